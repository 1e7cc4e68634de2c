"""Collective algorithms on clusters: textbook cases, algorithm choice, contention, speed."""

import math

import pytest
import yaml

from planner.mesh import group_ranks
from planner.spec import Plan, PlanError
from simulator.network.cluster import load_cluster
from simulator.network.collectives import (
    COLLECTIVES,
    busbw_factor,
    collective_cost,
    collective_time_s,
    concurrent_groups,
    ring_allreduce_time_s,
)
from simulator.network.placement import placement_report


def _file(tmp_path, **fabric):
    spec = {"kind": "gpu", "node_type": "dgx-h100", "nodes": 64,
            "fabric": {"topology": "rail-optimized", "switch_radix": 64, **fabric}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_ring_allreduce_is_textbook_on_a_uniform_ring():
    # One GPU per node on 16 nodes: every hop is the same NIC path (B = 50 GB/s, α = path).
    cluster = load_cluster("dgx-h100", nodes=16).ideal()
    group = range(0, 128, 8)
    alpha = cluster.link(0, 8).latency_s
    got = collective_time_s(cluster, "all_reduce", 2**30, group, algorithm="ring")
    assert got == pytest.approx(2 * 15 / 16 * 2**30 / 50e9 + 2 * 15 * alpha, rel=1e-12)
    assert got == pytest.approx(ring_allreduce_time_s(2**30, 16, 50e9, alpha), rel=1e-12)


def test_tree_latency_grows_with_log_n():
    # Zero-byte tree all-reduce across 2, 4, ..., 32 nodes: each doubling adds 2 network steps.
    cluster = load_cluster("dgx-h100", nodes=32).ideal()
    times = [collective_time_s(cluster, "all_reduce", 1e-9, range(0, 8 * n, 8),
                               algorithm="tree") for n in (2, 4, 8, 16, 32)]
    steps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert steps == pytest.approx([steps[0]] * 4, rel=1e-6) and steps[0] > 0
    ring = [collective_time_s(cluster, "all_reduce", 1e-9, range(0, 8 * n, 8),
                              algorithm="ring") for n in (2, 32)]
    assert times[-1] < ring[-1] and ring[-1] / ring[0] > 10


def test_nvlink_sharp_only_where_the_switch_reduces():
    h100, a100 = load_cluster("dgx-h100"), load_cluster("dgx-a100")
    assert collective_cost(h100, "all_reduce", 2**30, range(8)).algorithm == "nvls"
    assert collective_cost(a100, "all_reduce", 2**30, range(8)).algorithm == "ring"
    with pytest.raises(PlanError, match=r"algorithm='nvls' does not apply.*\['ring'\]"):
        collective_cost(a100, "all_reduce", 2**30, range(8), algorithm="nvls")


def test_protocol_is_chosen_per_size():
    cluster = load_cluster("dgx-a100")
    assert collective_cost(cluster, "all_reduce", 2**20, range(8)).protocol == "ll128"
    assert collective_cost(cluster, "all_reduce", 2**30, range(8)).protocol == "simple"


def test_across_nodes_tree_for_latency_ring_or_hierarchy_for_bandwidth():
    cluster = load_cluster("dgx-h100", nodes=64)
    assert collective_cost(cluster, "all_reduce", 2**16, range(512)).algorithm == "tree"
    small, big = (collective_cost(cluster, "all_reduce", s, range(512)) for s in (2**16, 2**32))
    assert big.busbw_Bps > 100 * small.busbw_Bps


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_every_collective_has_a_cost_and_nccl_busbw(kind):
    cluster = load_cluster("dgx-h100", nodes=2)
    devices = [0, 8] if kind == "send_recv" else range(16)
    cost = collective_cost(cluster, kind, 2**28, devices)
    assert cost.time_s > 0 and cost.algbw_Bps == pytest.approx(2**28 / cost.time_s)
    assert cost.busbw_Bps == pytest.approx(cost.algbw_Bps * busbw_factor(kind, len(devices)))


def test_send_recv_needs_two_devices():
    with pytest.raises(PlanError, match="send_recv needs exactly 2 devices"):
        collective_cost(load_cluster("dgx-h100"), "send_recv", 1e6, [0, 1, 2])


def test_groups_sharing_nics_split_their_bandwidth():
    # PCIe server: 8 GPUs share 2 NICs. tp=1 DP groups (one GPU per node) that all run at once
    # put 4 flows on every NIC; alone, a group has its NIC to itself.
    cluster = load_cluster("pcie-a100", nodes=4).ideal()
    group = range(0, 32, 8)
    assert len(concurrent_groups(cluster, group)) == 8
    shared = collective_time_s(cluster, "all_reduce", 2**30, group, algorithm="ring")
    alone = collective_time_s(cluster, "all_reduce", 2**30, group, concurrent=False,
                              algorithm="ring")
    assert shared / alone == pytest.approx(4.0, rel=1e-3)


def test_rail_groups_spread_over_all_nics_of_a_node():
    # 16 GPUs on 2 DGX A100: NCCL's channels spread the ring's node crossing over 8 NICs.
    cluster = load_cluster("dgx-a100", nodes=2).ideal()
    flat = collective_cost(cluster, "all_reduce", 2**30, range(16), algorithm="ring")
    assert flat.busbw_Bps == pytest.approx(8 * 25e9, rel=0.02)


def test_oversubscribed_uplinks_slow_only_groups_that_cross_the_spine(tmp_path):
    # 2:1 leaf oversubscription with ECMP over the spines: when every GPU of SU 0 pairs with
    # one in SU 1, all flows cross the spine and get half; pairs inside an SU are unaffected.
    # (A ring over 64 nodes crosses SUs on 2 edges only, so it barely loads the uplinks.)
    slow = load_cluster(_file(tmp_path, nodes_per_leaf=32, oversubscription=2.0)).ideal()
    fast = load_cluster("dgx-h100", nodes=64).ideal()
    ring = range(0, 512, 8)
    assert collective_time_s(slow, "all_reduce", 2**30, ring) == pytest.approx(
        collective_time_s(fast, "all_reduce", 2**30, ring), rel=1e-3)
    for group, ratio in ((range(0, 256, 128), 1.0), (range(0, 512, 256), 2.0)):
        t_slow = collective_time_s(slow, "all_reduce", 2**30, group, algorithm="ring")
        t_fast = collective_time_s(fast, "all_reduce", 2**30, group, algorithm="ring")
        assert t_slow / t_fast == pytest.approx(ratio, rel=0.02)


def test_all_to_all_across_nodes_is_bound_by_the_nics():
    cluster = load_cluster("dgx-h100", nodes=2)
    inside = collective_cost(cluster, "all_to_all", 2**30, range(8))
    across = collective_cost(cluster, "all_to_all", 2**30, range(16))
    assert across.busbw_Bps < inside.busbw_Bps / 3


def test_16384_gpu_dp_allreduce_costs():
    # Speed (first call and the cached second): benchmarks/simulator_bench.py.
    cluster = load_cluster("dgx-h100", nodes=2048)
    plan = Plan(tp=8, pp=1, dp=2048, micro_batch=1, global_batch=2048)
    first = collective_time_s(cluster, "all_reduce", 2**30, group_ranks(plan, "dp"))
    again = collective_time_s(cluster, "all_reduce", 2**31, group_ranks(plan, "dp"))
    # Twice the bytes: more time, less than twice (the latency part does not grow).
    assert math.isfinite(first) and first < again < 2 * first


def test_scaled_links_scale_the_library_costs_too():
    cluster = load_cluster("dgx-a100", nodes=2)
    free = cluster.scale_links(bandwidth=1e12, latency=0.0)
    assert collective_time_s(free, "all_reduce", 2**30, range(16)) < 1e-9


def test_placement_maps_ranks_and_reports_crossings():
    plan = Plan(tp=8, pp=2, dp=4, micro_batch=1, global_batch=4)
    assert list(group_ranks(plan, "tp")) == list(range(8))
    spread = plan.replace(placement=("dp", "tp", "pp"))
    assert list(group_ranks(spread, "tp"))[:3] == [0, 4, 8]
    cluster = load_cluster("dgx-h100", nodes=8)
    default = {g.axis: g for g in placement_report(plan, cluster)}
    assert default["tp"].crossing_node == 0 and default["dp"].crossing_node == 16
    other = {g.axis: g for g in placement_report(spread, cluster)}
    assert other["tp"].crossing_node == 8 and other["tp"].max_nodes == 4


def test_devices_outside_the_cluster_are_named():
    with pytest.raises(PlanError, match=r"devices 4..11 are outside \[0, 8\)"):
        collective_cost(load_cluster("dgx-h100"), "all_reduce", 1e6, range(4, 12))

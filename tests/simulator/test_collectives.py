"""Collective cost formulas and their placement on clusters."""

import pytest

from planner.mesh import group_ranks
from planner.spec import Plan
from simulator.network.cluster import load_cluster
from simulator.network.collectives import collective_time_s, ring_allreduce_time_s


def test_ring_allreduce_on_uniform_ring_by_hand():
    # By hand: 8 ranks, 1 GiB, 100 GB/s, 5 µs: 2·7/8·2^30/1e11 + 14·5e-6 = 0.018861... s.
    expected = 2 * 7 / 8 * 2**30 / 100e9 + 14 * 5e-6
    assert ring_allreduce_time_s(2**30, 8, 100e9, 5e-6) == pytest.approx(expected, rel=1e-12)


def test_intra_node_allreduce_uses_nvswitch_bandwidth():
    # DGX H100: 8 GPUs on NVSwitch at 450 GB/s per direction (datasheet), 1 µs per ring step.
    cluster = load_cluster("dgx-h100", nodes=1).ideal()
    got = collective_time_s(cluster, "all_reduce", 1e9, list(range(8)), algorithm="ring")
    assert got == pytest.approx(2 * 7 / 8 * 1e9 / 450e9 + 14 * 1e-6, rel=1e-9)


def test_one_gpu_per_node_ring_uses_nic_bandwidth():
    # DP group of tp8 plans: one GPU per node, ring over 50 GB/s NDR NICs (datasheet).
    cluster = load_cluster("dgx-h100", nodes=4).ideal()
    plan = Plan(tp=8, pp=1, dp=4, micro_batch=1, global_batch=4)
    group = group_ranks(plan, "dp")
    assert list(group) == [0, 8, 16, 24]
    got = collective_time_s(cluster, "all_reduce", 1e9, group, algorithm="ring")
    link = cluster.link(0, 8)
    assert link.bandwidth_Bps == 50e9
    assert got == pytest.approx(ring_allreduce_time_s(1e9, 4, 50e9, link.latency_s), rel=1e-9)


def test_hierarchical_allreduce_beats_flat_nic_ring():
    # 2 nodes x 8 GPUs: NCCL-style hierarchy moves only 1/8 of the buffer over each NIC.
    cluster = load_cluster("dgx-a100", nodes=2)
    hier = collective_time_s(cluster, "all_reduce", 1e9, list(range(16)))
    flat_over_nics = ring_allreduce_time_s(1e9, 16, 25e9, 0.0)
    assert hier < flat_over_nics


def test_unknown_collective_kind_is_rejected():
    cluster = load_cluster("dgx-a100")
    with pytest.raises(ValueError, match="kind='gossip' is not one of"):
        collective_time_s(cluster, "gossip", 1.0, [0, 1])


def test_oversubscribed_spine_slows_cross_leaf_rings_only(tmp_path):
    import yaml

    from simulator.network.cluster import PRESET_DIR
    spec = yaml.safe_load((PRESET_DIR / "clusters.yaml").read_text())["dgx-h100"]
    spec["fabric"]["oversubscription"] = 2.0
    path = tmp_path / "h100-2to1.yaml"
    path.write_text(yaml.safe_dump(spec))
    blocking = load_cluster(str(path), nodes=64).ideal()
    full = load_cluster("dgx-h100", nodes=64).ideal()
    in_leaf, across = [0, 8, 16, 24], [0, 8 * 32]
    for group, ratio in ((in_leaf, 1.0), (across, 2.0)):
        slow = collective_time_s(blocking, "all_reduce", 1e9, group)
        fast = collective_time_s(full, "all_reduce", 1e9, group)
        assert slow / fast == pytest.approx(ratio, rel=1e-3)

"""Node types, fabrics and user cluster files: what they build and how bad input is told."""

import math

import networkx as nx
import pytest
import yaml

from planner.spec import PlanError
from simulator.network.cluster import load_cluster, node_type_names
from simulator.network.hardware import load_device
from simulator.network.topology import bisection_bandwidth_Bps, draw_png, summary


def _write(tmp_path, spec: dict, name: str = "mine"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


USER = {"kind": "gpu", "node_type": "dgx-h100", "nodes": 64,
        "nic": {"per_node": 8, "speed_Gbps": 400},
        "fabric": {"topology": "fat-tree", "switch_radix": 64, "oversubscription": 3.0}}


def test_datasheet_numbers_of_new_devices():
    # H200 datasheet: 141 GB HBM3e at 4.8 TB/s, same FLOP/s as H100 SXM; DGX B200: 8 TB/s.
    h200, h100 = load_device("h200-sxm-141gb"), load_device("h100-sxm-80gb")
    assert (h200.memory_bytes, h200.memory_bandwidth_Bps) == (141e9, 4.8e12)
    assert h200.peak_flops == h100.peak_flops and h200.peak("fp8") == 1979e12
    assert load_device("a100-sxm-40gb").memory_bandwidth_Bps == 1.555e12
    assert load_device("b200-sxm-180gb").peak("bf16") == 2.25e15
    assert load_device("a100-pcie-80gb").nvlink_bandwidth_Bps is None


@pytest.mark.parametrize("node_type", node_type_names())
def test_every_node_type_builds_two_nodes(tmp_path, node_type):
    # A fat-tree leaf takes all NICs of a node: an NVL72 rack's 72 NICs need radix >= 144.
    spec = {"kind": "gpu", "node_type": node_type, "nodes": 2,
            "fabric": {"switch_radix": 144 if node_type.endswith("nvl72") else 64}}
    cluster = load_cluster(_write(tmp_path, spec))
    dpn = cluster.devices_per_node
    assert cluster.num_devices == 2 * dpn and nx.is_connected(cluster.graph)
    assert cluster.link(0, dpn).hops >= 4


def test_user_file_fields_are_applied(tmp_path):
    cluster = load_cluster(_write(tmp_path, USER))
    assert cluster.nic_bandwidth_Bps == 50e9 and cluster.topology == "fat-tree"
    # radix 64 at 3:1: 48 ports down = 6 nodes of 8 NICs per leaf, 16 up.
    assert cluster.nodes_per_leaf == 6 and cluster.tiers == 2
    assert cluster.leaf_uplink_Bps == pytest.approx(6 * 8 * 50e9 / 3)
    assert load_cluster(_write(tmp_path, USER), nodes=4).num_nodes == 4


def test_roce_costs_more_latency_than_infiniband():
    ib, roce = load_cluster("dgx-h100", nodes=64), load_cluster("dgx-h100-roce", nodes=64)
    assert roce.link(0, 8 * 40).latency_s > ib.link(0, 8 * 40).latency_s
    assert roce.link(0, 8).bandwidth_Bps == ib.link(0, 8).bandwidth_Bps


def test_three_tiers_for_16384_gpus():
    # Build speed: benchmarks/simulator_bench.py.
    cluster = load_cluster("dgx-h100", nodes=2048)
    assert cluster.tiers == 3 and summary(cluster)["switches"]["core"] > 0
    # GPU -> NIC -> leaf -> spine -> core -> spine -> leaf -> NIC -> GPU
    assert cluster.link(0, 16383 - 7).hops == 8


@pytest.mark.parametrize("name,nodes", [("dgx-h100", 4), ("pcie-a100", 2)])
def test_bisection_matches_networkx_max_flow(tmp_path, name, nodes):
    # The closed form equals the max flow from the first half of the GPUs to the second.
    spec = {"kind": "gpu", "node_type": "dgx-h100", "nodes": nodes,
            "fabric": {"topology": "rail-optimized", "switch_radix": 64, "nodes_per_leaf": 2,
                       "oversubscription": 2.0}}
    cluster = load_cluster(_write(tmp_path, spec)) if name == "dgx-h100" \
        else load_cluster(name, nodes=nodes)
    g = nx.DiGraph()
    for a, b, d in cluster.graph.edges(data=True):
        g.add_edge(a, b, capacity=d["bandwidth_Bps"])
        g.add_edge(b, a, capacity=d["bandwidth_Bps"])
    half = cluster.num_nodes // 2
    for v in cluster.graph:
        if v[0] == "gpu":
            g.add_edge("S", v, capacity=math.inf) if v[1] < half else \
                g.add_edge(v, "T", capacity=math.inf)
    assert bisection_bandwidth_Bps(cluster) == pytest.approx(
        nx.maximum_flow_value(g, "S", "T"))


def test_png_is_drawn(tmp_path):
    path = draw_png(load_cluster("dgx-h100", nodes=64), str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 10_000 and path.endswith(".png")


@pytest.mark.parametrize("drop,match", [
    ("node_type", r"missing field node_type"),
    ("fabric.switch_radix", r"missing field fabric.switch_radix"),
])
def test_missing_field_is_named(tmp_path, drop, match):
    spec = yaml.safe_load(yaml.safe_dump(USER))
    section, _, key = drop.rpartition(".")
    del (spec[section] if section else spec)[key]
    with pytest.raises(PlanError, match=match):
        load_cluster(_write(tmp_path, spec))


@pytest.mark.parametrize("value", [0, -25.0e9, "fast"])
def test_bad_bandwidth_is_named(tmp_path, value):
    spec = {**USER, "nic": {"bandwidth_Bps": value}}
    with pytest.raises(PlanError, match=rf"nic.bandwidth_Bps={value!r} must be a number > 0"):
        load_cluster(_write(tmp_path, spec))


@pytest.mark.parametrize("patch,match", [
    ({"node_type": "dgx-z9"}, r"node_type='dgx-z9' is not one of \['dgx-a100', 'dgx-b200'"),
    ({"nic": {"transport": "ethernet"}}, r"nic.transport='ethernet' is not one of "
                                         r"\['infiniband', 'roce'\]"),
    ({"fabric": {"topology": "torus", "switch_radix": 64}},
     r"fabric.topology='torus' is not one of \['rail-optimized', 'fat-tree'\]"),
    ({"fabric": {"switch_radix": 64, "tiers": 1}}, r"fabric.tiers=1 allows one leaf per rail"),
    ({"fabric": {"switch_radix": 64, "oversubscription": 0.5}}, r"oversubscription=0.5 must "
                                                                r"be >= 1"),
    ({"intra": {"bandwidth_Bps": -1.0}}, r"intra.bandwidth_Bps=-1.0 must be a number > 0"),
])
def test_bad_values_name_the_allowed_ones(tmp_path, patch, match):
    with pytest.raises(PlanError, match=match):
        load_cluster(_write(tmp_path, {**USER, **patch}))


def test_bad_yaml_is_a_plan_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("kind: gpu\nnode_type: [dgx-h100\n")
    with pytest.raises(PlanError, match="is not valid YAML"):
        load_cluster(str(path))


@pytest.mark.parametrize("module", ["simulator.network.fabric", "simulator.network.topology",
                                    "simulator.network.placement", "simulator.network.collectives",
                                    "apps.cmd_topo"])
def test_doctest_examples_pass(module):
    import doctest
    import importlib
    assert doctest.testmod(importlib.import_module(module)).failed == 0


@pytest.mark.parametrize("fabric, match", [
    # fat-tree: a leaf takes all 8 NICs of each DGX H200: 16 x 8 = 128 ports on 64; with
    # uplinks (16 nodes need more than one leaf) at most 7 nodes: 7 x 8 = 56 down + 8 up
    ({"topology": "fat-tree", "switch_radix": 64, "nodes_per_leaf": 16},
     r"fabric.nodes_per_leaf=16 x 8 NIC port\(s\) per node = 128 downlinks per leaf, more "
     r"than fabric.switch_radix=64 \(a fat-tree leaf takes all 8 NICs of each node\); use "
     r"nodes_per_leaf <= 7"),
    # rail-optimised: a leaf takes one NIC of each of its nodes: 16 ports on 8
    ({"topology": "rail-optimized", "switch_radix": 8, "nodes_per_leaf": 16},
     r"nodes_per_leaf=16 x 1 NIC port\(s\) per node = 16 downlinks per leaf, more than "
     r"fabric.switch_radix=8"),
    # 8 x 8 = 64 ports down fill the leaf, and two leaves need at least one spine uplink
    ({"topology": "fat-tree", "switch_radix": 64, "nodes_per_leaf": 8},
     r"a leaf has 64 downlinks .* and one uplink to each of 1 spine\(s\): 65 ports, more than "
     r"fabric.switch_radix=64; use nodes_per_leaf <= 7"),
])
def test_a_leaf_with_more_ports_than_its_switch_is_refused(tmp_path, fabric, match):
    spec = {"kind": "gpu", "node_type": "dgx-h200", "nodes": 16, "fabric": fabric}
    with pytest.raises(PlanError, match=match):
        load_cluster(_write(tmp_path, spec))


def test_a_leaf_that_fits_its_switch_builds():
    # 7 fat-tree nodes a leaf: 56 ports down, 8 up to 8 spines = 64 (the largest that fits)
    from simulator.network.cluster import cluster_from_spec
    spec = {"kind": "gpu", "node_type": "dgx-h200", "nodes": 16,
            "fabric": {"topology": "fat-tree", "switch_radix": 64, "nodes_per_leaf": 7}}
    cluster = cluster_from_spec("mine", spec)
    assert cluster.nodes_per_leaf == 7 and cluster.tiers == 2


@pytest.mark.parametrize("speed, hint", [
    # a quoted number: PyYAML would read 400 unquoted, so the fix is to drop the quotes
    ('"400"', '(unquote it: write 400, not "400")'),
    # no dot: PyYAML reads 400e9 as a string, and 4e11 Gb/s is 400 Gb/s in bits/s
    ("400e9", "(400e9 is read by YAML as a string, and as a number beyond any real hardware, "
              "at most 16000 Gb/s; 4e+11 looks like bits/s: speed_Gbps is in Gb/s, e.g. 400)"),
])
def test_a_nic_speed_written_as_a_string_gets_the_right_fix(tmp_path, speed, hint):
    path = tmp_path / "mine.yaml"
    path.write_text(f"kind: gpu\nnode_type: dgx-h100\nnic: {{speed_Gbps: {speed}}}\n"
                    f"fabric: {{switch_radix: 64}}\n")
    with pytest.raises(PlanError) as exc:
        load_cluster(str(path))
    value = speed.strip('"')
    assert str(exc.value) == f"nic.speed_Gbps='{value}' must be a number > 0 for cluster " \
                             f"'mine' {hint}"


def test_a_nic_speed_in_bits_per_second_says_the_unit(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("kind: gpu\nnode_type: dgx-h100\nnic: {speed_Gbps: 4.0e+11}\n"
                    "fabric: {switch_radix: 64}\n")
    with pytest.raises(PlanError) as exc:
        load_cluster(str(path))
    assert str(exc.value) == ("nic.speed_Gbps=400000000000.0 for cluster 'mine' is beyond any "
                              "real hardware (at most 16000 Gb/s); 4e+11 looks like bits/s: "
                              "speed_Gbps is in Gb/s, e.g. 400")


# 16 DGX H100 nodes on a 2:1 fat tree of 64-port switches, 4 nodes of 2 x 400 Gb/s RoCE NICs
# a leaf: 8 downlinks, whose 1,600 Gb/s at 2:1 leave 4 full-rate uplinks (4 spines).
SPINE_EXAMPLE = {"kind": "gpu", "node_type": "dgx-h100", "nodes": 16,
                 "nic": {"per_node": 2, "speed_Gbps": 400, "transport": "roce"},
                 "fabric": {"topology": "fat-tree", "switch_radix": 64,
                            "oversubscription": 2.0, "nodes_per_leaf": 4}}


def _spine_links(cluster) -> set:
    return {d["bandwidth_Bps"] for a, b, d in cluster.graph.edges(data=True)
            if {a[0], b[0]} == {"leaf", "spine"}}


def test_a_fixed_nodes_per_leaf_gets_spines_from_the_oversubscription():
    from simulator.network.cluster import cluster_from_spec
    cluster = cluster_from_spec("mine", SPINE_EXAMPLE)
    assert cluster.spines == 4 and cluster.leaf_uplink_Bps == 8 * 50e9 / 2
    assert _spine_links(cluster) == {50e9}           # each uplink at the NIC rate


@pytest.mark.parametrize("name, nodes, spines", [
    # GB200 NVL72: 8 racks a rail leaf, 1:1: 8 uplinks, 8 spines (16 racks: 2 SUs x 72 rails)
    ("gb200-nvl72", 16, 8), ("gb300-nvl72", 16, 8),
    # radix-sized leaves keep every free port: 32 down + 32 up (64), 20 + 20 (40)
    ("dgx-h100", 64, 32), ("dgx-b200", 64, 32), ("dgx-a100", 64, 20),
    # pcie-a100: 13 nodes x 2 HDR = 26 down at 2:1 = 13 NICs' worth, 13 of the 14 free ports
    ("pcie-a100", 64, 13),
])
def test_preset_spines_are_the_uplink_total_in_nic_ports(name, nodes, spines):
    cluster = load_cluster(name, nodes=nodes)
    assert cluster.spines == spines and _spine_links(cluster) == {cluster.nic_bandwidth_Bps}
    far = (nodes - 1) * cluster.devices_per_node     # another leaf (another pod at 3 tiers)
    assert cluster.link(0, far).bandwidth_Bps == cluster.nic_bandwidth_Bps


def test_a_send_across_leaves_runs_at_the_nic_rate():
    from simulator.network.cluster import cluster_from_spec
    from simulator.network.collectives import boundary_send_time_s, p2p_time_on_cluster_s
    cluster = cluster_from_spec("mine", SPINE_EXAMPLE)
    size = 64 * 2 ** 20
    # GPU 0 of node 0 -> GPU 0 of node 4 (next leaf): GPU-NIC, NIC-leaf, leaf-spine,
    # spine-leaf, leaf-NIC, NIC-GPU: 2 RoCE NIC latencies of 1.5 us + 4 switch hops of 0.6 us;
    # 67,108,864 B at 50 GB/s = 1.34217728 ms, + 5.4 us = 1.34757728 ms.
    assert p2p_time_on_cluster_s(cluster, size, 0, 4 * 8) == pytest.approx(1.34757728e-3)
    # a pipeline boundary of 4-node stages: GPUs 0-3 of node 0 share NIC 0 and send at once
    assert boundary_send_time_s(cluster, size, 0, 4 * 8, pp_stride=32, pp=4) == \
        pytest.approx(4 * size / 50e9 + 5.4e-6)


def test_collectives_do_not_depend_on_the_spine_count():
    # Collectives price the leaf's total uplink, which the spine count only divides.
    from simulator.network.cluster import cluster_from_spec
    from simulator.network.collectives import collective_time_s
    many = {**SPINE_EXAMPLE, "fabric": {**SPINE_EXAMPLE["fabric"], "spines": 56}}
    few, wide = cluster_from_spec("mine", SPINE_EXAMPLE), cluster_from_spec("mine", many)
    assert (few.spines, wide.spines) == (4, 56)
    assert few.leaf_uplink_Bps == wide.leaf_uplink_Bps
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for devices in (range(few.num_devices), range(0, few.num_devices, 8)):
            assert collective_time_s(few, kind, 1e9, list(devices)) == \
                collective_time_s(wide, kind, 1e9, list(devices))

"""Cluster presets, topology and load errors."""

import os
import re

import pytest

from planner.spec import PlanError
from simulator.network.cluster import cluster_names, load_cluster
from simulator.network.hardware import load_device


def test_presets_are_listed():
    assert {"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "pcie-a100",
            "localhost-cpu"} <= set(cluster_names())


def test_dgx_a100_matches_datasheet():
    # DGX A100 datasheet: 8x A100 80GB, NVLink 300 GB/s per direction, 8x 200 Gb/s HDR.
    cluster = load_cluster("dgx-a100", nodes=2)
    assert cluster.num_devices == 16 and cluster.default_dtype == "bf16"
    assert cluster.device.peak("bf16") == 312e12
    assert cluster.link(0, 1).bandwidth_Bps == 300e9
    assert cluster.link(0, 8).bandwidth_Bps == 25e9
    assert cluster.link(0, 8).latency_s > cluster.link(0, 1).latency_s


def test_every_edge_has_bandwidth_and_latency():
    graph = load_cluster("dgx-h100", nodes=40).graph
    assert all("bandwidth_Bps" in d and "latency_s" in d for _, _, d in graph.edges(data=True))


def test_cross_leaf_path_goes_through_a_spine():
    # 32 nodes per leaf: node 0 and node 32 are on different leaves.
    cluster = load_cluster("dgx-h100", nodes=64)
    assert cluster.link(0, 32 * 8).hops == 6 and cluster.link(0, 8).hops == 4


def test_16384_gpu_cluster_builds_and_queries():
    # Speed: benchmarks/simulator_bench.py.
    cluster = load_cluster("dgx-h100", nodes=2048)
    assert cluster.link(0, 16383).hops > cluster.link(0, 8).hops
    assert cluster.num_devices == 16384


def test_device_peak_names_missing_dtype():
    with pytest.raises(PlanError, match=r"dtype='fp8'.*\['bf16', 'fp16', 'fp32', 'tf32'\]"):
        load_device("a100-sxm-80gb").peak("fp8")


def test_unknown_cluster_names_the_choices():
    with pytest.raises(PlanError, match=r"cluster='dgx-x900' is neither a preset .*\(\['dgx-a100'"):
        load_cluster("dgx-x900")
    # a preset name with the wrong case or separator gets the preset it means
    with pytest.raises(PlanError, match=r"neither a preset \(did you mean 'dgx-h100'\?\)"):
        load_cluster("DGX_H100")


@pytest.mark.parametrize("nodes", [0, -2, 1.5, True])
def test_bad_node_count_is_rejected(nodes):
    with pytest.raises(PlanError, match=rf"nodes={nodes!r} must be a positive integer"):
        load_cluster("dgx-h100", nodes=nodes)


def test_ranks_is_only_for_localhost():
    with pytest.raises(PlanError, match="ranks=4 applies only to localhost-cpu"):
        load_cluster("dgx-h100", ranks=4)
    with pytest.raises(PlanError, match="nodes=2 is not allowed for 'localhost-cpu'"):
        load_cluster("localhost-cpu", nodes=2)
    with pytest.raises(PlanError, match="ranks=0 must be a positive integer"):
        load_cluster("localhost-cpu", ranks=0)


def test_localhost_ranks_share_cores():
    cores = os.cpu_count()
    cluster = load_cluster("localhost-cpu", ranks=2 * cores)
    assert cluster.num_devices == 2 * cores and cluster.default_dtype == "fp32"
    assert cluster.compute_share == pytest.approx(0.5)
    # Oversubscribed ranks pay more per ring step than ranks <= cores (measured gloo numbers).
    assert cluster.collective_latency_s > load_cluster("localhost-cpu", ranks=1)\
        .collective_latency_s


def test_cluster_from_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("kind: tpu\n")
    with pytest.raises(PlanError, match=r"kind='tpu'; use one of \['gpu', 'localhost'\]"):
        load_cluster(str(path))


def test_scale_links_scales_every_edge():
    cluster = load_cluster("dgx-a100", nodes=2)
    fast = cluster.scale_links(bandwidth=10.0)
    assert fast.link(0, 8).bandwidth_Bps == 250e9
    assert cluster.link(0, 8).bandwidth_Bps == 25e9


@pytest.mark.parametrize("nic, message", [
    ({"speed_Gbps": 400, "bandwidth_Bps": 25.0e9},
     "nic.speed_Gbps=400 and nic.bandwidth_Bps=25000000000.0 both give the NIC speed; keep one"),
    # GPU i uses NIC i*per_node//8: NICs 1, 3, 5... would carry nothing
    ({"per_node": 16}, "nic.per_node=16 is more than the 8 GPUs per node"),
])
def test_nic_fields_that_contradict_each_other_or_the_model_are_refused(nic, message):
    from simulator.network.cluster import cluster_from_spec
    with pytest.raises(PlanError, match=re.escape(message)):
        cluster_from_spec("c", {"kind": "gpu", "node_type": "dgx-h100", "nodes": 2,
                                "nic": nic, "fabric": {"switch_radix": 64}})


def test_a_cluster_default_dtype_is_one_of_the_dtype_choices():
    # one accepted set, planner.spec.Dtype, for the cluster file and for --dtype
    from apps.cli import build_parser
    from simulator.network.cluster import cluster_from_spec
    spec = {"kind": "gpu", "node_type": "dgx-h100", "fabric": {"switch_radix": 64}}
    with pytest.raises(PlanError, match=re.escape(
            "cluster 'c': default_dtype='bf17' is not one of fp32, tf32, bf16, fp16, fp8, "
            "fp8-current, mxfp8, nvfp4 (did you mean 'bf16'?) (the --dtype choices)")):
        cluster_from_spec("c", {**spec, "default_dtype": "bf17"})
    assert cluster_from_spec("c", {**spec, "default_dtype": "fp16"}).default_dtype == "fp16"
    dtype_flag = next(a for a in build_parser()._subparsers._group_actions[0].choices["plan"]
                      ._actions if "--dtype" in a.option_strings)
    # the same set, written out by hand, plus the search's "any"
    assert tuple(dtype_flag.choices) == ("fp32", "tf32", "bf16", "fp16", "fp8", "fp8-current",
                                         "mxfp8", "nvfp4", "any")


def test_the_default_global_batch_follows_the_cluster_kind_not_its_dtype():
    # 8 sequences on the CPU test bed; ~4M tokens (512 x 8192) on GPUs, fp32 or not
    from apps.cmd_plan import default_global_batch
    from simulator.network.cluster import cluster_from_spec
    gpu32 = cluster_from_spec("c", {"kind": "gpu", "node_type": "dgx-h100", "default_dtype":
                                    "fp32", "fabric": {"switch_radix": 64}})
    assert default_global_batch(gpu32, 8192) == 512
    assert default_global_batch(load_cluster("localhost-cpu"), 8192) == 8

"""Blackwell devices and NVL72 racks as data: datasheet numbers and the NVLink domain."""

import pytest
import yaml

from planner.spec import PlanError
from simulator.network.cluster import load_cluster
from simulator.network.hardware import load_device


def test_gb200_peaks_are_the_rack_datasheet_divided_by_72():
    # GB200 NVL72 datasheet: 360 PF BF16, 720 PF FP8, 1,440 PF FP4 per rack, all with 2:4
    # sparsity; dense = half; 72 GPUs -> 2.5, 5 and 10 PF per GPU.
    d = load_device("gb200")
    assert d.peak("bf16") == pytest.approx(360e15 / 2 / 72)
    assert d.peak("fp8") == pytest.approx(720e15 / 2 / 72)
    assert d.peak("nvfp4") == pytest.approx(1440e15 / 2 / 72)
    # 576 TB/s of HBM3e per rack -> 8 TB/s per GPU; NVLink 130 TB/s -> ~1.8 TB/s bidirectional.
    assert d.memory_bandwidth_Bps == pytest.approx(576e12 / 72)
    assert d.nvlink_bandwidth_Bps == pytest.approx(900e9)


def test_b300_nvfp4_is_one_and_a_half_times_b200():
    # HGX B300: 108 PF dense FP4 per 8 GPUs; HGX B200: 72 PF dense FP4 per 8 GPUs.
    assert load_device("b300-sxm-288gb").peak("nvfp4") == pytest.approx(108e15 / 8)
    assert load_device("b200-sxm-180gb").peak("nvfp4") == pytest.approx(72e15 / 8)
    assert load_device("b300-sxm-288gb").memory_bytes == pytest.approx(288e9)


def test_hopper_has_no_block_scaled_peaks():
    # Block-scaled MX / NVFP4 tensor-core instructions are new in Blackwell (5th-gen tensor core).
    for name in ("h100-sxm-80gb", "h200-sxm-141gb"):
        with pytest.raises(PlanError, match="no peak FLOP/s for dtype='nvfp4'"):
            load_device(name).peak("nvfp4")


def test_nvl72_rack_is_one_nvlink_domain_of_18_trays_of_4():
    c = load_cluster("gb200-nvl72", nodes=8)
    assert c.nvlink_domain_size == 72
    assert c.compute_trays == 18
    assert c.num_devices == 8 * 72
    # One ConnectX NIC per GPU: 4 per tray x 18 trays.
    assert c.nics_per_node == 72
    # GPUs 0 and 71 share the rack's NVLink switches; GPU 72 is the next rack.
    assert c.node_of(71) == c.node_of(0) != c.node_of(72)


def test_dgx_domain_is_8_and_pcie_has_none():
    assert load_cluster("dgx-b300").nvlink_domain_size == 8
    assert load_cluster("pcie-a100").nvlink_domain_size == 1


def test_cluster_file_states_its_nvlink_domain(tmp_path):
    path = tmp_path / "nvl36.yaml"
    path.write_text(yaml.safe_dump({"kind": "gpu", "node_type": "gb200-nvl72",
                                    "nvlink_domain_size": 36, "nic": {"per_node": 36},
                                    "fabric": {"topology": "rail-optimized",
                                               "switch_radix": 64}}))
    c = load_cluster(str(path), nodes=2)
    assert c.nvlink_domain_size == 36 and c.num_devices == 72


def test_nvlink_domain_disagreeing_with_devices_per_node_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"kind": "gpu", "node_type": "gb200-nvl72",
                                    "nvlink_domain_size": 36, "devices_per_node": 72,
                                    "fabric": {"topology": "rail-optimized",
                                               "switch_radix": 64}}))
    with pytest.raises(PlanError, match="nvlink_domain_size=36 != devices_per_node=72"):
        load_cluster(str(path))

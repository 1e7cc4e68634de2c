"""Bad flag values are named by the flag the user typed, with a fix, exit 2: never by the
library keyword behind it (num_devices, nic_Gbps, gpus), and a value with a leading '-'
reaches the check that says it must be > 0 instead of argparse's "expected one argument"."""

from __future__ import annotations

import pytest

from apps.cli import main


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--devices", "0"],
     "error: --devices=0 must be >= 1 (e.g. --devices 8)"),
    # localhost-cpu has 4 ranks by default
    (["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--max-devices", "9"],
     "error: --max-devices=9 is more than the cluster's 4 devices; give at most 4"),
    (["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "8", "--devices",
      "64", "--max-devices", "64"],
     "error: --devices 64 and --max-devices 64: give one"),
    (["sweep", "--model", "llama3-8b", "--tokens", "1T", "--gpus", "64", "--nic-gbps", "0"],
     "error: --nic-gbps=0 must be > 0: the line rate of one NIC in Gb/s (e.g. 400)"),
    # 100 GPUs are 12.5 DGX H100 nodes; the nearest multiple of 8 is 96 (12 nodes)
    (["sweep", "--model", "llama3-8b", "--tokens", "1T", "--gpus", "100"],
     "error: --gpus=100 is not a whole number of dgx-h100 nodes of 8 GPUs; use a positive "
     "multiple of 8 (e.g. 96)"),
    (["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--fix", "tp=abc"],
     "error: --fix tp='abc': tp takes integers, e.g. --fix tp=2 or --fix tp=2,4"),
    (["sweep", "--model", "llama3-8b", "--tokens", "-5T", "--gpus", "64"],
     "error: --tokens='-5T' must be a positive token count"),
    (["collective", "all_reduce", "--cluster", "dgx-h100", "--sizes", "-1M"],
     "error: --sizes '-1M' is not a positive size like 1M"),
])
def test_the_flag_is_named(capsys, argv, message):
    assert main(argv) == 2
    assert message in _err(capsys)


def test_a_negative_nic_speed_gets_no_yaml_notation_hint(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kind: gpu\nnode_type: dgx-b200\nnodes: 2\nnic: {per_node: 8, "
                    "speed_Gbps: -200}\nfabric: {switch_radix: 64}\n")
    assert main(["topo", str(path)]) == 2
    err = _err(capsys)
    assert "nic.speed_Gbps=-200 must be a number > 0 for cluster 'c'" in err
    assert "in YAML" not in err


def test_a_yaml_string_number_gets_the_notation_hint(tmp_path):
    # YAML 1.1 (PyYAML) reads 25e9 without a dot as the string '25e9'
    from planner.spec import PlanError
    from simulator.network.fabric import check_positive
    with pytest.raises(PlanError) as exc:
        check_positive("nic.bandwidth_Bps", "25e9", "c")
    # the same digits with a dot and a signed exponent: the float PyYAML reads
    assert str(exc.value).endswith("(YAML reads 25e9 as a string: write 25.0e+9)")

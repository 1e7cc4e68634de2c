"""`meshplan topo` and `meshplan collective`: tables, JSON, PNG, placement, bad input."""

import json

import pytest
import yaml

from apps.cli import main
from apps.cmd_topo import parse_op, parse_size
from planner.planfile import ClusterRef, PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan, PlanError


def test_collective_json_has_nccl_tests_rows(capsys):
    assert main(["collective", "allreduce", "--cluster", "dgx-a100", "--sizes", "1M,64M,1G",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["size_bytes"] for r in rows] == [2**20, 64 * 2**20, 2**30]
    for r in rows:
        assert {"size_bytes", "time_s", "algbw_Bps", "busbw_Bps", "algorithm"} <= set(r)
        assert r["algbw_Bps"] == pytest.approx(r["size_bytes"] / r["time_s"])
        assert r["busbw_Bps"] == pytest.approx(r["algbw_Bps"] * 2 * 7 / 8)


def test_collective_table_and_ranks(capsys):
    assert main(["collective", "all_gather", "--cluster", "dgx-h100", "--nodes", "2",
                 "--ranks", "16", "--sizes", "256M"]) == 0
    out = capsys.readouterr().out
    assert "busbw GB/s" in out and "256M" in out


def test_topo_summary_png_and_placement(tmp_path, capsys):
    plan = Plan(tp=8, pp=2, dp=4, micro_batch=1, global_batch=8)
    path = write_plan_file(tmp_path / "p.yaml", PlanFile(
        model=load_model("llama3-8b"), plan=plan, cluster=ClusterRef(name="dgx-h100", nodes=8)))
    png = tmp_path / "t.png"
    assert main(["topo", "dgx-h100", "--nodes", "8", "--png", str(png), "--plan", str(path),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["devices"] == 64 and out["cluster"]["links"] > 0
    assert out["cluster"]["bisection_bandwidth_Bps"] == 4 * 8 * 50e9
    groups = {g["axis"]: g for g in out["placement"]["groups"]}
    assert groups["tp"]["crossing_node"] == 0 and groups["pp"]["crossing_node"] == 32
    assert png.stat().st_size > 10_000
    assert main(["topo", "dgx-h100", "--nodes", "8", "--plan", str(path)]) == 0
    text = capsys.readouterr().out
    assert "bisection" in text and "cross nodes" in text


@pytest.mark.parametrize("argv,match", [
    (["collective", "gossip", "--cluster", "dgx-a100"], "collective 'gossip' is not one of"),
    (["collective", "allreduce", "--cluster", "dgx-a100", "--sizes=0M"], "--sizes '0M'"),
    (["collective", "allreduce", "--cluster", "dgx-a100", "--ranks", "9"], r"ranks=9 must be"),
    (["topo", "dgx-z9"], "neither a preset"),
])
def test_bad_input_exits_2_with_one_line(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match.split("(")[0].split("\\")[0] in err and "Traceback" not in err


def test_bad_cluster_file_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"kind": "gpu", "node_type": "dgx-h100",
                                    "nic": {"bandwidth_Bps": 0}, "fabric": {"switch_radix": 64}}))
    assert main(["topo", str(path)]) == 2
    assert "nic.bandwidth_Bps=0" in capsys.readouterr().err


def test_sizes_and_ops_parse_like_nccl_tests():
    assert parse_size("64M") == 64 * 2**20 and parse_size("2KiB") == 2048
    assert parse_op("reducescatter") == "reduce_scatter" and parse_op("sendrecv") == "send_recv"
    with pytest.raises(PlanError):
        parse_size("lots")


def test_collective_csv_has_the_json_rows(tmp_path, capsys):
    # The CSV holds the same rows as --json (SI units), one line per size.
    import json

    import pandas as pd

    from apps.cli import main
    path = tmp_path / "rows.csv"
    assert main(["collective", "all_reduce", "--cluster", "dgx-h100", "--ranks", "8",
                 "--sizes", "1M,64M", "--json", "--csv", str(path)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    table = pd.read_csv(path)
    assert list(table["size_bytes"]) == [r["size_bytes"] for r in rows] == [2**20, 64 * 2**20]
    assert list(table["busbw_Bps"]) == pytest.approx([r["busbw_Bps"] for r in rows])


def test_topo_checks_the_plan_fits_the_cluster_and_notes_another_cluster(tmp_path, capsys):
    # tp8 x pp2 x dp4 = 64 devices: 8 DGX nodes of 8 GPUs
    plan = Plan(tp=8, pp=2, dp=4, micro_batch=1, global_batch=8)
    path = write_plan_file(tmp_path / "p.yaml", PlanFile(
        model=load_model("llama3-8b"), plan=plan, cluster=ClusterRef(name="dgx-h100", nodes=8)))
    assert main(["topo", "dgx-h100", "--nodes", "4", "--plan", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "runs on 64 devices, cluster 'dgx-h100' has 32" in err and "--nodes 8" in err
    assert main(["topo", "dgx-a100", "--nodes", "8", "--plan", str(path), "--json"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "was made for cluster 'dgx-h100'; its placement is shown on 'dgx-a100'" in err

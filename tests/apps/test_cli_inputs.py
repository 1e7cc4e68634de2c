"""Bad input reaches the user as one line naming the field, the value and a fix (exit 2), and
machine-readable output stays valid JSON."""

import json
import subprocess
import sys

import pytest

from apps.compare import summarize_rows, summary_line


def _meshplan(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "apps.cli", *args], capture_output=True,
                          text=True, timeout=300)
    proc.stderr = " ".join(proc.stderr.split())       # the console wraps long lines
    return proc


@pytest.mark.parametrize("content, kind", [("", "empty"), ("[1, 2]\n", "a YAML list"),
                                           ("42\n", "a YAML int")])
def test_a_model_file_that_is_not_a_mapping_is_named(tmp_path, content, kind):
    path = tmp_path / "model.yaml"
    path.write_text(content)
    proc = _meshplan("plan", "--model", str(path), "--cluster", "dgx-h100", "--nodes", "1")
    assert proc.returncode == 2, proc.stderr
    assert kind in proc.stderr and "num_layers" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("ranks", ["0", "-1"])
def test_calibrate_rejects_fewer_than_one_rank(ranks):
    proc = _meshplan("calibrate", "--ranks", ranks)
    assert proc.returncode == 2
    assert f"--ranks={ranks} must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


def test_launch_refuses_more_workers_per_node_than_the_cluster_has(tmp_path):
    # Llama 3 8B on 2 DGX H100 nodes: tp*pp*dp = 16 workers need 16 / 8 = 2 nodes.
    plan = tmp_path / "plan.yaml"
    made = _meshplan("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                     "--devices", "16", "--out", str(plan))
    assert made.returncode == 0, made.stderr
    proc = _meshplan("launch", str(plan), "--nodes", "1", "--rdzv-endpoint", "head:29500")
    assert proc.returncode == 2
    assert "use --nodes 2" in proc.stderr and "8 devices" in proc.stderr
    ok = _meshplan("launch", str(plan), "--nodes", "2", "--rdzv-endpoint", "head:29500")
    assert ok.returncode == 0 and "--nproc-per-node 8" in ok.stdout


def test_fix_with_two_fields_in_one_flag_says_to_repeat_it():
    proc = _meshplan("plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks",
                     "2", "--fix", "pp=1,dp=2")
    assert proc.returncode == 2
    assert "give one --fix per field" in proc.stderr and "--fix dp=2" in proc.stderr


def test_plan_json_rows_carry_the_plan_fields():
    proc = _meshplan("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                     "--json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)["plans"][0]
    for key in ("virtual_stages", "schedule", "recompute", "zero_stage", "sequence_parallel",
                "placement", "hfu"):
        assert key in row
    assert row["hfu"] >= row["mfu"]          # recomputation only adds hardware FLOPs


def test_one_plan_has_no_spearman_and_stays_valid_json():
    # Spearman's rank correlation is undefined for one pair: null in JSON, 'n/a' in text.
    result = summarize_rows([{"id": "a", "model": "m", "predicted_step_time_s": 1.0,
                              "measured_step_time_s": 1.25, "rel_error": -0.2}])
    assert result["spearman"] is None
    assert json.loads(json.dumps(result, allow_nan=False))["mape"] == pytest.approx(0.2)
    assert "Spearman n/a" in summary_line(result)


def test_tables_wider_than_the_terminal_keep_every_cell_whole():
    import io

    import pandas as pd
    from rich.console import Console

    from apps.format import print_table
    out = io.StringIO()
    console = Console(file=out, width=40, color_system=None)
    df = pd.DataFrame([{f"c{i}": 1000 * i for i in range(10)}])
    print_table(console, df, "wide", {f"c{i}": (f"column{i}", None) for i in range(10)})
    lines = out.getvalue().splitlines()
    assert "…" not in out.getvalue()
    assert any(all(f"column{i}" in line for i in range(10)) for line in lines)
    assert any("9000" in line and "1000" in line for line in lines)
    assert console.width == 40                            # restored afterwards


def test_a_context_parallel_plan_is_simulated_and_launchable(tmp_path):
    # tiny-gpt on 4 CPU ranks with cp = 2: the simulator predicts it and `launch` prints the
    # torchrun line of all 4 ranks (the runtime runs ring attention; the run itself is checked
    # in tests/runtime/test_equivalence.py)
    plan = tmp_path / "cp.yaml"
    made = _meshplan("plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks",
                     "4", "--global-batch", "8", "--fix", "cp=2", "--out", str(plan))
    assert made.returncode == 0, made.stderr
    assert "cp: 2" in plan.read_text()
    sim = _meshplan("simulate", str(plan), "--json")
    assert sim.returncode == 0 and json.loads(sim.stdout)["step_time_s"] > 0
    launch = _meshplan("launch", str(plan), "--nodes", "1", "--rdzv-endpoint", "h:29500")
    assert launch.returncode == 0, launch.stderr
    assert "--nproc-per-node 4" in launch.stdout and "Traceback" not in launch.stderr
    # The ranked table and the JSON rows name cp; topo lists it inside dp.
    table = _meshplan("plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks",
                      "4", "--global-batch", "8", "--fix", "cp=2", "--json")
    assert {row["cp"] for row in json.loads(table.stdout)["plans"]} == {2}
    topo = _meshplan("topo", "localhost-cpu", "--plan", str(plan), "--json")
    assert json.loads(topo.stdout)["placement"]["order"] == ["tp", "cp", "dp", "pp"]


def test_validate_names_a_missing_runs_file(tmp_path):
    proc = _meshplan("validate", "--runs", str(tmp_path / "nothere.csv"))
    assert proc.returncode == 2 and "--runs" in proc.stderr and "no such file" in proc.stderr


def test_an_error_is_one_line_and_names_both_fixes_that_exclude_each_other(capsys):
    # the error console must not wrap: one line however long (80 columns when piped)
    from apps.cli import main
    code = main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks", "2",
                 "--fix", "schedule=1f1b", "--fix", "virtual_stages=2"])
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(errors[0]) > 80, err
    assert "schedule=1f1b and virtual_stages=2 exclude each other" in errors[0]
    assert err.endswith(errors[0] + "\n"), err          # nothing wraps onto a second line


def test_output_paths_are_checked_before_the_search(tmp_path, capsys):
    # --csv takes a folder: an existing file there used to fail only after the whole search
    from apps.cli import main
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    base = ["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks", "2"]
    assert main([*base, "--csv", str(afile)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--csv '{afile}' is a file; --csv takes a folder" in err
    assert "ranked plans" not in err and afile.read_text() == "keep me\n"
    assert main([*base, "--out", str(tmp_path)]) == 2
    assert f"--out '{tmp_path}' is a folder" in " ".join(capsys.readouterr().err.split())
    assert main(["collective", "all_reduce", "--cluster", "localhost-cpu", "--ranks", "2",
                 "--csv", str(afile / "x.csv")]) == 2
    assert "cannot write there (Not a directory)" in capsys.readouterr().err

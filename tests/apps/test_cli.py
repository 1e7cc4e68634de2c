"""CLI smoke tests: every --help, `plan --json`, plan files and exit codes."""

import json
import subprocess
import sys

import pytest

from apps.cli import build_parser, main

SUBCOMMANDS = ["plan", "simulate", "run", "compare", "demo"]


def _meshplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("command", [[]] + [[c] for c in SUBCOMMANDS])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    assert "usage: meshplan" in capsys.readouterr().out


#: What a command loads when it runs, never when it parses: `--help` answers at once.
HEAVY_MODULES = ("torch", "pandas", "numpy", "matplotlib", "streamlit", "altair", "simpy",
                 "networkx", "simulator")
_LOADED_BY_HELP = f"""
import contextlib, io, sys
from apps.cli import build_parser
for command in ["plan", "simulate", "run", "compare", "validate", "calibrate", "demo",
                "launch", "app", "topo", "collective"]:
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        build_parser().parse_args([command, "--help"])
print(" ".join(sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY_MODULES!r}))))
"""


def test_help_loads_no_heavy_module():
    proc = subprocess.run([sys.executable, "-c", _LOADED_BY_HELP], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == []


def test_every_subcommand_is_documented():
    text = build_parser().format_help()
    for command in SUBCOMMANDS:
        assert command in text


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("meshplan 0.")


def test_plan_json_is_one_object_best_first(tmp_path):
    out = tmp_path / "plan.yaml"
    proc = _meshplan("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                     "--global-batch", "64", "--top-k", "5", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) == {"plans", "rejected"}
    plans = data["plans"]
    assert plans and set(plans[0]) >= {"id", "tp", "pp", "dp", "micro_batch", "global_batch",
                                       "step_time_s", "tokens_per_s", "mfu",
                                       "peak_memory_bytes", "recompute", "zero_stage"}
    for row in plans:
        assert row["tp"] * row["pp"] * row["dp"] == 16  # 2 nodes x 8 GPUs
        # tokens/s = global batch x seq len / step time (definition), for every row
        assert row["tokens_per_s"] == pytest.approx(64 * 8192 / row["step_time_s"], rel=1e-9)
    refined = plans[:5]
    assert [r["tokens_per_s"] for r in refined] == sorted(
        (r["tokens_per_s"] for r in refined), reverse=True)
    assert all(r["reason"] for r in data["rejected"])
    assert out.is_file()
    sim = _meshplan("simulate", str(out), "--json")
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["step_time_s"] == pytest.approx(plans[0]["step_time_s"],
                                                                  rel=1e-6)


def test_bad_model_exits_2_with_the_choices():
    proc = _meshplan("plan", "--model", "gpt5", "--cluster", "dgx-h100")
    assert proc.returncode == 2
    assert "model='gpt5' is neither a preset" in proc.stderr
    assert "llama3-70b" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_plan_file_exits_2():
    proc = _meshplan("simulate", "no-such-plan.yaml")
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


def _two_runs_csv(tmp_path, second_source: str):
    """A runs CSV of two rows of one 8-GPU H100 run, ``a`` (NVIDIA/Megatron-LM, 1.0 s) and
    ``b`` (``second_source``, 2.0 s)."""
    header = ("id,source,table,model,params_b,layers,hidden,heads,kv_heads,ffn_hidden,vocab,"
              "seq_len,gpu,num_gpus,tp,pp,dp,cp,vpp,micro_batch,global_batch,recompute,"
              "sequence_parallel,zero_stage,ref_step_time_s,ref_step_time_kind,"
              "reported_tflops_per_gpu,reported_mfu,reported_hfu,notes")
    rows = [f"{i},{src} README,t,GPT,1.3,24,2048,16,16,8192,51200,2048,"
            f"H100 SXM 80GB,8,1,1,8,1,,1,64,,,,{t},reported,,,,precision=bf16"
            for i, src, t in (("a", "NVIDIA/Megatron-LM", "1.0"), ("b", second_source, "2.0"))]
    csv = tmp_path / "runs.csv"
    csv.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return csv


def test_validate_held_out_table_prints(tmp_path, capsys):
    # The held-out table's own console: `--loso-carried` without --json printed nothing but
    # a NameError. Two rows of two sources (cells as in ../shared/data's published_runs.csv
    # format), no refit (--loso-iters 0): the table names the device it grouped by.
    csv = _two_runs_csv(tmp_path, "pytorch/torchtitan")
    assert main(["validate", "--runs", str(csv), "--loso-carried", "--loso-iters", "0"]) == 0
    out = capsys.readouterr().out
    assert "leave-one-source-out" in out and "h100-sxm-80gb" in out


def test_validate_held_out_json_lists_each_row(tmp_path, capsys):
    # `--json` gives each row's held-out error beside the groups. The two rows are the same run
    # measured at 1.0 s and 2.0 s, held out by GPU type, no refit (--loso-iters 0): one prediction p for both, so
    # their errors p/1 - 1 and p/2 - 1 satisfy 1 + e_a = 2 (1 + e_b).
    csv = _two_runs_csv(tmp_path, "NVIDIA/Megatron-LM")  # one source: one framework
    assert main(["validate", "--runs", str(csv), "--logo", "--loso-iters", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    errors = {r["id"]: r["held_out"] for r in out["rows"]}
    assert set(errors) == {"a", "b"} and out["kind"] == "leave-one-GPU-out"
    assert 1 + errors["a"] == pytest.approx(2 * (1 + errors["b"]))

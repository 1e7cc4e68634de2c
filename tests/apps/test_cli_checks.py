"""Arguments are checked before any work, and `--help` loads no heavy library."""

import subprocess
import sys
from pathlib import Path

import pytest

from apps.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def test_help_of_every_command_loads_no_heavy_library():
    # torch, pandas, SimPy, NetworkX, rich and Streamlit load when a command runs, not for
    # its --help (the import itself is what makes --help slow)
    names = [c.__name__.removeprefix("apps.cmd_") for c in COMMANDS] + ["collective"]
    code = (f"import sys\nfrom apps.cli import main\nfor name in {names!r}:\n"
            "    try:\n        main([name, '--help'])\n    except SystemExit:\n        pass\n"
            "heavy = ('torch', 'pandas', 'simpy', 'networkx', 'rich', 'streamlit')\n"
            "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.stderr.strip().splitlines()[-1] == "[]", proc.stderr


def test_app_port_out_of_range_is_one_line(capsys):
    assert main(["app", "--port", "99999"]) == 2
    assert _err(capsys) == "error: --port=99999 must be a TCP port in 1..65535 (default 8501)"


def test_compare_steps_zero_fails_before_any_run(capsys, tmp_path):
    assert main(["compare", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "--steps=0 must be >= 1" in _err(capsys)
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("flags, message", [
    (["--top-k", "0"], "--top-k=0 must be > 0"),
    (["--restart-s", "60"], "it would be ignored"),
])
def test_plan_flags_without_effect_are_errors(capsys, flags, message):
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", *flags]) == 2
    assert message in _err(capsys)


def test_a_huge_global_batch_keeps_the_closed_form():
    # 1e8 sequences: ~6e6 micro-batches a step; SimPy would walk each, the closed form does not
    from planner.presets import load_model
    from planner.search import MAX_SIMULATED_MICROBATCHES, search
    from planner.space import SearchSpace
    from simulator.network.cluster import load_cluster
    space = SearchSpace(tp=(8,), pp=(1,), zero_stage=(3,), recompute=("full",))
    result = search(load_model("llama3-8b"), load_cluster("dgx-h100", nodes=2),
                    global_batch=100_000_000, top_k=2, space=space)
    assert not result.ranked.empty
    assert (result.ranked["tier"] == "estimated").all()
    small = search(load_model("llama3-8b"), load_cluster("dgx-h100", nodes=2),
                   global_batch=2 * MAX_SIMULATED_MICROBATCHES, top_k=2, space=space)
    assert (small.ranked["tier"] == "simulated").sum() == 2

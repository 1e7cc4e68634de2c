"""`meshplan run`'s fault flags: echoed in the command that reproduces the run, checked before
any worker starts (a fault beyond --steps, a --resume folder without checkpoints)."""

import json
import shlex

import pytest

from apps.cli import main
from apps.run_config import RUN_CONFIG_NAME


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")    # rich would wrap long paths mid-word


@pytest.fixture
def plan_path(tiny_plan_file):
    return tiny_plan_file(tp=1, pp=2, dp=1, micro_batch=2)


@pytest.fixture
def run_plan_calls(monkeypatch):
    """The keyword arguments of each `runtime.launch.run_plan` call (which does not run)."""
    import runtime.launch
    calls = []
    summary = {"plan_id": "tp1-pp2-dp1-mb2-gb8", "steps": 10, "final_loss": 3.5,
               "step_time_s": 0.25, "tokens_per_s": 4096.0}

    def fake(plan, **kwargs):
        calls.append(kwargs)
        return summary

    monkeypatch.setattr(runtime.launch, "run_plan", fake)
    return calls


def previous_run(tmp_path, *steps):
    """A run folder whose checkpoints/ holds checkpoints of ``steps``."""
    import torch

    from runtime.checkpoint import write_manifest
    folder = tmp_path / "previous"
    for step in steps:
        checkpoint = folder / "checkpoints" / f"step{step:08d}"
        checkpoint.mkdir(parents=True)
        # the job-wide fields a resume checks (global batch 8: the tiny plan's)
        torch.save({"step": step, "global_batch": 8, "global_samples_consumed": 8 * step},
                   checkpoint / "extra_rank0.pt")
        write_manifest(checkpoint, step)          # it verifies, as a finished save does
    folder.mkdir(exist_ok=True)
    return folder


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_saved_command_reproduces_every_fault_flag(plan_path, tmp_path, run_plan_calls):
    from runtime.train import parse_args
    previous, out = previous_run(tmp_path, 4), tmp_path / "run"
    assert main(["run", str(plan_path), "--steps", "10", "--checkpoint-every", "2",
                 "--inject", "kill:rank=1,step=7", "--max-restarts", "1", "--resume",
                 str(previous), "--timeout-s", "9", "--out", str(out)]) == 0
    config = json.loads((out / RUN_CONFIG_NAME).read_text())
    cmd = shlex.split(config["command"])
    assert cmd[cmd.index("--max-restarts") + 1] == "1"
    args = parse_args(cmd[cmd.index("runtime.train") + 1:])     # what the workers will read
    assert (args.steps, args.checkpoint_every, args.inject, args.timeout_s) == \
        (10, 2, ("kill:rank=1,step=7",), 9.0)
    assert args.resume == str(previous / "checkpoints")         # the run folder's checkpoints
    assert config["faults"]["max_restarts"] == 1
    (call,) = run_plan_calls
    assert (call["max_restarts"], call["checkpoint_every"], call["resume"]) == \
        (1, 2, str(previous / "checkpoints"))


def test_command_of_a_plain_run_has_no_fault_flags(plan_path, tmp_path, run_plan_calls):
    assert main(["run", str(plan_path), "--steps", "3", "--out", str(tmp_path / "r")]) == 0
    command = json.loads((tmp_path / "r" / RUN_CONFIG_NAME).read_text())["command"]
    assert "--max-restarts 0" in command
    assert not any(f in command for f in ("--checkpoint-every", "--inject", "--resume"))


def test_resume_of_a_checkpoint_folder_is_kept(plan_path, tmp_path, run_plan_calls):
    previous = previous_run(tmp_path, 3, 6)
    assert main(["run", str(plan_path), "--steps", "10", "--resume",
                 str(previous / "checkpoints"), "--out", str(tmp_path / "r")]) == 0
    assert run_plan_calls[0]["resume"] == str(previous / "checkpoints")


def test_resume_without_a_checkpoint_exits_2_naming_the_folder(plan_path, tmp_path, capsys,
                                                               run_plan_calls):
    empty = previous_run(tmp_path)
    assert main(["run", str(plan_path), "--steps", "4", "--resume", str(empty)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"--resume '{empty}': no checkpoint in it nor in '{empty / 'checkpoints'}'" in err
    assert "--checkpoint-every K" in err
    assert run_plan_calls == []


def test_fault_beyond_the_last_step_exits_2(plan_path, capsys, run_plan_calls):
    assert main(["run", str(plan_path), "--steps", "4", "--inject", "kill:rank=1,step=50"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "--inject kill:rank=1,step=50: step=50 is beyond --steps 4" in err
    assert "use a step from 1 to 4, or --steps 50 or more" in err
    assert run_plan_calls == []


def test_run_ends_with_predicted_against_measured(plan_path, capsys, monkeypatch):
    import runtime.launch
    # summary.json carries the plan file's prediction beside the measured median step
    summary = {"plan_id": "tp1-pp2-dp1-mb2-gb8", "steps": 10, "final_loss": 3.5,
               "step_time_s": 0.25, "tokens_per_s": 4096.0, "mfu": 0.2,
               "prediction": {"step_time_s": 0.2, "tokens_per_s": 5120.0, "mfu": 0.25}}
    monkeypatch.setattr(runtime.launch, "run_plan", lambda plan, **kwargs: summary)
    assert main(["run", str(plan_path), "--steps", "10"]) == 0
    out = one_line(capsys.readouterr().out)
    # by hand: 0.2 / 0.25 − 1 = −20%
    assert "predicted vs measured: step 200.0 ms vs 250.0 ms (error -20.0%)" in out
    assert "MFU 25.0% vs 20.0%" in out


# gloo's own words for a collective timeout: the bracketed source path is what rich would
# read as a closing markup tag ("closing tag '[/__w/...]' doesn't match any open tag")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78]"
                " Timed out waiting 5000ms for recv operation to complete")


def test_failure_text_with_brackets_is_printed_as_it_is(plan_path, tmp_path, capsys,
                                                        monkeypatch):
    import runtime.launch

    def fails(plan, **kwargs):
        raise RuntimeError(f"run of {plan} failed: {GLOO_TIMEOUT} [bold]x[/bold]")

    monkeypatch.setattr(runtime.launch, "run_plan", fails)
    assert main(["run", str(plan_path), "--out", str(tmp_path / "run")]) == 1
    err = one_line(capsys.readouterr().err)
    assert f"failed: run of {plan_path} failed: {GLOO_TIMEOUT} [bold]x[/bold]" in err


def test_failed_run_is_one_line_and_its_summary_under_json(plan_path, tmp_path, capsys,
                                                           monkeypatch):
    import runtime.launch
    from runtime.launch import RunFailed
    line = f"meshplan run: rank 1 hung at step 3 of 4: rank(s) 0 failed ({GLOO_TIMEOUT})"
    summary = {"plan_id": "tp1-pp2-dp1-mb2-gb8", "failed": True, "error": line}

    def fails(plan, **kwargs):
        raise RunFailed(f"run of {plan} failed (exit status 1)\n{line}\n", line=line,
                        summary=summary)

    monkeypatch.setattr(runtime.launch, "run_plan", fails)
    assert main(["run", str(plan_path), "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == line and "exit status" not in err
    assert main(["run", str(plan_path), "--out", str(tmp_path / "run"), "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out) == summary                 # stdout: the JSON alone
    assert captured.err.strip().splitlines()[-1] == line


def test_progress_of_a_resumed_run_counts_from_the_resumed_step(tmp_path):
    from rich.console import Console

    from apps.run_config import with_step_progress
    # a run resumed from another run's step 4 checkpoint: its own metrics.jsonl holds only
    # steps 5 and 6 of the 6-step job, so the bar must end at 6/6, not at 2 lines
    config = {"out_dir": str(tmp_path), "plan_id": "tp1-pp2-dp1-mb2-gb8", "steps": 6}

    def run():
        with open(tmp_path / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({"step": k, "loss": 3.0}) + "\n" for k in (5, 6))
        return {}

    console = Console(record=True, width=120, force_terminal=False)
    with_step_progress(console, config, run, poll_s=0.01)
    assert "6/6 steps" in console.export_text()


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_a_closed_stdout_exits_0_quietly(tiny_plan_file, flags):
    # `meshplan launch ... | head`: the reader is gone before the command writes (the read
    # end is closed first), so the first write gets EPIPE: rich's console (the node line)
    # or print (--json)
    import os
    import subprocess
    import sys
    from pathlib import Path
    plan = tiny_plan_file(tp=1, pp=1, dp=2)
    read, write = os.pipe()
    os.close(read)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "apps.cli", "launch", str(plan), "--nodes",
                           "2", "--rdzv-endpoint", "10.0.0.9:29500", *flags], stdout=write,
                          stderr=subprocess.PIPE, text=True, cwd=repo, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(repo)))
    os.close(write)
    assert proc.returncode == 0 and proc.stderr == ""


def test_resume_at_the_last_step_exits_2_before_any_worker(tiny_plan_file, tmp_path, capsys,
                                                           monkeypatch):
    import runtime.launch
    plan = tiny_plan_file(tp=1, pp=1, dp=1)
    out = tmp_path / "run dir [1]"
    # a real 1-rank run of 2 steps that checkpoints after step 2
    assert main(["run", str(plan), "--steps", "2", "--checkpoint-every", "2",
                 "--out", str(out)]) == 0
    assert (out / "checkpoints" / "step00000002" / "manifest.json").is_file()
    capsys.readouterr()
    calls = []
    monkeypatch.setattr(runtime.launch, "run_plan", lambda p, **kw: calls.append(kw))
    for steps in ("2", "1"):      # the checkpoint reaches --steps, or goes past it
        assert main(["run", str(plan), "--steps", steps, "--resume", str(out),
                     "--out", str(tmp_path / "again")]) == 2
        err = one_line(capsys.readouterr().err)
        assert (f"--resume '{out / 'checkpoints'}': its newest checkpoint is step 2, so "
                f"--steps {steps} has nothing left to train; give --steps 3 or more") in err
    assert calls == []                                      # no worker started


def test_summary_of_a_job_that_trained_no_step(tiny_plan_file):
    from planner.planfile import read_plan_file
    from runtime.metrics import summarize
    pf = read_plan_file(tiny_plan_file(tp=1, pp=1, dp=1))
    summary = summarize([], pf, "gloo", [], "fp32")        # no median of nothing: None
    assert (summary["steps"], summary["step_time_s"], summary["final_loss"]) == (0, None, None)


def test_resume_from_one_step_folder_loads_that_checkpoint(tiny_plan_file, tmp_path, capsys):
    plan = tiny_plan_file(tp=1, pp=1, dp=1)
    first = tmp_path / "first run"
    # a real 1-rank run of 4 steps with checkpoints after steps 2 and 4: the reference
    assert main(["run", str(plan), "--steps", "4", "--checkpoint-every", "2",
                 "--out", str(first)]) == 0
    step2 = first / "checkpoints" / "step00000002"
    reference = [json.loads(x) for x in (first / "metrics.jsonl").read_text().splitlines()]
    capsys.readouterr()
    # into its own run folder, the later step00000004 would be taken for the resumed run's
    assert main(["run", str(plan), "--steps", "4", "--resume", str(step2),
                 "--out", str(first)]) == 2
    err = one_line(capsys.readouterr().err)
    assert "also holds the later step00000004" in err and "--out NEW" in err
    # into a new run folder: steps 3 and 4 again, from step 2's state (exact resume: the
    # losses of the uninterrupted run), not from the newest checkpoint step 4
    again = tmp_path / "again"
    assert main(["run", str(plan), "--steps", "4", "--resume", str(step2),
                 "--out", str(again)]) == 0
    resumed = [json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in reference[2:]],
                                                          rel=1e-6)
    # a damaged step folder is refused: no fallback to another checkpoint
    shard = max(step2.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    shard.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])        # same size, other bytes
    capsys.readouterr()
    assert main(["run", str(plan), "--steps", "4", "--resume", str(step2),
                 "--out", str(tmp_path / "third")]) == 2
    assert "fails its sha256 check" in one_line(capsys.readouterr().err)


def test_a_run_that_trained_no_step_prints_so(plan_path, capsys, monkeypatch):
    import runtime.launch
    # summarize([]): the measured figures of a job with no step are None
    summary = {"plan_id": "tp1-pp2-dp1-mb2-gb8", "steps": 0, "final_loss": None,
               "step_time_s": None, "tokens_per_s": None, "prediction": {"step_time_s": 0.2}}
    monkeypatch.setattr(runtime.launch, "run_plan", lambda plan, **kwargs: summary)
    assert main(["run", str(plan_path), "--steps", "4"]) == 0
    assert "tp1-pp2-dp1-mb2-gb8: no step left to train" in one_line(capsys.readouterr().out)

"""Faults from outside the training loop: a signal to `meshplan run`, a killed torchrun agent,
a hung rank, a checkpoint folder that stops being writable.

Every run is the 2-layer tiny-gpt at dp=2 (2 ranks); a rank is slowed where the test needs
time to act while the run trains.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.interrupts import hung_ranks, record_collective_error
from runtime.launch import run_plan

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_path(write_plan, tiny_plan, tiny_model):
    return write_plan("outside-dp2", tiny_plan(dp=2), tiny_model(num_layers=2))


def meshplan_run(plan_path, out, *flags) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "apps.cli", "run", str(plan_path),
                             "--out", str(out), *flags], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_steps(out: Path, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{out} did not reach step {n}")


def processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (our run folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().split(")")[-1].split()[0]
            except OSError:
                continue
            if text in cmdline and state != "Z":
                pids.append(int(entry.name))
    return pids


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().split(")")[-1].split()[1])
            except OSError:
                continue
            if ppid == pid:
                kids.append(int(entry.name))
    return kids


def test_sigterm_stops_torchrun_and_workers_and_leaves_a_resumable_checkpoint(
        plan_path, tmp_path):
    out = tmp_path / "run"
    proc = meshplan_run(plan_path, out, "--steps", "40", "--inject", "slow:rank=0,factor=4")
    wait_for_steps(out, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM
    last = err.strip().splitlines()[-1]
    assert last.startswith("meshplan run: stopped by SIGTERM after step ")
    assert "--resume" in last
    time.sleep(1.0)
    assert processes_naming(str(out)) == []          # no torchrun, no orphaned worker
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] == "SIGTERM"
    done = summary["steps"]
    assert (out / "checkpoints" / f"step{done:08d}").is_dir()
    resumed = run_plan(plan_path, steps=done + 2, out_dir=out, quiet=True, timeout_s=120,
                       resume=out / "checkpoints")
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, done + 3))         # continues after the stop, nothing lost
    assert resumed["restarts"] == 1                  # the resume is one more attempt


def test_a_killed_agent_whose_workers_finished_reports_finished(plan_path, tmp_path):
    out = tmp_path / "run"
    proc = meshplan_run(plan_path, out, "--steps", "8", "--inject", "slow:rank=0,factor=3")
    wait_for_steps(out, 1)
    torchrun = children_of(proc.pid)
    assert len(torchrun) == 1
    os.kill(torchrun[0], signal.SIGKILL)             # the agent only; its workers train on
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "8 steps, final loss" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["launcher_exit_status"] == -signal.SIGKILL


def test_a_hung_rank_is_named_not_the_rank_that_timed_out(plan_path, tmp_path):
    # no restarts: rank 0's recv times out (gloo's message holds "[/__w/.../unbound_buffer.cc:78]",
    # which rich once read as markup), torchrun ends rank 1 and reports rank 0 as the first
    # failure; the run must end with one line naming rank 1, the tracebacks in the log
    out = tmp_path / "run"
    proc = meshplan_run(plan_path, out, "--steps", "3", "--checkpoint-every", "1",
                        "--inject", "hang:rank=1,step=2", "--timeout-s", "3")
    stdout, err = proc.communicate(timeout=150)
    assert proc.returncode == 1, err              # apps.cli: 1 is a runtime failure
    assert "Traceback" not in stdout and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("meshplan run: rank 1 hung at step 2 of 3: rank(s) 0 failed")
    assert f"resume with `meshplan run {plan_path} --steps 3 --out {out}" in lines[0]
    assert lines[0].endswith(f"the workers' output is in {out / 'logs' / 'attempt0.log'}")
    log = (out / "logs" / "attempt0.log").read_text()
    assert "ChildFailedError" in log and "Timed out waiting" in log


def test_a_recovered_kill_is_one_line_and_the_noise_goes_to_the_log(plan_path, tmp_path):
    out = tmp_path / "run"
    proc = meshplan_run(plan_path, out, "--steps", "3", "--checkpoint-every", "1",
                        "--inject", "kill:rank=1,step=2", "--max-restarts", "1",
                        "--timeout-s", "10")
    stdout, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err
    assert "Traceback" not in stdout and "Traceback" not in err
    restarts = [x for x in stdout.splitlines() if x.startswith("meshplan run: ")]
    assert restarts == [
        "meshplan run: rank 1 failed after step 1 of 3 (exit code -9, SIGKILL; injected fault "
        "kill:rank=1,step=2); restart 1 of 1 from the newest checkpoint; the attempt's "
        f"output is in {out / 'logs' / 'attempt0.log'}"]
    assert "3 steps, final loss" in stdout
    # the failed attempt's output: rank 0's error at its peer's death, torchrun's report
    log = (out / "logs" / "attempt0.log").read_text()
    assert "failed (exitcode: -9) local_rank: 1" in log
    assert [x for x in (out / "logs" / "attempt1.log").read_text().splitlines()
            if x.startswith("step: ")][-1].startswith("step: 3 ")


def test_hung_ranks_are_the_silent_ones_of_the_last_attempt(tmp_path):
    # attempt 0: rank 0 and 2 failed in a collective, so of 4 ranks 1 and 3 stayed silent
    for rank in (0, 2):
        record_collective_error(tmp_path, rank, 5, RuntimeError("Timed out waiting 5000ms"))
    silent, errors = hung_ranks(tmp_path, 4, since_unix_s=0.0)
    assert silent == [1, 3] and {e["rank"] for e in errors} == {0, 2}
    assert hung_ranks(tmp_path, 4, since_unix_s=time.time() + 1) == ([], [])
    # a rank that failed on its own is the cause: nobody is named as hung
    record_collective_error(tmp_path, 1, 5, ValueError("zip() argument 2 is shorter"))
    assert hung_ranks(tmp_path, 4, since_unix_s=0.0) == ([], [])


def test_an_unwritable_checkpoint_folder_mid_run_is_one_line_and_no_restart(plan_path,
                                                                             tmp_path):
    checkpoints = tmp_path / "checkpoints"

    def block_the_folder():
        # after the first checkpoint landed, a file takes the folder's place (root ignores
        # permission bits, so a read-only mode would not stop this process)
        deadline = time.monotonic() + 120
        while not (checkpoints / "step00000002").is_dir() and time.monotonic() < deadline:
            time.sleep(0.01)
        shutil.rmtree(checkpoints)
        checkpoints.write_text("not a folder")

    blocker = threading.Thread(target=block_the_folder)
    blocker.start()
    with pytest.raises(RuntimeError) as failure:
        run_plan(plan_path, steps=8, out_dir=tmp_path, quiet=True, timeout_s=120,
                 checkpoint_every=2, max_restarts=2, inject=["slow:rank=0,factor=4"])
    blocker.join()
    message = str(failure.value)
    assert "stopped: after step" in message and repr(str(checkpoints)) in message
    assert len(message.strip().splitlines()) == 1
    events = (tmp_path / "faults" / "events.jsonl").read_text()
    assert '"attempt": 1' not in events              # no restart was spent on it

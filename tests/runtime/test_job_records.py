"""A job's records span all its launches: a ``--resume`` into the same run folder appends to
metrics.jsonl, consumed/ and faults/, counts as a restart, and keeps goodput <= 1; the resume
command of a failure message repeats the run's fault-tolerance flags.

The runs are tiny-gpt (2 layers) at dp=2, 6 steps, checkpoints every 2 steps.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.launch import failure_hint, resume_flags, run_plan
from runtime.resilience import job_accounting

STEPS, EVERY, TIMEOUT_S = 6, 2, 10.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_path(write_plan, tiny_plan, tiny_model):
    return write_plan("records-dp2", tiny_plan(dp=2), tiny_model(num_layers=2))


def consumed(folder) -> dict[int, list[int]]:
    ids = {}
    for path in sorted((Path(folder) / "consumed").glob("dp*.jsonl")):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        ids[lines[0]["dp_rank"]] = [i for line in lines for i in line["samples"]]
    return ids


def test_a_resume_by_hand_continues_the_jobs_records(plan_path, tmp_path):
    reference = run_plan(plan_path, steps=STEPS, out_dir=tmp_path / "ref", quiet=True,
                         timeout_s=120)
    out = tmp_path / "job"
    with pytest.raises(RuntimeError) as failed:
        run_plan(plan_path, steps=STEPS, out_dir=out, quiet=True, timeout_s=120,
                 checkpoint_every=EVERY, collective_timeout_s=TIMEOUT_S,
                 inject=["kill:rank=1,step=4"])
    hint = str(failed.value).splitlines()[-1]
    command = re.search(r"`(meshplan run [^`]*)`", hint).group(1)
    # every fault-tolerance flag of the run is repeated (values as given above)
    assert "--checkpoint-every 2" in command and "--timeout-s 10.0" in command
    # run the printed command as a user would (the CLI, not the Python API)
    done = subprocess.run([sys.executable, "-m", "apps.cli", *shlex.split(command)[1:],
                           "--json"], capture_output=True, text=True, timeout=150, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == reference["losses"]            # bitwise, all 6 steps
    assert consumed(out) == consumed(tmp_path / "ref")          # nothing lost or repeated
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] \
        == list(range(1, STEPS + 1))
    assert summary["restarts"] == 1                             # the resume by hand
    # the kill came at the start of step 4 after step 3; the resume starts from step 2:
    # steps 3 and 4 are computed again (hand count)
    assert summary["steps_lost"] == 2
    assert 0 < summary["goodput"] <= 1
    fired = (out / "faults" / "fired.jsonl").read_text().splitlines()
    assert len(fired) == 1                                      # the kill fired once per job


def test_resume_flags_repeat_every_fault_tolerance_option(tmp_path):
    flags = resume_flags(data="d.txt", checkpoint_every=3, keep=4, collective_timeout_s=5.0,
                         on_nan="skip", max_restarts=2)
    # the flags as `meshplan run` spells them (apps.cmd_faults.add_run_fault_args)
    assert flags == ["--data", "d.txt", "--checkpoint-every", "3", "--keep", "4",
                     "--timeout-s", "5.0", "--on-nan", "skip", "--max-restarts", "2"]
    (tmp_path / "checkpoints" / "step00000003").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    hint = failure_hint([], "p.yaml", tmp_path, 9, 2, resume_flags=flags)
    assert hint.endswith(f"--resume {tmp_path / 'checkpoints'} --data d.txt "
                         "--checkpoint-every 3 --keep 4 --timeout-s 5.0 --on-nan skip "
                         "--max-restarts 2`\n")


def test_accounting_counts_a_resume_and_a_finished_attempt_loses_nothing():
    # attempt 0 finished 4 steps (each 1 s, from t=0); a resume by hand from step 4 ran two
    # more at t=100..102: one restart, no step lost, goodput 6 s / 102 s
    events = [{"event": "resumed", "attempt": 0, "from_step": 0, "time_unix_s": 0.0}]
    events += [{"event": "step", "attempt": 0, "step": k, "time_unix_s": float(k)}
               for k in range(1, 5)]
    events += [{"event": "finished", "attempt": 0, "step": 4, "time_unix_s": 4.0},
               {"event": "resumed", "attempt": 1, "from_step": 4, "time_unix_s": 100.0},
               {"event": "step", "attempt": 1, "step": 5, "time_unix_s": 101.0},
               {"event": "step", "attempt": 1, "step": 6, "time_unix_s": 102.0}]
    acc = job_accounting(events, [{"step_time_s": 1.0}] * 6)
    assert acc["restarts"] == 1 and acc["steps_lost"] == 0
    assert acc["goodput"] == pytest.approx(6 / 102)

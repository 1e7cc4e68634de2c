"""The job's accounting from its event log (``OUT/faults/events.jsonl``, written by
`runtime.resilience`): attempts, restarts, steps and wall time lost, checkpoint costs, goodput.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from simulator.failures.eviction import RestartEvidence


def next_attempt(events: list[dict]) -> int:
    """The job-wide number of a new attempt: one more than the highest attempt in the job's
    ``events`` (0 for a new job). A torchrun restart and a ``--resume`` into the same run
    folder both start a new attempt, so attempt numbers never repeat within a job.

    >>> next_attempt([]), next_attempt([{"attempt": 0}, {"attempt": 2}])
    (0, 3)
    """
    return max((e["attempt"] for e in events), default=-1) + 1


def checkpoint_blocking_times_s(events: list[dict], *, staging: bool = True) -> list[float]:
    """Per save (in order), the time it blocked the training loop, including its staging
    wait when that was logged (``checkpoint_staged``).

    With ``staging=False``: only the save call, the part between two steps. The staging wait
    runs inside the next step (before its optimizer step), so that step's ``step_time_s``
    already holds it; a goodput model fed with step times adds only this part.
    """
    kinds = ("checkpoint", "checkpoint_staged") if staging else ("checkpoint",)
    times: dict[tuple[int, int], float] = {}
    for e in events:
        if e["event"] in kinds:
            times[(e["attempt"], e["step"])] = e["blocking_s"]
    return list(times.values())


def read_events(out: str | os.PathLike) -> list[dict]:
    """The events of run folder ``out`` (``faults/events.jsonl``)."""
    path = Path(out) / "faults" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def restart_times_s(events: list[dict]) -> list[float]:
    """Per restart (in order), the seconds from the previous attempt's last step (or its
    resume, when it did no step) to training again (the next "resumed" event)."""
    resumes = [e for e in events if e["event"] == "resumed"]
    return [cur["time_unix_s"] - next(
        (e["time_unix_s"] for e in reversed(events) if e["event"] == "step"
         and e["attempt"] == prev["attempt"]), prev["time_unix_s"])
        for prev, cur in zip(resumes, resumes[1:], strict=False)]


def restart_evidence(events: list[dict], *, launched_unix_s: float | None,
                     now_unix_s: float) -> RestartEvidence:
    """What the job of ``events`` measured of its own stop-and-resume, at ``now_unix_s``
    (`simulator.failures.eviction.RestartEvidence`, whose `restart_estimate_s` turns it into
    seconds).

    - stop: ``now_unix_s`` minus the end of the step the job stopped after (the newest "evict"
      event's step, else the newest step);
    - start-up: the first "attempt_start" at or after ``launched_unix_s`` (the launch the
      job's latest attempts came from; None: not known) minus that launch time;
    - build: the newest "attempt_start"'s ``build_s`` (its process group, mesh, model and
      optimizer, `runtime.resilience.Resilience`);
    - load: the newest attempt's "attempt_start" to "resumed" span among attempts that loaded
      a checkpoint; else the write of the checkpoint the job stopped with (its step's end to
      the "evict" event, which follows the landing).

    >>> events = [{"event": "attempt_start", "attempt": 0, "time_unix_s": 110.0,
    ...            "build_s": 0.5},
    ...           {"event": "resumed", "attempt": 0, "time_unix_s": 110.1, "source": None},
    ...           {"event": "step", "attempt": 0, "step": 5, "time_unix_s": 130.0},
    ...           {"event": "evict", "attempt": 0, "step": 5, "time_unix_s": 131.5}]
    >>> restart_evidence(events, launched_unix_s=100.0, now_unix_s=134.0)
    RestartEvidence(stop_s=4.0, start_up_s=10.0, build_s=0.5, load_s=1.5, restarts_s=[])
    """
    steps = {(e["attempt"], e["step"]): e["time_unix_s"] for e in events if e["event"] == "step"}
    evicts = [e for e in events if e["event"] == "evict"]
    stopped = (steps.get((evicts[-1]["attempt"], evicts[-1]["step"])) if evicts
               else max(steps.values(), default=None))
    starts = {e["attempt"]: e["time_unix_s"] for e in events if e["event"] == "attempt_start"}
    start_up = None if launched_unix_s is None else next(
        (t - launched_unix_s for t in sorted(starts.values()) if t >= launched_unix_s), None)
    builds = [e["build_s"] for e in events if e["event"] == "attempt_start" and "build_s" in e]
    loads = [e["time_unix_s"] - starts[e["attempt"]] for e in events
             if e["event"] == "resumed" and e.get("source") and e["attempt"] in starts]
    load = loads[-1] if loads else (evicts[-1]["time_unix_s"] - stopped
                                    if evicts and stopped is not None else None)
    return RestartEvidence(stop_s=None if stopped is None else max(0.0, now_unix_s - stopped),
                           start_up_s=start_up, build_s=builds[-1] if builds else None,
                           load_s=load, restarts_s=restart_times_s(events))


def job_accounting(events: list[dict], records: list[dict]) -> dict:
    """Restarts, steps and wall time lost, checkpoint costs and goodput from ``events.jsonl``.

    ``goodput`` is the kept steps' step time over the job's wall time (from the first attempt's
    training start to the last step), at most 1: the kept steps ran inside that span (each
    step's record is timed after its "resumed" event and before its "step" event; the bound
    only absorbs clock rounding). A ``--resume`` into the same run folder is one more attempt
    of the same job (`next_attempt`), so it counts as a restart and its wall time includes the
    time the job stood still.
    """
    step_end = {}                       # step -> end time of the attempt that kept it
    resumes = [e for e in events if e["event"] == "resumed"]
    steps_lost, time_lost, last_done = 0, 0.0, {}
    for e in events:
        if e["event"] == "step":
            last_done[e["attempt"]] = e["step"]
    finished = {e["attempt"] for e in events if e["event"] == "finished"}
    for prev, cur in zip(resumes, resumes[1:], strict=False):
        done = last_done.get(prev["attempt"], prev["from_step"])
        # an interrupted attempt also lost the step it was in; a finished one lost nothing
        steps_lost += done + (prev["attempt"] not in finished) - cur["from_step"]
        base = next((e["time_unix_s"] for e in reversed(events)
                     if e["event"] == "step" and e["step"] == cur["from_step"]
                     and e["time_unix_s"] < cur["time_unix_s"]), resumes[0]["time_unix_s"])
        time_lost += cur["time_unix_s"] - base
    for e in events:
        if e["event"] == "step":
            step_end[e["step"]] = e["time_unix_s"]
    start = resumes[0]["time_unix_s"] if resumes else None
    end = max(step_end.values()) if step_end else start
    wall = (end - start) if start is not None else 0.0
    blocking = checkpoint_blocking_times_s(events)
    useful = sum(r["step_time_s"] for r in records)
    return {"restarts": max(0, len(resumes) - 1), "steps_lost": steps_lost,
            "wall_time_lost_s": time_lost, "wall_time_s": wall,
            "restart_times_s": restart_times_s(events),
            "checkpoints": len(blocking),
            "checkpoint_blocking_s": statistics.median(blocking) if blocking else None,
            "useful_time_s": useful,
            "goodput": min(1.0, useful / wall) if wall > 0 else None}

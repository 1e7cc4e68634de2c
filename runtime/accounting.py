"""The job's accounting from its event log (``OUT/faults/events.jsonl``, written by
`runtime.resilience`): attempts, restarts, steps and wall time lost, checkpoint costs, goodput.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path


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
            "restart_times_s": [cur["time_unix_s"] - next(
                (e["time_unix_s"] for e in reversed(events) if e["event"] == "step"
                 and e["attempt"] == prev["attempt"]), prev["time_unix_s"])
                for prev, cur in zip(resumes, resumes[1:], strict=False)],
            "checkpoints": len(blocking),
            "checkpoint_blocking_s": statistics.median(blocking) if blocking else None,
            "useful_time_s": useful,
            "goodput": min(1.0, useful / wall) if wall > 0 else None}

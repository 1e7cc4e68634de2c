"""Health telemetry of a run: every rank's compute time per step and a straggler detector.

Each rank times its part of a step from the step's start to the moment it reaches the step's
closing all-gather (forward, backward, the collectives inside them, the optimizer step), so
the time it then waits there for the slowest rank is left out. The value travels in the
all-gather the step already makes for the loss and peak memory (`runtime.train`), so the
telemetry costs no collective of its own; rank 0 writes it into every metrics.jsonl record
(``compute_time_s``: one value per rank, in rank order) and summary.json (the per-rank
medians, and the stragglers found).

Straggler detection follows NVIDIA's resiliency extension (nvidia-resiliency-ext,
``nvidia_resiliency_ext.straggler``, usage guide "Design Overview"): a rank's *relative
performance score* is a reference time over its own time, from 0 (worst) to 1 (best), and a
rank whose score falls below a threshold is a straggler; its default threshold is 0.7
(``gpu_relative_perf_threshold=0.7`` in its PyTorch Lightning callback and Megatron Bridge's
``NVRxStragglerDetectionConfig``). The extension takes the best rank as the reference; here it
is the median of the *other* ranks (on two ranks the best one would make the healthy rank the
reference of itself, and a median of peers ignores one fast outlier). One slow step is noise
(a page fault, a checkpoint's staging), so a rank is confirmed only after its score stayed
below the threshold for ``window`` consecutive steps (the extension reports over a time
interval instead, ``report_time_interval``, 300 s by default; steps are the unit this runtime
logs in).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from planner.stragglers import STRAGGLER_THRESHOLD, STRAGGLER_WINDOW

#: What a confirmed straggler triggers: a warning, or eviction and a re-planned resume.
ON_STRAGGLER = ("warn", "evict")


def relative_scores(compute_s: list[float]) -> list[float]:
    """Each rank's relative performance score: the median compute time of the other ranks
    over its own (capped at 1), as in nvidia-resiliency-ext's relative score with the peers'
    median as the reference (module docstring).

    >>> relative_scores([0.1, 0.3, 0.1, 0.1])
    [1.0, 0.33333333333333337, 1.0, 1.0]

    Args:
        compute_s: one compute time per rank (seconds, > 0); one rank alone scores 1.
    """
    if len(compute_s) < 2:
        return [1.0] * len(compute_s)
    scores = []
    for rank, own in enumerate(compute_s):
        peers = statistics.median(compute_s[:rank] + compute_s[rank + 1:])
        scores.append(min(1.0, peers / own) if own > 0 else 1.0)
    return scores


@dataclass
class StragglerDetector:
    """Flags ranks whose relative score stays below ``threshold`` for ``window`` steps.

    Every rank can run its own copy on the gathered times and reach the same verdict at the
    same step, so acting on it needs no further collective.

    Args:
        threshold: relative performance score below which a step counts as slow (0 < t <= 1).
        window: consecutive slow steps that confirm a straggler (>= 1).
    """

    threshold: float = STRAGGLER_THRESHOLD
    window: int = STRAGGLER_WINDOW
    streak: dict[int, int] = field(default_factory=dict)
    confirmed: list[dict] = field(default_factory=list)

    def observe(self, step: int, compute_s: list[float]) -> list[dict]:
        """Feed one step's per-rank compute times; returns the ranks confirmed at this step
        (each once per run): ``{"rank", "step", "first_step", "score", "compute_time_s",
        "peers_median_s"}`` with the window's median score and times."""
        new = []
        scores = relative_scores(compute_s)
        known = {c["rank"] for c in self.confirmed}
        for rank, score in enumerate(scores):
            slow = score < self.threshold
            self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
            if slow and self.streak[rank] >= self.window and rank not in known:
                peers = statistics.median(compute_s[:rank] + compute_s[rank + 1:])
                found = {"rank": rank, "step": step, "first_step": step - self.window + 1,
                         "score": score, "compute_time_s": compute_s[rank],
                         "peers_median_s": peers, "threshold": self.threshold,
                         "window": self.window}
                self.confirmed.append(found)
                new.append(found)
        return new


def straggler_line(found: dict) -> str:
    """The log line of a confirmed straggler, e.g. ``meshplan straggler: rank 1 ...``."""
    ratio = found["compute_time_s"] / found["peers_median_s"] if found["peers_median_s"] else 0
    return (f"meshplan straggler: rank {found['rank']} computes {ratio:.2f}x its peers' median "
            f"({found['compute_time_s']:.3f} s vs {found['peers_median_s']:.3f} s per step) "
            f"for {found['window']} steps ({found['first_step']}-{found['step']}): relative "
            f"performance score {found['score']:.2f} < threshold {found['threshold']:.2f}")


def compute_time_medians(records: list[dict]) -> list[float] | None:
    """Per-rank median ``compute_time_s`` over the records after the first (None without),
    of the job's last layout (a job that resumed on fewer ranks: the records of as many
    ranks as its last one)."""
    rows = [r["compute_time_s"] for r in records[1:] or records if r.get("compute_time_s")]
    if not rows:
        return None
    rows = [row for row in rows if len(row) == len(rows[-1])]
    return [statistics.median(col) for col in zip(*rows, strict=True)]


def straggler_flags_error(threshold: float, window: int, on_straggler: str) -> str | None:
    """The first problem with ``--straggler-threshold``, ``--straggler-window`` and
    ``--on-straggler``, or None."""
    if not 0.0 < threshold <= 1.0:
        return (f"--straggler-threshold={threshold} must be in (0, 1]: a relative performance "
                f"score (peers' median time over the rank's time); default "
                f"{STRAGGLER_THRESHOLD}")
    if window < 1:
        return f"--straggler-window={window} must be >= 1 (consecutive slow steps)"
    if on_straggler not in ON_STRAGGLER:
        return f"--on-straggler={on_straggler!r} is not one of {list(ON_STRAGGLER)}"
    return None


def job_stragglers(events: list[dict]) -> list[dict]:
    """The stragglers a job confirmed (its ``straggler`` events, every attempt), in order:
    ``{"rank", "step", "first_step", "score", "compute_time_s", "peers_median_s",
    "threshold", "window", "attempt"}``."""
    keep = ("rank", "step", "first_step", "score", "compute_time_s", "peers_median_s",
            "threshold", "window", "attempt")
    return [{k: e[k] for k in keep if k in e} for e in events if e["event"] == "straggler"]

"""Deterministic failure injection: parse ``--inject SPEC`` and fire each fault once per job.

Specs (``meshplan run --inject SPEC``, repeatable, or the plan file's ``faults:`` list):

- ``kill:rank=R,step=S``: rank R's process dies (SIGKILL) at the start of step S.
- ``hang:rank=R,step=S``: rank R stops answering collectives at the start of step S (it sleeps
  for an hour; the peers' collective timeout turns that into an error and torchrun restarts).
- ``slow:rank=R,factor=F[,step=S]``: rank R is a straggler: every step's compute (from step S,
  default 1) takes F times as long (it sleeps (F - 1) x its compute time of the step).
- ``corrupt-checkpoint:step=S``: the checkpoint of step S is damaged on disk right after it
  was written (bytes of a shard are flipped), so a later load must fall back.
- ``nan:step=S``: step S's loss (and gradients) become NaN.

Steps count from 1, as in the logs. A kill or a hang fires after the checkpoints already in
flight have landed, so which checkpoint a restart resumes from is deterministic; a crash in the
middle of a write leaves only a temporary folder, which `runtime.checkpoint` ignores.

Each fault fires once per job, not once per attempt: the firing rank appends it to
``OUT/faults/fired.jsonl`` before it acts, and later attempts skip it (a replayed step 7 does
not kill rank 1 again).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FaultKind = Literal["kill", "hang", "slow", "corrupt-checkpoint", "nan"]

#: The fields each fault kind takes (all required).
FAULT_FIELDS: dict[str, tuple[str, ...]] = {
    "kill": ("rank", "step"), "hang": ("rank", "step"), "slow": ("rank", "factor"),
    "corrupt-checkpoint": ("step",), "nan": ("step",),
}
#: Fields a kind may leave out.
OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {"slow": ("step",)}
#: Seconds a hung rank sleeps: far longer than any collective timeout.
HANG_S = 3600.0


#: NaN loss policies: stop the run with an error, or skip the step's update.
ON_NAN = ("stop", "skip")


def add_fault_args(parser: argparse.ArgumentParser, *, launcher: bool = False) -> None:
    """The fault-tolerance flags, shared by ``runtime.train`` and ``meshplan run``
    (``launcher=True``: adds ``--max-restarts`` and leaves out the measurement flag
    ``--sync-checkpoint``)."""
    add_checkpoint_args(parser)
    parser.add_argument("--inject", action="append", default=[], metavar="SPEC",
                        help="inject a fault (repeatable): kill:rank=R,step=S, "
                             "hang:rank=R,step=S, slow:rank=R,factor=F, "
                             "corrupt-checkpoint:step=S, nan:step=S")
    add_timeout_arg(parser)
    parser.add_argument("--on-nan", choices=ON_NAN, default="stop",
                        help="a NaN loss stops the run with an error (default), or skips "
                             "the step's update")
    add_straggler_args(parser)
    if launcher:
        add_max_restarts_arg(parser)
        parser.add_argument("--spares", type=int, default=0, metavar="N",
                            help="spare nodes an eviction may swap in (default 0: the job "
                                 "re-plans on the ranks left)")
        parser.add_argument("--ranks-per-node", type=int, default=1, metavar="K",
                            help="ranks per node: an eviction leaves a straggler's whole "
                                 "node out (default 1)")
    else:
        parser.add_argument("--sync-checkpoint", action="store_true",
                            help="blocking dcp.save instead of async_save (for measurements)")


def add_timeout_arg(parser: argparse.ArgumentParser) -> None:
    """``--timeout-s``, the collective timeout: shared by ``runtime.train``, ``meshplan run``
    and ``meshplan launch``."""
    parser.add_argument("--timeout-s", type=float, default=None, metavar="S",
                        help="collective timeout in seconds: a hung rank becomes an error")


def add_max_restarts_arg(parser: argparse.ArgumentParser) -> None:
    """``--max-restarts``, torchrun's restarts of the whole group: shared by ``meshplan run``
    and ``meshplan launch``."""
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="torchrun restarts of the whole group after a failure or a "
                             "lost node (default 0)")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """``--checkpoint-every``, ``--keep``, ``--checkpoint-dir`` and ``--resume``: shared by
    ``runtime.train``, ``meshplan run`` and ``meshplan launch``."""
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                        help="asynchronous checkpoint (torch.distributed.checkpoint) every K "
                             "steps into OUT/checkpoints (default 0: none)")
    parser.add_argument("--keep", type=int, default=2, metavar="N",
                        help="newest checkpoints kept (default 2)")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="where checkpoints go: a folder or an object-store URL "
                             "s3://bucket/prefix (credentials and endpoint from "
                             "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL; "
                             "default: OUT/checkpoints)")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="start from the newest valid checkpoint in DIR (a checkpoints "
                             "folder or s3://bucket/prefix, or a run folder: its "
                             "checkpoints/), or from the one checkpoint DIR is (one "
                             "step* folder of a checkpoints folder, checked against its "
                             "manifest)")


def add_straggler_args(parser: argparse.ArgumentParser) -> None:
    """``--straggler-threshold``, ``--straggler-window``, ``--on-straggler`` (`runtime.health`)."""
    from planner.stragglers import STRAGGLER_THRESHOLD, STRAGGLER_WINDOW
    from runtime.health import ON_STRAGGLER
    parser.add_argument("--straggler-threshold", type=float, default=STRAGGLER_THRESHOLD,
                        metavar="SCORE",
                        help="relative performance score (peers' median compute time over "
                             "the rank's) below which a step is slow (default "
                             f"{STRAGGLER_THRESHOLD}, nvidia-resiliency-ext's)")
    parser.add_argument("--straggler-window", type=int, default=STRAGGLER_WINDOW, metavar="N",
                        help=f"consecutive slow steps that confirm a straggler (default "
                             f"{STRAGGLER_WINDOW})")
    parser.add_argument("--on-straggler", choices=ON_STRAGGLER, default="warn",
                        help="a confirmed straggler is logged (warn, default) or evicted: "
                             "checkpoint, leave its node out, re-plan, resume")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault (see the module docstring); ``spec`` is its canonical text."""

    kind: FaultKind
    rank: int | None = None
    step: int | None = None
    factor: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_FIELDS:
            raise ValueError(f"fault kind {self.kind!r} is unknown; use one of "
                             f"{', '.join(FAULT_FIELDS)}")
        if self.step is not None and self.step < 1:
            raise ValueError(f"{self.kind}: step={self.step} must be >= 1 (steps count from 1)")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"{self.kind}: rank={self.rank} must be >= 0")
        if self.factor is not None and not self.factor >= 1.0:
            raise ValueError(f"{self.kind}: factor={self.factor} must be >= 1 (1 = full speed)")

    @property
    def spec(self) -> str:
        names = FAULT_FIELDS[self.kind] + OPTIONAL_FIELDS.get(self.kind, ())
        fields = [f"{n}={getattr(self, n)}" for n in names if getattr(self, n) is not None]
        return f"{self.kind}:{','.join(fields)}"


def parse_fault(spec: str) -> Fault:
    """Parse one ``KIND:key=value,...`` spec.

    >>> parse_fault("kill:rank=1,step=7")
    Fault(kind='kill', rank=1, step=7, factor=None)
    >>> parse_fault("slow:rank=0,factor=2.5").spec
    'slow:rank=0,factor=2.5'

    Raises:
        ValueError: unknown kind, missing or unknown field, or a bad value (the message says
            which fields the kind takes).
    """
    kind, _, rest = spec.strip().partition(":")
    if kind not in FAULT_FIELDS:
        raise ValueError(f"--inject {spec!r}: fault kind {kind!r} is unknown; use one of "
                         f"{', '.join(FAULT_FIELDS)}")
    want = FAULT_FIELDS[kind]
    usage = f"{kind}:" + ",".join(f"{name}=..." for name in want)
    allowed = want + OPTIONAL_FIELDS.get(kind, ())
    values: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise ValueError(f"--inject {spec!r}: field {key!r} is not one of {kind}'s "
                             f"fields; write {usage}")
        values[key] = value
    missing = [name for name in want if name not in values]
    if missing:
        raise ValueError(f"--inject {spec!r}: missing {', '.join(missing)}; write {usage}")
    try:
        typed = {k: float(v) if k == "factor" else int(v) for k, v in values.items()}
    except ValueError as exc:
        raise ValueError(f"--inject {spec!r}: {exc}; write {usage}") from None
    return Fault(kind=kind, **typed)


def parse_faults(specs: list[str] | None) -> list[Fault]:
    """Parse a list of specs (``--inject`` repeated); None or [] gives []."""
    return [parse_fault(s) for s in specs or []]


class Injector:
    """Fires this rank's faults at their steps, each once per job (see the module docstring).

    Args:
        faults: every fault of the job (all ranks read the same list).
        rank: this process's global rank.
        out: the run folder; ``out/faults/fired.jsonl`` records the faults that fired.
    """

    def __init__(self, faults: list[Fault], rank: int, out: Path) -> None:
        self.rank = rank
        self.log = Path(out) / "faults" / "fired.jsonl"
        fired = set()
        if self.log.exists():
            fired = {json.loads(line)["spec"] for line in self.log.read_text().splitlines()}
        self.pending = [f for f in faults if f.spec not in fired]
        self.slow = [f for f in faults if f.kind == "slow" and f.rank == rank]

    def slow_factor(self, step: int) -> float:
        """How many times slower this rank computes at ``step`` (1.0: full speed)."""
        return max([f.factor for f in self.slow if step >= (f.step or 1)] or [1.0])

    def _take(self, kind: str, step: int, *, mine: bool = True) -> Fault | None:
        for fault in self.pending:
            if fault.kind == kind and fault.step == step and (not mine or fault.rank == self.rank):
                self.pending.remove(fault)
                return fault
        return None

    def _record(self, fault: Fault, step: int) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"spec": fault.spec, "rank": self.rank, "step": step,
                           "time_unix_s": time.time(),
                           "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
        with self.log.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def process_fault(self, step: int, before_dying=None) -> None:
        """At the start of ``step``: die (kill) or stop answering (hang) if a fault says so.

        Args:
            before_dying: called first (waits for in-flight checkpoints to land).
        """
        for kind in ("kill", "hang"):
            fault = self._take(kind, step)
            if fault is None:
                continue
            if before_dying is not None:
                before_dying()
            self._record(fault, step)
            print(f"meshplan fault: {fault.spec} fired (rank {self.rank})", flush=True)
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(HANG_S)

    def nan_at(self, step: int) -> bool:
        """Whether step ``step``'s loss becomes NaN (every rank answers the same)."""
        fault = self._take("nan", step, mine=False)
        if fault is not None and self.rank == 0:
            self._record(fault, step)
        return fault is not None

    def corrupt_at(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is to be damaged (asked by the writer, rank 0)."""
        fault = self._take("corrupt-checkpoint", step, mine=False)
        if fault is not None:
            self._record(fault, step)
        return fault is not None


def corrupt_file(path: Path, *, offset_fraction: float = 0.5, count: int = 64) -> None:
    """Flip ``count`` bytes of ``path`` in the middle (the file keeps its size)."""
    path.write_bytes(corrupt_bytes(path.read_bytes(), offset_fraction=offset_fraction,
                                   count=count))


def corrupt_bytes(data: bytes, *, offset_fraction: float = 0.5, count: int = 64) -> bytes:
    """``data`` with ``count`` bytes flipped in the middle (same length)."""
    out = bytearray(data)
    start = int(len(out) * offset_fraction)
    for i in range(start, min(start + count, len(out))):
        out[i] ^= 0xFF
    return bytes(out)


def faults_error(specs, *, steps: int, world: int | None = None,
                 checkpoint_every: int | None = None) -> str | None:
    """The first problem with fault ``specs`` (``--inject`` or a plan file's ``faults:``), or
    None: a spec does not parse, names a rank the job does not have (when ``world``, its world
    size, is given), fires after the last step (``steps``), or damages the checkpoint of a step
    that never checkpoints (when ``checkpoint_every`` is given: checkpoints are written after
    every K-th step and after the last)."""
    try:
        faults = parse_faults(specs)
    except ValueError as exc:
        return str(exc)
    for fault in faults:
        if world is not None and fault.rank is not None and fault.rank >= world:
            return f"--inject {fault.spec}: rank {fault.rank} does not exist (world size {world})"
        if fault.step is not None and fault.step > steps:
            return (f"--inject {fault.spec}: step={fault.step} is beyond --steps {steps}, so "
                    f"it would never fire; use a step from 1 to {steps}, or --steps "
                    f"{fault.step} or more")
        if fault.kind == "corrupt-checkpoint" and checkpoint_every is not None and not (
                checkpoint_every and (fault.step % checkpoint_every == 0
                                      or fault.step == steps)):
            when = (f"--checkpoint-every {checkpoint_every} checkpoints steps "
                    f"{checkpoint_every}, {2 * checkpoint_every}, ... and {steps}"
                    if checkpoint_every else "no --checkpoint-every K: no step checkpoints")
            return (f"--inject {fault.spec}: step {fault.step} writes no checkpoint ({when}), "
                    "so it would never fire; damage a step that checkpoints")
    return None


def fault_flags_error(config) -> str | None:
    """The first problem with the fault flags' own values, or None: an ``--inject`` spec
    (`faults_error` without the world size), ``--checkpoint-every``, ``--keep`` or
    ``--timeout-s``. It needs no plan file and no world size, so `runtime.config.TrainConfig`
    checks it on construction; `runtime.resilience.fault_args_error` checks the rest."""
    if (problem := faults_error(config.inject, steps=config.steps)) is not None:
        return problem
    if config.checkpoint_every < 0:
        return f"--checkpoint-every={config.checkpoint_every} must be >= 0"
    if config.keep < 1:
        return f"--keep={config.keep} must be >= 1"
    if config.timeout_s is not None and not config.timeout_s > 0:
        return f"--timeout-s={config.timeout_s} must be > 0"
    from runtime.health import straggler_flags_error
    return straggler_flags_error(config.straggler_threshold, config.straggler_window,
                                 config.on_straggler)


def fault_cli_args(*, checkpoint_every: int = 0, keep: int = 2, resume=None,
                   checkpoint_dir=None, inject=(), timeout_s: float | None = None,
                   on_nan: str = "stop",
                   straggler_threshold: float | None = None,
                   straggler_window: int | None = None,
                   on_straggler: str = "warn") -> list[str]:
    """``runtime.train`` flags for the fault-tolerance options (defaults give [])."""
    from planner.stragglers import STRAGGLER_THRESHOLD, STRAGGLER_WINDOW
    args: list[str] = []
    if checkpoint_every:
        args += ["--checkpoint-every", str(checkpoint_every)]
    if keep != 2:
        args += ["--keep", str(keep)]
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", str(checkpoint_dir)]
    if resume is not None:
        args += ["--resume", str(resume)]
    for spec in inject:
        args += ["--inject", spec]
    if timeout_s is not None:
        args += ["--timeout-s", str(timeout_s)]
    if on_nan != "stop":
        args += ["--on-nan", on_nan]
    if straggler_threshold not in (None, STRAGGLER_THRESHOLD):
        args += ["--straggler-threshold", str(straggler_threshold)]
    if straggler_window not in (None, STRAGGLER_WINDOW):
        args += ["--straggler-window", str(straggler_window)]
    if on_straggler != "warn":
        args += ["--on-straggler", on_straggler]
    return args


def plan_file_faults(path) -> list[str]:
    """The ``faults:`` list of a plan file (fault specs, as ``--inject`` takes), or []."""
    import yaml
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    faults = data.get("faults") or []
    if not isinstance(faults, list) or not all(isinstance(f, str) for f in faults):
        raise ValueError(f"plan file {path}: 'faults' must be a list of fault specs such as "
                         "'kill:rank=1,step=7'")
    return faults

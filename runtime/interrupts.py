"""Faults from outside the training loop: a signal to `meshplan run`, a killed torchrun agent, a
hung rank's peers timing out.

- **A signal** (SIGTERM, or Ctrl-C's SIGINT) to `meshplan run` is forwarded as SIGTERM to
  torchrun's process group (`forward_signals`): torchrun and its workers live in their own
  session (`runtime.launch`), so without it they would train on as orphans. A worker does not
  die on it (`StopRequest`): it finishes its step, and since every rank's request travels in
  the step's closing all-gather (`runtime.train.gather_step_stats`), all ranks stop after the
  same step, checkpoint it, write the summary and exit 0 (torchrun waits 30 s for its workers
  after forwarding a signal, far longer than a step here). A rank that cannot reach its
  step's end (hung) dies of the signal after a grace period, as it would without the handler.
- **A killed agent** (torchrun SIGKILLed) leaves its workers running; they finish and write
  ``summary.json``. `finished_summary` recognises that the job finished although torchrun's
  exit status says otherwise.
- **A hung rank** stops answering collectives; its peers' collectives time out (or see the
  first peer that timed out go away) and raise. Each rank that fails in a collective records
  it (`record_collective_error`, as any failing rank records its error) before it dies; the
  hung rank is the one that recorded nothing while all the failures were collectives'
  (`hung_ranks`): it was alive and silent while every peer waited for it. torchrun's own
  report names the first rank that *exited*, which is a rank that timed out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

#: Signals a worker turns into a graceful stop, and `meshplan run` forwards.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Words of a collective failure in gloo's and NCCL's errors (timeouts and lost peers).
COLLECTIVE_ERROR_WORDS = ("timed out", "timeout", "connection closed", "connection reset",
                          "broken pipe", "watchdog", "peer")


#: Seconds a signalled worker waits for its step to end before it dies of the signal.
STOP_GRACE_S = 5.0


class StopRequest:
    """A worker's record of a stop signal: installs handlers that note the signal instead of
    dying; ``signum`` is 0 until one arrives.

    A rank that does not reach the end of its step within ``grace_s`` of the signal (a hung
    rank, or one blocked on a dead peer while torchrun tears the group down) dies of the
    signal after all, as without the handler; the training loop calls `at_step_end` when it
    sees the stop, and sets ``grace_s`` from its step time.
    """

    def __init__(self) -> None:
        self.signum = 0
        self.grace_s = STOP_GRACE_S
        self._timer: threading.Timer | None = None
        self._expired = False
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        if self._expired:                  # the grace is over: die of it (main thread)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if self._timer is None:
            self._timer = threading.Timer(self.grace_s, self._die, args=(signum,))
            self._timer.daemon = True
            self._timer.start()

    def _die(self, signum: int) -> None:
        # only the main thread may reset a handler: signal it again, and leave on our own if
        # it is stuck outside Python (a blocked C call runs no handler)
        self._expired = True
        os.kill(os.getpid(), signum)
        time.sleep(STOP_GRACE_S)
        os._exit(128 + signum)

    def at_step_end(self) -> None:
        """The loop stops at this step's end: no need to die of the signal."""
        if self._timer is not None:
            self._timer.cancel()


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15 (any signal number)."""
    return signal.Signals(int(signum)).name


@contextlib.contextmanager
def forward_signals(pgid_of):
    """While inside: SIGTERM and SIGINT to this process are sent on as SIGTERM to the process
    group ``pgid_of()`` (None: not started yet). Yields a list that holds the signal numbers
    received. Outside the main thread (where Python cannot set handlers) it forwards nothing.
    """
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def forward(signum, frame):
        got.append(signum)
        pgid = pgid_of()
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)

    old = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        yield got
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def finished_summary(out: Path, steps: int, started_unix_s: float) -> dict | None:
    """``out/summary.json`` when this launch's workers wrote it (after ``started_unix_s``)
    for all ``steps`` steps without an error, else None."""
    path = Path(out) / "summary.json"
    try:
        if path.stat().st_mtime < started_unix_s:
            return None
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if "error" in summary or summary.get("evicted") or summary.get("interrupted"):
        return None
    return summary if summary.get("steps", 0) >= steps else None


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed on a silent or lost peer."""
    text = str(exc).lower()
    return type(exc).__name__ == "DistBackendError" or any(
        w in text for w in COLLECTIVE_ERROR_WORDS)


def record_collective_error(out: Path, rank: int, step: int, exc: BaseException) -> None:
    """Append this rank's failure to ``out/faults/collective_errors.jsonl`` (every failure:
    a rank that failed for its own reason is not silent); ``collective`` says whether it
    was a collective's (`is_collective_error`)."""
    path = Path(out) / "faults" / "collective_errors.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"rank": rank, "step": step, "time_unix_s": time.time(),
            "collective": is_collective_error(exc),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "error": str(exc).strip().splitlines()[0][:200] if str(exc).strip() else
            type(exc).__name__}
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def hung_ranks(out: Path, world: int, since_unix_s: float) -> tuple[list[int], list[dict]]:
    """(ranks that recorded no collective failure while a peer did, the failures) of the
    attempts that started after ``since_unix_s``, from the last attempt with failures.

    >>> hung_ranks(Path("/nonexistent"), 2, 0.0)
    ([], [])
    """
    path = Path(out) / "faults" / "collective_errors.jsonl"
    try:
        lines = [json.loads(x) for x in path.read_text().splitlines() if x]
    except OSError:
        return [], []
    lines = [x for x in lines if x["time_unix_s"] >= since_unix_s]
    if not lines:
        return [], []
    last = max(x["attempt"] for x in lines)
    errors = [x for x in lines if x["attempt"] == last]
    if not all(x.get("collective", True) for x in errors):
        return [], []               # a rank failed on its own: it is the cause, none hung
    failed = {x["rank"] for x in errors}
    return sorted(set(range(world)) - failed), errors

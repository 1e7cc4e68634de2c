"""Launch a plan file with torchrun and collect its summary.

`torchrun_command` builds the command line (one process per device of the plan, loopback
rendezvous on a free port); `run_plan` runs it with one thread per rank, streams its output, and
returns the parsed ``summary.json``.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

from planner.planfile import read_plan_file

#: Lines of output kept for the error message of a failed run.
TAIL_LINES = 40
#: How `runtime.train` starts its one-line input errors; `run_plan` lifts them to the top.
ERROR_PREFIX = "meshplan run: error"
_REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(plan_file_path: str | os.PathLike, *, steps: int, out_dir: str | os.PathLike,
                     data: str | os.PathLike | None = None, nproc: int | None = None,
                     master_port: int | None = None, seed: int = 0) -> list[str]:
    """The torchrun command line that trains ``plan_file_path`` for ``steps`` steps.

    Args:
        nproc: processes to start; defaults to the plan's world size (tp·pp·dp).
        master_port: rendezvous port on 127.0.0.1; defaults to a free one.
    Raises:
        PlanError: the plan file is missing or invalid.
    """
    if nproc is None:
        nproc = read_plan_file(plan_file_path).plan.world_size
    port = free_port() if master_port is None else master_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "runtime.train", str(plan_file_path), "--steps", str(steps),
           "--out", str(out_dir), "--seed", str(seed)]
    if data is not None:
        cmd += ["--data", str(data)]
    return cmd


def run_plan(plan_file_path: str | os.PathLike, *, steps: int = 10,
             out_dir: str | os.PathLike | None = None, data: str | os.PathLike | None = None,
             seed: int = 0, nproc: int | None = None, timeout_s: float | None = None,
             quiet: bool = False) -> dict:
    """Train a plan with torchrun (``OMP_NUM_THREADS=1``) and return its ``summary.json``.

    Args:
        out_dir: run folder; defaults to ``runs/<plan_id>``.
        nproc: processes to start (default: the plan's world size).
        timeout_s: kill the run after this many seconds (None: no limit).
        quiet: do not echo the run's output.
    Raises:
        RuntimeError: the run exited non-zero or timed out; the message starts with the ranks'
            one-line input errors (if any) and ends with the last lines of the output.
    """
    if out_dir is None:
        out_dir = Path("runs") / read_plan_file(plan_file_path).plan.id
    cmd = torchrun_command(plan_file_path, steps=steps, out_dir=out_dir, data=data,
                           nproc=nproc, seed=seed)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    rc, tail = _stream(cmd, env, timeout_s, quiet)
    if rc != 0:
        errors = list(dict.fromkeys(ln for ln in tail if ln.startswith(ERROR_PREFIX)))
        raise RuntimeError(f"run of {plan_file_path} failed (exit status {rc})\n"
                           + "".join(errors) + "last output:\n" + "".join(tail))
    return json.loads((Path(out_dir) / "summary.json").read_text())


def _stream(cmd: list[str], env: dict, timeout_s: float | None, quiet: bool
            ) -> tuple[int, collections.deque]:
    """Run ``cmd``, echo its merged stdout/stderr line by line; (exit status, output tail)."""
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    timer = None
    if timeout_s is not None:
        timer = threading.Timer(timeout_s, lambda: _kill_group(proc, tail))
        timer.start()
    try:
        for line in proc.stdout:
            tail.append(line)
            if not quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
        return proc.wait(), tail
    finally:
        if timer is not None:
            timer.cancel()


def _kill_group(proc: subprocess.Popen, tail: collections.deque) -> None:
    """Kill a timed-out torchrun and its workers (its own session, started by us)."""
    tail.append("meshplan run: timed out; killed the torchrun process group\n")
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass

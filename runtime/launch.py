"""Launch a plan file with torchrun and collect its summary.

`local_torchrun_command` builds the command line (one process per device of the plan, loopback
rendezvous on a free port); `run_plan` runs it with one thread per rank, streams its output, and
returns the parsed ``summary.json``. A failed run's error ends with one line (`failure_hint`):
the rank that failed, the last step done and the ``--resume`` command when it left a checkpoint.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from planner.launch import torchrun_command
from planner.planfile import read_plan_file
from runtime.faults import fault_cli_args
from runtime.interrupts import finished_summary, forward_signals, hung_ranks, signal_name

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


def local_torchrun_command(plan_file_path: str | os.PathLike, *, steps: int,
                           out_dir: str | os.PathLike, data: str | os.PathLike | None = None,
                           nproc: int | None = None, master_port: int | None = None,
                           seed: int = 0, save_params: str | os.PathLike | None = None,
                           profile: bool = False, attention: str | None = None,
                           max_restarts: int = 0,
                           train_args: list[str] | None = None,
                           ep: int | None = None) -> list[str]:
    """The torchrun command line that trains ``plan_file_path`` on this machine
    (`planner.launch.torchrun_command` with a loopback rendezvous).

    Args:
        nproc: processes to start; defaults to the plan's world size.
        master_port: rendezvous port on 127.0.0.1; defaults to a free one.
        save_params, profile, attention: ``runtime.train``'s ``--save-params FILE``,
            ``--profile`` and ``--attention sdpa|tiled`` (None / False: not passed).
        max_restarts: torchrun ``--max-restarts`` (the whole group restarts on a failure).
        ep: ``runtime.train``'s ``--ep N`` (expert parallel degree; None: not passed).
        train_args: more ``runtime.train`` flags (`runtime.faults.fault_cli_args`).
    Raises:
        PlanError: the plan file is missing or invalid.
    """
    if nproc is None:
        nproc = read_plan_file(plan_file_path).plan.world_size
    extra = ["--seed", str(seed)]
    if save_params is not None:
        extra += ["--save-params", str(save_params)]
    if profile:
        extra += ["--profile"]
    if attention is not None:
        extra += ["--attention", attention]
    if ep is not None:
        extra += ["--ep", str(ep)]
    return torchrun_command(plan_file_path, nproc_per_node=nproc, steps=steps, out_dir=out_dir,
                            data=data, master_port=free_port() if master_port is None
                            else master_port, max_restarts=max_restarts,
                            train_args=extra + list(train_args or []))


def run_plan(plan_file_path: str | os.PathLike, *, steps: int = 10,
             out_dir: str | os.PathLike | None = None, data: str | os.PathLike | None = None,
             seed: int = 0, nproc: int | None = None, timeout_s: float | None = None,
             quiet: bool = False, save_params: str | os.PathLike | None = None,
             profile: bool = False, attention: str | None = None, max_restarts: int = 0,
             checkpoint_every: int = 0, keep: int = 2, resume: str | os.PathLike | None = None,
             checkpoint_dir: str | os.PathLike | None = None,
             inject: list[str] | tuple[str, ...] = (), collective_timeout_s: float | None = None,
             on_nan: str = "stop", ep: int | None = None,
             straggler_threshold: float | None = None,
             straggler_window: int | None = None, on_straggler: str = "warn",
             spares: int = 0, ranks_per_node: int = 1) -> dict:
    """Train a plan with torchrun (``OMP_NUM_THREADS=1``) and return its ``summary.json``.

    Args:
        out_dir: run folder; defaults to ``runs/<plan_id>``.
        nproc: processes to start (default: the plan's world size).
        timeout_s: kill the run after this many seconds (None: no limit).
        quiet: do not echo the run's output.
        save_params: write the full parameters after the last step to this file.
        profile: write torch profiler Chrome traces (``trace_rank{r}.json``) into out_dir.
        attention: "sdpa" or "tiled" (default: $MESHPLAN_ATTENTION, else "sdpa").
        max_restarts: torchrun restarts of the whole group after a failure.
        checkpoint_every, keep, resume, checkpoint_dir, inject, collective_timeout_s, on_nan:
            ``runtime.train``'s ``--checkpoint-every K``, ``--keep N``, ``--resume DIR``,
            ``--checkpoint-dir DIR`` (a folder or ``s3://bucket/prefix``), ``--inject SPEC``
            (each), ``--timeout-s S`` and ``--on-nan stop|skip``.
        ep: expert parallel degree (``--ep``; None: the plan's).
        straggler_threshold, straggler_window, on_straggler: ``--straggler-threshold``,
            ``--straggler-window``, ``--on-straggler`` (`runtime.health`; None: default).
        spares, ranks_per_node: under ``on_straggler="evict"``, spare nodes that may take a
            bad node's place, and ranks per node (a straggler's whole node leaves); the job
            then resumes on the planner's best plan for the ranks left (`runtime.evict`: the
            ranks that stay in their own processes, decided while they wait; relaunched when
            a spare joins) and the summary returned is the whole job's, with ``evictions``.
    Raises:
        RuntimeError: the run exited non-zero or timed out, or stopped on a NaN loss; the
            message starts with the ranks' one-line errors (if any) and ends with the last
            lines of the output.
        PlanError: an eviction left no rank to resume on.
    """
    if out_dir is None:
        out_dir = Path("runs") / read_plan_file(plan_file_path).plan.id
    cmd = local_torchrun_command(plan_file_path, steps=steps, out_dir=out_dir, data=data,
                           nproc=nproc, seed=seed, save_params=save_params, profile=profile,
                           attention=attention, max_restarts=max_restarts, ep=ep,
                           train_args=fault_cli_args(
                               checkpoint_every=checkpoint_every, keep=keep, resume=resume,
                               checkpoint_dir=checkpoint_dir, inject=inject,
                               timeout_s=collective_timeout_s, on_nan=on_nan,
                               straggler_threshold=straggler_threshold,
                               straggler_window=straggler_window, on_straggler=on_straggler))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    flags = resume_flags(data=data, checkpoint_every=checkpoint_every, keep=keep,
                         checkpoint_dir=checkpoint_dir,
                         collective_timeout_s=collective_timeout_s, on_nan=on_nan,
                         max_restarts=max_restarts, straggler_threshold=straggler_threshold,
                         straggler_window=straggler_window, on_straggler=on_straggler)
    flags += ["--ep", str(ep)] if ep else []
    evictions: list[dict] = []
    undecided: list[Exception] = []
    on_line = None
    if on_straggler == "evict":
        # the planner is imported now, before the launch, not while the stopped ranks wait
        import planner.search  # noqa: F401
        from runtime.evict import STOPPED_PREFIX, decide_in_flight

        def on_line(line: str) -> None:
            if not line.startswith(STOPPED_PREFIX) or undecided:
                return
            try:
                evictions.append(decide_in_flight(
                    plan_file_path, out=Path(out_dir), steps=steps, inject=list(inject),
                    spares=spares, ranks_per_node=ranks_per_node, launched_unix_s=started,
                    quiet=quiet))
            except Exception as exc:           # the ranks were told to leave; raised below
                undecided.append(exc)
    started, group = time.time(), []
    with forward_signals(lambda: group[0] if group else None) as signals:
        rc, tail, error_lines, fired = _stream(cmd, env, timeout_s, quiet, on_start=group.append,
                                               on_line=on_line)
    if signals:
        raise RunInterrupted(interrupted_line(signals[0], plan_file_path, out_dir, steps, flags),
                             signals[0])
    if undecided:
        raise undecided[0]
    if rc != 0 and (done := finished_summary(Path(out_dir), steps, started)) is not None:
        # torchrun itself died (killed), its workers finished the job and wrote the summary
        done["launcher_exit_status"] = rc
        (Path(out_dir) / "summary.json").write_text(json.dumps(done, indent=2) + "\n")
        if not quiet:
            print(f"meshplan run: torchrun exited with status {rc}, but its workers finished "
                  f"all {steps} steps: the run finished", flush=True)
        return done
    if rc != 0:
        errors = list(dict.fromkeys(error_lines))
        world = nproc or read_plan_file(plan_file_path).plan.world_size
        # the output was echoed already unless quiet; the last line says what to do next
        hint = failure_hint(list(tail), plan_file_path, out_dir, steps, max_restarts,
                            fired=fired, input_error=bool(errors), resume_flags=flags,
                            hung=hung_ranks(Path(out_dir), world, started))
        raise RuntimeError(f"run of {plan_file_path} failed (exit status {rc})\n"
                           + "".join(errors)
                           + ("last output:\n" + "".join(tail) if quiet else "")
                           + (hint or ""))
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    if "error" in summary:                   # stopped on purpose (runtime.resilience.StopTraining)
        raise RuntimeError(f"run of {plan_file_path} stopped: {summary['error']}")
    if evictions:
        from runtime.evict import finish_launch

        def relaunch(plan, nproc_left, inject_left, spares_left):
            return run_plan(plan, steps=steps, out_dir=out_dir, data=data, seed=seed,
                            nproc=nproc_left, timeout_s=timeout_s, quiet=quiet,
                            save_params=save_params, profile=profile, attention=attention,
                            max_restarts=max_restarts, checkpoint_every=checkpoint_every,
                            keep=keep, resume=checkpoint_dir or Path(out_dir) / "checkpoints",
                            checkpoint_dir=checkpoint_dir,
                            inject=inject_left, collective_timeout_s=collective_timeout_s,
                            on_nan=on_nan, straggler_threshold=straggler_threshold,
                            straggler_window=straggler_window, on_straggler=on_straggler,
                            spares=spares_left, ranks_per_node=ranks_per_node)
        return finish_launch(summary, evictions, out=Path(out_dir), relaunch=relaunch)
    return summary


def failed_rank(lines: list[str]) -> tuple[int, str] | None:
    """(rank, exit code with signal name) of torchrun's "Root Cause (first observed failure)"
    block in ``lines`` (its failure report), or None when the output has none.

    >>> failed_rank(["Root Cause (first observed failure):\\n", "[0]:\\n",
    ...              "  rank      : 1 (local_rank: 1)\\n",
    ...              "  exitcode  : -9 (pid: 3314)  (SIGKILL)\\n"])
    (1, '-9, SIGKILL')
    """
    start = next((i for i, line in enumerate(lines) if line.startswith("Root Cause")), None)
    if start is None:
        return None
    rank = code = None
    for line in lines[start + 1:]:
        key, _, value = line.strip().partition(":")
        if key.strip() == "rank" and rank is None:
            rank = int(value.split()[0])
        elif key.strip() == "exitcode" and code is None:
            words = value.split()
            code = words[0] + (f", {words[-1].strip('()')}" if words[-1].startswith("(SIG")
                               else "")
    return None if rank is None or code is None else (rank, code)


def exit_codes(lines: list[str]) -> dict[int, str]:
    """{rank: exit code} of every entry of torchrun's failure report in ``lines``.

    >>> exit_codes(["  rank      : 1 (local_rank: 1)", "  exitcode  : -15 (pid: 7)",
    ...             "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 6)"])
    {1: '-15', 0: '1'}
    """
    codes, rank = {}, None
    for line in lines:
        key, _, value = line.strip().partition(":")
        if key.strip() == "rank" and value.split():
            rank = int(value.split()[0])
        elif key.strip() == "exitcode" and rank is not None and value.split():
            codes.setdefault(rank, value.split()[0])
            rank = None
    return codes


def resume_flags(*, data=None, checkpoint_every: int = 0, keep: int = 2,
                 checkpoint_dir=None, collective_timeout_s: float | None = None,
                 on_nan: str = "stop",
                 max_restarts: int = 0, straggler_threshold: float | None = None,
                 straggler_window: int | None = None, on_straggler: str = "warn"
                 ) -> list[str]:
    """The ``meshplan run`` flags a resume command repeats: the data and every fault-tolerance
    option of the run (not ``--inject``: injected faults are part of a test, and the ones that
    fired are recorded as done in the run folder anyway).

    >>> resume_flags(checkpoint_every=3, collective_timeout_s=10.0, max_restarts=2)
    ['--checkpoint-every', '3', '--timeout-s', '10.0', '--max-restarts', '2']
    """
    flags = ["--data", str(data)] if data is not None else []
    flags += fault_cli_args(checkpoint_every=checkpoint_every, keep=keep,
                            checkpoint_dir=checkpoint_dir, timeout_s=collective_timeout_s,
                            on_nan=on_nan,
                            straggler_threshold=straggler_threshold,
                            straggler_window=straggler_window, on_straggler=on_straggler)
    return flags + (["--max-restarts", str(max_restarts)] if max_restarts else [])


class RunInterrupted(RuntimeError):
    """`meshplan run` got SIGTERM or SIGINT; the message is one line (`interrupted_line`)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def interrupted_line(signum: int, plan_file_path, out_dir, steps: int,
                     resume_flags: list[str] = ()) -> str:
    """One line: the signal, the steps done and the resume command of the checkpoint the
    workers left (`runtime.interrupts`)."""
    out = Path(out_dir)
    try:
        summary = json.loads((out / "summary.json").read_text())
        done = summary["steps"] if summary.get("interrupted") else None
    except (OSError, ValueError, KeyError):
        done = None
    text = f"meshplan run: stopped by {signal_name(signum)}"
    text += " before any step was logged" if done is None else f" after step {done} of {steps}"
    return text + resume_clause(plan_file_path, out, steps, resume_flags)


def resume_clause(plan_file_path, out: Path, steps: int, resume_flags: list[str] = ()) -> str:
    """``; newest checkpoint stepK: resume with `meshplan run ...`"`` or ``""`` without one.
    The checkpoints are the ``--checkpoint-dir`` of ``resume_flags`` (a folder or an
    object-store URL), else ``out/checkpoints``."""
    from runtime.checkpoint import list_checkpoints, location_name  # imports torch
    flags = list(resume_flags)
    folder = flags[flags.index("--checkpoint-dir") + 1] if "--checkpoint-dir" in flags \
        else out / "checkpoints"
    try:
        checkpoints = list_checkpoints(folder)
    except Exception:              # an object store that cannot be reached now: no clause
        return ""
    if not checkpoints:
        return ""
    return (f"; newest checkpoint {location_name(checkpoints[0])}: resume with `meshplan run "
            f"{plan_file_path} --steps {steps} --out {out} --resume {folder}"
            + "".join(f" {shlex.quote(flag)}" for flag in resume_flags) + "`")


def failure_hint(lines: list[str], plan_file_path, out_dir, steps: int, max_restarts: int,
                 *, fired: list[str] = (), input_error: bool = False,
                 resume_flags: list[str] = (), hung: tuple[list[int], list[dict]] = ([], [])
                 ) -> str | None:
    """The last line of a failed run's error: which rank failed, after which step, and how to
    go on (``--resume OUT/checkpoints`` when the run left a checkpoint); None for an input
    error (its own one-line errors say it all).

    Args:
        lines: the run's last lines of output (torchrun's failure report among them).
        fired: the run's ``meshplan fault: SPEC fired (rank R)`` lines (injected faults).
        resume_flags: flags the resume command repeats (`resume_flags`).
        hung: (ranks that stayed silent while their peers' collectives failed, those
            failures) (`runtime.interrupts.hung_ranks`): the silent rank is named instead
            of the first rank torchrun saw exit.
    """
    if input_error:
        return None
    out = Path(out_dir)
    who = failed_rank(lines)
    fired = list(dict.fromkeys(line.split()[2] for line in fired))
    try:
        done = sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if line)
    except OSError:
        done = 0
    injected = [f"injected fault {spec}" for spec in fired]
    why = ([] if who is None else [f"exit code {who[1]}"]) + injected
    silent, errors = hung
    # a silent rank that died on its own (SIGKILL, a crash) is not hung: torchrun ended a
    # hung one with SIGTERM after its peers failed (-15, or 143 from `StopRequest`)
    codes = exit_codes(lines)
    silent = [r for r in silent if codes.get(r, "-15") in ("-15", "143")]
    if silent and errors:
        waited = sorted({e["rank"] for e in errors})
        text = (f"meshplan run: rank {', '.join(map(str, silent))} hung at step "
                f"{max(e['step'] for e in errors)} of {steps}: rank(s) "
                f"{', '.join(map(str, waited))} failed waiting for it in a collective "
                f"({errors[0]['error']})" + (f" ({'; '.join(injected)})" if injected else ""))
    else:
        text = (f"meshplan run: {'the run' if who is None else f'rank {who[0]}'} failed after "
                f"step {done} of {steps}" + (f" ({'; '.join(why)})" if why else ""))
    if max_restarts:
        text += f", with all {max_restarts} restart(s) used"
    clause = resume_clause(plan_file_path, out, steps, resume_flags)
    if clause:
        text += clause
        if not max_restarts:
            text += " (or add --max-restarts N to restart automatically)"
    else:
        text += ("; no checkpoint to resume from: run again with --checkpoint-every K "
                 "--max-restarts N to survive a failure")
    return text + "\n"


def _stream(cmd: list[str], env: dict, timeout_s: float | None, quiet: bool, on_start=None,
            on_line=None) -> tuple[int, collections.deque, list[str], list[str]]:
    """Run ``cmd`` in a session of its own, echo its merged stdout/stderr line by line;
    ``on_start(pid)`` is called once it runs (its pid is its process group's id), and
    ``on_line(line)`` after each line is echoed.

    Returns:
        (exit status, the last TAIL_LINES lines, every line that starts with ERROR_PREFIX,
        every line that reports an injected fault firing).
    """
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    error_lines: list[str] = []
    fired: list[str] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    if on_start is not None:
        on_start(proc.pid)
    timer = None
    if timeout_s is not None:
        timer = threading.Timer(timeout_s, lambda: _kill_group(proc, tail))
        timer.start()
    try:
        for line in proc.stdout:
            tail.append(line)
            if line.startswith(ERROR_PREFIX):
                error_lines.append(line)
            elif line.startswith("meshplan fault:") and " fired " in line:
                fired.append(line)
            if not quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
            if on_line is not None:
                on_line(line)
        return proc.wait(), tail, error_lines, fired
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

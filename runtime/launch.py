"""Launch a plan file with torchrun and collect its summary.

`local_torchrun_command` builds the command line (one process per device of the plan, loopback
rendezvous on a free port); `run_plan` runs it with one thread per rank, streams the workers'
own output (their stdout and their one-line errors), writes everything torchrun and the workers
print into ``OUT/logs/attempt{N}.log`` (one file per torchrun attempt), and returns the parsed
``summary.json``. A restart is one line (`restart_line`); a failed run's error ends with one
line (`failure_hint`): the rank that failed, the last step done and the ``--resume`` command
when it left a checkpoint.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import selectors
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
#: Folder of the run folder that holds torchrun's and the workers' output, one file per attempt.
LOG_DIR = "logs"
#: torchrun's agent logs this when a worker group fails (torch.distributed.elastic
#: `multiprocessing.api`: "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s").
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: \d+\)")
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
        quiet: do not echo the workers' output and the restart lines (`_stream`; all of it
            is in ``out_dir/logs/attempt{N}.log`` either way).
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
        RunFailed: the run exited non-zero or timed out, or stopped on a NaN loss; the
            message starts with the ranks' one-line errors (if any), under ``quiet`` holds
            the last lines of the output, and ends with `failure_hint`'s line.
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
    world = nproc or read_plan_file(plan_file_path).plan.world_size

    received: list[list[int]] = []

    def on_restart(number: int, rank: int, code: str, fired_now: list[str], log: Path) -> str:
        if received and received[0]:      # stopped by a signal: torchrun does not restart
            return ""
        # the attempt's last step and the evidence of a hang are in the run folder already
        return restart_line(plan_file_path, out_dir, steps, number, max_restarts, (rank, code),
                            fired=fired_now, log=log,
                            hung=hung_ranks(Path(out_dir), world, started))
    with forward_signals(lambda: group[0] if group else None) as signals:
        received.append(signals)
        rc, tail, error_lines, fired, logs = _stream(
            cmd, env, timeout_s, quiet, on_start=group.append, on_line=on_line,
            log_dir=Path(out_dir) / LOG_DIR, max_restarts=max_restarts, on_restart=on_restart)
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
        # the workers' own lines were echoed already unless quiet; the last line says what
        # to do next, and where the rest of the output went
        hint = failure_hint(list(tail), plan_file_path, out_dir, steps, max_restarts,
                            fired=fired, input_error=bool(errors), resume_flags=flags,
                            hung=hung_ranks(Path(out_dir), world, started))
        if hint is not None and logs:
            hint = hint.rstrip("\n") + f"; the workers' output is in {logs[-1]}\n"
        raise RunFailed(f"run of {plan_file_path} failed (exit status {rc})\n"
                        + "".join(errors)
                        + ("last output:\n" + "".join(tail) if quiet else "")
                        + (hint or ""),
                        line=(hint or "".join(errors)).strip() or None,
                        summary=failed_summary(plan_file_path, out_dir, steps, rc,
                                               (hint or "".join(errors)).strip(), logs))
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    if "error" in summary:                   # stopped on purpose (runtime.resilience.StopTraining)
        message = f"run of {plan_file_path} stopped: {summary['error']}"
        raise RunFailed(message, line=message, summary=summary)
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


class RunFailed(RuntimeError):
    """A run that exited non-zero, timed out or stopped on purpose (a NaN loss, an unwritable
    checkpoint folder). ``str()`` is the whole report (the ranks' one-line errors, under
    ``quiet`` the last output, then the `failure_hint` line); ``line`` is the one line a
    console shows; ``summary`` is what ``meshplan run --json`` prints (`failed_summary`, or
    the workers' ``summary.json`` of a run that stopped)."""

    def __init__(self, message: str, *, line: str | None, summary: dict) -> None:
        super().__init__(message)
        self.line = line or message.strip().splitlines()[-1]
        self.summary = summary


def failed_summary(plan_file_path, out_dir, steps: int, status: int, error: str,
                   logs: list[Path]) -> dict:
    """The summary of a run that failed for good: plan id, steps asked for and done (lines of
    ``metrics.jsonl``), torchrun's exit status, the failure line, the log files, and the
    losses of the steps done."""
    out = Path(out_dir)
    try:
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                   if x.strip()]
    except (OSError, ValueError):
        records = []
    try:
        plan_id = read_plan_file(plan_file_path).plan.id
    except Exception:             # the plan file changed under the run: the summary says less
        plan_id = None
    return {"plan_id": plan_id, "failed": True, "exit_status": status, "error": error,
            "steps": steps, "steps_done": len(records),
            "losses": [r["loss"] if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])
                       else None for r in records], "out_dir": str(out),
            "logs": [str(path) for path in logs]}


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
    text = _failure_text(out, steps, failed_rank(lines), fired, exit_codes(lines), hung)
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


def _failure_text(out: Path, steps: int, who: tuple[int, str] | None, fired: list[str],
                  codes: dict[int, str], hung: tuple[list[int], list[dict]]) -> str:
    """``meshplan run: rank 1 failed after step 6 of 10 (exit code -9, SIGKILL; injected fault
    ...)`` or ``meshplan run: rank 1 hung at step 3 of 4: rank(s) 0 failed waiting for it in a
    collective (...)``: `failure_hint`'s and `restart_line`'s first clause.

    Args:
        who: (rank, exit code) torchrun saw fail first, or None.
        fired: ``meshplan fault: SPEC fired (rank R)`` lines.
        codes: {rank: exit code} of the ranks torchrun reported (`exit_codes`).
        hung: `runtime.interrupts.hung_ranks`'s (silent ranks, their peers' failures).
    """
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
    silent = [r for r in silent if codes.get(r, "-15") in ("-15", "143")]
    if silent and errors:
        waited = sorted({e["rank"] for e in errors})
        return (f"meshplan run: rank {', '.join(map(str, silent))} hung at step "
                f"{max(e['step'] for e in errors)} of {steps}: rank(s) "
                f"{', '.join(map(str, waited))} failed waiting for it in a collective "
                f"({errors[0]['error']})" + (f" ({'; '.join(injected)})" if injected else ""))
    return (f"meshplan run: {'the run' if who is None else f'rank {who[0]}'} failed after "
            f"step {done} of {steps}" + (f" ({'; '.join(why)})" if why else ""))


def restart_line(plan_file_path, out_dir, steps: int, number: int, max_restarts: int,
                 who: tuple[int, str], *, fired: list[str] = (), log: Path | None = None,
                 hung: tuple[list[int], list[dict]] = ([], [])) -> str:
    """The one console line of a restart: what failed (`_failure_text`), which restart of how
    many, and the file that holds the failed attempt's output (torchrun's and the workers'
    tracebacks).

    Args:
        number: this restart, 1-based.
        who: (rank, exit code) of the failure torchrun's agent logged first
            (``failed (exitcode: -9) local_rank: 1 ...``; one node: local rank = rank).
        fired, hung: as `failure_hint`'s.
    """
    code = who[1]
    if code.lstrip("-").isdigit() and int(code) < 0:
        from runtime.interrupts import signal_name
        try:
            code = f"{code}, {signal_name(-int(code))}"
        except ValueError:                         # not a signal number
            pass
    text = _failure_text(Path(out_dir), steps, (who[0], code), list(fired), {who[0]: who[1]},
                         hung)
    return (text + f"; restart {number} of {max_restarts} from the newest checkpoint"
            + (f"; the attempt's output is in {log}" if log is not None else "") + "\n")


def _stream(cmd: list[str], env: dict, timeout_s: float | None, quiet: bool, on_start=None,
            on_line=None, log_dir: Path | None = None, max_restarts: int = 0,
            on_restart=None) -> tuple[int, collections.deque, list[str], list[str], list[Path]]:
    """Run ``cmd`` (torchrun) in a session of its own and read its stdout and stderr line by
    line. Every line goes to ``log_dir/attempt{N}.log`` (appended; N counts torchrun's
    attempts); the console (``sys.stdout``, unless ``quiet``) gets the workers' stdout (their
    step lines and ``meshplan ...`` notes) and their one-line errors (`ERROR_PREFIX`), not
    torchrun's logs or the workers' tracebacks (stderr). ``on_start(pid)`` is called once it
    runs (its pid is its process group's id), ``on_line(line)`` after each line, and
    ``on_restart(number, rank, exit_code, fired_lines, log)`` when torchrun's agent reports a
    failed attempt it will restart (the number-th failure, number <= ``max_restarts``); the
    line it returns is echoed.

    Returns:
        (exit status, the last TAIL_LINES lines, every line that starts with ERROR_PREFIX,
        every line that reports an injected fault firing, the log files written).
    """
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    error_lines: list[str] = []
    fired: list[str] = []
    logs: list[Path] = []
    state = {"attempt": 0, "fired_from": 0, "log": None, "echo": not quiet}

    def open_log():
        if log_dir is None:
            return None
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / f"attempt{state['attempt']}.log"
        logs.append(path)
        f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed at the next attempt
        f.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} torchrun attempt "
                f"{state['attempt']}: {shlex.join(cmd)}\n")
        return f

    def echo(line: str) -> None:
        if state["echo"]:
            sys.stdout.write(line)
            sys.stdout.flush()

    def handle(line: str, stream: str) -> None:
        tail.append(line)
        if state["log"] is not None:
            state["log"].write(line)
            state["log"].flush()
        if line.startswith(ERROR_PREFIX):
            error_lines.append(line)
        elif line.startswith("meshplan fault:") and " fired " in line:
            fired.append(line)
        if stream == "stdout" or line.startswith(ERROR_PREFIX):
            echo(line)
        if on_line is not None:
            on_line(line)
        failed = _AGENT_FAILED.search(line) if stream == "stderr" else None
        if failed is not None and state["attempt"] < max_restarts:
            state["attempt"] += 1
            if on_restart is not None:
                echo(on_restart(state["attempt"], int(failed.group(2)), failed.group(1),
                                fired[state["fired_from"]:], logs[-1] if logs else None))
            state["fired_from"] = len(fired)
            if state["log"] is not None:
                state["log"].close()
                state["log"] = open_log()

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    if on_start is not None:
        on_start(proc.pid)
    timer = None
    if timeout_s is not None:
        timer = threading.Timer(timeout_s, lambda: _kill_group(proc, tail))
        timer.start()
    state["log"] = open_log()
    pipes = {proc.stdout: "stdout", proc.stderr: "stderr"}
    try:
        _read_lines(pipes, handle)
        return proc.wait(), tail, error_lines, fired, logs
    except BaseException:
        # this process cannot echo any more (its own stdout closed, ...): stop the group
        # rather than leave it training unwatched, its last words into the log
        state["echo"] = False
        _stop_group(proc, lambda: _read_lines(pipes, handle))
        raise
    finally:
        if timer is not None:
            timer.cancel()
        if state["log"] is not None:
            state["log"].close()


def _read_lines(pipes: dict, handle) -> None:
    """Call ``handle(line, name)`` for each line of the binary ``pipes`` ({file: name}) as it
    arrives, until all of them close. When several are readable the first one's data is taken
    first: the workers' stdout before the agent's report of their end, which they preceded."""
    order = list(pipes)
    partial = {f: b"" for f in pipes}
    with selectors.DefaultSelector() as sel:
        for f in pipes:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map():
            for key, _ in sorted(sel.select(), key=lambda e: order.index(e[0].fileobj)):
                f = key.fileobj
                chunk = os.read(f.fileno(), 65536)
                if not chunk:
                    sel.unregister(f)
                    if partial[f]:
                        handle(partial[f].decode(errors="replace") + "\n", pipes[f])
                    continue
                *lines, partial[f] = (partial[f] + chunk).split(b"\n")
                for line in lines:
                    handle(line.decode(errors="replace") + "\n", pipes[f])


def _stop_group(proc: subprocess.Popen, drain, grace_s: float = 30.0) -> None:
    """SIGTERM to torchrun's process group (the workers checkpoint the step they are in and
    exit, `runtime.interrupts`) while ``drain()`` reads its output to the end; SIGKILL if it
    has not ended after ``grace_s``."""
    try:
        os.killpg(proc.pid, 15)
    except ProcessLookupError:
        return
    killer = threading.Timer(grace_s, lambda: _kill_group(proc, collections.deque()))
    killer.start()
    try:
        drain()
        proc.wait()
    finally:
        killer.cancel()


def _kill_group(proc: subprocess.Popen, tail: collections.deque) -> None:
    """Kill a timed-out torchrun and its workers (its own session, started by us)."""
    tail.append("meshplan run: timed out; killed the torchrun process group\n")
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass

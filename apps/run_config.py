"""The resolved configuration of `meshplan run`: echoed before the run, saved beside its outputs.

``run_config.json`` (SI units) sits in the run folder next to ``plan.yaml``, ``metrics.jsonl``
and ``summary.json``, so a run folder says exactly what was run and how.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from planner import __version__
from planner.planfile import check_runnable, read_plan_file
from planner.spec import PlanError, check_plan

RUN_CONFIG_NAME = "run_config.json"


def run_folder(out_dir: str | os.PathLike | None, plan_id: str) -> Path:
    """The run folder of ``--out out_dir``: ``out_dir``, by default ``runs/<plan id>``."""
    return Path(out_dir) if out_dir else Path("runs") / plan_id


def resolved_run_config(plan_path: str | os.PathLike, *, steps: int,
                        out_dir: str | os.PathLike | None, data: str | None,
                        faults: dict | None = None, ep: int | None = None) -> dict:
    """Every setting of a run, defaults filled in: plan file, model, plan, cluster, steps,
    data, run folder, fault-tolerance options and the torchrun command line.

    Args:
        faults: `runtime.launch.run_plan`'s fault keywords (`apps.cmd_faults.run_fault_kwargs`:
            checkpoint_every, keep, resume, checkpoint_dir, inject, collective_timeout_s, on_nan,
            max_restarts); None: the defaults. The command carries every one that is not a
            default, so running it reproduces the run.
        ep: expert parallel degree (``--ep``; None: the plan's).
    Raises:
        PlanError: the plan file is missing or invalid.
    """
    from runtime.faults import fault_cli_args
    from runtime.launch import local_torchrun_command
    pf = read_plan_file(plan_path)
    out = run_folder(out_dir, pf.plan.id)
    plan = pf.to_dict()["plan"]
    options = {"checkpoint_every": 0, "keep": 2, "resume": None, "checkpoint_dir": None,
               "inject": [],
               "collective_timeout_s": None, "on_nan": "stop", "max_restarts": 0,
               "straggler_threshold": None, "straggler_window": None, "on_straggler": "warn",
               "spares": 0, "ranks_per_node": 1,
               **(faults or {})}
    options["resume"] = None if options["resume"] is None else str(options["resume"])
    options["inject"] = list(options["inject"])
    train_args = fault_cli_args(
        checkpoint_every=options["checkpoint_every"], keep=options["keep"],
        resume=options["resume"], checkpoint_dir=options["checkpoint_dir"],
        inject=options["inject"],
        timeout_s=options["collective_timeout_s"], on_nan=options["on_nan"],
        straggler_threshold=options["straggler_threshold"],
        straggler_window=options["straggler_window"], on_straggler=options["on_straggler"])
    command = local_torchrun_command(plan_path, steps=steps, out_dir=out, data=data,
                               nproc=pf.plan.world_size, master_port=0,
                               max_restarts=options["max_restarts"], train_args=train_args,
                               ep=ep)
    return {"meshplan_version": __version__, "plan_file": str(plan_path),
            "plan_id": pf.plan.id, "world_size": pf.plan.world_size, "steps": steps,
            "data": data or "python-stdlib-sources", "out_dir": str(out),
            "omp_num_threads": 1, "model": dataclasses.asdict(pf.model), "plan": plan,
            "cluster": pf.cluster.to_dict(), "faults": options,
            "command": shlex.join(["python", *command[1:]]).replace(
                "--master-port 0", "--master-port FREE_PORT")}


def check_run_args(args) -> None:
    """Check `meshplan run`'s plan and flags before torchrun starts any worker.

    A ``--resume`` run folder becomes its ``checkpoints/`` folder
    (`runtime.resilience.resume_folder`).

    Raises:
        PlanError: the plan file is invalid or context-parallel; a flag is out of range (a
            fault beyond --steps, a --resume folder without checkpoints); the data file is
            missing; or the plan needs devices this machine does not have (a GPU cluster's
            plan without CUDA, or more ranks than GPUs: multi-node plans go through
            `meshplan launch`).
    """
    import torch

    from runtime.config import TrainConfig
    from runtime.resilience import fault_args_error, resume_folder
    pf = read_plan_file(args.plan)
    from apps.format import check_output_path
    check_output_path("--out", run_folder(args.out, pf.plan.id), folder=True)
    check_runnable(pf.plan)
    from runtime.precision import machine_dtype_error
    if (problem := machine_dtype_error(pf.plan.dtype)) is not None:
        raise PlanError(problem)   # e.g. an FP8 plan on a CPU: refused, not run as fp32
    # --steps and the fault flags, checked as runtime.train's workers check them
    config = TrainConfig.from_args(args, out_dir=str(run_folder(args.out, pf.plan.id)))
    if args.max_restarts < 0:
        raise PlanError(f"--max-restarts={args.max_restarts} must be >= 0")
    if args.spares < 0:
        raise PlanError(f"--spares={args.spares} must be >= 0")
    if args.ranks_per_node < 1 or pf.plan.world_size % args.ranks_per_node:
        raise PlanError(f"--ranks-per-node={args.ranks_per_node} must divide the world size "
                        f"{pf.plan.world_size} of plan {pf.plan.id}")
    if args.data is not None and Path(args.data).is_dir():
        raise PlanError(f"--data {args.data!r} is a folder; --data takes one UTF-8 text file "
                        f"to train on (e.g. --data corpus.txt; join a folder's files with "
                        f"`cat {args.data.rstrip('/')}/*.txt > corpus.txt`)")
    if args.data is not None and not Path(args.data).is_file():
        raise PlanError(f"--data file {args.data!r} does not exist")
    if args.data is not None:
        from runtime.data import read_corpus
        try:
            read_corpus(args.data, pf.model.seq_len)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
    from runtime.train import cluster_block_error, moe_plan_error
    if (problem := cluster_block_error(pf)) is not None:
        raise PlanError(problem)
    from runtime.parallel.ep import with_ep
    plan = with_ep(pf.plan, config.ep)                  # --ep, checked as the workers do
    check_plan(pf.model, plan)
    if (problem := moe_plan_error(pf.model, plan)) is not None:
        raise PlanError(problem)
    if (problem := fault_args_error(config, world=pf.plan.world_size,
                                    global_batch=pf.plan.global_batch)) is not None:
        raise PlanError(problem)
    if args.resume is not None:
        args.resume = str(resume_folder(args.resume))   # a run folder: its checkpoints/
    world, gpus = pf.plan.world_size, torch.cuda.device_count()
    if not pf.cluster.is_localhost and gpus == 0:
        raise PlanError(
            f"plan {pf.plan.id} is for cluster {pf.cluster.name!r} ({world} GPUs) and "
            f"this machine has no CUDA device; plan for it with --cluster localhost-cpu, or "
            f"start it on the cluster with `meshplan launch`")
    if gpus and world > gpus:
        raise PlanError(f"plan {pf.plan.id} needs {world} GPUs, this node has {gpus}; start "
                        f"it across nodes with `meshplan launch {args.plan} --nodes N ...`")


def echo_run_config(console: Console, config: dict) -> None:
    """Print the resolved configuration in a few lines."""
    from rich.markup import escape
    model, plan = config["model"], config["plan"]
    # names and paths come from the user's files: never read as rich markup
    console.print(f"[bold]run {escape(config['plan_id'])}[/] ({config['world_size']} ranks, "
                  f"{config['steps']} steps) -> {escape(config['out_dir'])}", highlight=False)
    console.print(f"  model   {model['name']}: {model['num_layers']} layers, hidden "
                  f"{model['hidden']}, seq {model['seq_len']}", highlight=False, markup=False)
    console.print(f"  plan    tp {plan['tp']} pp {plan['pp']} dp {plan['dp']}, micro-batch "
                  f"{plan['micro_batch']}, global batch {plan['global_batch']}, "
                  f"{plan['schedule']}, recompute {plan['recompute']}, dtype {plan['dtype']}",
                  highlight=False, markup=False)
    console.print(f"  data    {config['data']}", highlight=False, markup=False)
    console.print(f"  command {config['command']}", highlight=False, markup=False)


def save_run_config(config: dict) -> Path:
    """Write ``run_config.json`` into the run folder (created) and return its path."""
    out = Path(config["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / RUN_CONFIG_NAME
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def _steps_done(metrics_path: Path, since: float = 0.0, total: int | None = None) -> int:
    """The job's last step in ``metrics.jsonl`` (its records' ``step``: a run resumed from
    step k counts on from k, though its own file may hold only the steps after k), once the
    run has written it (a file older than ``since`` is a previous run's), at most ``total``."""
    try:
        if metrics_path.stat().st_mtime < since:
            return 0
        with open(metrics_path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError:
        return 0
    done = 0
    for line in lines:
        try:
            done = max(done, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):    # a line being written: the next poll
            continue
    return done if total is None else min(done, total)


def with_step_progress(console: Console, config: dict, run: Callable[[], dict],
                       poll_s: float = 0.5) -> dict:
    """Call ``run()`` under a progress bar of the steps written to the run's metrics.jsonl.

    The run's own output (its step lines) goes to ``console``'s stream: stderr when the console
    is on stderr (``--json``), so stdout keeps one JSON object.
    """
    metrics = Path(config["out_dir"]) / "metrics.jsonl"
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("steps"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        from rich.markup import escape
        task = progress.add_task(f"training {escape(config['plan_id'])}", total=config["steps"])
        stop, since = threading.Event(), time.time()

        def poll() -> None:
            while not stop.wait(poll_s):
                progress.update(task, completed=_steps_done(metrics, since, config["steps"]))

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        try:
            with contextlib.redirect_stdout(sys.stderr if console.stderr else sys.stdout):
                return run()
        finally:
            stop.set()
            watcher.join()
            progress.update(task, completed=_steps_done(metrics, since, config["steps"]))

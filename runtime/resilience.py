"""Fault tolerance of one training job: checkpoints, exact resume, injected faults, NaN policy.

`runtime.train` builds one `Resilience` per rank after its model and optimizer and calls it at
four points: ``wrap`` (the step function), ``resume`` (before the loop), ``after_step`` (after
each step's record) and ``close`` (after the loop). Under ``torchrun --max-restarts`` a failed
attempt is restarted as a whole group; the new attempt finds the newest valid checkpoint in
``OUT/checkpoints`` and continues from it, so the job's files describe the whole job:

- ``metrics.jsonl`` keeps the steps up to the checkpoint and drops the replayed ones (each step
  is logged once, by the attempt that kept it);
- ``consumed/dp{r}.jsonl``: the sample ids data-parallel rank r trained on, one line per step
  (same rule), so a test can compare the ordered list with an uninterrupted run's;
- ``faults/events.jsonl``: attempts, resumes, checkpoints and step end times (rank 0), from
  which ``summary.json`` gets ``restarts``, ``steps_lost`` (steps computed again, counting the
  interrupted one), ``wall_time_lost_s`` (from the end of the step a restart resumed from to
  training again: the lost work plus detection, restart and load) and ``wall_time_s``.

Exact resume: a checkpoint holds model and optimizer state (DCP), and per rank the RNG states
and the data position (steps done, samples this DP rank consumed, global samples consumed, the
global batch and the mesh). The data loader is a pure function of (seed, step)
(`runtime.data.ByteBatches`), so the resumed run trains on sample ``k·B`` onwards, whatever
the number of steps left and whatever the new layout: a checkpoint written by 2 ranks resumes
on 1 (or the other way round) with the same sample sequence, DCP resharding the state; the
RNG states are then re-seeded from (seed, step, rank) (`Resilience._restore_position`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.accounting import (  # noqa: F401 - job_accounting, read_events: public here too
    checkpoint_blocking_times_s,
    job_accounting,
    next_attempt,
    read_events,
)
from runtime.checkpoint import (
    CheckpointManager,
    CheckpointStore,
    checkpoint_location,
    is_checkpoint,
    join,
    list_checkpoints,
    load_extra,
    location_name,
    parent_location,
    read_manifest,
    resume_candidates,
    rng_state,
    saved_world_size,
    set_rng_state,
    verify,
)
from runtime.config import TrainConfig
from runtime.faults import Injector, faults_error, parse_faults, plan_file_faults
from runtime.health import StragglerDetector, job_stragglers, straggler_line
from runtime.interrupts import signal_name
from runtime.parallel.cp import cp_rank, cp_size


def fault_args_error(config: TrainConfig, world: int | None = None,
                     global_batch: int | None = None) -> str | None:
    """The first problem with the fault options that needs the launch (checked before any
    collective, by ``meshplan run`` before torchrun starts and by every worker), or None: a
    fault of ``--inject`` or of the plan file's ``faults:`` list that names a rank the job does
    not have, a plan-file fault that does not parse or fires after the last step, a checkpoint
    folder that cannot be written (`checkpoint_folder_error`), or a ``--resume`` folder
    without checkpoints, whose every checkpoint is damaged, or whose newest valid checkpoint
    was trained with another global batch (`resume_error`). The options' own values are
    checked when the `TrainConfig` is built (`runtime.faults.fault_flags_error`).

    ``world`` is the job's world size (default: this process's ``WORLD_SIZE``);
    ``global_batch`` the plan's (None: not checked)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    problem = faults_error(all_fault_specs(config), steps=config.steps, world=world,
                           checkpoint_every=config.checkpoint_every)
    folder = checkpoint_location(config.checkpoint_dir or Path(config.out_dir) / "checkpoints")
    # a restart resumes its own checkpoints; the --resume folder was checked by attempt 0
    resuming = problem is None and config.resume is not None and attempt_number() == 0
    if resuming:       # before the probe of the checkpoint folder, which creates it
        try:
            source = resume_folder(config.resume)
        except ValueError as exc:
            return str(exc)
    if problem is None and (config.checkpoint_every or config.resume is not None):
        problem = checkpoint_folder_error(folder)
    if problem is None and resuming:
        problem = resume_error(source, global_batch, config.steps)
        if problem is None and is_checkpoint(source) and \
                _same_location(parent_location(source), folder):
            newer = [location_name(c) for c in list_checkpoints(folder)
                     if location_name(c) > location_name(source)]
            if newer:   # a restart would load them: steps of the run this resume replaces
                problem = (f"--resume {str(source)!r}: its run's checkpoint folder also holds "
                           f"the later {', '.join(newer)}, which a restart of this run would "
                           f"take for its own; resume into another run folder (--out NEW), "
                           f"or remove {', '.join(newer)} first")
    return problem


def checkpoint_folder_error(folder: str | os.PathLike) -> str | None:
    """Why checkpoints cannot be written into ``folder``, or None: it is created if missing
    and a probe file is written and removed (a real write: permission bits say nothing to
    root, and a read-only mount or a file in the way only shows on writing). An object-store
    URL gets a probe object (a missing bucket, bad credentials or an unreachable endpoint show
    here)."""
    folder = checkpoint_location(folder)
    if not isinstance(folder, Path):
        store = CheckpointStore(folder)
        probe = join(folder, f".write-probe-{os.getpid()}")
        try:
            store.write_bytes(probe, b"")
            store.remove_file(probe)
        except Exception as exc:       # botocore and s3fs raise many kinds; all mean the same
            return (f"checkpoint location {folder!r} cannot be written ({type(exc).__name__}: "
                    f"{str(exc)[:200]}); create the bucket, check AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL, or give a local --checkpoint-dir")
        return None
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return (f"checkpoint folder {str(folder)!r} cannot be written ({exc.strerror or exc}); "
                "make it writable, or give a writable run folder with --out")
    return None


def resume_error(folder: Path | str, global_batch: int | None = None,
                 steps: int | None = None) -> str | None:
    """Why the checkpoints of ``folder`` cannot be resumed, or None: every one of them fails
    its checksums (`runtime.checkpoint.verify`), so a resume would silently start from step
    0; the newest valid one was trained with another global batch than ``global_batch``
    (step k trains on samples [k·B, (k+1)·B), so another B skips or repeats samples); or it
    is at step ``steps`` or later, so the job would have no step left to train (None: not
    checked)."""
    damaged = []
    for candidate in resume_candidates(folder):
        if (problem := verify(candidate)) is not None:
            damaged.append(f"{location_name(candidate)}: {problem}")
            continue
        try:
            extra = load_extra(candidate, 0, saved_world_size(candidate))
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            damaged.append(f"{location_name(candidate)}: extra_rank0.pt does not load ({exc})")
            continue
        saved = extra.get("global_batch", global_batch)
        if global_batch is not None and saved != global_batch:
            return (f"--resume {str(folder)!r}: checkpoint {location_name(candidate)} was "
                    f"trained with global_batch={saved}, this plan has global_batch="
                    f"{global_batch}; resume with a plan of global_batch={saved} (any tp, pp, dp and micro-batch that "
                    "divide it), or start a new run without --resume")
        step = int(read_manifest(candidate)["step"])
        if steps is not None and step >= steps:
            return (f"--resume {str(folder)!r}: its newest checkpoint is step {step}, so "
                    f"--steps {steps} has nothing left to train; give --steps {step + 1} "
                    "or more")
        return None
    return (f"--resume {str(folder)!r}: every checkpoint is damaged ({'; '.join(damaged)}); "
            "nothing to resume from: start a new run without --resume")


def resume_folder(path: str | os.PathLike) -> Path | str:
    """The checkpoints that ``--resume path`` means: ``path`` itself when it is one
    checkpoint (a ``step*`` folder with its manifest: that one is loaded) or holds
    checkpoints (``step*/`` folders: the newest valid one is), else a run folder's
    ``path/checkpoints``; ``path`` may be an object-store URL (``s3://bucket/prefix``,
    returned as a string).

    Raises:
        ValueError: ``path`` does not exist, or neither it nor ``path/checkpoints`` holds a
            checkpoint (the message names both and the fix).
    """
    folder = checkpoint_location(path)
    if is_checkpoint(folder):
        return folder
    if not isinstance(folder, Path):
        for candidate in (folder, join(folder, "checkpoints")):
            if list_checkpoints(candidate):
                return candidate
        raise ValueError(f"--resume {path!r}: no finished checkpoint under it nor under "
                         f"{join(folder, 'checkpoints')!r} (no step*/ prefix with a "
                         f"manifest.json); resume from the --checkpoint-dir of a run with "
                         "--checkpoint-every K")
    if not folder.is_dir():
        raise ValueError(f"--resume folder {str(path)!r} does not exist; give a run folder "
                         "(OUT of a run with --checkpoint-every K) or its checkpoints/ folder")
    if list_checkpoints(folder):
        return folder
    if list_checkpoints(folder / "checkpoints"):
        return folder / "checkpoints"
    raise ValueError(f"--resume {str(path)!r}: no checkpoint in it nor in "
                     f"{str(folder / 'checkpoints')!r} (no step*/ folder); resume from the run "
                     "folder of a run with --checkpoint-every K, or its checkpoints/ folder")


def all_fault_specs(config: TrainConfig) -> list[str]:
    """``--inject`` specs followed by the plan file's ``faults:`` list."""
    return list(config.inject) + plan_file_faults(config.plan_path)


class StopTraining(RuntimeError):
    """The run stops on purpose (a NaN loss with ``--on-nan stop``); not worth a restart."""


def attempt_number() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Resilience:
    """One rank's fault tolerance (see the module docstring).

    Args:
        config: the run's `TrainConfig` (the fault-tolerance options, ``out_dir``, ``steps``).
        modules / optimizer: this rank's parallel modules and their optimizer.
        mesh: the run's DeviceMesh (axes "pp", "dp", "tp", and "cp" when cp > 1).
        batches: the run's `runtime.data.ByteBatches`.
        dp: the plan's data-parallel degree.
        build_started_unix_s: when this attempt began to read its plan and build its process
            group, mesh, model and optimizer; the "attempt_start" event keeps the span
            (``build_s``), the evidence of what resuming in place costs (`runtime.evict`).
    """

    def __init__(self, config: TrainConfig, *, modules, optimizer, mesh, batches,
                 dp: int, build_started_unix_s: float | None = None) -> None:
        self.config, self.modules, self.batches, self.dp = config, modules, batches, dp
        self.rank = dist.get_rank()
        self.out = Path(config.out_dir)
        self.restart = attempt_number()      # torchrun's restart count of this launch
        self.dp_rank = mesh["dp"].get_local_rank()
        axes = ("pp", "dp", "tp") + (("cp",) if cp_size(mesh) > 1 else ())
        self.mesh_shape = {axis: mesh[axis].size() for axis in axes}
        # one writer per DP rank: its first TP (and CP) peer of the first pipeline stage
        self.writes_consumed = mesh["tp"].get_local_rank() == 0 and \
            mesh["pp"].get_local_rank() == 0 and cp_rank(mesh) == 0
        self.ckpt_dir = checkpoint_location(config.checkpoint_dir or self.out / "checkpoints")
        self.events = self.out / "faults" / "events.jsonl"
        # a resume into the run folder that wrote the checkpoint continues that job's records;
        # so does an elastic start that finds the job's checkpoints: torchrun restarts a group
        # whose membership changed (a node joined) without counting a restart
        self.continues_job = (config.resume is not None and (
            _same_location(config.resume, self.ckpt_dir) or
            is_checkpoint(config.resume) and
            _same_location(parent_location(config.resume), self.ckpt_dir))) or \
            (config.elastic and bool(list_checkpoints(self.ckpt_dir)))
        self.attempt = 0              # the job's attempt number, across launches (rank 0)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.restart == 0 and not self.continues_job:
                shutil.rmtree(self.out / "faults", ignore_errors=True)
                shutil.rmtree(self.out / "consumed", ignore_errors=True)
                # a new job starts a clean OUT/checkpoints (never a --checkpoint-dir's content)
                if config.checkpoint_dir is None:
                    shutil.rmtree(self.ckpt_dir, ignore_errors=True)
            self.attempt = next_attempt(self._read_events())
            built = {} if build_started_unix_s is None else {
                "build_s": time.time() - build_started_unix_s}
            self._event("attempt_start", launch_restart=self.restart, **built)
        dist.barrier()
        self.injector = Injector(parse_faults(all_fault_specs(config)), self.rank, self.out)
        self.health = StragglerDetector(threshold=config.straggler_threshold,
                                        window=config.straggler_window)
        self.evicted: dict | None = None
        self.interrupted: str | None = None
        # an eviction or a stop signal checkpoints the step it stopped at, with or without
        # --checkpoint-every
        self.checkpoints = CheckpointManager(
            self.ckpt_dir, modules, optimizer, keep=config.keep,
            asynchronous=not config.sync_checkpoint, corrupt_at=self.injector.corrupt_at,
            timeout_s=config.timeout_s or 120.0)
        self.done = 0                  # steps done (the next step is done + 1)
        self.records: list[dict] = []
        self.skipped_steps: list[int] = []
        self.fallbacks: list[str] = []
        self._unlogged_checkpoint: int | None = None

    # -- events ----------------------------------------------------------------------------
    def _event(self, event: str, **fields) -> None:
        self.events.parent.mkdir(parents=True, exist_ok=True)
        line = {"event": event, "attempt": self.attempt, "time_unix_s": time.time(), **fields}
        with self.events.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def _read_events(self) -> list[dict]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line]

    # -- the step ---------------------------------------------------------------------------
    def wrap(self, step_fn):
        """The step function with this rank's faults (kill / hang / slow / nan) and the NaN
        skip policy applied."""
        def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            k = self.done + 1
            self.injector.process_fault(k, before_dying=self._land)
            start = time.perf_counter()
            share = step_fn(inputs, targets)
            if self.checkpoints is not None:
                self.checkpoints.wait_staged()     # the optimizer step may change params now
            if (factor := self.injector.slow_factor(k)) > 1.0:
                time.sleep((factor - 1.0) * (time.perf_counter() - start))
            if self.injector.nan_at(k):
                share = share * float("nan")
                for p in self._params():
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
            if self.config.on_nan == "skip" and self._any_rank_nonfinite(share):
                for p in self._params():
                    p.grad = None                    # AdamW skips parameters without grads
                self.skipped_steps.append(k)
            return share
        return step

    def _params(self):
        return (p for m in self.modules for p in m.parameters())

    def _any_rank_nonfinite(self, share: torch.Tensor) -> bool:
        flag = torch.tensor([0.0 if math.isfinite(float(share)) else 1.0], device=share.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _land(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.wait_landed()

    # -- resume -----------------------------------------------------------------------------
    def resume(self) -> tuple[int, list[dict]]:
        """Load the newest valid checkpoint (a restart's own, else ``--resume``'s).

        Returns:
            (steps already done, the records of those steps on rank 0 ([] elsewhere)); the
            caller appends its new records to that list.
        """
        source = None
        if (self.restart > 0 or self.config.elastic) and list_checkpoints(self.ckpt_dir):
            source = self.ckpt_dir
        elif self.config.resume is not None:
            source = checkpoint_location(self.config.resume)
        step, extra = 0, None
        if source is not None and self.checkpoints is not None:
            step, extra, self.fallbacks = self.checkpoints.load_latest(source)
            for line in self.fallbacks if self.rank == 0 else []:
                print(f"meshplan checkpoint: {line}", flush=True)
        if extra is not None:
            self._restore_position(step, extra)
        self.done = step
        # the job's own records up to the checkpoint; a new job (a fresh start, or a resume
        # from another run's checkpoint) starts empty records
        kept = step if self.restart > 0 or self.continues_job else 0
        self._trim("metrics.jsonl", kept, rank0=True)
        if self.writes_consumed:
            self._trim(f"consumed/dp{self.dp_rank}.jsonl", kept)
        # DP ranks of an earlier, wider layout (an elastic job that lost a node) keep the
        # steps up to the checkpoint only: the steps after it are trained again by this one
        for path in sorted((self.out / "consumed").glob("dp*.jsonl")) if self.rank == 0 else []:
            if int(path.stem.removeprefix("dp")) >= self.dp:
                self._trim(f"consumed/{path.name}", kept)
        if self.rank == 0:
            path = self.out / "metrics.jsonl"
            self.records = [json.loads(x) for x in path.read_text().splitlines() if x]
            self._event("resumed", from_step=step, skipped=self.fallbacks,
                        source=None if source is None else str(source))
        return step, self.records

    def _restore_position(self, step: int, extra: dict) -> None:
        """Check the data position of a checkpoint and restore (or re-derive) the RNG states.

        The position is job-wide: after step k the job has consumed k·B global samples, and
        the loader maps step k to samples [k·B, (k+1)·B) whatever the DP degree, so a resume
        on another layout continues the same sample sequence as long as B is the same. The
        RNG states are reused when the checkpoint was written by the same mesh (pp, dp, tp);
        otherwise (another world size or layout) a saved state belongs to a process with
        another role, so every rank is seeded from (seed, step, rank) (`resumed_rng_seed`).

        Raises:
            RuntimeError: a different global batch, or a position that does not match step k.
        """
        batch = self.batches.global_batch
        saved_batch = extra.get("global_batch", batch)
        if saved_batch != batch:
            raise RuntimeError(
                f"checkpoint of step {step} was trained with global_batch={saved_batch}; this "
                f"plan has global_batch={batch}. Step k trains on samples [k*B, (k+1)*B), so "
                f"another B would skip or repeat samples; resume with global_batch="
                f"{saved_batch} (any tp, pp, dp and micro-batch that divide it)")
        consumed = extra.get("global_samples_consumed")
        if consumed is None:                       # written before the job-wide field existed
            consumed = extra["samples_consumed"] * self.dp
        if consumed != step * batch:
            raise RuntimeError(f"checkpoint of step {step}: {consumed} global samples consumed, "
                               f"expected step x global_batch = {step} x {batch} = "
                               f"{step * batch}")
        same_mesh = ("resharded_from" not in extra
                     and extra.get("mesh_shape", self.mesh_shape) == self.mesh_shape)
        if same_mesh:
            if extra["dp_rank"] != self.dp_rank:
                raise RuntimeError(f"checkpoint of step {step}: rank {self.rank} was DP rank "
                                   f"{extra['dp_rank']}, this run makes it DP rank "
                                   f"{self.dp_rank}")
            set_rng_state(extra["rng"])
            return
        seed = resumed_rng_seed(self.config.seed, step, self.rank)
        torch.manual_seed(seed)
        if self.rank == 0:
            saved = extra.get("mesh_shape") or {"ranks": extra.get("resharded_from")}
            print(f"meshplan checkpoint: step {step} was written by mesh {saved}, this run has "
                  f"{self.mesh_shape}: DCP reshards model and optimizer, the data continues at "
                  f"global sample {consumed} (step {step} x global_batch {batch}), and each "
                  "rank's RNG is seeded from (seed, step, rank) instead of a saved state",
                  flush=True)

    def _trim(self, name: str, step: int, *, rank0: bool = False) -> None:
        """Keep the lines of ``OUT/name`` with "step" <= ``step`` (a fresh job: none)."""
        if rank0 and self.rank != 0:
            return
        path = self.out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().splitlines() if path.exists() else []
        kept = [x for x in lines if x and json.loads(x)["step"] <= step]
        path.write_text("".join(x + "\n" for x in kept))

    # -- after each step -----------------------------------------------------------------------
    def after_step(self, step: int, loss: float, compute_s: list[float] | None = None,
                   stop_signal: int = 0) -> str | None:
        """Record step ``step`` (1-based), stop on NaN if asked, checkpoint every K steps,
        and feed the straggler detector with the step's per-rank compute times.

        Returns:
            "evict" when a straggler was confirmed under ``--on-straggler evict``, "stop" when
            a rank received ``stop_signal`` (SIGTERM / SIGINT, `runtime.interrupts`): the
            state after this step is checkpointed (landed) and the caller stops training;
            else None.
        Raises:
            StopTraining: the loss is NaN and ``--on-nan stop``.
        """
        self.done = step
        if self.writes_consumed:
            ids = self.batches.local_sample_ids(step - 1, self.dp_rank, self.dp)
            with (self.out / "consumed" / f"dp{self.dp_rank}.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "dp_rank": self.dp_rank, "samples": ids}) + "\n")
        if self.rank == 0:
            self._event("step", step=step)
        if not math.isfinite(loss) and self.config.on_nan == "stop":
            self._stop(step, f"loss is {loss} at step {step}; stopping (--on-nan stop; use "
                             "--on-nan skip to skip such steps)")
        every = self.config.checkpoint_every
        saved = self.checkpoints is not None and every and (step % every == 0
                                                           or step == self.config.steps)
        if saved:
            self._save(step)
        if stop_signal and step < self.config.steps:
            if not saved:
                self._save(step)
            self.checkpoints.wait_landed()
            self.interrupted = signal_name(stop_signal)
            if self.rank == 0:
                self._event("interrupted", step=step, signal=self.interrupted)
            return "stop"
        return self._check_health(step, compute_s or [], saved=bool(saved))

    def _check_health(self, step: int, compute_s: list[float], *, saved: bool) -> str | None:
        """Log stragglers confirmed at ``step``; under ``--on-straggler evict``, checkpoint
        the step (unless ``saved``), wait for it to land and return "evict"."""
        found = self.health.observe(step, compute_s)
        for straggler in found if self.rank == 0 else []:
            print(straggler_line(straggler), flush=True)
            self._event("straggler", **straggler)
        if not found or self.config.on_straggler != "evict" or step == self.config.steps:
            return None
        if not saved:
            self._save(step)
        self.checkpoints.wait_landed()
        self.evicted = {"step": step, "ranks": [f["rank"] for f in found],
                        "stragglers": found}
        if self.rank == 0:
            self._event("evict", **self.evicted)
        return "evict"

    def _stop(self, step: int, message: str) -> None:
        """End the run on purpose after ``step``: rank 0 writes the error into summary.json;
        every rank raises `StopTraining` (exit 0, so torchrun spends no restart on it)."""
        if self.rank == 0:
            self._event("stopped", step=step, error=message)
            summary = {"error": message, "steps": len(self.records),
                       "losses": [r["loss"] for r in self.records]}
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        raise StopTraining(message)

    def _save(self, step: int) -> None:
        """Checkpoint the state after ``step`` with this rank's data position and RNG.

        Raises:
            StopTraining: the checkpoint folder cannot be written any more (a restart would
                meet the same folder, so it is not worth one).
        """
        # a local folder is probed before each save (a disk can turn read-only under a run);
        # an object store was probed before the launch (`fault_args_error`): a probe PUT and
        # DELETE per save would block the training loop for two round trips, and a write that
        # fails later surfaces as that save's error
        if isinstance(self.ckpt_dir, Path) and \
                (problem := checkpoint_folder_error(self.ckpt_dir)) is not None:
            self._stop(step, f"after step {step}: {problem}")
        batch = self.batches.global_batch
        extra = {"rng": rng_state(), "step": step, "dp_rank": self.dp_rank,
                 "samples_consumed": step * (batch // self.dp),
                 "global_samples_consumed": step * batch, "global_batch": batch,
                 "mesh_shape": self.mesh_shape}
        self._log_checkpoint()
        self.checkpoints.save(step, extra)
        if self.rank == 0:
            self._event("checkpoint", step=step, blocking_s=self.checkpoints.blocking_s[-1])
        self._unlogged_checkpoint = step

    def _log_checkpoint(self) -> None:
        """Log the previous save's final blocking time (after its staging wait)."""
        if self._unlogged_checkpoint is not None and self.rank == 0:
            self._event("checkpoint_staged", step=self._unlogged_checkpoint,
                        blocking_s=self.checkpoints.blocking_s[-1])
        self._unlogged_checkpoint = None

    def close(self) -> None:
        """Wait for the in-flight checkpoint (call before destroying the process group)."""
        if self.checkpoints is not None:
            self.checkpoints.close()
            self._log_checkpoint()

    # -- summary ----------------------------------------------------------------------------
    def summary_fields(self) -> dict:
        """The job-level keys of ``summary.json`` (rank 0; see the module docstring); logs
        that this attempt finished."""
        self._event("finished", step=self.done)
        return job_accounting(self._read_events(), self.records) | {
            "stragglers": job_stragglers(self._read_events()), "evicted": self.evicted,
            "interrupted": self.interrupted,
            "skipped_steps": self.skipped_steps, "checkpoint_fallbacks": self.fallbacks,
            "faults_injected": [f.spec for f in parse_faults(all_fault_specs(self.config))]}


def _same_location(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    a, b = checkpoint_location(a), checkpoint_location(b)
    if isinstance(a, Path) and isinstance(b, Path):
        return a.resolve() == b.resolve()
    return a == b


def resumed_rng_seed(seed: int, step: int, rank: int) -> int:
    """Seed of rank ``rank``'s RNG when a checkpoint of ``step`` is resumed on another mesh:
    deterministic in (seed, step, rank), distinct per rank, in torch's 64-bit seed range.

    >>> resumed_rng_seed(0, 8, 1) == resumed_rng_seed(0, 8, 1) != resumed_rng_seed(0, 8, 0)
    True
    """
    digest = hashlib.sha256(f"meshplan-resume:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

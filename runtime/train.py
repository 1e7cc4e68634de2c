"""Per-rank training entry point, run under torchrun (see `runtime.launch`).

    python -m torch.distributed.run --nproc-per-node W ... -m runtime.train PLAN.yaml \
        --steps N --out DIR [--data FILE] [--seed 0] [--attention sdpa|tiled]
        [--save-params FILE] [--profile] [--ep N]
        [--checkpoint-every K] [--keep N] [--resume DIR] [--inject SPEC ...] [--timeout-s S]
        [--on-nan stop|skip]       (fault tolerance: `runtime.resilience`, docs/faults.md)

The flags become a `runtime.config.TrainConfig` (`parse_args`), which the runtime takes.

Every rank reads the plan file, builds the full model from the seed (so the start equals the
single-process model), shards it with the plan's TP / PP / DP (`runtime.parallelize`) and trains
with AdamW on byte-level text (`runtime.data`). Rank 0 appends one JSON record per step to
``DIR/metrics.jsonl``, prints the same record as one stable line, and at the end writes
``DIR/summary.json`` and copies the plan file to ``DIR/plan.yaml`` (the record's keys:
`runtime.metrics`). ``--save-params`` writes the full parameters after the last optimizer step
(`runtime.params`); ``--profile`` writes one torch profiler Chrome trace per rank
(``DIR/trace_rank{r}.json``) and fills ``comm_time_s`` from it. ``--attention tiled`` runs our
FlashAttention-2 kernel (`runtime.attention`) instead of SDPA (default: $MESHPLAN_ATTENTION,
else "sdpa").

Steps are numbered from 1 in the logs; step k trains on data step k-1's global batch.
Input errors (bad plan, wrong world size, missing data) print one line per rank and exit 2
before any collective, so a mismatched launch never hangs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from planner.planfile import PlanFile, check_runnable, read_plan_file, write_plan_file
from planner.precision import storage_dtype
from planner.spec import V_SCHEDULES, PlanError, check_plan
from runtime.config import TrainConfig
from runtime.data import ByteBatches, read_corpus
from runtime.evict import next_layout
from runtime.faults import add_fault_args
from runtime.interrupts import STOP_GRACE_S, StopRequest, record_collective_error
from runtime.launch import ERROR_PREFIX
from runtime.metrics import comm_time_s, format_step, peak_memory_bytes, step_record, summarize
from runtime.model import ATTENTION_IMPLS, Transformer, cross_entropy_loss
from runtime.moe import runtime_moe_error, set_aux_grad_scale
from runtime.parallel.cp import cp_rank
from runtime.parallel.dp import gradient_sync
from runtime.parallel.ep import (
    build_expert_mesh,
    expert_parallel_error,
    reduce_expert_grads,
    with_ep,
)
from runtime.parallel.pp import sum_tied_embedding_grads, tied_embedding_group
from runtime.parallelize import (
    build_mesh,
    parallelize,
    parallelize_pipeline,
    vocab_parallel_loss,
)
from runtime.params import save_full_parameters
from runtime.precision import apply_float8
from runtime.resilience import Resilience, StopTraining, fault_args_error, resume_folder
from runtime.ring_attention import shard_sequence

__all__ = ["format_step", "main", "step_record"]    # step_record / format_step: runtime.metrics

#: AdamW settings shared with `runtime.reference` (fixed learning rate, no weight decay).
LEARNING_RATE = 1e-3
ADAM_BETAS = (0.9, 0.95)
#: Seconds a rank that found an input error waits before exiting (see `main`).
INPUT_ERROR_GRACE_S = 2.0
#: Seconds a collective (or the store rendezvous) may wait before the run fails.
DIST_TIMEOUT_S = 120

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_optimizer(params) -> torch.optim.AdamW:
    """AdamW with the runtime's fixed settings (the single-process reference uses the same)."""
    return torch.optim.AdamW(params, lr=LEARNING_RATE, betas=ADAM_BETAS, eps=1e-8,
                             weight_decay=0.0)


def autocast_context(plan_dtype: str, device: torch.device):
    """bf16 autocast on CUDA when the plan asks for bf16; fp32 otherwise (always on CPU, where a
    bf16 matmul is ~176x slower than fp32 on CPUs without AVX512-BF16/AMX)."""
    if device.type == "cuda" and storage_dtype(plan_dtype) == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The command line as a `TrainConfig` (argparse parses the flags, the config checks them).

    Raises:
        PlanError: a flag is out of range (`TrainConfig`).
    """
    parser = argparse.ArgumentParser(prog="runtime.train", description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="plan file (YAML) written by `meshplan plan`")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("--out", required=True, help="run folder for metrics.jsonl, summary.json")
    parser.add_argument("--data", default=None, help="train on the bytes of this file "
                        "(default: the Python standard library's source)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the init and the data order")
    parser.add_argument("--attention", choices=ATTENTION_IMPLS,
                        default=os.environ.get("MESHPLAN_ATTENTION", "sdpa"),
                        help="attention kernel: PyTorch SDPA or our tiled FlashAttention-2")
    parser.add_argument("--save-params", default=None, metavar="FILE",
                        help="torch.save the full parameters after the last step (rank 0)")
    parser.add_argument("--profile", action="store_true",
                        help="write a torch profiler Chrome trace per rank into --out")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert parallel degree of an MoE model (default: the plan's)")
    add_fault_args(parser)      # --checkpoint-every, --resume, --inject, ... (runtime.faults)
    parser.add_argument("--elastic", action="store_true",
                        help="an elastic launch (torchrun --nnodes MIN:MAX): train the "
                             "planner's best plan on the ranks that joined, and continue "
                             "from the job's checkpoints")
    return TrainConfig.from_args(parser.parse_args(argv))


def init_distributed(backend: str, timeout_s: float | None = None) -> tuple[int, int]:
    """Create the default process group; returns (rank, world_size).

    Under torchrun the store is torchrun's agent store, namespaced per restart attempt (and
    world size, for an elastic group): without the prefix, restarted gloo workers hang or fail
    in connectFullMesh in most runs (measured on torch 2.13 with gloo: 11 of 14 first
    restarts). Outside torchrun: one process, a HashStore.
    """
    timeout = timedelta(seconds=DIST_TIMEOUT_S if timeout_s is None else timeout_s)
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # the rendezvous keeps the default patience: a short collective timeout (--timeout-s)
    # must not fail a restart whose ranks start a few seconds apart on a loaded machine
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=(rank == 0 and not agent_store),
                         timeout=max(timeout, timedelta(seconds=DIST_TIMEOUT_S)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # an elastic group whose membership changed restarts with the same count, in a larger or
    # smaller world, and a group that shrank in place after an eviction rendezvouses afresh
    # (runtime.evict): the world size and the layout keep their keys apart too
    layout = os.environ.get("MESHPLAN_LAYOUT", "0")
    store = dist.PrefixStore(f"attempt{attempt}-world{world}/layout{layout}/", base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return rank, world


def check_inputs(config: TrainConfig) -> tuple[PlanFile, torch.Tensor]:
    """Read the plan and the data and check the launch, before any collective (``config``
    has checked its own fields on construction).

    Raises:
        PlanError: invalid plan, vocabulary too small for bytes, sequence parallelism over a
            length tp does not divide, world size != tp·cp·pp·dp, or an MoE plan the runtime
            does not execute (`moe_plan_error`).
        FileNotFoundError / ValueError: missing or too short ``--data``.
    Returns:
        (the plan file, its plan with ``--ep`` applied; the corpus tokens).
    """
    pf = read_plan_file(config.plan_path)
    pf = dataclasses.replace(pf, plan=with_ep(pf.plan, config.ep))
    model, plan = pf.model, pf.plan
    check_runnable(plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if config.elastic and world != plan.world_size:
        from runtime.evict import plan_for_world
        pf = plan_for_world(pf, world)           # the same on every rank: a pure search
        model, plan = pf.model, pf.plan
    if world != plan.world_size:
        raise PlanError(f"plan {plan.id} needs world_size {plan.degrees}, but {world} "
                        f"process(es) were started; "
                        f"launch with --nproc-per-node {plan.world_size}")
    check_plan(model, plan)
    if (problem := cluster_block_error(pf)) is not None:
        raise PlanError(problem)
    if plan.sequence_parallel and (model.seq_len // plan.cp) % plan.tp:
        raise PlanError(f"sequence_parallel shards the seq_len/cp = {model.seq_len // plan.cp} "
                        f"tokens of a rank over tp={plan.tp}, which does not divide them; use "
                        f"seq_len a multiple of cp*tp = {plan.cp * plan.tp}")
    if model.vocab_size < 256:
        raise PlanError(f"vocab_size={model.vocab_size} is too small for byte tokens; use >= 256")
    if (problem := moe_plan_error(model, plan)) is not None:
        raise PlanError(problem)
    return pf, read_corpus(config.data, model.seq_len)


def moe_plan_error(model, plan) -> str | None:
    """What of an MoE model or its expert split the runtime does not execute, or None
    (`runtime.moe.runtime_moe_error`, `runtime.parallel.ep.expert_parallel_error`; sequence
    parallelism of MoE blocks is not executed, and under TP they stay whole on every rank).
    The planner's expert rules are `planner.spec.check_plan`'s."""
    if plan.ep > 1 and plan.cp > 1:
        return (f"plan {plan.id} has ep={plan.ep} and cp={plan.cp}: the runtime does not run "
                f"expert parallelism with context parallelism; use cp=1 or ep=1")
    if model.is_moe and plan.sequence_parallel:
        return (f"plan {plan.id} has sequence_parallel=True: the runtime does not run "
                f"mixture-of-experts blocks on sequence shards; use sequence_parallel=false")
    return runtime_moe_error(model) or expert_parallel_error(plan)


def cluster_block_error(pf: PlanFile) -> str | None:
    """The plan file's ``cluster`` block disagrees with its plan, or None: a localhost block
    whose ``ranks`` is not the plan's world size tp·pp·dp (the plan was predicted for another
    number of processes, so its prediction and MFU would describe another job)."""
    ranks, world = pf.cluster.ranks, pf.plan.world_size
    if pf.cluster.is_localhost and ranks is not None and ranks != world:
        return (f"plan file: cluster {pf.cluster.name!r} has ranks={ranks}, but plan "
                f"{pf.plan.id} has world_size {pf.plan.degrees} = {world}; write the plan "
                f"again with `meshplan plan` (or set cluster.ranks to {world})")
    return None


def build_step(pf: PlanFile, mesh, device: torch.device, seed: int, attention: str = "sdpa",
               expert_mesh=None) -> tuple[list[torch.nn.Module], StepFn]:
    """This rank's parallel modules and a function that runs one step's forward + backward.

    The step function takes this DP rank's (B/dp, T) inputs and targets and returns this rank's
    share of the global mean loss (all ranks' shares sum to it). Under expert parallelism
    (``expert_mesh``, `runtime.parallel.ep.build_expert_mesh`) it also reduces the experts'
    gradients (`reduce_expert_grads`); under context parallelism it keeps this cp rank's
    load-balanced T/cp tokens of both (`runtime.parallel.cp`).
    """
    modules, step = _build_step(pf, mesh, device, seed, attention, expert_mesh)
    if expert_mesh is not None:
        edp_mesh = expert_mesh["edp"]
        edp = edp_mesh.get_group() if edp_mesh.size() > 1 else None
        local_step = step

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            share = local_step(inputs, targets)
            reduce_expert_grads(modules, edp, pf.plan.dp)
            return share
    if pf.plan.cp == 1:
        return modules, step
    cp, rank = pf.plan.cp, cp_rank(mesh)
    return modules, lambda inputs, targets: step(shard_sequence(inputs, cp, rank),
                                                 shard_sequence(targets, cp, rank))


def _build_step(pf: PlanFile, mesh, device: torch.device, seed: int, attention: str,
                expert_mesh) -> tuple[list[torch.nn.Module], StepFn]:
    """`build_step` on the full (or this cp rank's) sequence."""
    model = Transformer(pf.model, seed=seed, attention=attention).to(device)
    apply_float8(model, pf.plan.dtype)   # FP8 plans: torchao float8 linears (CUDA only)
    plan, amp = pf.plan, autocast_context(pf.plan.dtype, device)
    if plan.pp == 1:
        # the aux loss is scaled like the main loss, 1/num_microbatches (runtime.moe)
        set_aux_grad_scale(model, 1.0 / plan.num_microbatches)
        module = parallelize(model, plan, mesh, expert_mesh)
        return [module], _accumulation_step(module, plan, amp, vocab_parallel_loss(plan))
    stages, schedule, modules = parallelize_pipeline(model, plan, mesh, cross_entropy_loss,
                                                     device=device, expert_mesh=expert_mesh)
    # ZB-V / DualPipe-V hold both tied copies on pipeline rank 0: no group, a local sum.
    tied = tied_embedding_group(mesh) if pf.model.tied_embeddings and \
        plan.schedule not in V_SCHEDULES else None
    step = _pipeline_step(stages, schedule, plan, amp, device)

    def step_and_sum_tied(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        share = step(inputs, targets)
        sum_tied_embedding_grads(modules, tied)
        return share

    return modules, step_and_sum_tied if pf.model.tied_embeddings else step


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss (from ``loss_parallel``) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _accumulation_step(module, plan, amp, vocab_loss: bool) -> StepFn:
    """Gradient accumulation over plan.num_microbatches (loss scaled by 1/num_microbatches);
    the DP gradient reduction runs on the last micro-batch only."""
    n, share = plan.num_microbatches, 1.0 / plan.world_size
    loss_ctx = loss_parallel if vocab_loss else contextlib.nullcontext

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=inputs.device)
        pairs = zip(inputs.split(plan.micro_batch), targets.split(plan.micro_batch), strict=True)
        # each (mb, T)
        for i, (x, y) in enumerate(pairs):
            with gradient_sync(module, enabled=(i == n - 1)), loss_ctx():
                with amp:
                    loss = cross_entropy_loss(module(x), y) / n
                loss.backward()
            total += _plain(loss.detach())
        return total * share          # every rank (TP peers too) holds a DP replica's mean

    return step


def _pipeline_step(stages, schedule, plan, amp, device) -> StepFn:
    """One pipeline schedule step; the last stage's ranks (dp·cp·tp of them) hold the losses."""
    indices = {stage.stage_index for stage in stages}
    is_first, is_last = 0 in indices, plan.pp * plan.virtual_stages - 1 in indices
    share = 1.0 / (plan.dp_cp * plan.tp)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = (inputs,) if is_first else ()
        kwargs = {"target": targets, "losses": losses} if is_last else {}
        with amp:
            schedule.step(*args, **kwargs)
        if not is_last:
            return torch.zeros((), device=device)
        return torch.stack([loss.detach().float() for loss in losses]).mean() * share

    return step


def gather_step_stats(share: torch.Tensor, memory_bytes: int, compute_s: float = 0.0,
                      stop_signal: int = 0) -> tuple[float, list[int], list[float], int]:
    """One all-gather of (loss share, peak memory, compute time, stop signal) over all ranks;
    it also syncs the ranks, and it is the only collective of the health telemetry
    (`runtime.health`) and of a graceful stop (`runtime.interrupts`).

    Returns:
        (the global mean loss = the sum of the shares, peak memory bytes per rank, compute
        seconds per rank, the stop signal any rank received (0: none)).
    """
    mine = torch.tensor([float(share), float(memory_bytes), compute_s, float(stop_signal)],
                        dtype=torch.float64, device=share.device)
    every = torch.empty(dist.get_world_size() * 4, dtype=torch.float64, device=share.device)
    dist.all_gather_into_tensor(every, mine)
    every = every.view(-1, 4).cpu()                              # (world, 4)
    return (float(every[:, 0].sum()), [int(m) for m in every[:, 1]],
            [float(t) for t in every[:, 2]], int(every[:, 3].max()))


def plan_notes(pf: PlanFile, backend: str) -> list[str]:
    """What of the plan this runtime runs differently (printed by rank 0, kept in summary.json)."""
    notes = []
    if _run_dtype(pf, backend) != pf.plan.dtype:
        notes.append(f"dtype {pf.plan.dtype} runs as {_run_dtype(pf, backend)} on {backend}")
    elif pf.plan.dtype == "fp8":
        notes.append("dtype fp8 (delayed scaling) runs with torchao's dynamic per-tensor "
                     "(current) scaling")
    if pf.plan.zero_stage > 0 and pf.plan.ep > 1 and pf.plan.edp > 1:
        notes.append(f"zero_stage {pf.plan.zero_stage} shards the dense parameters only: each "
                     f"rank keeps its experts whole, replicated over edp={pf.plan.edp}")
    if pf.plan.zero_stage in (1, 2):
        notes.append(f"zero_stage {pf.plan.zero_stage} runs as FSDP2 without resharding after "
                     "forward (sharded optimizer state and reduce-scattered gradients)")
    return notes


def _run_dtype(pf: PlanFile, backend: str) -> str:
    """The dtype the step really computes in: bf16 / tf32 on CUDA when asked, else fp32."""
    return pf.plan.dtype if backend == "nccl" and pf.plan.dtype in (
        "bf16", "tf32", "fp8", "fp8-current") else "fp32"


def select_device(plan_dtype: str) -> tuple[str, torch.device]:
    """(backend, device) of this rank: nccl and its GPU when CUDA is present, else gloo and CPU."""
    if not torch.cuda.is_available():
        torch.set_num_threads(1)          # one thread per rank: oversubscription costs 2-20x
        return "gloo", torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = plan_dtype == "tf32"
    return "nccl", torch.device("cuda", torch.cuda.current_device())


def train(config: TrainConfig, pf: PlanFile, tokens: torch.Tensor, *,
          stop_request: StopRequest | None = None,
          build_started_unix_s: float | None = None) -> dict | None:
    """Run ``config.steps`` steps of the plan; rank 0 writes the run folder.

    Returns:
        the eviction that stopped the run (`runtime.resilience.Resilience.evicted`), or None.
    """
    backend, device = select_device(pf.plan.dtype)
    # SIGTERM / SIGINT: stop after the step, checkpointed
    stop_request = stop_request or StopRequest()
    rank, _ = init_distributed(backend, config.timeout_s)
    resilience = None
    try:
        mesh = build_mesh(pf.plan, device.type)
        ep = pf.plan.ep
        expert_mesh = build_expert_mesh(mesh, ep) if ep > 1 else None
        modules, step_fn = build_step(pf, mesh, device, config.seed, config.attention,
                                      expert_mesh)
        optimizer = make_optimizer([p for m in modules for p in m.parameters()])
        batches = ByteBatches(tokens, seq_len=pf.model.seq_len,
                              global_batch=pf.plan.global_batch, seed=config.seed)
        out, dp_rank = Path(config.out_dir), mesh["dp"].get_local_rank()
        resilience = Resilience(config, modules=modules, optimizer=optimizer, mesh=mesh,
                                batches=batches, dp=pf.plan.dp,
                                build_started_unix_s=build_started_unix_s)
        step_fn = resilience.wrap(step_fn)
        first_step, records = resilience.resume()    # a restart continues from its checkpoint
        notes = plan_notes(pf, backend) + elastic_notes(config, pf)
        if rank == 0:
            for note in notes:
                print(f"note: {note}", flush=True)
        prof = _profiler(device) if config.profile else contextlib.nullcontext()
        with prof:
            for k in range(first_step, config.steps):
                start = time.perf_counter()
                with torch.profiler.record_function(f"meshplan_step_{k + 1}"):
                    inputs, targets = batches.local_batch_at(k, dp_rank, pf.plan.dp)  # (B/dp, T)
                    optimizer.zero_grad(set_to_none=True)
                    share = step_fn(inputs.to(device), targets.to(device))
                    optimizer.step()
                    # this rank's part of the step, before it waits for the slowest rank
                    loss, memory, compute, stop = gather_step_stats(
                        share, peak_memory_bytes(device), time.perf_counter() - start,
                        stop_request.signum)
                record = step_record(k + 1, loss, time.perf_counter() - start, pf,
                                     peak_memory_bytes=memory, compute_time_s=compute)
                if stop:
                    stop_request.at_step_end()
                stop_request.grace_s = max(STOP_GRACE_S, 3 * record["step_time_s"])
                if rank == 0:
                    records.append(record)
                    if not config.profile:
                        _log_step(out, record)
                # NaN policy, consumed samples, stragglers, checkpoint
                if resilience.after_step(k + 1, loss, compute, stop) is not None:
                    break                             # evicted, or stopped by a signal
        resilience.close()
        if config.profile:
            out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
            if rank == 0:
                events = prof.events()
                windows = _step_windows(events)
                for record in records[len(records) - (config.steps - first_step):]:
                    lo, hi = windows[record["step"]]
                    record["comm_time_s"] = comm_time_s(events, lo, hi)
                    _log_step(out, record)
        if config.save_params:
            # tied: the last stage's out.weight is the same matrix as tok.weight
            skip = {"out.weight"} if pf.model.tied_embeddings else set()
            save_full_parameters(modules, config.save_params, skip=skip)
        if rank == 0:
            _write_summary(out, summarize(records, pf, backend, notes, _run_dtype(pf, backend))
                           | resilience.summary_fields() | {"ep": ep}, config.plan_path, pf)
        # leave together: a gloo process group torn down while a peer still receives (rank 0's
        # gather and writes above) aborted with "terminate called without an active exception"
        dist.barrier()
        return resilience.evicted
    except Exception as exc:
        if not isinstance(exc, StopTraining):   # evidence for naming a hung peer (interrupts)
            record_collective_error(Path(config.out_dir), rank,
                                    resilience.done + 1 if resilience else 0, exc)
        raise
    finally:
        dist.destroy_process_group()


def _profiler(device: torch.device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _step_windows(events) -> dict[int, tuple[float, float]]:
    """{step: (start_us, end_us)} of the profile's ``meshplan_step_k`` ranges."""
    return {int(e.name.removeprefix("meshplan_step_")): (e.time_range.start, e.time_range.end)
            for e in events if e.name.startswith("meshplan_step_")}


def _log_step(out: Path, record: dict) -> None:
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(format_step(record), flush=True)


def elastic_notes(config: TrainConfig, pf: PlanFile) -> list[str]:
    """The line that says an elastic launch trains another plan than the one it was given
    (`check_inputs`: the ranks that joined are not the plan's world size), or []."""
    if not config.elastic:
        return []
    launched = read_plan_file(config.plan_path).plan
    if launched.world_size == pf.plan.world_size:
        return []
    predicted = (pf.prediction or {}).get("step_time_s")
    return [f"elastic: {pf.plan.world_size} rank(s) joined and plan {launched.id} needs "
            f"{launched.world_size}: training {pf.plan.id}, the planner's best on "
            f"{pf.plan.world_size} rank(s)"
            + (f" (predicted {predicted:.3f} s/step)" if predicted else "")]


def _write_summary(out: Path, summary: dict, plan_path: str, pf: PlanFile | None = None) -> None:
    # Every run is a data point: (predicted − measured) / measured step time of its plan file.
    predicted = (summary.get("prediction") or {}).get("step_time_s")
    summary["prediction_error"] = (None if not predicted else
                                   (predicted - summary["step_time_s"]) / summary["step_time_s"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # OUT/plan.yaml is the plan trained: the launched one, or an elastic launch's re-plan
    if pf is not None and read_plan_file(plan_path).plan.world_size != pf.plan.world_size:
        write_plan_file(out / "plan.yaml", pf)
    elif Path(plan_path).resolve() != (out / "plan.yaml").resolve():
        shutil.copyfile(plan_path, out / "plan.yaml")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (2 for input errors)."""
    # torch's own FSDP / DTensor code still calls the old collective names; the warning is
    # about torch internals, not this program, and would print once per rank per run.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*(all_gather_into_tensor|reduce_scatter_tensor)`? is "
                                    r"deprecated")
    try:
        config = parse_args(argv)
        build_started = time.time()
        pf, tokens = check_inputs(config)
        if (problem := fault_args_error(config, global_batch=pf.plan.global_batch)) is not None:
            raise ValueError(problem)
        if config.resume is not None:              # a run folder: its checkpoints/
            config = dataclasses.replace(config, resume=str(resume_folder(config.resume)))
    except (PlanError, FileNotFoundError, ValueError) as exc:
        rank = os.environ.get("RANK", "0")
        print(f"{ERROR_PREFIX} (rank {rank}): {exc}", file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # torchrun kills the other ranks as soon as one exits; every rank runs the same
            # checks, so a short grace lets each of them print its own line first
            time.sleep(INPUT_ERROR_GRACE_S)
        return 2
    stop_request = StopRequest()
    try:
        while train(config, pf, tokens, stop_request=stop_request,
                    build_started_unix_s=build_started) is not None:
            # evicted: this process stays in the smaller group, or leaves (runtime.evict)
            if (config := next_layout(config, stopped=lambda: stop_request.signum)) is None:
                break
            build_started = time.time()
            pf, tokens = check_inputs(config)
    except StopTraining as exc:
        # exit 0 so that torchrun does not restart a run that stopped on purpose; the error
        # is in summary.json and `runtime.launch.run_plan` raises it
        print(f"{ERROR_PREFIX} (rank {os.environ.get('RANK', '0')}): {exc}", file=sys.stderr,
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-rank training entry point, run under torchrun (see `runtime.launch`).

    python -m torch.distributed.run --nproc-per-node W ... -m runtime.train PLAN.yaml \
        --steps N --out DIR [--data FILE] [--seed 0]

Every rank reads the plan file, builds the full model from the seed (so the start equals the
single-process model), shards it with the plan's TP / PP / DP (`runtime.parallelize`) and trains
with AdamW on byte-level text (`runtime.data`). Rank 0 appends one JSON record per step to
``DIR/metrics.jsonl``, prints the same record as one stable line, and at the end writes
``DIR/summary.json`` and copies the plan file to ``DIR/plan.yaml``.

Steps are numbered from 1 in the logs; step k trains on data step k-1's global batch.
Input errors (bad plan, wrong world size, missing data) print one line per rank and exit 2
before any collective, so a mismatched launch never hangs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from planner.planfile import PlanFile, read_plan_file
from planner.spec import PlanError, check_plan, training_flops_per_token
from runtime.data import ByteBatches, read_corpus
from runtime.launch import ERROR_PREFIX
from runtime.model import Transformer, cross_entropy_loss
from runtime.parallelize import (
    apply_dp,
    apply_pp,
    apply_recompute,
    apply_tp,
    build_mesh,
    gradient_sync,
)

#: AdamW settings shared with `runtime.reference` (fixed learning rate, no weight decay).
LEARNING_RATE = 1e-3
ADAM_BETAS = (0.9, 0.95)
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
    if device.type == "cuda" and plan_dtype == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="runtime.train", description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="plan file (YAML) written by `meshplan plan`")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("--out", required=True, help="run folder for metrics.jsonl, summary.json")
    parser.add_argument("--data", default=None, help="train on the bytes of this file "
                        "(default: the Python standard library's source)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the init and the data order")
    return parser.parse_args(argv)


def init_distributed(backend: str) -> tuple[int, int]:
    """Create the default process group; returns (rank, world_size).

    Under torchrun the store is torchrun's agent store, namespaced per restart attempt: without
    the prefix, restarted gloo workers hang or fail in connectFullMesh in most runs (measured on
    torch 2.13 with gloo: 11 of 14 first restarts). Outside torchrun: one process, a HashStore.
    """
    timeout = timedelta(seconds=DIST_TIMEOUT_S)
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=(rank == 0 and not agent_store), timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt{attempt}/", base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return rank, world


def check_inputs(args: argparse.Namespace) -> tuple[PlanFile, torch.Tensor]:
    """Read the plan and the data and check the launch, before any collective.

    Raises:
        PlanError: invalid plan, vocabulary too small for bytes, or world size != tp·pp·dp.
        FileNotFoundError / ValueError: missing or too short ``--data``.
    """
    pf = read_plan_file(args.plan)
    model, plan = pf.model, pf.plan
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:
        raise PlanError(f"plan {plan.id} needs world_size tp*pp*dp = {plan.tp}*{plan.pp}*"
                        f"{plan.dp} = {plan.world_size}, but {world} process(es) were started; "
                        f"launch with --nproc-per-node {plan.world_size}")
    check_plan(model, plan)
    if model.vocab_size < 256:
        raise PlanError(f"vocab_size={model.vocab_size} is too small for byte tokens; use >= 256")
    if args.steps < 1:
        raise PlanError(f"--steps={args.steps} must be >= 1")
    return pf, read_corpus(args.data, model.seq_len)


def build_step(pf: PlanFile, mesh, device: torch.device, seed: int
               ) -> tuple[list[torch.nn.Parameter], StepFn]:
    """The parallel model's parameters and a function that runs one step's forward + backward.

    The step function takes this DP rank's (B/dp, T) inputs and targets and returns this rank's
    share of the global mean loss (all ranks' shares sum to it).
    """
    model, plan = Transformer(pf.model, seed=seed).to(device), pf.plan
    amp = autocast_context(plan.dtype, device)

    def parallelize(module):
        if plan.tp > 1:
            apply_tp(module, mesh["tp"])
        apply_recompute(module, plan.recompute)
        if plan.dp > 1 or plan.zero_stage > 0:
            module = apply_dp(module, mesh["dp"], zero_stage=plan.zero_stage)
        return module

    if plan.pp == 1:
        module = parallelize(model)
        return list(module.parameters()), _accumulation_step(module, plan, amp)
    stages, schedule, modules = apply_pp(model, plan, mesh["pp"], cross_entropy_loss,
                                         device=device, parallelize_fn=parallelize)
    params = [p for m in modules for p in m.parameters()]
    return params, _pipeline_step(stages, schedule, plan, amp, device)


def _accumulation_step(module, plan, amp) -> StepFn:
    """Gradient accumulation over plan.num_microbatches (loss scaled by 1/num_microbatches);
    the DP gradient reduction runs on the last micro-batch only."""
    n, share = plan.num_microbatches, 1.0 / plan.world_size

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=inputs.device)
        pairs = zip(inputs.split(plan.micro_batch), targets.split(plan.micro_batch), strict=True)
        # each (mb, T)
        for i, (x, y) in enumerate(pairs):
            with gradient_sync(module, enabled=(i == n - 1)):
                with amp:
                    loss = cross_entropy_loss(module(x), y) / n
                loss.backward()
            total += loss.detach()
        return total * share          # every rank (TP peers too) holds a DP replica's mean

    return step


def _pipeline_step(stages, schedule, plan, amp, device) -> StepFn:
    """One pipeline schedule step; the last stage's ranks (dp·tp of them) hold the losses."""
    indices = {stage.stage_index for stage in stages}
    is_first, is_last = 0 in indices, plan.pp * plan.virtual_stages - 1 in indices
    share = 1.0 / (plan.dp * plan.tp)

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


def global_loss(share: torch.Tensor) -> float:
    """Sum the ranks' loss shares: the mean loss over the global batch, known on every rank."""
    total = share.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total)


def step_record(step: int, loss: float, step_time_s: float, pf: PlanFile) -> dict:
    """The metrics.jsonl record of one step (tokens_per_s is global; mfu is None without a
    ``peak_flops_per_device`` in the plan file's cluster block)."""
    tokens = pf.plan.global_batch * pf.model.seq_len
    tokens_per_s = tokens / step_time_s
    peak = pf.cluster.get("peak_flops_per_device")
    mfu = (training_flops_per_token(pf.model) * tokens_per_s / (pf.plan.world_size * peak)
           if peak else None)
    return {"step": step, "loss": loss, "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_s, "mfu": mfu}


def format_step(record: dict) -> str:
    """The stable human step line, e.g. ``step: 3  loss: 5.1234  step_time_s: 0.412 ...``."""
    mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.2f}"
    return (f"step: {record['step']}  loss: {record['loss']:.4f}  "
            f"step_time_s: {record['step_time_s']:.3f}  "
            f"tokens_per_s: {record['tokens_per_s']:.0f}  mfu_pct: {mfu}")


def plan_notes(pf: PlanFile, backend: str) -> list[str]:
    """What of the plan this runtime runs differently (printed by rank 0, kept in summary.json)."""
    notes = []
    if _run_dtype(pf, backend) != pf.plan.dtype:
        notes.append(f"dtype {pf.plan.dtype} runs as {_run_dtype(pf, backend)} on {backend}")
    if pf.plan.sequence_parallel:
        notes.append("sequence_parallel is not applied yet (TP activations stay replicated)")
    return notes


def summarize(records: list[dict], pf: PlanFile, backend: str) -> dict:
    """summary.json: losses, and the median step time over the steps after the first."""
    timed = records[1:] or records
    step_time_s = statistics.median(r["step_time_s"] for r in timed)
    rec = step_record(len(records), records[-1]["loss"], step_time_s, pf)
    return {"plan_id": pf.plan.id, "world_size": pf.plan.world_size, "steps": len(records),
            "losses": [r["loss"] for r in records], "final_loss": records[-1]["loss"],
            "step_time_s": step_time_s, "tokens_per_s": rec["tokens_per_s"], "mfu": rec["mfu"],
            "backend": backend, "ranks": pf.plan.world_size, "cores": os.cpu_count(),
            "threads_per_rank": torch.get_num_threads(), "dtype": _run_dtype(pf, backend),
            "notes": plan_notes(pf, backend), "prediction": pf.prediction}


def _run_dtype(pf: PlanFile, backend: str) -> str:
    """The dtype the step really computes in: bf16 / tf32 on CUDA when asked, else fp32."""
    return pf.plan.dtype if backend == "nccl" and pf.plan.dtype in ("bf16", "tf32") else "fp32"


def select_device(plan_dtype: str) -> tuple[str, torch.device]:
    """(backend, device) of this rank: nccl and its GPU when CUDA is present, else gloo and CPU."""
    if not torch.cuda.is_available():
        torch.set_num_threads(1)          # one thread per rank: oversubscription costs 2-20x
        return "gloo", torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = plan_dtype == "tf32"
    return "nccl", torch.device("cuda", torch.cuda.current_device())


def train(args: argparse.Namespace, pf: PlanFile, tokens: torch.Tensor) -> None:
    """Run ``args.steps`` steps of the plan; rank 0 writes the run folder."""
    backend, device = select_device(pf.plan.dtype)
    rank, _ = init_distributed(backend)
    try:
        mesh = build_mesh(pf.plan, device.type)
        params, step_fn = build_step(pf, mesh, device, args.seed)
        optimizer = make_optimizer(params)
        batches = ByteBatches(tokens, seq_len=pf.model.seq_len,
                              global_batch=pf.plan.global_batch, seed=args.seed)
        out, dp_rank, records = Path(args.out), mesh["dp"].get_local_rank(), []
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.jsonl").write_text("")
            for note in plan_notes(pf, backend):
                print(f"note: {note}", flush=True)
        for k in range(args.steps):
            start = time.perf_counter()
            inputs, targets = batches.local_batch_at(k, dp_rank, pf.plan.dp)   # (B/dp, T)
            optimizer.zero_grad(set_to_none=True)
            share = step_fn(inputs.to(device), targets.to(device))
            optimizer.step()
            loss = global_loss(share)                 # all-reduce: also syncs the ranks
            record = step_record(k + 1, loss, time.perf_counter() - start, pf)
            if rank == 0:
                records.append(record)
                _log_step(out, record)
        if rank == 0:
            _write_summary(out, summarize(records, pf, backend), args.plan)
    finally:
        dist.destroy_process_group()


def _log_step(out: Path, record: dict) -> None:
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(format_step(record), flush=True)


def _write_summary(out: Path, summary: dict, plan_path: str) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if Path(plan_path).resolve() != (out / "plan.yaml").resolve():
        shutil.copyfile(plan_path, out / "plan.yaml")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (2 for input errors)."""
    args = parse_args(argv)
    try:
        pf, tokens = check_inputs(args)
    except (PlanError, FileNotFoundError, ValueError) as exc:
        rank = os.environ.get("RANK", "0")
        print(f"{ERROR_PREFIX} (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2
    train(args, pf, tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())

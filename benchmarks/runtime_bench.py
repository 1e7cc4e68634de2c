"""Runtime overhead and data-parallel scaling on this machine.

    python benchmarks/runtime_bench.py [--model tiny-gpt] [--steps 30] [--global-batch 8]

1. Overhead at world size 1: tokens/s of a meshplan run (torchrun, one rank, `runtime.train`)
   against a plain single-process PyTorch loop over the same model, data, batch and optimizer
   (one thread each, as the runtime runs one thread per rank). Both use the median step time
   over the steps after the first. The ratio is meshplan / plain (1.0 = no overhead).
2. DP=2 scaling efficiency (weak scaling: the same batch per rank): tokens/s of dp=2 divided by
   2 × the tokens/s of the world-size-1 run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from planner.planfile import ClusterRef, PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan
from runtime.data import ByteBatches, read_corpus
from runtime.launch import run_plan
from runtime.model import Transformer, cross_entropy_loss
from runtime.train import make_optimizer


def plain_loop_tokens_per_s(spec, global_batch: int, steps: int) -> float:
    """Median tokens/s of a plain PyTorch training loop (steps after the first)."""
    torch.set_num_threads(1)
    model = Transformer(spec, seed=0)
    optimizer = make_optimizer(model.parameters())
    batches = ByteBatches(read_corpus(None, spec.seq_len), seq_len=spec.seq_len,
                          global_batch=global_batch, seed=0)
    times = []
    for k in range(steps):
        start = time.perf_counter()
        inputs, targets = batches.global_batch_at(k)                   # (B, T)
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        float(loss.detach())                                           # as the runtime logs it
        times.append(time.perf_counter() - start)
    return global_batch * spec.seq_len / statistics.median(times[1:])


def meshplan_tokens_per_s(folder: Path, spec, plan: Plan, steps: int) -> float:
    path = write_plan_file(folder / f"{plan.id}.yaml", PlanFile(
        model=spec, plan=plan, cluster=ClusterRef(name="localhost-cpu", nodes=1),
        prediction={}))
    summary = run_plan(path, steps=steps, out_dir=folder / plan.id, quiet=True, timeout_s=600)
    return summary["tokens_per_s"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-gpt")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs of each")
    args = p.parse_args(argv)
    spec, gb = load_model(args.model), args.global_batch
    one = Plan(tp=1, pp=1, dp=1, micro_batch=gb, global_batch=gb, dtype="fp32")
    two = Plan(tp=1, pp=1, dp=2, micro_batch=gb, global_batch=2 * gb, dtype="fp32")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plain = max(plain_loop_tokens_per_s(spec, gb, args.steps) for _ in range(args.repeats))
        ws1 = max(meshplan_tokens_per_s(folder, spec, one, args.steps)
                  for _ in range(args.repeats))
        dp2 = max(meshplan_tokens_per_s(folder, spec, two, args.steps)
                  for _ in range(args.repeats))
    print(f"model={spec.name} seq_len={spec.seq_len} batch_per_rank={gb} steps={args.steps} "
          f"threads_per_rank=1")
    print(f"plain_loop_tokens_per_s: {plain:.0f}")
    print(f"meshplan_ws1_tokens_per_s: {ws1:.0f}")
    print(f"overhead_ratio (meshplan/plain): {ws1 / plain:.3f}")
    print(f"meshplan_dp2_tokens_per_s (global): {dp2:.0f}")
    print(f"dp2_scaling_efficiency: {dp2 / (2 * ws1):.3f}")


if __name__ == "__main__":
    main()

"""Time and peak memory of our tiled attention against naive attention and SDPA.

    python benchmarks/attention_bench.py [--seqs 1024,2048,4096,8192,16384] [--heads 8]
        [--head-dim 64] [--batch 1] [--dtype fp32] [--threads 2] [--repeats 2] [--no-causal]

For each sequence length and implementation it prints the best-of-``repeats`` forward and
forward+backward times (s), the implementations interleaved within each repeat so that all of
them see the same machine load (the load average is printed before and after), and the peak
bytes of tensors allocated during forward+backward (inputs excluded):
``torch.cuda.max_memory_allocated`` on CUDA, `runtime.memtrack` elsewhere.
"ours" is `runtime.attention.flash_attention` (the Triton kernel on CUDA when Triton is
installed), "sdpa" is ``F.scaled_dot_product_attention``, "naive" materialises the (N, N)
matrix (skipped above ``--naive-max-seq``, where it needs tens of GiB).

Then ring attention (`runtime.ring_attention`, causal) at ``--cp`` ranks (default 2; 0 skips
it) for each of ``--ring-seqs``: every rank holds T/cp tokens in the load-balanced chunk order
and runs the ring's forward+backward; each line gives the slowest rank's best time and the
largest per-rank peak beside one rank's kernel ("ours") on the same total length T, with
``--threads`` split evenly over the ranks (gloo on CPU; NCCL with one GPU per rank on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.attention import flash_attention, naive_attention
from runtime.launch import free_port
from runtime.memtrack import PeakTensorBytes
from runtime.ring_attention import ring_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = {
    "naive": lambda q, k, v, causal: naive_attention(q, k, v, causal=causal),
    "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "ours": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_qkv(args: argparse.Namespace, n: int, device: torch.device) -> list[torch.Tensor]:
    """Leaf q, k, v of shape (batch, heads, n, head_dim) in the benchmark's dtype."""
    shape = (args.batch, args.heads, n, args.head_dim)
    return [torch.randn(shape, device=device, dtype=DTYPES[args.dtype], requires_grad=True)
            for _ in range(3)]


def time_s(fn, q, k, v, causal: bool, backward: bool, repeats: int) -> float:
    """Best-of-``repeats`` wall time (s) of one forward (and backward)."""
    best = float("inf")
    for _ in range(repeats):
        for t in (q, k, v):
            t.grad = None
        _sync(q.device)
        start = time.perf_counter()
        out = fn(q, k, v, causal)                                  # (B, H, N, d)
        if backward:
            out.backward(torch.ones_like(out))
        _sync(q.device)
        best = min(best, time.perf_counter() - start)
    return best


def peak_bytes(fn, q, k, v, causal: bool) -> int:
    """Peak bytes allocated by one forward+backward beyond the inputs."""
    for t in (q, k, v):
        t.grad = None
    if q.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(q, k, v, causal)
        out.backward(torch.ones_like(out))
        del out
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with PeakTensorBytes() as mem:
        out = fn(q, k, v, causal)
        out.backward(torch.ones_like(out))
        del out
    return mem.peak_bytes


def _ring_rank(rank: int, cp: int, port: int, n: int, args: argparse.Namespace,
               out: str) -> None:
    """One rank of the ring measurement: writes {"time_s", "peak_bytes"} to out/rank{r}.json."""
    import torch.distributed as dist
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= cp
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, args.threads // cp))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=cp)
    group = dist.group.WORLD
    q, k, v = random_qkv(args, n // cp, device)                       # this rank's tokens
    fn = lambda q, k, v, causal: ring_attention(q, k, v, group)      # noqa: E731
    both = time_s(fn, q, k, v, True, True, args.repeats)
    peak = peak_bytes(fn, q, k, v, True)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"time_s": both, "peak_bytes": peak}))
    dist.barrier()
    dist.destroy_process_group()


def ring_rows(args: argparse.Namespace, device: torch.device) -> None:
    """Print ring attention at ``args.cp`` ranks against one rank's kernel, per length."""
    import torch.multiprocessing as mp
    cp = args.cp
    print(f"ring attention, cp={cp} ranks x {max(1, args.threads // cp)} thread(s), causal, "
          f"fwd+bwd; one rank: our kernel on the whole length with {args.threads} thread(s)")
    print(f"{'seq':>6} {'impl':>8} {'fwd_bwd_s':>10} {'peak_MiB/rank':>14} {'time_vs_1':>10} "
          f"{'mem_vs_1':>9}")
    for n in map(int, args.ring_seqs.split(",")):
        q, k, v = random_qkv(args, n, device)
        one = (time_s(IMPLS["ours"], q, k, v, True, True, args.repeats),
               peak_bytes(IMPLS["ours"], q, k, v, True))
        with tempfile.TemporaryDirectory() as out:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            mp.start_processes(_ring_rank, args=(cp, free_port(), n, args, out), nprocs=cp,
                               start_method="spawn")
            ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(cp)]
        ring = (max(r["time_s"] for r in ranks), max(r["peak_bytes"] for r in ranks))
        for name, (both, peak) in (("1 rank", one), (f"ring cp{cp}", ring)):
            print(f"{n:>6} {name:>8} {both:>10.3f} {peak / 2**20:>14.1f} "
                  f"{both / one[0]:>10.2f} {peak / one[1]:>9.3f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--naive-max-seq", type=int, default=8192)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--cp", type=int, default=2, help="ring attention ranks (0: skip the ring)")
    p.add_argument("--ring-seqs", default="4096,8192", help="total lengths of the ring lines")
    args = p.parse_args(argv)
    if args.cp == 1 or args.cp < 0:
        p.error(f"--cp={args.cp}: use 0 (no ring lines) or at least 2 ranks")
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    causal = not args.no_causal
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"device={device.type} dtype={args.dtype} batch={args.batch} heads={args.heads} "
          f"head_dim={args.head_dim} causal={causal} threads={args.threads} "
          f"repeats={args.repeats} load average={load}")
    print(f"{'seq':>6} {'impl':>6} {'fwd_s':>8} {'fwd_bwd_s':>10} {'peak_MiB':>9} "
          f"{'time_vs_sdpa':>12} {'mem_vs_naive':>12}")
    for n in map(int, args.seqs.split(",")):
        q, k, v = random_qkv(args, n, device)
        impls = {name: fn for name, fn in IMPLS.items()
                 if name != "naive" or n <= args.naive_max_seq}
        best = {name: [float("inf"), float("inf")] for name in impls}
        for _ in range(args.repeats):         # interleaved: every impl sees the same load
            for name, fn in impls.items():
                for i, backward in enumerate((False, True)):
                    best[name][i] = min(best[name][i],
                                        time_s(fn, q, k, v, causal, backward, 1))
        rows = {name: (*best[name], peak_bytes(fn, q, k, v, causal))
                for name, fn in impls.items()}
        for name, (fwd, both, peak) in rows.items():
            vs_sdpa = both / rows["sdpa"][1]
            vs_naive = f"{peak / rows['naive'][2]:.3f}" if "naive" in rows else "-"
            print(f"{n:>6} {name:>6} {fwd:>8.3f} {both:>10.3f} {peak / 2**20:>9.1f} "
                  f"{vs_sdpa:>12.2f} {vs_naive:>12}", flush=True)
    print("load average after: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    if args.cp:
        ring_rows(args, device)


if __name__ == "__main__":
    main()

"""Time and peak memory of our tiled attention against naive attention and SDPA.

    python benchmarks/attention_bench.py [--seqs 1024,2048,4096,8192,16384] [--heads 8]
        [--head-dim 64] [--batch 1] [--dtype fp32] [--threads 2] [--repeats 2] [--no-causal]

For each sequence length and implementation it prints the best-of-``repeats`` forward and
forward+backward times (s) and the peak bytes of tensors allocated during forward+backward
(inputs excluded): ``torch.cuda.max_memory_allocated`` on CUDA, `runtime.memtrack` elsewhere.
"ours" is `runtime.attention.flash_attention` (the Triton kernel on CUDA when Triton is
installed), "sdpa" is ``F.scaled_dot_product_attention``, "naive" materialises the (N, N)
matrix (skipped above ``--naive-max-seq``, where it needs tens of GiB).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from runtime.attention import flash_attention, naive_attention
from runtime.memtrack import PeakTensorBytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = {
    "naive": lambda q, k, v, causal: naive_attention(q, k, v, causal=causal),
    "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "ours": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    causal = not args.no_causal
    print(f"device={device.type} dtype={args.dtype} batch={args.batch} heads={args.heads} "
          f"head_dim={args.head_dim} causal={causal} threads={args.threads}")
    print(f"{'seq':>6} {'impl':>6} {'fwd_s':>8} {'fwd_bwd_s':>10} {'peak_MiB':>9} "
          f"{'time_vs_sdpa':>12} {'mem_vs_naive':>12}")
    for n in map(int, args.seqs.split(",")):
        shape = (args.batch, args.heads, n, args.head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=DTYPES[args.dtype],
                               requires_grad=True) for _ in range(3))
        rows = {}
        for name, fn in IMPLS.items():
            if name == "naive" and n > args.naive_max_seq:
                continue
            fwd = time_s(fn, q, k, v, causal, False, args.repeats)
            both = time_s(fn, q, k, v, causal, True, args.repeats)
            rows[name] = (fwd, both, peak_bytes(fn, q, k, v, causal))
        for name, (fwd, both, peak) in rows.items():
            vs_sdpa = both / rows["sdpa"][1]
            vs_naive = f"{peak / rows['naive'][2]:.3f}" if "naive" in rows else "-"
            print(f"{n:>6} {name:>6} {fwd:>8.3f} {both:>10.3f} {peak / 2**20:>9.1f} "
                  f"{vs_sdpa:>12.2f} {vs_naive:>12}", flush=True)


if __name__ == "__main__":
    main()

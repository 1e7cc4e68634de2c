"""One rank of the ring-attention check (run by tests/runtime/test_ring_attention.py under
torchrun): ring attention of this rank's load-balanced tokens against float64 SDPA on the full
sequence, for each case; writes the largest errors of o, dq, dk, dv to OUT/rank{r}.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.ring_attention import load_balanced_indices, ring_attention

#: (batch, query heads, kv heads, full length, head dim, block_q, block_k): MHA with several
#: tiles per chunk, and grouped-query attention with tiles that do not divide the chunk.
CASES = [(2, 2, 2, 48, 8, 4, 5), (1, 4, 2, 32, 16, 512, 128)]


def errors_of_case(b, h, hk, t, d, block_q, block_k, group) -> dict[str, float]:
    g = torch.Generator().manual_seed(t * 7 + h)           # the same full tensors on every rank
    q, k, v, do = (torch.randn(b, hh, t, d, generator=g, dtype=torch.float64)
                   for hh in (h, hk, hk, h))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=hk < h)
    ref.backward(do)
    idx = load_balanced_indices(t, dist.get_world_size(group), dist.get_rank(group))
    mine = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
    out = ring_attention(*mine, group, block_q=block_q, block_k=block_k)
    out.backward(do[:, :, idx])
    errs = {"o": float((out - ref[:, :, idx]).abs().max())}
    for name, ours, want in zip("qkv", mine, full, strict=True):
        errs[f"d{name}"] = float((ours.grad - want.grad[:, :, idx]).abs().max())
    errs["dtype_ok"] = out.dtype == torch.float64 and mine[1].grad.dtype == torch.float64
    return errs


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = [errors_of_case(*case, dist.group.WORLD) for case in CASES]
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

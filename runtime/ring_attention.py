"""Ring attention over a context-parallel group, built on our FlashAttention-2 tiles.

Sources: H. Liu, M. Zaharia, P. Abbeel, "Ring Attention with Blockwise Transformers for
Near-Infinite Context" (2023), section 3 (each rank keeps its query block and passes its
key/value block around a ring of cp ranks, overlapping each transfer with the attention of the
block it already holds); T. Dao, FlashAttention-2 (2023), Algorithms 1 and 2 (the tiles, the
log-sum-exp ``L`` they return and the backward from the saved ``L``); the causal load balance of
Megatron-LM's context parallelism and of torchtitan (each sequence cut into 2·cp chunks, rank i
holding chunks i and 2·cp − 1 − i, so every rank has the same causal work).

Forward: rank i holds queries Q_i and keys/values KV_i of its two chunks. In ring step s it
holds KV of rank j = (i − s) mod cp and merges the partial output of that block into its
running output with the log-sum-exp rule (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax")::

    L = logaddexp(L_a, L_b),   O = O_a · exp(L_a − L) + O_b · exp(L_b − L).

With the balanced layout the causal structure of a step is one of three shapes, each half the
work of a full block: s = 0, the local pair under a plain causal mask (chunk i sees itself
causally, chunk 2cp−1−i sees chunk i fully and itself causally); j < i, both query chunks see
the first key chunk j in full; j > i, the second query chunk sees both key chunks in full.

Backward: with the saved final O and L, the FA-2 backward of each key block needs only that
block (``P = exp(S − L)``, ``D = rowsum(dO · O)``). K/V ring again, and the dK/dV accumulator of
each block travels with it, one hop behind, so after cp hops it is back on its owner with every
rank's contribution summed.

Why not ``torch.distributed.tensor.experimental.context_parallel``: in torch 2.13 it rewrites
only the CUDA SDPA kernels (flash, efficient, cuDNN); on CPU SDPA runs
``aten._scaled_dot_product_flash_attention_for_cpu``, which it does not handle ("does not have a
sharding strategy registered", measured on gloo), and it cannot drive our own kernel. The ring
below runs on gloo and NCCL alike with torch.distributed's P2P ops.

Shapes: B batch, H query heads, Hk key/value heads, g = H / Hk, T full sequence, n = T / cp local
tokens (two chunks of c = n / 2), d head dim.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from runtime.attention import BLOCK_K, BLOCK_Q, _backward, _check, _forward, _rows, _unrows


def load_balanced_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global token positions held by context-parallel rank ``cp_rank``: chunks ``cp_rank`` and
    ``2·cp − 1 − cp_rank`` of the sequence cut into 2·cp equal chunks, in that order.

    >>> load_balanced_indices(8, 2, 0).tolist(), load_balanced_indices(8, 2, 1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])

    Returns:
        (seq_len / cp,) int64 positions.
    Raises:
        ValueError: 2·cp does not divide ``seq_len`` or ``cp_rank`` is outside 0..cp − 1.
    """
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp = {2 * cp}; use a "
                         f"sequence length that is a multiple of {2 * cp}")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is outside 0..{cp - 1}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                      torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)])


def shard_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of ``x`` along ``dim`` (`load_balanced_indices`): e.g. token ids or
    labels (B, T) -> (B, T / cp). cp = 1 returns ``x``."""
    if cp == 1:
        return x
    idx = load_balanced_indices(x.shape[dim], cp, cp_rank).to(x.device)
    return x.index_select(dim, idx)


class _Ring:
    """Neighbours of this rank in ``group`` and one exchange step: send to the next rank,
    receive from the previous one (``batch_isend_irecv``; peers as global ranks)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post the exchange of ``send``; returns (receive buffer, works to wait on)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _step_work(ring: _Ring, step: int, half: int, groups: int) -> tuple[slice, slice, bool]:
    """(query rows, key positions, causal) that ring step ``step`` computes on this rank, for
    the three shapes of the module docstring; rows count n·g (`runtime.attention._rows`)."""
    src = (ring.rank - step) % ring.size
    if step == 0:                           # the local pair: a plain causal mask
        return slice(None), slice(None), True
    if src < ring.rank:                     # both query chunks see key chunk src in full
        return slice(None), slice(None, half), False
    return slice(half * groups, None), slice(None), False    # the second query chunk, all keys


def _merge(o: torch.Tensor, lse: torch.Tensor, o_new: torch.Tensor, lse_new: torch.Tensor
           ) -> None:
    """Merge a partial (o_new, lse_new) into (o, lse) in place: o (..., R, d), lse (..., R)."""
    total = torch.logaddexp(lse, lse_new)
    o.mul_(torch.exp(lse - total).unsqueeze(-1)).add_(o_new * torch.exp(lse_new - total)
                                                      .unsqueeze(-1))
    lse.copy_(total)


class RingAttention(torch.autograd.Function):
    """Causal ring attention on the load-balanced layout; use `ring_attention`.

    ``apply(q, k, v, group, block_q, block_k, scale)`` with local (B, H, n, d) queries and
    (B, Hk, n, d) keys/values in `load_balanced_indices` order.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, block_q, block_k, scale):
        ring, g = _Ring(group), q.shape[1] // k.shape[1]
        dtype = torch.promote_types(q.dtype, torch.float32)   # fp32 tiles; fp64 stays fp64
        qr, kv = _rows(q, g).to(dtype), torch.stack([k, v]).to(dtype)   # kv (2, B, Hk, n, d)
        tiles = (block_q, block_k, scale, g)
        o = lse = None                                         # (B, Hk, n·g, d), (B, Hk, n·g)
        for step in range(ring.size):
            # the next block travels while this one computes (Liu et al. 2023, section 3)
            nxt = ring.start(kv, tag=0) if step + 1 < ring.size else None
            rows, keys, causal = _step_work(ring, step, q.shape[2] // 2, g)
            part = _forward(qr[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys], causal, *tiles)
            if o is None:
                o, lse = part
            else:
                _merge(o[:, :, rows], lse[:, :, rows], *part)
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.tiles = group, tiles
        return _unrows(o, g).to(q.dtype)                        # (B, H, n, d)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring, tiles = _Ring(ctx.group), ctx.tiles
        g = tiles[-1]
        qr, dor = _rows(q, g).to(o.dtype), _rows(do, g).to(o.dtype)
        kv = torch.stack([k, v]).to(o.dtype)                   # (2, B, Hk, n, d)
        dq, dkv_in = torch.zeros_like(qr), None
        for step in range(ring.size):
            nxt = ring.start(kv, tag=0) if step + 1 < ring.size else None
            rows, keys, causal = _step_work(ring, step, q.shape[2] // 2, g)
            dq_p, dk_p, dv_p = _backward(qr[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys],
                                         o[:, :, rows], lse[:, :, rows], dor[:, :, rows],
                                         causal, *tiles[:3], g)
            dq[:, :, rows].add_(dq_p)
            if dkv_in is None:                  # step 0: this rank starts its own block's sum
                dkv = torch.zeros_like(kv)
            else:                               # this block's accumulator, one hop behind it
                _wait(dkv_in[1])
                dkv = dkv_in[0]
            dkv[0, :, :, keys].add_(dk_p)
            dkv[1, :, :, keys].add_(dv_p)
            del dq_p, dk_p, dv_p
            dkv_in = ring.start(dkv, tag=1)     # (added to in place, then sent on)
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        _wait(dkv_in[1])
        dkv = dkv_in[0]                         # this rank's own block, every rank's share
        return (_unrows(dq, g).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                   scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention of a sequence split over the ranks of ``group`` (cp of them).

    Every rank of ``group`` calls it with its own tokens, laid out by `load_balanced_indices`
    (chunks cp_rank and 2·cp − 1 − cp_rank); the result equals the rows of
    ``scaled_dot_product_attention(..., is_causal=True)`` on the full sequence at those
    positions, and so do the gradients of q, k and v.

    Args:
        q: (B, H, n, d) local queries, n = T / cp even.
        k, v: (B, Hk, n, d) local keys and values; Hk divides H (grouped-query attention).
        group: the context-parallel process group (cp = its size; cp = 1 is plain causal
            attention).
        block_q, block_k, scale: as `runtime.attention.flash_attention`.
    Returns:
        (B, H, n, d) in q's dtype. Tiles compute in fp32 (fp64 for fp64 inputs).
    Raises:
        ValueError: inconsistent shapes or an odd local length.
    """
    _check(q, k, v, block_q, block_k)
    if q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"ring attention needs equal, even local query and key lengths (two "
                         f"balanced chunks); got {q.shape[2]} and {k.shape[2]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return RingAttention.apply(q, k, v, group, block_q, block_k, scale)

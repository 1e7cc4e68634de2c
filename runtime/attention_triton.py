"""The Triton kernels of our tiled attention (FlashAttention-2, Dao 2023, Algorithms 1 and 2).

`runtime.attention.flash_attention` calls `triton_flash_attention` for CUDA tensors when this
module imports (i.e. Triton is installed). The same kernels run on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1`` set before ``import triton``), which is how CI checks them.

Kernels (one program per (query or key tile, batch·head)):

- ``_fwd_kernel``: Algorithm 1. A BLOCK_M tile of queries walks the BLOCK_N key tiles (causal:
  only up to the diagonal) with an online softmax; writes O and the log-sum-exp L.
- ``_bwd_dkdv_kernel``: Algorithm 2's outer loop over key tiles: recomputes P = exp(S - L) per
  query tile and accumulates dK, dV in registers (no atomics).
- ``_bwd_dq_kernel``: dQ by a second pass over key tiles per query tile, again from L, so dQ is
  also accumulated without atomics (the split the FlashAttention-2 Triton kernels use).

GQA: query head h reads key/value head h // g. dK and dV are computed per query head and
summed over each group of g heads in PyTorch afterwards ((B, H, M, d) -> (B, Hk, M, d)).
The head dim is padded to a power of two >= 16 inside the kernels (``tl.dot`` needs >= 16).
Shapes: B batch, H query heads, Hk key/value heads, N queries, M keys, d head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Tile sizes on a GPU; the interpreter test passes 16 to stay fast.
BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _fwd_kernel(Q, K, V, Out, L, sqb, sqh, sqn, skb, skh, skn, sob, soh, son,
                H, GROUPS, N, M, D, scale,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                D_PAD: tl.constexpr, PRECISION: tl.constexpr):
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    hk = h // GROUPS
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)                  # (BM,)
    cols = tl.arange(0, D_PAD)                                        # (Dp,)
    row_ok, col_ok = rows < N, cols < D
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)    # (BM, Dp)
    # initial running max: a finite stand-in for -inf keeps exp(m_old - m_new) finite
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    hi = M
    if CAUSAL:
        hi = tl.minimum(M, (start_m + 1) * BLOCK_M)                   # skip tiles above diagonal
    k_base = K + b * skb + hk * skh
    v_base = V + b * skb + hk * skh
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)                        # (BN,)
        kv_mask = (keys[:, None] < M) & col_ok[None, :]
        k = tl.load(k_base + keys[:, None] * skn + cols[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + keys[:, None] * skn + cols[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BM, BN)
        ok = keys[None, :] < M
        if CAUSAL:
            ok = ok & (keys[None, :] <= rows[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])                                # (BM, BN)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(Out + b * sob + h * soh + rows[:, None] * son + cols[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    tl.store(L + bh * N + rows, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, L, DELTA, DK, DV, sqb, sqh, sqn, skb, skh, skn,
                     sgb, sgh, sgn, H, GROUPS, N, M, D, scale,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     D_PAD: tl.constexpr, PRECISION: tl.constexpr):
    start_n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    hk = h // GROUPS
    keys = start_n * BLOCK_N + tl.arange(0, BLOCK_N)                  # (BN,)
    cols = tl.arange(0, D_PAD)
    col_ok = cols < D
    kv_mask = (keys[:, None] < M) & col_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + keys[:, None] * skn + cols[None, :], mask=kv_mask,
                other=0.0)                                            # (BN, Dp)
    v = tl.load(V + b * skb + hk * skh + keys[:, None] * skn + cols[None, :], mask=kv_mask,
                other=0.0)
    dk = tl.zeros((BLOCK_N, D_PAD), tl.float32)
    dv = tl.zeros((BLOCK_N, D_PAD), tl.float32)
    lo = 0
    if CAUSAL:
        lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M                 # tiles above: all masked
    for start_m in range(lo, N, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_mask = (rows[:, None] < N) & col_ok[None, :]
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + cols[None, :], mask=q_mask,
                    other=0.0)                                        # (BM, Dp)
        do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqn + cols[None, :], mask=q_mask,
                     other=0.0)
        lse = tl.load(L + bh * N + rows, mask=rows < N, other=0.0)    # (BM,)
        delta = tl.load(DELTA + bh * N + rows, mask=rows < N, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BM, BN)
        ok = (rows[:, None] < N) & (keys[None, :] < M)
        if CAUSAL:
            ok = ok & (keys[None, :] <= rows[:, None])
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)               # P
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)       # (BM, BN)
        ds = p * (dp - delta[:, None]) * scale
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    out = keys[:, None] * sgn + cols[None, :]
    tl.store(DK + b * sgb + h * sgh + out, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sgb + h * sgh + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, L, DELTA, DQ, sqb, sqh, sqn, skb, skh, skn,
                   H, GROUPS, N, M, D, scale,
                   CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   D_PAD: tl.constexpr, PRECISION: tl.constexpr):
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    hk = h // GROUPS
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D_PAD)
    q_mask = (rows[:, None] < N) & (cols[None, :] < D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + cols[None, :], mask=q_mask,
                other=0.0)
    do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqn + cols[None, :], mask=q_mask,
                 other=0.0)
    lse = tl.load(L + bh * N + rows, mask=rows < N, other=0.0)
    delta = tl.load(DELTA + bh * N + rows, mask=rows < N, other=0.0)
    dq = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    hi = M
    if CAUSAL:
        hi = tl.minimum(M, (start_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (keys[:, None] < M) & (cols[None, :] < D)
        k = tl.load(K + b * skb + hk * skh + keys[:, None] * skn + cols[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(V + b * skb + hk * skh + keys[:, None] * skn + cols[None, :], mask=kv_mask,
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        ok = (rows[:, None] < N) & (keys[None, :] < M)
        if CAUSAL:
            ok = ok & (keys[None, :] <= rows[:, None])
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None]) * scale
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqn + cols[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


def _launch_args(q: torch.Tensor, k: torch.Tensor, block_m: int, block_n: int):
    d = q.shape[-1]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"   # exact fp32 GEMMs for fp32
    return dict(CAUSAL=False, BLOCK_M=block_m, BLOCK_N=block_n,
                D_PAD=max(16, triton.next_power_of_2(d)), PRECISION=precision)


class TritonAttention(torch.autograd.Function):
    """``apply(q, k, v, causal, scale, block_m, block_n)``; use `triton_flash_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_m, block_n):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, h, n, d = q.shape
        hk, m = k.shape[1], k.shape[2]
        o = torch.empty_like(q)                                          # (B, H, N, d)
        lse = torch.empty((b * h, n), dtype=torch.float32, device=q.device)   # (B·H, N)
        meta = _launch_args(q, k, block_m, block_n) | {"CAUSAL": causal}
        grid = (triton.cdiv(n, block_m), b * h)
        _fwd_kernel[grid](q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *o.stride()[:3],
                          h, h // hk, n, m, d, scale, **meta)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.blocks = causal, scale, (block_m, block_n)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        b, h, n, d = q.shape
        hk, m = k.shape[1], k.shape[2]
        block_m, block_n = ctx.blocks
        delta = (do.float() * o.float()).sum(-1).reshape(b * h, n)       # D: (B·H, N)
        dq = torch.empty_like(q)
        # per query head, fp32 so the GQA group sum below does not round in bf16
        dk_h = torch.empty((b, h, m, d), dtype=torch.float32, device=k.device)
        dv_h = torch.empty_like(dk_h)
        meta = _launch_args(q, k, block_m, block_n) | {"CAUSAL": ctx.causal}
        common = (h, h // hk, n, m, d, ctx.scale)
        _bwd_dkdv_kernel[(triton.cdiv(m, block_n), b * h)](
            q, k, v, do, lse, delta, dk_h, dv_h, *q.stride()[:3], *k.stride()[:3],
            *dk_h.stride()[:3], *common, **meta)
        _bwd_dq_kernel[(triton.cdiv(n, block_m), b * h)](
            q, k, v, do, lse, delta, dq, *q.stride()[:3], *k.stride()[:3], *common, **meta)
        g = h // hk
        dk = dk_h.view(b, hk, g, m, d).sum(2) if g > 1 else dk_h         # (B, Hk, M, d)
        dv = dv_h.view(b, hk, g, m, d).sum(2) if g > 1 else dv_h
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def triton_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           causal: bool = False, scale: float | None = None,
                           block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> torch.Tensor:
    """FlashAttention-2 in Triton: q (B, H, N, d), k/v (B, Hk, M, d) -> (B, H, N, d).

    Same contract as `runtime.attention.flash_attention` (causal is top-left aligned). Block
    sizes must be powers of two >= 16.

    Raises:
        ValueError: a block size is not a power of two >= 16.
    """
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two >= 16 (tl.dot tiles)")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return TritonAttention.apply(q, k, v, causal, scale, block_m, block_n)

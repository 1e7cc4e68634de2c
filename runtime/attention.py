"""Our tiled attention: the FlashAttention-2 algorithm as a ``torch.autograd.Function``.

Source: T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning" (2023), Algorithm 1 (forward) and Algorithm 2 (backward).

Forward (Algorithm 1): for each block of queries, walk the key/value blocks and keep an online
softmax per query row: running max ``m``, running normaliser ``l`` and an unnormalised output
``acc``; the (N, N) attention matrix never exists, only one (block_q, block_k) tile at a time.
Only the output O and the log-sum-exp ``L = m + log l`` per row are saved.

Backward (Algorithm 2): with ``D = rowsum(dO * O)``, for each key/value block walk the query
blocks, recompute the tile ``P = exp(S - L)`` from the saved log-sum-exp and accumulate
``dV += P^T dO``, ``dS = P * (dO V^T - D)``, ``dQ += dS K * scale``, ``dK += dS^T Q * scale``.

Causal masking (top-left aligned, as ``scaled_dot_product_attention(is_causal=True)``: query i
sees keys j <= i) skips every tile that lies wholly above the diagonal and masks only the tiles
that cross it. Grouped-query attention (fewer key/value heads) is handled without repeating K
and V: the g = heads / kv_heads query heads of one KV head are laid out as g·N query rows.

On CUDA the Triton kernel of the same algorithm (`runtime.attention_triton`) is used when
Triton is importable; everywhere else the PyTorch implementation below runs. Its tiles are
computed in fp32 whatever the input dtype (FlashAttention keeps the softmax statistics and
accumulators in fp32 too), and the outputs and gradients are cast back to the input dtype.

Shapes: B batch, H query heads, Hk key/value heads (H % Hk == 0), g = H / Hk, N query length,
M key length, d head dim.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor, wait

import torch

#: Default tile sizes of the PyTorch path, measured on a 2-core AVX-512 CPU (fp32, d=64,
#: 8 heads): a (heads, 256, 128) fp32 score tile is 1 MiB at 8 heads (512 KiB at the 4 heads of
#: one of 2 threads), so a tile and its P / dS companions stay in a 2 MiB L2; 512-row tiles
#: spill to L3 and made fwd+bwd 1.3–1.8x slower at 1k–4k.
BLOCK_Q = 256
BLOCK_K = 128


def _triton_available() -> bool:
    try:
        from runtime import attention_triton  # noqa: F401  (imports triton)
    except ImportError:
        return False
    return True


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, seq, head_dim); got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"k and v must be (B, Hk, M, d) with q's B and d; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads "
                         f"({k.shape[1]})")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q={block_q} and block_k={block_k} must be >= 1")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                    scale: float | None = None) -> torch.Tensor:
    """Exact softmax attention ``softmax(q k^T * scale [+ causal mask]) v``, tiled.

    Args:
        q: (B, H, N, d) queries.
        k: (B, Hk, M, d) keys; Hk divides H (grouped-query attention when Hk < H).
        v: (B, Hk, M, d) values.
        causal: mask keys after the query position (top-left aligned, as SDPA's ``is_causal``).
        block_q: query rows per tile (per KV head; times g under GQA) of the PyTorch path.
        block_k: keys per tile of the PyTorch path. The Triton kernel (CUDA) uses its own
            power-of-two tiles (`runtime.attention_triton.BLOCK_M` / ``BLOCK_N``).
        scale: logit scale; default 1/sqrt(d).
    Returns:
        (B, H, N, d) output in q's dtype. Peak extra memory is O(N·d + block_q·block_k) per
        (batch, head): linear in the sequence length.
    Raises:
        ValueError: shapes or block sizes are inconsistent.
    """
    _check(q, k, v, block_q, block_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.is_cuda and _triton_available():
        from runtime.attention_triton import triton_flash_attention
        return triton_flash_attention(q, k, v, causal=causal, scale=scale)
    return TiledAttention.apply(q, k, v, causal, block_q, block_k, scale)


def _rows(q: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, N, d) -> (B, Hk, N·g, d): row n·g + i is query position n of head group i."""
    b, h, n, d = q.shape
    return q.view(b, h // groups, groups, n, d).transpose(2, 3).reshape(b, h // groups,
                                                                         n * groups, d)


def _unrows(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of `_rows`: (B, Hk, N·g, d) -> (B, H, N, d)."""
    b, hk, rows, d = x.shape
    return x.view(b, hk, rows // groups, groups, d).transpose(2, 3).reshape(
        b, hk * groups, rows // groups, d)


def _key_blocks(q_start: int, q_end: int, m: int, block_k: int, causal: bool) -> range:
    """Starts of the key tiles that query positions [q_start, q_end) attend to."""
    stop = min(m, q_end) if causal else m
    return range(0, stop, block_k)


class _CausalBias:
    """Additive causal masks (0 where key <= query, -inf after) of the tiles that cross the
    diagonal, as (R, bk) tensors broadcast over the batch of heads; tiles wholly on or below
    the diagonal get None (no mask). A mask depends only on the tile's shape and on the offset
    of its first key from its first query, so each distinct one is built once per call."""

    def __init__(self, groups: int, dtype: torch.dtype, device: torch.device) -> None:
        self.groups, self.dtype, self.device = groups, dtype, device
        self.cache: dict[tuple[int, int, int], torch.Tensor] = {}

    def __call__(self, q_start: int, q_end: int, k_start: int, k_end: int
                 ) -> torch.Tensor | None:
        if k_end - 1 <= q_start:                              # wholly on/below the diagonal
            return None
        key = (k_start - q_start, q_end - q_start, k_end - k_start)
        bias = self.cache.get(key)
        if bias is None:
            q_pos = torch.arange(q_end - q_start, device=self.device).repeat_interleave(
                self.groups)                                                      # (R,)
            k_pos = torch.arange(k_start - q_start, k_end - q_start, device=self.device)
            bias = torch.zeros(q_pos.numel(), k_pos.numel(), dtype=self.dtype,
                               device=self.device)
            bias.masked_fill_(k_pos[None, :] > q_pos[:, None], -math.inf)       # (R, bk)
            self.cache[key] = bias
        return bias


def _heads(x: torch.Tensor) -> torch.Tensor:
    """(B, Hk, L, ...) -> (B·Hk, L, ...) (the batched-matmul layout): a view of a contiguous
    tensor (what the outputs written through it must be), a copy of a strided input."""
    return x.flatten(0, 1)


class TiledAttention(torch.autograd.Function):
    """FlashAttention-2 forward/backward in PyTorch (Dao 2023, Algorithms 1 and 2).

    ``apply(q, k, v, causal, block_q, block_k, scale)``; use `flash_attention`.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, block_q, block_k, scale):
        groups = q.shape[1] // k.shape[1]
        qr = _rows(q, groups).float()                         # (B, Hk, N·g, d)
        kf, vf = k.float(), v.float()                         # (B, Hk, M, d)
        o, lse = _forward(qr, kf, vf, causal, block_q, block_k, scale, groups)
        ctx.save_for_backward(q, k, v, o, lse)                # o (B,Hk,N·g,d), lse (B,Hk,N·g)
        ctx.causal, ctx.block_q, ctx.block_k, ctx.scale = causal, block_q, block_k, scale
        return _unrows(o, groups).to(q.dtype)                 # (B, H, N, d)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = _backward(_rows(q, groups).float(), k.float(), v.float(), o, lse,
                               _rows(do, groups).float(), ctx.causal, ctx.block_q,
                               ctx.block_k, ctx.scale, groups)
        return (_unrows(dq, groups).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None)


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(size: int) -> ThreadPoolExecutor:
    """The process's thread pool of ``size`` workers, made once: a pool per call started and
    joined its threads every attention call (every ring step under context parallelism)."""
    if size not in _POOLS:
        _POOLS[size] = ThreadPoolExecutor(size, thread_name_prefix="meshplan-attention")
    return _POOLS[size]


def _over_heads(work, bh: int) -> None:
    """Run ``work(lo, hi)`` over the heads [0, bh) of the (B·Hk, ...) layout, split evenly over
    ``torch.get_num_threads()`` threads, each running its tiles single-threaded.

    Why not torch's intra-op threads: every tile op would fork and join the whole thread team
    (thousands of joins per call, each waiting for the slowest thread, which on a loaded machine
    is often descheduled); splitting the heads gives one join per call, as SDPA's CPU kernel
    has (one parallel loop over batch, heads and query blocks). The torch ops release the GIL,
    so the Python threads overlap. ``torch.set_num_threads`` is process-wide, so it is 1 for
    the duration of the call and restored after.
    """
    threads = torch.get_num_threads()
    workers = min(threads, bh)
    if workers <= 1:
        work(0, bh)
        return
    bounds = [bh * i // workers for i in range(workers + 1)]
    grad = torch.is_grad_enabled()                             # grad mode is per thread

    def worker(lo: int, hi: int) -> None:
        with torch.set_grad_enabled(grad):
            work(lo, hi)

    torch.set_num_threads(1)
    try:
        pool = _pool(workers - 1)
        futures = [pool.submit(worker, bounds[i], bounds[i + 1]) for i in range(1, workers)]
        try:
            work(bounds[0], bounds[1])
        finally:
            wait(futures)            # every share ends before the threads' count is restored
        for future in futures:
            future.result()
    finally:
        torch.set_num_threads(threads)


def _forward(qr, k, v, causal, block_q, block_k, scale, groups):
    """Algorithm 1 on rows (fp32, or fp64 for fp64 inputs): qr (B, Hk, N·g, d), k/v
    (B, Hk, M, d) -> (o (B, Hk, N·g, d), lse (B, Hk, N·g)), both in qr's dtype.

    Every tile is one batched GEMM over a share of the B·Hk heads (`_over_heads`) with Q scaled
    once per query block and the causal mask of a diagonal tile as the GEMM's additive input;
    the output accumulates in place in a contiguous block (``baddbmm_``).
    """
    o = torch.empty(qr.shape, dtype=qr.dtype, device=qr.device)           # (B, Hk, N·g, d)
    lse = torch.empty(qr.shape[:3], dtype=qr.dtype, device=qr.device)     # (B, Hk, N·g)
    q3, o3, lse3 = _heads(qr), _heads(o), _heads(lse)
    kt3, v3 = _heads(k).transpose(1, 2), _heads(v)            # (B·Hk, d, M), (B·Hk, M, d)
    _over_heads(lambda lo, hi: _forward_tiles(q3[lo:hi], kt3[lo:hi], v3[lo:hi], o3[lo:hi],
                                              lse3[lo:hi], causal, block_q, block_k, scale,
                                              groups), q3.shape[0])
    return o, lse


def _forward_tiles(q3, kt3, v3, o3, lse3, causal, block_q, block_k, scale, groups):
    """`_forward`'s tile loop on heads (h, ...): q3 (h, N·g, d), kt3 (h, d, M), v3 (h, M, d);
    writes o3 (h, N·g, d) and lse3 (h, N·g)."""
    n, m = q3.shape[1] // groups, v3.shape[1]
    masks = _CausalBias(groups, q3.dtype, q3.device) if causal else None
    for qs in range(0, n, block_q):
        qe = min(qs + block_q, n)
        rows = slice(qs * groups, qe * groups)
        q_blk = q3[:, rows] * scale                            # Q·scale: (h, R, d), R = bq·g
        row_max = row_sum = None                               # (h, R)
        # contiguous: an in-place baddbmm_ into a strided view runs one GEMM per head
        acc = torch.empty(q_blk.shape, dtype=q3.dtype, device=q3.device)   # (h, R, d)
        for ks in _key_blocks(qs, qe, m, block_k, causal):
            ke = min(ks + block_k, m)
            mask = masks(qs, qe, ks, ke) if causal else None
            s = (torch.bmm(q_blk, kt3[:, :, ks:ke]) if mask is None
                 else torch.baddbmm(mask, q_blk, kt3[:, :, ks:ke]))      # S: (h, R, bk)
            tile_max = s.amax(dim=-1)                                    # (h, R)
            if row_max is None:                                # first tile: nothing to rescale
                row_max = tile_max
                p = s.sub_(row_max.unsqueeze(-1)).exp_()
                row_sum = p.sum(dim=-1)
                torch.bmm(p, v3[:, ks:ke], out=acc)
                continue
            new_max = torch.maximum(row_max, tile_max)
            p = s.sub_(new_max.unsqueeze(-1)).exp_()                     # (h, R, bk)
            alpha = row_max.sub_(new_max).exp_()                         # (h, R)
            row_sum.mul_(alpha).add_(p.sum(dim=-1))
            acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p, v3[:, ks:ke])
            row_max = new_max
        torch.div(acc, row_sum.unsqueeze(-1), out=o3[:, rows])
        torch.add(row_max, row_sum.log_(), out=lse3[:, rows])


def _backward(qr, k, v, o, lse, dor, causal, block_q, block_k, scale, groups):
    """Algorithm 2 on fp32 rows; returns dq (B, Hk, N·g, d), dk and dv (B, Hk, M, d).

    Per tile: ``S − L`` is one GEMM with the log-sum-exp as its additive input (plus the causal
    mask on diagonal tiles), ``dP − D`` likewise with D, the scale rides in the GEMMs' alpha,
    and dV, dK, dQ accumulate in place (``baddbmm_``): two elementwise passes (exp, times P).
    The heads are split over the threads as in `_forward`.
    """
    neg_delta = (dor * o).sum(dim=-1).neg_().unsqueeze(-1)   # −D: (B, Hk, N·g, 1)
    neg_lse = lse.neg().unsqueeze(-1)                         # −L: (B, Hk, N·g, 1)
    # contiguous, whatever the inputs' strides: the tiles write through `_heads` views, and a
    # strided (B > 1, transposed) tensor would flatten to a copy, leaving these unwritten
    dq = torch.empty(qr.shape, dtype=qr.dtype, device=qr.device)   # (B, Hk, N·g, d)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)      # (B, Hk, M, d)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    t = [_heads(x) for x in (qr, k, v, dor, neg_lse, neg_delta, dq, dk, dv)]
    _over_heads(lambda lo, hi: _backward_tiles(*(x[lo:hi] for x in t), causal, block_q,
                                               block_k, scale, groups), t[0].shape[0])
    return dq, dk, dv


def _backward_tiles(q3, k3, v3, do3, nl3, nd3, dq3, dk3, dv3, causal, block_q, block_k,
                    scale, groups):
    """`_backward`'s tile loop on heads (h, ...): q3/do3 (h, N·g, d), k3/v3 (h, M, d), −L and
    −D (h, N·g, 1); writes dq3 (h, N·g, d), dk3 and dv3 (h, M, d)."""
    n, m = q3.shape[1] // groups, k3.shape[1]
    h, rows_q = q3.shape[0], block_q * groups
    # Accumulators are contiguous (an in-place baddbmm_ into a strided view runs one GEMM per
    # head): dQ block-major, one (h, R, d) block per query tile, reordered once at the end.
    n_qb = -(-n // block_q)
    dq_blocks = torch.zeros(n_qb, h, rows_q, q3.shape[2], dtype=q3.dtype, device=q3.device)
    masks = _CausalBias(groups, q3.dtype, q3.device) if causal else None
    for ks in range(0, m, block_k):
        ke = min(ks + block_k, m)
        kt_blk, vt_blk = k3[:, ks:ke].transpose(1, 2), v3[:, ks:ke].transpose(1, 2)
        k_blk = k3[:, ks:ke]                                   # (h, bk, d)
        dk_blk = torch.zeros(k_blk.shape, dtype=q3.dtype, device=q3.device)
        dv_blk = torch.zeros_like(dk_blk)                      # (h, bk, d)
        first = (ks // block_q) * block_q if causal else 0     # query tiles above: masked
        for qs in range(first, n, block_q):
            qe = min(qs + block_q, n)
            rows = slice(qs * groups, qe * groups)
            q_blk, do_blk = q3[:, rows], do3[:, rows]          # (h, R, d)
            bias = nl3[:, rows]                                # (h, R, 1)
            mask = masks(qs, qe, ks, ke) if causal else None
            if mask is not None:
                bias = bias + mask                             # (h, R, bk)
            p = torch.baddbmm(bias, q_blk, kt_blk, alpha=scale).exp_()   # P: (h, R, bk)
            dv_blk.baddbmm_(p.transpose(1, 2), do_blk)                    # (h, bk, d)
            ds = torch.baddbmm(nd3[:, rows], do_blk, vt_blk).mul_(p)     # dS = P (dP − D)
            dq_blocks[qs // block_q, :, :rows.stop - rows.start].baddbmm_(ds, k_blk,
                                                                          alpha=scale)
            dk_blk.baddbmm_(ds.transpose(1, 2), q_blk, alpha=scale)      # (h, bk, d)
        dk3[:, ks:ke], dv3[:, ks:ke] = dk_blk, dv_blk
    dq3.copy_(dq_blocks.transpose(0, 1).reshape(h, n_qb * rows_q, -1)[:, :n * groups])


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    causal: bool = False) -> torch.Tensor:
    """Materialised attention (the (N, M) matrix is stored for backward): the memory baseline.

    Shapes as `flash_attention`.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])     # (B, H, N, M)
    if causal:
        n, m = q.shape[2], k.shape[2]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, -math.inf)
    return torch.matmul(torch.softmax(s, dim=-1), v)                       # (B, H, N, d)

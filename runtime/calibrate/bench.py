"""The microbenchmarks of `meshplan calibrate` (`runtime.calibrate.calibrate` runs them in worker
processes): the runtime's model step timed by phase, the embedding, single-op rates, gloo
collectives, send/recv and one pipeline-schedule action. One torch thread per process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from planner.spec import ModelSpec


def median_s(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_step_times(spec: ModelSpec, layers: int, micro_batch: int, iters: int, *,
                     recompute: str = "none", tp_mesh=None, dp_mesh=None,
                     zero_stage: int = 3, sequence_parallel: bool = False,
                     cp_mesh=None, barrier=None) -> dict[str, float]:
    """Median forward, backward and AdamW seconds of the runtime's model with ``layers``
    layers on one (micro_batch, seq_len) batch; under TP when ``tp_mesh`` is given (with
    sequence parallelism when ``sequence_parallel``), under context parallelism when
    ``cp_mesh`` is, under FSDP2 (`runtime.parallel.dp.apply_dp` at ``zero_stage``) when
    ``dp_mesh`` is. Arguments as `model_step_rows`."""
    rows = model_step_rows(spec, layers, micro_batch, iters, recompute=recompute,
                           tp_mesh=tp_mesh, dp_mesh=dp_mesh, zero_stage=zero_stage,
                           sequence_parallel=sequence_parallel, cp_mesh=cp_mesh,
                           barrier=barrier)
    return {k: statistics.median(r[j] for r in rows)
            for j, k in enumerate(("fwd", "bwd", "opt"))}


def model_step_rows(spec: ModelSpec, layers: int, micro_batch: int, iters: int, *,
                    recompute: str = "none", tp_mesh=None, dp_mesh=None,
                    zero_stage: int = 3, sequence_parallel: bool = False,
                    cp_mesh=None, barrier=None) -> list[tuple[float, float, float]]:
    """``(forward, backward, AdamW)`` seconds of each of ``iters`` timed steps (after two
    warm-up steps) of the runtime's model with ``layers`` layers on one (micro_batch,
    seq_len) batch. ``recompute`` is `runtime.parallel.recompute.apply_recompute`'s policy ("none",
    "full", "selective"). ``barrier`` (a callable) runs before every step, so that processes
    timed together start each step together; TP / SP / FSDP2 as in `model_step_times`.
    ``cp_mesh``: the model as a context-parallel plan runs it (`runtime.parallel.cp.apply_cp`:
    every block's attention is the key/value ring of `runtime.ring_attention` on the tiled
    kernel of `runtime.attention`), each rank on its load-balanced seq_len / cp tokens of the
    batch (`runtime.ring_attention.shard_sequence`); no gradient reduction (the caller costs
    DP over dp·cp as for the other terms)."""
    import torch
    from torch.distributed.tensor.parallel import loss_parallel

    from runtime.model import Transformer, cross_entropy_loss
    from runtime.parallel.cp import apply_cp
    from runtime.parallel.dp import apply_dp
    from runtime.parallel.recompute import apply_recompute
    from runtime.parallel.tp import apply_tp
    from runtime.ring_attention import shard_sequence
    from runtime.train import make_optimizer

    model = Transformer(spec.replace(num_layers=layers), seed=0)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=True)
    if cp_mesh is not None:
        apply_cp(model, cp_mesh)
    apply_recompute(model, recompute)
    if dp_mesh is not None:
        model = apply_dp(model, dp_mesh, zero_stage=zero_stage)
    opt = make_optimizer(model.parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec.vocab_size, (micro_batch, spec.seq_len), generator=g)
    y = torch.randint(0, spec.vocab_size, (micro_batch, spec.seq_len), generator=g)
    if cp_mesh is not None:
        x, y = (shard_sequence(t, cp_mesh.size(), cp_mesh.get_local_rank()) for t in (x, y))
    ctx = loss_parallel if tp_mesh is not None else _nullcontext
    rows = []
    for i in range(iters + 2):                     # two warm-up steps (DTensor propagation)
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        with ctx():
            loss = cross_entropy_loss(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= 2:
            rows.append((t1 - t0, t2 - t1, t3 - t2))
    return rows


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def embedding_times(spec: ModelSpec, micro_batch: int, iters: int) -> dict[str, float]:
    import torch
    tok = torch.nn.Embedding(spec.vocab_size, spec.hidden)
    pos = torch.nn.Embedding(spec.seq_len, spec.hidden)
    x = torch.randint(0, spec.vocab_size, (micro_batch, spec.seq_len))
    rows = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        h = tok(x) + pos(torch.arange(spec.seq_len))
        t1 = time.perf_counter()
        h.sum().backward()
        rows.append((t1 - t0, time.perf_counter() - t1))
    return {"fwd": statistics.median(r[0] for r in rows[1:]),
            "bwd": statistics.median(r[1] for r in rows[1:])}


def op_rates(spec: ModelSpec, iters: int) -> dict[str, float]:
    """GEMM FLOP/s at the layer shapes (best and harmonic mean), SDPA fwd+bwd FLOP/s, and
    elementwise (GeLU, LayerNorm) and copy bytes/s, one thread."""
    import torch
    import torch.nn.functional as F

    from runtime.calibrate.probe import layer_gemm_shapes
    rates = []
    for m, k, n in layer_gemm_shapes(spec, micro_batch=4):
        a, b = torch.randn(m, k), torch.randn(k, n)
        rates.append(2.0 * m * k * n / median_s(lambda a=a, b=b: a @ b, iters))
    heads, d, s = spec.num_heads, spec.head_dim, spec.seq_len
    q, k_, v = (torch.randn(4, heads, s, d, requires_grad=True) for _ in range(3))

    def attn():
        F.scaled_dot_product_attention(q, k_, v, is_causal=True).sum().backward()
    # causal QKᵀ and AV forward = 2·b·a·s²·d, backward 2.5x (FlashAttention-2 accounting)
    attn_flops = 3.5 * 2 * 4 * heads * s * s * d
    big = torch.randn(4 * s, spec.ffn_hidden)
    act = torch.randn(4 * s, spec.hidden)
    ln = torch.nn.LayerNorm(spec.hidden)
    src = torch.empty(16 * 2**20)
    dst = torch.empty_like(src)
    return {"gemm_best_flops": max(rates), "gemm_mean_flops": statistics.harmonic_mean(rates),
            "attention_flops": attn_flops / median_s(attn, iters),
            "gelu_Bps": 2 * big.numel() * 4 / median_s(lambda: F.gelu(big), iters),
            "layernorm_Bps": 2 * act.numel() * 4 / median_s(lambda: ln(act), iters),
            "copy_Bps": 2 * src.numel() * 4 / median_s(lambda: dst.copy_(src), iters)}


def time_collective(dist, op, size, group, iters):
    import torch
    n = dist.get_world_size(group)
    elems = max(n, int(size // 4) // n * n)
    x = torch.ones(elems)
    shard = torch.empty(elems // n)
    if op == "all_reduce":
        def fn():
            dist.all_reduce(x, group=group)
    elif op == "reduce_scatter":
        def fn():
            dist.reduce_scatter_tensor(shard, x, group=group)
    else:
        def fn():
            dist.all_gather_into_tensor(x, shard, group=group)
    # per-rank buffer bytes: the full tensor for all-reduce / reduce-scatter input / gather out
    dist.barrier()
    return median_s(fn, iters, warmup=2)


def time_p2p(dist, size, iters):
    import torch
    rank = dist.get_rank()
    x = torch.ones(max(1, int(size // 4)))
    peer = rank ^ 1

    def ping():
        if rank % 2 == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
    dist.barrier()
    return median_s(ping, iters, warmup=2) / 2


def time_pipeline_action(dist, world: int, micro_batches: int, iters: int, width: int,
                         tokens: int, virtual_stages: int = 1) -> float:
    """Seconds per pipeline action (one forward or backward of one micro-batch on one stage
    chunk, with its send / receive) of ``torch.distributed.pipelining`` over ``world`` ranks
    whose compute is a tiny Linear on a (tokens, width) activation: the schedule's own cost.

    ``virtual_stages`` = 1: `Schedule1F1B`, the step's critical path is 2·(m + world − 1)
    actions; > 1: `ScheduleInterleaved1F1B` with that many chunks per rank (rank r holds
    stages r, r + world, ...), 2·(m·v + world − 1) actions (Narayanan et al. 2021, §2.2.2).
    ``micro_batches`` must be a multiple of ``world`` when interleaved."""
    import torch
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
    )
    rank, v = dist.get_rank(), virtual_stages
    stages = [PipelineStage(torch.nn.Linear(width, width), rank + c * world, world * v,
                            torch.device("cpu")) for c in range(v)]

    def loss_fn(out, y):
        return ((out - y) ** 2).mean()
    if v == 1:
        schedule = Schedule1F1B(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=micro_batches,
                                           loss_fn=loss_fn)
    x = torch.randn(micro_batches, tokens, width)

    def step():
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=x, losses=[])
        else:
            schedule.step()
        dist.barrier()
    step_s = median_s(step, iters, warmup=2)
    return step_s / (2 * (micro_batches * v + world - 1))

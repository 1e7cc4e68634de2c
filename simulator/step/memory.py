"""Memory per pipeline stage: weights, gradients, optimizer states, activations.

Sources: ZeRO (Rajbhandari et al. 2020, §3.1) for 2 + 2 + 12 bytes per parameter with mixed-
precision Adam and for what each ZeRO stage shards; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4 and Table 2, for activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from planner.mesh import chunk_rank, rank_chunks
from planner.precision import recipe, storage_dtype, weight_cache_bytes_per_param
from planner.spec import DTYPE_BYTES, V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, ModelSpec, Plan
from simulator.network.collectives import identity_memo, memo_enabled
from simulator.step.zb_orders import rank_peak_in_flight


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one rank of a pipeline stage holds at its peak."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    overhead_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        """Sum of all parts."""
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.overhead_bytes)

    def to_dict(self) -> dict[str, float]:
        """JSON-ready dict of the parts and ``total_bytes``."""
        return {**asdict(self), "total_bytes": self.total_bytes}


def chunk_params(model: ModelSpec, plan: Plan, chunk: int) -> float:
    """Parameters one TP rank holds of pipeline chunk ``chunk`` (pipeline order, pp·v chunks,
    chunk g on pipeline rank g % pp): its blocks / tp; chunk 0 adds the input embedding
    (V·h / tp, vocab-parallel); the last adds the output projection and the final norm (a
    tied projection is still a separate copy on the last stage when pp > 1, as in
    Megatron-LM).

    >>> from planner.presets import load_model
    >>> chunk_params(load_model("tiny-gpt"), Plan(tp=1, pp=2, dp=1, micro_batch=1,
    ...     global_batch=8, dtype="fp32", schedule="interleaved-1f1b", virtual_stages=2), 1)
    787456.0
    """
    return _chunk_params(model, plan, chunk, plan.layers_per_stage(model), model.layer_params())


def _chunk_params(model: ModelSpec, plan: Plan, chunk: int, sizes: tuple[int, ...],
                  layer: int) -> float:
    # `chunk_params` with the chunk sizes and one block's parameters already known.
    params = sizes[chunk] * layer / plan.tp
    if chunk == 0:
        params += model.embedding_params() / plan.tp
    if chunk == len(sizes) - 1:
        untied_or_split = not model.tied_embeddings or plan.pp > 1
        params += untied_or_split * model.vocab_size * model.hidden / plan.tp
        params += (2 if model.norm == "layernorm" else 1) * model.hidden
    return float(params)


def stage_params(model: ModelSpec, plan: Plan, stage: int) -> float:
    """Parameters one TP rank of pipeline ``stage`` holds (before ZeRO sharding): the sum of
    its chunks' `chunk_params` (one chunk unless interleaved; `planner.mesh.rank_chunks`)."""
    return stage_param_splits(model, plan)[stage][0] if not model.is_moe else \
        sum(chunk_params(model, plan, c) for c in rank_chunks(plan, stage))


def stage_param_splits(model: ModelSpec, plan: Plan) -> list[tuple[float, float]]:
    """`stage_param_split` of every pipeline stage, in stage order, in one pass over the
    chunks.

    >>> from planner.presets import load_model
    >>> p = Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=8, dtype="fp32",
    ...          schedule="interleaved-1f1b", virtual_stages=2)
    >>> m = load_model("tiny-gpt")
    >>> c = [chunk_params(m, p, g) for g in range(4)]  # chunk g sits on rank g % pp
    >>> stage_param_splits(m, p) == [(c[0] + c[2], 0.0), (c[1] + c[3], 0.0)]
    True
    """
    sizes, layer, moe = plan.layers_per_stage(model), model.layer_params(), model.is_moe
    last, inner, out = len(sizes) - 1, {}, [[0.0, 0.0] for _ in range(plan.pp)]
    chunk_list = []
    for g, size in enumerate(sizes):
        if 0 < g < last:  # an inner chunk: its blocks only, equal for equal sizes
            if size not in inner:
                inner[size] = _chunk_params(model, plan, g, sizes, layer)
            chunk_list.append(inner[size])
        else:
            chunk_list.append(_chunk_params(model, plan, g, sizes, layer))
    if not moe and plan.schedule not in V_SCHEDULES:  # chunk g on rank g % pp, in order
        return [(sum(chunk_list[r::plan.pp]), 0.0) for r in range(plan.pp)]
    if moe:
        from simulator.step.moe import chunk_param_split
    for g, params in enumerate(chunk_list):   # in chunk order: each rank's in rank_chunks order
        dense, expert = chunk_param_split(model, plan, g, params) if moe else (params, 0.0)
        acc = out[chunk_rank(plan.schedule, plan.pp, g)]
        acc[0], acc[1] = acc[0] + dense, acc[1] + expert
    return [(d, e) for d, e in out]


def stage_param_split(model: ModelSpec, plan: Plan, stage: int) -> tuple[float, float]:
    """(non-expert, routed-expert) parameters one rank of pipeline ``stage`` holds before
    ZeRO sharding: `stage_params` for a dense model (no experts); for an MoE model the routed
    experts are held E/ep per rank and 1/etp of each, the rest split over tp
    (`simulator.step.moe.chunk_param_split`). ZeRO shards the first over dp·cp and the
    experts over the expert data-parallel group edp (Megatron-Core's distributed optimizer
    with MoE parallel folding)."""
    if not model.is_moe:
        return stage_param_splits(model, plan)[stage]
    from simulator.step.moe import chunk_param_split
    dense = expert = 0.0
    for c in rank_chunks(plan, stage):
        d, e = chunk_param_split(model, plan, c, chunk_params(model, plan, c))
        dense, expert = dense + d, expert + e
    return dense, expert


def optimizer_bytes_per_param(dtype: str) -> int:
    """Adam state bytes per parameter: 12 (fp32 master + 2 moments) for 16/8-bit training,
    8 (2 fp32 moments) for fp32 training (ZeRO paper §3.1, K = 12)."""
    return 8 if DTYPE_BYTES[dtype] == 4 else 12


def layer_activation_bytes(model: ModelSpec, plan: Plan, attention: str = "unfused") -> float:
    """Activation bytes one layer stores for one micro-batch on one TP rank.

    Korthikanti et al. 2022 Table 2, generalised to ffn width f and KV width k (it reduces to
    the paper's 34·sbh + 5·a·s²·b when f = 4h and k = h):
    attention 7h + 4k, MLP 3h + 4f (GeLU) or 3h + 6f (SwiGLU), two norms 4h, all times s·b,
    plus 5·a·s²·b for the scores. Of these, 10·s·b·h (norms, block inputs, dropout masks) is
    replicated over TP unless sequence parallelism shards it. Full recomputation keeps only the
    layer input (2·s·b·h); selective drops the 5·a·s²·b term. (This is a recomputed block's;
    under the block method the blocks that do not recompute keep what ``recompute="none"``
    keeps: `memory_per_stage`.) 16-bit bytes; scaled by
    dtype_bytes / 2. Context parallelism keeps s/cp tokens per rank (scores: s/cp queries by
    s keys). Fused attention (``attention`` "flash" or "flash-triton") stores no score
    matrix, only the fp32 log-sum-exp of each query row (4·a·s·b bytes; Dao et al. 2022, §3.1:
    the backward recomputes the scores from it), so it costs what selective recomputation
    keeps.
    """
    s, b, h, t = model.seq_len // plan.cp, plan.micro_batch, model.hidden, plan.tp
    scale = DTYPE_BYTES[plan.dtype] / 2
    if plan.recompute == "full":
        return 2 * s * b * h * scale / (t if plan.sequence_parallel else 1)
    mlp = 3 * h + (6 if model.activation == "swiglu" else 4) * model.ffn_hidden
    linear = (7 * h + 4 * model.kv_hidden) + mlp + 4 * h
    replicated = 10 * h
    per_token = (linear / t) if plan.sequence_parallel else (replicated + (linear - replicated) / t)
    if attention != "unfused":
        return s * b * per_token * scale + 4 * model.num_heads / t * s * b
    scores = 0.0 if plan.recompute == "selective" else \
        5 * model.num_heads * s * model.seq_len * b / t
    return (s * b * per_token + scores) * scale


def lowp_activation_saving(model: ModelSpec, plan: Plan) -> float:
    """Bytes per layer and micro-batch a low-precision recipe saves on the stored activations:
    Transformer Engine keeps each linear GEMM's input for the weight gradient as its
    low-precision cast (``operand_bytes`` an element) instead of bf16 (2): the two norm
    outputs feeding QKV and MLP up (T·h, /tp with sequence parallelism), the attention
    output feeding the output projection (T·h/tp) and the activation output feeding MLP
    down (T·f/tp); T = s·b/cp. 0 for bf16 and under full recomputation (only block inputs
    are kept).

    >>> from planner.presets import load_model
    >>> m, p = load_model("llama3-8b"), Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1,
    ...                                      dtype="fp8")
    >>> lowp_activation_saving(m, p) == 8192 * (3 * 4096 + 14336) * (2 - 1)
    True
    """
    r = recipe(plan.dtype)
    if r is None or plan.recompute == "full":
        return 0.0
    t, tp = model.seq_len // plan.cp * plan.micro_batch, plan.tp
    norm_out = 2 * model.hidden / (tp if plan.sequence_parallel else 1)
    return t * (norm_out + (model.hidden + model.ffn_hidden) / tp) * (2 - r.operand_bytes)


def microbatches_in_flight(plan: Plan, stage: int) -> float:
    """Micro-batches of the whole stage's activations that rank ``stage`` holds at its peak.

    1F1B: min(pp − stage, m) (Narayanan et al. 2021, §2.2); GPipe: all m. Interleaved 1F1B
    with v chunks: the w + 1 chunk micro-batches of Megatron-LM's warm-up, w = 2(pp − stage −
    1) + (v − 1)·pp, each 1/v of the stage: min(w + 1, m·v) / v (≈ pp·(1 + 1/v) on rank 0).
    Zero-bubble schedules: the peak of their order (`simulator.step.zb_orders.peak_in_flight`,
    activations held until W), over v: pp for ZB-H1 and ZB-V as for 1F1B (Qi et al. 2024
    Table 2 and §6), (2·pp + 1)/2 for DualPipe-V (PP + 1 chunks, DeepSeek-V3 report Table 2).
    """
    m, v = plan.num_microbatches, plan.virtual_stages
    if plan.schedule in ZERO_BUBBLE_SCHEDULES:
        return rank_peak_in_flight(plan.schedule, plan.pp, m, stage, v) / v
    if plan.schedule == "gpipe":
        return m
    if v == 1:
        return min(plan.pp - stage, m)
    return min(2 * (plan.pp - stage - 1) + (v - 1) * plan.pp + 1, m * v) / v


def _edge_activation_bytes(model: ModelSpec, plan: Plan, stage: int,
                           chunks: list[int] | tuple[int, ...] | None = None) -> float:
    # Embedding output on the first stage (2sbh, Korthikanti §4.3); final norm input plus fp32
    # logits (4·s·b·V / tp) on the last. ``chunks``: the stage's `rank_chunks`, if known.
    chunks = rank_chunks(plan, stage) if chunks is None else chunks
    return _edge_sum(_edge_terms(model, plan), 0 in chunks,
                     plan.pp * plan.virtual_stages - 1 in chunks)


def _edge_terms(model: ModelSpec, plan: Plan) -> tuple[float, float]:
    # (first chunk's, last chunk's) extra activation bytes of `_edge_activation_bytes`.
    s, b, h = model.seq_len // plan.cp, plan.micro_batch, model.hidden
    scale = DTYPE_BYTES[plan.dtype] / 2
    return 2 * s * b * h * scale, 2 * s * b * h * scale + 4 * s * b * model.vocab_size / plan.tp


def _edge_sum(terms: tuple[float, float], first: bool, last: bool) -> float:
    extra = 0.0
    if first:
        extra += terms[0]
    if last:
        extra += terms[1]
    return extra


def main_grad_bytes_per_param(dtype: str) -> tuple[int, int]:
    """(gradient-buffer, optimizer-state) bytes per parameter of a framework that keeps fp32
    main gradients (Megatron-LM / Megatron-Core DDP, DeepSpeed's fp16 / bf16 optimizers).

    bf16: the gradients accumulate in an fp32 buffer (4) and the optimizer holds the fp32
    master weights and both moments (12): 2 + 4 + 12 = 18 bytes with the 16-bit weights.
    fp16: 16-bit gradients (2) and an fp32 copy of them in the optimizer with the master
    weights and moments (16): 2 + 2 + 16 = 20. fp32: 4 + 4 + 8 = 16. With the distributed
    optimizer (ZeRO-1) the optimizer part is divided by dp: 6 + 12/dp (bf16), 4 + 16/dp
    (fp16), 8 + 8/dp (fp32) (Megatron-LM ``docs/source/api-guide/dist_optimizer.md``, the
    bytes-per-parameter table; DeepSpeed ZeRO-0 fp16: 20).

    >>> [2 + sum(main_grad_bytes_per_param(d)) for d in ("bf16", "fp16")]
    [18, 20]
    """
    d = DTYPE_BYTES[dtype]
    if d == 4:
        return 4, 8
    return (4, 12) if storage_dtype(dtype) == "bf16" else (d, 16)


def _linear_params(model: ModelSpec) -> float:
    # The matrices of one block (the mean over blocks for an MoE model), which a
    # low-precision recipe casts and caches.
    if model.is_moe:
        return model.moe_mean_layer_params(active=False, matmul_only=True)
    return model.layer_matmul_params()


def zero3_buffer_bytes(model: ModelSpec, plan: Plan) -> float:
    """Bytes of unsharded weights ZeRO-3 / FSDP holds on one rank while a block computes:
    the block's all-gathered parameters and the next block's, prefetched (PyTorch FSDP2
    ``reshard_after_forward`` with one-block prefetch; DeepSpeed ZeRO-3's prefetch bucket),
    two blocks' worth in the plan dtype. A dense block: its parameters / tp (nothing is
    gathered when dp·cp = 1: the weights are whole already). An MoE block: its non-expert
    parameters / tp and its E/ep local experts (`simulator.step.moe.expert_params_per_block`);
    without expert parallelism a rank gathers every expert of a block: for DeepSeek-V3
    256 x 44.0M routed parameters plus ~0.23B others, 23.0 GB per block in bf16.

    >>> from planner.presets import load_model
    >>> m = load_model("deepseek-v3")
    >>> p = Plan(tp=1, pp=1, dp=1024, micro_batch=1, global_batch=1024, zero_stage=3)
    >>> round(zero3_buffer_bytes(m, p) / 1e9, 1)   # two blocks, ep = 1
    46.0
    >>> round(zero3_buffer_bytes(m, p.replace(ep=64)) / 1e9, 1)   # 4 local experts each
    1.6
    >>> l70 = load_model("llama3-70b")   # 2 blocks x 855.6M parameters / tp 4 x 2 bytes
    >>> round(zero3_buffer_bytes(l70, Plan(tp=4, pp=1, dp=128, micro_batch=1,
    ...                                    global_batch=512, zero_stage=3)) / 1e9, 3)
    0.856
    """
    if plan.zero_stage < 3:
        return 0.0
    if not model.is_moe:
        if plan.dp_cp == 1:
            return 0.0
        return 2 * model.layer_params() / plan.tp * DTYPE_BYTES[plan.dtype]
    from simulator.step.moe import expert_params_per_block
    moe_block = next(i for i in range(model.num_layers) if model.is_moe_layer(i))
    routed = model.num_experts * model.expert_params()
    dense = (model.block_params(moe_block, active=False) - routed) / plan.tp
    return 2 * (dense + expert_params_per_block(model, plan)) * DTYPE_BYTES[plan.dtype]


def memory_per_stage(model: ModelSpec, plan: Plan, overhead_bytes: float = 0.0,
                     attention: str = "unfused", *,
                     fp32_main_grads: bool = False,
                     block_scaled: bool = False,
                     recompute_modules: tuple[str, ...] | None = None,
                     main_grad_bytes: int | None = None) -> list[MemoryBreakdown]:
    """Peak memory of one rank of each pipeline stage.

    Weights and gradients in the plan dtype; Adam states per `optimizer_bytes_per_param`; ZeRO
    stage 1 shards optimizer states over dp (dp·cp with context parallelism, as Megatron's
    distributed optimizer does), 2 also gradients, 3 also weights. Activations are
    `layer_activation_bytes` × the stage's layers × `microbatches_in_flight`, plus the
    embedding / logits on the first / last stage. An MoE model (`simulator.step.moe`) holds
    E/ep experts per rank, sharded by ZeRO over edp, and the dispatched tokens' activations.
    Under ZeRO-3 every model also holds two gathered blocks' weights (`zero3_buffer_bytes`).

    Args:
        overhead_bytes: fixed per-rank extra (framework context, buffers); 0 by default.
        attention: "unfused" (Korthikanti et al.'s score matrices) or a fused kernel
            ("flash", "flash-triton"; `layer_activation_bytes`).
        fp32_main_grads: gradients and optimizer states as a framework with fp32 main
            gradients keeps them (`main_grad_bytes_per_param`: Megatron 18 bytes per
            parameter in bf16, 6 + 12/dp with the distributed optimizer; DeepSpeed ZeRO-0
            fp16 20); False: the ZeRO paper's 2 + 2 + 12.
        main_grad_bytes: with ``fp32_main_grads``, the bytes of one main-gradient element
            when the buffer is not fp32: Megatron-Core's DDP keeps its gradient buffer in
            the reduction dtype, bf16 (2) under ``grad_reduce_in_fp32=False``
            (``DistributedDataParallelConfig``), as the Megatron-Bridge and NeMo 2.0
            performance recipes set it; None: `main_grad_bytes_per_param`'s.
        block_scaled: the device has block-scaled tensor cores (one FP8 weight copy instead
            of the weight and its transpose, `planner.precision.cast_copies`). A
            low-precision plan holds its linear weights as their casts instead of bf16
            (primary low-precision weights: Megatron-Core ``--fp8-param-gather``, NeMo's FP8
            recipes; the fp32 master weights stay in the optimizer states; NVFP4 holds the
            casts beside the bf16 weights, `planner.precision.Recipe.primary_weights`) and
            stores the linear inputs as their casts (`lowp_activation_saving`).
        recompute_modules: an MoE model's selective recomputation modules; the
            output-discarding ones keep fewer activations
            (`simulator.step.moe.selective_saving_bytes`).
    Raises:
        PlanError: the layers do not split over the stages (from `Plan.layers_per_stage`).
    """
    return [MemoryBreakdown(weights_bytes=w, gradients_bytes=g, optimizer_bytes=o,
                            activations_bytes=a, overhead_bytes=overhead_bytes)
            for _, (w, g, o, a) in _stage_parts(model, plan, attention, fp32_main_grads,
                                                block_scaled,
                                                recompute_modules=recompute_modules,
                                                main_grad_bytes=main_grad_bytes)]


#: Schedules whose micro-batches in flight never grow from one stage to the next.
MONOTONE_IN_FLIGHT = ("1f1b", "gpipe", "interleaved-1f1b")


def worst_stage_memory(model: ModelSpec, plan: Plan, overhead_bytes: float = 0.0,
                       attention: str = "unfused", *, fp32_main_grads: bool = False,
                       block_scaled: bool = False,
                       main_grad_bytes: int | None = None) -> tuple[int, MemoryBreakdown]:
    """``(stage, breakdown)`` of the stage of `memory_per_stage` that needs the most (the
    first of equals), without building the others' breakdowns.

    >>> from planner.presets import load_model
    >>> m, p = load_model("tiny-gpt"), Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=8)
    >>> stages = memory_per_stage(m, p)
    >>> worst_stage_memory(m, p) == max(enumerate(stages), key=lambda s: s[1].total_bytes)
    True
    """
    # With equal chunks of a dense model the inner stages hold equal weights and layers and,
    # in these schedules, no more micro-batches in flight than the stage before them
    # (`microbatches_in_flight`): only stages 0, 1 and pp − 1 can be the first worst.
    stages = None
    if plan.stage_layers is None and plan.schedule in MONOTONE_IN_FLIGHT and not model.is_moe:
        stages = sorted({0, min(1, plan.pp - 1), plan.pp - 1})
    worst, parts, top = 0, None, -1.0
    for stage, (w, g, o, a) in _stage_parts(model, plan, attention, fp32_main_grads,
                                            block_scaled, stages,
                                            main_grad_bytes=main_grad_bytes):
        total = w + g + o + a + overhead_bytes  # as `MemoryBreakdown.total_bytes` sums
        if total > top:
            worst, parts, top = stage, (w, g, o, a), total
    w, g, o, a = parts
    return worst, MemoryBreakdown(weights_bytes=w, gradients_bytes=g, optimizer_bytes=o,
                                  activations_bytes=a, overhead_bytes=overhead_bytes)


#: `stage_layout` entries while the cost memo is on (`identity_memo`).
_LAYOUTS: dict[tuple, tuple] = {}


def stage_layout(model: ModelSpec, plan: Plan) -> tuple[tuple, ...]:
    """Per pipeline stage: ``(non-expert params, expert params, chunks held, blocks held,
    MoE blocks held)`` (`stage_param_splits`, `planner.mesh.chunk_rank`,
    `simulator.step.moe.stage_expert_blocks`), which depend on the plan through its chunk
    layout (pp, virtual stages, schedule, stage layers) and tp, ep, etp alone; with the cost
    memo on, plans that agree on those share one entry."""
    if not memo_enabled():
        return _fresh_stage_layout(model, plan)
    key = (id(model), plan.pp, plan.virtual_stages, plan.schedule, plan.stage_layers, plan.tp,
           plan.ep, plan.etp)
    return identity_memo(_LAYOUTS, key, (model,), lambda: _fresh_stage_layout(model, plan))


def _fresh_stage_layout(model: ModelSpec, plan: Plan) -> tuple[tuple, ...]:
    chunks = plan.layers_per_stage(model)
    held_chunks: list[list[int]] = [[] for _ in range(plan.pp)]
    for c in range(len(chunks)):
        held_chunks[chunk_rank(plan.schedule, plan.pp, c)].append(c)
    splits = stage_param_splits(model, plan)  # one pass over the chunks, MoE or not
    if model.is_moe:
        from simulator.step.moe import stage_expert_blocks
    return tuple((*splits[stage], tuple(held_chunks[stage]),
                  sum(chunks[c] for c in held_chunks[stage]),
                  stage_expert_blocks(model, plan, stage) if model.is_moe else 0)
                 for stage in range(plan.pp))


def _in_flight(plan: Plan) -> Callable[[int], float]:
    # `microbatches_in_flight` of a stage; with the cost memo on, from one tuple per
    # (schedule, pp, micro-batches, virtual stages), what it depends on.
    if not memo_enabled():
        return lambda stage: microbatches_in_flight(plan, stage)
    key = ("in-flight", plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
    return identity_memo(_LAYOUTS, key, (), lambda: tuple(
        microbatches_in_flight(plan, stage) for stage in range(plan.pp))).__getitem__


def _stage_parts(model: ModelSpec, plan: Plan, attention: str, fp32_main_grads: bool,
                 block_scaled: bool, stages: list[int] | None = None,
                 recompute_modules: tuple[str, ...] | None = None,
                 main_grad_bytes: int | None = None):
    # (stage, (weights, gradients, optimizer, activations) bytes) of each stage (or of
    # ``stages``), as `memory_per_stage` documents them.
    d = DTYPE_BYTES[plan.dtype]
    per_layer = layer_activation_bytes(model, plan, attention) \
        - lowp_activation_saving(model, plan)
    # The block method (``recompute_num_layers``) recomputes the first N blocks of a chunk;
    # the others keep every activation, as without recomputation.
    kept_plan = plan.replace(recompute="none", recompute_num_layers=0) \
        if plan.recompute_num_layers else None
    per_kept = 0.0 if kept_plan is None else layer_activation_bytes(model, kept_plan, attention) \
        - lowp_activation_saving(model, kept_plan)
    chunks = plan.layers_per_stage(model) if kept_plan is not None else ()
    layout = stage_layout(model, plan)
    moe = model.is_moe
    z, shard, eshard = plan.zero_stage, plan.dp_cp, plan.edp
    g, o = main_grad_bytes_per_param(plan.dtype) if fp32_main_grads else \
        (d, optimizer_bytes_per_param(plan.dtype))
    if fp32_main_grads and main_grad_bytes:
        g = main_grad_bytes
    linear = _linear_params(model) / plan.tp
    cache_per_param = weight_cache_bytes_per_param(plan.dtype, block_scaled)
    gathered = zero3_buffer_bytes(model, plan)          # the same on every stage
    # Low-precision primary weights: the linear weights are held as their casts (FP8 and
    # its transpose on Hopper), not in bf16 (`planner.precision`); 0 for bf16.
    # NVFP4 keeps its bf16 weights and caches the casts beside them.
    r = recipe(plan.dtype)
    wc = 0.0 if r is None else cache_per_param - (d if r.primary_weights else 0.0)
    if moe:   # per-block terms, the same on every stage
        from simulator.step.moe import (
            activation_delta_bytes,
            expert_params_per_block,
            selective_saving_bytes,
        )
        delta = activation_delta_bytes(model, plan)
        delta_kept = 0.0 if kept_plan is None else activation_delta_bytes(model, kept_plan)
        save_dense = selective_saving_bytes(model, plan, recompute_modules, False)
        save_moe = selective_saving_bytes(model, plan, recompute_modules, True)
        # the rank's own matrices: non-expert ones / tp, its E/ep local experts
        routed = model.num_experts * model.expert_params() * model.num_moe_layers \
            / model.num_layers
        mine_per_block = (_linear_params(model) - routed) / plan.tp
        local_per_block = expert_params_per_block(model, plan)
    in_flight = _in_flight(plan)
    edges, last_chunk = _edge_terms(model, plan), plan.pp * plan.virtual_stages - 1
    # held bytes of both parameter groups, each sharded over its own group under ZeRO from
    # stage 3 (weights), 2 (gradients), 1 (optimizer states)
    s3, s2, s1 = (shard if z >= k else 1 for k in (3, 2, 1))
    e3, e2, e1 = (eshard if z >= k else 1 for k in (3, 2, 1))
    for stage in range(plan.pp) if stages is None else stages:
        p, e, held_chunks, layers, n_moe = layout[stage]
        redo = layers if kept_plan is None else sum(
            plan.full_recompute_share(chunks[c]) * chunks[c] for c in held_chunks)
        acts = per_layer * redo + per_kept * (layers - redo) \
            + _edge_sum(edges, 0 in held_chunks, last_chunk in held_chunks)
        if moe:
            acts += n_moe * delta - (layers - n_moe) * save_dense - n_moe * save_moe
            if kept_plan is not None and layers:
                # the expert blocks among the kept ones (in the stage's proportion)
                acts += n_moe * (layers - redo) / layers * delta_kept
            mine = mine_per_block * layers
            local = n_moe * local_per_block
            cached = wc * (mine / s3 + local / e3)
        else:
            cached = linear * layers * wc / s3
        yield stage, (p * d / s3 + e * d / e3 + gathered + cached, p * g / s2 + e * g / e2,
                      p * o / s1 + e * o / e1, acts * in_flight(stage))

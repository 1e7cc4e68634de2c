"""Mixture-of-experts costs of one training step: expert compute, token dispatch, memory.

An MoE block (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; DeepSeekMoE, Dai et al.
2024) replaces the dense MLP with a router and E experts of width f_e, each token visiting k
of them, plus shared experts every token visits. Under Megatron-Core's MoE parallel folding
(`planner.spec.Plan`: attention on tp·cp·dp ranks, experts on etp·ep·edp of the same ranks)
one rank of a micro-batch of T = b·s/cp tokens does, per MoE block (forward):

=====================  =================================================================
op                     what it costs on one rank (t = T/tp tokens enter, sequence parallel)
=====================  =================================================================
router                 GEMM (t, E, h), then score + top-k over t·E fp32 (memory-bound)
permute                gather t·k token copies by expert: read t·h, write t·k·h; local sort
                       of the received copies: read + write them (memory-bound)
dispatch all-to-all    t·k·h elements per rank over the ep group; (ep − 1)/ep of them leave
                       the rank (Megatron-Core ``MoEAlltoAllTokenDispatcher``); etp > 1 adds
                       an all-gather of them over the etp group
grouped GEMMs          E/ep local experts, m = etp·t·k·ρ/(E/ep) tokens each: up (m, 2f_e/etp,
                       h) for SwiGLU, down (m, h, f_e/etp), one batched kernel each (the
                       grouped GEMM of Megatron-Core ``TEGroupedMLP``), costed by the same
                       shape-dependent GEMM efficiency as dense GEMMs (`gemm_time_s`):
                       small m pays for wave and tile quantisation and saturation
shared experts         a dense tp-split MLP of width n_s·f_e on the T tokens
combine all-to-all     the reverse of dispatch (same bytes), then unpermute (memory-bound)
=====================  =================================================================

ρ is the routing imbalance: the busiest EP rank's tokens over the mean (`SimOptions`
``moe_imbalance``; 1.0 is the balanced load the published benchmarks force, Megatron-Core
``--moe-router-force-load-balancing`` and NeMo Automodel's fake balanced gate; a real router
shows its measured max/mean, e.g. 1 + MaxVio of Wang et al. 2024, "Auxiliary-Loss-Free Load
Balancing Strategy for Mixture-of-Experts", arXiv:2408.15664, §4). The slowest rank sets the
pace of the all-to-all and of the expert GEMMs, so both scale by ρ.

Backward repeats both all-to-alls (gradients of the combine, then of the dispatch) and runs
the GEMMs twice (dgrad, wgrad). With DeepEP (``moe_dispatcher='deepep'``; DeepSeek-AI 2025,
github.com/deepseek-ai/DeepEP, "normal kernels"): a token crosses to each remote node once,
by RDMA to the GPU of the same local index, then fans out over NVLink, so inter-node bytes
shrink from k copies to the nodes the token touches (at most ``router_group_topk`` when
routing is node-limited, DeepSeek-V3 report §2.1.2); the NICs remain the bottleneck
(`dispatch_time_s`). Multi-head latent attention (DeepSeek-V2 §2.1) replaces the QKV and
output projections with its low-rank GEMMs (`mla_ops`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from operator import attrgetter

from planner.mesh import expert_group_ranks
from planner.precision import block_scaled_device, recipe
from planner.spec import DTYPE_BYTES, ModelSpec, Plan
from simulator.network.cluster import Cluster
from simulator.network.collectives import collective_time_s, identity_memo, memo_enabled
from simulator.network.hardware import DeviceProfile
from simulator.step.compute import (
    ATTENTION_CORE,
    Attention,
    CpAttention,
    Efficiency,
    LayerCompute,
    Op,
    cast_ops,
    layer_forward_ops,
    op_time_s,
    ops_compute,
)

_DENSE_MLP = ("mlp-up", "swiglu", "gelu", "mlp-down")
_STANDARD_ATTENTION = ("qkv", "out-proj", "attn-core", "attn-qk", "attn-softmax",
                       "attn-softmax-cast", "attn-softmax-scale", "attn-softmax-mask",
                       "attn-softmax-uncast", "attn-dropout", "attn-av")


@lru_cache(maxsize=256)
def _block_table(model: ModelSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Prefix sums over the blocks of (MoE blocks, all parameters of the block), so a chunk's
    # counts take two lookups (the planner asks for them once per candidate and stage).
    moe, params = [0], [0]
    for i in range(model.num_layers):
        moe.append(moe[-1] + model.is_moe_layer(i))
        params.append(params[-1] + model.block_params(i, active=False))
    return tuple(moe), tuple(params)


def _chunk_range(model: ModelSpec, plan: Plan, chunk: int) -> tuple[int, int]:
    starts = _chunk_starts(plan.layers_per_stage(model))
    return starts[chunk], starts[chunk + 1]


@lru_cache(maxsize=1024)
def _chunk_starts(sizes: tuple[int, ...]) -> tuple[int, ...]:
    # First block of each chunk, and the block count at the end (prefix sums of ``sizes``).
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return tuple(out)


def chunk_moe_blocks(model: ModelSpec, plan: Plan, chunk: int) -> int:
    """MoE blocks of pipeline chunk ``chunk`` (pipeline order, `Plan.layers_per_stage`)."""
    a, b = _chunk_range(model, plan, chunk)
    moe = _block_table(model)[0]
    return moe[b] - moe[a]


def tokens_per_rank(model: ModelSpec, plan: Plan) -> float:
    """Tokens of one micro-batch that enter an MoE block on one rank: b·s/(cp·tp) (the
    sequence-parallel shard; Megatron-Core requires sequence parallelism with tp > 1 and MoE).

    >>> from planner.presets import load_model
    >>> tokens_per_rank(load_model("deepseek-v3"), Plan(tp=2, pp=1, dp=4, ep=8,
    ...     micro_batch=1, global_batch=4))
    2048.0
    """
    return plan.micro_batch * model.seq_len / (plan.cp * plan.tp)


def dispatch_bytes_per_rank(model: ModelSpec, plan: Plan) -> float:
    """Bytes one rank sends to other EP ranks in one dispatch (or combine) all-to-all, balanced
    routing: ``t·k·h·bytes·(ep − 1)/ep`` (t = `tokens_per_rank`; each of the t·k token copies
    goes to one of ep ranks, 1/ep of them to itself).

    >>> from planner.presets import load_model
    >>> m = load_model("mixtral-8x7b")   # k = 2, h = 4096, s = 4096
    >>> dispatch_bytes_per_rank(m, Plan(tp=1, pp=1, dp=8, ep=8, micro_batch=1,
    ...     global_batch=8)) == 4096 * 2 * 4096 * 2 * 7 / 8
    True
    """
    t = tokens_per_rank(model, plan)
    return t * model.experts_per_token * model.hidden * DTYPE_BYTES[plan.dtype] \
        * (plan.ep - 1) / plan.ep


def mla_ops(model: ModelSpec, t: int, tp: int, dtype: str) -> list[Op]:
    """Forward attention ops of multi-head latent attention on one TP rank (DeepSeek-V2 §2.1):
    query down (t, r_q, h) and up (t, a·(d + d_r)/tp, r_q) projections (one (t, a·(d+d_r)/tp,
    h) GEMM without query compression), key-value down (t, r_kv + d_r, h) and up (t,
    a·(d + d_v)/tp, r_kv), their RMSNorms, causal flash attention over q/k width d + d_r
    and value width d_v (t·s·a·(d + d_r + d_v)/tp FLOPs), output (t, h, a·d_v/tp).
    The down projections are replicated over tp (Megatron-Core ``MLASelfAttention``)."""
    h, a, d, s = model.hidden, model.num_heads, model.head_dim, model.seq_len
    qk, vd, b = d + model.qk_rope_head_dim, model.v_head_dim or d, DTYPE_BYTES[dtype]
    if model.q_lora_rank:
        ops = [Op("mla-q-down", m=t, n=model.q_lora_rank, k=h),
               Op("mla-q-norm", bytes=2 * t * model.q_lora_rank * b),
               Op("mla-q-up", m=t, n=a * qk // tp, k=model.q_lora_rank)]
    else:
        ops = [Op("mla-q", m=t, n=a * qk // tp, k=h)]
    rkv = model.kv_lora_rank
    return ops + [Op("mla-kv-down", m=t, n=rkv + model.qk_rope_head_dim, k=h),
                  Op("mla-kv-norm", bytes=2 * t * rkv * b),
                  Op("mla-kv-up", m=t, n=a * (d + vd) // tp, k=rkv),
                  Op("attn-core", flops=t * s * a * (qk + vd) / tp),
                  Op("out-proj", m=t, n=h, k=a * vd // tp)]


def expert_ops(model: ModelSpec, plan: Plan, imbalance: float) -> list[Op]:
    """Forward ops of one MoE MLP on one rank (router, permute, grouped GEMMs, shared
    experts, unpermute; see the module table). Shapes in elements, bytes in bytes."""
    h, k, e, fe = model.hidden, model.experts_per_token, model.num_experts, model.expert_hidden
    d, tr = DTYPE_BYTES[plan.dtype], tokens_per_rank(model, plan)
    t_full = int(tr * plan.tp)
    local = e // plan.ep
    recv = plan.etp * tr * k * imbalance          # token copies this rank's experts compute
    m = max(1, round(recv / local))
    f_loc = fe // plan.etp
    swiglu = model.activation == "swiglu"
    ops = [Op("router", m=int(tr), n=e, k=h),
           Op("router-topk", bytes=3 * tr * e * 4),
           Op("permute", bytes=(1 + k) * tr * h * d + 2 * recv * h * d),
           Op("expert-up", m=m, n=(2 if swiglu else 1) * f_loc, k=h, count=local),
           Op("expert-act", bytes=(3 if swiglu else 2) * recv * f_loc * d),
           Op("expert-down", m=m, n=h, k=f_loc, count=local),
           Op("unpermute", bytes=(1 + k) * tr * h * d + 2 * recv * h * d)]
    if model.num_shared_experts:
        fs = model.num_shared_experts * fe // plan.tp
        ops += [Op("shared-up", m=t_full, n=(2 if swiglu else 1) * fs, k=h),
                Op("shared-act", bytes=(3 if swiglu else 2) * t_full * fs * d),
                Op("shared-down", m=t_full, n=h, k=fs)]
    return ops


_EXPERT_GEMMS = ("expert-up", "expert-down")
#: Bytes moved per weight element by the accumulation of one micro-batch's weight gradient:
#: Megatron-Core's fused accumulation (``gradient_accumulation_fusion``; Transformer Engine
#: ``GroupedLinear(fuse_wgrad_accumulation=True)`` for the experts) runs the wgrad GEMM with
#: beta = 1 into the fp32 ``main_grad``, reading and writing it (4 + 4 B); PyTorch autograd
#: writes the bf16 gradient and adds it into ``.grad`` (2 + 2 + 2 + 2 B). 8 B either way.
WGRAD_ACCUMULATION_BYTES = 8


def wgrad_accumulation_excess_s(op: Op, wgrad_s: float, device: DeviceProfile,
                                eff: Efficiency) -> float:
    """Seconds the weight-gradient GEMM of ``op`` (``count`` experts' (n, k) weights, its
    compute ``wgrad_s``) takes beyond its compute because the gradient accumulation is
    memory-bound: a GEMM takes at least the time its bytes take (roofline, Williams et al.
    2009, "Roofline: an insightful visual performance model", CACM 52(4)), here
    `WGRAD_ACCUMULATION_BYTES` per weight element at the memory-bound ops' bandwidth
    (``memory_fraction`` of the device's). A dense GEMM over T tokens does 2·T flops per
    weight element and stays compute-bound; a routed expert sees only its m = t·k/(E/ep)
    token copies (on a B200 at MXFP8, 4.5 PF x 0.56 against 8 TB/s x 0.62: below
    m ≈ 2,000), so with many local experts the accumulation sets the pace.

    >>> from simulator.network.hardware import load_device
    >>> from simulator.step.compute import load_efficiency
    >>> dev, eff = load_device("h100-sxm-80gb"), load_efficiency("h100-sxm-80gb")
    >>> up = Op("expert-up", m=1024, n=4096, k=7168, count=32)
    >>> # 32 x 4096 x 7168 x 8 B = 7.516 GB at 3.35 TB/s x 0.6222 = 2.0843 TB/s: 3.606 ms;
    >>> # less a 1.0 ms GEMM = 2.606 ms
    >>> round(wgrad_accumulation_excess_s(up, 1e-3, dev, eff) * 1e3, 3)
    2.606
    """
    moved = WGRAD_ACCUMULATION_BYTES * op.count * op.n * op.k
    return max(0.0, moved / (device.memory_bandwidth_Bps * eff.memory_fraction) - wgrad_s)


#: Forward ops (with their casts) each Megatron-Core ``recompute_modules`` entry repeats in
#: the backward under selective recomputation (``TransformerConfig.recompute_modules``:
#: "core_attn" the core attention, "mla_up_proj" the MLA up projections and RoPE, "moe_act"
#: the experts' activation, "layernorm" the input and pre-MLP norms, "mlp" the dense MLP
#: (a dense block's only), "moe" the whole MoE layer (its all-to-alls too, `chunk_moe_terms`),
#: "shared_experts" the shared experts). Default ["core_attn"].
RECOMPUTE_MODULES: dict[str, tuple[str, ...]] = {
    "core_attn": ATTENTION_CORE,
    "mla_up_proj": ("mla-q-up", "mla-kv-up", "mla-q-up-cast", "mla-kv-up-cast"),
    "moe_act": ("expert-act",),
    "layernorm": ("norm1", "norm2"),
    "mlp": _DENSE_MLP + ("mlp-up-cast", "mlp-down-cast"),
    "moe": ("router", "router-topk", "permute", "expert-up", "expert-act", "expert-down",
            "unpermute", "shared-up", "shared-act", "shared-down", "expert-up-cast",
            "expert-down-cast", "shared-up-cast", "shared-down-cast"),
    "shared_experts": ("shared-up", "shared-act", "shared-down", "shared-up-cast",
                       "shared-down-cast"),
}


def recomputed_ops(recompute_modules: tuple[str, ...] | None) -> frozenset[str]:
    """Names of the forward ops selective recomputation repeats for ``recompute_modules``
    (`RECOMPUTE_MODULES`; None: Megatron-Core's default, the attention core).

    >>> sorted(recomputed_ops(("mla_up_proj",)))
    ['mla-kv-up', 'mla-kv-up-cast', 'mla-q-up', 'mla-q-up-cast']
    """
    return frozenset(n for m in (recompute_modules or ("core_attn",))
                     for n in RECOMPUTE_MODULES[m])


def block_ops(model: ModelSpec, plan: Plan, attention: Attention, device: DeviceProfile,
              moe_layer: bool, imbalance: float = 1.0,
              cp_attention: CpAttention = "ring") -> list[Op]:
    """Forward ops of one block of an MoE and/or MLA model on one rank: the dense block's
    ops (`layer_forward_ops`) with the MLP swapped for `expert_ops` when ``moe_layer`` and the
    attention for `mla_ops` when the model uses MLA, plus a low-precision recipe's quantize
    ops for every linear GEMM of the block, the experts' and MLA's included
    (`planner.precision.LOWP_GEMMS`)."""
    ops = layer_forward_ops(model, plan.micro_batch, plan.tp, plan.sequence_parallel,
                            attention, plan.dtype, plan.cp, cp_attention)
    t = plan.micro_batch * model.seq_len // plan.cp
    if model.is_mla:
        at = next(i for i, op in enumerate(ops) if op.name == "qkv")
        ops = ops[:at] + mla_ops(model, t, plan.tp, plan.dtype) + \
            [op for op in ops[at:] if op.name not in _STANDARD_ATTENTION]
    if moe_layer:
        at = next(i for i, op in enumerate(ops) if op.name == "mlp-up")
        ops = ops[:at] + expert_ops(model, plan, imbalance) + \
            [op for op in ops[at:] if op.name not in _DENSE_MLP]
    return ops + cast_ops(ops, plan.dtype, block_scaled_device(device.peak_flops))


#: The `Plan` fields `block_ops` reads: a block's costs depend on the plan through these alone
#: (with the model, kernel, device, efficiency and routing), not on dp, pp, the schedule,
#: recomputation, ZeRO or the placement.
_BLOCK_FIELDS = ("micro_batch", "tp", "sequence_parallel", "dtype", "cp", "ep", "etp")


#: The values of `_BLOCK_FIELDS` of a plan, in that order (the memo keys below).
_block_key = attrgetter(*_BLOCK_FIELDS)


#: Memo of `block_compute` and `chunk_compute` while the cost memo is on
#: (`simulator.network.collectives.cost_memo`; `identity_memo`): keyed by the ids of the
#: model, device and efficiency, the fields of `_BLOCK_FIELDS` and every other argument.
_MEMO: dict[tuple, tuple] = {}


def block_compute(model: ModelSpec, plan: Plan, attention: Attention, device: DeviceProfile,
                  eff: Efficiency, moe_layer: bool, imbalance: float = 1.0,
                  cp_attention: CpAttention = "ring",
                  recompute_modules: tuple[str, ...] | None = None) -> LayerCompute:
    """`LayerCompute` of `block_ops` (cached), its backward with the routed experts'
    `wgrad_accumulation_excess_s`. Its ``attn_core_fwd_s``, the forward time selective
    recomputation repeats, is that of the ops `recomputed_ops` (``recompute_modules``)
    names. With the cost memo on, plans that agree on `_BLOCK_FIELDS` share one entry."""
    args = (attention, moe_layer, imbalance, cp_attention, recompute_modules)
    if not memo_enabled():
        return _block_compute(model, plan, device, eff, *args)
    return identity_memo(_MEMO, ("block", id(model), id(device), id(eff), *_block_key(plan),
                                 *args), (model, device, eff),
                         lambda: _block_compute(model, plan, device, eff, *args))


@lru_cache(maxsize=4096)
def _block_compute(model: ModelSpec, plan: Plan, device: DeviceProfile, eff: Efficiency,
                   attention: Attention, moe_layer: bool, imbalance: float,
                   cp_attention: CpAttention,
                   recompute_modules: tuple[str, ...] | None) -> LayerCompute:
    ops = block_ops(model, plan, attention, device, moe_layer, imbalance, cp_attention)
    lc = ops_compute(tuple(ops), device, eff, plan.dtype)
    lc = replace(lc, bwd_s=lc.bwd_s + sum(
        wgrad_accumulation_excess_s(op, op_time_s(op, device, eff, plan.dtype), device, eff)
        for op in ops if op.name in _EXPERT_GEMMS))
    if recompute_modules is None:
        return lc
    again = recomputed_ops(recompute_modules)
    return replace(lc, attn_core_fwd_s=sum(op_time_s(op, device, eff, plan.dtype)
                                           for op in ops if op.name in again))


def chunk_compute(model: ModelSpec, plan: Plan, chunk: int, attention: Attention,
                  device: DeviceProfile, eff: Efficiency, imbalance: float = 1.0,
                  cp_attention: CpAttention = "ring",
                  recompute_modules: tuple[str, ...] | None = None
                  ) -> tuple[LayerCompute, int]:
    """(mean `LayerCompute` per block, MoE blocks) of pipeline chunk ``chunk`` (pipeline
    order, as `Plan.layers_per_stage`), its dense and MoE blocks each costed by
    `block_compute`; with the cost memo on, chunks of equal block and MoE-block counts of
    plans that agree on `_BLOCK_FIELDS` share one entry."""
    n_moe = chunk_moe_blocks(model, plan, chunk)
    n = plan.layers_per_stage(model)[chunk]
    args = (attention, imbalance, cp_attention, recompute_modules)
    if not memo_enabled():
        return _chunk_mean(model, plan, device, eff, n, n_moe, *args), n_moe
    return identity_memo(_MEMO, ("chunk", id(model), id(device), id(eff), *_block_key(plan),
                                 n, n_moe, *args), (model, device, eff),
                         lambda: _chunk_mean(model, plan, device, eff, n, n_moe, *args)), n_moe


def _chunk_mean(model: ModelSpec, plan: Plan, device: DeviceProfile, eff: Efficiency, n: int,
                n_moe: int, attention: Attention, imbalance: float, cp_attention: CpAttention,
                recompute_modules: tuple[str, ...] | None) -> LayerCompute:
    # The mean `LayerCompute` of ``n`` blocks, ``n_moe`` of them MoE blocks.
    parts = [(n - n_moe, block_compute(model, plan, attention, device, eff, False,
                                       cp_attention=cp_attention,
                                       recompute_modules=recompute_modules)),
             (n_moe, block_compute(model, plan, attention, device, eff, True, imbalance,
                                   cp_attention, recompute_modules))]
    parts = [(w, lc) for w, lc in parts if w]
    return LayerCompute(*(sum(w * getattr(lc, f) for w, lc in parts) / n
                          for f in ("fwd_s", "bwd_s", "attn_core_fwd_s", "host_fwd_s",
                                    "host_bwd_s")),
                        round(sum(w * lc.kernels_fwd for w, lc in parts) / n))


def node_dedup_factor(model: ModelSpec, nodes: int) -> float:
    """Inter-node bytes of a DeepEP dispatch relative to a plain all-to-all: a token crosses
    to each remote node it touches once (DeepEP normal kernels) instead of once per expert.
    With k experts spread uniformly over ``nodes`` nodes a token touches
    u = nodes·(1 − (1 − 1/nodes)^k) of them, at most ``router_group_topk`` when the router's
    groups are the nodes (node-limited routing, DeepSeek-V3 report §2.1.2); factor u / k.

    >>> from planner.presets import load_model
    >>> node_dedup_factor(load_model("deepseek-v3"), 8)   # top-8 limited to 4 of 8 nodes
    0.5
    """
    k = model.experts_per_token
    if nodes <= 1 or k <= 1:
        return 1.0
    u = nodes * (1 - (1 - 1 / nodes) ** k)
    if model.router_groups == nodes and model.router_group_topk < model.router_groups:
        u = min(u, model.router_group_topk)
    return u / k


#: Share of one GPU's NVLink bandwidth (per direction) that DeepEP's normal dispatch kernel
#: moves inside one NVLink domain: 153 GB/s on H800, whose NVLink runs at ~160 GB/s
#: (DeepEP README, github.com/deepseek-ai/DeepEP, "Normal kernels with NVLink and RDMA
#: forwarding", intranode EP 8 row; combine 158 GB/s). The kernel writes every token copy
#: straight into the peer's receive buffer (Hybrid-EP on NVL72 the same way, by TMA; NVIDIA,
#: DeepEP ``hybrid-ep`` branch, Hybrid-EP_Implementation.md), so neither a per-peer step
#: latency nor a separate staging pass of NCCL's all-to-all applies.
DEEPEP_NVLINK_FRACTION = 153 / 160


def dispatch_time_s(model: ModelSpec, plan: Plan, cluster: Cluster, stage: int,
                    imbalance: float = 1.0, dispatcher: str = "alltoall") -> float:
    """Seconds of one dispatch (or combine) all-to-all of one MoE block, one micro-batch: the
    ep group's all-to-all of t·k·h·bytes per rank (`collective_time_s`, with every EP group
    of the stage running at once and sharing the NICs), times the routing imbalance; with
    etp > 1 plus the all-gather of the received tokens over the etp group. ``dispatcher``
    'deepep' scales the bytes by `node_dedup_factor` when the group spans nodes; inside one
    NVLink domain it is DeepEP's copy kernel: the (ep − 1)/ep of the bytes that leave the
    rank at `DEEPEP_NVLINK_FRACTION` of the NVLink bandwidth, plus one launch.

    >>> from planner.presets import load_model
    >>> from simulator.network.cluster import load_cluster
    >>> m, c = load_model("deepseek-v3"), load_cluster("dgx-h100", nodes=1)
    >>> p = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch=1, global_batch=8)
    >>> # 4,096 tokens x 8 copies x 7,168 x 2 B = 469.8 MB, 7/8 of it leaves the rank:
    >>> # 411.0 MB / (450 GB/s x 153/160 = 430.3 GB/s) = 955.2 us, + 42 us launch = 997.2 us
    >>> round(dispatch_time_s(m, p, c, 0, dispatcher="deepep") * 1e6, 1)
    997.2
    """
    if plan.ep == 1 and plan.etp == 1:
        return 0.0
    if not memo_enabled():
        return _dispatch_time_s(model, plan, cluster, stage, imbalance, dispatcher)
    # The bytes depend on the plan through tokens_per_rank (micro-batch, cp, tp) and the
    # dtype; the ep and etp groups through the mesh (`planner.mesh.expert_group_ranks`:
    # tp, cp, dp, pp, ep, etp, placement) and the stage.
    key = (id(model), plan.micro_batch, plan.tp, plan.cp, plan.dtype, plan.dp, plan.pp,
           plan.ep, plan.etp, plan.placement, stage, imbalance, dispatcher)
    return identity_memo(cluster._links.setdefault("dispatch", {}), key, (model,),
                         lambda: _dispatch_time_s(model, plan, cluster, stage, imbalance,
                                                  dispatcher))


def _dispatch_time_s(model: ModelSpec, plan: Plan, cluster: Cluster, stage: int,
                     imbalance: float, dispatcher: str) -> float:
    t = tokens_per_rank(model, plan)
    size = t * model.experts_per_token * model.hidden * DTYPE_BYTES[plan.dtype] * imbalance
    group = expert_group_ranks(plan, "ep", stage=stage)
    nodes = len({cluster.node_of(r) for r in group}) if cluster.nics_per_node else 1
    if dispatcher == "deepep":
        size *= node_dedup_factor(model, nodes)
    if plan.ep == 1:
        out = 0.0
    elif dispatcher == "deepep" and nodes == 1 and cluster.collective_bandwidth_Bps is None:
        out = cluster.comm.launch_latency_s + size * (plan.ep - 1) / plan.ep \
            / (cluster.intra_bandwidth_Bps * DEEPEP_NVLINK_FRACTION)
    else:
        out = collective_time_s(cluster, "all_to_all", size, group)
    if plan.etp > 1:
        out += collective_time_s(cluster, "all_gather", size * plan.etp,
                                 expert_group_ranks(plan, "etp", stage=stage))
    return out


#: Streaming multiprocessors a token dispatcher's kernels hold while they move tokens: DeepEP's
#: high-throughput ("normal") kernels run on ``Buffer.num_sms`` SMs, 20 by default (DeepEP
#: deep_ep/buffer.py @e02e4d2, 2025-09), which Megatron-Core sets from
#: ``TransformerConfig.moe_deepep_num_sms``, also 20 by default. NCCL's all-to-all
#: ('alltoall') is not counted: its channel count depends on the NCCL version and topology.
DISPATCHER_SMS: dict[str, int] = {"deepep": 20}


def overlapped_exposed_s(comm_s: float, compute_s: float, sm_share: float = 0.0) -> float:
    """Seconds an all-to-all of ``comm_s`` adds to ``compute_s`` of another micro-batch's
    compute it runs beside (Megatron-Core's combined-1F1B EP overlap, DualPipe), when the
    communication kernels hold ``sm_share`` of the GPU's SMs (`DISPATCHER_SMS` over
    ``DeviceProfile.sm_count``). The transfer runs at the links' pace; while it runs the
    compute keeps 1 − ``sm_share`` of the SMs and so of its rate (DeepSeek-V3 report §3.2.1:
    the SMs given to communication are taken from computation). Both done after
    max(comm, compute + comm · share): exposed max(comm − compute, comm · share).

    >>> # 6.6 ms of dispatch + combine beside 5.0 ms of compute: 1.6 ms shows, whatever the SMs
    >>> round(overlapped_exposed_s(6.6e-3, 5.0e-3, 20 / 132) * 1e3, 4)
    1.6
    >>> # 4.0 ms beside 10.0 ms on an H100 with DeepEP's 20 of 132 SMs: 4.0 x 20/132 = 0.6061 ms
    >>> round(overlapped_exposed_s(4.0e-3, 10.0e-3, 20 / 132) * 1e3, 4)
    0.6061
    """
    return max(0.0, comm_s - compute_s, comm_s * sm_share)


def expert_params_per_block(model: ModelSpec, plan: Plan) -> float:
    """Routed-expert parameters of one MoE block on one rank: E/ep experts, 1/etp of each."""
    return model.num_experts * model.expert_params() / (plan.ep * plan.etp)


def chunk_param_split(model: ModelSpec, plan: Plan, chunk: int, total: float) -> tuple[float,
                                                                                      float]:
    """(non-expert, routed-expert) parameters one rank holds of pipeline chunk ``chunk``,
    given ``total`` = the chunk's parameters as a dense split counts them (every block / tp,
    `simulator.step.memory.chunk_params`): the routed experts of its MoE blocks leave the
    tp split and are held E/ep per rank, 1/etp of each (`expert_params_per_block`)."""
    a, b = _chunk_range(model, plan, chunk)
    n_moe = chunk_moe_blocks(model, plan, chunk)
    routed = model.num_experts * model.expert_params()
    params = _block_table(model)[1]
    blocks = params[b] - params[a]
    dense = total - (b - a) * model.layer_params() / plan.tp \
        + (blocks - n_moe * routed) / plan.tp
    return dense, n_moe * expert_params_per_block(model, plan)


def activation_delta_bytes(model: ModelSpec, plan: Plan) -> float:
    """Activation bytes an MoE block stores beyond what the dense-block formula
    (`simulator.step.memory.layer_activation_bytes`) counts for its MLP, one micro-batch, one
    rank: the MoE MLP keeps the router input and fp32 scores (2h + 4E per token), per
    received token copy its permuted input (2h) and the expert activations (6·f_e/etp for
    SwiGLU, 4·f_e/etp for GeLU, as the dense MLP keeps per token, Korthikanti et al. 2022
    Table 2), the unpermute input (2h) per copy, and the shared experts as a dense MLP; minus
    the dense MLP's 3h + 6f (or 4f) per token. 16-bit bytes, scaled by dtype_bytes / 2;
    full recomputation keeps neither (0).

    Under a low-precision recipe Transformer Engine keeps each linear GEMM's input for the
    weight gradient as its cast (``operand_bytes`` an element, not 2), the experts' grouped
    linears as the dense ones (`simulator.step.memory.lowp_activation_saving`): per received
    copy the permuted input (h) and the activation output (f_e/etp), per token the shared
    experts' activation output (n_s·f_e/tp); and the dense MLP-down input (f/tp per token)
    that `lowp_activation_saving` takes off every block is not an MoE block's.

    >>> from planner.presets import load_model
    >>> m = load_model("mixtral-8x7b")      # h 4096, f = f_e 14336, top-2 of 8, no shared
    >>> p = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch=1, global_batch=8)
    >>> # 4096 tokens, 8192 copies: 4096*(2*4096 + 4*8) + 8192*(4*4096 + 6*14336)
    >>> # - 4096*(3*4096 + 6*14336) = 469,893,120 B in bf16; FP8 keeps the copies' h + f_e
    >>> # as 1 B instead of 2 and gives back the dense f: (8192*(4096 + 14336)
    >>> # - 4096*14336) * 1 = 92,274,688 B less
    >>> activation_delta_bytes(m, p), activation_delta_bytes(m, p.replace(dtype="fp8"))
    (469893120.0, 377618432.0)
    """
    if plan.recompute == "full":
        return 0.0
    h, k, e, fe = model.hidden, model.experts_per_token, model.num_experts, model.expert_hidden
    tr = tokens_per_rank(model, plan)
    t_all = tr * plan.tp
    c = 6 if model.activation == "swiglu" else 4
    copies = plan.etp * tr * k
    moe = tr * (2 * h + 4 * e) + copies * (4 * h + c * fe / plan.etp) \
        + t_all * c * model.num_shared_experts * fe / plan.tp
    dense = t_all * (3 * h + c * model.ffn_hidden) / plan.tp
    out = (moe - dense) * DTYPE_BYTES[plan.dtype] / 2
    low = recipe(plan.dtype)
    if low is not None:
        out -= (2 - low.operand_bytes) * (
            copies * (h + fe / plan.etp) + t_all * model.num_shared_experts * fe / plan.tp
            - t_all * model.ffn_hidden / plan.tp)
    return out


def selective_saving_bytes(model: ModelSpec, plan: Plan,
                           recompute_modules: tuple[str, ...] | None,
                           moe_layer: bool) -> float:
    """Activation bytes one block (one micro-batch, one rank) does not keep under
    ``recompute='selective'`` with the output-discarding ``recompute_modules`` of
    Megatron-Core (``TransformerConfig.recompute_modules``: "moe_act", "layernorm" and
    "mla_up_proj" discard their outputs and recompute them in the backward): "layernorm" the
    input and pre-MLP norm outputs (2h per token, /tp with sequence parallelism), "moe_act"
    an MoE block's activation output per received copy (f_e/etp), each as the plan stores it
    (the recipe's cast, ``operand_bytes``, for a low-precision plan; else the dtype's bytes).
    "mla_up_proj"'s tensors are not in the activation formula, so it saves nothing here.

    >>> from planner.presets import load_model
    >>> m = load_model("mixtral-8x7b")
    >>> p = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch=1, global_batch=8, recompute="selective",
    ...          dtype="fp8")
    >>> # layernorm 4096 tokens x 2 x 4096 x 1 B; moe_act 8192 copies x 14336 x 1 B
    >>> want = 4096 * 2 * 4096 + 8192 * 14336
    >>> selective_saving_bytes(m, p, ("layernorm", "moe_act"), True) == want
    True
    """
    if plan.recompute != "selective" or not recompute_modules:
        return 0.0
    low = recipe(plan.dtype)
    b = low.operand_bytes if low is not None else DTYPE_BYTES[plan.dtype]
    out = 0.0
    if "layernorm" in recompute_modules:
        t = tokens_per_rank(model, plan) * (1 if plan.sequence_parallel else plan.tp)
        out += 2 * model.hidden * t * b
    if "moe_act" in recompute_modules and moe_layer:
        copies = plan.etp * tokens_per_rank(model, plan) * model.experts_per_token
        out += copies * model.expert_hidden / plan.etp * b
    return out


def chunk_moe_terms(model: ModelSpec, plan: Plan, cluster: Cluster, chunk: int, stage: int,
                    attention: Attention, device: DeviceProfile, eff: Efficiency, *,
                    imbalance: float = 1.0, dispatcher: str = "alltoall",
                    overlap: bool = False, cp_attention: CpAttention = "ring",
                    recompute_modules: tuple[str, ...] | None = None
                    ) -> tuple[LayerCompute, float, float]:
    """(mean `LayerCompute` per block, exposed all-to-all seconds per block forward, the same
    backward) of pipeline chunk ``chunk`` on pipeline rank ``stage``, one micro-batch.

    Each MoE block runs a dispatch and a combine all-to-all forward and both again backward
    (`dispatch_time_s`); full recomputation, and selective recomputation of the "moe" module
    (``recompute_modules``), repeat the forward pair. With ``overlap`` (a
    framework that runs one micro-batch's all-to-all beside another's compute: Megatron-Core
    ``--overlap-moe-expert-parallel-comm``, DualPipe, DeepSeek-V3 report §3.2.1) only the part
    longer than the block's compute is exposed, and at least the compute the dispatcher's
    SMs take from it (`overlapped_exposed_s`). Averaged over the chunk's blocks (dense
    blocks send nothing).
    """
    mean, n_moe = chunk_compute(model, plan, chunk, attention, device, eff, imbalance,
                                cp_attention, recompute_modules)
    if n_moe == 0 or (plan.ep == 1 and plan.etp == 1):
        return mean, 0.0, 0.0
    fwd, bwd = block_a2a_exposed_s(model, plan, cluster, stage, attention, device, eff,
                                   imbalance=imbalance, dispatcher=dispatcher, overlap=overlap,
                                   cp_attention=cp_attention,
                                   recompute_modules=recompute_modules,
                                   full_share=plan.full_recompute_share(
                                       plan.layers_per_stage(model)[chunk]))
    share = n_moe / plan.layers_per_stage(model)[chunk]
    return mean, fwd * share, bwd * share


def block_a2a_exposed_s(model: ModelSpec, plan: Plan, cluster: Cluster, stage: int,
                        attention: Attention, device: DeviceProfile, eff: Efficiency, *,
                        imbalance: float = 1.0, dispatcher: str = "alltoall",
                        overlap: bool = False, cp_attention: CpAttention = "ring",
                        recompute_modules: tuple[str, ...] | None = None,
                        full_share: float = 1.0) -> tuple[float, float]:
    """(forward, backward) exposed all-to-all seconds of one MoE block on pipeline rank
    ``stage``, one micro-batch, as `chunk_moe_terms` counts them (its per-block figures
    before the average over the chunk's blocks); under full recomputation the backward
    repeats the pair for ``full_share`` of the blocks (`Plan.full_recompute_share`)."""
    if plan.ep == 1 and plan.etp == 1:
        return 0.0, 0.0
    a2a = dispatch_time_s(model, plan, cluster, stage, imbalance, dispatcher)
    # the share of blocks whose forward (with its dispatch and combine) runs again
    again = full_share if plan.recompute == "full" else float(
        plan.recompute == "selective" and "moe" in (recompute_modules or ()))
    fwd, bwd = 2 * a2a, 2 * a2a + 2 * a2a * again
    if overlap:
        block = block_compute(model, plan, attention, device, eff, True, imbalance,
                              cp_attention, recompute_modules)
        sms = DISPATCHER_SMS.get(dispatcher, 0)
        share = sms / device.sm_count if device.sm_count else 0.0
        fwd = overlapped_exposed_s(fwd, block.fwd_s, share)
        bwd = overlapped_exposed_s(bwd, block.bwd_s, share)
    return fwd, bwd


def stage_expert_blocks(model: ModelSpec, plan: Plan, stage: int) -> int:
    """MoE blocks held by pipeline rank ``stage`` (all its chunks)."""
    from planner.mesh import rank_chunks
    return sum(chunk_moe_blocks(model, plan, c) for c in rank_chunks(plan, stage))


def zero3_layer_groups(model: ModelSpec, plan: Plan, stage: int) -> list[tuple[float, list]]:
    """(parameters per block per rank, gather / reduce-scatter group) of ZeRO-3 / FSDP on an
    MoE model: the non-expert part of a block (/tp) over the dp·cp group and the routed
    experts (`expert_params_per_block`, averaged over the blocks) over the edp group."""
    from planner.mesh import group_ranks
    moe, params = _block_table(model)
    routed = model.num_experts * model.expert_params() * moe[-1]
    dense = (params[-1] - routed) / model.num_layers / plan.tp
    expert = expert_params_per_block(model, plan) * moe[-1] / model.num_layers
    return [(dense, list(group_ranks(plan, "dp_cp", stage=stage))),
            (expert, expert_group_ranks(plan, "edp", stage=stage))]

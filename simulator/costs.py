"""Per-stage costs of one micro-batch: compute, TP collectives, P2P, DP and optimizer times.

FLOPs: every GEMM is 2·m·n·k; the forward of one layer on T = b·s tokens is
``2·T·(layer matmul params)/tp + 4·T·s·h/tp`` (QKᵀ and AV over the full score matrix, as PaLM
appendix B and Megatron eq. 3 count it), the backward is twice the forward (Narayanan et al.
2021, §3.1). Memory-bound ops (norms, residual adds, activation function; attention is taken as
fused, FlashAttention-style) cost bytes / (bandwidth · memory_efficiency). TP: two all-reduces
of the T·h activation per layer in forward and two in backward (Shoeybi et al. 2019, §3); with
sequence parallelism they become all-gather + reduce-scatter pairs of the same ring cost
(Korthikanti et al. 2022, §4.2.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.spec import DTYPE_BYTES, ModelSpec, Plan, PlanError, check_plan
from simulator.cluster import Cluster
from simulator.collectives import (
    collective_time_s,
    group_devices,
    mesh_strides,
    p2p_time_on_cluster_s,
)
from simulator.memory import optimizer_bytes_per_param, stage_params


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Seconds one rank of a pipeline stage spends per micro-batch (and once per step).

    fwd/bwd_compute_s and fwd/bwd_comm_s are per micro-batch (bwd includes any recomputed
    forward); p2p_fwd_s sends the activation to the next stage, p2p_bwd_s the gradient to the
    previous one. Once per step: dp_comm_s reduces the gradients (all-reduce, or
    reduce-scatter under ZeRO) in ``dp_buckets`` equal buckets, optimizer_s updates the
    weights, dp_gather_s all-gathers updated weight shards (ZeRO >= 1).
    """

    fwd_compute_s: float
    bwd_compute_s: float
    fwd_comm_s: float = 0.0
    bwd_comm_s: float = 0.0
    p2p_fwd_s: float = 0.0
    p2p_bwd_s: float = 0.0
    dp_comm_s: float = 0.0
    dp_buckets: int = 1
    dp_gather_s: float = 0.0
    optimizer_s: float = 0.0


def layer_matmul_params(model: ModelSpec) -> int:
    """Matrix parameters of one block: QKV + output projection + MLP (2 or 3 matrices)."""
    h = model.hidden
    mlp = (3 if model.activation == "swiglu" else 2) * h * model.ffn_hidden
    return h * (h + 2 * model.kv_hidden) + h * h + mlp


def layer_forward_flops(model: ModelSpec, plan: Plan) -> float:
    """Forward GEMM FLOPs of one layer, one micro-batch, one TP rank:
    ``2·T·P_layer/tp + 4·T·s·h/tp`` with T = micro_batch·seq_len."""
    tokens = plan.micro_batch * model.seq_len
    return (2 * tokens * layer_matmul_params(model)
            + 4 * tokens * model.seq_len * model.hidden) / plan.tp


def layer_forward_bytes(model: ModelSpec, plan: Plan) -> float:
    """Forward memory-bound bytes of one layer on one TP rank: two norms (read + write, 4h),
    two residual adds (2 reads + 1 write, 6h) — sharded over tp only with sequence parallelism —
    and the activation function (GeLU 2f/tp, SwiGLU 3f/tp), all times T·dtype_bytes."""
    tokens = plan.micro_batch * model.seq_len
    replicated = 10 * model.hidden / (plan.tp if plan.sequence_parallel else 1)
    act = (3 if model.activation == "swiglu" else 2) * model.ffn_hidden / plan.tp
    return tokens * (replicated + act) * DTYPE_BYTES[plan.dtype]


def recompute_flops_per_token(model: ModelSpec, plan: Plan) -> float:
    """Extra FLOPs per token that recomputation adds (for HFU): full = the blocks' forward
    (2·P_blocks + 4·L·s·h); selective = the attention core (4·L·s·h) (Korthikanti et al. 2022,
    §5)."""
    attn_core = 4.0 * model.num_layers * model.seq_len * model.hidden
    if plan.recompute == "full":
        return 2.0 * model.num_layers * layer_matmul_params(model) + attn_core
    return attn_core if plan.recompute == "selective" else 0.0


def _rates(cluster: Cluster, plan: Plan) -> tuple[float, float]:
    dev = cluster.device
    flops = dev.peak(plan.dtype) * dev.matmul_efficiency * cluster.compute_share
    bandwidth = dev.memory_bandwidth_Bps * dev.memory_efficiency * cluster.compute_share
    return flops, bandwidth


def _edge_compute(model: ModelSpec, plan: Plan, first: bool,
                  last: bool) -> tuple[float, float]:
    # (forward GEMM FLOPs, forward bytes) the first / last stage adds: embedding lookup
    # (read + write T·h), final norm (4·T·h) and logits GEMM 2·T·h·V/tp with an fp32 softmax
    # cross-entropy (3 passes over T·V/tp).
    tokens, d = plan.micro_batch * model.seq_len, DTYPE_BYTES[plan.dtype]
    flops, nbytes = 0.0, 0.0
    if first:
        nbytes += 2 * tokens * model.hidden * d
    if last:
        flops += 2 * tokens * model.hidden * model.vocab_size / plan.tp
        nbytes += 4 * tokens * model.hidden * d + 3 * tokens * model.vocab_size / plan.tp * 4
    return flops, nbytes


#: Gradient bucket size: PyTorch DDP's default ``bucket_cap_mb=25``.
DP_BUCKET_BYTES = 25 * 2**20


def _dp_and_optimizer(model: ModelSpec, plan: Plan, cluster: Cluster,
                      stage: int, bandwidth: float) -> dict[str, float]:
    # Gradients are reduced in the plan dtype. ZeRO: reduce-scatter gradients, all-gather the
    # updated weights; ZeRO-3 / FSDP gathers the weights for the forward and again for the
    # backward (Rajbhandari et al. 2020, §5.3), counted here as 2 all-gathers once per step.
    params = stage_params(model, plan, stage)
    d = DTYPE_BYTES[plan.dtype]
    grads = params * d
    group = group_devices(plan, "dp", stage=stage)
    if plan.zero_stage == 0:
        reduce, gather = collective_time_s(cluster, "all_reduce", grads, group), 0.0
    else:
        reduce = collective_time_s(cluster, "reduce_scatter", grads, group)
        gather = (2 if plan.zero_stage == 3 else 1) * collective_time_s(
            cluster, "all_gather", params * d, group)
    # Adam: read gradients, read/write master weights (16-bit) and both moments, write weights.
    per_param = d + 2 * optimizer_bytes_per_param(plan.dtype) + (d if d < 4 else 0)
    shard = plan.dp if plan.zero_stage >= 1 else 1
    return {"dp_comm_s": reduce, "dp_gather_s": gather,
            "dp_buckets": max(1, math.ceil(grads / DP_BUCKET_BYTES)),
            "optimizer_s": params / shard * per_param / bandwidth}


def stage_costs(model: ModelSpec, plan: Plan, cluster: Cluster) -> list[StageCosts]:
    """`StageCosts` of every virtual pipeline stage, one representative rank each.

    Entry g = chunk·pp + rank (pp·virtual_stages entries, pipeline order; just the pp stages
    when virtual_stages = 1) runs on pipeline rank g % pp. Each rank's once-per-step DP and
    optimizer costs sit on its first chunk's entry (g < pp; zero elsewhere): chunk 0 runs the
    rank's last backward, the one DP buckets overlap with.

    Raises:
        PlanError: the plan does not fit the model (`check_plan`) or needs more devices than
            the cluster has.
    """
    check_plan(model, plan)
    if plan.world_size > cluster.num_devices:
        raise PlanError(
            f"tp*pp*dp = {plan.tp}*{plan.pp}*{plan.dp} = {plan.world_size} > "
            f"devices({cluster.num_devices}) of cluster {cluster.name!r} "
            f"({cluster.num_nodes} nodes x {cluster.devices_per_node})")
    flop_rate, byte_rate = _rates(cluster, plan)
    f_layer, b_layer = layer_forward_flops(model, plan), layer_forward_bytes(model, plan)
    layer_fwd = f_layer / flop_rate + b_layer / byte_rate
    recompute = {"full": layer_fwd, "none": 0.0,
                 "selective": 4 * plan.micro_batch * model.seq_len ** 2 * model.hidden
                 / plan.tp / flop_rate}[plan.recompute]
    act_bytes = plan.micro_batch * model.seq_len * model.hidden * DTYPE_BYTES[plan.dtype]
    pp, stride = plan.pp, mesh_strides(plan)["pp"]
    chunks = plan.layers_per_stage(model)
    tp_ar = [collective_time_s(cluster, "all_reduce", act_bytes,
                               group_devices(plan, "tp", stage=r)) for r in range(pp)]
    out = []
    for g, layers in enumerate(chunks):
        rank = g % pp
        e_flops, e_bytes = _edge_compute(model, plan, g == 0, g == len(chunks) - 1)
        edge = e_flops / flop_rate + e_bytes / byte_rate
        comm = 2 * layers * tp_ar[rank]
        src = rank * stride
        nxt, prv = ((rank + 1) % pp) * stride, ((rank - 1) % pp) * stride
        tail = _dp_and_optimizer(model, plan, cluster, rank, byte_rate) \
            if g < pp else {}
        out.append(StageCosts(
            fwd_compute_s=layers * layer_fwd + edge,
            bwd_compute_s=layers * (2 * layer_fwd + recompute) + 2 * edge,
            fwd_comm_s=comm, bwd_comm_s=comm * (2 if plan.recompute == "full" else 1),
            p2p_fwd_s=p2p_time_on_cluster_s(cluster, act_bytes, src, nxt)
            if g < len(chunks) - 1 else 0.0,
            p2p_bwd_s=p2p_time_on_cluster_s(cluster, act_bytes, src, prv) if g > 0 else 0.0,
            **tail))
    return out

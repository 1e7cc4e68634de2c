"""Per-stage costs of one micro-batch: compute, TP collectives, P2P, DP and optimizer times.

Compute comes op by op from `simulator.step.compute` (GEMMs at a shape-dependent efficiency,
memory-bound ops at achievable bandwidth, host launch time). TP: two all-reduces of the T·h
activation per layer in forward and two in backward (Shoeybi et al. 2019, §3); with sequence
parallelism each becomes a reduce-scatter + all-gather pair (Korthikanti et al. 2022, §4.2.2).
Full recomputation repeats the forward, its TP collectives included, before the backward;
selective repeats the attention core only (Korthikanti et al. 2022, §5). ZeRO-3 / FSDP gathers
each layer's weights before its forward and again before its backward and reduce-scatters its
gradients after, every micro-batch, prefetched one block ahead under the previous block's
compute, which the collective kernels slow; the first gather and the last reduce-scatter of
a micro-batch are exposed (Rajbhandari et al. 2020, §5.3; Zhao et al. 2023, PyTorch FSDP §3.3;
Lee et al. 2025 for the slowdown; `zero3_exposed_s`). Context parallelism (cp > 1) gives each rank b·s/cp
tokens; attention passes the key/value blocks round the cp ring, cp − 1 sends per layer
forward and, with their gradients, twice the bytes backward, each overlapped with the block
attention it feeds (Liu et al. 2023, "Ring Attention", §3); gradients reduce over dp·cp.
PyTorch's context-parallel SDPA (torchtitan) all-gathers the keys and values instead, under the
first block only, and passes fp32 key/value gradients one hop per block (`torch_cp_comm`).
"""

from __future__ import annotations

import math

from planner.mesh import chunk_rank, expert_group_ranks, group_ranks, mesh_strides
from planner.precision import (
    LINEAR_GEMMS,
    block_scaled_device,
    cast_bytes,
    cast_copies,
    recipe,
    storage_dtype,
)
from planner.spec import (
    DTYPE_BYTES,
    ZERO_BUBBLE_SCHEDULES,
    ModelSpec,
    Plan,
    PlanError,
    check_plan,
)
from simulator.network.cluster import Cluster
from simulator.network.collectives import (
    boundary_send_time_s,
    collective_time_s,
    identity_memo,
    memo_enabled,
    p2p_time_on_cluster_s,
)
from simulator.step.compute import (
    Efficiency,
    LayerCompute,
    edge_compute,
    layer_compute,
    load_efficiency,
    with_attention_kernel,
)
from simulator.step.cpu_model import cpu_stage_costs
from simulator.step.memory import (
    optimizer_bytes_per_param,
    stage_layout,
    stage_param_split,
    stage_param_splits,
)
from simulator.step.moe import (
    block_a2a_exposed_s,
    chunk_compute,
    chunk_moe_terms,
    zero3_layer_groups,
)
from simulator.step.stagecosts import DEFAULT_OPTIONS, SimOptions, StageCosts
from simulator.step.zero_bubble import split_backward


def _efficiency(cluster: Cluster, options: SimOptions) -> Efficiency:
    eff = options.efficiency or load_efficiency(cluster.device.name)
    if eff.host_op_s == 0 and eff.gemm_half_flops == 0 and eff.num_sms == 1:
        # Generic device (CPU core): the device profile's flat efficiencies.
        dev = cluster.device
        eff = Efficiency(gemm_max_fraction=dev.matmul_efficiency, gemm_half_flops=0.0,
                         num_sms=1, memory_fraction=dev.memory_efficiency, kernel_s=0.0,
                         host_op_s=0.0, flash_fraction=1.0)
    if options.attention != "unfused":
        # The framework's attention kernel at its published rate on this GPU generation.
        eff = with_attention_kernel(eff, cluster.device.name, options.attention_kernel)
    return eff


def _device(cluster: Cluster):
    dev = cluster.device
    if cluster.compute_share == 1.0:
        return dev
    share = cluster.compute_share
    return dev.replace(peak_flops={k: v * share for k, v in dev.peak_flops.items()},
                       memory_bandwidth_Bps=dev.memory_bandwidth_Bps * share)


def _tp_collectives(model: ModelSpec, plan: Plan, cluster: Cluster,
                    rank: int) -> tuple[float, float]:
    # (all-gather s, reduce-scatter s) of one sequence-parallel TP collective of T·h.
    act = plan.micro_batch * model.seq_len // plan.cp * model.hidden * DTYPE_BYTES[plan.dtype]
    group = group_ranks(plan, "tp", stage=rank)
    return (collective_time_s(cluster, "all_gather", act, group),
            collective_time_s(cluster, "reduce_scatter", act, group))


def _tp_layer_comm(model: ModelSpec, plan: Plan, cluster: Cluster, rank: int) -> float:
    # One TP collective pair's worth per layer direction: 2 all-reduces of T·h, or with SP
    # 2 × (reduce-scatter + all-gather).
    if plan.tp == 1:
        return 0.0
    if plan.sequence_parallel:
        return 2 * sum(_tp_collectives(model, plan, cluster, rank))
    act = plan.micro_batch * model.seq_len // plan.cp * model.hidden * DTYPE_BYTES[plan.dtype]
    return 2 * collective_time_s(cluster, "all_reduce", act, group_ranks(plan, "tp", stage=rank))


def micro_pipelined_s(comm_s: float, gemm_s: float, chunked_s: float, tp: int) -> float:
    """Seconds a collective of ``comm_s`` and the GEMM it feeds or is fed by take together
    when micro-pipelined (PyTorch async TP: ``fused_all_gather_matmul`` /
    ``fused_matmul_reduce_scatter`` over SymmetricMemory, copy-engine transfers), beyond the
    GEMM's own ``gemm_s``: the GEMM is cut into ``tp`` row chunks (``chunked_s`` in all);
    one chunk runs with no transfer (the local shard of an all-gather, the last partial of a
    reduce-scatter) and each of the ``tp − 1`` others waits for, or is waited on by, one
    shard's transfer of ``comm_s / (tp − 1)``: the pair takes
    ``chunked/tp + (tp − 1)·max(chunked/tp, comm/(tp − 1)) = max(chunked, chunked/tp + comm)``
    (Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition
    in Large Deep Learning Models", ASPLOS, §3; PyTorch
    ``torch/distributed/_symmetric_memory`` ``_pipelined_all_gather_and_consume``).

    >>> # a 4 ms GEMM under a 3 ms all-gather over 8 ranks, chunks 10% slower in all:
    >>> # max(4.4, 0.55 + 3) - 4 = 0.4 ms (the chunking's cost; the transfer hides)
    >>> round(micro_pipelined_s(3e-3, 4e-3, 4.4e-3, 8) * 1e3, 3)
    0.4
    >>> # a 2 ms GEMM cannot hide it: max(2, 0.25 + 3) - 2 = 1.25 ms exposed
    >>> round(micro_pipelined_s(3e-3, 2e-3, 2e-3, 8) * 1e3, 3)
    1.25
    """
    return max(chunked_s, chunked_s / tp + comm_s) - gemm_s


def async_tp_exposed_s(ag_s: float, rs_s: float, gemms: tuple[tuple[float, float], ...],
                       tp: int) -> tuple[float, float]:
    """(forward, backward) exposed seconds per block of the sequence-parallel TP collectives
    under PyTorch's async TP (torch._inductor ``_micro_pipeline_tp``, torchtitan
    ``--parallelism.enable_async_tensor_parallel``, which requires torch.compile). Inductor's
    pass fuses an all-gather with the matmul it feeds and a matmul with the reduce-scatter it
    feeds (pytorch/pytorch#126598); each pair costs `micro_pipelined_s`, so a collective
    hides only under its own GEMM (the attention side's QKV and output projections are
    short), not the whole block. Forward: all four pairs, ``gemms`` = (QKV, output
    projection, MLP up, MLP down) as `LayerCompute.tp_gemms_s`. Backward: the all-gathers
    of the output gradient feed the output and down projections' dgrad GEMMs (the forward
    GEMMs' shape) and fuse; the reduce-scatters after the QKV and up projections' dgrad take
    a sum of matmuls, which the pass does not match (pytorch/pytorch#149946: "only valid
    ...mm-reduce-scatter patterns in the forward graph, but not in the backward graph"),
    so they stay exposed. Full recomputation repeats the forward's cost (add it to the
    backward).

    >>> g = ((1e-3, 1e-3), (1e-3, 1e-3), (8e-3, 8e-3), (4e-3, 4e-3))
    >>> f, b = async_tp_exposed_s(2e-3, 2e-3, g, 8)
    >>> # forward: QKV and output projection 1.125 ms exposed each (0.125 + 2 - 1), the MLP
    >>> # pairs hide; backward: output projection 1.125 + the two reduce-scatters 2 x 2
    >>> round(f * 1e3, 3), round(b * 1e3, 3)
    (2.25, 5.125)
    """
    (qkv, qkv_c), (out, out_c), (up, up_c), (down, down_c) = gemms
    fwd = (micro_pipelined_s(ag_s, qkv, qkv_c, tp) + micro_pipelined_s(rs_s, out, out_c, tp)
           + micro_pipelined_s(ag_s, up, up_c, tp) + micro_pipelined_s(rs_s, down, down_c, tp))
    bwd = (micro_pipelined_s(ag_s, out, out_c, tp) + micro_pipelined_s(ag_s, down, down_c, tp)
           + 2 * rs_s)
    return fwd, bwd


def cp_ring_comm(model: ModelSpec, plan: Plan, cluster: Cluster, rank: int) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's key/value ring on one CP rank, one
    micro-batch, before overlap: cp − 1 steps, each sending the rank's K and V block
    (2·b·(s/cp)·kv_hidden/tp elements) to the next rank of the ring and receiving the previous
    rank's; backward passes the blocks and their gradients (twice the bytes). A step takes
    the slowest hop of the ring (the one that leaves the node, if any).

    >>> from planner.spec import ModelSpec
    >>> from simulator.network.cluster import load_cluster
    >>> m = ModelSpec(name="m", num_layers=2, hidden=4096, num_heads=32, num_kv_heads=8,
    ...               ffn_hidden=14336, vocab_size=32000, seq_len=8192, activation="swiglu")
    >>> p = Plan(tp=1, cp=2, pp=1, dp=1, micro_batch=1, global_batch=1)
    >>> f, b = cp_ring_comm(m, p, load_cluster("dgx-h100"), 0)
    >>> # one step: K and V of 4096 tokens x 1024 x 2 B = 16.8 MB over NVLink4 at 450 GB/s
    >>> # plus the 1 us hop latency; backward sends twice the bytes
    >>> round(f * 1e6, 1), round(b * 1e6, 1)
    (38.3, 75.6)
    """
    if plan.cp == 1:
        return 0.0, 0.0
    block = 2 * plan.micro_batch * (model.seq_len // plan.cp) * model.kv_hidden / plan.tp \
        * DTYPE_BYTES[plan.dtype]
    ring = list(group_ranks(plan, "cp", stage=rank))
    hops = list(zip(ring, ring[1:] + ring[:1], strict=True))

    def step(nbytes: float) -> float:
        return max(p2p_time_on_cluster_s(cluster, nbytes, a, b) for a, b in hops)

    return (plan.cp - 1) * step(block), (plan.cp - 1) * step(2 * block)


def torch_cp_comm(model: ModelSpec, plan: Plan, cluster: Cluster,
                  rank: int) -> tuple[float, float]:
    """(all-gather, gradient hop) seconds of one layer's key/value exchange on one CP rank,
    one micro-batch, in PyTorch's context-parallel SDPA as torchtitan runs it, before overlap.

    torchtitan repeats the K/V heads to the query heads before SDPA (``repeat_kv`` in
    ``torchtitan/models/llama/model.py``), so a rank's K and V are 2·b·(s/cp)·a·d_head/tp
    elements, not the compact GQA width; the default rotate method ``allgather``
    (torchtitan's ``context_parallel_rotate_method``, ``_AllGatherRotater`` in
    ``torch/distributed/tensor/experimental/_attention.py``) gathers all cp of them once per
    pass, forward and again backward. The backward sends each block's fp32 dK, dV (twice the
    bf16 bytes) to the next rank (``_AllToAllRotater``), one hop per block, the slowest hop
    of the ring.

    >>> from simulator.network.cluster import load_cluster
    >>> m = ModelSpec(name="m", num_layers=2, hidden=4096, num_heads=32, num_kv_heads=8,
    ...               ffn_hidden=14336, vocab_size=32000, seq_len=8192, activation="swiglu")
    >>> p = Plan(tp=1, cp=2, pp=1, dp=1, micro_batch=1, global_batch=1)
    >>> gather, hop = torch_cp_comm(m, p, load_cluster("dgx-h100"), 0)
    >>> # K and V of 4096 tokens x 32 heads x 128 x 2 B = 67.1 MB per rank, 4x the GQA block
    >>> # of `cp_ring_comm`; the hop carries them in fp32 (134 MB) over NVLink4 at 450 GB/s
    >>> round(hop * 1e3, 3)
    0.299
    """
    if plan.cp == 1:
        return 0.0, 0.0
    kv = 2 * plan.micro_batch * (model.seq_len // plan.cp) * model.num_heads \
        * model.head_dim / plan.tp * DTYPE_BYTES[storage_dtype(plan.dtype)]
    ring = list(group_ranks(plan, "cp", stage=rank))
    gather = collective_time_s(cluster, "all_gather", plan.cp * kv, ring)
    hop = max(p2p_time_on_cluster_s(cluster, 2 * kv, a, b)
              for a, b in zip(ring, ring[1:] + ring[:1], strict=True))
    return gather, hop


def cp_exposed_s(model: ModelSpec, plan: Plan, cluster: Cluster, rank: int,
                 lc: LayerCompute, options: SimOptions) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's context-parallel K/V exchange that its
    attention does not hide, one micro-batch on one CP rank (0 when cp = 1).

    ``options.cp_attention``:

    * 'ring': the cp − 1 hops of `cp_ring_comm` against the layer's whole attention core
      (forward; backward 2.5x it with FlashAttention, Dao 2023 §3.1): only the excess shows.
    * 'pytorch' (`torch_cp_comm`): the all-gather is issued before the first block and
      awaited before the second, so it hides under one block, the core's 1/cp (the blocks
      are equal under the two-chunk load balancing); backward gathers again under the first
      block, each block's gradient hop is awaited after the next block (cp − 1 hops under
      one block each), and the last hop is awaited after the last block, under nothing.

    >>> from simulator.network.cluster import load_cluster
    >>> m = ModelSpec(name="m", num_layers=2, hidden=4096, num_heads=32, num_kv_heads=8,
    ...               ffn_hidden=14336, vocab_size=32000, seq_len=8192, activation="swiglu")
    >>> p = Plan(tp=1, cp=2, pp=1, dp=1, micro_batch=1, global_batch=1)
    >>> lc = LayerCompute(1.0, 3.0, 1.0, 0.0, 0.0, 1)  # attention takes 1 s: all hides
    >>> cl = load_cluster("dgx-h100")
    >>> f, b = cp_exposed_s(m, p, cl, 0, lc, SimOptions(cp_attention="pytorch"))
    >>> f, b == torch_cp_comm(m, p, cl, 0)[1]  # only the last gradient hop shows
    (0.0, True)
    """
    if plan.cp == 1:
        return 0.0, 0.0
    core_f = lc.attn_core_fwd_s
    core_b = core_f * (2.5 if options.attention != "unfused" else 2.0)
    if options.cp_attention == "pytorch":
        gather, hop = torch_cp_comm(model, plan, cluster, rank)
        block_f, block_b = core_f / plan.cp, core_b / plan.cp
        return (max(0.0, gather - block_f),
                max(0.0, gather - block_b) + (plan.cp - 1) * max(0.0, hop - block_b) + hop)
    ring_f, ring_b = cp_ring_comm(model, plan, cluster, rank)
    return max(0.0, ring_f - core_f), max(0.0, ring_b - core_b)


def _unaggregated_s(cluster: Cluster, nbytes: float, n: int) -> float:
    # (n − 1)/n · S through one rank's share of its node's NICs.
    nic = getattr(cluster, "nic_bandwidth_Bps", 0.0) or 0.0
    if cluster.num_nodes == 1 or nic <= 0:
        return 0.0
    comm = getattr(cluster, "comm", None)
    nic *= getattr(comm, "nic_efficiency", 1.0)
    share = nic * cluster.nics_per_node / cluster.devices_per_node
    return (n - 1) / n * nbytes / share


def _zero3_layer_comm(model: ModelSpec, plan: Plan, cluster: Cluster, rank: int,
                      options: SimOptions) -> tuple[float, float]:
    # (forward, backward) per-layer ZeRO-3 traffic: gather the weights; gather again and
    # reduce-scatter the gradients. The weights travel in the plan dtype; the gradients in
    # the reduction dtype, as for ZeRO 0-2 (`_dp_and_optimizer`): fp32 for bf16 unless the
    # framework reduces in 16 bits (PyTorch FSDP MixedPrecision reduce_dtype; torchtitan's
    # default mixed_precision_reduce = float32, Composer's PURE = bf16).
    # An MoE model gathers its non-expert and expert parts over their own groups.
    if plan.zero_stage != 3:
        return 0.0, 0.0
    d = DTYPE_BYTES[plan.dtype]
    groups = zero3_layer_groups(model, plan, rank) if model.is_moe else \
        [(model.layer_params() / plan.tp, group_ranks(plan, "dp_cp", stage=rank))]
    gather = scatter = 0.0
    for params, group in groups:
        shard = len(group)
        if shard == 1:
            continue
        nbytes = params * d
        gbytes = params * (options.grad_reduce_bytes
                           or (4 if storage_dtype(plan.dtype) == "bf16" else d))
        g = collective_time_s(cluster, "all_gather", nbytes, group)
        r = collective_time_s(cluster, "reduce_scatter", gbytes, group)
        if options.zero3_unaggregated and plan.world_size > cluster.devices_per_node:
            g = max(g, _unaggregated_s(cluster, nbytes, shard))
            r = max(r, _unaggregated_s(cluster, gbytes, shard))
        gather, scatter = gather + g, scatter + r
    return gather, gather + scatter


#: Fraction by which compute slows while a collective runs beside it on the same GPU: NCCL
#: kernels hold SMs (one thread block per channel) and share HBM bandwidth with the GEMMs
#: they overlap. Lee et al. 2025, "Characterizing Compute-Communication Overlap in
#: GPU-Accelerated Distributed Deep Learning" (arXiv 2507.03114), abstract and §5: 18.9% mean
#: compute slowdown under overlap (maximum 40%) over GPT and Llama layers on A100 and H100
#: (and MI250 / MI210). One published mean, not fitted and not split by device.
OVERLAP_COMPUTE_SLOWDOWN = 0.189


def overlapped_s(compute_s: float, comm_s: float,
                 slowdown: float = OVERLAP_COMPUTE_SLOWDOWN) -> float:
    """Seconds until both ``compute_s`` of compute and a ``comm_s`` collective started beside
    it are done, when the compute runs ``1 + slowdown`` times slower while the collective
    runs (`OVERLAP_COMPUTE_SLOWDOWN`): ``comm_s`` if the collective outlasts the slowed
    compute, else ``compute_s + comm_s · slowdown / (1 + slowdown)`` (the compute done
    during the collective is ``comm_s / (1 + slowdown)``; the rest runs at full speed).

    >>> overlapped_s(10.0, 0.0), overlapped_s(10.0, 30.0)  # nothing beside it; comm-bound
    (10.0, 30.0)
    >>> overlapped_s(10.0, 5.0, slowdown=0.25)  # 4 s of compute in the 5 s, then 6 s
    11.0
    """
    if comm_s >= compute_s * (1 + slowdown):
        return comm_s
    return compute_s + comm_s * slowdown / (1 + slowdown)


def zero3_exposed_s(gather_s: float, scatter_s: float, window_f: float, window_b: float,
                    ahead: float = 1.0, overlap_reduce: bool = True,
                    slowdown: float = OVERLAP_COMPUTE_SLOWDOWN
                    ) -> tuple[float, float, float, float]:
    """ZeRO-3 / FSDP time beyond compute for one micro-batch of a chunk of L blocks, as
    (per-block forward, per-block backward, once-per-chunk forward, once-per-chunk backward)
    seconds: the chunk's total is L · per-block + once-per-chunk.

    Each block's weights are all-gathered before its forward and again before its backward
    and its gradients reduce-scattered after its backward, every micro-batch (Rajbhandari et
    al. 2020, ZeRO §5.3 and §7.2.2: parameters are re-gathered for every forward and
    backward; Zhao et al. 2023, PyTorch FSDP, VLDB, §3.3 and §4: resharding after forward,
    backward prefetch, one unit ahead). With gradient accumulation both FSDP and DeepSpeed
    re-gather per micro-batch (FSDP keeps the weights only under
    ``reshard_after_forward=False``, not modelled here). The collective for block i + 1
    (forward) or i − 1 plus block i's reduce-scatter (backward) runs beside block i's
    compute ``window_f`` / ``window_b``, which it slows (`overlapped_s`); what outlasts it
    shows. Only the ``ahead`` share of a gather is prefetched (DeepSpeed
    ``stage3_prefetch_bucket_size``): the rest stalls every block. Per chunk and micro-batch
    the first block's prefetched gather has no compute before it and the last block's
    reduce-scatter none after it (the backward's end waits for it: FSDP2's final backward
    callback): both are exposed once, and a chunk has L − 1 prefetch windows, so the once
    terms are those two less one block's overlap excess. ``overlap_reduce`` False
    (DeepSpeed ``overlap_comm: false``): every reduce-scatter blocks the backward.

    >>> # gather 4 s, scatter 6 s, 10 s forward / 20 s backward per block, no slowdown:
    >>> zero3_exposed_s(4.0, 6.0, 10.0, 20.0, slowdown=0.0)  # all hides but the ends
    (0.0, 0.0, 4.0, 6.0)
    >>> # 12 s gathers against 10 s of compute: 2 s per window, so L - 1 windows plus the
    >>> # first gather: L · 2 + (12 - 2)
    >>> zero3_exposed_s(12.0, 6.0, 10.0, 20.0, slowdown=0.0)[::2]
    (2.0, 10.0)
    >>> # slowdown 0.25: 4 s of gather beside 10 s cost 4 · 0.25 / 1.25 = 0.8 s per window
    >>> [round(x, 6) for x in zero3_exposed_s(4.0, 6.0, 10.0, 20.0, slowdown=0.25)]
    [0.8, 2.0, 3.2, 4.0]
    """
    hidden_f = ahead * gather_s
    stall_f = (1 - ahead) * gather_s
    hidden_b = ahead * gather_s + (scatter_s if overlap_reduce else 0.0)
    stall_b = (1 - ahead) * gather_s + (0.0 if overlap_reduce else scatter_s)
    per_f = stall_f + overlapped_s(window_f, hidden_f, slowdown) - window_f
    per_b = stall_b + overlapped_s(window_b, hidden_b, slowdown) - window_b
    last = scatter_s if overlap_reduce else 0.0
    excess_f, excess_b = per_f - stall_f, per_b - stall_b
    return per_f, per_b, hidden_f - excess_f, last - excess_b


def zero3_once_per_step(plan: Plan, options: SimOptions) -> bool:
    """Whether ZeRO-3 gathers the weights and reduce-scatters the gradients once per step
    instead of every micro-batch: FSDP2 under ``torch.distributed.pipelining`` with the
    framework's ``zero3_pp_unsharded`` (pp > 1). The pipeline stage turns off resharding
    after backward and gradient sync for every backward but the last
    (``_PipelineStageBase.backward_maybe_with_nosync`` in ``torch/distributed/pipelining/
    stage.py``: ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``)
    and torchtitan does not reshard after forward when pp > 1
    (``fsdp_reshard_after_forward = "default"``), so the weights stay gathered between
    micro-batches.

    >>> p = Plan(tp=1, pp=2, dp=4, micro_batch=1, global_batch=16, zero_stage=3)
    >>> zero3_once_per_step(p, SimOptions(zero3_pp_unsharded=True))
    True
    >>> zero3_once_per_step(p.replace(pp=1, dp=8), SimOptions(zero3_pp_unsharded=True))
    False
    """
    return plan.zero_stage == 3 and plan.pp > 1 and options.zero3_pp_unsharded


def _dp_and_optimizer(model: ModelSpec, plan: Plan, cluster: Cluster, stage: int,
                      bandwidth: float, options: SimOptions) -> dict[str, float]:
    # ZeRO 1/2 (distributed optimizer): reduce-scatter gradients, all-gather the updated
    # 16-bit weights. ZeRO-3 reduces per layer (`_zero3_layer_comm`).
    # An MoE model reduces its expert gradients over the expert data-parallel group.
    dense, experts = stage_param_split(model, plan, stage)
    d = DTYPE_BYTES[plan.dtype]
    g = options.grad_reduce_bytes or (4 if storage_dtype(plan.dtype) == "bf16" else d)
    groups = [(dense, group_ranks(plan, "dp_cp", stage=stage))]
    if experts:
        groups.append((experts, expert_group_ranks(plan, "edp", stage=stage)))
    reduce = gather = updated = 0.0
    for params, group in groups:
        grads = params * g
        if plan.zero_stage == 0:
            reduce += collective_time_s(cluster, "all_reduce", grads, group)
        elif plan.zero_stage != 3:
            reduce += collective_time_s(cluster, "reduce_scatter", grads, group)
            gather += collective_time_s(cluster, "all_gather", params * d, group)
        updated += params / (len(group) if plan.zero_stage >= 1 else 1)
    # Adam: read gradients, read/write master weights and both moments, write weights.
    per_param = g + 2 * optimizer_bytes_per_param(plan.dtype) + (d if d < 4 else 0)
    bucket = options.dp_bucket_bytes
    grads = (dense + experts) * g
    return {"dp_comm_s": reduce, "dp_gather_s": gather,
            "dp_buckets": max(1, math.ceil(grads / bucket)) if bucket else 1,
            "optimizer_s": updated * per_param / bandwidth}


def check_cluster(plan: Plan, cluster: Cluster) -> None:
    """Raise `PlanError` with the arithmetic when the plan needs more devices than exist."""
    if plan.world_size > cluster.num_devices:
        raise PlanError(
            f"{plan.degrees} > "
            f"devices({cluster.num_devices}) of cluster {cluster.name!r} "
            f"({cluster.num_nodes} nodes x {cluster.devices_per_node})")


def _chunk_times(model: ModelSpec, plan: Plan, cluster: Cluster, options: SimOptions,
                 rank: int, layers: int, lc: LayerCompute, edge: tuple[float, float, float],
                 host_re: float, moe_comm: tuple[float, float] = (0.0, 0.0)
                 ) -> tuple[float, float, float, float, float, float]:
    # (fwd compute, bwd compute, fwd exposed comm, bwd exposed comm, fwd hidden comm, bwd
    # hidden comm) of one micro-batch of a chunk of ``layers`` blocks on pipeline rank
    # ``rank``; ``moe_comm`` is the exposed expert all-to-all per block
    # (`simulator.step.moe.chunk_moe_terms`). Hidden: the TP and ZeRO-3 traffic that runs
    # beside the compute, less what of it is exposed.
    full = plan.full_recompute_share(layers)       # blocks whose forward runs again
    recompute = lc.recompute_s(plan.recompute, full)
    tp_comm = _tp_layer_comm(model, plan, cluster, rank)
    z_fwd, z_bwd = (0.0, 0.0) if zero3_once_per_step(plan, options) else \
        _zero3_layer_comm(model, plan, cluster, rank, options)
    fwd_dev, bwd_dev = lc.fwd_s, lc.bwd_s + recompute
    fwd_comm = tp_comm
    bwd_comm = tp_comm * (1 + full)
    hide_f = hide_b = 0.0  # per block
    if options.tp_comm_overlap and options.tp_overlap_kind == "async-tp" \
            and plan.sequence_parallel and lc.tp_gemms_s:
        ag, rs = _tp_collectives(model, plan, cluster, rank)
        ex_f, ex_b = async_tp_exposed_s(ag, rs, lc.tp_gemms_s, plan.tp)
        ex_b += ex_f * full
        hide_f, hide_b = max(0.0, fwd_comm - ex_f), max(0.0, bwd_comm - ex_b)
        fwd_comm, bwd_comm = ex_f, ex_b
    elif options.tp_comm_overlap:
        hide_f, hide_b = min(fwd_comm, fwd_dev), min(bwd_comm, bwd_dev)
        fwd_comm, bwd_comm = max(0.0, fwd_comm - fwd_dev), max(0.0, bwd_comm - bwd_dev)
    # The CP exchange hides under the block attention it feeds: only the excess shows (full
    # recomputation repeats the forward's).
    cp_f, cp_b = cp_exposed_s(model, plan, cluster, rank, lc, options)
    fwd_comm += cp_f
    bwd_comm += cp_b + cp_f * full
    fwd_comm, bwd_comm = fwd_comm + moe_comm[0], bwd_comm + moe_comm[1]
    # ZeRO-3 traffic is prefetched on its own stream (`zero3_exposed_s`): one block's gather
    # ahead, the first gather and last reduce-scatter under nothing, the compute it overlaps
    # slowed by the collective kernels. On a CPU cluster (gloo) the collectives run on the
    # cores that compute: nothing overlaps.
    z_once_f = z_once_b = 0.0
    if cluster.collective_bandwidth_Bps is None:
        ahead = 1.0
        if options.zero3_prefetch_params is not None and z_fwd > 0:
            layer = model.layer_params() / plan.tp
            ahead = min(1.0, options.zero3_prefetch_params / layer)
        z_f, z_b, z_once_f, z_once_b = zero3_exposed_s(
            z_fwd, z_bwd - z_fwd, fwd_dev + fwd_comm, bwd_dev + bwd_comm, ahead,
            options.zero3_overlap_reduce)
        fwd_comm, bwd_comm = fwd_comm + z_f, bwd_comm + z_b
        hide_f, hide_b = hide_f + max(0.0, z_fwd - z_f), hide_b + max(0.0, z_bwd - z_b)
    else:
        fwd_comm, bwd_comm = fwd_comm + z_fwd, bwd_comm + z_bwd
    # Host-bound: the device idles between launches and in-stream collectives fill the gaps,
    # so only device + comm beyond the host time is exposed communication.
    fwd, bwd, dev_f, dev_b = _chunk_compute(plan, layers, lc, edge, host_re)
    amax_f, amax_b = amax_allreduce_s(plan, cluster, rank, layers)
    return (fwd, bwd, max(0.0, dev_f + layers * fwd_comm + z_once_f - fwd) + amax_f,
            max(0.0, dev_b + layers * bwd_comm + z_once_b - bwd) + amax_b,
            max(0.0, layers * hide_f - z_once_f), max(0.0, layers * hide_b - z_once_b))


def _chunk_compute(plan: Plan, layers: int, lc: LayerCompute, edge: tuple[float, float, float],
                   host_re: float) -> tuple[float, float, float, float]:
    # (fwd, bwd, fwd device, bwd device) seconds of one micro-batch of a chunk: a pass takes
    # max(device time, host launch time).
    e_fwd, e_bwd, e_host = edge
    full = plan.full_recompute_share(layers)
    recompute = lc.recompute_s(plan.recompute, full)
    if plan.recompute == "full":
        host_re *= full                            # only the recomputed blocks relaunch
    dev_f, dev_b = layers * lc.fwd_s + e_fwd, layers * (lc.bwd_s + recompute) + e_bwd
    fwd = max(dev_f, layers * lc.host_fwd_s + e_host)
    bwd = max(dev_b, layers * (lc.host_bwd_s + host_re) + 2 * e_host)
    return fwd, bwd, dev_f, dev_b


def _compute_setup(model: ModelSpec, plan: Plan, cluster: Cluster, options: SimOptions):
    # (efficiency, device, layer compute, host recompute s) shared by every chunk of a plan;
    # memoised on the cluster per (model, options) object and the fields it reads (the
    # objects are kept with the entry, so their ids stay theirs).
    if not memo_enabled():
        return _fresh_setup(model, plan, cluster, options)
    memo = cluster._links.setdefault("setup", {})
    key = (id(model), id(options), plan.micro_batch, plan.tp, plan.sequence_parallel,
           plan.dtype, plan.cp, plan.recompute)
    hit = memo.get(key)
    if hit is None or hit[0] is not model or hit[1] is not options:
        hit = memo[key] = (model, options, *_fresh_setup(model, plan, cluster, options))
    return hit[2:]


def _fresh_setup(model: ModelSpec, plan: Plan, cluster: Cluster, options: SimOptions):
    eff, dev = _efficiency(cluster, options), _device(cluster)
    lc = layer_compute(model, plan.micro_batch, plan.tp, plan.sequence_parallel,
                       options.attention, plan.dtype, dev, eff, plan.cp, options.cp_attention,
                       options.eager_pointwise)
    host_re = {"full": lc.host_fwd_s, "none": 0.0,
               "selective": eff.host_op_s * 4}[plan.recompute]
    return eff, dev, lc, host_re


def step_lower_bound_s(model: ModelSpec, plan: Plan, cluster: Cluster,
                       options: SimOptions = DEFAULT_OPTIONS) -> float:
    """A compute-only lower bound of the closed-form step time
    (`simulator.step.pipeline.estimate_pipeline` over `stage_costs`), in seconds: the first
    of `compute_lower_bounds_s`.

    Raises:
        PlanError: as `stage_costs`.
    """
    return compute_lower_bounds_s(model, plan, cluster, options)[0]


def compute_lower_bounds_s(model: ModelSpec, plan: Plan, cluster: Cluster,
                           options: SimOptions = DEFAULT_OPTIONS) -> tuple[float, float]:
    """Compute-only lower bounds ``(step_s, busy_s)`` of the closed form
    (`simulator.simulate.estimate`): of its step time, and of its critical rank's busy time
    (``compute_s + comm_s``), in seconds; no communication is costed but an MoE model's
    expert all-to-all (below).

    With C_r = the forward + backward compute of one micro-batch on pipeline rank r (its
    chunks, by `planner.mesh.chunk_rank`, summed): for GPipe / 1F1B / interleaved 1F1B
    ``step_s = m·max_r C_r + (Σ_r C_r − max_r C_r)/v``. The closed form is the same
    expression over C_r plus each chunk's exposed communication, plus P2P and the DP /
    optimizer tail, all ≥ 0; the expression grows with every C_r (its slope is
    m − 1/v + 1/v ≥ 0 in the largest and 1/v in the others), so it is never above the step.

    Zero-bubble schedules (`simulator.step.zero_bubble.estimate_zero_bubble`):
    ``step_s = max_r (s_r + m·C_r)``. Rank r runs every F, B and W of its chunks, m
    micro-batches, one step at a time, so its last op ends at least m·C_r after its first
    starts; its first op is the forward of micro-batch 0 on its first chunk r, which waits
    for that micro-batch's forwards on chunks 0 .. r − 1: s_r = Σ_{g<r} F_g (0 with
    ``options.optimizer_post_validation``, whose step is counted from each rank's first op).

    ``busy_s = m·min_r C_r``: whichever rank is critical computes m micro-batches of its
    chunks (its ``compute_s`` counts them all).

    MoE and MLA chunks take their blocks' compute as `stage_costs` does
    (`simulator.step.moe.chunk_compute`). With expert parallelism (and no
    ``options.recompute_modules``) C_r is at least D_r + n_r·(a_f + a_b), D_r the device
    time of C_r (without the host-bound excess), n_r the MoE blocks of rank r and a_f, a_b
    one block's exposed all-to-all forward and backward
    (`simulator.step.moe.block_a2a_exposed_s`): a chunk's pass takes at least its device
    time plus the communication its blocks expose, `_chunk_times`, whose other terms are
    ≥ 0; not under DualPipe-V, whose overlapped pairs hide communication under compute
    (`OVERLAPPED_PAIR_SCHEDULES`). (0, 0) (no bound) on a calibrated CPU cluster
    (measured tables).

    Raises:
        PlanError: as `stage_costs`.
    """
    check_plan(model, plan)
    check_cluster(plan, cluster)
    if cluster.cpu_profile is not None:      # calibrated CPU (cp plans too): no bound
        return 0.0, 0.0
    fill, work, dev_work = _bound_terms(model, plan, cluster, options)
    if model.is_moe and (plan.ep > 1 or plan.etp > 1) and options.recompute_modules is None \
            and plan.schedule not in OVERLAPPED_PAIR_SCHEDULES:
        work = _with_moe_a2a(model, plan, cluster, options, work, dev_work)
    m, busiest = plan.num_microbatches, max(work)
    busy = m * min(work)
    if plan.schedule in ZERO_BUBBLE_SCHEDULES:
        if options.optimizer_post_validation:
            return m * busiest, busy
        return max(f + m * w for f, w in zip(fill, work, strict=True)), busy
    return m * busiest + (sum(work) - busiest) / plan.virtual_stages, busy


#: Schedules whose orders overlap two ops' communication with their compute (DualPipe's
#: F&B pairs, `simulator.step.zero_bubble.step_times`): their all-to-all need not show.
OVERLAPPED_PAIR_SCHEDULES = ("dualpipe-v",)


def _with_moe_a2a(model: ModelSpec, plan: Plan, cluster: Cluster, options: SimOptions,
                  work: list[float], dev_work: list[float]) -> list[float]:
    # C_r raised by the MoE all-to-all: a chunk's pass takes at least its device time plus
    # its blocks' exposed all-to-all (`_chunk_times`: exposed comm ≥ device + layers × per-
    # block comm − the pass, every other comm term ≥ 0), so rank r's micro-batch takes at
    # least D_r + n_r·(a_f + a_b): D_r its chunks' device time, n_r its MoE blocks, a_f /
    # a_b one block's exposed all-to-all (`simulator.step.moe.block_a2a_exposed_s`).
    eff, dev, _, _ = _compute_setup(model, plan, cluster, options)
    layout, chunks = stage_layout(model, plan), plan.layers_per_stage(model)
    out = []
    for r, (w, d) in enumerate(zip(work, dev_work, strict=True)):
        n_moe = layout[r][4]
        if n_moe:
            # the least recomputed share of the rank's chunks keeps this a lower bound
            full = min((plan.full_recompute_share(chunks[c]) for c in layout[r][2]),
                       default=1.0)
            a_f, a_b = block_a2a_exposed_s(
                model, plan, cluster, r, options.attention, dev, eff,
                imbalance=options.moe_imbalance, dispatcher=options.moe_dispatcher,
                overlap=options.moe_a2a_overlap, cp_attention=options.cp_attention,
                full_share=full)
            w = max(w, d + n_moe * (a_f + a_b))
        out.append(w)
    return out


def _bound_terms(model: ModelSpec, plan: Plan, cluster: Cluster,
                 options: SimOptions) -> tuple[list[float], list[float], list[float]]:
    # (s_r, C_r, D_r) of `compute_lower_bounds_s` per pipeline rank (D_r: the device
    # time of C_r, without the host-bound excess, for `_with_moe_a2a`). They depend on the plan
    # through its block fields (`simulator.step.moe._BLOCK_FIELDS`), recomputation and chunk
    # layout alone, not on dp, the micro-batch count, ZeRO or the placement: with the cost
    # memo on, memoised on the cluster per (model, options) object (kept with the entry).
    if not memo_enabled():
        return _fresh_bound_terms(model, plan, cluster, options)
    key = (id(model), id(options), plan.micro_batch, plan.tp, plan.sequence_parallel,
           plan.dtype, plan.cp, plan.ep, plan.etp, plan.recompute, plan.recompute_num_layers,
           plan.pp, plan.virtual_stages, plan.schedule, plan.stage_layers)
    return identity_memo(cluster._links.setdefault("bounds", {}), key, (model, options),
                         lambda: _fresh_bound_terms(model, plan, cluster, options))


def _fresh_bound_terms(model: ModelSpec, plan: Plan, cluster: Cluster,
                       options: SimOptions) -> tuple[list[float], list[float], list[float]]:
    eff, dev, lc, host_re = _compute_setup(model, plan, cluster, options)
    chunks = plan.layers_per_stage(model)
    pp, work, seen = plan.pp, [0.0] * plan.pp, {}
    dev_work = [0.0] * pp
    fill, forwards = [0.0] * pp, 0.0  # forwards: Σ F_g over the chunks before g
    by_index = model.is_moe or model.is_mla
    for g, layers in enumerate(chunks):
        first, last = g == 0, g == len(chunks) - 1
        key = (layers, first, last, g if by_index else -1)
        if key not in seen:
            edge = edge_compute(model, plan.micro_batch, plan.tp, plan.dtype, dev, eff,
                                first=first, last=last, cp=plan.cp)
            lc_g = chunk_compute(model, plan, g, options.attention, dev, eff,
                                 options.moe_imbalance, options.cp_attention)[0] \
                if by_index else lc
            fwd, bwd, dev_f, dev_b = _chunk_compute(plan, layers, lc_g, edge, host_re)
            seen[key] = (fwd, fwd + bwd, dev_f + dev_b)
        if g < pp:
            fill[g] = forwards
        forwards += seen[key][0]
        work[chunk_rank(plan.schedule, pp, g)] += seen[key][1]
        dev_work[chunk_rank(plan.schedule, pp, g)] += seen[key][2]
    return fill, work, dev_work


def weight_cast_s(model: ModelSpec, plan: Plan, layers: int, device, bandwidth: float) -> float:
    """Seconds a low-precision recipe spends once per step casting one rank's linear weights
    (``layers`` blocks, 1/tp of each; `planner.precision.cast_bytes` with its copies) after
    the optimizer step, cached for every micro-batch; 0 for bf16.

    >>> from planner.presets import load_model
    >>> from simulator.network.hardware import load_device
    >>> p = Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="fp8")
    >>> m = load_model("llama3-8b")
    >>> w = m.layer_matmul_params()  # read 2 B, write the weight and its transpose: 4 B
    >>> weight_cast_s(m, p, 1, load_device("h100-sxm-80gb"), 1e12) == w * 4 / 1e12
    True
    """
    r = recipe(plan.dtype)
    if r is None:
        return 0.0
    copies = cast_copies(r, block_scaled_device(device.peak_flops))
    return cast_bytes(r, model.layer_matmul_params() / plan.tp * layers, copies) / bandwidth


def amax_allreduce_s(plan: Plan, cluster: Cluster, rank: int,
                     layers: int) -> tuple[float, float]:
    """(forward, backward) seconds of a delayed-scaling recipe's amax all-reduce for one
    micro-batch of a chunk of ``layers`` blocks; (0, 0) for every other dtype.

    Transformer Engine reduces the amaxes of all FP8 tensors of a forward in one all-reduce
    when ``fp8_autocast`` exits, and those of the backward in one more, over the amax
    reduction group (Megatron-Core: the tp·dp·cp ranks that hold the same layers); 4 bytes
    per tensor: the input and weight of each linear forward, its output gradient backward.
    The group is costed as its tp and dp·cp groups in turn (latency-bound).
    """
    r = recipe(plan.dtype)
    if r is None or not r.amax_allreduce:
        return 0.0, 0.0

    def reduce(nbytes: float) -> float:
        return sum(collective_time_s(cluster, "all_reduce", nbytes,
                                     group_ranks(plan, axis, stage=rank))
                   for axis, n in (("tp", plan.tp), ("dp_cp", plan.dp_cp)) if n > 1)

    tensors = len(LINEAR_GEMMS) * layers
    return reduce(2 * 4 * tensors), reduce(4 * tensors)


def stage_costs(model: ModelSpec, plan: Plan, cluster: Cluster,
                options: SimOptions = DEFAULT_OPTIONS) -> list[StageCosts]:
    """`StageCosts` of every virtual pipeline stage, one representative rank each.

    Entry g = chunk·pp + rank (pp·virtual_stages entries, pipeline order; just the pp stages
    when virtual_stages = 1) runs on pipeline rank g % pp (`planner.mesh.chunk_rank`: ZB-V and
    DualPipe-V fold the chunks in a V). Zero-bubble schedules get each chunk's weight-gradient
    time (`simulator.step.zero_bubble.split_backward`). Each rank's once-per-step DP and
    optimizer costs sit on its first chunk's entry (g < pp; zero elsewhere): chunk 0 runs the
    rank's last backward, the one DP buckets overlap with. A micro-batch of a chunk takes
    max(device time, host launch time) (`simulator.step.compute`).

    Raises:
        PlanError: the plan does not fit the model (`check_plan`) or needs more devices than
            the cluster has.
    """
    check_plan(model, plan)
    check_cluster(plan, cluster)
    if cluster.cpu_profile is not None:  # calibrated CPU (cp plans: the measured ring)
        calibrated = cpu_stage_costs(model, plan, cluster)
        if calibrated is not None:
            return _with_wgrad(calibrated, model, plan, cluster, options)
    eff, dev, lc, host_re = _compute_setup(model, plan, cluster, options)
    bandwidth = dev.memory_bandwidth_Bps * eff.memory_fraction
    act_bytes = plan.micro_batch * model.seq_len // plan.cp * model.hidden \
        * DTYPE_BYTES[plan.dtype]
    # Megatron's scatter-gather P2P sends 1/tp of the activation per TP rank; the all-gather
    # inside the node is not counted.
    p2p_bytes = act_bytes / plan.tp if options.p2p_scatter_gather else act_bytes
    pp, stride = plan.pp, mesh_strides(plan)["pp"]
    chunks = plan.layers_per_stage(model)
    # Chunks of one plan differ only by their layers, their edges (embedding, logits) and,
    # with cp > 1, the devices of their CP ring (MoE and MLA chunks also by their index):
    # the TP, ZeRO-3 and DP groups are concurrent ranges, costed by stride and size alone
    # (`simulator.network.collectives`). So equal chunks, equal DP tails and equal entries
    # are costed once (unless the cost memo is off).
    memo: dict | None = {} if memo_enabled() else None
    by_index = model.is_moe or model.is_mla
    held = [0] * pp  # blocks each rank holds (all its chunks)
    for g, layers in enumerate(chunks):
        held[chunk_rank(plan.schedule, pp, g)] += layers
    splits = None if model.is_moe else stage_param_splits(model, plan)
    out = []
    for g, layers in enumerate(chunks):
        rank = chunk_rank(plan.schedule, pp, g)
        first, last = g == 0, g == len(chunks) - 1
        key = (layers, first, last, rank if plan.cp > 1 else -1, g if by_index else -1)
        times = None if memo is None else memo.get(key)
        if times is None:
            times = _chunk_entry(model, plan, cluster, options, g, rank, layers, lc, dev, eff,
                                 host_re)
            if memo is not None:
                memo[key] = times
        fwd, bwd, fwd_comm, bwd_comm, hide_f, hide_b, alone_f, alone_b = times
        src = rank * stride
        nxt = chunk_rank(plan.schedule, pp, min(g + 1, len(chunks) - 1)) * stride
        prv = chunk_rank(plan.schedule, pp, max(g - 1, 0)) * stride
        tail = _tail(model, plan, cluster, rank, bandwidth, options, (
            splits[rank] if splits else stage_param_split(model, plan, rank), held[rank]),
            dev, fwd, memo) if g < pp else {}
        extra = options.p2p_overhead_s
        p2p_f = boundary_send_time_s(cluster, p2p_bytes, src, nxt, pp_stride=stride, pp=pp) \
            + extra if g < len(chunks) - 1 else 0.0
        p2p_b = boundary_send_time_s(cluster, p2p_bytes, src, prv, pp_stride=stride, pp=pp) \
            + extra if g > 0 else 0.0
        block_f, block_b = (p2p_f, p2p_b) if options.blocking_p2p else (0.0, 0.0)
        fields = (fwd, bwd, fwd_comm + block_f, bwd_comm + block_b, p2p_f - block_f,
                  p2p_b - block_b, hide_f, hide_b, alone_f, alone_b)
        entry = None if tail or memo is None else memo.get(fields)  # equal entries: one object
        if entry is None:
            entry = StageCosts(fwd_compute_s=fields[0], bwd_compute_s=fields[1],
                               fwd_comm_s=fields[2], bwd_comm_s=fields[3],
                               p2p_fwd_s=fields[4], p2p_bwd_s=fields[5],
                               fwd_overlap_s=fields[6], bwd_overlap_s=fields[7],
                               fwd_unpaired_s=fields[8], bwd_unpaired_s=fields[9], **tail)
            if not tail and memo is not None:
                memo[fields] = entry
        out.append(entry)
    return _with_wgrad(out, model, plan, cluster, options)


def _chunk_entry(model: ModelSpec, plan: Plan, cluster: Cluster, options: SimOptions, g: int,
                 rank: int, layers: int, lc: LayerCompute, dev, eff: Efficiency,
                 host_re: float) -> tuple[float, ...]:
    # `_chunk_times` of chunk g, with its edges and, for MoE / MLA, its own block costs; then
    # the exposed communication a forward and a backward add when they run unpaired
    # (`StageCosts.fwd_unpaired_s`): the chunk's all-to-alls without the overlap.
    edge = edge_compute(model, plan.micro_batch, plan.tp, plan.dtype, dev, eff, first=g == 0,
                        last=g == plan.pp * plan.virtual_stages - 1, cp=plan.cp)
    if not (model.is_moe or model.is_mla):
        return _chunk_times(model, plan, cluster, options, rank, layers, lc, edge,
                            host_re) + (0.0, 0.0)

    def times(overlap: bool) -> tuple[float, ...]:
        lc_g, *moe_comm = chunk_moe_terms(
            model, plan, cluster, g, rank, options.attention, dev, eff,
            imbalance=options.moe_imbalance, dispatcher=options.moe_dispatcher,
            overlap=overlap, cp_attention=options.cp_attention,
            recompute_modules=options.recompute_modules)
        return _chunk_times(model, plan, cluster, options, rank, layers, lc_g, edge, host_re,
                            tuple(moe_comm))

    paired = times(options.moe_a2a_overlap)
    if not options.moe_a2a_overlap:
        return paired + (0.0, 0.0)
    alone = times(False)
    return paired + (max(0.0, alone[2] - paired[2]), max(0.0, alone[3] - paired[3]))


def _tail(model: ModelSpec, plan: Plan, cluster: Cluster, rank: int, bandwidth: float,
          options: SimOptions, holds: tuple[tuple[float, float], int], dev, fwd: float,
          memo: dict | None) -> dict:
    # A rank's once-per-step DP reduction, weight gather, optimizer and weight casts
    # (`_dp_and_optimizer`, `weight_cast_s`); ``holds``: its (dense, expert) parameters and
    # blocks. Its DP and expert-DP groups are concurrent groups of one shape for every
    # rank, so ranks with equal parameters, blocks and forward time have equal tails.
    held = holds[1]
    key = ("tail", holds, fwd)
    if memo is not None and key in memo:
        return dict(memo[key])
    tail = _dp_and_optimizer(model, plan, cluster, rank, bandwidth, options)
    tail["optimizer_s"] += weight_cast_s(model, plan, held, dev, bandwidth)
    if options.overlap_param_gather:
        tail["dp_gather_s"] = max(0.0, tail["dp_gather_s"] - fwd)
    if zero3_once_per_step(plan, options):
        # The weights are gathered in the first micro-batch's forward, block by block under
        # the chunks' forwards (the first block's under nothing), and the gradients reduced
        # once after the last backward, in buckets beside it like ZeRO-1/2.
        g, gs = _zero3_layer_comm(model, plan, cluster, rank, options)
        tail["dp_comm_s"] += held * (gs - g)
        tail["dp_gather_s"] += max(g, held * g - plan.virtual_stages * fwd)
    if memo is not None:
        memo[key] = dict(tail)
    return tail


def _with_wgrad(costs: list[StageCosts], model: ModelSpec, plan: Plan, cluster: Cluster,
                options: SimOptions) -> list[StageCosts]:
    # Zero-bubble schedules run the weight gradients apart: give each chunk its W time.
    if plan.schedule not in ZERO_BUBBLE_SCHEDULES:
        return costs
    return split_backward(costs, model, plan, options.attention, _device(cluster),
                          _efficiency(cluster, options), options.cp_attention)

"""Per-stage costs of one micro-batch: compute, TP collectives, P2P, DP and optimizer times.

Compute comes op by op from `simulator.step.compute` (GEMMs at a shape-dependent efficiency,
memory-bound ops at achievable bandwidth, host launch time). TP: two all-reduces of the T·h
activation per layer in forward and two in backward (Shoeybi et al. 2019, §3); with sequence
parallelism each becomes a reduce-scatter + all-gather pair (Korthikanti et al. 2022, §4.2.2).
Full recomputation repeats the forward, its TP collectives included, before the backward;
selective repeats the attention core only (Korthikanti et al. 2022, §5). ZeRO-3 / FSDP gathers
each layer's weights before its forward and again before its backward and reduce-scatters its
gradients after, every micro-batch, overlapped with the layer's compute (Rajbhandari et al.
2020, §5.3; PyTorch FSDP prefetching). Context parallelism (cp > 1) gives each rank b·s/cp
tokens; attention passes the key/value blocks round the cp ring, cp − 1 sends per layer
forward and, with their gradients, twice the bytes backward, each overlapped with the block
attention it feeds (Liu et al. 2023, "Ring Attention", §3); gradients reduce over dp·cp.
"""

from __future__ import annotations

import math

from planner.mesh import group_ranks, mesh_strides
from planner.spec import DTYPE_BYTES, ModelSpec, Plan, PlanError, check_plan
from simulator.network.cluster import Cluster
from simulator.network.collectives import (
    boundary_send_time_s,
    collective_time_s,
    memo_enabled,
    p2p_time_on_cluster_s,
)
from simulator.step.compute import (
    Efficiency,
    LayerCompute,
    edge_compute,
    layer_compute,
    load_efficiency,
)
from simulator.step.cpu_model import cpu_stage_costs
from simulator.step.memory import optimizer_bytes_per_param, params_per_stage, stage_params
from simulator.step.stagecosts import DEFAULT_OPTIONS, SimOptions, StageCosts


def _efficiency(cluster: Cluster, options: SimOptions) -> Efficiency:
    eff = options.efficiency or load_efficiency(cluster.device.name)
    if eff.host_op_s == 0 and eff.gemm_half_flops == 0 and eff.num_sms == 1:
        # Generic device (CPU core): the device profile's flat efficiencies.
        dev = cluster.device
        eff = Efficiency(gemm_max_fraction=dev.matmul_efficiency, gemm_half_flops=0.0,
                         num_sms=1, memory_fraction=dev.memory_efficiency, kernel_s=0.0,
                         host_op_s=0.0, flash_fraction=1.0)
    return eff


def _device(cluster: Cluster):
    dev = cluster.device
    if cluster.compute_share == 1.0:
        return dev
    share = cluster.compute_share
    return dev.replace(peak_flops={k: v * share for k, v in dev.peak_flops.items()},
                       memory_bandwidth_Bps=dev.memory_bandwidth_Bps * share)


def _tp_layer_comm(model: ModelSpec, plan: Plan, cluster: Cluster, rank: int) -> float:
    # One TP collective pair's worth per layer direction: 2 all-reduces of T·h, or with SP
    # 2 × (reduce-scatter + all-gather).
    if plan.tp == 1:
        return 0.0
    act = plan.micro_batch * model.seq_len // plan.cp * model.hidden * DTYPE_BYTES[plan.dtype]
    group = group_ranks(plan, "tp", stage=rank)
    if plan.sequence_parallel:
        one = (collective_time_s(cluster, "reduce_scatter", act, group)
               + collective_time_s(cluster, "all_gather", act, group))
    else:
        one = collective_time_s(cluster, "all_reduce", act, group)
    return 2 * one


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
    shard = plan.dp_cp
    if plan.zero_stage != 3 or shard == 1:
        return 0.0, 0.0
    d = DTYPE_BYTES[plan.dtype]
    nbytes = model.layer_params() / plan.tp * d
    gbytes = model.layer_params() / plan.tp * (options.grad_reduce_bytes
                                               or (4 if plan.dtype == "bf16" else d))
    group = group_ranks(plan, "dp_cp", stage=rank)
    gather = collective_time_s(cluster, "all_gather", nbytes, group)
    scatter = collective_time_s(cluster, "reduce_scatter", gbytes, group)
    if options.zero3_unaggregated and plan.world_size > cluster.devices_per_node:
        gather = max(gather, _unaggregated_s(cluster, nbytes, shard))
        scatter = max(scatter, _unaggregated_s(cluster, gbytes, shard))
    return gather, gather + scatter


def _dp_and_optimizer(model: ModelSpec, plan: Plan, cluster: Cluster, stage: int,
                      bandwidth: float, options: SimOptions,
                      params: float | None = None) -> dict[str, float]:
    # ZeRO 1/2 (distributed optimizer): reduce-scatter gradients, all-gather the updated
    # 16-bit weights. ZeRO-3 reduces per layer (`_zero3_layer_comm`). ``params``: the
    # stage's `stage_params` when the caller has it.
    params = stage_params(model, plan, stage) if params is None else params
    d = DTYPE_BYTES[plan.dtype]
    g = options.grad_reduce_bytes or (4 if plan.dtype == "bf16" else d)
    grads = params * g
    group = group_ranks(plan, "dp_cp", stage=stage)
    if plan.zero_stage == 0:
        reduce, gather = collective_time_s(cluster, "all_reduce", grads, group), 0.0
    elif plan.zero_stage == 3:
        reduce = gather = 0.0
    else:
        reduce = collective_time_s(cluster, "reduce_scatter", grads, group)
        gather = collective_time_s(cluster, "all_gather", params * d, group)
    # Adam: read gradients, read/write master weights and both moments, write weights.
    per_param = g + 2 * optimizer_bytes_per_param(plan.dtype) + (d if d < 4 else 0)
    shard = plan.dp_cp if plan.zero_stage >= 1 else 1
    bucket = options.dp_bucket_bytes
    return {"dp_comm_s": reduce, "dp_gather_s": gather,
            "dp_buckets": max(1, math.ceil(grads / bucket)) if bucket else 1,
            "optimizer_s": params / shard * per_param / bandwidth}


def check_cluster(plan: Plan, cluster: Cluster) -> None:
    """Raise `PlanError` with the arithmetic when the plan needs more devices than exist."""
    if plan.world_size > cluster.num_devices:
        raise PlanError(
            f"{plan.degrees} > "
            f"devices({cluster.num_devices}) of cluster {cluster.name!r} "
            f"({cluster.num_nodes} nodes x {cluster.devices_per_node})")


def _chunk_times(model: ModelSpec, plan: Plan, cluster: Cluster, options: SimOptions,
                 rank: int, layers: int, lc: LayerCompute, edge: tuple[float, float, float],
                 host_re: float) -> tuple[float, float, float, float]:
    # (fwd compute, bwd compute, fwd exposed comm, bwd exposed comm) of one micro-batch of a
    # chunk of ``layers`` blocks on pipeline rank ``rank``.
    recompute = {"full": lc.fwd_s, "none": 0.0, "selective": lc.attn_core_fwd_s}[plan.recompute]
    tp_comm = _tp_layer_comm(model, plan, cluster, rank)
    z_fwd, z_bwd = _zero3_layer_comm(model, plan, cluster, rank, options)
    fwd_dev, bwd_dev = lc.fwd_s, lc.bwd_s + recompute
    fwd_comm = tp_comm
    bwd_comm = tp_comm * (2 if plan.recompute == "full" else 1)
    if options.tp_comm_overlap:
        fwd_comm, bwd_comm = max(0.0, fwd_comm - fwd_dev), max(0.0, bwd_comm - bwd_dev)
    # The CP ring hides under the block attention it feeds: only the excess shows.
    ring_f, ring_b = cp_ring_comm(model, plan, cluster, rank)
    core_b = lc.attn_core_fwd_s * (2.5 if options.attention != "unfused" else 2.0)
    cp_f = max(0.0, ring_f - lc.attn_core_fwd_s)
    fwd_comm += cp_f
    bwd_comm += max(0.0, ring_b - core_b) + (cp_f if plan.recompute == "full" else 0.0)
    # ZeRO-3 traffic is prefetched on its own stream: only what outlasts compute shows, and
    # only the prefetched share of a layer's gather can hide (`SimOptions`). On a CPU
    # cluster (gloo) the collectives run on the cores that compute: nothing overlaps.
    if cluster.collective_bandwidth_Bps is None:
        ahead = 1.0
        if options.zero3_prefetch_params is not None and z_fwd > 0:
            layer = model.layer_params() / plan.tp
            ahead = min(1.0, options.zero3_prefetch_params / layer)
        scatter = z_bwd - z_fwd
        hidden_b = ahead * z_fwd + (scatter if options.zero3_overlap_reduce else 0.0)
        fwd_comm += (1 - ahead) * z_fwd + max(0.0, ahead * z_fwd - fwd_dev - fwd_comm)
        bwd_comm += (z_bwd - hidden_b) + max(0.0, hidden_b - bwd_dev - bwd_comm)
    else:
        fwd_comm, bwd_comm = fwd_comm + z_fwd, bwd_comm + z_bwd
    # Host-bound: the device idles between launches and in-stream collectives fill the gaps,
    # so only device + comm beyond the host time is exposed communication.
    fwd, bwd, dev_f, dev_b = _chunk_compute(plan, layers, lc, edge, host_re)
    return (fwd, bwd, max(0.0, dev_f + layers * fwd_comm - fwd),
            max(0.0, dev_b + layers * bwd_comm - bwd))


def _chunk_compute(plan: Plan, layers: int, lc: LayerCompute, edge: tuple[float, float, float],
                   host_re: float) -> tuple[float, float, float, float]:
    # (fwd, bwd, fwd device, bwd device) seconds of one micro-batch of a chunk: a pass takes
    # max(device time, host launch time).
    e_fwd, e_bwd, e_host = edge
    recompute = {"full": lc.fwd_s, "none": 0.0, "selective": lc.attn_core_fwd_s}[plan.recompute]
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
                       options.attention, plan.dtype, dev, eff, plan.cp)
    host_re = {"full": lc.host_fwd_s, "none": 0.0,
               "selective": eff.host_op_s * 4}[plan.recompute]
    return eff, dev, lc, host_re


def step_lower_bound_s(model: ModelSpec, plan: Plan, cluster: Cluster,
                       options: SimOptions = DEFAULT_OPTIONS) -> float:
    """A compute-only lower bound of the closed-form step time
    (`simulator.step.pipeline.estimate_pipeline` over `stage_costs`), in seconds.

    With C_r = the forward + backward compute of one micro-batch on pipeline rank r (its
    chunks summed, no communication): ``m·max_r C_r + (Σ_r C_r − max_r C_r)/v``. The closed
    form is the same expression over C_r plus each chunk's exposed communication, plus P2P
    and the DP / optimizer tail, all ≥ 0; the expression grows with every C_r (its slope is
    m − 1/v + 1/v ≥ 0 in the largest and 1/v in the others), so it is never above the step.
    0 on a calibrated CPU cluster (its costs come from measured tables, not this model).

    Raises:
        PlanError: as `stage_costs`.
    """
    check_plan(model, plan)
    check_cluster(plan, cluster)
    if cluster.cpu_profile is not None and plan.cp == 1:
        return 0.0
    eff, dev, lc, host_re = _compute_setup(model, plan, cluster, options)
    chunks = plan.layers_per_stage(model)
    pp, work, seen = plan.pp, [0.0] * plan.pp, {}
    for g, layers in enumerate(chunks):
        first, last = g == 0, g == len(chunks) - 1
        key = (layers, first, last)
        if key not in seen:
            edge = edge_compute(model, plan.micro_batch, plan.tp, plan.dtype, dev, eff,
                                first=first, last=last, cp=plan.cp)
            fwd, bwd, _, _ = _chunk_compute(plan, layers, lc, edge, host_re)
            seen[key] = fwd + bwd
        work[g % pp] += seen[key]
    busiest = max(work)
    return plan.num_microbatches * busiest + (sum(work) - busiest) / plan.virtual_stages


def stage_costs(model: ModelSpec, plan: Plan, cluster: Cluster,
                options: SimOptions = DEFAULT_OPTIONS) -> list[StageCosts]:
    """`StageCosts` of every virtual pipeline stage, one representative rank each.

    Entry g = chunk·pp + rank (pp·virtual_stages entries, pipeline order; just the pp stages
    when virtual_stages = 1) runs on pipeline rank g % pp. Each rank's once-per-step DP and
    optimizer costs sit on its first chunk's entry (g < pp; zero elsewhere): chunk 0 runs the
    rank's last backward, the one DP buckets overlap with. A micro-batch of a chunk takes
    max(device time, host launch time) (`simulator.step.compute`).

    Raises:
        PlanError: the plan does not fit the model (`check_plan`) or needs more devices than
            the cluster has.
    """
    check_plan(model, plan)
    check_cluster(plan, cluster)
    if cluster.cpu_profile is not None and plan.cp == 1:  # calibrated CPU
        calibrated = cpu_stage_costs(model, plan, cluster)
        if calibrated is not None:
            return calibrated
    eff, dev, lc, host_re = _compute_setup(model, plan, cluster, options)
    bandwidth = dev.memory_bandwidth_Bps * eff.memory_fraction
    act_bytes = plan.micro_batch * model.seq_len // plan.cp * model.hidden \
        * DTYPE_BYTES[plan.dtype]
    # Megatron's scatter-gather P2P sends 1/tp of the activation per TP rank; the all-gather
    # inside the node is not counted.
    p2p_bytes = act_bytes / plan.tp if options.p2p_scatter_gather else act_bytes
    pp, stride = plan.pp, mesh_strides(plan)["pp"]
    chunks = plan.layers_per_stage(model)
    params = params_per_stage(model, plan)
    # Chunks of one plan differ only by their layers, their edges (embedding, logits) and,
    # with cp > 1, the devices of their CP ring: the TP and ZeRO-3 groups are concurrent
    # ranges, costed by stride and size alone (`simulator.network.collectives`). So equal
    # chunks are costed once (unless the cost memo is off), and so are equal DP tails.
    memo: dict | None = {} if memo_enabled() else None
    out = []
    for g, layers in enumerate(chunks):
        rank = g % pp
        first, last = g == 0, g == len(chunks) - 1
        key = (layers, first, last, rank if plan.cp > 1 else -1)
        times = None if memo is None else memo.get(key)
        if times is None:
            edge = edge_compute(model, plan.micro_batch, plan.tp, plan.dtype, dev, eff,
                                first=first, last=last, cp=plan.cp)
            times = _chunk_times(model, plan, cluster, options, rank, layers, lc, edge, host_re)
            if memo is not None:
                memo[key] = times
        fwd, bwd, fwd_comm, bwd_comm = times
        tail = _tail(model, plan, cluster, rank, bandwidth, options, params[rank], fwd, memo) \
            if g < pp else {}
        extra = options.p2p_overhead_s
        src = rank * stride
        nxt, prv = ((rank + 1) % pp) * stride, ((rank - 1) % pp) * stride
        p2p_f = boundary_send_time_s(cluster, p2p_bytes, src, nxt, pp_stride=stride, pp=pp) \
            + extra if g < len(chunks) - 1 else 0.0
        p2p_b = boundary_send_time_s(cluster, p2p_bytes, src, prv, pp_stride=stride, pp=pp) \
            + extra if g > 0 else 0.0
        block_f, block_b = (p2p_f, p2p_b) if options.blocking_p2p else (0.0, 0.0)
        fields = (fwd, bwd, fwd_comm + block_f, bwd_comm + block_b, p2p_f - block_f,
                  p2p_b - block_b)
        entry = None if tail or memo is None else memo.get(fields)  # equal entries: one object
        if entry is None:
            entry = StageCosts(fwd_compute_s=fields[0], bwd_compute_s=fields[1],
                               fwd_comm_s=fields[2], bwd_comm_s=fields[3],
                               p2p_fwd_s=fields[4], p2p_bwd_s=fields[5], **tail)
            if not tail and memo is not None:
                memo[fields] = entry
        out.append(entry)
    return out


def _tail(model: ModelSpec, plan: Plan, cluster: Cluster, rank: int, bandwidth: float,
          options: SimOptions, params: float, fwd: float, memo: dict | None) -> dict:
    # A rank's once-per-step DP reduction, weight gather and optimizer (`_dp_and_optimizer`);
    # the DP group of every rank is a concurrent range of one stride and size, so ranks with
    # equal parameters have equal tails.
    key = ("tail", params, fwd)
    if memo is not None and key in memo:
        return dict(memo[key])
    tail = _dp_and_optimizer(model, plan, cluster, rank, bandwidth, options, params)
    if options.overlap_param_gather:
        tail["dp_gather_s"] = max(0.0, tail["dp_gather_s"] - fwd)
    if memo is not None:
        memo[key] = dict(tail)
    return tail

"""Cost terms of the localhost-cpu path, from a calibrated profile (`runtime.calibrate.calibrate`).

On a CPU every rank is a Python process with one torch thread, so a step's time is not a sum of
FLOPs over peak: eager framework overhead per op (module calls, autograd nodes, DTensor
dispatch under TP), ranks that outnumber the cores time-sharing them, gloo running its
reductions on the same cores, the optimizer and the once-per-step loss all-gather all matter.
None of it is a fudge factor; every term below is a microbenchmark `meshplan calibrate` ran:

==========================  ==================================================================
term                        measured as
==========================  ==================================================================
layer fwd / bwd             the runtime's own model with 3 layers minus 1 layer (halved), fwd and
                            backward timed apart, at several micro-batch sizes (piecewise linear
                            in tokens), with k processes computing at once (k = 1, 2, 4 here)
layer bwd, recompute full   the same under ``checkpoint_wrapper`` (forward replayed)
layer fwd / bwd, selective  the same under the runtime's selective policy (GEMM and attention
                            outputs kept, the rest replayed in backward; the forward pays the
                            checkpoint's dispatch mode), locally and under TP
edges (embedding, head)     1-layer model minus one layer; embedding timed alone
optimizer                   AdamW step on the 1- and 3-layer models' parameters
TP layer / edges            the same two models under DTensor TP (``runtime.parallel.tp``) in a
                            gloo group of tp ranks, all world ranks busy: comm + dispatch
TP + SP layer / edges       the same with sequence parallelism (reduce-scatter + all-gather),
                            also under selective recomputation
CP layer / edges            the same two models under context parallelism
                            (``runtime.parallel.cp``) in a gloo group of cp ranks, all world
                            ranks busy, each on its seq_len/cp tokens: the key/value ring of
                            ``runtime.ring_attention`` on the tiled kernel of
                            ``runtime.attention``, not SDPA (keyed by the micro-batch's whole
                            b·s tokens, as the other terms)
collectives, send/recv      gloo all-reduce, reduce-scatter, all-gather at 4 KiB - 16 MiB per
                            (world size, group size): the measured points (`at_size`), and
                            an alpha-beta fit for the preset-format ``collective`` section
pipeline action             one forward or backward of torch.distributed.pipelining on
                            trivial stages (schedule bookkeeping + send/recv latency), of
                            ``Schedule1F1B`` and of ``ScheduleInterleaved1F1B`` (2 chunks per
                            rank); an interleaved rank pays it 2·v times per micro-batch
ZeRO-3 layer / edges        the 1- and 3-layer models under FSDP2 over all ranks
TP x DP layer / edges       the same under TP groups of 2 and FSDP2 across them
==========================  ==================================================================

Ranks that share cores run at the speed measured with as many processes computing at once as
the plan keeps busy on average: R ranks, or R·m·v/(m·v + pp − 1) in a pipeline (v chunks per
rank) whose ranks idle in the bubble (processor sharing; the per-rank time is interpolated
between measured counts).

Composed rather than measured as such: selective recomputation under ZeRO-3 over all ranks
and under TP x DP adds the selective minus plain layer times measured without FSDP (locally,
or under TP) to the FSDP layer times (FSDP's gathers run in hooks outside the checkpointed
block, so replaying it adds compute only); SP x DP is the TP + SP layer plus FSDP2's modelled
gathers and reduce-scatters (as TP x DP with several micro-batches). Not covered (the caller's
generic model): shapes or TP degrees not calibrated, and profiles written before a term
existed.

The k processes start every timed iteration together (a barrier) and the slowest one's time
is kept: a synchronous step waits for its last rank, and with more processes than cores the
last one finishes measurably later than the average (4 on 2 cores: about 5%).
"""

from __future__ import annotations

import itertools
import math

from planner.spec import ModelSpec, Plan
from simulator.network.cpu_profile import CpuProfile, shape_key
from simulator.step.memory import chunk_params
from simulator.step.stagecosts import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, StageCosts


def at_tokens(points: dict, tokens: float) -> float:
    """Seconds at ``tokens`` from measured ``{tokens: seconds}``: piecewise linear between the
    points, linear beyond the ends (through the two nearest points), never below zero.

    >>> at_tokens({128: 0.01, 256: 0.02, 1024: 0.06}, 512)
    0.03333333333333333
    >>> at_tokens({128: 0.01, 256: 0.02}, 64)
    0.005
    """
    pts = sorted((int(t), float(v)) for t, v in points.items())
    if len(pts) == 1:
        return pts[0][1] * tokens / pts[0][0]
    if tokens <= pts[0][0]:
        (t0, v0), (t1, v1) = pts[0], pts[1]
    elif tokens >= pts[-1][0]:
        (t0, v0), (t1, v1) = pts[-2], pts[-1]
    else:
        (t0, v0), (t1, v1) = next((a, b) for a, b in itertools.pairwise(pts) if tokens <= b[0])
    return max(0.0, v0 + (v1 - v0) * (tokens - t0) / (t1 - t0))


def interpolate(levels: dict[float, float], x: float) -> float:
    """Piecewise-linear interpolation of ``{level: value}`` at ``x`` (clamped at the ends).

    >>> interpolate({1: 1.0, 2: 1.2, 4: 2.4}, 3)
    1.7999999999999998
    """
    keys = sorted(levels)
    if x <= keys[0]:
        return levels[keys[0]]
    for lo, hi in itertools.pairwise(keys):
        if x <= hi:
            w = (x - lo) / (hi - lo)
            return (1 - w) * levels[lo] + w * levels[hi]
    return levels[keys[-1]]


def active_ranks(plan: Plan) -> float:
    """Ranks computing at once on average: all of them, or in a pipeline the busy share
    m·v / (m·v + pp − 1) of each rank's step: 1F1B and GPipe idle (pp − 1) micro-batch
    times, interleaved 1F1B with v chunks per rank (pp − 1) chunk times, a v-th of that
    (Narayanan et al. 2021, §2.2.2).

    >>> active_ranks(Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=8, dtype="fp32"))
    2.909090909090909
    >>> active_ranks(Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=8, dtype="fp32",
    ...                   schedule="interleaved-1f1b", virtual_stages=2))
    1.8823529411764706
    """
    m, pp, v = plan.num_microbatches, plan.pp, plan.virtual_stages
    return plan.world_size * (m * v / (m * v + pp - 1) if pp > 1 else 1.0)


#: Per-micro-batch terms interpolated in tokens and in active ranks.
LAYER_TERMS = ("layer_fwd", "layer_bwd", "layer_bwd_full", "edge_fwd", "edge_bwd")
#: The layer under the runtime's selective recomputation policy.
SELECTIVE_TERMS = ("layer_fwd_selective", "layer_bwd_selective")


def _at(levels: dict, name: str, tokens: float, active: float) -> float:
    # a {tokens: s} term at the plan's tokens, interpolated between measured process counts
    return interpolate({k: at_tokens(v[name], tokens) for k, v in levels.items()}, active)


def _has(levels: dict, names: tuple[str, ...]) -> bool:
    return all(name in v for v in levels.values() for name in names)


def _levels(entry: dict, plan: Plan) -> tuple[dict, bool] | None:
    # ({active ranks: terms}, measured under FSDP2) for the plan's parallelism, or None
    if plan.cp > 1:
        # the ring on the tiled kernel, measured without TP and without DP: DDP over dp·cp
        # (`_rank_tail`) or FSDP2's modelled traffic (`_fsdp_comm`) is added, as for SP x DP
        cp = entry.get("cp", {}).get(f"cp{plan.cp}")
        if not cp or plan.tp > 1:
            return None
        return {int(w): v for w, v in cp.items()}, False
    zero3 = entry.get("zero3", {}).get(f"dp{plan.dp}") if zero3_measured(plan) else None
    if plan.sequence_parallel:
        # measured without DP; SP x DP adds FSDP2's modelled traffic, as TP x DP does with
        # more than one micro-batch
        sp = entry.get("tp_sp", {}).get(f"tp{plan.tp}")
        return ({int(w): v for w, v in sp.items()}, False) if sp else None
    if not zero3 and plan.tp > 1 and plan.dp > 1 and plan.num_microbatches == 1:
        # TP x DP (FSDP2 on DTensor parameters), measured as such: gathers, reduce-scatters
        # and FSDP's per-parameter hooks included
        zero3 = entry.get("tp_dp", {}).get(f"tp{plan.tp}-dp{plan.dp}")
    if zero3:
        return {int(w): v for w, v in zero3.items()}, True
    if plan.tp > 1:
        tp = entry.get("tp", {}).get(f"tp{plan.tp}")
        return ({int(w): v for w, v in tp.items()}, False) if tp else None
    return {int(k): v for k, v in entry["local"].items()}, False


def selective_terms(entry: dict, plan: Plan, levels: dict, fsdp: bool, tokens: float,
                    active: float, plain: dict[str, float]) -> dict[str, float] | None:
    """Seconds per micro-batch of one layer's forward and backward under selective
    recomputation: measured as such (``layer_*_selective`` of ``levels``), or, for layer
    times measured under FSDP2 (``fsdp``) or on the context-parallel ring (cp > 1), those
    plus what selective adds to the same layer without FSDP (the local terms, or the TP ones
    at the plan's TP degree), at the rank's tokens (b·s/cp) and active rank count. None when
    the profile has neither.

    ``plain`` holds the plan's ``layer_fwd`` / ``layer_bwd`` (seconds) from ``levels``.
    """
    if _has(levels, SELECTIVE_TERMS):
        return {name: _at(levels, name, tokens, active) for name in SELECTIVE_TERMS}
    if not fsdp and plan.cp == 1:
        return None
    base = (entry.get("tp", {}).get(f"tp{plan.tp}") if plan.tp > 1 else entry["local"]) or {}
    base = {int(k): v for k, v in base.items()}
    if not base or not _has(base, SELECTIVE_TERMS):
        return None
    # what the policy replays is per token (norms, activations, dropout): a cp rank's
    # b·s/cp tokens
    mine = tokens / plan.cp
    return {f"layer_{ph}_selective": plain[f"layer_{ph}"]
            + _at(base, f"layer_{ph}_selective", mine, active)
            - _at(base, f"layer_{ph}", mine, active) for ph in ("fwd", "bwd")}


def compute_terms(profile: CpuProfile, model: ModelSpec, plan: Plan) -> dict[str, float] | dict:
    """Per-rank compute terms of ``plan`` (seconds per micro-batch for layers and edges,
    per step for the optimizer), interpolated at the plan's active rank count; with
    selective recomputation also ``layer_fwd_selective`` / ``layer_bwd_selective``
    (`selective_terms`).

    Returns {} when the model shape, the plan's TP degree or one of its features
    (sequence parallelism, selective recomputation) was not calibrated.
    """
    entry = profile.compute.get(shape_key(model))
    if entry is None:
        return {}
    found = _levels(entry, plan)
    if found is None:
        return {}
    levels, zero3 = found
    tokens = plan.micro_batch * model.seq_len
    active = active_ranks(plan)
    local = {int(k): v for k, v in entry["local"].items()}
    out = {name: _at(levels, name, tokens, active) for name in LAYER_TERMS}
    for name in ("emb_fwd", "emb_bwd"):
        # a cp rank embeds its seq_len / cp tokens of each sequence
        out[name] = _at(local, name, tokens / plan.cp, active)
    for name in ("opt_layer_s", "opt_edge_s"):
        out[name] = interpolate({k: v[name] for k, v in levels.items()}, active)
    if plan.tp > 1 or plan.cp > 1 or zero3:
        # Recomputation under TP / CP / ZeRO-3 replays the forward (its collectives and the
        # forward ring included).
        out["layer_bwd_full"] = out["layer_bwd"] + out["layer_fwd"]
    if plan.recompute == "selective":
        sel = selective_terms(entry, plan, levels, zero3, tokens, active, out)
        if sel is None:
            return {}
        out.update(sel)
    out["zero3_measured"] = bool(zero3)
    return out


def zero3_measured(plan: Plan) -> bool:
    """Plans whose layer times calibrate measured under ZeRO-3 directly: FSDP2 over all ranks
    (dp = world size), one micro-batch per step (the calibration's gradient sync per step)."""
    return plan.zero_stage == 3 and plan.dp == plan.world_size and plan.num_microbatches == 1


def ddp_buckets(grad_bytes: float) -> int:
    """Gradient buckets DDP reduces: a 1 MiB first bucket, then 25 MiB ones.

    >>> ddp_buckets(13e6)
    2
    """
    return len(ddp_bucket_bytes(grad_bytes))


def ddp_bucket_bytes(grad_bytes: float) -> list[float]:
    """Bytes of each gradient bucket DDP all-reduces, in order: the first 1 MiB
    (``first_bucket_bytes``), then 25 MiB buckets (``bucket_cap_mb``), then the rest
    (PyTorch's ``torch.nn.parallel.DistributedDataParallel`` defaults; whole parameters make
    real buckets slightly larger).

    >>> [round(b / 2**20, 2) for b in ddp_bucket_bytes(13e6)]
    [1.0, 11.4]
    """
    if grad_bytes <= DDP_FIRST_BUCKET_BYTES:
        return [float(grad_bytes)]
    rest = grad_bytes - DDP_FIRST_BUCKET_BYTES
    full = math.ceil(rest / DDP_BUCKET_BYTES) - 1
    return [float(DDP_FIRST_BUCKET_BYTES)] + [float(DDP_BUCKET_BYTES)] * full + [
        float(rest - full * DDP_BUCKET_BYTES)]


def uses_fsdp(plan: Plan) -> bool:
    """The runtime shards with FSDP2 (ZeRO plans, and TP x DP); else DDP (or nothing); the
    data-parallel ranks are dp·cp (`runtime.parallel.cp.data_parallel_mesh`)."""
    return plan.dp_cp > 1 and (plan.zero_stage > 0 or plan.tp > 1)


def step_overhead_s(profile: CpuProfile, plan: Plan) -> float:
    """Once per step on every rank: the all-gather of (loss share, peak memory) that ends each
    step of `runtime.train` (16 bytes per rank, over all ranks)."""
    return profile.collective_s("all_gather", 16.0 * plan.world_size, plan.world_size,
                                plan.world_size)


def _fsdp_comm(profile: CpuProfile, plan: Plan, layers: int, grad_bytes: float,
               m: int) -> tuple[float, float]:
    # FSDP2 over the dp·cp ranks: each block (and the chunk's root) all-gathers its shard
    # before every forward (it reshards after backward); ZeRO-3 gathers again before the
    # backward; the gradients reduce-scatter once per step (synced on the last micro-batch).
    world, units = plan.world_size, layers + 1
    unit_bytes = grad_bytes / units
    gather = profile.collective_s("all_gather", unit_bytes, world, plan.dp_cp)
    scatter = profile.collective_s("reduce_scatter", unit_bytes, world, plan.dp_cp)
    return units * gather, units * ((gather if plan.zero_stage == 3 else 0.0) + scatter / m)


def _rank_tail(profile: CpuProfile, model: ModelSpec, plan: Plan, terms: dict, rank: int,
               fsdp: bool) -> dict[str, float]:
    # Once per step on pipeline rank ``rank``: DDP's reduction of each of its chunk modules,
    # the step's loss all-gather, AdamW over its layers and its share of the edges.
    chunks = plan.layers_per_stage(model)
    mine = range(rank, len(chunks), plan.pp)
    dp_comm = 0.0
    if plan.dp_cp > 1 and not fsdp:
        # each bucket at its own size: with more ranks than cores the measured time is far
        # from linear in bytes (`at_size`); DDP reduces over the dp·cp ranks
        dp_comm = sum(profile.collective_s("all_reduce", size, plan.world_size, plan.dp_cp)
                      for c in mine
                      for size in ddp_bucket_bytes(chunk_params(model, plan, c) * 4))
    emb_share = model.embedding_params() / max(1.0, model.embedding_params()
                                                + model.vocab_size * model.hidden)
    optimizer = (sum(chunks[c] for c in mine) * terms["opt_layer_s"]
                 + terms["opt_edge_s"] * ((rank == 0) * emb_share
                                          + (rank == plan.pp - 1) * (1 - emb_share)))
    return {"dp_comm_s": dp_comm + step_overhead_s(profile, plan),
            "optimizer_s": optimizer / plan.dp_cp if fsdp else optimizer}


def cpu_stage_costs(model: ModelSpec, plan: Plan, cluster) -> list | None:
    """`simulator.step.costs.StageCosts` of every pipeline chunk (pp·v entries, pipeline order;
    entry g runs on pipeline rank g % pp) from the cluster's calibrated profile; None when the
    profile does not cover the model shape, the TP degree or the plan's features
    (`compute_terms`), so the caller falls back to the generic per-op model.

    Layer and edge times come measured with their framework overhead (and, under TP, the TP
    collectives and DTensor dispatch). A chunk of an interleaved schedule is a stage with
    fewer layers: each of its forwards and backwards pays the measured pipeline action, and
    every chunk boundary is a send. Each rank's once-per-step costs (DP reduction of all its
    chunks, optimizer, the step's loss all-gather) sit on its first chunk (g < pp). DP and
    ZeRO-3 traffic is exposed, not overlapped: the gloo reduction runs on the same cores as
    the backward. Measured on 4 ranks / 2 cores (tiny-gpt, 2 sequences per rank): a DDP
    step's backward, 106-109 ms, equals a ``no_sync`` backward (60-67 ms) plus one
    all-reduce of the flattened 13 MB gradient run after it (41-43 ms); DDP's bucketed
    overlap hides nothing when every core is busy computing.
    """
    profile: CpuProfile | None = cluster.cpu_profile
    if profile is None:
        return None
    terms = compute_terms(profile, model, plan)
    if not terms:
        return None
    world, pp, m = plan.world_size, plan.pp, plan.num_microbatches
    chunks = plan.layers_per_stage(model)
    selective = plan.recompute == "selective"
    fwd_layer = terms["layer_fwd_selective" if selective else "layer_fwd"]
    bwd_layer = terms[{"full": "layer_bwd_full", "selective": "layer_bwd_selective",
                       "none": "layer_bwd"}[plan.recompute]]
    if plan.recompute_num_layers:  # block method: the first N blocks of each chunk recompute
        share = plan.model_full_recompute_share(model)
        bwd_layer = share * bwd_layer + (1 - share) * terms["layer_bwd"]
    head_fwd = max(0.0, terms["edge_fwd"] - terms["emb_fwd"])
    head_bwd = max(0.0, terms["edge_bwd"] - terms["emb_bwd"])
    act_bytes = plan.micro_batch * model.seq_len * model.hidden * 4       # fp32 (B, T, h)
    fsdp = uses_fsdp(plan) and not terms["zero3_measured"]     # else measured with the layers
    # a pipeline chunk pays the schedule's own cost per action (measured with its send /
    # receive latency on trivial stages); the activation bytes travel at p2p rate
    action = profile.pipeline_action_s(world, plan.virtual_stages) if pp > 1 else 0.0
    p2p = act_bytes / profile.collective("p2p", world, 2)["bandwidth_Bps"] if pp > 1 else 0.0
    out = []
    for g, layers in enumerate(chunks):
        rank, first, last = g % pp, g == 0, g == len(chunks) - 1
        fwd = layers * fwd_layer + first * terms["emb_fwd"] + last * head_fwd + action
        bwd = layers * bwd_layer + first * terms["emb_bwd"] + last * head_bwd + action
        grad_bytes = chunk_params(model, plan, g) * 4
        fwd_comm, bwd_comm = _fsdp_comm(profile, plan, layers, grad_bytes, m) if fsdp else (
            0.0, 0.0)
        tail = _rank_tail(profile, model, plan, terms, rank, fsdp) if g < pp else {}
        out.append(StageCosts(
            fwd_compute_s=fwd, bwd_compute_s=bwd, fwd_comm_s=fwd_comm, bwd_comm_s=bwd_comm,
            p2p_fwd_s=p2p if not last else 0.0, p2p_bwd_s=p2p if not first else 0.0, **tail))
    return out

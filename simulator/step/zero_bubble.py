"""Zero-bubble pipeline schedules in the SimPy step: ZB-H1, interleaved zero bubble, ZB-V
and DualPipe-V.

Zero-bubble schedules split each chunk's backward into B, the input gradient the previous
stage waits for, and W, the weight gradient nothing waits for, and move the W's into what
would be bubbles (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024, §2–3).
DualPipe-V also pairs a forward with a backward of another micro-batch so that one's
communication hides under the other's compute (DeepSeek-V3 technical report §3.2.1).

`split_backward` gives every chunk its W time from the op model (each weight GEMM's wgrad
costs what its forward costs: dW = Xᵀ·dY has the same m·n·k); `simulate_zero_bubble` runs the
ranks' orders (`simulator.step.zb_orders`, those torch.distributed.pipelining executes) on
the streams of `simulator.step.pipeline`; `estimate_zero_bubble` is the closed form, from
the bubble formulas of `bubble_formula_s`.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import simpy

from planner.mesh import chunk_rank
from planner.precision import storage_dtype
from planner.spec import ZERO_BUBBLE_SCHEDULES, ModelSpec, Plan
from simulator.network.collectives import memo_enabled
from simulator.network.hardware import DeviceProfile
from simulator.step.compute import (
    ATTENTION_CORE,
    Efficiency,
    edge_compute,
    gemm_time_s,
    layer_compute,
    layer_forward_ops,
    op_time_s,
)
from simulator.step.pipeline import (
    PipelineResult,
    _bucket_reduce,
    _Pipeline,
    exposed_dp_s,
    pipeline_result,
    simulate_pipeline,
    step_tail,
)
from simulator.step.stagecosts import StageCosts
from simulator.step.zb_orders import Step, rank_order


def wgrad_layer_s(model: ModelSpec, plan: Plan, attention: str, device: DeviceProfile,
                  eff: Efficiency) -> float:
    """Seconds of one block's weight-gradient GEMMs for one micro-batch on one TP rank.

    Each weight GEMM Y = X·W (X: T×k, W: k×n) has a wgrad dW = Xᵀ·dY of the same 2·T·k·n
    FLOPs, so it costs its forward GEMM's time (Qi et al. 2024 §2: T_W ≈ T_F for the
    linear layers); attention's score and value products have no weights and belong to B.
    """
    ops = layer_forward_ops(model, plan.micro_batch, plan.tp, plan.sequence_parallel,
                            attention, plan.dtype, plan.cp)
    return sum(op_time_s(op, device, eff, plan.dtype) for op in ops
               if op.m and op.name not in ATTENTION_CORE)


def split_backward(costs: list[StageCosts], model: ModelSpec, plan: Plan, attention: str,
                   device: DeviceProfile, eff: Efficiency,
                   cp_attention: str = "ring") -> list[StageCosts]:
    """``costs`` with ``wgrad_s`` set: each chunk's backward times the weight-gradient share
    of its device backward (the blocks' `wgrad_layer_s` plus, on the last chunk, the logits
    GEMM's wgrad, over the blocks' backward with any recomputation plus the edge backward).

    A share keeps the split right when the backward is host-bound or calibrated on a CPU.
    Mixture-of-experts blocks take the share of the dense block of the same widths (expert
    GEMMs, like dense ones, cost their forward time in wgrad).
    """
    lc = layer_compute(model, plan.micro_batch, plan.tp, plan.sequence_parallel, attention,
                       plan.dtype, device, eff, plan.cp, cp_attention)
    w_layer = wgrad_layer_s(model, plan, attention, device, eff)
    chunks = plan.layers_per_stage(model)
    out = []
    for g, (c, layers) in enumerate(zip(costs, chunks, strict=True)):
        last = g == len(chunks) - 1
        _, e_bwd, _ = edge_compute(model, plan.micro_batch, plan.tp, plan.dtype, device, eff,
                                   first=g == 0, last=last, cp=plan.cp)
        t = plan.micro_batch * model.seq_len // plan.cp
        e_w = gemm_time_s(t, model.vocab_size // plan.tp, model.hidden,
                          device.peak(storage_dtype(plan.dtype)), eff) if last else 0.0
        recompute = lc.recompute_s(plan.recompute, plan.full_recompute_share(layers))
        share = (layers * w_layer + e_w) / (layers * (lc.bwd_s + recompute) + e_bwd)
        out.append(dataclasses.replace(c, wgrad_s=c.bwd_compute_s * min(1.0, share)))
    return out


def _op_times(c: StageCosts, kind: str) -> tuple[float, float]:
    # (compute s, exposed comm s) of one op; the TP collectives of the backward sit in B.
    return {"F": (c.fwd_compute_s, c.fwd_comm_s),
            "B": (c.bwd_compute_s - c.wgrad_s, c.bwd_comm_s),
            "W": (c.wgrad_s, 0.0),
            "BW": (c.bwd_compute_s, c.bwd_comm_s)}[kind]


def step_times(costs: list[StageCosts], step: Step) -> tuple[float, float]:
    """(compute s, exposed comm s) of one step of an order. An overlapped pair (DualPipe's
    F&B) computes both ops back to back and hides their communication under that compute:
    only the excess shows (DeepSeek-V3 report §3.2.1, Figure 4).

    >>> c = StageCosts(fwd_compute_s=1, bwd_compute_s=2, fwd_comm_s=0.5, bwd_comm_s=1,
    ...                wgrad_s=1)
    >>> step_times([c], (("B", 0, 0),)), step_times([c], (("F", 0, 1), ("BW", 0, 0)))
    ((1, 1), (3, 0.0))
    """
    times = [_op_times(costs[g], kind) for kind, g, _ in step]
    compute, comm = sum(t[0] for t in times), sum(t[1] for t in times)
    if len(step) > 1:
        comm = max(0.0, comm - compute)
    return compute, comm


def _rank_process(env: simpy.Environment, pipe: _Pipeline, stage: int, order: list[Step],
                  schedule: str, overlap_dp: bool):
    rank, last_g = pipe.ranks[stage], len(pipe.costs) - 1
    tail = pipe.costs[stage]  # chunk `stage` is on this rank in both layouts: it holds DP
    dp_done = env.event()
    grads = [i for i, s in enumerate(order) if any(op[0] in ("W", "BW") for op in s)]
    for i, step in enumerate(order):
        for kind, g, k in step:
            if kind == "F" and g > 0:
                yield pipe.arrival(("F", g, k))
            elif kind in ("B", "BW") and g < last_g:
                yield pipe.arrival(("B", g, k))
        compute, comm = step_times(pipe.costs, step)
        if overlap_dp and grads and i == grads[-1]:  # the buckets reduce under the last W
            last = dataclasses.replace(tail, bwd_compute_s=compute, bwd_comm_s=comm)
            env.process(_bucket_reduce(env, rank, last, env.now, dp_done))
        name = "&".join(f"{kind}{k}.c{g}" for kind, g, k in step)
        yield from rank.hold("compute", name, compute)
        yield from rank.hold("comm", f"tp-{name}", comm)
        for kind, g, k in step:
            _send(env, pipe, rank, schedule, kind, g, k, last_g)
    yield from step_tail(env, rank, tail, overlap_dp, dp_done)


def _send(env: simpy.Environment, pipe: _Pipeline, rank, schedule: str, kind: str, g: int,
          k: int, last_g: int) -> None:
    # F sends its activation to chunk g + 1, B / BW its input gradient to chunk g − 1; a
    # neighbour on the same rank (the turn of a V) needs no transfer.
    if kind == "F" and g < last_g:
        key, peer, stream, seconds = ("F", g + 1, k), g + 1, "p2p-next", pipe.costs[g].p2p_fwd_s
    elif kind in ("B", "BW") and g > 0:
        key, peer, stream, seconds = ("B", g - 1, k), g - 1, "p2p-prev", pipe.costs[g].p2p_bwd_s
    else:
        return
    if chunk_rank(schedule, pipe.pp, peer) == rank.stage:
        pipe.arrival(key).succeed()
    else:
        tag = f"{k}.c{g}"
        env.process(pipe.send(rank, stream, key, seconds,
                              f"send-{'act' if kind == 'F' else 'grad'}{tag}"))


def simulate_zero_bubble(costs: list[StageCosts], schedule: str, num_microbatches: int, *,
                         virtual_stages: int = 1, trace: bool = False,
                         overlap_dp: bool = False, post_validation: bool = False
                         ) -> PipelineResult:
    """Run one step of zero-bubble ``schedule`` over ``costs`` (pp·v chunks in pipeline
    order, chunk g on rank `planner.mesh.chunk_rank`) in SimPy.

    Each rank runs its order (`simulator.step.zb_orders.rank_order`) on its compute stream,
    waiting for each op's input (the activation of a forward, the gradient of a B); F, B, W
    and BW cost per `step_times`; sends go on the P2P streams as in
    `simulator.step.pipeline.simulate_pipeline`, whose result this returns. With
    ``overlap_dp`` the gradient buckets reduce under the rank's last weight-gradient step;
    with ``post_validation`` the longest rank span sets the step (Qi et al. 2024 §4,
    `simulator.step.pipeline.pipeline_result`).
    """
    env = simpy.Environment()
    pp = len(costs) // virtual_stages
    pipe = _Pipeline(env, costs, pp, trace)
    for stage in range(pp):
        order = rank_order(schedule, pp, num_microbatches, stage, virtual_stages)
        env.process(_rank_process(env, pipe, stage, order, schedule, overlap_dp))
    env.run()
    return pipeline_result(pipe, post_validation)


@lru_cache(maxsize=256)
def _dependencies(schedule: str, pp: int, m: int, v: int) -> tuple[tuple[tuple, ...], ...]:
    # Per rank, per step: (step, the arrival keys it waits for, the keys it produces with
    # whether each crosses to another rank and the chunk whose send time it takes, and
    # which P2P direction). Cached: the planner asks for the same shapes many times.
    last_g, ranks = pp * v - 1, []
    for r in range(pp):
        steps = []
        for step in rank_order(schedule, pp, m, r, v):
            needs = tuple([("F", g, k) for kind, g, k in step if kind == "F" and g > 0]
                          + [("B", g, k) for kind, g, k in step
                             if kind in ("B", "BW") and g < last_g])
            makes = []
            for kind, g, k in step:
                if kind == "F" and g < last_g:
                    makes.append((("F", g + 1, k), chunk_rank(schedule, pp, g + 1) != r, g, 0))
                elif kind in ("B", "BW") and g > 0:
                    makes.append((("B", g - 1, k), chunk_rank(schedule, pp, g - 1) != r, g, 1))
            steps.append((step, needs, tuple(makes)))
        ranks.append(tuple(steps))
    return tuple(ranks)


#: Timelines kept by `_timeline_memo` (cleared when full).
TIMELINE_MEMO_SIZE = 8192
_TIMELINES: dict[tuple, tuple] = {}


def _timeline_memo(costs: list[StageCosts], schedule: str, m: int, v: int) -> tuple:
    # `_timeline`, memoised by what it reads: the schedule's shape and each chunk's op and
    # send times. Plans that differ only in ZeRO stage, DP layout or the optimizer share the
    # chunks' times and so their timeline. Off with the cost memo
    # (`simulator.network.collectives.cost_memo`).
    if not memo_enabled():
        return _timeline(costs, schedule, m, v)
    key = (schedule, m, v, tuple((c.fwd_compute_s, c.bwd_compute_s, c.wgrad_s, c.fwd_comm_s,
                                  c.bwd_comm_s, c.p2p_fwd_s, c.p2p_bwd_s) for c in costs))
    hit = _TIMELINES.get(key)
    if hit is None:
        if len(_TIMELINES) >= TIMELINE_MEMO_SIZE:
            _TIMELINES.clear()
        hit = _TIMELINES[key] = tuple(tuple(x) for x in _timeline(costs, schedule, m, v))
    return hit


def _timeline(costs: list[StageCosts], schedule: str, m: int,
              v: int) -> tuple[list[float], list[float], list[float], list[float]]:
    # Each rank's (end of its last op, busy compute, exposed comm, start of its first op)
    # from list scheduling of the orders: a step starts when its rank is free and its inputs
    # have arrived (producer end + the P2P time); sends do not queue. The SimPy run without
    # stream contention.
    pp = len(costs) // v
    ranks = _dependencies(schedule, pp, m, v)
    sends = [(c.p2p_fwd_s, c.p2p_bwd_s) for c in costs]
    single = {(kind, g): _op_times(c, kind) for g, c in enumerate(costs)
              for kind in ("F", "B", "W", "BW")}
    ready: dict[tuple, float] = {}
    free, compute, comm, nxt = [0.0] * pp, [0.0] * pp, [0.0] * pp, [0] * pp
    first: list[float | None] = [None] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            steps, i = ranks[r], nxt[r]
            n_steps = len(steps)
            while i < n_steps:
                step, needs, makes = steps[i]
                start = free[r]                        # the latest of free and every input
                for key in needs:
                    arrived = ready.get(key)
                    if arrived is None:
                        break
                    if arrived > start:
                        start = arrived
                else:                                  # every input has arrived
                    arrived = start
                if arrived is None:                    # an input not made yet: wait
                    break
                c, x = single[step[0][:2]] if len(step) == 1 else step_times(costs, step)
                end = start + c + x
                first[r] = start if first[r] is None else first[r]
                free[r], compute[r], comm[r], i = end, compute[r] + c, comm[r] + x, i + 1
                for key, hop, g, direction in makes:
                    ready[key] = end + hop * sends[g][direction]
            progress = progress or i > nxt[r]
            nxt[r] = i
    return free, compute, comm, [f or 0.0 for f in first]


def estimate_zero_bubble(costs: list[StageCosts], schedule: str, num_microbatches: int,
                         overlap_dp: bool = False, virtual_stages: int = 1, *,
                         post_validation: bool = False) -> tuple[float, float, float]:
    """Closed form of `simulate_zero_bubble`: ``(step_s, compute_s, comm_s)``.

    List scheduling of the ranks' orders (each step starts when its rank is free and its
    inputs have arrived; P2P sends do not queue), then each rank's once-per-step tail
    (exposed DP reduction, optimizer, weight gather; `simulator.step.pipeline.exposed_dp_s`,
    with the W time as the backward it hides under). The critical rank is the one that
    finishes last (with ``post_validation``: whose span from first op to optimizer end is
    longest). Equals the SimPy step when sends do not contend.

    Warm-up and cool-down of these orders span under 2·pp micro-batches and the steady
    state repeats every micro-batch, so for m > 2·pp the ranks are scheduled for m₀ = 2·pp
    micro-batches and extended by (m − m₀) rounds of the busiest rank's work per
    micro-batch (its chunks' F + B + W + exposed comm). DualPipe-V's steady state has no
    slack, so its P2P times add to each round: it is scheduled for 2·pp and 3·pp and
    extended along that slope. interleaved-zb is extended only when pp divides m (its rounds
    then stay pp long).
    """
    pp, v, m = len(costs) // virtual_stages, virtual_stages, num_microbatches
    if m <= 2 * pp or (schedule == "interleaved-zb" and m % pp) or \
            (schedule == "dualpipe-v" and m <= 3 * pp):
        ends, compute, comm, starts = _timeline_memo(costs, schedule, m, v)
    elif schedule == "dualpipe-v":
        runs = [_timeline_memo(costs, schedule, n, v) for n in (2 * pp, 3 * pp)]
        ends, compute, comm, starts = ([b + (b - a) * (m - 3 * pp) / pp
                                        for a, b in zip(*pair, strict=True)]
                                       for pair in zip(*runs, strict=True))
    else:
        ends, compute, comm, starts = _timeline_memo(costs, schedule, 2 * pp, v)
        work = [[c for g, c in enumerate(costs) if chunk_rank(schedule, pp, g) == r]
                for r in range(pp)]
        per_mb = [(sum(c.fwd_compute_s + c.bwd_compute_s for c in w),
                   sum(c.fwd_comm_s + c.bwd_comm_s for c in w)) for w in work]
        pace, extra = max(c + x for c, x in per_mb), m - 2 * pp
        ends = [e + extra * pace for e in ends]
        compute = [c + extra * mb[0] for c, mb in zip(compute, per_mb, strict=True)]
        comm = [x + extra * mb[1] for x, mb in zip(comm, per_mb, strict=True)]
    origin = starts if post_validation else [0.0] * pp
    return _with_tails(costs, pp, ends, compute, comm, overlap_dp, origin)


def _with_tails(costs: list[StageCosts], pp: int, ends: list[float], compute: list[float],
                comm: list[float], overlap_dp: bool,
                origin: list[float]) -> tuple[float, float, float]:
    # Each rank's once-per-step tail after its last op; the rank whose end is latest (counted
    # from its origin) is critical.
    finish = []
    for r in range(pp):
        tail = costs[r]
        hidden = dataclasses.replace(tail, bwd_compute_s=tail.wgrad_s or tail.bwd_compute_s,
                                     bwd_comm_s=0.0 if tail.wgrad_s else tail.bwd_comm_s)
        exposed = exposed_dp_s(hidden, overlap_dp) + tail.dp_gather_s
        finish.append((ends[r] + exposed + tail.optimizer_s - origin[r], exposed))
    crit = max(range(pp), key=lambda r: (finish[r][0], compute[r] + comm[r]))
    return (finish[crit][0], compute[crit] + costs[crit].optimizer_s,
            comm[crit] + finish[crit][1])


def simulate_schedule(costs: list[StageCosts], schedule: str, num_microbatches: int, *,
                      virtual_stages: int = 1, trace: bool = False, overlap_dp: bool = False,
                      post_validation: bool = False) -> PipelineResult:
    """One SimPy step of any schedule: `simulate_zero_bubble` for the zero-bubble ones
    (`planner.spec.ZERO_BUBBLE_SCHEDULES`), `simulator.step.pipeline.simulate_pipeline` for
    GPipe, 1F1B and interleaved 1F1B (``post_validation`` applies to the former only).

    >>> c = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0)
    >>> simulate_schedule([c, c], "1f1b", 2).step_time_s  # (m + pp − 1)(F + B)
    9.0
    """
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return simulate_zero_bubble(costs, schedule, num_microbatches,
                                    virtual_stages=virtual_stages, trace=trace,
                                    overlap_dp=overlap_dp, post_validation=post_validation)
    return simulate_pipeline(costs, schedule, num_microbatches, virtual_stages=virtual_stages,
                             trace=trace, overlap_dp=overlap_dp)

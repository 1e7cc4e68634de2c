"""Step-time prediction: a SimPy pipeline simulation (`simulate`) and its closed form
(`estimate`).

One SimPy process per pipeline stage runs that stage's schedule (1F1B: pp − stage − 1 warm-up
forwards, then one-forward-one-backward, then the cool-down backwards; or GPipe: all forwards,
then all backwards; or interleaved 1F1B over v model chunks per rank). Activations and
gradients travel between (virtual) stages as P2P transfers that trigger SimPy events keyed by
(direction, virtual stage, micro-batch). TP collectives sit on the critical path of each micro-batch; the DP gradient
reduction and the optimizer step follow the last backward, or (``overlap_dp=True``) the
gradient buckets reduce while the last backward runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import simpy

from planner.spec import ModelSpec, Plan, training_flops_per_token
from simulator.cluster import Cluster
from simulator.costs import (
    DEFAULT_OPTIONS,
    SimOptions,
    StageCosts,
    recompute_flops_per_token,
    stage_costs,
)
from simulator.memory import MemoryBreakdown, memory_per_stage


@dataclass(frozen=True, kw_only=True)
class StepPrediction:
    """Predicted training step. Seconds, bytes, FLOP fractions; events are
    ``(stage, stream, name, start_s, end_s)`` and empty unless traced.

    compute_s / comm_s are the busy compute and exposed communication of the critical (last to
    finish) stage; bubble_s = step_time_s − compute_s − comm_s (idle time, incl. P2P waits).
    """

    step_time_s: float
    compute_s: float
    comm_s: float
    bubble_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    peak_memory_bytes: float
    memory: list[MemoryBreakdown]
    events: list[tuple] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dict (SI units); memory as a list of dicts; no events."""
        return {"step_time_s": self.step_time_s, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "bubble_s": self.bubble_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "hfu": self.hfu,
                "peak_memory_bytes": self.peak_memory_bytes,
                "memory": [m.to_dict() for m in self.memory]}


@dataclass(frozen=True, kw_only=True)
class PipelineResult:
    """Outcome of `simulate_pipeline`: step time and the critical stage's busy times."""

    step_time_s: float
    compute_s: float
    comm_s: float
    critical_stage: int
    events: list[tuple]


def schedule_order(schedule: str, pp: int, m: int, stage: int,
                   virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    """Operations of pipeline rank ``stage`` in order, as ``("F" | "B", chunk, micro_batch)``.

    1F1B (Narayanan et al. 2021, §2.2; PipeDream-Flush): w = min(pp − stage − 1, m) warm-up
    forwards, then alternate F/B, then w cool-down backwards. Interleaved 1F1B (same paper,
    §2.2.2; Megatron-LM's ``forward_backward_pipelining_with_interleaving``): m·v chunk
    operations, w = min(2(pp − stage − 1) + (v − 1)·pp, m·v); op k runs chunk (k // pp) % v
    (backward: v − 1 minus that) on micro-batch (k // (pp·v))·pp + k % pp. GPipe (Huang et al.
    2019): all forwards, then all backwards.

    >>> schedule_order("1f1b", 2, 3, 0)
    [('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('F', 0, 2), ('B', 0, 1), ('B', 0, 2)]
    >>> schedule_order("interleaved-1f1b", 2, 2, 1, virtual_stages=2)[:3]
    [('F', 0, 0), ('F', 0, 1), ('F', 1, 0)]
    """
    v = virtual_stages
    if schedule == "gpipe":
        return [("F", 0, k) for k in range(m)] + [("B", 0, k) for k in range(m)]
    ops = m * v
    warm = min(pp - stage - 1 if v == 1 else 2 * (pp - stage - 1) + (v - 1) * pp, ops)

    def op(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k // pp) % v
        return (kind, chunk if kind == "F" else v - 1 - chunk, (k // (pp * v)) * pp + k % pp)

    order = [op("F", k) for k in range(warm)]
    for k in range(ops - warm):
        order += [op("F", warm + k), op("B", k)]
    return order + [op("B", k) for k in range(ops - warm, ops)]


def _bucket_reduce(env, stage, c, start, log, done):
    # Overlapped DP reduction: bucket i is ready when (i + 1)/n of the last backward is done;
    # buckets reduce one after another on the communication stream.
    n, t_b = c.dp_buckets, c.bwd_compute_s + c.bwd_comm_s
    for i in range(n):
        ready = start + (i + 1) * t_b / n
        if env.now < ready:
            yield env.timeout(ready - env.now)
        begin = env.now
        yield env.timeout(c.dp_comm_s / n)
        if log is not None:
            log.append((stage, "dp", f"dp-bucket{i}", begin, env.now))
    done.succeed()


class _Pipeline:
    """Shared state of one simulated step: arrival events keyed (kind, virtual stage, mb)."""

    def __init__(self, env, costs, pp, trace):
        self.env, self.costs, self.pp = env, costs, pp
        self.arrivals: dict[tuple, simpy.Event] = {}
        self.busy = [{"compute": 0.0, "comm": 0.0} for _ in range(pp)]
        self.finish = [0.0] * pp
        self.log: list[tuple] | None = [] if trace else None

    def arrival(self, key: tuple) -> simpy.Event:
        if key not in self.arrivals:
            self.arrivals[key] = self.env.event()
        return self.arrivals[key]

    def work(self, stage, stream, name, seconds, kind):
        start = self.env.now
        yield self.env.timeout(seconds)
        self.busy[stage][kind] += seconds
        if self.log is not None and seconds > 0:
            self.log.append((stage, stream, name, start, self.env.now))

    def send(self, stage, key, seconds, name):
        # P2P transfer on its own stream: does not block the sender's compute.
        start = self.env.now
        yield self.env.timeout(seconds)
        if self.log is not None:
            self.log.append((stage, "p2p", name, start, self.env.now))
        self.arrival(key).succeed()


def _stage_process(env, pipe, stage, schedule, m, virtual_stages, overlap_dp):
    pp, last_g = pipe.pp, len(pipe.costs) - 1
    tail = pipe.costs[stage]  # chunk 0: holds this rank's DP / optimizer, runs its last B
    dp_done = env.event()
    order = schedule_order(schedule, pp, m, stage, virtual_stages)
    for i, (kind, chunk, k) in enumerate(order):
        g = chunk * pp + stage
        c = pipe.costs[g]
        tag = f"{k}" if virtual_stages == 1 else f"{k}.c{chunk}"
        if kind == "F":
            if g > 0:
                yield pipe.arrival(("F", g, k))
            yield from pipe.work(stage, "compute", f"F{tag}", c.fwd_compute_s, "compute")
            yield from pipe.work(stage, "comm", f"tp-F{tag}", c.fwd_comm_s, "comm")
            if g < last_g:
                env.process(pipe.send(stage, ("F", g + 1, k), c.p2p_fwd_s, f"send-act{tag}"))
        else:
            if g < last_g:
                yield pipe.arrival(("B", g, k))
            if overlap_dp and i == len(order) - 1:
                env.process(_bucket_reduce(env, stage, tail, env.now, pipe.log, dp_done))
            yield from pipe.work(stage, "compute", f"B{tag}", c.bwd_compute_s, "compute")
            yield from pipe.work(stage, "comm", f"tp-B{tag}", c.bwd_comm_s, "comm")
            if g > 0:
                env.process(pipe.send(stage, ("B", g - 1, k), c.p2p_bwd_s, f"send-grad{tag}"))
    if overlap_dp:
        backward_end = env.now
        yield dp_done
        pipe.busy[stage]["comm"] += env.now - backward_end  # only the exposed part
    else:
        yield from pipe.work(stage, "comm", "dp-grad-reduce", tail.dp_comm_s, "comm")
    yield from pipe.work(stage, "compute", "optimizer", tail.optimizer_s, "compute")
    yield from pipe.work(stage, "comm", "dp-weight-gather", tail.dp_gather_s, "comm")
    pipe.finish[stage] = env.now


def simulate_pipeline(costs: list[StageCosts], schedule: str, num_microbatches: int,
                      *, virtual_stages: int = 1, trace: bool = False,
                      overlap_dp: bool = False) -> PipelineResult:
    """Run one step of a pipeline whose (virtual) stages cost ``costs`` in SimPy.

    ``costs`` lists pp·virtual_stages entries in pipeline order (entry g on rank g % pp, see
    `simulator.costs.stage_costs`). With ``overlap_dp`` the gradient buckets reduce during
    each rank's last backward (as DDP / Megatron's overlap_grad_reduce do once gradient
    accumulation ends); otherwise the whole reduction follows it. Returns the step time (last
    rank to finish) and the busy compute / exposed communication of the critical rank (latest
    finish; ties go to the busier rank).
    """
    env = simpy.Environment()
    pp = len(costs) // virtual_stages
    pipe = _Pipeline(env, costs, pp, trace)
    for stage in range(pp):
        env.process(_stage_process(env, pipe, stage, schedule, num_microbatches,
                                   virtual_stages, overlap_dp))
    env.run()
    busy, finish = pipe.busy, pipe.finish
    crit = max(range(pp), key=lambda s: (finish[s], busy[s]["compute"] + busy[s]["comm"]))
    events = sorted(pipe.log, key=lambda e: (e[3], e[0])) if pipe.log else []
    return PipelineResult(step_time_s=max(finish), compute_s=busy[crit]["compute"],
                          comm_s=busy[crit]["comm"], critical_stage=crit, events=events)


def _prediction(model: ModelSpec, plan: Plan, cluster: Cluster, step: float, compute: float,
                comm: float, events: list[tuple], attention: str) -> StepPrediction:
    # MFU / HFU: PaLM appendix B (training_flops_per_token) over world · dense peak.
    tokens_per_s = plan.global_batch * model.seq_len / step
    peak = plan.world_size * cluster.device.peak(plan.dtype)
    model_flops = training_flops_per_token(model)
    memory = memory_per_stage(model, plan, attention=attention)
    return StepPrediction(
        step_time_s=step, compute_s=compute, comm_s=comm,
        bubble_s=max(0.0, step - compute - comm), tokens_per_s=tokens_per_s,
        mfu=model_flops * tokens_per_s / peak,
        hfu=(model_flops + recompute_flops_per_token(model, plan)) * tokens_per_s / peak,
        peak_memory_bytes=max(m.total_bytes for m in memory), memory=memory, events=events)


def simulate(model: ModelSpec, plan: Plan, cluster: Cluster, *, trace: bool = False,
             overlap_dp: bool = False, options: SimOptions = DEFAULT_OPTIONS,
             stragglers: Mapping[int, float] | None = None) -> StepPrediction:
    """Simulate one training step of ``model`` under ``plan`` on ``cluster`` with SimPy.

    Cost grows with pp × micro-batches, not with the number of devices. ``overlap_dp``
    overlaps the bucketed gradient reduction with the last backward (`simulate_pipeline`);
    ``options`` names framework behaviour the plan does not (`simulator.costs.SimOptions`).
    ``stragglers`` maps global ranks (numbered as `runtime.parallelize.build_mesh` numbers
    them) to compute slowdown factors >= 1; their TP, PP and DP groups wait for them
    (`simulator.stragglers.simulate_with_stragglers`).

    Raises:
        PlanError: the plan does not fit the model, needs more devices than the cluster has
            (with the arithmetic), the device has no peak FLOP/s for ``plan.dtype``, or a
            straggler names a rank the plan does not have or a factor below 1.
    """
    costs = stage_costs(model, plan, cluster, options)
    if stragglers:
        from simulator.stragglers import simulate_with_stragglers
        result = simulate_with_stragglers(costs, plan, stragglers, trace=trace,
                                          overlap_dp=overlap_dp)
    else:
        result = simulate_pipeline(costs, plan.schedule, plan.num_microbatches,
                                   virtual_stages=plan.virtual_stages, trace=trace,
                                   overlap_dp=overlap_dp)
    return _prediction(model, plan, cluster, result.step_time_s, result.compute_s,
                       result.comm_s, result.events, options.attention)


def exposed_dp_s(c: StageCosts, overlap_dp: bool) -> float:
    """Gradient-reduction time left after the last backward.

    Overlapped, n buckets of d = dp/n each become ready every t_b/n during the last backward
    t_b and reduce in order, so the last ends at max(t_b/n + dp, t_b + d): exposed is that
    minus t_b.

    >>> exposed_dp_s(StageCosts(fwd_compute_s=1, bwd_compute_s=4, dp_comm_s=2, dp_buckets=4),
    ...              True)
    0.5
    """
    if not overlap_dp:
        return c.dp_comm_s
    n, t_b = c.dp_buckets, c.bwd_compute_s + c.bwd_comm_s
    return max(t_b / n + c.dp_comm_s, t_b + c.dp_comm_s / n) - t_b


def estimate_pipeline(costs: list[StageCosts], num_microbatches: int,
                      overlap_dp: bool = False,
                      virtual_stages: int = 1) -> tuple[float, float, float]:
    """Closed form of `simulate_pipeline`: ``(step_s, compute_s, comm_s)``.

    With c_g = t_f + t_b of virtual stage g, v chunks per rank and R_r = Σ_{g on rank r} c_g
    (one micro-batch's work on rank r): step = m·max_r R_r + (Σ_r R_r − max_r R_r)/v + P2P
    of one fill and one drain + max_rank(exposed DP + optimizer + weight gather): the busiest
    rank's m rounds plus the fill and drain through the others, 1/v of a round each. For
    equal stages and free P2P this is (m + p − 1)(t_f + t_b) + ... for 1F1B / GPipe and
    (m·v + p − 1)·(t_f + t_b)/v interleaved (Narayanan et al. 2021, §2.2). The critical rank
    is the busiest one.
    """
    m, v = num_microbatches, virtual_stages
    pp = len(costs) // v
    per_mb = [c.fwd_compute_s + c.bwd_compute_s + c.fwd_comm_s + c.bwd_comm_s for c in costs]
    p2p = sum(c.p2p_fwd_s + c.p2p_bwd_s for c in costs[:pp])
    tails = [exposed_dp_s(c, overlap_dp) + c.optimizer_s + c.dp_gather_s for c in costs[:pp]]
    rank_work = [sum(per_mb[r::pp]) for r in range(pp)]
    step = m * max(rank_work) + (sum(rank_work) - max(rank_work)) / v + p2p + max(tails)
    crit = max(range(pp), key=rank_work.__getitem__)
    mine, tail = costs[crit::pp], costs[crit]
    compute = m * sum(c.fwd_compute_s + c.bwd_compute_s for c in mine) + tail.optimizer_s
    comm = (m * sum(c.fwd_comm_s + c.bwd_comm_s for c in mine)
            + exposed_dp_s(tail, overlap_dp) + tail.dp_gather_s)
    return step, compute, comm


def estimate(model: ModelSpec, plan: Plan, cluster: Cluster, *,
             overlap_dp: bool = False, options: SimOptions = DEFAULT_OPTIONS,
             stragglers: Mapping[int, float] | None = None) -> StepPrediction:
    """Analytical (no SimPy) version of `simulate`, for screening many plans quickly
    (~0.1 ms a call); with ``stragglers``, the slowest replica's closed form
    (`simulator.stragglers.estimate_with_stragglers`).

    Raises:
        PlanError: as `simulate`.
    """
    costs = stage_costs(model, plan, cluster, options)
    if stragglers:
        from simulator.stragglers import estimate_with_stragglers
        step, compute, comm = estimate_with_stragglers(costs, plan, stragglers,
                                                       overlap_dp=overlap_dp)
    else:
        step, compute, comm = estimate_pipeline(costs, plan.num_microbatches, overlap_dp,
                                                plan.virtual_stages)
    return _prediction(model, plan, cluster, step, compute, comm, [], options.attention)

"""Pipeline schedules of one training step: the operation order of each pipeline rank, the SimPy
simulation of the step (`simulate_pipeline`) and its closed form (`estimate_pipeline`).

In the SimPy model every pipeline rank owns its streams as ``simpy.Resource`` s of capacity 1,
as a GPU owns CUDA streams: ``compute`` (forward, backward, optimizer), ``comm`` (the
collectives on the critical path: exposed TP traffic, a gradient reduction that follows the
backward, the ZeRO weight gather), ``dp`` (gradient buckets that reduce while the last backward
runs) and one P2P stream per direction (sends to the next and to the previous stage). A rank's
schedule is one SimPy process that requests its streams in order; a send is a process of its
own on the sender's P2P stream, and the receiver waits on the event the send triggers, keyed by
(direction, virtual stage, micro-batch). Two sends in the same direction queue on the stream;
a send never blocks its sender's compute; the bucket reduction overlaps the backward because it
runs on another stream. Every request that holds a stream writes one event
``(stage, stream, name, start_s, end_s)`` to the log, which the trace exporter
(`simulator.step.trace`) and the tests read. Communication hidden under a pass (ZeRO-3
prefetch, TP overlap: `StageCosts.fwd_overlap_s`) is logged on an ``overlap`` track from the
pass's start; it holds no stream and adds no time.
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from planner.spec import ZERO_BUBBLE_SCHEDULES, PlanError
from simulator.step.stagecosts import StageCosts


@dataclass(frozen=True, kw_only=True)
class PipelineResult:
    """Outcome of `simulate_pipeline`: step time and the critical stage's busy times."""

    step_time_s: float
    compute_s: float
    comm_s: float
    critical_stage: int
    events: list[tuple]


def warmup_passes(schedule: str, pp: int, m: int, stage: int, virtual_stages: int = 1) -> int:
    """Forwards pipeline rank ``stage`` runs before its first backward pairs with one
    (`schedule_order`): w = min(pp − stage − 1, m) in 1F1B, min(2(pp − stage − 1) +
    (v − 1)·pp, m·v) interleaved, all m in GPipe.

    >>> warmup_passes("1f1b", 4, 8, 0), warmup_passes("interleaved-1f1b", 8, 128, 0, 4)
    (3, 38)
    """
    v = virtual_stages
    if schedule == "gpipe":
        return m
    return min(pp - stage - 1 if v == 1 else 2 * (pp - stage - 1) + (v - 1) * pp, m * v)


def unpaired_passes(schedule: str, pp: int, m: int, stage: int, virtual_stages: int = 1
                    ) -> int:
    """Passes at each end of rank ``stage``'s `schedule_order` that run with no pass of
    another micro-batch beside them. Megatron-Core's combined 1F1B (the EP all-to-all
    overlap, ``overlap_moe_expert_parallel_comm``; `SimOptions.moe_a2a_overlap`) merges each
    steady-state forward with the backward that follows it in the order, which is another
    micro-batch's once a rank warms up with w > 0 forwards; with w = 0 (the last 1F1B stage)
    a forward is followed by its own backward, so the first forward and the last backward run
    alone. The w warm-up forwards and w cool-down backwards run alone; all of them when
    nothing pairs (GPipe, or w = every pass).

    >>> unpaired_passes("1f1b", 2, 3, 0), unpaired_passes("1f1b", 2, 3, 1)
    (1, 1)
    >>> unpaired_passes("gpipe", 2, 3, 0), unpaired_passes("interleaved-1f1b", 8, 128, 7, 4)
    (3, 24)
    """
    ops = m * virtual_stages
    warm = warmup_passes(schedule, pp, m, stage, virtual_stages)
    return ops if warm >= ops else max(warm, 1)


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
    warm = warmup_passes(schedule, pp, m, stage, v)

    def op(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k // pp) % v
        return (kind, chunk if kind == "F" else v - 1 - chunk, (k // (pp * v)) * pp + k % pp)

    order = [op("F", k) for k in range(warm)]
    for k in range(ops - warm):
        order += [op("F", warm + k), op("B", k)]
    return order + [op("B", k) for k in range(ops - warm, ops)]


#: The streams of one rank (each a ``simpy.Resource`` of capacity 1); both P2P directions
#: log to the "p2p" track.
STREAMS = ("compute", "comm", "dp", "p2p-next", "p2p-prev")


class _Rank:
    """One pipeline rank's streams and busy time."""

    def __init__(self, env: simpy.Environment, stage: int, log: list | None):
        self.env, self.stage, self.log = env, stage, log
        self.streams = {name: simpy.Resource(env, capacity=1) for name in STREAMS}
        self.busy = {"compute": 0.0, "comm": 0.0}
        self.finish = 0.0
        self.first_compute_s: float | None = None  # start of the rank's first compute op

    def hold(self, stream: str, name: str, seconds: float):
        """Hold ``stream`` for ``seconds`` (a SimPy generator); logs the interval."""
        with self.streams[stream].request() as req:
            yield req
            start = self.env.now
            if stream == "compute" and self.first_compute_s is None and seconds > 0:
                self.first_compute_s = start
            yield self.env.timeout(seconds)
        if stream in self.busy:
            self.busy[stream] += seconds
        if self.log is not None and seconds > 0:
            track = "p2p" if stream.startswith("p2p") else stream
            self.log.append((self.stage, track, name, start, self.env.now))


class _Pipeline:
    """Shared state of one simulated step: the ranks and the P2P arrival events keyed
    (kind, virtual stage, micro-batch)."""

    def __init__(self, env: simpy.Environment, costs: list[StageCosts], pp: int, trace: bool):
        self.env, self.costs, self.pp = env, costs, pp
        self.log: list[tuple] | None = [] if trace else None
        self.ranks = [_Rank(env, s, self.log) for s in range(pp)]
        self.arrivals: dict[tuple, simpy.Event] = {}

    def arrival(self, key: tuple) -> simpy.Event:
        if key not in self.arrivals:
            self.arrivals[key] = self.env.event()
        return self.arrivals[key]

    def send(self, rank: _Rank, stream: str, key: tuple, seconds: float, name: str):
        """A P2P transfer on the sender's stream; the receiver's arrival event fires at its end."""
        yield from rank.hold(stream, name, seconds)
        self.arrival(key).succeed()


def _bucket_reduce(env: simpy.Environment, rank: _Rank, c: StageCosts, start: float,
                   done: simpy.Event):
    # Overlapped DP reduction: bucket i is ready when (i + 1)/n of the last backward is done;
    # the buckets reduce one after another on the dp stream.
    n, t_b = c.dp_buckets, c.bwd_compute_s + c.bwd_comm_s
    for i in range(n):
        ready = start + (i + 1) * t_b / n
        if env.now < ready:
            yield env.timeout(ready - env.now)
        yield from rank.hold("dp", f"dp-bucket{i}", c.dp_comm_s / n)
    done.succeed()


def _log_overlap(pipe: _Pipeline, rank: _Rank, name: str, seconds: float) -> None:
    # Communication hidden under the pass about to start (`StageCosts.fwd_overlap_s`): drawn
    # on the ``overlap`` track from the pass's start; it holds no stream, costs no time.
    if pipe.log is not None and seconds > 0:
        pipe.log.append((rank.stage, "overlap", name, rank.env.now, rank.env.now + seconds))


def _stage_process(env: simpy.Environment, pipe: _Pipeline, stage: int, schedule: str, m: int,
                   virtual_stages: int, overlap_dp: bool):
    pp, last_g, rank = pipe.pp, len(pipe.costs) - 1, pipe.ranks[stage]
    tail = pipe.costs[stage]  # chunk 0: holds this rank's DP / optimizer, runs its last B
    dp_done = env.event()
    order = schedule_order(schedule, pp, m, stage, virtual_stages)
    # The warm-up forwards and cool-down backwards run unpaired (`StageCosts.fwd_unpaired_s`).
    alone = unpaired_passes(schedule, pp, m, stage, virtual_stages)
    for i, (kind, chunk, k) in enumerate(order):
        g = chunk * pp + stage
        c = pipe.costs[g]
        tag = f"{k}" if virtual_stages == 1 else f"{k}.c{chunk}"
        if kind == "F":
            if g > 0:
                yield pipe.arrival(("F", g, k))
            _log_overlap(pipe, rank, f"overlap-F{tag}", c.fwd_overlap_s)
            yield from rank.hold("compute", f"F{tag}", c.fwd_compute_s)
            yield from rank.hold("comm", f"tp-F{tag}", c.fwd_comm_s)
            if i < alone:
                yield from rank.hold("comm", f"a2a-F{tag}", c.fwd_unpaired_s)
            if g < last_g:
                env.process(pipe.send(rank, "p2p-next", ("F", g + 1, k), c.p2p_fwd_s,
                                      f"send-act{tag}"))
        else:
            if g < last_g:
                yield pipe.arrival(("B", g, k))
            if overlap_dp and i == len(order) - 1:
                env.process(_bucket_reduce(env, rank, tail, env.now, dp_done))
            _log_overlap(pipe, rank, f"overlap-B{tag}", c.bwd_overlap_s)
            yield from rank.hold("compute", f"B{tag}", c.bwd_compute_s)
            yield from rank.hold("comm", f"tp-B{tag}", c.bwd_comm_s)
            if i >= len(order) - alone:
                yield from rank.hold("comm", f"a2a-B{tag}", c.bwd_unpaired_s)
            if g > 0:
                env.process(pipe.send(rank, "p2p-prev", ("B", g - 1, k), c.p2p_bwd_s,
                                      f"send-grad{tag}"))
    yield from step_tail(env, rank, tail, overlap_dp, dp_done)


def step_tail(env: simpy.Environment, rank: _Rank, tail: StageCosts, overlap_dp: bool,
              dp_done: simpy.Event):
    """The once-per-step end of a rank (a SimPy generator): the exposed part of the bucketed
    gradient reduction (or all of it), the optimizer, the ZeRO weight gather."""
    if overlap_dp:
        backward_end = env.now
        yield dp_done
        rank.busy["comm"] += env.now - backward_end  # only the exposed part
    else:
        yield from rank.hold("comm", "dp-grad-reduce", tail.dp_comm_s)
    yield from rank.hold("compute", "optimizer", tail.optimizer_s)
    yield from rank.hold("comm", "dp-weight-gather", tail.dp_gather_s)
    rank.finish = env.now


def simulate_pipeline(costs: list[StageCosts], schedule: str, num_microbatches: int,
                      *, virtual_stages: int = 1, trace: bool = False,
                      overlap_dp: bool = False) -> PipelineResult:
    """Run one step of a pipeline whose (virtual) stages cost ``costs`` in SimPy.

    ``costs`` lists pp·virtual_stages entries in pipeline order (entry g on rank g % pp, see
    `simulator.step.costs.stage_costs`). With ``overlap_dp`` the gradient buckets reduce
    during each rank's last backward (as DDP / Megatron's overlap_grad_reduce do once gradient
    accumulation ends); otherwise the whole reduction follows it. Returns the step time (last
    rank to finish) and the busy compute / exposed communication of the critical rank (latest
    finish; ties go to the busier rank); ``events`` is the event log (empty unless ``trace``),
    ordered by start time. Zero-bubble schedules (`planner.spec.ZERO_BUBBLE_SCHEDULES`) are
    `simulator.step.zero_bubble.simulate_schedule`'s, which runs any schedule.

    Raises:
        PlanError: a zero-bubble schedule.

    >>> c = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, p2p_fwd_s=0.5, p2p_bwd_s=0.5)
    >>> simulate_pipeline([c, c], "1f1b", 2).step_time_s  # (m + pp − 1)(F + B) + 2 sends
    10.0
    """
    if schedule in ZERO_BUBBLE_SCHEDULES:
        raise PlanError(f"schedule={schedule!r} splits the backward into B and W: simulate it "
                        f"with simulator.step.zero_bubble.simulate_schedule")
    env = simpy.Environment()
    pp = len(costs) // virtual_stages
    pipe = _Pipeline(env, costs, pp, trace)
    for stage in range(pp):
        env.process(_stage_process(env, pipe, stage, schedule, num_microbatches,
                                   virtual_stages, overlap_dp))
    env.run()
    return pipeline_result(pipe)


def pipeline_result(pipe: _Pipeline, post_validation: bool = False) -> PipelineResult:
    """The `PipelineResult` of a finished SimPy run: the last rank to finish sets the step
    time; the critical rank is the latest to finish (ties go to the busier rank).

    With ``post_validation`` no synchronisation of all stages precedes the optimizer step
    (Qi et al. 2024 §4), so rank r's next step starts once its own step ends and, in steady
    state, steps follow each other every max_r (finish_r − first start_r): the longest span
    of one rank sets the step time and that rank is critical.
    """
    pp, ranks = pipe.pp, pipe.ranks

    def span(r: _Rank) -> float:
        return r.finish - (r.first_compute_s or 0.0) if post_validation else r.finish

    crit = max(range(pp), key=lambda s: (span(ranks[s]),
                                         ranks[s].busy["compute"] + ranks[s].busy["comm"]))
    events = sorted(pipe.log, key=lambda e: (e[3], e[0])) if pipe.log else []
    return PipelineResult(step_time_s=span(ranks[crit]),
                          compute_s=ranks[crit].busy["compute"],
                          comm_s=ranks[crit].busy["comm"], critical_stage=crit, events=events)


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


def unpaired_s(costs: list[StageCosts], schedule: str, num_microbatches: int, stage: int,
               virtual_stages: int = 1) -> float:
    """Seconds pipeline rank ``stage`` adds in its unpaired passes (`unpaired_passes`), each
    its chunk's ``fwd_unpaired_s`` / ``bwd_unpaired_s``.

    >>> c = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, fwd_unpaired_s=0.25,
    ...                bwd_unpaired_s=0.5)
    >>> # 1F1B, pp = 2, m = 3: each rank's first forward and last backward run alone
    >>> unpaired_s([c, c], "1f1b", 3, 0), unpaired_s([c, c], "gpipe", 3, 1)
    (0.75, 2.25)
    """
    pp = len(costs) // virtual_stages
    order = schedule_order(schedule, pp, num_microbatches, stage, virtual_stages)
    alone = unpaired_passes(schedule, pp, num_microbatches, stage, virtual_stages)
    return sum(costs[chunk * pp + stage].fwd_unpaired_s if kind == "F"
               else costs[chunk * pp + stage].bwd_unpaired_s
               for i, (kind, chunk, _) in enumerate(order)
               if i < alone or i >= len(order) - alone)


def estimate_pipeline(costs: list[StageCosts], num_microbatches: int,
                      overlap_dp: bool = False,
                      virtual_stages: int = 1, schedule: str | None = None
                      ) -> tuple[float, float, float]:
    """Closed form of `simulate_pipeline`: ``(step_s, compute_s, comm_s)``.

    With c_g = t_f + t_b of virtual stage g, v chunks per rank and R_r = Σ_{g on rank r} c_g
    (one micro-batch's work on rank r): step = m·max_r R_r + (Σ_r R_r − max_r R_r)/v + P2P
    of one fill and one drain + max_rank(exposed DP + optimizer + weight gather): the busiest
    rank's m rounds plus the fill and drain through the others, 1/v of a round each. For
    equal stages and free P2P this is (m + p − 1)(t_f + t_b) + ... for 1F1B / GPipe and
    (m·v + p − 1)·(t_f + t_b)/v interleaved (Narayanan et al. 2021, §2.2). Each rank's
    unpaired passes (`unpaired_s`; ``schedule`` orders them, default 1F1B or interleaved
    1F1B) add to its m rounds. The critical rank is the busiest one.
    """
    m, v = num_microbatches, virtual_stages
    pp = len(costs) // v
    per_mb = [c.fwd_compute_s + c.bwd_compute_s + c.fwd_comm_s + c.bwd_comm_s for c in costs]
    p2p = sum(c.p2p_fwd_s + c.p2p_bwd_s for c in costs[:pp])
    tails = [exposed_dp_s(c, overlap_dp) + c.optimizer_s + c.dp_gather_s for c in costs[:pp]]
    rank_work = [sum(per_mb[r::pp]) for r in range(pp)]
    alone = [0.0] * pp
    if any(c.fwd_unpaired_s or c.bwd_unpaired_s for c in costs):
        order = schedule or ("interleaved-1f1b" if v > 1 else "1f1b")
        alone = [unpaired_s(costs, order, m, r, v) for r in range(pp)]
    total = [m * w + a for w, a in zip(rank_work, alone, strict=True)]
    crit = max(range(pp), key=total.__getitem__)
    step = total[crit] + (sum(rank_work) - rank_work[crit]) / v + p2p + max(tails)
    mine, tail = costs[crit::pp], costs[crit]
    compute = m * sum(c.fwd_compute_s + c.bwd_compute_s for c in mine) + tail.optimizer_s
    comm = (m * sum(c.fwd_comm_s + c.bwd_comm_s for c in mine) + alone[crit]
            + exposed_dp_s(tail, overlap_dp) + tail.dp_gather_s)
    return step, compute, comm

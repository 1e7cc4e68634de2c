"""Stragglers in the step simulation: slow devices and the TP, PP and DP groups that wait.

A straggler is a rank whose compute runs ``factor`` times slower (a throttled GPU, a noisy
neighbour, a bad core). Its groups wait for it:

- TP and CP: its TP peers (and, with context parallelism, the ranks of its key/value ring)
  meet it at every layer's collective, so the whole TP group, that pipeline
  stage of that DP replica, computes (forward, backward, optimizer) ``factor`` times slower
  (the largest factor in the group wins);
- PP: the other stages of its pipeline wait for that stage's P2P sends, so the steady-state
  rate of the pipeline is the slow stage's;
- DP: the gradient reduction of a stage needs every replica's gradients, so it starts when the
  last replica's backward of that stage ends, and a ZeRO weight all-gather waits for the
  slowest optimizer: the step is the slowest replica's.

Communication times are unchanged (a slow device computes slowly; its links are healthy).

Ranks and their coordinates come from the one mesh layout (`planner.mesh`), which the
runtime's DeviceMesh uses too, so ``rank=R`` here is the process ``--inject slow:rank=R,...``
slows in a run.

The SimPy version (`simulate_with_stragglers`) runs one pipeline per distinct DP replica and
synchronises them at each stage's gradient reduction; the closed form
(`estimate_with_stragglers`) is the slowest replica's `simulator.step.pipeline.estimate_pipeline`
(exact when every straggler sits in one DP replica).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from planner.mesh import chunk_rank, rank_coords
from planner.spec import ZERO_BUBBLE_SCHEDULES, Plan, PlanError
from simulator.step.pipeline import PipelineResult, estimate_pipeline
from simulator.step.stagecosts import StageCosts
from simulator.step.zero_bubble import estimate_zero_bubble, simulate_schedule


def group_slowdowns(plan: Plan, stragglers: Mapping[int, float]) -> dict[tuple[int, int], float]:
    """``{(dp replica, pp stage): factor}`` of the TP groups that hold a straggler (the
    largest factor of the group's ranks).

    >>> group_slowdowns(Plan(tp=2, pp=1, dp=2, micro_batch=1, global_batch=2), {1: 1.5, 2: 3.0})
    {(0, 0): 1.5, (1, 0): 3.0}

    Raises:
        PlanError: a rank that does not exist, or a factor that is not a finite number >= 1.
    """
    slow: dict[tuple[int, int], float] = {}
    for rank, factor in stragglers.items():
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or \
                not math.isfinite(factor) or factor < 1.0:
            raise PlanError(f"straggler factor={factor!r} on rank {rank} must be a finite "
                            "number >= 1 (1 = full speed, 2 = compute twice as slow)")
        try:
            c = rank_coords(plan, rank)
        except PlanError as exc:
            raise PlanError(f"straggler {exc}") from None
        key = (c["dp"], c["pp"])
        slow[key] = max(slow.get(key, 1.0), float(factor))
    return slow


def slowed_costs(costs: list[StageCosts], factors: tuple[float, ...],
                 schedule: str = "1f1b") -> list[StageCosts]:
    """``costs`` (pp·v entries, entry g on pipeline rank `planner.mesh.chunk_rank`: g % pp,
    or a V under ZB-V / DualPipe-V) with pipeline rank s's compute (forward, backward,
    optimizer) stretched by ``factors[s]``; communication kept.

    >>> slowed_costs([StageCosts(fwd_compute_s=1, bwd_compute_s=2, fwd_comm_s=5)], (3.0,))[0]
    ... # doctest: +NORMALIZE_WHITESPACE
    StageCosts(fwd_compute_s=3.0, bwd_compute_s=6.0, fwd_comm_s=5, bwd_comm_s=0.0,
               p2p_fwd_s=0.0, p2p_bwd_s=0.0, dp_comm_s=0.0, dp_buckets=1, dp_gather_s=0.0,
               optimizer_s=0.0, wgrad_s=0.0, fwd_overlap_s=0.0, bwd_overlap_s=0.0,
               fwd_unpaired_s=0.0, bwd_unpaired_s=0.0)
    """
    pp = len(factors)
    f = [factors[chunk_rank(schedule, pp, g)] for g in range(len(costs))]
    return [dataclasses.replace(c, fwd_compute_s=c.fwd_compute_s * f[g],
                                bwd_compute_s=c.bwd_compute_s * f[g],
                                optimizer_s=c.optimizer_s * f[g], wgrad_s=c.wgrad_s * f[g])
            if f[g] != 1.0 else c for g, c in enumerate(costs)]


def replica_profiles(plan: Plan, stragglers: Mapping[int, float]) -> list[tuple[float, ...]]:
    """The distinct per-stage slowdowns of the DP replicas (a healthy replica is all 1.0)."""
    slow = group_slowdowns(plan, stragglers)
    replicas = {d for d, _ in slow}
    profiles = {tuple(slow.get((d, s), 1.0) for s in range(plan.pp)) for d in replicas}
    if len(replicas) < plan.dp:
        profiles.add((1.0,) * plan.pp)
    return sorted(profiles)


def _backward_ends(costs: list[StageCosts], plan: Plan
                   ) -> tuple[list[float], list[dict], list[tuple]]:
    """SimPy run of one replica up to its last backward: per stage (end of the last backward,
    busy compute / comm), and the event log. The DP tail is zeroed here and added by the
    caller, synchronised over the replicas."""
    bare = [dataclasses.replace(c, dp_comm_s=0.0, optimizer_s=0.0, dp_gather_s=0.0)
            for c in costs]
    run = simulate_schedule(bare, plan.schedule, plan.num_microbatches,
                            virtual_stages=plan.virtual_stages, trace=True)
    ends, busy = [0.0] * plan.pp, [{"compute": 0.0, "comm": 0.0} for _ in range(plan.pp)]
    for stage, stream, _, start, end in run.events:
        if stream in ("compute", "comm"):
            ends[stage] = max(ends[stage], end)
            busy[stage][stream] += end - start
    return ends, busy, run.events


def _reduce_end(stage_costs: StageCosts, replicas: list[tuple[float, float]],
                overlap_dp: bool, log: list | None, stage: int) -> float:
    """End of stage's gradient reduction over replicas given as (backward end, last-backward
    duration t_b). Overlapped: bucket i is ready once every replica has done (i + 1)/n of its
    last backward; buckets reduce in order (as `simulator.step.pipeline.exposed_dp_s`)."""
    c = stage_costs
    if not overlap_dp:
        start = max(end for end, _ in replicas)
        if log is not None and c.dp_comm_s > 0:
            log.append((stage, "comm", "dp-grad-reduce", start, start + c.dp_comm_s))
        return start + c.dp_comm_s
    n, t = c.dp_buckets, 0.0
    for i in range(n):
        ready = max(end - t_b + (i + 1) * t_b / n for end, t_b in replicas)
        begin = max(t, ready)
        t = begin + c.dp_comm_s / n
        if log is not None and c.dp_comm_s > 0:
            log.append((stage, "dp", f"dp-bucket{i}", begin, t))
    return max(t, max(end for end, _ in replicas))


def simulate_with_stragglers(costs: list[StageCosts], plan: Plan,
                             stragglers: Mapping[int, float], *, trace: bool = False,
                             overlap_dp: bool = False) -> PipelineResult:
    """SimPy step of ``plan`` (per-stage ``costs`` of `simulator.step.costs.stage_costs`) with
    slow ranks ``stragglers`` (rank -> compute slowdown factor >= 1); see the module docstring.

    Every distinct replica runs its pipeline in SimPy up to its last backward; then, per
    stage s, the gradient reduction starts when the last replica's backward of s ends (or,
    overlapped, bucket by bucket as every replica's buckets become ready), each rank runs its
    optimizer at its own pace, and a ZeRO weight all-gather starts after the slowest optimizer
    of the stage. The step ends with the last rank. ``compute_s`` / ``comm_s`` are the critical
    rank's busy compute (optimizer included) and exposed communication (TP, DP reduction after
    the last replica's backward, weight gather); waiting for other replicas is bubble. Events
    (``trace``) are the critical replica's pipeline plus the DP tail of each of its stages.

    With no straggler in effect (every factor 1) this equals `simulate_pipeline`.

    Raises:
        PlanError: a straggler rank that does not exist or a factor below 1.
    """
    replicas = {p: slowed_costs(costs, p, plan.schedule)
                for p in replica_profiles(plan, stragglers)}
    return simulate_replicas(replicas, costs, plan, trace=trace, overlap_dp=overlap_dp)


def simulate_replicas(replicas: Mapping[object, list[StageCosts]], tail: list[StageCosts],
                      plan: Plan, *, trace: bool = False,
                      overlap_dp: bool = False) -> PipelineResult:
    """SimPy step over the distinct DP replicas ``replicas`` (key -> that replica's pp·v
    `StageCosts`, its compute and communication already slowed), synchronised at each
    stage's gradient reduction, whose times (``dp_comm_s``, ``dp_buckets``,
    ``dp_gather_s``) come from ``tail[s]`` (one collective over every replica); each replica
    runs its own optimizer (``optimizer_s`` of its entry s). See `simulate_with_stragglers`.
    """
    pp = plan.pp
    runs = {k: _backward_ends(rc, plan) for k, rc in replicas.items()}
    log: list | None = [] if trace else None
    finish: dict[tuple[object, int], float] = {}
    tails: dict[int, tuple[float, float, float]] = {}   # stage -> (reduce end, last bwd, opt)
    for s in range(pp):
        c = tail[s]
        ends = [(runs[k][0][s], rc[s].bwd_compute_s + rc[s].bwd_comm_s)
                for k, rc in replicas.items()]
        reduce_end = _reduce_end(c, ends, overlap_dp, log, s)
        opt_end = {k: reduce_end + rc[s].optimizer_s for k, rc in replicas.items()}
        slowest = max(opt_end.values())
        for k in replicas:
            finish[(k, s)] = slowest + c.dp_gather_s if c.dp_gather_s > 0 else opt_end[k]
        tails[s] = (reduce_end, max(end for end, _ in ends), slowest)

    def busy(key):
        k, s = key
        b = runs[k][1][s]
        return b["compute"] + b["comm"]

    crit_k, crit_s = max(finish, key=lambda k: (finish[k], busy(k)))
    c, b = tail[crit_s], runs[crit_k][1][crit_s]
    reduce_end, last_bwd, _ = tails[crit_s]
    exposed_dp = c.dp_comm_s if not overlap_dp else reduce_end - last_bwd
    compute = b["compute"] + replicas[crit_k][crit_s].optimizer_s
    comm = b["comm"] + exposed_dp + c.dp_gather_s
    events: list[tuple] = []
    if trace:
        for s in range(pp):
            end = tails[s][0]
            opt = replicas[crit_k][s].optimizer_s
            if opt > 0:
                log.append((s, "compute", "optimizer", end, end + opt))
            if tail[s].dp_gather_s > 0:
                log.append((s, "comm", "dp-weight-gather", tails[s][2], finish[(crit_k, s)]))
        events = sorted(runs[crit_k][2] + log, key=lambda e: (e[3], e[0]))
    return PipelineResult(step_time_s=max(finish.values()), compute_s=compute, comm_s=comm,
                          critical_stage=crit_s, events=events)


def estimate_with_stragglers(costs: list[StageCosts], plan: Plan,
                             stragglers: Mapping[int, float], *,
                             overlap_dp: bool = False) -> tuple[float, float, float]:
    """Closed form of `simulate_with_stragglers`: ``(step_s, compute_s, comm_s)`` of the
    slowest replica's `simulator.step.pipeline.estimate_pipeline` over its slowed costs.

    Exact (as exact as `estimate_pipeline`) when the stragglers sit in one DP replica; with
    stragglers in several replicas and different stages it leaves out that each stage's
    reduction waits for the latest replica of that stage (the SimPy version includes it).

    Raises:
        PlanError: as `simulate_with_stragglers`.
    """
    if plan.schedule in ZERO_BUBBLE_SCHEDULES:
        return max(estimate_zero_bubble(slowed_costs(costs, p, plan.schedule), plan.schedule,
                                        plan.num_microbatches, overlap_dp, plan.virtual_stages)
                   for p in replica_profiles(plan, stragglers))
    replicas = [slowed_costs(costs, p, plan.schedule) for p in replica_profiles(plan, stragglers)]
    return estimate_replicas(replicas, costs, plan, overlap_dp=overlap_dp)


def estimate_replicas(replicas: list[list[StageCosts]], tail: list[StageCosts], plan: Plan,
                      *, overlap_dp: bool = False) -> tuple[float, float, float]:
    """Closed form of `simulate_replicas`: the slowest replica's
    `simulator.step.pipeline.estimate_pipeline`, each replica's stage s reducing with
    ``tail[s]``'s DP times."""
    pp = plan.pp
    results = []
    for rc in replicas:
        own = [dataclasses.replace(c, dp_comm_s=tail[g].dp_comm_s,
                                   dp_buckets=tail[g].dp_buckets,
                                   dp_gather_s=tail[g].dp_gather_s)
               if g < pp and c is not tail[g] else c for g, c in enumerate(rc)]
        results.append(estimate_pipeline(own, plan.num_microbatches, overlap_dp,
                                         plan.virtual_stages, plan.schedule))
    return max(results)

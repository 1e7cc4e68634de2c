"""Plan search: enumerate every plan of a `SearchSpace` (tp × pp × dp, micro-batch, virtual
stages, schedule, recomputation, ZeRO stage, sequence parallelism, placement), reject the illegal
and out-of-memory ones with a reason, rank the rest.

Two tiers: the analytical `simulator.step.simulate.estimate` screens every candidate that fits
in memory, then the SimPy `simulator.step.simulate.simulate` refines the best ``top_k`` and the
final ranking puts the refined rows first. When nothing fits, `SearchResult.infeasible` says
which plans came closest, what they would need and which constraint blocks them
(`planner.infeasible`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from planner.precision import search_dtypes
from planner.space import Rejection, SearchSpace, enumerate_candidates
from planner.spec import MEMORY_HEADROOM, ModelSpec, Plan, PlanError
from simulator.network.cluster import Cluster
from simulator.step.costs import (
    DEFAULT_OPTIONS,
    SimOptions,
    compute_lower_bounds_s,
    step_lower_bound_s,
)
from simulator.step.memory import MemoryBreakdown, worst_stage_memory
from simulator.step.simulate import StepPrediction, estimate, simulate

RANKED_COLUMNS = ["id", "tp", "pp", "dp", "cp", "micro_batch", "global_batch", "recompute",
                  "sequence_parallel", "step_time_s", "tokens_per_s", "mfu", "hfu",
                  "peak_memory_bytes", "tier", "schedule", "virtual_stages", "zero_stage",
                  "placement", "ep", "etp", "dtype"]
REJECTED_COLUMNS = ["id", "reason", "kind"]
GiB = 2**30
#: Out-of-memory plans kept as the "closest" answer when nothing fits.
CLOSEST_KEPT = 5
#: Candidates (and estimates) between two calls of a search's ``progress``.
PROGRESS_EVERY = 2000
#: The SimPy tier simulates at most this many times top_k extra plans (see `refine`).
EXTRA_REFINE = 2
#: Plans with more micro-batches per step than this keep their closed-form estimate: SimPy
#: cost grows with the micro-batch count, and past the fill and drain every 1F1B round is the
#: same, where the closed form follows SimPy within 1% (docs/planner.md, "Simulator speed").
MAX_SIMULATED_MICROBATCHES = 256


@dataclass(frozen=True)
class SearchResult:
    """What a search found.

    Attributes:
        ranked: one row per legal plan, best (highest tokens/s) first; columns `RANKED_COLUMNS`.
        rejected: one row per rejected candidate or branch with its reason; columns
            `REJECTED_COLUMNS` (kind: tp, layers, batch, schedule, devices, memory).
        plans: the `Plan` of each ranked row, keyed by plan id.
        predictions: the best prediction of each ranked row (simulated where refined).
        infeasible: when no plan is legal and fits, the closest plans and what blocks them.
        stats: candidates seen, plans estimated / simulated, the wall time of each tier and
            the CPU time of the analytical one.
    """

    ranked: pd.DataFrame
    rejected: pd.DataFrame
    plans: dict[str, Plan]
    predictions: dict[str, StepPrediction]
    infeasible: object | None = None
    stats: dict = field(default_factory=dict)

    @property
    def best(self) -> Plan:
        """The best plan.

        Raises:
            PlanError: no candidate was legal; the message lists the commonest reasons.
        """
        if self.ranked.empty:
            reasons = self.rejected["reason"].value_counts().head(3)
            raise PlanError("no legal plan: " + "; ".join(
                f"{n}x {reason}" for reason, n in reasons.items()))
        return self.plans[self.ranked.iloc[0]["id"]]


def memory_reason(need: MemoryBreakdown, stage: int, limit_bytes: float) -> str:
    """The out-of-memory reason with the breakdown of the worst stage; the need and the limit
    get as many decimals as it takes to tell them apart, and the overrun is stated.

    >>> need = MemoryBreakdown(weights_bytes=70.83 * GiB, gradients_bytes=0, optimizer_bytes=0,
    ...                        activations_bytes=0, overhead_bytes=0)
    >>> memory_reason(need, 0, 70.78 * GiB)[:86]
    'out of memory: stage 0 needs 70.83 GiB, device has 70.78 GiB usable, 51.2 MiB over (we'
    """
    over = need.total_bytes - limit_bytes
    digits = next((d for d in (1, 2, 3) if round(need.total_bytes / GiB, d)
                   != round(limit_bytes / GiB, d)), 3)
    over_text = (f"{over / GiB:.1f} GiB" if over >= GiB else f"{over / 2**20:.1f} MiB")
    return (f"out of memory: stage {stage} needs {need.total_bytes / GiB:.{digits}f} GiB, "
            f"device has {limit_bytes / GiB:.{digits}f} GiB usable, {over_text} over "
            f"(weights {need.weights_bytes / GiB:.1f}, "
            f"gradients {need.gradients_bytes / GiB:.1f}, optimizer "
            f"{need.optimizer_bytes / GiB:.1f}, activations {need.activations_bytes / GiB:.1f}, "
            f"overhead {need.overhead_bytes / GiB:.1f})")


def worst_stage(model: ModelSpec, plan: Plan) -> tuple[int, MemoryBreakdown]:
    """(stage, breakdown) of the pipeline stage that needs the most memory."""
    return worst_stage_memory(model, plan, attention=DEFAULT_OPTIONS.attention)


def out_of_memory_reason(model: ModelSpec, plan: Plan, cluster: Cluster,
                         headroom: float) -> str:
    """'' if every stage fits in ``headroom`` × device memory, else the reason with the breakdown."""
    limit = cluster.device.memory_bytes * headroom
    stage, need = worst_stage(model, plan)
    return "" if need.total_bytes <= limit else memory_reason(need, stage, limit)


def _memory_key(plan: Plan) -> tuple:
    # Memory does not depend on placement: the cache key is every other field.
    return (plan.tp, plan.pp, plan.dp, plan.cp, plan.micro_batch, plan.global_batch, plan.schedule,
            plan.virtual_stages, plan.recompute, plan.recompute_num_layers, plan.zero_stage,
            plan.sequence_parallel, plan.dtype, plan.ep, plan.etp)


def resolve_global_batch(model: ModelSpec, global_batch: int | None,
                         global_batch_tokens: int | None) -> int:
    """Sequences per step from ``global_batch`` (sequences) or ``global_batch_tokens``.

    Raises:
        PlanError: neither or both given, not positive, or tokens not a multiple of seq_len.
    """
    if (global_batch is None) == (global_batch_tokens is None):
        raise PlanError("give exactly one of global_batch (sequences) and global_batch_tokens")
    if global_batch_tokens is not None:
        if global_batch_tokens < 1 or global_batch_tokens % model.seq_len:
            raise PlanError(f"global_batch_tokens={global_batch_tokens} must be a positive "
                            f"multiple of seq_len={model.seq_len}")
        return global_batch_tokens // model.seq_len
    if global_batch < 1:
        raise PlanError(f"global_batch={global_batch} must be a positive integer")
    return global_batch


def _device_bounds(cluster: Cluster, num_devices: int | None,
                   max_devices: int | None) -> tuple[int | None, int | None]:
    if num_devices is not None and max_devices is not None:
        raise PlanError("give at most one of num_devices (use exactly) and max_devices "
                        "(use at most)")
    n = num_devices if num_devices is not None else max_devices
    if n is None:
        return cluster.num_devices, None
    if n < 1 or n > cluster.num_devices:
        name = "num_devices" if num_devices is not None else "max_devices"
        raise PlanError(f"{name}={n} must be between 1 and the cluster's "
                        f"{cluster.num_devices} devices")
    return num_devices, max_devices


def _space(space: SearchSpace | None, micro_batches, recompute) -> SearchSpace:
    space = space or SearchSpace()
    if micro_batches is not None:
        space = space.replace(micro_batch=tuple(micro_batches))
    if recompute is not None:
        space = space.replace(recompute=tuple(recompute))
    return space


def _row(plan: Plan, pred: StepPrediction, tier: str) -> dict:
    return {"id": plan.id, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "cp": plan.cp,
            "micro_batch": plan.micro_batch, "global_batch": plan.global_batch,
            "recompute": plan.recompute, "sequence_parallel": plan.sequence_parallel,
            "step_time_s": pred.step_time_s, "tokens_per_s": pred.tokens_per_s,
            "mfu": pred.mfu, "hfu": pred.hfu, "peak_memory_bytes": pred.peak_memory_bytes,
            "tier": tier, "schedule": plan.schedule, "virtual_stages": plan.virtual_stages,
            "zero_stage": plan.zero_stage, "placement": ".".join(plan.placement),
            "ep": plan.ep, "etp": plan.etp, "dtype": plan.dtype}


def screen(model: ModelSpec, cluster: Cluster, space: SearchSpace, *, global_batch: int,
           num_devices: int | None, max_devices: int | None, memory_headroom: float,
           dtype: str, overlap_dp: bool = False, prune: int | None = None,
           progress: Callable[[str], None] | None = None,
           options: SimOptions = DEFAULT_OPTIONS):
    """The analytical tier: ``(screened, rejected, closest, candidates, fitting)``;
    ``progress`` (if given) is called with a one-line status every `PROGRESS_EVERY`
    candidates and estimates.

    screened: ``(plan, estimate)`` of every legal plan that fits (with ``prune``, of those
    `prune_by_bound` costs), in enumeration order; rejected: rows with reasons;
    closest: the `CLOSEST_KEPT` out-of-memory plans that need least, as ``(need_bytes, id,
    plan, stage, breakdown)``; candidates: plans plus rejected branches seen; fitting: every
    legal plan that fits, costed or not, in enumeration order.
    """
    limit = cluster.device.memory_bytes * memory_headroom
    rejected: list[dict] = []
    fitting: list[Plan] = []
    closest: list[tuple] = []
    memo: dict[tuple, tuple[int, MemoryBreakdown]] = {}
    candidates = 0
    for item in enumerate_candidates(model, space, devices_per_node=cluster.devices_per_node,
                                     global_batch=global_batch, dtype=dtype,
                                     num_devices=num_devices, max_devices=max_devices):
        candidates += 1
        if progress is not None and candidates % PROGRESS_EVERY == 0:
            progress(f"{dtype}: {candidates:,} candidates walked, {len(fitting):,} fit")
        if isinstance(item, Rejection):
            rejected.append({"id": item.id, "reason": item.reason, "kind": item.kind})
            continue
        key = _memory_key(item)
        if key not in memo:
            memo[key] = worst_stage(model, item)
        stage, need = memo[key]
        if need.total_bytes > limit:
            rejected.append({"id": item.id, "reason": memory_reason(need, stage, limit),
                             "kind": "memory"})
            entry = (-need.total_bytes, item.id, item, stage, need)
            if len(closest) < CLOSEST_KEPT:
                heapq.heappush(closest, entry)
            elif entry > closest[0]:
                heapq.heapreplace(closest, entry)
            continue
        fitting.append(item)
    closest = [(-e[0], *e[1:]) for e in sorted(closest, reverse=True)]
    if prune is None:
        screened = []
        for i, p in enumerate(fitting, start=1):
            if progress is not None and i % PROGRESS_EVERY == 0:
                progress(f"{dtype}: estimated {i:,} of {len(fitting):,} plans that fit")
            screened.append((p, estimate(model, p, cluster, overlap_dp=overlap_dp, options=options)))
    else:
        screened = prune_by_bound(model, cluster, fitting, prune, overlap_dp, options)
    return screened, rejected, closest, candidates, fitting


def prune_by_bound(model: ModelSpec, cluster: Cluster, plans: list[Plan], keep: int,
                   overlap_dp: bool = False, options: SimOptions = DEFAULT_OPTIONS
                   ) -> list[tuple[Plan, StepPrediction]]:
    """``(plan, estimate)`` of the plans that can be among the ``keep`` fastest, in the order
    of ``plans``: branch and bound on the step time.

    Every plan gets its compute-only lower bound (`simulator.step.costs.step_lower_bound_s`,
    no communication); plans are costed in order of that bound, and once ``keep`` estimates
    are known, a plan whose bound exceeds the ``keep``-th best step time (with a 1e-9
    relative margin for rounding) is never costed, nor is any after it. The plans of one
    search share the global batch, so a slower step is a lower tokens/s: the ``keep`` best
    estimates, and their order, are those of costing every plan.

    Raises:
        PlanError: ``keep`` < 1.
    """
    if keep < 1:
        raise PlanError(f"prune={keep} must be >= 1 (plans kept by the bound); leave it unset "
                        f"to cost every plan")
    bounds = sorted((step_lower_bound_s(model, p, cluster, options), i) for i, p in enumerate(plans))
    best: list[float] = []  # max-heap (negated) of the `keep` best step times so far
    costed: list[tuple[int, StepPrediction]] = []
    for bound, i in bounds:
        if len(best) == keep and bound > -best[0] * (1 + 1e-9):
            break
        pred = estimate(model, plans[i], cluster, overlap_dp=overlap_dp, options=options)
        costed.append((i, pred))
        if len(best) < keep:
            heapq.heappush(best, -pred.step_time_s)
        elif pred.step_time_s < -best[0]:
            heapq.heapreplace(best, -pred.step_time_s)
    return [(plans[i], pred) for i, pred in sorted(costed, key=lambda c: c[0])]


def refine(model: ModelSpec, cluster: Cluster, screened: list[tuple[Plan, StepPrediction]],
           top_k: int, overlap_dp: bool = False, *, pruned: list[Plan] = (),
           order: Callable[[tuple[Plan, StepPrediction]], tuple] | None = None,
           options: SimOptions = DEFAULT_OPTIONS
           ) -> tuple[dict[str, StepPrediction], list[tuple[Plan, StepPrediction]]]:
    """The SimPy tier: simulate the ``top_k`` best estimates, then (up to `EXTRA_REFINE` ×
    ``top_k`` more) every plan whose lower bound beats the k-th best simulated plan.
    Returns ``(simulated by plan id, recovered)``.

    ``screened`` is sorted best first. The lower bound of a step is the busy time of the
    estimate's critical rank (compute_s + comm_s): no schedule runs a rank's work faster. The
    closed form follows the SimPy run within about 1% on the reference runs but is not exact
    (event order, P2P waits, straggling replicas); this second pass keeps a plan it overrates
    from being lost.

    ``pruned``: plans the screen did not cost (`prune_by_bound`). Those whose compute-only
    busy bound (`simulator.step.costs.compute_lower_bounds_s`) is below the k-th simulated
    step could be in the second pass, so they are costed first (``recovered``, as
    ``(plan, estimate)``) and merged into ``screened`` by ``order`` (the sort key that
    ranked it): the second pass then sees what it sees without pruning.
    """
    screened = [(p, e) for p, e in screened if p.num_microbatches <= MAX_SIMULATED_MICROBATCHES]
    sims = {p.id: simulate(model, p, cluster, overlap_dp=overlap_dp, options=options) for p, _ in
            screened[:top_k]}
    recovered: list[tuple[Plan, StepPrediction]] = []
    if sims and pruned:
        kth = sorted(s.step_time_s for s in sims.values())[-1]
        recovered = [(p, estimate(model, p, cluster, overlap_dp=overlap_dp, options=options)) for p in pruned
                     if p.num_microbatches <= MAX_SIMULATED_MICROBATCHES
                     and compute_lower_bounds_s(model, p, cluster, options)[1] < kth]
        screened = sorted(screened + recovered, key=order)
    if not sims or len(screened) <= top_k:
        return sims, recovered
    kth = sorted(s.step_time_s for s in sims.values())[-1]
    rest = sorted((e.compute_s + e.comm_s, i) for i, (_, e) in enumerate(screened[top_k:],
                                                                         start=top_k))
    for bound, i in rest[:EXTRA_REFINE * top_k]:
        if bound >= kth:
            break
        plan = screened[i][0]
        sims[plan.id] = simulate(model, plan, cluster, overlap_dp=overlap_dp, options=options)
    return sims, recovered


def search(model: ModelSpec, cluster: Cluster, *, global_batch: int | None = None,
           global_batch_tokens: int | None = None, num_devices: int | None = None,
           max_devices: int | None = None, top_k: int = 20, memory_headroom: float = MEMORY_HEADROOM,
           dtype: str | None = None, micro_batches: tuple[int, ...] | None = None,
           recompute: tuple[str, ...] | None = None, space: SearchSpace | None = None,
           overlap_dp: bool = False, explain: bool = True,
           prune: int | None = None,
           progress: Callable[[str], None] | None = None,
           options: SimOptions = DEFAULT_OPTIONS) -> SearchResult:
    """Search every plan of ``space`` for ``model`` on ``cluster``; rank by predicted tokens/s.

    Args:
        model: the model (its ``seq_len`` is the training sequence length).
        cluster: the cluster; all its devices are used unless ``num_devices`` (exactly that
            many) or ``max_devices`` (at most that many) is given.
        global_batch / global_batch_tokens: the step's batch in sequences or in tokens.
        top_k: how many of the best analytical estimates the SimPy simulation refines.
        memory_headroom: fraction of device memory a plan may use.
        dtype: the plan dtype or low-precision recipe (`planner.precision.PLAN_DTYPES`);
            ``any`` searches every one the device runs; default the cluster's.
        micro_batches, recompute: shorthands for the same fields of ``space``.
        space: allowed values per plan field (`SearchSpace`; default: every legal value).
        overlap_dp: overlap the DP gradient reduction with the last backward in both tiers.
        explain: when nothing fits, work out the closest plans and the blocking constraint.
        prune: cost only the plans that can be among the ``prune`` fastest estimates
            (`prune_by_bound`; at least (1 + `EXTRA_REFINE`) × ``top_k`` are kept so the
            SimPy tier sees the same candidates); the ranked table then holds the plans
            costed, and ``stats["pruned"]`` counts the others. None: cost every plan.
        progress: called with a one-line status while the search runs (`screen`).
        options: the framework behaviour both tiers cost plans with (`SimOptions`; e.g. a
            framework family's, `simulator.validation.validate.framework_options`); default
            `DEFAULT_OPTIONS`. Memory is counted as for `DEFAULT_OPTIONS`.
    Returns:
        A `SearchResult`; its ``ranked`` table is sorted best first.
    Raises:
        PlanError: a bad batch, device count, headroom or space, or a dtype the device
            cannot run (`planner.precision.unsupported_dtype_reason`).
    """
    gb = resolve_global_batch(model, global_batch, global_batch_tokens)
    if prune is not None and (isinstance(prune, bool) or not isinstance(prune, int)
                              or prune < 1):
        raise PlanError(f"prune={prune!r} must be an integer >= 1 (plans kept by the bound); "
                        f"leave it unset to cost every plan")
    if not 0 < memory_headroom <= 1:
        raise PlanError(f"memory_headroom={memory_headroom} must be in (0, 1]")
    exact, most = _device_bounds(cluster, num_devices, max_devices)
    space = _space(space, micro_batches, recompute)
    dtypes = search_dtypes(dtype or cluster.default_dtype, cluster.device.name,
                           cluster.device.peak_flops)
    dtype = dtypes[0]
    t0, c0 = time.perf_counter(), time.process_time()
    keep = None if prune is None else max(prune, (1 + EXTRA_REFINE) * top_k)
    screened, rejected, closest, candidates, fitting = [], [], [], 0, []
    for dt in dtypes:   # `--dtype any`: every precision the device runs, ranked together
        # (with ``prune``, the best of all dtypes are among the best of each)
        s_dt, r_dt, c_dt, n_dt, f_dt = screen(
            model, cluster, space, global_batch=gb, num_devices=exact, max_devices=most,
            memory_headroom=memory_headroom, dtype=dt, overlap_dp=overlap_dp, prune=keep,
            progress=progress, options=options)
        screened, rejected, candidates = screened + s_dt, rejected + r_dt, candidates + n_dt
        fitting += f_dt
        closest = sorted(closest + c_dt, key=lambda e: e[0])[:CLOSEST_KEPT]
    t1, c1 = time.perf_counter(), time.process_time()
    # Best first; among equal speeds the plan that needs less memory, then the first seen.
    position = {p.id: i for i, p in enumerate(fitting)}

    def order(pair: tuple[Plan, StepPrediction]) -> tuple:
        return -pair[1].tokens_per_s, pair[1].peak_memory_bytes, position[pair[0].id]

    screened.sort(key=order)
    costed = {p.id for p, _ in screened}
    refined, recovered = refine(model, cluster, screened, top_k, overlap_dp,
                                pruned=[p for p in fitting if p.id not in costed],
                                order=order, options=options)
    if recovered:
        screened = sorted(screened + recovered, key=order)
    rows, plans, preds = [], {}, {}
    for plan, pred in screened:
        tier = "estimated"
        if plan.id in refined:
            pred, tier = refined[plan.id], "simulated"
        rows.append(_row(plan, pred, tier))
        plans[plan.id], preds[plan.id] = plan, pred
    t2 = time.perf_counter()
    ranked = pd.DataFrame(rows, columns=RANKED_COLUMNS)
    if not ranked.empty:
        # Refined rows first (their numbers are the better ones), each tier by tokens/s.
        ranked = ranked.assign(_refined=ranked["tier"] == "simulated").sort_values(
            ["_refined", "tokens_per_s", "peak_memory_bytes"], ascending=[False, False, True],
            kind="stable"
        ).drop(columns="_refined").reset_index(drop=True)
    rejected_df = pd.DataFrame(rejected, columns=REJECTED_COLUMNS)
    infeasible = None
    if ranked.empty and explain:
        from planner.infeasible import explain_infeasible
        infeasible = explain_infeasible(
            model, cluster, space, global_batch=gb, num_devices=exact, max_devices=most,
            memory_headroom=memory_headroom, dtype=dtype, closest=closest,
            rejected=rejected_df)
    stats = {"candidates": candidates, "estimated": len(screened),
             "pruned": candidates - len(rejected) - len(screened),
             "simulated": len(refined), "rejected": len(rejected),
             "analytical_s": t1 - t0, "simulation_s": t2 - t1, "analytical_cpu_s": c1 - c0,
             "total_s": time.perf_counter() - t0}
    return SearchResult(ranked=ranked, rejected=rejected_df, plans=plans, predictions=preds,
                        infeasible=infeasible, stats=stats)

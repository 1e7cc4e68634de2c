"""Plan search: enumerate every tp × pp × dp split (and micro-batch, recomputation, sequence
parallelism), reject the illegal and out-of-memory ones with a reason, rank the rest.

Two tiers: the analytical `simulator.estimate` screens every candidate, then the SimPy
`simulator.simulate` refines the best ``top_k`` and the final ranking uses the refined numbers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pandas as pd

from planner.spec import ModelSpec, Plan, PlanError, check_plan, divisors
from simulator.cluster import Cluster
from simulator.memory import memory_per_stage
from simulator.simulate import StepPrediction, estimate, simulate

RANKED_COLUMNS = ["id", "tp", "pp", "dp", "micro_batch", "global_batch", "recompute",
                  "sequence_parallel", "step_time_s", "tokens_per_s", "mfu", "hfu",
                  "peak_memory_bytes", "tier"]
REJECTED_COLUMNS = ["id", "reason"]
GiB = 2**30


@dataclass(frozen=True)
class SearchResult:
    """What a search found.

    Attributes:
        ranked: one row per legal plan, best (highest tokens/s) first; columns `RANKED_COLUMNS`.
        rejected: one row per rejected candidate with its reason; columns `REJECTED_COLUMNS`.
        plans: the `Plan` of each ranked row, keyed by plan id.
        predictions: the best prediction of each ranked row (simulated where refined).
    """

    ranked: pd.DataFrame
    rejected: pd.DataFrame
    plans: dict[str, Plan]
    predictions: dict[str, StepPrediction]

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


def candidate_plans(model: ModelSpec, cluster: Cluster, *, global_batch: int,
                    num_devices: int | None = None, dtype: str | None = None,
                    micro_batches: tuple[int, ...] = (1, 2, 4, 8),
                    recompute: tuple[str, ...] = ("none", "selective", "full"),
                    ) -> list[tuple[str, Plan | None, str]]:
    """Every candidate as ``(id, plan or None, reason if rejected else '')``.

    tp ranges over the divisors of the devices per node (tensor parallelism stays inside the
    NVSwitch domain, as Megatron recommends, Narayanan et al. 2021 §3.3), pp over the divisors of
    the remaining devices, dp fills the rest; micro-batch sizes, recomputation policies and
    sequence parallelism (tp > 1) are crossed with each split.
    """
    n = cluster.num_devices if num_devices is None else num_devices
    if n < 1 or n > cluster.num_devices:
        raise PlanError(f"num_devices={n} must be between 1 and the cluster's "
                        f"{cluster.num_devices} devices")
    dtype = dtype or cluster.default_dtype
    out: list[tuple[str, Plan | None, str]] = []
    for tp in divisors(cluster.devices_per_node):
        if n % tp:
            continue
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            if pp > model.num_layers:
                continue
            sps = (False, True) if tp > 1 else (False,)
            for mb, rc, sp in itertools.product(micro_batches, recompute, sps):
                cid = f"tp{tp}-pp{pp}-dp{dp}-mb{mb}-gb{global_batch}" + \
                    ("" if rc == "none" else f"-ac-{rc}") + ("-sp" if sp else "")
                try:
                    plan = Plan(tp=tp, pp=pp, dp=dp, micro_batch=mb, global_batch=global_batch,
                                recompute=rc, sequence_parallel=sp, dtype=dtype)
                    check_plan(model, plan, world_size=n)
                except PlanError as exc:
                    out.append((cid, None, str(exc)))
                    continue
                out.append((plan.id, plan, ""))
    return out


def out_of_memory_reason(model: ModelSpec, plan: Plan, cluster: Cluster,
                         headroom: float) -> str:
    """'' if every stage fits in ``headroom`` × device memory, else the reason with the breakdown."""
    limit = cluster.device.memory_bytes * headroom
    stages = memory_per_stage(model, plan)
    worst = max(range(len(stages)), key=lambda i: stages[i].total_bytes)
    need = stages[worst]
    if need.total_bytes <= limit:
        return ""
    return (f"out of memory: stage {worst} needs {need.total_bytes / GiB:.1f} GiB, device has "
            f"{limit / GiB:.1f} GiB usable (weights {need.weights_bytes / GiB:.1f}, gradients "
            f"{need.gradients_bytes / GiB:.1f}, optimizer {need.optimizer_bytes / GiB:.1f}, "
            f"activations {need.activations_bytes / GiB:.1f}, overhead "
            f"{need.overhead_bytes / GiB:.1f})")


def _row(plan: Plan, pred: StepPrediction, tier: str) -> dict:
    return {"id": plan.id, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp,
            "micro_batch": plan.micro_batch, "global_batch": plan.global_batch,
            "recompute": plan.recompute, "sequence_parallel": plan.sequence_parallel,
            "step_time_s": pred.step_time_s, "tokens_per_s": pred.tokens_per_s,
            "mfu": pred.mfu, "hfu": pred.hfu, "peak_memory_bytes": pred.peak_memory_bytes,
            "tier": tier}


def search(model: ModelSpec, cluster: Cluster, *, global_batch: int,
           num_devices: int | None = None, top_k: int = 20, memory_headroom: float = 0.95,
           dtype: str | None = None, micro_batches: tuple[int, ...] = (1, 2, 4, 8),
           recompute: tuple[str, ...] = ("none", "selective", "full")) -> SearchResult:
    """Search every legal plan of ``model`` on ``cluster`` and rank them by predicted tokens/s.

    Args:
        model: the model (its ``seq_len`` is the training sequence length).
        cluster: the cluster; all its devices are used unless ``num_devices`` is given.
        global_batch: sequences per optimizer step.
        top_k: how many of the best analytical estimates the SimPy simulation refines.
        memory_headroom: fraction of device memory a plan may use.
    Returns:
        A `SearchResult`; its ``ranked`` table is sorted best first.
    Raises:
        PlanError: ``global_batch`` or ``num_devices`` is not a positive integer in range.
    """
    if global_batch < 1:
        raise PlanError(f"global_batch={global_batch} must be a positive integer")
    if not 0 < memory_headroom <= 1:
        raise PlanError(f"memory_headroom={memory_headroom} must be in (0, 1]")
    rejected: list[dict] = []
    screened: list[tuple[Plan, StepPrediction]] = []
    for cid, plan, reason in candidate_plans(model, cluster, global_batch=global_batch,
                                             num_devices=num_devices, dtype=dtype,
                                             micro_batches=micro_batches, recompute=recompute):
        if plan is not None:
            reason = out_of_memory_reason(model, plan, cluster, memory_headroom)
        if reason:
            rejected.append({"id": cid, "reason": reason})
            continue
        screened.append((plan, estimate(model, plan, cluster)))
    screened.sort(key=lambda pair: -pair[1].tokens_per_s)
    rows, plans, preds = [], {}, {}
    for i, (plan, pred) in enumerate(screened):
        tier = "estimated"
        if i < top_k:
            pred, tier = simulate(model, plan, cluster), "simulated"
        rows.append(_row(plan, pred, tier))
        plans[plan.id], preds[plan.id] = plan, pred
    ranked = pd.DataFrame(rows, columns=RANKED_COLUMNS)
    if not ranked.empty:
        # Refined rows first (their numbers are the better ones), each tier by tokens/s.
        ranked = ranked.assign(_refined=ranked["tier"] == "simulated").sort_values(
            ["_refined", "tokens_per_s"], ascending=[False, False], kind="stable"
        ).drop(columns="_refined").reset_index(drop=True)
    return SearchResult(ranked=ranked,
                        rejected=pd.DataFrame(rejected, columns=REJECTED_COLUMNS),
                        plans=plans, predictions=preds)

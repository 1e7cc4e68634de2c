"""Step-time prediction of a model under a plan on a cluster: the SimPy simulation
(`simulate`) and its closed form (`estimate`).

Both cost every (virtual) pipeline stage (`simulator.step.costs.stage_costs`) and run the
plan's schedule over them (`simulator.step.pipeline`; with slow ranks,
`simulator.failures.stragglers`), then turn the step time into tokens/s, MFU, HFU and the
memory per rank (`simulator.step.memory`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from planner.flops import hfu, mfu
from planner.precision import block_scaled_device, storage_dtype
from planner.spec import ZERO_BUBBLE_SCHEDULES, ModelSpec, Plan
from simulator.failures.slow_links import link_slowdowns, replica_costs, slow_nic_cluster
from simulator.failures.stragglers import (
    estimate_replicas,
    estimate_with_stragglers,
    simulate_replicas,
    simulate_with_stragglers,
)
from simulator.network.cluster import Cluster
from simulator.step.costs import (
    DEFAULT_OPTIONS,
    SimOptions,
    stage_costs,
)
from simulator.step.memory import MemoryBreakdown, memory_per_stage
from simulator.step.pipeline import estimate_pipeline
from simulator.step.zero_bubble import estimate_zero_bubble, simulate_schedule


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


def _prediction(model: ModelSpec, plan: Plan, cluster: Cluster, step: float, compute: float,
                comm: float, events: list[tuple], attention: str, *,
                fp32_main_grads: bool = False,
                main_grad_bytes: int | None = None) -> StepPrediction:
    # MFU / HFU (`planner.flops`) against the world's dense peak at the plan's storage dtype
    # (bf16 for a low-precision recipe, as torchtitan and Megatron-Bridge report MFU)
    tokens_per_s = plan.global_batch * model.seq_len / step
    peak = cluster.device.peak(storage_dtype(plan.dtype))
    memory = memory_per_stage(model, plan, attention=attention,
                              fp32_main_grads=fp32_main_grads,
                              block_scaled=block_scaled_device(cluster.device.peak_flops),
                              main_grad_bytes=main_grad_bytes)
    return StepPrediction(
        step_time_s=step, compute_s=compute, comm_s=comm,
        bubble_s=max(0.0, step - compute - comm), tokens_per_s=tokens_per_s,
        mfu=mfu(model, tokens_per_s, plan.world_size, peak),
        hfu=hfu(model, plan, tokens_per_s, plan.world_size, peak),
        peak_memory_bytes=max(m.total_bytes for m in memory), memory=memory, events=events)


def simulate(model: ModelSpec, plan: Plan, cluster: Cluster, *, trace: bool = False,
             overlap_dp: bool = False, options: SimOptions = DEFAULT_OPTIONS,
             stragglers: Mapping[int, float] | None = None,
             slow_links: Mapping[int, float] | None = None) -> StepPrediction:
    """Simulate one training step of ``model`` under ``plan`` on ``cluster`` with SimPy.

    Cost grows with pp × micro-batches, not with the number of devices. ``overlap_dp``
    overlaps the bucketed gradient reduction with the last backward (`simulate_pipeline`);
    ``options`` names framework behaviour the plan does not (`simulator.step.costs.SimOptions`).
    ``stragglers`` maps global ranks (numbered by the mesh layout, `planner.mesh`) to compute
    slowdown factors >= 1; their TP, PP and DP groups wait for them
    (`simulator.failures.stragglers.simulate_with_stragglers`). ``slow_links`` maps devices
    to factors >= 1 by which the NIC they use is below line rate; the groups and sends that
    cross it slow down (`simulator.failures.slow_links`).

    Raises:
        PlanError: the plan does not fit the model, needs more devices than the cluster has
            (with the arithmetic), the device has no peak FLOP/s for ``plan.dtype``, or a
            straggler names a rank the plan does not have or a factor below 1 (likewise a
            slow link).
    """
    links = link_slowdowns(plan, cluster, slow_links) if slow_links else None
    costs = stage_costs(model, plan, cluster, options)
    if links is not None:
        replicas, tail = _asymmetric(model, plan, cluster, options, costs, stragglers, links)
        result = simulate_replicas(replicas, tail, plan, trace=trace, overlap_dp=overlap_dp)
    elif stragglers:
        result = simulate_with_stragglers(costs, plan, stragglers, trace=trace,
                                          overlap_dp=overlap_dp)
    else:
        result = simulate_schedule(costs, plan.schedule, plan.num_microbatches,
                                   virtual_stages=plan.virtual_stages, trace=trace,
                                   overlap_dp=overlap_dp,
                                   post_validation=options.optimizer_post_validation)
    return _prediction(model, plan, cluster, result.step_time_s, result.compute_s,
                       result.comm_s, result.events, options.attention,
                       fp32_main_grads=options.fp32_main_grads,
                       main_grad_bytes=options.grad_reduce_bytes)


def _asymmetric(model, plan, cluster, options, costs, stragglers, links):
    # The distinct replicas and the shared DP tail with slow links (and stragglers).
    return replica_costs(costs, plan, stragglers or {}, links, lambda f: stage_costs(
        model, plan, slow_nic_cluster(cluster, f), options))


def estimate(model: ModelSpec, plan: Plan, cluster: Cluster, *,
             overlap_dp: bool = False, options: SimOptions = DEFAULT_OPTIONS,
             stragglers: Mapping[int, float] | None = None,
             slow_links: Mapping[int, float] | None = None) -> StepPrediction:
    """Analytical (no SimPy) version of `simulate`, for screening many plans quickly
    (~0.1 ms a call; zero-bubble schedules ~ms, `estimate_zero_bubble`); with
    ``stragglers`` or ``slow_links``, the slowest replica's closed form
    (`simulator.failures.stragglers.estimate_with_stragglers`).

    Raises:
        PlanError: as `simulate`.
    """
    links = link_slowdowns(plan, cluster, slow_links) if slow_links else None
    costs = stage_costs(model, plan, cluster, options)
    if links is not None:
        replicas, tail = _asymmetric(model, plan, cluster, options, costs, stragglers, links)
        step, compute, comm = estimate_replicas(list(replicas.values()), tail, plan,
                                                overlap_dp=overlap_dp)
    elif stragglers:
        step, compute, comm = estimate_with_stragglers(costs, plan, stragglers,
                                                       overlap_dp=overlap_dp)
    elif plan.schedule in ZERO_BUBBLE_SCHEDULES:
        step, compute, comm = estimate_zero_bubble(
            costs, plan.schedule, plan.num_microbatches, overlap_dp, plan.virtual_stages,
            post_validation=options.optimizer_post_validation)
    else:
        step, compute, comm = estimate_pipeline(costs, plan.num_microbatches, overlap_dp,
                                                plan.virtual_stages, plan.schedule)
    return _prediction(model, plan, cluster, step, compute, comm, [], options.attention,
                       fp32_main_grads=options.fp32_main_grads,
                       main_grad_bytes=options.grad_reduce_bytes)

"""Failures over a long run: failure rates, checkpoint cost, a SimPy Monte Carlo, stragglers.

The closed forms live in `simulator.goodput` (Young 1974, Daly 2006). This module adds

- `job_failure_rate_per_s`: failures per second of a job from per-device, per-node and per-link
  MTBFs (independent exponential failures add their rates);
- `checkpoint_write_s`: the time to write the training state (bytes over storage bandwidth);
- `exact_goodput`: the exponential-failure model behind Daly's optimum: a segment of ``tau``
  work plus a checkpoint ``C`` takes ``M·e^(R/M)·(e^((tau+C)/M) − 1)`` expected wall time when
  failures (mean interval M) also strike during restarts (R) (Daly 2006, §3, the model whose
  first-order optimum is eq. (37));
- `monte_carlo_goodput`: a SimPy simulation of the same process: a trainer works in segments,
  a failure process interrupts it at exponential intervals; the work of an unfinished segment
  is lost and a restart follows; a node failure first waits for a spare node (a configurable
  swap delay) or, with none left, for the repair;
- `straggler_step_time_s` / `simulate_straggler`: the step time when one device is slow (the
  step simulation itself takes any set of slow ranks: `simulator.stragglers`).

Failures are independent and memoryless; a checkpoint is kept only once fully written.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import simpy

from planner.spec import PlanError
from simulator.goodput import daly_interval_s, expected_goodput


def job_failure_rate_per_s(*, num_devices: int, device_mtbf_s: float,
                           num_nodes: int = 0, node_mtbf_s: float | None = None,
                           num_links: int = 0, link_mtbf_s: float | None = None) -> float:
    """Failures per second of the whole job: N/M_dev + nodes/M_node + links/M_link.

    >>> job_failure_rate_per_s(num_devices=1000, device_mtbf_s=3.6e6) * 3600
    1.0
    >>> round(1 / job_failure_rate_per_s(num_devices=8, device_mtbf_s=8e5, num_nodes=1,
    ...                                   node_mtbf_s=1e5), 1)
    50000.0
    """
    if num_devices < 1 or not device_mtbf_s > 0:
        raise PlanError(f"num_devices={num_devices} must be >= 1 and device_mtbf_s="
                        f"{device_mtbf_s} > 0")
    rate = num_devices / device_mtbf_s
    for count, mtbf, name in ((num_nodes, node_mtbf_s, "node"), (num_links, link_mtbf_s, "link")):
        if count and mtbf is not None:
            if not mtbf > 0:
                raise PlanError(f"{name}_mtbf_s={mtbf} must be > 0")
            rate += count / mtbf
    return rate


def checkpoint_write_s(state_bytes: float, storage_bandwidth_Bps: float, *,
                       writers: int = 1, writer_bandwidth_Bps: float | None = None) -> float:
    """Seconds to write ``state_bytes``: over the storage bandwidth, or over ``writers``
    ranks' own bandwidth when that is the smaller.

    >>> checkpoint_write_s(100e9, 10e9)
    10.0
    >>> checkpoint_write_s(100e9, 100e9, writers=4, writer_bandwidth_Bps=5e9)
    5.0
    """
    if not state_bytes >= 0 or not storage_bandwidth_Bps > 0:
        raise PlanError(f"state_bytes={state_bytes} must be >= 0 and storage_bandwidth_Bps="
                        f"{storage_bandwidth_Bps} > 0")
    bandwidth = storage_bandwidth_Bps
    if writer_bandwidth_Bps is not None:
        bandwidth = min(bandwidth, writers * writer_bandwidth_Bps)
    return state_bytes / bandwidth


def training_state_bytes(num_params: float, *, bytes_per_param: float = 12.0) -> float:
    """Checkpointed bytes: fp32 weights plus Adam's two fp32 moments (12 bytes per parameter).

    >>> training_state_bytes(1e9) / 1e9
    12.0
    """
    return num_params * bytes_per_param


def exact_goodput(interval_s: float, checkpoint_s: float, restart_s: float,
                  mtbf_s: float) -> float:
    """Kept fraction of wall time for exponential failures (module docstring, Daly 2006 §3).

    >>> round(exact_goodput(3600.0, 60.0, 600.0, 36000.0), 4)
    0.919
    """
    if not (interval_s > 0 and checkpoint_s >= 0 and restart_s >= 0 and mtbf_s > 0):
        raise PlanError(f"need interval_s > 0, checkpoint_s >= 0, restart_s >= 0, mtbf_s > 0; "
                        f"got {interval_s}, {checkpoint_s}, {restart_s}, {mtbf_s}")
    segment = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s)
                                                                 / mtbf_s)
    return interval_s / segment


@dataclass(frozen=True, kw_only=True)
class MonteCarloResult:
    """A simulated long run (seconds).

    Attributes:
        goodput: kept work over wall time.
        failures: failures that struck (during work, checkpoints or restarts).
        node_failures: of them, failures that needed a replacement node.
        spare_waits: node failures that found no spare and waited for a repair.
        wall_s / work_s: simulated wall time and kept work.
    """

    goodput: float
    failures: int
    node_failures: int
    spare_waits: int
    wall_s: float
    work_s: float


def monte_carlo_goodput(*, interval_s: float, checkpoint_s: float, restart_s: float,
                        mtbf_s: float, horizon_s: float, seed: int = 0,
                        node_failure_fraction: float = 0.0, spares: int = 0,
                        spare_delay_s: float = 0.0, repair_s: float = 0.0) -> MonteCarloResult:
    """SimPy Monte Carlo of checkpoint/restart under exponential failures.

    Args:
        interval_s / checkpoint_s / restart_s: tau, C, R (as `exact_goodput`).
        mtbf_s: mean time between failures of the job (1 / `job_failure_rate_per_s`).
        horizon_s: simulated wall time; its standard error shrinks as 1/sqrt(failures).
        node_failure_fraction: share of failures that take a node away (a replacement is
            needed before the restart).
        spares: spare nodes at the start; a failed node comes back as a spare after repair_s.
        spare_delay_s: time to swap a spare in; with no spare, wait for the next repair.
    """
    rng = random.Random(seed)
    env = simpy.Environment()
    state = {"work": 0.0, "failures": 0, "nodes": 0, "waits": 0, "spares": spares,
             "hw_wait": False}

    def repaired(delay: float):
        yield env.timeout(delay)
        state["spares"] += 1

    def replacement_delay() -> float:
        state["nodes"] += 1
        if state["spares"] > 0:
            state["spares"] -= 1
            env.process(repaired(repair_s))    # the failed node rejoins the spare pool
            return spare_delay_s
        state["waits"] += 1
        return repair_s + spare_delay_s        # the failed node itself, once repaired

    def trainer():
        phase_restart = False
        while True:
            try:
                if phase_restart:
                    yield env.timeout(restart_s)
                    phase_restart = False
                yield env.timeout(interval_s + checkpoint_s)
                state["work"] += interval_s
            except simpy.Interrupt as failure:
                state["failures"] += 1
                if failure.cause == "node":
                    # waiting for hardware is not interrupted by further failures
                    state["hw_wait"] = True
                    yield env.timeout(replacement_delay())
                    state["hw_wait"] = False
                phase_restart = True

    def failures(target):
        while True:
            yield env.timeout(rng.expovariate(1.0 / mtbf_s))
            cause = "node" if rng.random() < node_failure_fraction else "device"
            if target.is_alive and not state["hw_wait"]:
                target.interrupt(cause)

    proc = env.process(trainer())
    env.process(failures(proc))
    env.run(until=horizon_s)
    return MonteCarloResult(goodput=state["work"] / horizon_s, failures=state["failures"],
                            node_failures=state["nodes"], spare_waits=state["waits"],
                            wall_s=horizon_s, work_s=state["work"])


@dataclass(frozen=True, kw_only=True)
class JobGoodput:
    """Goodput of a job from its failure rates and costs (seconds; fractions)."""

    mtbf_s: float
    checkpoint_s: float
    restart_s: float
    interval_s: float
    goodput: float
    exact_goodput: float
    tokens_per_s: float
    effective_tokens_per_s: float


def job_goodput(*, tokens_per_s: float, num_devices: int, device_mtbf_s: float,
                state_bytes: float, storage_bandwidth_Bps: float, restart_s: float,
                devices_per_node: int = 8, node_mtbf_s: float | None = None,
                link_mtbf_s: float | None = None, writers: int = 1,
                writer_bandwidth_Bps: float | None = None, spare_delay_s: float = 0.0,
                node_failure_fraction: float | None = None,
                interval_s: float | None = None) -> JobGoodput:
    """Expected goodput with the checkpoint time from the state size and Daly's interval.

    Node failures add ``spare_delay_s`` to their restart (spares assumed available); the
    default node share of failures is the node rate over the total. One link per device.
    """
    nodes = max(1, math.ceil(num_devices / devices_per_node))
    rate = job_failure_rate_per_s(num_devices=num_devices, device_mtbf_s=device_mtbf_s,
                                  num_nodes=nodes, node_mtbf_s=node_mtbf_s,
                                  num_links=num_devices, link_mtbf_s=link_mtbf_s)
    mtbf = 1.0 / rate
    if node_failure_fraction is None:
        node_failure_fraction = (nodes / node_mtbf_s) / rate if node_mtbf_s else 0.0
    restart = restart_s + node_failure_fraction * spare_delay_s
    write = checkpoint_write_s(state_bytes, storage_bandwidth_Bps, writers=writers,
                               writer_bandwidth_Bps=writer_bandwidth_Bps)
    tau = interval_s if interval_s is not None else daly_interval_s(max(write, 1e-9), mtbf)
    good = expected_goodput(tau, max(write, 1e-9), restart, mtbf)
    return JobGoodput(mtbf_s=mtbf, checkpoint_s=write, restart_s=restart, interval_s=tau,
                      goodput=good, exact_goodput=exact_goodput(tau, write, restart, mtbf),
                      tokens_per_s=tokens_per_s, effective_tokens_per_s=tokens_per_s * good)


def straggler_step_time_s(step_time_s: float, compute_s: float, slow_factor: float) -> float:
    """Step time when one device computes ``slow_factor`` times slower.

    The slow device's TP peers wait for it at every layer's collective, so its whole TP group
    (one pipeline stage) computes at its pace; the pipeline advances at its slowest stage's
    pace and every DP replica waits for it in the gradient reduction. So the critical stage's
    compute (``compute_s`` of `simulator.simulate.StepPrediction`) stretches by the factor;
    exposed communication and bubble stay.

    >>> straggler_step_time_s(1.0, 0.8, 1.5)
    1.4
    """
    if not slow_factor >= 1.0:
        raise PlanError(f"slow_factor={slow_factor} must be >= 1")
    return step_time_s + (slow_factor - 1.0) * compute_s


def predicted_run_goodput(*, step_time_s: float, steps: int, checkpoint_every: int,
                          checkpoint_blocking_s: float, restart_s: float,
                          failure_steps: list[int], interrupted_fraction: float = 0.5) -> float:
    """Goodput of a run with failures at known steps (each resuming from its last checkpoint).

    Wall time = steps x step time + checkpoints x blocking time + per failure at step S
    (restart time + the steps done since the last checkpoint + ``interrupted_fraction`` of
    step S, the part of it done before the failure: 0 for a rank killed at the start of S).

    Counted as `runtime.elastic.job_accounting` measures a run: the wall time runs from the
    first step's start to the last step's end, so the checkpoints counted are those saved
    after steps 1 .. steps − 1 (the save after the last step is outside it);
    ``checkpoint_blocking_s`` is the time a save keeps the loop from the next step, outside
    any step's time (an asynchronous save's staging wait inside the next step is part of
    ``step_time_s``); ``restart_s`` runs from the failed attempt's last step end to training
    again.

    >>> predicted_run_goodput(step_time_s=1.0, steps=10, checkpoint_every=3,
    ...                       checkpoint_blocking_s=0.0, restart_s=4.0, failure_steps=[7],
    ...                       interrupted_fraction=1.0)
    0.6666666666666666
    """
    useful = steps * step_time_s
    checkpoints = (steps - 1) // checkpoint_every if checkpoint_every else 0
    lost = 0.0
    for step in failure_steps:
        done = step - 1
        last = (done // checkpoint_every) * checkpoint_every if checkpoint_every else 0
        lost += restart_s + (done - last + interrupted_fraction) * step_time_s
    return useful / (useful + checkpoints * checkpoint_blocking_s + lost)


def simulate_straggler(model, plan, cluster, *, slow_factor: float, stage: int = 0,
                       overlap_dp: bool = False, options=None):
    """SimPy step of ``plan`` when one device of pipeline rank ``stage`` is ``slow_factor``
    times slower (returns `simulator.simulate.PipelineResult`).

    Its TP peers wait for it at every collective, so the whole stage computes (forward,
    backward, optimizer) at its pace; the simulated pipeline then waits for that stage, and
    the DP reduction for this replica, the slowest, so its step is the job's step. The same as
    ``simulate(..., stragglers={rank: slow_factor})`` for the stage's first rank
    (`simulator.stragglers.simulate_with_stragglers`), which takes any set of slow ranks.
    """
    from simulator.collectives import mesh_strides
    from simulator.costs import DEFAULT_OPTIONS, stage_costs
    from simulator.stragglers import simulate_with_stragglers
    if not slow_factor >= 1.0:
        raise PlanError(f"slow_factor={slow_factor} must be >= 1")
    if not 0 <= stage < plan.pp:
        raise PlanError(f"stage={stage} must be in [0, pp={plan.pp})")
    costs = stage_costs(model, plan, cluster, options or DEFAULT_OPTIONS)
    rank = stage * mesh_strides(plan)["pp"]        # (pp=stage, dp=0, tp=0) in build_mesh order
    return simulate_with_stragglers(costs, plan, {rank: slow_factor}, overlap_dp=overlap_dp)

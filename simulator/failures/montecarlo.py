"""Failures over a long run, simulated: a SimPy Monte Carlo of failures and restarts, a run's
goodput from its failure steps, and stragglers.

The closed forms (failure rates, checkpoint cost, Young's and Daly's intervals, a job's
goodput) live in `simulator.failures.goodput`. This module adds

- `monte_carlo_goodput`: a SimPy simulation of the same process: a trainer works in segments,
  a failure process interrupts it at exponential intervals; the work of an unfinished segment
  is lost and a restart follows; a node failure first waits for a spare node (a configurable
  swap delay) or, with none left, for the repair;
- `straggler_step_time_s` / `simulate_straggler`: the step time when one device is slow (the
  step simulation itself takes any set of slow ranks: `simulator.failures.stragglers`).

Failures are independent and memoryless; a checkpoint is kept only once fully written.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import simpy

from planner.spec import PlanError


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


def straggler_step_time_s(step_time_s: float, compute_s: float, slow_factor: float) -> float:
    """Step time when one device computes ``slow_factor`` times slower.

    The slow device's TP peers wait for it at every layer's collective, so its whole TP group
    (one pipeline stage) computes at its pace; the pipeline advances at its slowest stage's
    pace and every DP replica waits for it in the gradient reduction. So the critical stage's
    compute (``compute_s`` of `simulator.step.simulate.StepPrediction`) stretches by the factor;
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

    Counted as `runtime.resilience.job_accounting` measures a run: the wall time runs from the
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
    times slower (returns `simulator.step.simulate.PipelineResult`).

    Its TP peers wait for it at every collective, so the whole stage computes (forward,
    backward, optimizer) at its pace; the simulated pipeline then waits for that stage, and
    the DP reduction for this replica, the slowest, so its step is the job's step. The same as
    ``simulate(..., stragglers={rank: slow_factor})`` for the stage's first rank
    (`simulator.failures.stragglers.simulate_with_stragglers`), which takes any set of slow ranks.
    """
    from planner.mesh import mesh_strides
    from simulator.failures.stragglers import simulate_with_stragglers
    from simulator.step.costs import DEFAULT_OPTIONS, stage_costs
    if not slow_factor >= 1.0:
        raise PlanError(f"slow_factor={slow_factor} must be >= 1")
    if not 0 <= stage < plan.pp:
        raise PlanError(f"stage={stage} must be in [0, pp={plan.pp})")
    costs = stage_costs(model, plan, cluster, options or DEFAULT_OPTIONS)
    rank = stage * mesh_strides(plan)["pp"]        # (pp=stage, dp=0, tp=0) in build_mesh order
    return simulate_with_stragglers(costs, plan, {rank: slow_factor}, overlap_dp=overlap_dp)

"""The cost of evicting a straggler, as the runtime's ``--on-straggler evict`` policy pays it.

A device turns slow at step ``onset``: every step from then on takes ``step_s_staying``
instead of ``step_s``. The detector confirms it after ``window`` slow steps
(`runtime.health`); evicting then costs one stop-and-resume (``restart_s``: the save of the
confirming step, the process start, the rendezvous and the checkpoint load on the new layout)
and every later step takes ``step_s_after`` (the new plan on the devices that remain).

`eviction_pays` is the decision rule of `runtime.evict.decide_eviction`: leave when the time the
steps left save is more than the restart costs. `straggler_run_time_s` is the wall time of a
run under either policy, and `predicted_eviction_goodput` the goodput `runtime.resilience`'s
job accounting measures for it (kept steps' step time over the job's wall time: the restart
is the only time outside a step). Expected-value comparison as in Young (1974) and Daly
(2006), whose checkpoint-interval trade-off (work lost vs. time spent) this is for a slow
device instead of a dead one.
"""

from __future__ import annotations

from planner.spec import PlanError

#: Seconds one stop-and-resume takes on this machine when a job has not restarted yet:
#: torchrun start, rendezvous, model build and checkpoint load of a tiny model on 2 CPU cores
#: (docs/faults.md; a job's own ``restart_times_s`` replace it once measured).
LOCAL_RESTART_S = 8.0


def eviction_pays(*, step_s_staying: float, step_s_after: float, steps_left: int,
                  restart_s: float) -> bool:
    """Whether evicting saves time: ``steps_left`` x (staying − after) > ``restart_s``.

    >>> eviction_pays(step_s_staying=3.0, step_s_after=2.0, steps_left=10, restart_s=5.0)
    True
    >>> eviction_pays(step_s_staying=3.0, step_s_after=2.0, steps_left=4, restart_s=5.0)
    False
    """
    return steps_left * (step_s_staying - step_s_after) > restart_s


def straggler_run_time_s(*, steps: int, step_s: float, step_s_staying: float,
                         step_s_after: float, onset: int, window: int, restart_s: float,
                         evict: bool) -> float:
    """Wall time (s) of a ``steps``-step run whose device turns slow at step ``onset``
    (1-based; steps before it take ``step_s``), staying or evicting after ``window`` slow
    steps (when the run is long enough to confirm it).

    >>> straggler_run_time_s(steps=10, step_s=1.0, step_s_staying=3.0, step_s_after=2.0,
    ...                      onset=1, window=3, restart_s=5.0, evict=True)
    28.0
    """
    for name, value in {"steps": steps, "onset": onset, "window": window}.items():
        if value < 1:
            raise PlanError(f"{name}={value} must be >= 1")
    healthy = min(steps, onset - 1)
    confirmed = healthy + window
    if not evict or confirmed >= steps:
        return healthy * step_s + (steps - healthy) * step_s_staying
    return (healthy * step_s + window * step_s_staying + restart_s
            + (steps - confirmed) * step_s_after)


def predicted_eviction_goodput(*, steps: int, step_s: float, step_s_staying: float,
                               step_s_after: float, onset: int, window: int,
                               restart_s: float) -> float:
    """Goodput of the evicting run as the runtime measures it: the steps' own time over the
    wall time (`straggler_run_time_s`), so only the restart counts as lost.

    >>> predicted_eviction_goodput(steps=10, step_s=1.0, step_s_staying=3.0, step_s_after=2.0,
    ...                            onset=1, window=3, restart_s=5.0)
    0.8214285714285714
    """
    wall = straggler_run_time_s(steps=steps, step_s=step_s, step_s_staying=step_s_staying,
                                step_s_after=step_s_after, onset=onset, window=window,
                                restart_s=restart_s, evict=True)
    lost = restart_s if min(steps, onset - 1) + window < steps else 0.0
    return (wall - lost) / wall

"""The cost of evicting a straggler, as the runtime's ``--on-straggler evict`` policy pays it.

A device turns slow at step ``onset``: every step from then on takes ``step_s_staying``
instead of ``step_s``. The detector confirms it after ``window`` slow steps
(`runtime.health`); evicting then costs one stop-and-resume (``restart_s``: the save of the
confirming step, the re-planning, the rendezvous and model build of the smaller group (with
new processes' start-up when a spare joins) and the checkpoint load on the new layout) and
every later step takes ``step_s_after`` (the new plan on the devices that remain).

`eviction_pays` is the decision rule of `runtime.evict.decide_eviction`: leave when the time the
steps left save is more than the restart costs. `straggler_run_time_s` is the wall time of a
run under either policy, and `predicted_eviction_goodput` the goodput `runtime.resilience`'s
job accounting measures for it (kept steps' step time over the job's wall time: the restart
is the only time outside a step). Expected-value comparison as in Young (1974) and Daly
(2006), whose checkpoint-interval trade-off (work lost vs. time spent) this is for a slow
device instead of a dead one.

`restart_estimate_s` is the one home of ``restart_s``: the job's own evidence of what a
stop-and-resume costs (`RestartEvidence`, which `runtime.accounting.restart_evidence` reads
from the job's event log), and `LOCAL_RESTART_S` only when the job measured nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from planner.spec import PlanError

#: Seconds one stop-and-resume takes on this machine, used only when a job measured nothing of
#: its own (`restart_estimate_s`): torchrun start, rendezvous, model build and checkpoint load
#: of a tiny model on 2 idle CPU cores (docs/faults.md).
LOCAL_RESTART_S = 8.0


@dataclass(frozen=True, kw_only=True)
class RestartEvidence:
    """What a job measured of its own stop-and-resume before an eviction (seconds; None: not
    measured).

    Attributes:
        stop_s: from the end of the step the job stops after to the decision: that step's
            checkpoint saved and landed, the workers and their launcher gone, the new plan
            searched.
        start_up_s: the job's latest launch to its first attempt's start: the launcher, the
            worker processes and their imports, the process group, the model build.
        build_s: the part of that start-up a process that stays does again: the process
            group, the mesh, the model and its optimizer (the job's latest timed build).
        load_s: a checkpoint load this job timed, else the write of the checkpoint it stops
            with (the load reads the bytes that write put down).
        restarts_s: this job's measured restarts (last step to training again).
    """

    stop_s: float | None = None
    start_up_s: float | None = None
    build_s: float | None = None
    load_s: float | None = None
    restarts_s: Sequence[float] = ()

    def __post_init__(self) -> None:
        for name in ("stop_s", "start_up_s", "build_s", "load_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise PlanError(f"{name}={value} must be >= 0 (a measured duration)")


def restart_estimate_s(evidence: RestartEvidence | None = None, *,
                       in_place: bool = False) -> tuple[float, str]:
    """(predicted seconds of one stop-and-resume, what the figure rests on).

    A resume repeats what the job itself did to start, each part measured by this job
    (`RestartEvidence`): relaunched (new processes), stop + start-up + load; ``in_place``
    (the processes that stay form the smaller group themselves, `runtime.evict`), stop +
    build + load. Without that part measured: the median of the job's measured restarts;
    without those, `LOCAL_RESTART_S`. This is the ``restart_s`` of `eviction_pays` and
    `predicted_eviction_goodput`.

    >>> restart_estimate_s(RestartEvidence(stop_s=4.0, start_up_s=9.5, load_s=0.5))
    (14.0, 'stop 4.0 + start-up 9.5 + load 0.5 s, measured by this job')
    >>> restart_estimate_s(RestartEvidence(stop_s=4.0, start_up_s=9.5, build_s=0.3,
    ...                                    load_s=0.5), in_place=True)
    (4.8, 'stop 4.0 + build 0.3 + load 0.5 s, measured by this job')
    >>> restart_estimate_s(RestartEvidence(restarts_s=[12.0, 20.0, 13.0]))
    (13.0, 'median of 3 measured restart(s)')
    >>> restart_estimate_s()
    (8.0, 'default, nothing measured')
    """
    e = evidence or RestartEvidence()
    start, name = (e.build_s, "build") if in_place else (e.start_up_s, "start-up")
    if start is not None:
        stop, load = e.stop_s or 0.0, e.load_s or 0.0
        return (stop + start + load,
                f"stop {stop:.1f} + {name} {start:.1f} + load {load:.1f} s, "
                "measured by this job")
    if e.restarts_s:
        return (statistics.median(e.restarts_s),
                f"median of {len(e.restarts_s)} measured restart(s)")
    return LOCAL_RESTART_S, "default, nothing measured"


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

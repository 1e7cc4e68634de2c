"""An answer for impossible requests: the closest plans, what they would need, what blocks them.

When no plan of a search is legal and fits in memory, `explain_infeasible` reports

- the plans that came closest (least memory of the out-of-memory ones) with the memory they
  need per device and the device memory that would hold them;
- each constraint whose relaxation makes some plan fit, with that plan: the memory headroom,
  every fixed field of the `SearchSpace`, and the device count (the fewest devices, up to
  `MAX_SCALE` times the request, on which some plan of the space fits).

The relaxations only check legality and memory (no step-time estimate), on the leanest values
of every free field (micro-batch 1, full recomputation, ZeRO-3, sequence parallelism), so they
cost a small fraction of the search.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from planner.space import Rejection, SearchSpace, enumerate_candidates, layers_reason, tp_reason
from planner.spec import ModelSpec, Plan
from simulator.network.cluster import Cluster
from simulator.step.costs import DEFAULT_OPTIONS
from simulator.step.memory import memory_per_stage

GiB = 2**30
#: The device-count relaxation tries 2, 4, ... up to this many times the requested devices.
MAX_SCALE = 1024
CLOSEST_COLUMNS = ["id", "peak_memory_bytes", "usable_bytes", "over_bytes",
                   "device_memory_needed_bytes", "worst_stage"]


@dataclass(frozen=True, kw_only=True)
class Infeasibility:
    """Why nothing fits, and what would.

    Attributes:
        summary: one sentence for people.
        closest: the out-of-memory plans that need least (columns `CLOSEST_COLUMNS`):
            peak and usable bytes per device, the excess, and the device memory that would hold
            the plan at the same headroom.
        blocking: one line per constraint that blocks, each naming the plan that fits once
            it is relaxed ("memory_headroom=0.8: at 1.0 tp8-... fits").
        min_devices: fewest devices on which some plan of the space fits (None: none up to
            `MAX_SCALE` times the request, or the request is not blocked by memory).
    """

    summary: str
    closest: pd.DataFrame
    blocking: list[str] = field(default_factory=list)
    min_devices: int | None = None

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"summary": self.summary, "closest": self.closest.to_dict("records"),
                "blocking": list(self.blocking), "min_devices": self.min_devices}


def _lean(space: SearchSpace) -> SearchSpace:
    # The least memory each free field allows; fixed fields stay as the user set them.
    lean = {"micro_batch": (1,), "recompute": ("full",), "zero_stage": (3, 0),
            "schedule": ("1f1b",), "placement": (("tp", "dp", "pp"),)}
    return space.replace(**{k: v for k, v in lean.items() if getattr(space, k) is None})


def first_fit(model: ModelSpec, space: SearchSpace, *, devices_per_node: int,
              global_batch: int, dtype: str, limit_bytes: float, num_devices: int | None,
              max_devices: int | None) -> Plan | None:
    """A legal plan of ``space`` whose every stage fits in ``limit_bytes``, or None."""
    best, best_need = None, None
    for item in enumerate_candidates(model, space, devices_per_node=devices_per_node,
                                     global_batch=global_batch, dtype=dtype,
                                     num_devices=num_devices, max_devices=max_devices):
        if isinstance(item, Rejection):
            continue
        need = max(m.total_bytes for m in memory_per_stage(
            model, item, attention=DEFAULT_OPTIONS.attention))
        if need <= limit_bytes and (best_need is None or need < best_need):
            best, best_need = item, need
    return best


def _closest_table(closest: list[tuple], usable: float, headroom: float) -> pd.DataFrame:
    rows = [{"id": pid, "peak_memory_bytes": need, "usable_bytes": usable,
             "over_bytes": need - usable, "device_memory_needed_bytes": need / headroom,
             "worst_stage": stage} for need, pid, _plan, stage, _b in closest]
    return pd.DataFrame(rows, columns=CLOSEST_COLUMNS)


def explain_infeasible(model: ModelSpec, cluster: Cluster, space: SearchSpace, *,
                       global_batch: int, num_devices: int | None, max_devices: int | None,
                       memory_headroom: float, dtype: str, closest: list[tuple],
                       rejected: pd.DataFrame) -> Infeasibility:
    """Explain a search that found nothing (see the module docstring).

    Args:
        closest: ``(need_bytes, id, plan, stage, breakdown)`` of the out-of-memory plans that
            need least, smallest first (from `planner.search.screen`).
        rejected: the search's rejected table.
    """
    usable = cluster.device.memory_bytes * memory_headroom
    n = num_devices if num_devices is not None else max_devices
    word = "" if num_devices is not None else "at most "
    common = {"devices_per_node": cluster.devices_per_node, "global_batch": global_batch,
              "dtype": dtype}

    def fits(sp: SearchSpace, limit: float = usable, devices: int = n) -> Plan | None:
        bounds = ({"num_devices": devices, "max_devices": None} if num_devices is not None
                  else {"num_devices": None, "max_devices": devices})
        return first_fit(model, sp, limit_bytes=limit, **common, **bounds)

    blocking = [f"tp={tp} (fixed): {reason}" for tp in space.tp or ()
                if (reason := tp_reason(model, tp))]
    blocking += [f"pp={pp} (fixed): {reason}" for pp in space.pp or ()
                 if (reason := layers_reason(model, pp, 1))]
    if memory_headroom < 1:
        plan = fits(_lean(space), limit=cluster.device.memory_bytes)
        if plan is not None:
            blocking.append(f"memory_headroom={memory_headroom}: at 1.0 {plan.id} fits")
    for name, values in space.fixed().items():
        plan = fits(_lean(space.replace(**{name: None})))
        if plan is not None:
            shown = values[0] if len(values) == 1 else list(values)
            blocking.append(f"{name}={shown} (fixed): with {name} free, {plan.id} fits")
    min_devices, scale = None, 2
    while scale <= MAX_SCALE:
        plan = fits(_lean(space), devices=n * scale)
        if plan is not None:
            min_devices = plan.world_size
            blocking.append(f"devices: {word}{n} is too few; {plan.id} fits on "
                            f"{plan.world_size} devices "
                            f"({-(-plan.world_size // cluster.devices_per_node)} nodes)")
            break
        scale *= 2
    if closest:
        need = closest[0][0]
        summary = (f"no plan of {model.name} fits on {word}{n} x {cluster.device.name}: the "
                   f"leanest, {closest[0][1]}, needs {need / GiB:.1f} GiB per device, "
                   f"{usable / GiB:.1f} GiB usable (a device with "
                   f"{need / memory_headroom / GiB:.1f} GiB would hold it)")
        if min_devices is None:
            blocking.append(f"device memory: no split of up to {MAX_SCALE}x the devices fits; "
                            f"{closest[0][1]} needs {need / GiB:.1f} GiB per device")
    else:
        counts = rejected["reason"].value_counts().head(3) if len(rejected) else {}
        # no candidate at all: the fixed fields exclude each other before any is built
        why = "; ".join(f"{k}x {r}" for r, k in counts.items()) or \
            "the fixed fields leave no candidate to build (see 'blocked by' below)"
        summary = f"no legal plan of {model.name} on {word}{n} devices: {why}"
    return Infeasibility(summary=summary, closest=_closest_table(closest, usable,
                                                                 memory_headroom),
                         blocking=blocking, min_devices=min_devices)

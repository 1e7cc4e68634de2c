"""Efficiency across GPU generations: one set of carried terms, every device from its datasheet.

A device's `Efficiency` splits into terms that carry from one generation to the next and
terms its datasheet gives (docs/validation.md, "Efficiency across generations"):

* carried: ``gemm_max_fraction`` (a large GEMM's fraction of the dense peak: the tensor-core
  pipeline's issue efficiency, about the same on A100, H100 and Blackwell for 128-multiple
  shapes), the GEMM saturation as a fixed latency ``gemm_half_flops / peak`` (a GEMM's
  prologue / epilogue and tile fill: the same seconds at any rate), ``memory_fraction``
  (the achieved share of HBM bandwidth of the frameworks' memory-bound kernels),
  ``kernel_s`` and ``host_op_s`` (launch gap, CPU time per op), ``fp8_fraction`` /
  ``fp4_fraction`` (a low-precision GEMM's ceiling relative to bf16's);
* from the datasheet: peak FLOP/s per dtype, HBM bandwidth, SM count (wave quantisation);
* from the generation's published attention-kernel benchmark, in the device's own
  ``efficiency.yaml`` entry: ``flash_fraction`` (the attention kernel's rate relative to a
  GEMM; FlashAttention-2's 35% of the H100 peak on Hopper, on Blackwell cuDNN's 54.6% of the B200 peak times the share of cuDNN's benchmark Hopper training reaches, on
  Blackwell, where FlashAttention-2 / -3 do not run). Neither carried nor refitted: which
  kernel a generation runs is a fact about its software, not an efficiency to fit. It is
  stated against the device entry's own documented GEMM ceiling (``flash_ceiling``), so the
  kernel keeps its share of the peak when the one carried ``gemm_max_fraction`` is refitted.

`carried_efficiency` builds a device's entry from the reference entry (H100 SXM's) by those
rules; `held_out_errors` fits the carried terms on every row but a group (a source, or a GPU
type: leave-one-GPU-out) and predicts the group, one held-out prediction per row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from simulator.network.hardware import DeviceProfile, load_device
from simulator.step.compute import Efficiency, load_efficiency
from simulator.validation.fit import nelder_mead
from simulator.validation.validate import RunCase, predict, validation_cluster

#: The device whose efficiency.yaml entry holds the carried terms.
REFERENCE = "h100-sxm-80gb"
#: The carried terms a fit frees (``gemm_half_flops`` as the reference device's).
CARRIED = ("gemm_max_fraction", "gemm_half_flops", "memory_fraction", "kernel_s",
           "host_op_s", "fp8_fraction", "fp4_fraction")
_FRACTIONS = ("gemm_max_fraction", "memory_fraction", "fp8_fraction", "fp4_fraction")


def carried_efficiency(ref: Efficiency, ref_device: DeviceProfile,
                       device: DeviceProfile) -> Efficiency:
    """``device``'s entry from the reference entry ``ref`` of ``ref_device``: every carried
    term kept, the saturation point scaled by the bf16 peak ratio (the same fixed latency at
    the new rate), the SM count (its datasheet) and ``flash_fraction`` (its generation's
    attention kernel) from ``device``'s own entry.

    >>> h100, b200 = load_device("h100-sxm-80gb"), load_device("b200-sxm-180gb")
    >>> e = carried_efficiency(load_efficiency("h100-sxm-80gb"), h100, b200)
    >>> e.num_sms, round(e.gemm_half_flops / 8.372e8, 3)  # 148 SMs; x 2250/989
    (148, 2.275)
    >>> e.flash_fraction  # cuDNN on Blackwell: 0.663 x 0.546 / 0.713 (efficiency.yaml)
    0.508
    """
    ratio = device.peak("bf16") / ref_device.peak("bf16")
    own = load_efficiency(device.name)
    return dataclasses.replace(ref, gemm_half_flops=ref.gemm_half_flops * ratio,
                               num_sms=own.num_sms, flash_fraction=own.flash_fraction,
                               flash_ceiling=own.gemm_max_fraction,
                               source=f"carried from {ref_device.name}")


def case_device(case: RunCase) -> DeviceProfile:
    """The device profile a case runs on."""
    return validation_cluster(case.cluster_name, case.nodes).device


def _predict(case: RunCase, ref: Efficiency, ref_device: DeviceProfile) -> float:
    eff = carried_efficiency(ref, ref_device, case_device(case))
    return predict(dataclasses.replace(
        case, options=dataclasses.replace(case.options, efficiency=eff)), fast=True)


def fit_carried(cases: Sequence[RunCase], start: Efficiency, ref_device: DeviceProfile, *,
                iters: int, free: Sequence[str] = CARRIED) -> Efficiency:
    """The carried terms (``free``) minimising the mean absolute relative step-time error of
    ``cases`` (closed form), every case's device built by `carried_efficiency`; fractions
    stay in (0, 1]. ``iters=0`` returns ``start``."""
    if iters <= 0 or not cases:
        return start

    def build(x: np.ndarray) -> Efficiency:
        values = {n: math.exp(v) for n, v in zip(free, x, strict=True)}
        for n in _FRACTIONS:
            if n in values:
                values[n] = min(1.0, values[n])
        return dataclasses.replace(start, **values)

    def objective(x: np.ndarray) -> float:
        eff = build(x)
        return sum(abs(_predict(c, eff, ref_device) / c.reference_step_time_s - 1)
                   for c in cases) / len(cases)

    x0 = np.array([math.log(max(getattr(start, n), 1e-12)) for n in free])
    return build(nelder_mead(objective, x0, iters=iters))


def held_out_errors(cases: Sequence[RunCase], group: Callable[[RunCase], str], *,
                    iters: int, start: Efficiency | None = None,
                    free: Sequence[str] = CARRIED) -> list[dict]:
    """One in-fit and one held-out relative error per case: the carried terms fitted on
    every case (in-fit) and, per value of ``group`` (a source, a GPU type), on the cases of
    the other values (held out); a group alone gets the reference entry for held out.

    Returns ``[{"id", "group", "device", "dtype", "in_fit", "held_out"}, ...]``, errors as
    predicted / reference − 1.
    """
    ref_device = load_device(REFERENCE)
    start = start or load_efficiency(REFERENCE)
    every = fit_carried(cases, start, ref_device, iters=iters, free=free)
    out = []
    for g in sorted({group(c) for c in cases}):
        rest = [c for c in cases if group(c) != g]
        eff = fit_carried(rest, start, ref_device, iters=iters, free=free)
        for c in (c for c in cases if group(c) == g):
            ref = c.reference_step_time_s
            out.append({"id": c.id, "group": g, "device": case_device(c).name,
                        "dtype": c.plan.dtype,
                        "in_fit": _predict(c, every, ref_device) / ref - 1,
                        "held_out": _predict(c, eff, ref_device) / ref - 1})
    return out


def summarize(errors: Sequence[dict], by: Sequence[str]) -> list[dict]:
    """Rows, in-fit and held-out MAPE, held-out bias and worst row of ``errors``
    (`held_out_errors`) grouped by the keys ``by`` (e.g. ``("device", "dtype")``).

    >>> summarize([{"id": "a", "device": "d", "in_fit": 0.1, "held_out": -0.2},
    ...            {"id": "b", "device": "d", "in_fit": 0.0, "held_out": 0.1}], ["device"])
    [{'device': 'd', 'rows': 2, 'in_fit_mape': 0.05, 'held_out_mape': 0.15000000000000002, \
'held_out_bias': -0.05, 'worst': 'a', 'worst_error': -0.2}]
    """
    groups: dict[tuple, list[dict]] = {}
    for e in errors:
        groups.setdefault(tuple(e[k] for k in by), []).append(e)
    out = []
    for key, rows in sorted(groups.items()):
        worst = max(rows, key=lambda r: abs(r["held_out"]))
        out.append({**dict(zip(by, key, strict=True)), "rows": len(rows),
                    "in_fit_mape": sum(abs(r["in_fit"]) for r in rows) / len(rows),
                    "held_out_mape": sum(abs(r["held_out"]) for r in rows) / len(rows),
                    "held_out_bias": sum(r["held_out"] for r in rows) / len(rows),
                    "worst": worst["id"], "worst_error": worst["held_out"]})
    return out

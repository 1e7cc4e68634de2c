"""Fit the few compute-efficiency parameters of one GPU type to whole tables of runs at once.

One set of parameters for every row of every table (nothing per row or per table): the
objective is the mean over the tables of each table's mean absolute relative step-time error
(so the 960-row vTrain single-node table does not outweigh the 63 published runs), over the
rows that run on the fitted GPU type, minimised by Nelder-Mead over the logarithms of the free
parameters (the closed-form `estimate`, not the SimPy run, for speed). ``--leave-one-out``
refits once per table without it and reports that table's error, the hold-out figure.
Used to produce ``presets/efficiency.yaml``::

    python -m simulator.validation.fit a100-sxm-80gb ../shared/data/published_runs.csv \
        ../shared/data/vtrain/ground_truth_multi.csv \
        ../shared/data/vtrain/ground_truth_single.csv --leave-one-out
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from simulator.step.compute import Efficiency, load_efficiency, load_framework
from simulator.validation.report import error_summary, rel_error
from simulator.validation.validate import RunCase, predict, read_runs, validation_cluster

#: The parameters fitted for ``efficiency.yaml`` (flash_fraction is a documented value).
FREE = ("gemm_max_fraction", "gemm_half_flops", "memory_fraction", "kernel_s", "host_op_s",
        "p2p_overhead_s")
#: Free parameters that belong to the framework (`SimOptions`), not to the GPU.
FRAMEWORK = ("p2p_overhead_s",)


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, *, step: float = 0.3,
                iters: int = 300, tol: float = 1e-6) -> np.ndarray:
    """Minimise ``f`` from ``x0`` with the Nelder-Mead simplex (Nelder & Mead 1965).

    >>> x = nelder_mead(lambda v: float(((v - 3.0) ** 2).sum()), np.zeros(2))
    >>> bool(np.allclose(x, 3.0, atol=1e-3))
    True
    """
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                best = simplex[0]
                simplex = [best + 0.5 * (x - best) for x in simplex]
                values = [f(x) for x in simplex]
    return simplex[int(np.argmin(values))]


def mape(cases: Sequence[RunCase], eff: Efficiency, *, fast: bool = False,
         **framework: float) -> float:
    """Mean absolute relative step-time error of ``cases`` under ``eff`` (and framework
    parameters of `SimOptions`, e.g. ``p2p_overhead_s``, for the cases whose framework has
    them: those with a non-zero default)."""
    errors = []
    for case in cases:
        fw = {k: v for k, v in framework.items() if getattr(case.options, k)}
        pred = predict(dataclasses.replace(
            case, options=dataclasses.replace(case.options, efficiency=eff, **fw)), fast=fast)
        errors.append(abs(pred / case.reference_step_time_s - 1))
    return sum(errors) / len(errors)


def _same_entry(a: Efficiency, b: Efficiency) -> bool:
    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")


def cases_on_device(cases: Sequence[RunCase], device: str) -> list[RunCase]:
    """The cases whose cluster's GPU uses the efficiency entry of ``device`` (an entry that
    merges it unchanged, e.g. a100-sxm-40gb into a100-sxm-80gb, counts as the same)."""
    target = load_efficiency(device)
    return [c for c in cases if _same_entry(
        load_efficiency(validation_cluster(c.cluster_name, c.nodes).device.name), target)]


def fit_efficiency(tables: Sequence[Sequence[RunCase]], start: Efficiency,
                   free: Sequence[str] = FREE, iters: int = 300,
                   framework_start: dict[str, float] | None = None,
                   ) -> tuple[Efficiency, dict[str, float], list[float]]:
    """Parameters in ``free`` that minimise the mean over ``tables`` of each table's `mape`:
    the fitted `Efficiency`, the fitted framework parameters and each table's MAPE (closed
    form). Fractions stay in (0, 1].

    Raises:
        ValueError: ``tables`` is empty or holds an empty table.
    """
    if not tables or any(not t for t in tables):
        raise ValueError("fit_efficiency: every table needs at least one run on the device")
    start_fw = {"p2p_overhead_s": 1e-4, **(framework_start or {})}

    def build(x: np.ndarray) -> tuple[Efficiency, dict[str, float]]:
        values = {name: math.exp(v) for name, v in zip(free, x, strict=True)}
        for name in ("gemm_max_fraction", "memory_fraction"):
            if name in values:
                values[name] = min(1.0, values[name])
        fw = {n: values.pop(n) for n in FRAMEWORK if n in values}
        return dataclasses.replace(start, **values), fw

    def objective(x: np.ndarray) -> float:
        eff, fw = build(x)
        return sum(mape(t, eff, fast=True, **fw) for t in tables) / len(tables)

    x0 = np.array([math.log(max(start_fw[n] if n in FRAMEWORK else getattr(start, n), 1e-12))
                   for n in free])
    eff, fw = build(nelder_mead(objective, x0, iters=iters))
    return eff, fw, [mape(t, eff, fast=True, **fw) for t in tables]


#: Nelder-Mead iterations of each refit in `leave_one_source_out` (the tool's default; the
#: full fit of ``efficiency.yaml`` used 300).
LOSO_ITERS = 40


def _figures(cases: Sequence[RunCase], eff: Efficiency, fw: dict[str, float]) -> dict:
    rows = []
    for case in cases:
        fw_c = {k: v for k, v in fw.items() if getattr(case.options, k)}
        pred = predict(dataclasses.replace(
            case, options=dataclasses.replace(case.options, efficiency=eff, **fw_c)), fast=True)
        rows.append({"id": case.id, "rel_error": rel_error(pred, case.reference_step_time_s),
                     "predicted_step_time_s": pred,
                     "reference_step_time_s": case.reference_step_time_s})
    s = error_summary(rows)
    return {"mape": s["mape"], "mean_error": s["mean_error"], "worst": s["worst"],
            "rows": rows}


def leave_one_source_out(tables: Sequence[Sequence[RunCase]], device: str, *,
                         iters: int = LOSO_ITERS) -> list[dict]:
    """Per-source accuracy on ``device``, in-fit and held out (leave-one-source-out).

    The free parameters (`FREE`) of ``device``'s efficiency entry are fitted with
    `fit_efficiency` (the objective: mean over ``tables`` of each table's MAPE, closed form)
    once on every row (in-fit), then once per source (`RunCase.source`: one paper or
    repository) with that source's rows removed from every table; the held-out figures are
    that source's rows predicted with the parameters fitted without them. Each refit starts
    from the ``efficiency.yaml`` entry and runs ``iters`` Nelder-Mead iterations: with few
    iterations the held-out figures are optimistic (that entry was fitted on every source);
    ``iters=0`` gives the entry itself for both.

    Returns one dict per source with rows on ``device``: ``{"device", "source", "rows",
    "in_fit": {"mape", "mean_error", "worst": {"id", "rel_error"}}, "held_out": {...}}``,
    errors as predicted / reference − 1. A source that is alone on the device has no
    held-out figure (``held_out`` None): nothing is left to fit on.

    Raises:
        ValueError: no table has a row on ``device``.
    """
    on_device = [t for t in (cases_on_device(t, device) for t in tables) if t]
    if not on_device:
        raise ValueError(f"leave_one_source_out: no row runs on {device}")
    start, start_fw = load_efficiency(device), load_framework("megatron-deepspeed")

    def fit(tabs: list[list[RunCase]]) -> tuple[Efficiency, dict[str, float]]:
        if iters <= 0:
            return start, dict(start_fw)
        eff, fw, _ = fit_efficiency(tabs, start, iters=iters, framework_start=start_fw)
        return eff, fw

    eff_all, fw_all = fit(on_device)
    sources = sorted({c.source for t in on_device for c in t})
    out = []
    for src in sources:
        held = [c for t in on_device for c in t if c.source == src]
        rest = [r for r in ([c for c in t if c.source != src] for t in on_device) if r]
        entry = {"device": device, "source": src, "rows": len(held),
                 "in_fit": _figures(held, eff_all, fw_all), "held_out": None}
        if rest:
            eff_i, fw_i = fit(rest)
            entry["held_out"] = _figures(held, eff_i, fw_i)
        out.append(entry)
    return out


def fitted_devices(cases: Sequence[RunCase]) -> list[str]:
    """The device profiles ``cases`` run on, one per distinct efficiency entry (a device
    whose entry merges another's unchanged, a100-sxm-40gb into a100-sxm-80gb, is counted
    under the last name in sorted order: a100-sxm-80gb, the entry's own name)."""
    names = sorted({validation_cluster(c.cluster_name, c.nodes).device.name for c in cases},
                   reverse=True)
    out: list[str] = []
    for name in names:
        if not any(_same_entry(load_efficiency(name), load_efficiency(o)) for o in out):
            out.append(name)
    return sorted(out)


def _print_fit(eff: Efficiency, fw: dict[str, float], names: Sequence[str],
               errors: Sequence[float]) -> None:
    for name in FREE:
        print(f"{name}: {fw[name] if name in fw else getattr(eff, name):.4g}")
    for name, err in zip(names, errors, strict=True):
        print(f"mape {name}: {err:.4f}")


def main(argv: list[str]) -> int:
    """``python -m simulator.validation.fit DEVICE RUNS.csv [RUNS.csv ...] [--leave-one-out]``: fit
    `FREE` starting from the presets, print the parameters and each table's MAPE; with
    ``--leave-one-out`` also refit without each table in turn and print its hold-out MAPE."""
    loo = "--leave-one-out" in argv
    args = [a for a in argv if a != "--leave-one-out"]
    if len(args) < 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    device, paths = args[0], args[1:]
    tables = [cases_on_device(read_runs(p), device) for p in paths]
    names = [Path(p).name for p in paths]
    start, start_fw = load_efficiency(device), load_framework("megatron-deepspeed")
    eff, fw, errors = fit_efficiency(tables, start, framework_start=start_fw)
    sizes = ", ".join(f"{n} ({len(t)} rows)" for n, t in zip(names, tables, strict=True))
    print(f"fit on {sizes}:")
    _print_fit(eff, fw, names, errors)
    if loo and len(tables) > 1:
        for i, name in enumerate(names):
            rest = [t for j, t in enumerate(tables) if j != i]
            e_i, fw_i, _ = fit_efficiency(rest, start, framework_start=start_fw)
            print(f"hold-out {name}: mape {mape(tables[i], e_i, fast=True, **fw_i):.4f} "
                  f"(fitted on the other {len(rest)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Fit the few compute-efficiency parameters of one GPU type to a whole table of runs at once.

The objective is the mean absolute relative step-time error over every row of the table
(one set of parameters for all rows; nothing per row), minimised by Nelder-Mead over the
logarithms of the free parameters. Used to produce ``presets/efficiency.yaml``::

    python -m simulator.fit ../shared/data/vtrain/ground_truth_single.csv a100-sxm-80gb \
        megatron-deepspeed
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence

import numpy as np

from simulator.compute import Efficiency, load_efficiency, load_framework
from simulator.validate import RunCase, predict, read_runs

#: The parameters fitted for ``efficiency.yaml`` (gemm_max_fraction and memory_fraction are
#: documented values: left free, both run to their 1.0 bound).
FREE = ("gemm_half_flops", "kernel_s", "host_op_s", "p2p_overhead_s")
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


def fit_efficiency(cases: Sequence[RunCase], start: Efficiency,
                   free: Sequence[str] = FREE, iters: int = 300,
                   framework_start: dict[str, float] | None = None,
                   ) -> tuple[Efficiency, dict[str, float], float]:
    """Parameters in ``free`` that minimise `mape` over all ``cases`` together: the fitted
    `Efficiency`, the fitted framework parameters and the MAPE. Fractions stay in (0, 1]."""
    start_fw = {"p2p_overhead_s": 1e-4, **(framework_start or {})}

    def build(x: np.ndarray) -> tuple[Efficiency, dict[str, float]]:
        values = {name: math.exp(v) for name, v in zip(free, x, strict=True)}
        for name in ("gemm_max_fraction", "memory_fraction"):
            if name in values:
                values[name] = min(1.0, values[name])
        fw = {n: values.pop(n) for n in FRAMEWORK if n in values}
        return dataclasses.replace(start, **values), fw

    x0 = np.array([math.log(max(start_fw[n] if n in FRAMEWORK else getattr(start, n), 1e-12))
                   for n in free])
    best = nelder_mead(lambda x: mape(cases, *build(x)[:1], **build(x)[1]), x0, iters=iters)
    eff, fw = build(best)
    return eff, fw, mape(cases, eff, **fw)


def main(argv: list[str]) -> int:
    """``python -m simulator.fit RUNS.csv DEVICE [FRAMEWORK]``: fit `FREE` starting from the
    presets, print the parameters and the MAPE."""
    path, device = argv[0], argv[1]
    cases = read_runs(path)
    start_fw = load_framework(argv[2]) if len(argv) > 2 else {}
    eff, fw, err = fit_efficiency(cases, load_efficiency(device), framework_start=start_fw)
    for name in FREE:
        print(f"{name}: {fw[name] if name in fw else getattr(eff, name):.4g}")
    print(f"mape: {err:.4f} over {len(cases)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

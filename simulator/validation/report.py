"""The error report of predictions against measurements, in one place: relative error, MAPE,
mean signed error, the worst row and the Spearman rank correlation. `meshplan validate` (the
published tables) and `meshplan compare` (runs on this machine) both report with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd


def rel_error(predicted: float, measured: float) -> float:
    """``predicted / measured − 1``: negative when the prediction is too fast.

    >>> rel_error(0.9, 1.0)
    -0.09999999999999998
    """
    return predicted / measured - 1


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation: Pearson's of the ranks (ties get their average rank);
    None when it is undefined (fewer than two values, or all equal), so JSON stays valid.
    (pandas' own ``method="spearman"`` needs scipy, which the project does not depend on.)

    >>> spearman([1, 2, 3], [10, 30, 20]), spearman([1], [2])
    (0.5, None)
    """
    if len(x) < 2:
        return None
    value = float(pd.Series(list(x)).rank().corr(pd.Series(list(y)).rank()))
    return None if math.isnan(value) else value


def error_summary(rows: Sequence[dict], *, predicted: str = "predicted_step_time_s",
                  measured: str = "reference_step_time_s") -> dict:
    """The report of ``rows`` (each with ``id``, ``rel_error`` and the two step times).

    Returns ``{"count", "mape", "mean_error", "max_abs_rel_error", "worst": {"id",
    "rel_error"}, "spearman"}``; the figures are None when there are no rows.

    >>> r = error_summary([{"id": "a", "rel_error": -0.2, "predicted_step_time_s": 0.8,
    ...                     "reference_step_time_s": 1.0},
    ...                    {"id": "b", "rel_error": 0.1, "predicted_step_time_s": 2.2,
    ...                     "reference_step_time_s": 2.0}])
    >>> round(r["mape"], 3), round(r["mean_error"], 3), r["worst"], round(r["spearman"], 6)
    (0.15, -0.05, {'id': 'a', 'rel_error': -0.2}, 1.0)
    """
    if not rows:
        return {"count": 0, "mape": None, "mean_error": None, "max_abs_rel_error": None,
                "worst": None, "spearman": None}
    errors = [float(r["rel_error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["rel_error"]))
    return {"count": len(rows), "mape": sum(abs(e) for e in errors) / len(errors),
            "mean_error": sum(errors) / len(errors),
            "max_abs_rel_error": max(abs(e) for e in errors),
            "worst": {"id": worst["id"], "rel_error": float(worst["rel_error"])},
            "spearman": spearman([r[predicted] for r in rows], [r[measured] for r in rows])}

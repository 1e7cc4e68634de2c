"""Goodput under failures: the checkpoint interval and the useful fraction of wall-clock time.

A cluster of N devices, each failing independently with mean time between failures M_dev, fails
as a whole every M = M_dev / N on average (exponential failures; the minimum of N exponentials).
Training writes a checkpoint (C seconds) after every tau seconds of work; a failure costs a
restart (R seconds: reschedule, reload the checkpoint) plus the work since the last checkpoint,
on average half a segment.

Sources: J. W. Young, "A first order approximation to the optimum checkpoint interval",
Communications of the ACM 17(9), 1974 (tau = sqrt(2·C·M)); J. T. Daly, "A higher order estimate
of the optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22(3),
2006, eq. (37).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.spec import PlanError


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise PlanError(f"{name}={value!r} must be > 0")


def cluster_mtbf_s(device_mtbf_s: float, num_devices: int) -> float:
    """Mean time between failures of the whole cluster: device MTBF / number of devices.

    >>> cluster_mtbf_s(3.6e6, 1000)
    3600.0
    """
    _positive(device_mtbf_s=device_mtbf_s, num_devices=num_devices)
    return device_mtbf_s / num_devices


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's (1974) optimum work between checkpoints, sqrt(2·C·M).

    >>> young_interval_s(50.0, 3600.0)
    600.0
    """
    _positive(checkpoint_s=checkpoint_s, mtbf_s=mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's (2006, eq. 37) higher-order optimum work between checkpoints.

    sqrt(2·C·M)·[1 + (1/3)·sqrt(C/(2M)) + (1/9)·(C/(2M))] − C for C < 2M, else M.

    >>> round(daly_interval_s(50.0, 3600.0), 2)
    567.13
    """
    _positive(checkpoint_s=checkpoint_s, mtbf_s=mtbf_s)
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def expected_goodput(interval_s: float, checkpoint_s: float, restart_s: float,
                     mtbf_s: float) -> float:
    """Expected fraction of wall-clock time spent on work that is kept (first-order model).

    Each segment of tau work + C checkpoint keeps tau / (tau + C) of its time; failures arrive
    every M of wall-clock time and each wastes R + (tau + C)/2 (restart plus, on average, half a
    segment of lost work, Young 1974), so the kept fraction is
    tau / (tau + C) · max(0, 1 − (R + (tau + C)/2) / M).

    Args:
        interval_s: work between checkpoints (tau).
        checkpoint_s: time to write one checkpoint (C).
        restart_s: time from a failure to training again, excluding lost work (R >= 0).
        mtbf_s: mean time between failures of the cluster (M), see `cluster_mtbf_s`.

    >>> round(expected_goodput(3600.0, 60.0, 600.0, 36000.0), 6)
    0.917213
    """
    _positive(interval_s=interval_s, checkpoint_s=checkpoint_s, mtbf_s=mtbf_s)
    if restart_s < 0:
        raise PlanError(f"restart_s={restart_s!r} must be >= 0")
    segment = interval_s + checkpoint_s
    lost = (restart_s + segment / 2) / mtbf_s
    return interval_s / segment * max(0.0, 1.0 - lost)


@dataclass(frozen=True, kw_only=True)
class GoodputEstimate:
    """Goodput of a training job (seconds, fractions).

    Attributes:
        mtbf_s: cluster MTBF.
        interval_s: work between checkpoints used.
        young_interval_s / daly_interval_s: the optimum intervals of Young and Daly.
        goodput: kept fraction of wall-clock time at ``interval_s``.
        optimal_goodput: kept fraction at ``daly_interval_s``.
        effective_tokens_per_s: ``tokens_per_s`` × goodput.
    """

    mtbf_s: float
    interval_s: float
    young_interval_s: float
    daly_interval_s: float
    goodput: float
    optimal_goodput: float
    effective_tokens_per_s: float


def goodput_estimate(*, tokens_per_s: float, num_devices: int, device_mtbf_s: float,
                     checkpoint_s: float, restart_s: float,
                     interval_s: float | None = None) -> GoodputEstimate:
    """Goodput of a job on ``num_devices`` devices; ``interval_s`` None uses Daly's optimum.

    >>> g = goodput_estimate(tokens_per_s=1e6, num_devices=1000, device_mtbf_s=3.6e6,
    ...                      checkpoint_s=50.0, restart_s=0.0, interval_s=600.0)
    >>> round(g.goodput, 4), g.young_interval_s
    (0.8397, 600.0)
    """
    mtbf = cluster_mtbf_s(device_mtbf_s, num_devices)
    daly = daly_interval_s(checkpoint_s, mtbf)
    tau = daly if interval_s is None else interval_s
    good = expected_goodput(tau, checkpoint_s, restart_s, mtbf)
    return GoodputEstimate(
        mtbf_s=mtbf, interval_s=tau, young_interval_s=young_interval_s(checkpoint_s, mtbf),
        daly_interval_s=daly, goodput=good,
        optimal_goodput=expected_goodput(daly, checkpoint_s, restart_s, mtbf),
        effective_tokens_per_s=tokens_per_s * good)

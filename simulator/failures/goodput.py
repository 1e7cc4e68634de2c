"""Goodput under failures, in closed form: failure rates, checkpoint cost, the checkpoint
interval and the useful fraction of wall-clock time of a job (`job_goodput`).

A cluster of N devices, each failing independently with mean time between failures M_dev, fails
as a whole every M = M_dev / N on average (exponential failures; the minimum of N exponentials).
Training writes a checkpoint (C seconds) after every tau seconds of work; a failure costs a
restart (R seconds: reschedule, reload the checkpoint) plus the work since the last checkpoint,
on average half a segment.

Sources: J. W. Young, "A first order approximation to the optimum checkpoint interval",
Communications of the ACM 17(9), 1974 (tau = sqrt(2·C·M)); J. T. Daly, "A higher order estimate
of the optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22(3),
2006, eq. (37); `exact_goodput` is the exponential-failure model behind that optimum: a
segment of ``tau`` work plus a checkpoint ``C`` takes ``M·e^(R/M)·(e^((tau+C)/M) − 1)``
expected wall time when failures (mean interval M) also strike during restarts (R) (Daly 2006,
§3). Independent exponential failures of devices, nodes and links add their rates.
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
    >>> exact_goodput(3600.0, 60.0, 600.0, 3.6)  # an MTBF of 1 ms: e**1000 would overflow
    0.0
    """
    if not (interval_s > 0 and checkpoint_s >= 0 and restart_s >= 0 and mtbf_s > 0):
        raise PlanError(f"need interval_s > 0, checkpoint_s >= 0, restart_s >= 0, mtbf_s > 0; "
                        f"got {interval_s}, {checkpoint_s}, {restart_s}, {mtbf_s}")
    lost, span = restart_s / mtbf_s, (interval_s + checkpoint_s) / mtbf_s
    if lost + span > 700:   # e**(lost + span) overflows a float: no segment ever completes
        return 0.0
    segment = mtbf_s * math.exp(lost) * math.expm1(span)
    return interval_s / segment


@dataclass(frozen=True, kw_only=True)
class JobGoodput:
    """Goodput of a job from its failure rates and costs (seconds; fractions).

    Attributes:
        mtbf_s: mean time between failures of the whole job.
        checkpoint_s: time to write one checkpoint.
        restart_s: mean restart (spare swaps of node failures included).
        interval_s: work between checkpoints used (Daly's optimum unless given).
        young_interval_s / daly_interval_s: the optimum intervals of Young and of Daly.
        goodput: kept fraction of wall time at ``interval_s``, first-order model.
        optimal_goodput: the same at ``daly_interval_s``.
        exact_goodput: kept fraction at ``interval_s``, exponential model (`exact_goodput`).
        tokens_per_s / effective_tokens_per_s: the healthy rate, and it times ``goodput``.
    """

    mtbf_s: float
    checkpoint_s: float
    restart_s: float
    interval_s: float
    young_interval_s: float
    daly_interval_s: float
    goodput: float
    optimal_goodput: float
    exact_goodput: float
    tokens_per_s: float
    effective_tokens_per_s: float


def job_goodput(*, tokens_per_s: float, num_devices: int, device_mtbf_s: float,
                checkpoint_s: float, restart_s: float, devices_per_node: int = 8,
                node_mtbf_s: float | None = None, link_mtbf_s: float | None = None,
                spare_delay_s: float = 0.0, node_failure_fraction: float | None = None,
                interval_s: float | None = None) -> JobGoodput:
    """Goodput of a job on ``num_devices`` devices: its failure rate (`job_failure_rate_per_s`;
    one link per device), a checkpoint of ``checkpoint_s`` (`checkpoint_write_s` works it out
    from the state size) every ``interval_s`` of work (None: Daly's optimum) and a restart.

    Node failures add ``spare_delay_s`` to their restart (spares assumed available); the
    default node share of failures is the node rate over the total.

    >>> g = job_goodput(tokens_per_s=1e6, num_devices=1000, device_mtbf_s=3.6e6,
    ...                 checkpoint_s=50.0, restart_s=0.0, interval_s=600.0)
    >>> g.mtbf_s, round(g.goodput, 4), g.young_interval_s
    (3600.0, 0.8397, 600.0)

    Raises:
        PlanError: a non-positive MTBF, device count or checkpoint time, or a negative
            restart.
    """
    nodes = max(1, math.ceil(num_devices / devices_per_node))
    rate = job_failure_rate_per_s(num_devices=num_devices, device_mtbf_s=device_mtbf_s,
                                  num_nodes=nodes, node_mtbf_s=node_mtbf_s,
                                  num_links=num_devices, link_mtbf_s=link_mtbf_s)
    mtbf = 1.0 / rate
    if node_failure_fraction is None:
        node_failure_fraction = (nodes / node_mtbf_s) / rate if node_mtbf_s else 0.0
    restart = restart_s + node_failure_fraction * spare_delay_s
    write = max(checkpoint_s, 1e-9)
    daly = daly_interval_s(write, mtbf)
    tau = interval_s if interval_s is not None else daly
    good = expected_goodput(tau, write, restart, mtbf)
    return JobGoodput(mtbf_s=mtbf, checkpoint_s=checkpoint_s, restart_s=restart, interval_s=tau,
                      young_interval_s=young_interval_s(write, mtbf), daly_interval_s=daly,
                      goodput=good, optimal_goodput=expected_goodput(daly, write, restart, mtbf),
                      exact_goodput=exact_goodput(tau, checkpoint_s, restart, mtbf),
                      tokens_per_s=tokens_per_s, effective_tokens_per_s=tokens_per_s * good)

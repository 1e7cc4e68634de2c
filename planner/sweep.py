"""Cluster-design sweeps: for one model and token budget, a full plan search at every point
of a grid of cluster variants (GPU count × node type × NIC speed × leaf oversubscription),
ranked by time-to-train.

Each point is independent, so the grid runs in parallel: on the local cores through a
`concurrent.futures.ProcessPoolExecutor` by default, or on a Ray cluster through Ray's task
API (``ray.remote`` / ``ray.get``) when given an address. Both call the same pure function
per point (`run_point`), so they return the same rows.

Time-to-train = token budget / predicted tokens/s of the point's best plan
(`planner.time_to_train.wall_s` at goodput 1: a healthy cluster; `meshplan plan --tokens`
adds failures); GPU-hours = time-to-train × GPUs / 3600; cost = GPU-hours × the node type's
price per GPU-hour, when one is given.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from planner.spec import PlanError

#: Plans the search of each point keeps exactly (`planner.search.search` ``prune``).
SWEEP_PRUNE = 20
SWEEP_COLUMNS = ["gpus", "node_type", "nic_Gbps", "oversubscription", "nodes", "best",
                 "tokens_per_s", "mfu", "step_time_s", "time_to_train_s", "gpu_hours",
                 "cost_usd", "candidates", "estimated"]


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One cluster variant: ``gpus`` devices of ``node_type`` on the fabric of ``base`` (the
    cluster preset of that node type when there is one), with the NIC line rate and the leaf
    oversubscription overridden where given (None: the preset's)."""

    gpus: int
    node_type: str
    nic_Gbps: float | None = None
    oversubscription: float | None = None
    base: str = "dgx-h100"


def sweep_grid(gpus: Sequence[int], node_types: Sequence[str],
               nic_Gbps: Sequence[float | None] = (None,),
               oversubscription: Sequence[float | None] = (None,),
               base: str = "dgx-h100",
               names: Mapping[str, str] | None = None) -> list[SweepPoint]:
    """Every combination of the axes, node type outermost (``names``: what messages call the
    axes, e.g. the command's flags; `simulator.network.variants.check_variant`).

    >>> [(p.gpus, p.node_type) for p in sweep_grid([8, 16], ["dgx-a100", "dgx-h100"])]
    [(8, 'dgx-a100'), (16, 'dgx-a100'), (8, 'dgx-h100'), (16, 'dgx-h100')]

    Raises:
        PlanError: an empty axis, a GPU count that is not a whole number of nodes, an
            unknown node type, or a NIC speed / oversubscription that is not positive.
    """
    from simulator.network.variants import check_variant
    for name, axis in (("gpus", gpus), ("node_types", node_types), ("nic_Gbps", nic_Gbps),
                       ("oversubscription", oversubscription)):
        if not axis:
            raise PlanError(f"sweep axis {(names or {}).get(name, name)} is empty; give at "
                            f"least one value")
    points = [SweepPoint(gpus=g, node_type=t, nic_Gbps=n, oversubscription=o, base=base)
              for t, g, n, o in itertools.product(node_types, gpus, nic_Gbps, oversubscription)]
    for p in points:
        check_variant(p.base, p.node_type, p.gpus, p.nic_Gbps, p.oversubscription, names)
    return points


def run_point(model_name: str, point: SweepPoint, token_budget: float, global_batch: int,
              prices: Mapping[str, float] | None = None) -> dict:
    """The full plan search at one point: a row of `SWEEP_COLUMNS` (time-to-train, GPU-hours
    and cost of the best plan; None where no plan fits)."""
    from planner.presets import load_model
    from planner.search import search
    from planner.time_to_train import wall_s
    from simulator.network.variants import cluster_variant
    model = load_model(model_name)
    cluster = cluster_variant(point.base, point.node_type, point.gpus, point.nic_Gbps,
                              point.oversubscription)
    row = {**asdict(point), "nodes": cluster.num_nodes}
    del row["base"]
    result = search(model, cluster, global_batch=global_batch, top_k=0, prune=SWEEP_PRUNE,
                    explain=False)
    row.update(candidates=result.stats["candidates"], estimated=result.stats["estimated"])
    if result.ranked.empty:
        return {**row, **dict.fromkeys(["best", "tokens_per_s", "mfu", "step_time_s",
                                        "time_to_train_s", "gpu_hours", "cost_usd"])}
    best = result.ranked.iloc[0]
    seconds = wall_s(token_budget, float(best["tokens_per_s"]), 1.0)  # healthy: no failures
    hours = seconds * point.gpus / 3600
    price = (prices or {}).get(point.node_type)
    return {**row, "best": best["id"], "tokens_per_s": float(best["tokens_per_s"]),
            "mfu": float(best["mfu"]), "step_time_s": float(best["step_time_s"]),
            "time_to_train_s": seconds, "gpu_hours": hours,
            "cost_usd": None if price is None else hours * price}


def run_sweep(model_name: str, points: Sequence[SweepPoint], *, token_budget: float,
              global_batch: int, prices: Mapping[str, float] | None = None,
              workers: int | None = None, ray_address: str | None = None) -> list[dict]:
    """`run_point` at every point, fastest time-to-train first (points where nothing fits
    last, in grid order).

    Args:
        workers: local processes (default: the machine's cores, at most one per point).
        ray_address: run each point as a Ray task on this cluster (``"auto"``, ``"local"``
            for a fresh local instance, a head node's ``host:port``, or ``ray://host:port``)
            instead of locally.
    Raises:
        PlanError: a non-positive budget, batch or worker count, or ``ray_address`` given
            without Ray installed (``pip install 'meshplan[ray]'``).
    """
    if not token_budget > 0:
        raise PlanError(f"token_budget={token_budget!r} must be > 0 (tokens to train on)")
    if global_batch < 1:
        raise PlanError(f"global_batch={global_batch} must be >= 1 sequence")
    if workers is not None and workers < 1:
        raise PlanError(f"workers={workers} must be >= 1")
    jobs = [(model_name, p, token_budget, global_batch, dict(prices or {})) for p in points]
    if ray_address is not None:
        rows = _on_ray(jobs, ray_address)
    else:
        n = min(workers or os.cpu_count() or 1, len(jobs))
        if n == 1:
            rows = [run_point(*job) for job in jobs]
        else:
            with ProcessPoolExecutor(max_workers=n) as pool:
                rows = list(pool.map(run_point, *zip(*jobs, strict=True)))
    return sorted(rows, key=lambda r: (r["time_to_train_s"] is None,
                                       r["time_to_train_s"] or 0.0))


def _on_ray(jobs: list[tuple], address: str) -> list[dict]:
    # One Ray task per point (Ray's own scheduler places them); a local instance when the
    # address is "local" and none is running.
    try:
        import ray
    except ImportError:
        raise PlanError("--ray-address needs Ray: pip install 'meshplan[ray]' (or "
                        "pip install ray), or leave --ray-address out to use the local "
                        "cores") from None
    started = not ray.is_initialized()  # else: the caller's connection is used as it is
    if started:
        ray.init(address=None if address == "local" else address, include_dashboard=False,
                 log_to_driver=False)
    try:
        task = ray.remote(run_point)
        return ray.get([task.remote(*job) for job in jobs])
    finally:
        if started:
            ray.shutdown()

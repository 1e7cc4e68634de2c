"""Slow links in the step simulation: a NIC below its line rate, and the groups it slows.

A slow link is the NIC a device uses running ``factor`` times below its line rate (a link
that trained down to a lower speed, a flapping port, a congested rail). Every device that
shares the NIC is behind it. What crosses it, and who waits:

- the data-parallel (dp·cp) group of each rank behind the NIC: a ring (or tree, or the
  inter-node phase of a hierarchical algorithm) moves at its slowest link, so that group's
  gradient reduction and weight gather, and its ZeRO-3 per-layer traffic, are costed as if
  every NIC of the group ran at the slow rate; the reduction is one collective over all
  replicas, so every replica's stage waits for it;
- the pipeline sends into and out of that stage of that replica: the path's bottleneck is
  min(path bandwidth, NIC rate / factor);
- TP and CP peers meet at every layer, so the whole stage of that replica runs at the pace
  of its slowest member's communication (as `simulator.failures.stragglers` does for
  compute).

Compute is unchanged. The replicas that differ run in SimPy; identical ones are merged
(`simulator.failures.stragglers.simulate_replicas`), so a slow link at 16,384 GPUs costs two
pipelines, not 2,048.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from planner.mesh import rank_coords
from planner.spec import Plan, PlanError
from simulator.failures.stragglers import group_slowdowns, slowed_costs
from simulator.network.cluster import Cluster
from simulator.step.stagecosts import StageCosts

#: Communication fields of a stage a slow link stretches (the DP ones go with the tail).
COMM_FIELDS = ("fwd_comm_s", "bwd_comm_s", "p2p_fwd_s", "p2p_bwd_s")
TAIL_FIELDS = ("dp_comm_s", "dp_gather_s")


def slow_nic_cluster(cluster: Cluster, factor: float) -> Cluster:
    """``cluster`` with every NIC at 1/``factor`` of its line rate: the collective model's
    NIC bandwidth, and every path that leaves a node capped at that rate
    (`Cluster.nic_cap_Bps`).

    >>> from simulator.network.cluster import load_cluster
    >>> c = load_cluster("dgx-h100", nodes=2)
    >>> slow_nic_cluster(c, 4.0).link(0, 8).bandwidth_Bps / c.link(0, 8).bandwidth_Bps
    0.25
    """
    rate = cluster.nic_bandwidth_Bps / factor
    return cluster.replace(nic_bandwidth_Bps=rate, nic_cap_Bps=min(cluster.nic_cap_Bps, rate))


def link_slowdowns(plan: Plan, cluster: Cluster,
                   slow_links: Mapping[int, float]) -> dict[tuple[int, int], float]:
    """``{(dp replica, pp stage): factor}`` of the stages that hold a rank behind a slow NIC
    (``slow_links``: device index -> factor by which its NIC is below line rate; every
    device sharing that NIC is behind it; the largest factor of a stage wins).

    >>> from simulator.network.cluster import load_cluster
    >>> p = Plan(tp=8, pp=2, dp=2, micro_batch=1, global_batch=2)
    >>> link_slowdowns(p, load_cluster("dgx-h100", nodes=4), {25: 2.0})  # node 3: pp 1, dp 1
    {(1, 1): 2.0}

    Raises:
        PlanError: a device the plan does not use, a factor that is not a finite number
            >= 1, or a cluster without NICs.
    """
    if cluster.nics_per_node == 0:
        raise PlanError(f"slow link on cluster {cluster.name!r}: it has no NICs (one node, "
                        "loopback); slow links apply to GPU clusters")
    dpn, out = cluster.devices_per_node, {}
    for device, factor in slow_links.items():
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or \
                not math.isfinite(factor) or factor < 1.0:
            raise PlanError(f"slow link factor={factor!r} on device {device} must be a finite "
                            "number >= 1 (1 = line rate, 2 = half the bandwidth)")
        if isinstance(device, bool) or not isinstance(device, int) or \
                not 0 <= device < plan.world_size:
            raise PlanError(f"slow link device={device!r} is not used by the plan: use a "
                            f"device in 0..{plan.world_size - 1}")
        node, nic = cluster.node_of(device), cluster.nic_of(device)
        for d in range(node * dpn, min((node + 1) * dpn, plan.world_size)):
            if cluster.nic_of(d) == nic:
                c = rank_coords(plan, d)
                key = (c["dp"], c["pp"])
                out[key] = max(out.get(key, 1.0), float(factor))
    return out


def _with_fields(c: StageCosts, src: StageCosts, fields: tuple[str, ...]) -> StageCosts:
    return dataclasses.replace(c, **{f: getattr(src, f) for f in fields})


def replica_costs(costs: list[StageCosts], plan: Plan, stragglers: Mapping[int, float],
                  links: Mapping[tuple[int, int], float],
                  slowed: Callable[[float], list[StageCosts]]
                  ) -> tuple[dict[tuple, list[StageCosts]], list[StageCosts]]:
    """The distinct replicas' costs and the shared DP tail, for `simulate_replicas`.

    A replica is keyed by (compute factor per stage, link factor per stage); replicas with
    the same key are one. ``links`` is `link_slowdowns`; ``slowed(f)`` the plan's costs on
    `slow_nic_cluster` (f). Entries of a slow stage take its communication from
    ``slowed(f)``, and so do the sends of its neighbours into it; stage s's reduction takes
    the slowest link of that stage in any replica.

    Raises:
        PlanError: as `simulator.failures.stragglers.group_slowdowns`.
    """
    pp, cache = plan.pp, {}

    def slow(f: float) -> list[StageCosts]:
        if f not in cache:
            cache[f] = slowed(f)
        return cache[f]

    compute = group_slowdowns(plan, stragglers)
    keys = {tuple((compute.get((d, s), 1.0), links.get((d, s), 1.0)) for s in range(pp))
            for d in {d for d, _ in compute} | {d for d, _ in links}}
    if len(keys) < plan.dp:
        keys.add(((1.0, 1.0),) * pp)
    replicas = {}
    for key in sorted(keys):
        rc = list(costs)
        for g in range(len(rc)):
            s = g % pp
            for stage, fields in ((s, COMM_FIELDS), ((s + 1) % pp, ("p2p_fwd_s",)),
                                  ((s - 1) % pp, ("p2p_bwd_s",))):
                if key[stage][1] > 1.0 and (stage == s or pp > 1):
                    rc[g] = _with_fields(rc[g], slow(key[stage][1])[g], fields)
        replicas[key] = slowed_costs(rc, tuple(k[0] for k in key))
    tail = list(costs)
    for s in range(pp):
        worst = max((f for (_, stage), f in links.items() if stage == s), default=1.0)
        if worst > 1.0:
            tail[s] = _with_fields(tail[s], slow(worst)[s], TAIL_FIELDS)
    return replicas, tail

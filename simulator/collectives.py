"""Alpha-beta cost models of collectives, and their placement on a `Cluster`.

Formulas (ring algorithms, n ranks, S bytes, link bandwidth B in bytes/s, per-step latency α):
Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH", and Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from planner.spec import Plan, PlanError
from simulator.cluster import Cluster

Collective = Literal["all_reduce", "reduce_scatter", "all_gather"]


def ring_allreduce_time_s(size_bytes: float, n: int, bandwidth_Bps: float,
                          latency_s: float) -> float:
    """Ring all-reduce: ``2(n−1)/n · S/B + 2(n−1)·α`` (Thakur et al. 2005, §4.5).

    >>> ring_allreduce_time_s(1e9, 4, 1e9, 1e-6)  # 2·3/4·1 s + 6 µs
    1.500006
    >>> ring_allreduce_time_s(1e9, 1, 1e9, 1e-6)
    0.0
    """
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * size_bytes / bandwidth_Bps + 2 * (n - 1) * latency_s


def ring_reduce_scatter_time_s(size_bytes: float, n: int, bandwidth_Bps: float,
                               latency_s: float) -> float:
    """Ring reduce-scatter of an S-byte buffer: ``(n−1)/n · S/B + (n−1)·α``.

    >>> ring_reduce_scatter_time_s(1e9, 4, 1e9, 1e-6)  # 3/4 s + 3 µs
    0.750003
    """
    if n <= 1:
        return 0.0
    return (n - 1) / n * size_bytes / bandwidth_Bps + (n - 1) * latency_s


def ring_allgather_time_s(size_bytes: float, n: int, bandwidth_Bps: float,
                          latency_s: float) -> float:
    """Ring all-gather into an S-byte buffer: ``(n−1)/n · S/B + (n−1)·α`` (same as
    reduce-scatter).

    >>> ring_allgather_time_s(8e6, 8, 1e9, 0.0)  # 7/8 · 8 ms
    0.007
    """
    return ring_reduce_scatter_time_s(size_bytes, n, bandwidth_Bps, latency_s)


def p2p_time_s(size_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Point-to-point transfer: ``α + S/B``.

    >>> p2p_time_s(1e6, 1e9, 1e-5)
    0.00101
    """
    return latency_s + size_bytes / bandwidth_Bps


_RING = {"all_reduce": ring_allreduce_time_s, "reduce_scatter": ring_reduce_scatter_time_s,
         "all_gather": ring_allgather_time_s}


def flows_per_nic(cluster: Cluster) -> float:
    """Concurrent inter-node flows per NIC when every device on a node sends at once (all DP
    groups reduce together): ``devices_per_node / nics_per_node``, at least 1."""
    if cluster.nics_per_node == 0:
        return 1.0
    return max(1.0, cluster.devices_per_node / cluster.nics_per_node)


def _flat_ring_link(cluster: Cluster, devices: list[int], concurrent: bool) -> tuple:
    # Bottleneck (bandwidth, per-step latency) of the ring d0 -> d1 -> ... -> d0. With
    # concurrent groups, NICs are shared by `flows_per_nic` flows and, across the spine, the
    # leaf uplinks by every device under the leaf (divided by the oversubscription).
    pairs = list(zip(devices, devices[1:] + devices[:1], strict=True))
    links = [cluster.link(a, b) for a, b in pairs]
    bandwidth = min(link.bandwidth_Bps for link in links)
    latency = max(link.latency_s for link in links)
    if concurrent and any(cluster.node_of(a) != cluster.node_of(b) for a, b in pairs):
        bandwidth /= flows_per_nic(cluster)
        if cluster.oversubscription > 1 and any(cluster.crosses_spine(a, b) for a, b in pairs):
            bandwidth /= cluster.oversubscription
    return bandwidth, latency


def _group_links(cluster: Cluster, devices: list[int], concurrent: bool) -> tuple:
    # (members per node k, nodes spanned, intra (B, α), inter (B, α)) of a group: the flat
    # ring's links when the group sits on one node or has one member per node, else the
    # links of the intra-node ring and of the ring over one member per node.
    by_node: dict[int, list[int]] = {}
    for d in devices:
        by_node.setdefault(cluster.node_of(d), []).append(d)
    k = max(len(v) for v in by_node.values())
    if len(by_node) == 1 or k == 1:
        flat = _flat_ring_link(cluster, devices, concurrent)
        return k, len(by_node), flat, flat
    local = next(iter(by_node.values()))
    across = [v[0] for v in by_node.values()]
    return (k, len(by_node), _flat_ring_link(cluster, local, concurrent),
            _flat_ring_link(cluster, across, concurrent))


def collective_time_s(cluster: Cluster, kind: Collective, size_bytes: float,
                      devices: Sequence[int], *, concurrent: bool = True) -> float:
    """Time of a ring collective over ``devices`` (indices) on ``cluster``.

    One node: a ring over the intra-node links. One device per node: a ring over the NICs.
    Several devices per node on several nodes: hierarchical, as NCCL does for all-reduce —
    reduce-scatter inside the node, the collective on the 1/k shard across nodes (k rings in
    parallel, one per NIC), then all-gather inside the node. With ``concurrent`` every group of
    the same shape runs at once, so NIC bandwidth is divided by `flows_per_nic`.

    Args:
        kind: 'all_reduce', 'reduce_scatter' or 'all_gather'; ``size_bytes`` is the full
            (unsharded) buffer.
    Raises:
        PlanError: unknown ``kind``.
    """
    if kind not in _RING:
        raise PlanError(f"collective kind={kind!r} is not one of {sorted(_RING)}")
    n = len(devices)
    if n <= 1 or size_bytes <= 0:
        return 0.0
    ring = _RING[kind]
    if cluster.collective_bandwidth_Bps is not None:
        return ring(size_bytes, n, cluster.collective_bandwidth_Bps,
                    cluster.collective_latency_s or 0.0)
    group = (devices.start, devices.step, n) if isinstance(devices, range) else tuple(devices)
    key = ("group", group, concurrent)
    if key not in cluster._links:
        cluster._links[key] = _group_links(cluster, list(devices), concurrent)
    k, nodes, intra, inter = cluster._links[key]
    if k == 1 or nodes == 1:
        return ring(size_bytes, n, *(inter if nodes > 1 else intra))
    inter = ring(size_bytes / k, nodes, *inter)
    if kind == "all_reduce":
        return (ring_reduce_scatter_time_s(size_bytes, k, *intra) + inter
                + ring_allgather_time_s(size_bytes, k, *intra))
    return ring(size_bytes, k, *intra) + inter


def p2p_time_on_cluster_s(cluster: Cluster, size_bytes: float, src: int, dst: int) -> float:
    """Point-to-point time from device ``src`` to ``dst`` over the graph path (α + S/B)."""
    if src == dst or size_bytes <= 0:
        return 0.0
    link = cluster.link(src, dst)
    return p2p_time_s(size_bytes, link.bandwidth_Bps, link.latency_s)


def mesh_strides(plan: Plan) -> dict[str, int]:
    """Device-index stride of each mesh axis; ``plan.placement`` lists axes innermost first.

    >>> from planner.spec import Plan
    >>> mesh_strides(Plan(tp=8, pp=4, dp=2, micro_batch=1, global_batch=8))
    {'tp': 1, 'dp': 8, 'pp': 16}
    """
    sizes = {"tp": plan.tp, "dp": plan.dp, "pp": plan.pp}
    strides, stride = {}, 1
    for axis in plan.placement:
        strides[axis] = stride
        stride *= sizes[axis]
    return strides


def group_devices(plan: Plan, axis: str, *, stage: int = 0) -> range:
    """Device indices of the ``axis`` group ('tp', 'dp' or 'pp') holding the first rank of
    pipeline stage ``stage`` (TP rank 0, DP rank 0).

    >>> from planner.spec import Plan
    >>> list(group_devices(Plan(tp=2, pp=2, dp=2, micro_batch=1, global_batch=4), "dp", stage=1))
    [4, 6]
    """
    strides = mesh_strides(plan)
    base = stage * strides["pp"]
    size = {"tp": plan.tp, "dp": plan.dp, "pp": plan.pp}[axis]
    if axis == "pp":
        base = 0
    return range(base, base + size * strides[axis], strides[axis])


"""Alpha-beta cost models of collectives, and their placement on a `Cluster`.

Formulas (n ranks, S bytes, link bandwidth B in bytes/s, per-step latency α): ring algorithms
from Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH", and Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; the double binary tree from Sanders, Speck & Träff 2009, "Two-tree algorithms
for full bandwidth broadcast, reduction and scan" (as NCCL 2.4 uses it across nodes); NVLink
SHARP in-switch reduction from the NVIDIA H100 whitepaper (2022). Bus bandwidth follows
nccl-tests' PERFORMANCE.md: busbw = algbw · factor, algbw = S / t.

On a cluster (`collective_cost`), every algorithm a collective library would consider is
costed and the fastest is picked, as NCCL's tuner does. A ring step's bandwidth is the
bottleneck of the group's share of each resource it crosses: the GPU's NVLink / PCIe port, the
NICs of its node (inter-node traffic spread over the NICs the group's members own, as NCCL's
channels do), the leaf uplinks (ECMP spreads flows evenly over the spines) and, in three tiers,
the pod uplinks; with ``concurrent=True`` all groups of the same shape run at once and share
them. Identical groups are costed once: the routed shape of a group is cached per layout
class (the offsets of its members from its first, which with ``concurrent=True`` fix every
sibling group), and each cost per (kind, bytes, layout class, algorithm), both on the cluster;
`cost_memo` turns the second cache off to compare against the uncached path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np

from planner.mesh import mesh_strides
from planner.spec import Plan, PlanError
from simulator.network.cluster import Cluster

Collective = Literal["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                     "send_recv"]
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
               "send_recv")
ALGORITHMS = ("ring", "tree", "hierarchical", "nvls", "pairwise", "p2p")
#: Whether collective and P2P costs are memoised per cluster (see `cost_memo`).
_MEMO = {"on": True}


@contextmanager
def cost_memo(enabled: bool) -> Iterator[None]:
    """Turn the per-cluster memo of collective and pipeline-P2P costs on or off inside a
    ``with`` block (off: every call is costed afresh, as a reference for the memoised path;
    both give the same numbers). The routed group shapes stay cached either way.

    >>> with cost_memo(False):
    ...     memo_enabled()
    False
    >>> memo_enabled()
    True
    """
    before = _MEMO["on"]
    _MEMO["on"] = enabled
    try:
        yield
    finally:
        _MEMO["on"] = before


def memo_enabled() -> bool:
    """Whether `cost_memo` is on (the default)."""
    return _MEMO["on"]


def identity_memo(store: dict, key: tuple, objects: tuple, compute: Callable[[], object],
                  max_entries: int = 1 << 16):
    """``compute()``, memoised in ``store`` under ``key``: a key that names objects by
    ``id()`` lists them in ``objects``, kept with the entry and checked by identity on a hit
    (so a reused id of a freed object never hits); ``store`` is cleared when it holds
    ``max_entries`` entries.

    >>> store, calls = {}, []
    >>> a = [1]
    >>> identity_memo(store, ("x", id(a)), (a,), lambda: calls.append(1) or len(calls))
    1
    >>> identity_memo(store, ("x", id(a)), (a,), lambda: calls.append(1) or len(calls))
    1
    """
    hit = store.get(key)
    if hit is not None and all(x is y for x, y in zip(hit[0], objects, strict=True)):
        return hit[1]
    if len(store) >= max_entries:
        store.clear()
    value = compute()
    store[key] = (objects, value)
    return value


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


def tree_allreduce_time_s(size_bytes: float, n: int, bandwidth_Bps: float,
                          latency_s: float) -> float:
    """Double binary tree all-reduce: reduce up and broadcast down two trees of depth
    ``⌈log2 n⌉``, each carrying S/2, pipelined: ``2·⌈log2 n⌉·α + 2·S/B`` (Sanders et al. 2009;
    each rank sends S up and S down in total).

    >>> round(tree_allreduce_time_s(0.0, 1024, 1e9, 1e-6), 12)  # 2·10 steps of 1 µs
    2e-05
    """
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * latency_s + 2 * size_bytes / bandwidth_Bps


def all_to_all_time_s(size_bytes: float, n: int, bandwidth_Bps: float,
                      latency_s: float) -> float:
    """Pairwise-exchange all-to-all of S bytes per rank: ``(n−1)/n · S/B + (n−1)·α``.

    >>> all_to_all_time_s(8e6, 8, 1e9, 0.0)
    0.007
    """
    return ring_reduce_scatter_time_s(size_bytes, n, bandwidth_Bps, latency_s)


def ring_broadcast_time_s(size_bytes: float, n: int, bandwidth_Bps: float,
                          latency_s: float) -> float:
    """Pipelined chain broadcast (NCCL's ring broadcast): ``S/B + (n−1)·α``.

    >>> ring_broadcast_time_s(1e9, 8, 1e9, 1e-6)
    1.000007
    """
    if n <= 1:
        return 0.0
    return size_bytes / bandwidth_Bps + (n - 1) * latency_s


def p2p_time_s(size_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Point-to-point transfer: ``α + S/B``.

    >>> p2p_time_s(1e6, 1e9, 1e-5)
    0.00101
    """
    return latency_s + size_bytes / bandwidth_Bps


def busbw_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw · factor (PERFORMANCE.md).

    >>> busbw_factor("all_reduce", 8), busbw_factor("all_gather", 8), busbw_factor("send_recv", 2)
    (1.75, 0.875, 1.0)
    """
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


_RING = {"all_reduce": ring_allreduce_time_s, "reduce_scatter": ring_reduce_scatter_time_s,
         "all_gather": ring_allgather_time_s, "all_to_all": all_to_all_time_s,
         "broadcast": ring_broadcast_time_s}


def flows_per_nic(cluster: Cluster) -> float:
    """Concurrent inter-node flows per NIC when every device on a node sends at once (all DP
    groups reduce together): ``devices_per_node / nics_per_node``, at least 1."""
    if cluster.nics_per_node == 0:
        return 1.0
    return max(1.0, cluster.devices_per_node / cluster.nics_per_node)


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """One costed collective: time, the algorithm picked, and nccl-tests bandwidths."""

    kind: str
    size_bytes: float
    ranks: int
    time_s: float
    algorithm: str
    protocol: str = "simple"

    @property
    def algbw_Bps(self) -> float:
        """S / t (nccl-tests' algorithm bandwidth)."""
        return self.size_bytes / self.time_s if self.time_s > 0 else math.inf

    @property
    def busbw_Bps(self) -> float:
        """algbw · `busbw_factor`."""
        return self.algbw_Bps * busbw_factor(self.kind, self.ranks)


def concurrent_groups(cluster: Cluster, devices: Sequence[int],
                      concurrent: bool = True) -> np.ndarray:
    """The groups that run at the same time as ``devices``, one per row (``devices`` first
    in shape): with ``concurrent`` every translate of the group that tiles the cluster (the
    other DP / TP groups of a mesh), else the group alone.

    >>> from simulator.network.cluster import load_cluster
    >>> concurrent_groups(load_cluster("dgx-h100", nodes=2), range(0, 16, 8)).shape
    (8, 2)
    """
    d = np.asarray(list(devices), dtype=np.int64)
    total = cluster.num_devices
    if not concurrent or len(d) < 2:
        return d[None, :]
    steps = np.diff(d)
    if (steps == steps[0]).all() and steps[0] > 0:
        stride, span = int(steps[0]), len(d) * int(steps[0])
        offsets = (np.arange(max(1, total // span))[:, None] * span
                   + np.arange(stride)[None, :]).ravel()
    else:
        span = int(d.max() - d.min() + 1)
        offsets = np.arange(max(1, total // span)) * span
    rows = offsets[:, None] + (d - d.min())[None, :]
    return rows[rows.max(axis=1) < total] if rows.max() >= total else rows


def _nic_seconds_per_byte(cluster: Cluster, rows: np.ndarray, node_out: np.ndarray,
                          su_out: np.ndarray, pod_out: np.ndarray) -> float:
    # Seconds per byte of the busiest fabric resource when member (g, j) of every group sends
    # node_out[g, j] bytes off its node (su_out of them off its SU, pod_out off its pod), each
    # group spreading a node's traffic evenly over the NICs its members there own.
    dpn, nics = cluster.devices_per_node, cluster.nics_per_node
    g = np.broadcast_to(np.arange(rows.shape[0])[:, None], rows.shape).ravel()
    dev = rows.ravel()
    node = dev // dpn
    nic = (dev % dpn) * nics // dpn
    ugx, gx_inv = np.unique(g * cluster.num_nodes + node, return_inverse=True)
    triples, first = np.unique(gx_inv * nics + nic, return_index=True)
    t_gx = triples // nics
    share = 1.0 / np.bincount(t_gx, minlength=len(ugx))[t_gx]
    t_node, t_nic = node[first], nic[first]
    inv = 0.0
    levels = [(node_out, t_node * nics + t_nic, cluster.nic_bandwidth_Bps
               * cluster.comm.nic_efficiency)]
    rails = nics if cluster.rail_optimized else 1
    rail = t_nic if cluster.rail_optimized else 0
    if cluster.tiers > 1:
        levels.append((su_out, (t_node // cluster.nodes_per_leaf) * rails + rail,
                       cluster.leaf_uplink_Bps))
    if cluster.tiers > 2:
        levels.append((pod_out, (t_node // cluster.nodes_per_pod) * rails + rail,
                       cluster.pod_uplink_Bps))
    for demand, resource, capacity in levels:
        per_gx = np.bincount(gx_inv, weights=demand.ravel(), minlength=len(ugx))
        load = np.bincount(resource, weights=per_gx[t_gx] * share)
        if load.size and load.max() > 0:
            inv = max(inv, float(load.max()) / capacity)
    return inv


@dataclass(frozen=True)
class _Ring:
    # A ring's per-chunk-byte costs: SM-side (NVLink / PCIe port) and fabric side, and the
    # worst path latency of its intra-node and inter-node edges (wire only).
    intra_inv: float
    inter_inv: float
    intra_lat: float
    inter_lat: float


def _ring(cluster: Cluster, rows: np.ndarray) -> _Ring:
    dpn = cluster.devices_per_node
    nxt = np.roll(rows, -1, axis=1)
    node_a, node_b = rows // dpn, nxt // dpn
    cross = node_a != node_b
    intra_inv = inter_inv = 0.0
    intra_lat = inter_lat = 0.0
    if (~cross).any():
        intra_inv = 1.0 / (cluster.intra_bandwidth_Bps * cluster.comm.link_efficiency)
    if cross.any():
        npl, npp = cluster.nodes_per_leaf, cluster.nodes_per_pod or cluster.num_nodes
        inter_inv = _nic_seconds_per_byte(
            cluster, rows, cross.astype(float),
            (node_a // npl != node_b // npl).astype(float),
            (node_a // npp != node_b // npp).astype(float))
    # Path latencies: one query per path class (the cluster caches them).
    for a, b, c in zip(rows[0].tolist(), nxt[0].tolist(), cross[0].tolist(), strict=True):
        lat = cluster.link(a, b).latency_s
        if c:
            inter_lat = max(inter_lat, lat)
        else:
            intra_lat = max(intra_lat, lat)
    return _Ring(intra_inv, inter_inv, intra_lat, inter_lat)


def _by_node(cluster: Cluster, rows: np.ndarray) -> np.ndarray | None:
    # rows (g, n) -> (g, nodes, k) when every node of a group holds k members in a block.
    dpn = cluster.devices_per_node
    rows = np.sort(rows, axis=1)
    nodes = rows // dpn
    counts = np.unique(nodes[0], return_counts=True)[1]
    k = int(counts[0])
    if (counts != k).any() or k == rows.shape[1] or k == 1:
        return None
    blocks = rows.reshape(rows.shape[0], -1, k)
    if (blocks // dpn != blocks[:, :, :1] // dpn).any():
        return None
    return blocks


def _members_sharing(rows: np.ndarray, key: np.ndarray) -> np.ndarray:
    # For each member, how many members of its own row share its key (node, SU or pod).
    g = np.broadcast_to(np.arange(rows.shape[0])[:, None], rows.shape)
    _, inv, counts = np.unique(g * (int(key.max()) + 1) + key, return_inverse=True,
                               return_counts=True)
    return counts[inv.reshape(rows.shape)]


@dataclass(frozen=True)
class _Shape:
    # Everything about a group (and its concurrent siblings) that does not depend on size.
    n: int
    nodes: int
    k: int
    flat: _Ring
    intra: _Ring | None
    inter: _Ring | None
    a2a_intra_inv: float
    a2a_inter_inv: float


def _layout_class(devices: Sequence[int], concurrent: bool) -> tuple:
    # What a group's cost depends on besides kind and bytes. Concurrent groups tile the
    # cluster from device 0 (`concurrent_groups`), so only the members' offsets from the
    # first matter: a stride and a length for a range; alone, the devices themselves.
    if isinstance(devices, range):
        if concurrent and devices.step > 0 and len(devices) > 1:
            return ("stride", devices.step, len(devices))
        return ("range", devices.start, devices.step, len(devices), concurrent)
    if concurrent and len(devices) > 1:
        low = min(devices)
        return ("offsets", *(d - low for d in devices))
    return ("alone", *devices)


def _shape(cluster: Cluster, devices: Sequence[int], concurrent: bool) -> _Shape:
    key = ("shape", _layout_class(devices, concurrent))
    if key in cluster._links:
        return cluster._links[key]
    rows = np.sort(concurrent_groups(cluster, devices, concurrent), axis=1)
    dpn, n = cluster.devices_per_node, rows.shape[1]
    nodes = rows // dpn
    k = int(_members_sharing(rows[:1], nodes[:1]).max())
    blocks = _by_node(cluster, rows)
    intra = inter = None
    if blocks is not None:
        intra = _ring(cluster, blocks.reshape(-1, blocks.shape[2]))
        inter = _ring(cluster, blocks.transpose(0, 2, 1).reshape(-1, blocks.shape[1]))
    # All-to-all: each member sends S/n to every other member.
    npl, npp = cluster.nodes_per_leaf, cluster.nodes_per_pod or cluster.num_nodes
    a2a_inter = 0.0
    if cluster.nics_per_node and (nodes != nodes[:, :1]).any():
        out = [(n - _members_sharing(rows, nodes // m)) / n for m in (1, npl, npp)]
        a2a_inter = _nic_seconds_per_byte(cluster, rows, *out)
    a2a_intra = (k - 1) / n / (cluster.intra_bandwidth_Bps * cluster.comm.link_efficiency)
    shape = _Shape(n=n, nodes=len(np.unique(nodes[0])), k=k, flat=_ring(cluster, rows),
                   intra=intra, inter=inter, a2a_intra_inv=a2a_intra, a2a_inter_inv=a2a_inter)
    cluster._links[key] = shape
    return shape


_RING_STEPS = {"all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
               "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
               "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
               "broadcast": (lambda n: n - 1, lambda n: 1.0)}


def _candidates(cluster: Cluster, kind: str, size: float, sh: _Shape) -> dict[str, float]:
    # Time of every (algorithm, protocol) that applies, before the launch cost.
    out: dict[str, float] = {}
    for proto, step, frac in cluster.comm.protocols():
        times = _algorithm_times(cluster, kind, size, sh, step, frac)
        for algo, t in times.items():
            if algo == "nvls" and proto != "simple":
                continue  # NVLS runs on the Simple protocol only
            out[f"{algo}/{proto}"] = t
    return out


def _algorithm_times(cluster: Cluster, kind: str, size: float, sh: _Shape, step: float,
                     bw_frac: float) -> dict[str, float]:
    # SM-side work (NVLink / PCIe copies plus the endpoint's own reads and writes) and the NIC
    # DMA pipeline overlap: a ring's bandwidth term is the slower of the two. ``step`` is the
    # protocol's software cost per step, ``bw_frac`` the share of link bandwidth it achieves.
    end = size / cluster.comm.endpoint_Bps
    n, r = sh.n, sh.flat
    intra_inv, inter_inv = r.intra_inv / bw_frac, r.inter_inv / bw_frac
    a_in, a_net = r.intra_lat + step, r.inter_lat + step
    lat = max(r.intra_lat, r.inter_lat) + step
    out: dict[str, float] = {}
    if kind in _RING_STEPS:
        steps, frac = (f(n) for f in _RING_STEPS[kind])
        out["ring"] = steps * lat + max(frac * size * intra_inv + end,
                                        frac * size * inter_inv)
    if kind == "all_reduce" and sh.nodes > 1:
        # NCCL's tree: a chain inside each node, a double binary tree across nodes.
        out["tree"] = (2 * (math.ceil(math.log2(sh.nodes)) * a_net + (sh.k - 1) * a_in)
                       + max(2 * size * intra_inv + end, 2 * size * inter_inv))
    if kind == "all_reduce" and sh.nodes == 1 and cluster.in_switch_reduction:
        # NVLink SHARP: each GPU pushes S to the switch, which reduces its 1/n slice and
        # multicasts it: S + S/n out and in per GPU, two steps.
        out["nvls"] = 2 * a_in + (1 + 1 / n) * size * intra_inv + end
    if kind in ("all_reduce", "reduce_scatter", "all_gather") and sh.intra is not None:
        k, nodes = sh.k, sh.nodes
        mult = 2 if kind == "all_reduce" else 1
        phase_in = mult * ((k - 1) * (sh.intra.intra_lat + step) + (k - 1) / k * size
                           * sh.intra.intra_inv / bw_frac)
        phase_out = mult * ((nodes - 1) * (sh.inter.inter_lat + step) + (nodes - 1) / nodes
                            * size / k * sh.inter.inter_inv / bw_frac)
        out["hierarchical"] = phase_in + phase_out + end
    if kind == "all_to_all":
        out["pairwise"] = (n - 1) * lat + max(size * sh.a2a_intra_inv / bw_frac + end,
                                              size * sh.a2a_inter_inv / bw_frac)
    if kind == "send_recv":
        out["p2p"] = lat + max(size * intra_inv + end, size * inter_inv)
    return out


def collective_cost(cluster: Cluster, kind: Collective, size_bytes: float,
                    devices: Sequence[int], *, concurrent: bool = True,
                    algorithm: str = "auto") -> CollectiveCost:
    """Cost of collective ``kind`` on ``devices`` (indices) of ``cluster``, as a library
    would run it: every applicable algorithm (ring, tree, hierarchical, nvls, pairwise, p2p)
    is costed and the fastest is taken, unless ``algorithm`` names one.

    Args:
        kind: one of `COLLECTIVES`; ``size_bytes`` is the full buffer as nccl-tests counts it
            (all-gather: the gathered output; send_recv: ``devices`` is ``[src, dst]``).
        concurrent: every group of the same shape runs at once and shares NICs and uplinks.
    Raises:
        PlanError: unknown ``kind``, a send_recv without exactly 2 devices, a device outside
            the cluster, or an ``algorithm`` that does not apply (the message lists those
            that do).
    """
    if kind not in COLLECTIVES:
        raise PlanError(f"collective kind={kind!r} is not one of {list(COLLECTIVES)}")
    n = len(devices)
    if kind == "send_recv" and n != 2:
        raise PlanError(f"send_recv needs exactly 2 devices [src, dst], got {n}")
    if n <= 1 or size_bytes <= 0:
        return CollectiveCost(kind=kind, size_bytes=size_bytes, ranks=n, time_s=0.0,
                              algorithm="none", protocol="none")
    if cluster.collective_bandwidth_Bps is not None:
        return _override_cost(cluster, kind, size_bytes, devices)
    low, high = _bounds(devices)
    if low < 0 or high >= cluster.num_devices:
        raise PlanError(f"devices {low}..{high} are outside [0, "
                        f"{cluster.num_devices}) of cluster {cluster.name!r}")
    if not _MEMO["on"]:
        return _routed_cost(cluster, kind, size_bytes, devices, concurrent, algorithm)
    memo = cluster._links.setdefault("costs", {})
    key = (kind, size_bytes, _layout_class(devices, concurrent), algorithm)
    cost = memo.get(key)
    if cost is None:
        cost = memo[key] = _routed_cost(cluster, kind, size_bytes, devices, concurrent,
                                        algorithm)
    return cost


def _bounds(devices: Sequence[int]) -> tuple[int, int]:
    # (lowest, highest) device; O(1) for a range.
    if isinstance(devices, range):
        return min(devices[0], devices[-1]), max(devices[0], devices[-1])
    return min(devices), max(devices)


def _routed_cost(cluster: Cluster, kind: str, size_bytes: float, devices: Sequence[int],
                 concurrent: bool, algorithm: str) -> CollectiveCost:
    # Every applicable algorithm on the group's routed shape; the fastest, or the one named.
    n = len(devices)
    options = _candidates(cluster, kind, size_bytes, _shape(cluster, devices, concurrent))
    if algorithm != "auto":
        chosen = {k: v for k, v in options.items() if algorithm in (k, k.split("/")[0])}
        if not chosen:
            names = sorted({k.split("/")[0] for k in options})
            raise PlanError(f"algorithm={algorithm!r} does not apply to {kind} on this group; "
                            f"use one of {names}, one of {sorted(options)} or 'auto'")
        options = chosen
    best = min(options, key=options.get)
    algo, proto = best.split("/")
    return CollectiveCost(kind=kind, size_bytes=size_bytes, ranks=n, algorithm=algo,
                          protocol=proto, time_s=cluster.comm.launch_latency_s + options[best])


def _override_cost(cluster: Cluster, kind: str, size: float,
                   devices: Sequence[int]) -> CollectiveCost:
    # Loopback gloo: one measured per-step alpha and bus bandwidth for every ring.
    n = len(devices)
    if kind == "send_recv":
        link = cluster.link(devices[0], devices[1])
        t, algo = p2p_time_s(size, link.bandwidth_Bps, link.latency_s), "p2p"
    else:
        t = _RING[kind](size, n, cluster.collective_bandwidth_Bps,
                        cluster.collective_latency_s or 0.0)
        algo = "pairwise" if kind == "all_to_all" else "ring"
    return CollectiveCost(kind=kind, size_bytes=size, ranks=n, time_s=t, algorithm=algo,
                          protocol="gloo")


def collective_time_s(cluster: Cluster, kind: Collective, size_bytes: float,
                      devices: Sequence[int], *, concurrent: bool = True,
                      algorithm: str = "auto") -> float:
    """Seconds of collective ``kind`` over ``devices`` on ``cluster`` (see
    `collective_cost`): the fastest of ring, tree, hierarchical and in-switch algorithms, with
    NICs and uplinks shared by every concurrent group of the same shape.

    Raises:
        PlanError: unknown ``kind`` or inapplicable ``algorithm``.
    """
    return collective_cost(cluster, kind, size_bytes, devices, concurrent=concurrent,
                           algorithm=algorithm).time_s


def p2p_time_on_cluster_s(cluster: Cluster, size_bytes: float, src: int, dst: int) -> float:
    """Point-to-point time from device ``src`` to ``dst`` over the graph path (α + S/B)."""
    if src == dst or size_bytes <= 0:
        return 0.0
    link = cluster.link(src, dst)
    return p2p_time_s(size_bytes, link.bandwidth_Bps, link.latency_s)


def p2p_boundary_time_s(cluster: Cluster, plan: Plan, size_bytes: float, src: int,
                        dst: int) -> float:
    """Pipeline send from device ``src`` to ``dst`` while every rank of the same stage sends
    across the same boundary at once: ``α + k·S/B``, k = the concurrent off-node flows that
    leave through ``src``'s NIC (all TP ranks and DP replicas of a stage on one node send in
    the same schedule slot; with fewer NICs than devices, they share them).

    Equal to `p2p_time_on_cluster_s` inside a node and with one NIC per device (the flows of
    a DGX node use their own rails, k = 1).

    >>> from planner.spec import Plan
    >>> from simulator.network.cluster import load_cluster
    >>> c = load_cluster("dgx-a100", nodes=2)
    >>> p = Plan(tp=8, pp=2, dp=1, micro_batch=1, global_batch=8)
    >>> p2p_boundary_time_s(c, p, 1e6, 0, 8) == p2p_time_on_cluster_s(c, 1e6, 0, 8)
    True
    """
    if src == dst or size_bytes <= 0:
        return 0.0
    return boundary_send_time_s(cluster, size_bytes, src, dst, pp_stride=mesh_strides(plan)["pp"],
                                pp=plan.pp)


def boundary_send_time_s(cluster: Cluster, size_bytes: float, src: int, dst: int, *,
                         pp_stride: int, pp: int) -> float:
    """`p2p_boundary_time_s` for a pipeline of ``pp`` stages whose stage s starts at device
    s · ``pp_stride`` (what it reads of the plan).

    >>> from simulator.network.cluster import load_cluster
    >>> c = load_cluster("dgx-a100", nodes=2)
    >>> p = Plan(tp=8, pp=2, dp=1, micro_batch=1, global_batch=8)
    >>> boundary_send_time_s(c, 1e6, 0, 8, pp_stride=8, pp=2) == p2p_boundary_time_s(c, p, 1e6,
    ...                                                                              0, 8)
    True
    """
    if src == dst or size_bytes <= 0:
        return 0.0
    if not _MEMO["on"]:
        flows, link = _boundary_flows(cluster, pp_stride, pp, src, dst)
    else:
        # The flows depend on the pipeline layout and the two devices, not on the bytes.
        memo = cluster._links.setdefault("p2p", {})
        key = (pp_stride, pp, src, dst)
        found = memo.get(key)
        if found is None:
            found = memo[key] = _boundary_flows(cluster, pp_stride, pp, src, dst)
        flows, link = found
    return p2p_time_s(flows * size_bytes, link.bandwidth_Bps, link.latency_s)


def _boundary_flows(cluster: Cluster, stride: int, pp: int, src: int, dst: int):
    # (k, link) of `p2p_boundary_time_s`: k = 1 inside a node or without NICs, else the
    # concurrent same-stage flows that leave src's node through src's NIC (at least 1).
    link = cluster.link(src, dst)
    node = cluster.node_of(src)
    if node == cluster.node_of(dst) or cluster.nics_per_node == 0:
        return 1, link
    delta = dst - src
    stage = (src // stride) % pp
    nic, flows = cluster.nic_of(src), 0
    first = node * cluster.devices_per_node
    for d in range(first, min(first + cluster.devices_per_node, cluster.num_devices)):
        peer = d + delta
        if ((d // stride) % pp == stage and 0 <= peer < cluster.num_devices
                and cluster.node_of(peer) != node and cluster.nic_of(d) == nic):
            flows += 1
    return max(1, flows), link

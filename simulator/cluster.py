"""Clusters as NetworkX graphs of devices, switches and links, with presets as YAML data.

Graph nodes are devices ``("gpu", node, local)`` (or ``("cpu", 0, rank)``) and switches
``("nvswitch", node)``, ``("nic", node, local)``, ``("leaf", i)``, ``("spine", i)``,
``("loopback", 0)``. Every edge carries ``bandwidth_Bps`` (per direction) and ``latency_s``.
Device index ``d`` is ``node * devices_per_node + local``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

import networkx as nx
import yaml

from planner.spec import PlanError
from simulator.hardware import DeviceProfile, load_device

PRESET_DIR = Path(__file__).with_name("presets")


class Link(NamedTuple):
    """Alpha-beta parameters of a path: bottleneck bandwidth (B/s), summed latency (s), hops."""

    bandwidth_Bps: float
    latency_s: float
    hops: int


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A set of devices and the network between them.

    Attributes:
        name: preset name or file stem.
        graph: devices, switches and links (edges: ``bandwidth_Bps``, ``latency_s``).
        device: hardware profile of every device.
        num_nodes: servers.
        devices_per_node: devices (GPUs, or ranks for localhost-cpu) per server.
        default_dtype: dtype plans use by default ('bf16' on GPUs, 'fp32' on CPU).
        nics_per_node: NICs per server that carry inter-node traffic (0 for localhost-cpu).
        nodes_per_leaf: servers per leaf switch (for the path class cache).
        oversubscription: leaf downlink / uplink bandwidth ratio (1 = non-blocking fat tree);
            when every device sends across the spine at once each gets
            ``nics_per_node · nic_bw / (devices_per_node · oversubscription)``.
        compute_share: fraction of a device each rank gets (C/R when R ranks share C cores).
        collective_latency_s / collective_bandwidth_Bps: when set, collectives use this per-step
            alpha and bus bandwidth instead of the graph links (loopback gloo, where the CPU
            reduction, not a wire, is the bottleneck).
        source: where the numbers come from.
    """

    name: str
    graph: nx.Graph = field(compare=False, repr=False)
    device: DeviceProfile
    num_nodes: int
    devices_per_node: int
    default_dtype: str
    nics_per_node: int = 0
    nodes_per_leaf: int = 1
    oversubscription: float = 1.0
    compute_share: float = 1.0
    collective_latency_s: float | None = None
    collective_bandwidth_Bps: float | None = None
    source: str = ""
    _links: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_devices(self) -> int:
        """All devices: num_nodes · devices_per_node."""
        return self.num_nodes * self.devices_per_node

    def node_of(self, index: int) -> int:
        """Server that device ``index`` sits in."""
        return index // self.devices_per_node

    def device_key(self, index: int) -> tuple:
        """Graph node of device ``index``.

        Raises:
            PlanError: ``index`` is outside ``[0, num_devices)``.
        """
        if not 0 <= index < self.num_devices:
            raise PlanError(f"device index {index} is outside [0, {self.num_devices}) of "
                            f"cluster {self.name!r}")
        kind = "cpu" if self.nics_per_node == 0 else "gpu"
        return (kind, self.node_of(index), index % self.devices_per_node)

    def _path_class(self, i: int, j: int) -> tuple:
        # Devices are symmetric within a class: same device, same node, same leaf, other leaf.
        if i == j:
            return ("self",)
        ni, nj = self.node_of(i), self.node_of(j)
        if ni == nj:
            return ("node",)
        if ni // self.nodes_per_leaf == nj // self.nodes_per_leaf:
            return ("leaf",)
        return ("spine",)

    def link(self, i: int, j: int) -> Link:
        """Alpha-beta parameters between devices ``i`` and ``j``.

        Bottleneck bandwidth and summed latency over the NetworkX shortest (fewest-hop) path,
        cached per path class (same node / same leaf / across the spine), so a query on a
        16,384-device cluster costs one BFS per class.
        """
        key = self._path_class(i, j)
        if key not in self._links:
            if key == ("self",):
                self._links[key] = Link(math.inf, 0.0, 0)
            else:
                path = nx.bidirectional_shortest_path(self.graph, self.device_key(i),
                                                      self.device_key(j))
                edges = [self.graph.edges[a, b] for a, b in pairwise(path)]
                self._links[key] = Link(min(e["bandwidth_Bps"] for e in edges),
                                        sum(e["latency_s"] for e in edges), len(edges))
        return self._links[key]

    def crosses_spine(self, i: int, j: int) -> bool:
        """Whether devices ``i`` and ``j`` sit under different leaf switches."""
        return self._path_class(i, j) == ("spine",)

    def replace(self, **changes: object) -> Cluster:
        """A copy with some fields changed (the link cache starts empty)."""
        return dataclasses.replace(self, _links={}, **changes)

    def scale_links(self, bandwidth: float = 1.0, latency: float = 1.0) -> Cluster:
        """A copy with every link's bandwidth multiplied by ``bandwidth`` and latency by
        ``latency`` (the collective overrides too)."""
        graph = self.graph.copy()
        for _, _, data in graph.edges(data=True):
            data["bandwidth_Bps"] *= bandwidth
            data["latency_s"] *= latency
        coll_bw = self.collective_bandwidth_Bps
        coll_lat = self.collective_latency_s
        return self.replace(
            graph=graph,
            collective_bandwidth_Bps=None if coll_bw is None else coll_bw * bandwidth,
            collective_latency_s=None if coll_lat is None else coll_lat * latency)


@lru_cache(maxsize=1)
def _cluster_presets() -> dict[str, dict]:
    with open(PRESET_DIR / "clusters.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def cluster_names() -> list[str]:
    """Names of the cluster presets: ``['dgx-a100', 'dgx-h100', 'localhost-cpu']``."""
    return sorted(_cluster_presets())


def _positive_int(name: str, value: object, cluster: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be a positive integer for cluster {cluster!r}")
    return value


def build_gpu_graph(spec: dict, nodes: int) -> nx.Graph:
    """NVSwitch inside each node, one NIC per GPU, NICs into leaves, leaves into spines.

    Leaf-to-spine links carry ``nodes_per_leaf · nics · nic_bw / (spines · oversubscription)``
    each, so the fabric is non-blocking at oversubscription 1 (a fat tree).
    """
    g = nx.Graph()
    per_node, nic = spec["devices_per_node"], spec["nic"]
    nv, fabric = spec["nvswitch"], spec["fabric"]
    nic_bw, nic_lat = float(nic["bandwidth_Bps"]), float(nic["latency_s"]) / 2
    sw_lat = float(fabric["switch_latency_s"])
    per_leaf = fabric["nodes_per_leaf"]
    for n in range(nodes):
        for local in range(per_node):
            gpu = ("gpu", n, local)
            # NVSwitch latency splits over the two hops GPU->switch->GPU.
            g.add_edge(gpu, ("nvswitch", n), bandwidth_Bps=float(nv["bandwidth_Bps"]),
                       latency_s=float(nv["latency_s"]) / 2)
            nic_key = ("nic", n, local % nic["per_node"])
            g.add_edge(gpu, nic_key, bandwidth_Bps=nic_bw, latency_s=nic_lat)
            g.add_edge(nic_key, ("leaf", n // per_leaf), bandwidth_Bps=nic_bw,
                       latency_s=nic_lat + sw_lat)
    leaves = math.ceil(nodes / per_leaf)
    if leaves > 1:
        spines = fabric["spines"]
        uplink = per_leaf * nic["per_node"] * nic_bw / (spines * fabric["oversubscription"])
        for leaf in range(leaves):
            for s in range(spines):
                g.add_edge(("leaf", leaf), ("spine", s), bandwidth_Bps=uplink,
                           latency_s=sw_lat)
    return g


def _gpu_cluster(name: str, spec: dict, nodes: int | None, ranks: int | None,
                 profile: DeviceProfile | None) -> Cluster:
    if ranks is not None:
        raise PlanError(f"ranks={ranks!r} applies only to localhost-cpu; cluster {name!r} "
                        f"takes nodes")
    nodes = _positive_int("nodes", spec.get("default_nodes", 1) if nodes is None else nodes,
                          name)
    device = profile or load_device(spec["device"])
    return Cluster(name=name, graph=build_gpu_graph(spec, nodes), device=device,
                   num_nodes=nodes, devices_per_node=spec["devices_per_node"],
                   default_dtype=spec.get("default_dtype", "bf16"),
                   nics_per_node=spec["nic"]["per_node"],
                   nodes_per_leaf=spec["fabric"]["nodes_per_leaf"],
                   oversubscription=float(spec["fabric"]["oversubscription"]),
                   source="; ".join(spec[k]["source"] for k in ("nvswitch", "nic", "fabric")))


def _localhost_cluster(name: str, spec: dict, nodes: int | None, ranks: int | None,
                       profile: DeviceProfile | None) -> Cluster:
    if nodes not in (None, 1):
        raise PlanError(f"nodes={nodes!r} is not allowed for {name!r} (one machine); "
                        f"use ranks")
    ranks = _positive_int("ranks", spec.get("default_ranks", 4) if ranks is None else ranks,
                          name)
    cores = os.cpu_count() or 1
    over = max(1.0, ranks / cores)
    exp = spec["oversubscription"]
    lat_scale = over ** exp["latency_exponent"]
    bw_scale = over ** exp["bandwidth_exponent"]
    g = nx.Graph()
    for r in range(ranks):
        # Two hops rank->loopback->rank: each carries half the one-way p2p latency.
        g.add_edge(("cpu", 0, r), ("loopback", 0),
                   bandwidth_Bps=spec["p2p"]["bandwidth_Bps"] / bw_scale,
                   latency_s=spec["p2p"]["latency_s"] * lat_scale / 2)
    return Cluster(name=name, graph=g, device=profile or load_device(spec["device"]),
                   num_nodes=1, devices_per_node=ranks,
                   default_dtype=spec.get("default_dtype", "fp32"),
                   compute_share=min(1.0, cores / ranks),
                   collective_latency_s=spec["collective"]["latency_s"] * lat_scale,
                   collective_bandwidth_Bps=spec["collective"]["bandwidth_Bps"] / bw_scale,
                   source=f"{spec['source']}; {ranks} ranks on {cores} cores")


def load_cluster(name_or_path: str, nodes: int | None = None, ranks: int | None = None,
                 profile: DeviceProfile | None = None) -> Cluster:
    """A cluster preset by name (see `cluster_names`) or a cluster YAML file by path.

    Args:
        name_or_path: 'dgx-a100', 'dgx-h100', 'localhost-cpu', or a YAML file with one preset
            entry's fields (``kind: gpu`` or ``kind: localhost``).
        nodes: servers of a GPU cluster (default from the preset, 1).
        ranks: processes of localhost-cpu (default 4); each gets min(1, cores/ranks) of a core.
        profile: device profile to use instead of the preset's (e.g. a measured CPU profile).
    Raises:
        PlanError: unknown name or file, bad ``nodes`` / ``ranks``, or an invalid file.
    """
    presets = _cluster_presets()
    if name_or_path in presets:
        name, spec = name_or_path, presets[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise PlanError(f"cluster={name_or_path!r} is neither a preset ({cluster_names()}) "
                            f"nor an existing YAML file")
        name, spec = path.stem, yaml.safe_load(path.read_text(encoding="utf-8"))
    kind = spec.get("kind") if isinstance(spec, dict) else None
    builders = {"gpu": _gpu_cluster, "localhost": _localhost_cluster}
    if kind not in builders:
        raise PlanError(f"cluster {name!r} has kind={kind!r}; use one of {sorted(builders)}")
    try:
        return builders[kind](name, spec, nodes, ranks, profile)
    except KeyError as exc:
        raise PlanError(f"cluster {name!r} is missing field {exc}") from None

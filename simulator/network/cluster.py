"""Clusters as NetworkX graphs of devices, switches and links, with presets as YAML data.

Graph nodes are devices ``("gpu", node, local)`` (or ``("cpu", 0, rank)``), and switches
``("nvswitch", node)``, ``("pcie", node, i)``, ``("host", node)``, ``("nic", node, i)``,
``("leaf", su, rail)`` (rail-optimised; ``("leaf", su, 0)`` in a plain fat tree),
``("spine", pod, i)``, ``("core", i)``, ``("loopback", 0)``. Every edge carries
``bandwidth_Bps`` (per direction) and ``latency_s``. Device index ``d`` is
``node * devices_per_node + local``.

A GPU cluster file (see docs/clusters.md) names a node type (``presets/node_types.yaml``), a
node count, and the fabric: ``rail-optimized`` (NIC i of every node in a scalable unit (SU) on
leaf i) or ``fat-tree`` (all NICs of a node on one leaf), switch radix, tiers (1-3) and the
leaf oversubscription (downlink / uplink bandwidth).
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

from planner.precision import CPU_DTYPE, check_default_dtype
from planner.spec import PlanError, did_you_mean, require_bool
from planner.userfile import read_yaml
from simulator import PRESET_DIR
from simulator.network.cluster_keys import check_cluster_keys
from simulator.network.cpu_profile import CpuProfile, read_profile
from simulator.network.fabric import (
    INTRA_KINDS,
    build_gpu_graph,
    check_positive,
    check_positive_int,
    fabric_layout,
    mapping_field,
    require_field,
)
from simulator.network.hardware import DeviceProfile, device_names, load_device


class Link(NamedTuple):
    """Alpha-beta parameters of a path: bottleneck bandwidth (B/s), summed latency (s), hops."""

    bandwidth_Bps: float
    latency_s: float
    hops: int


@dataclass(frozen=True, kw_only=True)
class CommModel:
    """Parameters of the collective library on top of the wires (see presets/fabrics.yaml).

    Attributes:
        link_efficiency: achieved fraction of NVLink / PCIe line rate per ring step.
        nic_efficiency: achieved fraction of NIC line rate.
        endpoint_Bps: per-rank bytes/s of reading the input and writing the output (inf: free).
        launch_latency_s: fixed cost of one collective call.
        step_latency_s: software cost per algorithm step of the Simple protocol, on top of the
            path latency.
        ll128_step_latency_s: the same for NCCL's LL128 protocol; None: Simple only.
        ll128_bandwidth_fraction: share of the Simple protocol's bandwidth LL128 achieves.
    """

    link_efficiency: float = 1.0
    nic_efficiency: float = 1.0
    endpoint_Bps: float = math.inf
    launch_latency_s: float = 0.0
    step_latency_s: float = 0.0
    ll128_step_latency_s: float | None = None
    ll128_bandwidth_fraction: float = 1.0

    def protocols(self) -> list[tuple[str, float, float]]:
        """``(name, step latency s, bandwidth fraction)`` of each protocol a collective may
        pick per size (NCCL: Simple, LL128)."""
        out = [("simple", self.step_latency_s, 1.0)]
        if self.ll128_step_latency_s is not None:
            out.append(("ll128", self.ll128_step_latency_s, self.ll128_bandwidth_fraction))
        return out

    def __post_init__(self) -> None:
        for name in ("link_efficiency", "nic_efficiency", "ll128_bandwidth_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise PlanError(f"{name}={getattr(self, name)!r} must be in (0, 1]")
        if not self.endpoint_Bps > 0:
            raise PlanError(f"endpoint_Bps={self.endpoint_Bps!r} must be > 0")
        for name in ("launch_latency_s", "step_latency_s"):
            if getattr(self, name) < 0:
                raise PlanError(f"{name}={getattr(self, name)!r} must be >= 0")


#: Textbook alpha-beta on the raw links: no efficiency loss, no launch or endpoint cost.
IDEAL_COMM = CommModel()


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
        nodes_per_leaf: servers per scalable unit: under one leaf (per rail when rail-optimised).
        oversubscription: leaf downlink / uplink bandwidth ratio (1 = non-blocking fat tree).
        compute_share: fraction of a device each rank gets (C/R when R ranks share C cores).
        collective_latency_s / collective_bandwidth_Bps: when set, collectives use this per-step
            alpha and bus bandwidth instead of the graph links (loopback gloo, where the CPU
            reduction, not a wire, is the bottleneck).
        node_type: node type preset ('dgx-h100', ...); '' for localhost.
        intra_kind: 'nvswitch', 'pcie' or 'loopback'.
        intra_bandwidth_Bps / intra_latency_s: one GPU's port into the node's switch, and the
            GPU-to-GPU latency through it.
        gpus_per_switch: GPUs under one PCIe switch (pcie nodes).
        in_switch_reduction: the NVSwitch reduces in the switch (NVLink SHARP).
        nic_bandwidth_Bps / transport: one NIC's line rate and 'infiniband' / 'roce'.
        topology / tiers / switch_radix: fabric shape.
        leaf_uplink_Bps: total uplink bandwidth of one leaf (one rail of an SU).
        nodes_per_pod: servers under one set of spines (3 tiers; = num_nodes below that).
        pod_uplink_Bps: total uplink bandwidth of one pod's spines to the cores (per rail).
        spines: spine switches per pod.
        comm: collective-library parameters (`CommModel`).
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
    node_type: str = ""
    intra_kind: str = "loopback"
    intra_bandwidth_Bps: float = math.inf
    intra_latency_s: float = 0.0
    gpus_per_switch: int = 0
    in_switch_reduction: bool = False
    nic_bandwidth_Bps: float = 0.0
    transport: str = ""
    topology: str = "fat-tree"
    tiers: int = 1
    switch_radix: int = 0
    leaf_uplink_Bps: float = math.inf
    nodes_per_pod: int = 0
    pod_uplink_Bps: float = math.inf
    spines: int = 0
    comm: CommModel = IDEAL_COMM
    source: str = ""
    #: localhost-cpu: the calibrated profile in use (None: the preset's generic costs).
    cpu_profile: CpuProfile | None = field(default=None, compare=False, repr=False)
    _links: dict = field(default_factory=dict, compare=False, repr=False)
    #: compute trays per node (18 in an NVL72 rack, 1 in an 8-GPU server).
    compute_trays: int = 1
    #: fabric keys the cluster file left out, taken at their defaults (``fabric.topology``:
    #: fat-tree, ``fabric.oversubscription``: 1), so that reports can say so.
    defaulted: tuple[str, ...] = field(default=(), compare=False)
    #: cap on the bandwidth of every path that leaves a node (a NIC below its line rate;
    #: `simulator.failures.slow_links`); inf: none.
    nic_cap_Bps: float = math.inf

    @property
    def nvlink_domain_size(self) -> int:
        """GPUs that reach each other over NVLink: the node when its GPUs share an NVSwitch
        fabric (8 in a DGX, 72 in an NVL72 rack), else 1."""
        return self.devices_per_node if self.intra_kind == "nvswitch" else 1

    @property
    def num_devices(self) -> int:
        """All devices: num_nodes · devices_per_node."""
        return self.num_nodes * self.devices_per_node

    @property
    def rail_optimized(self) -> bool:
        """NIC i of every node in an SU sits on leaf i (NCCL keeps traffic on its rail)."""
        return self.topology == "rail-optimized"

    def node_of(self, index: int) -> int:
        """Server that device ``index`` sits in."""
        return index // self.devices_per_node

    def nic_of(self, index: int) -> int:
        """NIC (rail) that device ``index`` uses: local · nics_per_node // devices_per_node."""
        return (index % self.devices_per_node) * max(1, self.nics_per_node) \
            // self.devices_per_node

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
        # Devices are symmetric within a class: same device, same node, same SU, same pod,
        # across pods; and whether the two use the same rail.
        if i == j:
            return ("self",)
        ni, nj = self.node_of(i), self.node_of(j)
        if ni == nj:
            return ("node",)
        rail = self.nic_of(i) == self.nic_of(j)
        if ni // self.nodes_per_leaf == nj // self.nodes_per_leaf:
            return ("leaf", rail)
        if self.nodes_per_pod and ni // self.nodes_per_pod == nj // self.nodes_per_pod:
            return ("spine", rail)
        return ("core", rail) if self.nodes_per_pod else ("spine", rail)

    def link(self, i: int, j: int) -> Link:
        """Alpha-beta parameters between devices ``i`` and ``j``.

        Bottleneck bandwidth and summed latency over the NetworkX shortest (fewest-hop) path,
        cached per path class (same node / same leaf / across the spine / across the core), so
        a query on a 16,384-device cluster costs one BFS per class.
        """
        key = self._path_class(i, j)
        if key not in self._links:
            if key == ("self",):
                self._links[key] = Link(math.inf, 0.0, 0)
            else:
                path = nx.bidirectional_shortest_path(self.graph, self.device_key(i),
                                                      self.device_key(j))
                edges = [self.graph.edges[a, b] for a, b in pairwise(path)]
                bw = min(e["bandwidth_Bps"] for e in edges)
                self._links[key] = Link(bw if key == ("node",) else min(bw, self.nic_cap_Bps),
                                        sum(e["latency_s"] for e in edges), len(edges))
        return self._links[key]

    def crosses_spine(self, i: int, j: int) -> bool:
        """Whether devices ``i`` and ``j`` sit under different leaf switches (SUs)."""
        return self._path_class(i, j)[0] in ("spine", "core")

    def replace(self, **changes: object) -> Cluster:
        """A copy with some fields changed (the link cache starts empty)."""
        return dataclasses.replace(self, _links={}, **changes)

    def ideal(self) -> Cluster:
        """A copy costed with textbook alpha-beta on the raw links (`IDEAL_COMM`)."""
        return self.replace(comm=IDEAL_COMM)

    def scale_links(self, bandwidth: float = 1.0, latency: float = 1.0) -> Cluster:
        """A copy with every link's bandwidth multiplied by ``bandwidth`` and latency by
        ``latency`` (the collective overrides and library costs too)."""
        graph = self.graph.copy()
        for _, _, data in graph.edges(data=True):
            data["bandwidth_Bps"] *= bandwidth
            data["latency_s"] *= latency
        coll_bw = self.collective_bandwidth_Bps
        coll_lat = self.collective_latency_s
        comm = dataclasses.replace(
            self.comm, endpoint_Bps=self.comm.endpoint_Bps * bandwidth,
            launch_latency_s=self.comm.launch_latency_s * latency,
            step_latency_s=self.comm.step_latency_s * latency,
            ll128_step_latency_s=None if self.comm.ll128_step_latency_s is None
            else self.comm.ll128_step_latency_s * latency)
        return self.replace(
            graph=graph, comm=comm,
            intra_bandwidth_Bps=self.intra_bandwidth_Bps * bandwidth,
            intra_latency_s=self.intra_latency_s * latency,
            nic_bandwidth_Bps=self.nic_bandwidth_Bps * bandwidth,
            leaf_uplink_Bps=self.leaf_uplink_Bps * bandwidth,
            pod_uplink_Bps=self.pod_uplink_Bps * bandwidth,
            collective_bandwidth_Bps=None if coll_bw is None else coll_bw * bandwidth,
            collective_latency_s=None if coll_lat is None else coll_lat * latency)


def _load_yaml(name: str) -> dict:
    with open(PRESET_DIR / name, encoding="utf-8") as f:
        return yaml.safe_load(f)


@lru_cache(maxsize=1)
def _cluster_presets() -> dict[str, dict]:
    return _load_yaml("clusters.yaml")


@lru_cache(maxsize=1)
def _node_types() -> dict[str, dict]:
    return _load_yaml("node_types.yaml")


@lru_cache(maxsize=1)
def _fabrics() -> dict[str, dict]:
    return _load_yaml("fabrics.yaml")


def cluster_names() -> list[str]:
    """Names of the cluster presets, e.g. ``['dgx-a100', 'dgx-b200', ...]``."""
    return sorted(_cluster_presets())


def node_type_names() -> list[str]:
    """Names of the node types, e.g. ``['dgx-a100', 'dgx-b200', ..., 'pcie-a100']``."""
    return sorted(_node_types())


def transport_names() -> list[str]:
    """Fabric transports: ``['infiniband', 'roce']``."""
    return sorted(_fabrics()["transports"])


def default_comm_model(device: DeviceProfile) -> CommModel:
    """The fitted collective-library parameters (presets/fabrics.yaml) on ``device``."""
    p = _fabrics()["collective_model"]
    proto = p["protocols"]
    return CommModel(link_efficiency=p["link_efficiency"], nic_efficiency=p["nic_efficiency"],
                     endpoint_Bps=p["endpoint_hbm_fraction"] * device.memory_bandwidth_Bps,
                     launch_latency_s=p["launch_latency_s"],
                     step_latency_s=proto["simple"]["step_latency_s"],
                     ll128_step_latency_s=proto["ll128"]["step_latency_s"],
                     ll128_bandwidth_fraction=proto["ll128"]["bandwidth_fraction"])


def _nvlink_domain(spec: dict, per_node: int, name: str) -> int:
    """``devices_per_node`` after a cluster file's ``nvlink_domain_size`` (the GPUs of one
    NVSwitch fabric, which this model treats as one node).

    Raises:
        PlanError: ``nvlink_domain_size`` is not a positive int, or disagrees with an explicit
            ``devices_per_node``.
    """
    if "nvlink_domain_size" not in spec:
        return per_node
    size = check_positive_int("nvlink_domain_size", spec["nvlink_domain_size"], name)
    if "devices_per_node" in spec and spec["devices_per_node"] != size:
        raise PlanError(f"cluster {name!r}: nvlink_domain_size={size} != devices_per_node="
                        f"{spec['devices_per_node']}; one NVLink domain is one node here, so "
                        f"give one of the two")
    return size


def _merged(base: dict, override: dict) -> dict:
    return {**base, **override}


def _gpu_cluster(name: str, spec: dict, nodes: int | None, ranks: int | None,
                 profile: DeviceProfile | None, cpu_profile: CpuProfile | None) -> Cluster:
    if cpu_profile is not None:
        raise PlanError(f"cpu_profile={cpu_profile.path!r} applies only to localhost "
                        f"clusters; cluster {name!r} is a GPU cluster")
    if ranks is not None:
        raise PlanError(f"ranks={ranks!r} applies only to localhost-cpu; cluster {name!r} "
                        f"takes nodes")
    node_type = require_field(spec, "node_type", "", name)
    types = _node_types()
    if node_type not in types:
        raise PlanError(f"cluster {name!r}: node_type={node_type!r} is not one of "
                        f"{node_type_names()}")
    base = types[node_type]
    nodes = check_positive_int("nodes", spec.get("nodes", spec.get("default_nodes", 1))
                          if nodes is None else nodes, name)
    per_node = check_positive_int("devices_per_node", spec.get("devices_per_node",
                                                          base["devices_per_node"]), name)
    per_node = _nvlink_domain(spec, per_node, name)
    device_name = spec.get("device", base["device"])
    if profile is None and device_name not in device_names():
        raise PlanError(f"cluster {name!r}: device={device_name!r} is not one of "
                        f"{device_names()}")
    device = profile or load_device(device_name)
    intra = _merged(base["intra"], mapping_field(spec, "intra", name))
    if intra["kind"] not in INTRA_KINDS:
        raise PlanError(f"cluster {name!r}: intra.kind={intra['kind']!r} is not one of "
                        f"{list(INTRA_KINDS)}")
    check_positive("intra.bandwidth_Bps", intra["bandwidth_Bps"], name)
    check_positive("intra.latency_s", intra["latency_s"], name, zero_ok=True)
    nic_given = mapping_field(spec, "nic", name)
    if "speed_Gbps" in nic_given and "bandwidth_Bps" in nic_given:
        raise PlanError(f"cluster {name!r}: nic.speed_Gbps={nic_given['speed_Gbps']!r} and "
                        f"nic.bandwidth_Bps={nic_given['bandwidth_Bps']!r} both give the NIC "
                        f"speed; keep one of them")
    nic = _merged(base["nic"], nic_given)
    if "speed_Gbps" in nic_given:
        nic["bandwidth_Bps"] = check_positive("nic.speed_Gbps", nic["speed_Gbps"], name) * 1e9 / 8
    nics = check_positive_int("nic.per_node", nic["per_node"], name)
    if nics > per_node:
        # each GPU's inter-node traffic goes through one NIC (its rail); more compute NICs
        # than GPUs (AWS p5: 32 EFA NICs for 8 GPUs) would leave the extra ones unused
        raise PlanError(f"cluster {name!r}: nic.per_node={nics} is more than the "
                        f"{per_node} GPUs per node; the model gives each GPU one NIC: give "
                        f"nic.per_node <= {per_node} with each GPU's total NIC speed (e.g. 4 "
                        f"x 100 Gb/s per GPU: per_node {per_node}, speed_Gbps 400), and leave "
                        f"storage / in-band NICs out")
    nic_bw = check_positive("nic.bandwidth_Bps", nic["bandwidth_Bps"], name)
    transports = _fabrics()["transports"]
    if nic.get("transport") not in transports:
        raise PlanError(f"cluster {name!r}: nic.transport={nic.get('transport')!r} is not one "
                        f"of {transport_names()}")
    transport = dict(transports[nic["transport"]])
    if "latency_s" in nic:
        transport["nic_latency_s"] = check_positive("nic.latency_s", nic["latency_s"], name,
                                               zero_ok=True)
    fabric_spec = mapping_field(spec, "fabric", name)
    fab = fabric_layout(name, fabric_spec, nodes, per_node, nics, nic_bw, transport)
    sources = [intra.get("source", ""), nic.get("source", ""), fabric_spec.get("source", ""),
               transport.get("source", "")]
    return Cluster(name=name, graph=build_gpu_graph(fab, intra), device=device,
                   num_nodes=nodes, devices_per_node=per_node,
                   default_dtype=check_default_dtype(spec.get("default_dtype", "bf16"), name,
                                                     device.name, device.peak_flops),
                   nics_per_node=nics, nodes_per_leaf=fab.nodes_per_leaf,
                   oversubscription=fab.oversubscription, node_type=node_type,
                   intra_kind=intra["kind"], intra_bandwidth_Bps=float(intra["bandwidth_Bps"]),
                   intra_latency_s=float(intra["latency_s"]),
                   gpus_per_switch=int(intra.get("gpus_per_switch", per_node)),
                   in_switch_reduction=require_bool(
                       "intra.in_switch_reduction", intra.get("in_switch_reduction", False),
                       f"cluster {name!r}: "),
                   nic_bandwidth_Bps=nic_bw, transport=nic["transport"],
                   topology=fab.topology, tiers=fab.tiers, switch_radix=fab.radix,
                   leaf_uplink_Bps=fab.leaf_uplink_Bps if fab.tiers > 1 else math.inf,
                   nodes_per_pod=fab.nodes_per_pod, pod_uplink_Bps=fab.pod_uplink_Bps,
                   spines=fab.spines if fab.tiers > 1 else 0,
                   comm=default_comm_model(device),
                   compute_trays=int(spec.get("compute_trays", base.get("compute_trays", 1))),
                   source="; ".join(s for s in sources if s),
                   defaulted=tuple(f"fabric.{k}" for k in ("topology", "oversubscription")
                                   if k not in fabric_spec))


def _localhost_cluster(name: str, spec: dict, nodes: int | None, ranks: int | None,
                       profile: DeviceProfile | None, cpu_profile: CpuProfile | None) -> Cluster:
    if nodes not in (None, 1):
        raise PlanError(f"nodes={nodes!r} is not allowed for {name!r} (one machine); "
                        f"use ranks")
    ranks = check_positive_int("ranks", spec.get("default_ranks", 4) if ranks is None else ranks,
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
    calibrated = cpu_profile
    source = f"{spec['source']}; {ranks} ranks on {cores} cores"
    if calibrated is not None:
        source = f"calibrated profile {calibrated.name}; {ranks} ranks on {cores} cores"
    device = profile or (calibrated.device if calibrated else load_device(spec["device"]))
    return Cluster(name=name, graph=g, device=device, num_nodes=1, devices_per_node=ranks,
                   default_dtype=check_default_dtype(spec.get("default_dtype", CPU_DTYPE), name,
                                                     device.name, device.peak_flops),
                   compute_share=min(1.0, cores / ranks),
                   collective_latency_s=spec["collective"]["latency_s"] * lat_scale,
                   collective_bandwidth_Bps=spec["collective"]["bandwidth_Bps"] / bw_scale,
                   source=source, cpu_profile=calibrated)


def load_cluster(name_or_path: str, nodes: int | None = None, ranks: int | None = None,
                 profile: DeviceProfile | None = None,
                 cpu_profile: CpuProfile | str | os.PathLike | None = None) -> Cluster:
    """A cluster preset by name (see `cluster_names`) or a cluster YAML file by path.

    Args:
        name_or_path: a preset ('dgx-a100', 'dgx-h100', ..., 'localhost-cpu') or a YAML file
            in the format of docs/clusters.md (``kind: gpu`` or ``kind: localhost``).
        nodes: servers of a GPU cluster (default: the file's ``nodes``, else 1).
        ranks: processes of localhost-cpu (default 4); each gets min(1, cores/ranks) of a core.
        profile: device profile to use instead of the preset's (e.g. a measured CPU profile).
        cpu_profile: a localhost cluster's calibrated profile (`CpuProfile`, or the path of a
            file written by `meshplan calibrate`); default: the cluster file's ``cpu_profile``
            (a path relative to the file), else none (the preset's generic costs).
    Raises:
        PlanError: unknown name or file, bad ``nodes`` / ``ranks``, or an invalid file (the
            message names the field and the allowed values).

    >>> c = load_cluster("dgx-h100", nodes=4)
    >>> c.num_devices, c.devices_per_node, c.nics_per_node, c.device.name
    (32, 8, 8, 'h100-sxm-80gb')
    >>> c.link(0, 8).bandwidth_Bps / 1e9  # GPU 0 to GPU 0 of the next node: one 400 Gb/s NIC
    50.0
    """
    presets = _cluster_presets()
    path = None
    if name_or_path in presets:
        name, spec = name_or_path, presets[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.exists():
            guess = did_you_mean(name_or_path.lower().replace("_", "-"), cluster_names())
            raise PlanError(f"cluster={name_or_path!r} is neither a preset{guess} "
                            f"({cluster_names()}) nor an existing YAML file")
        name, spec = path.stem, read_yaml(path, "cluster")
    return cluster_from_spec(name, spec, nodes=nodes, ranks=ranks, profile=profile,
                             cpu_profile=cpu_profile,
                             base_dir=None if path is None else path.parent)


def cluster_from_spec(name: str, spec: object, *, nodes: int | None = None,
                      ranks: int | None = None, profile: DeviceProfile | None = None,
                      cpu_profile: CpuProfile | str | os.PathLike | None = None,
                      base_dir: Path | None = None) -> Cluster:
    """The cluster of a cluster file's mapping ``spec`` (the contents of a YAML file in the
    format of docs/clusters.md, e.g. one a plan file embeds), named ``name``; ``base_dir``
    resolves a relative ``cpu_profile``. Other arguments and errors as `load_cluster`.
    """
    kind = spec.get("kind") if isinstance(spec, dict) else None
    builders = {"gpu": _gpu_cluster, "localhost": _localhost_cluster}
    if isinstance(spec, dict) and "kind" not in spec:
        raise PlanError(f"cluster {name!r} is missing field kind; add kind: gpu (or localhost)")
    if kind not in builders:
        raise PlanError(f"cluster {name!r} has kind={kind!r}; use one of {sorted(builders)}")
    check_cluster_keys(name, spec)
    try:
        if cpu_profile is None and isinstance(spec.get("cpu_profile"), str) \
                and base_dir is not None:
            cpu_profile = base_dir / spec["cpu_profile"]
        if cpu_profile is not None and not isinstance(cpu_profile, CpuProfile):
            cpu_profile = read_profile(cpu_profile)
        return builders[kind](name, spec, nodes, ranks, profile, cpu_profile)
    except KeyError as exc:
        raise PlanError(f"cluster {name!r} is missing field {exc}") from None
    except TypeError as exc:
        raise PlanError(f"cluster {name!r} has a field of the wrong type: {exc}") from None

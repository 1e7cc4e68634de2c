"""Fabric shape and the NetworkX graph of a GPU cluster: leaves, spines and cores sized from
the switch radix, tiers and oversubscription of a cluster file (docs/clusters.md).

A leaf has ``d`` ports down and ``radix - d`` up, ``d / (radix - d)`` = oversubscription
(unless the file fixes ``nodes_per_leaf``). A rail-optimised leaf takes NIC i of every node in
its scalable unit (SU); a plain fat-tree leaf takes all NICs of its nodes. Three tiers group
SUs into pods under radix/2-port spine layers, joined by a core layer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import networkx as nx
import yaml

from planner.spec import PlanError

TOPOLOGIES = ("rail-optimized", "fat-tree")
INTRA_KINDS = ("nvswitch", "pcie")


def check_positive_int(name: str, value: object, cluster: str) -> int:
    """``value`` if it is an int >= 1, else a `PlanError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be a positive integer for cluster {cluster!r}")
    return value


#: Upper bounds of a cluster file's numbers by the unit their name ends in: ten times the
#: fastest hardware of the kind (1.6 Tb/s NICs, 1.8 TB/s NVLink 5 per GPU; switch and NIC
#: latencies are microseconds), so a typo (1e300, a latency in ms written as s) is refused.
UPPER_BOUNDS = {"_Gbps": (16_000.0, "16000 Gb/s"), "_Bps": (2e13, "2e13 B/s (20 TB/s)"),
                "_s": (1e-2, "0.01 s (switch and NIC latencies are microseconds)"),
                "oversubscription": (64.0, "64:1")}


def check_positive(name: str, value: object, cluster: str, *, zero_ok: bool = False) -> float:
    """``value`` as a float if it is a finite number > 0 (>= 0 with ``zero_ok``) and no more
    than the plausible bound of its unit (`UPPER_BOUNDS`, by the end of ``name``), else a
    `PlanError` naming ``name``, the value and the range.

    >>> check_positive("nic.speed_Gbps", 400, "c")
    400.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
            or (value == 0 and not zero_ok) or not math.isfinite(value):
        kind = "finite number" if isinstance(value, float) and not math.isfinite(value) \
            else "number"
        raise PlanError(f"{name}={value!r} must be a {kind} {'>= 0' if zero_ok else '> 0'} "
                        f"for cluster {cluster!r}"
                        f"{_string_hint(name, value) if isinstance(value, str) else ''}")
    beyond = _beyond(name, value)
    if beyond:
        raise PlanError(f"{name}={value!r} for cluster {cluster!r} is beyond any real "
                        f"hardware (at most {beyond[0]}); {beyond[1]}")
    return float(value)


def _beyond(name: str, number: float) -> tuple[str, str] | None:
    """None when ``number`` is within the bound of ``name``'s unit (`UPPER_BOUNDS`), else the
    bound and a fix: a speed in Gb/s that reads as one in bits/s says so.

    >>> _beyond("nic.speed_Gbps", 4e11)
    ('16000 Gb/s', '4e+11 looks like bits/s: speed_Gbps is in Gb/s, e.g. 400')
    """
    for suffix, (most, text) in UPPER_BOUNDS.items():
        if name.endswith(suffix) and number > most:
            key = name.rsplit(".", 1)[-1]
            if suffix == "_Gbps" and number / 1e9 <= most:
                return text, (f"{number:g} looks like bits/s: {key} is in Gb/s, e.g. "
                              f"{number / 1e9:g}")
            return text, "check the unit and the exponent"
    return None


def _string_hint(name: str, text: str) -> str:
    """The fix of a number a cluster file gives as a string: quoted (``"400"``: unquote it),
    or an exponent YAML 1.1 does not read as a number (``25e9``, ``4.0e11``: a dot and a
    signed exponent); '' for text that is no number.

    >>> _string_hint("nic.speed_Gbps", "400"), _string_hint("nic.bandwidth_Bps", "25e9")
    (' (unquote it: write 400, not "400")', ' (YAML reads 25e9 as a string: write 25.0e+9)')
    """
    try:
        number = float(text)
    except ValueError:
        return ""
    if not math.isfinite(number) or number < 0:
        return ""
    beyond = _beyond(name, number)
    quoted = isinstance(yaml.safe_load(text), (int, float))
    if beyond:
        how = "quoted" if quoted else "read by YAML as a string"
        return (f" ({text} is {how}, and as a number beyond any real hardware, at most "
                f"{beyond[0]}; {beyond[1]})")
    if quoted:
        return f' (unquote it: write {text}, not "{text}")'
    m = re.fullmatch(r"\s*([-+]?\d+)(?:\.(\d*))?[eE]([-+]?)(\d+)\s*", text)
    form = f"{m[1]}.{m[2] or 0}e{m[3] or '+'}{m[4]}" if m else repr(number)
    return f" (YAML reads {text} as a string: write {form})"


def mapping_field(spec: dict, key: str, cluster: str) -> dict:
    """Section ``key`` of ``spec`` ({} when absent); a `PlanError` if it is not a mapping."""
    value = spec.get(key, {})
    if not isinstance(value, dict):
        raise PlanError(f"cluster {cluster!r}: field {key!r} must be a mapping, got {value!r}")
    return value


def require_field(section: dict, key: str, where: str, cluster: str) -> object:
    """``section[key]``, or a `PlanError` naming the missing field ``where + key``."""
    if key not in section:
        raise PlanError(f"cluster {cluster!r} is missing field {where}{key}; add it (every "
                        f"field of a cluster file is in docs/clusters.md, Format)")
    return section[key]


@dataclass(frozen=True, kw_only=True)
class Fabric:
    """The resolved fabric of one cluster: counts, bandwidths (B/s) and latencies (s)."""

    nodes: int
    per_node: int
    nics: int
    nic_bw: float
    topology: str
    tiers: int
    radix: int
    nodes_per_leaf: int
    nodes_per_pod: int
    spines: int
    oversubscription: float
    leaf_uplink_Bps: float
    pod_uplink_Bps: float
    nic_lat: float
    sw_lat: float


def fabric_layout(name: str, fab: dict, nodes: int, per_node: int, nics: int,
                  nic_bw: float, transport: dict) -> Fabric:
    """Resolve the ``fabric`` section of cluster ``name`` for ``nodes`` servers.

    Raises:
        PlanError: a missing or bad field (named, with the allowed values).
    """
    # Ports of a leaf: d down, radix - d up; d/(radix - d) = oversubscription unless the file
    # fixes nodes_per_leaf. A rail-optimised leaf takes one NIC of each node in its SU.
    topology = fab.get("topology", "fat-tree")
    if topology not in TOPOLOGIES:
        raise PlanError(f"cluster {name!r}: fabric.topology={topology!r} is not one of "
                        f"{list(TOPOLOGIES)}")
    over = check_positive("fabric.oversubscription", fab.get("oversubscription", 1.0), name)
    if over < 1:
        raise PlanError(f"cluster {name!r}: fabric.oversubscription={over!r} must be >= 1 "
                        f"(downlink / uplink bandwidth of a leaf)")
    radix = check_positive_int("fabric.switch_radix", require_field(fab, "switch_radix", "fabric.", name),
                          name)
    ports_per_node = 1 if topology == "rail-optimized" else nics
    if "nodes_per_leaf" in fab:
        per_leaf = check_positive_int("fabric.nodes_per_leaf", fab["nodes_per_leaf"], name)
    else:
        per_leaf = int(radix * over / (1 + over)) // ports_per_node
        if per_leaf < 1:
            raise PlanError(f"cluster {name!r}: fabric.switch_radix={radix} leaves no leaf port "
                            f"for a node's {ports_per_node} NICs; use switch_radix >= "
                            f"{2 * ports_per_node}")
    # The wiring of `build_gpu_graph`: a rail-optimised leaf takes NIC r of each of its
    # nodes (one port a node), a fat-tree leaf every NIC of its nodes.
    down = per_leaf * ports_per_node

    def leaf_fix() -> str:
        return _leaf_fix(radix, ports_per_node, nodes, fab.get("tiers"), fab.get("spines"))
    if down > radix:
        wired = ("one NIC of each node (its rail)" if topology == "rail-optimized"
                 else f"all {nics} NICs of each node")
        raise PlanError(f"cluster {name!r}: fabric.nodes_per_leaf={per_leaf} x "
                        f"{ports_per_node} NIC port(s) per node = {down} downlinks per leaf, "
                        f"more than fabric.switch_radix={radix} (a {topology} leaf takes "
                        f"{wired}); {leaf_fix()}")
    leaf_up = per_leaf * ports_per_node * nic_bw / over
    sus = math.ceil(nodes / per_leaf)
    leaves = sus * (nics if topology == "rail-optimized" else 1)
    auto = 1 if sus == 1 else (2 if leaves <= radix else 3)
    tiers = fab.get("tiers", auto)
    if tiers not in (1, 2, 3):
        raise PlanError(f"cluster {name!r}: fabric.tiers={tiers!r} is not one of [1, 2, 3]")
    if tiers < auto:
        need = "one leaf per rail" if auto == 2 else f"{radix} leaves per spine layer"
        raise PlanError(f"cluster {name!r}: nodes={nodes} needs {sus} scalable units of "
                        f"{per_leaf} nodes ({leaves} leaves) but fabric.tiers={tiers} allows "
                        f"{need}; use tiers: {auto}")
    # One uplink to each spine; by default as many NIC-rate ports as the uplinks total
    # (downlinks / oversubscription), at most the ports left over, so that a leaf-spine link
    # carries the NIC line rate (the uplink total / spines, `build_gpu_graph`).
    spines = check_positive_int("fabric.spines", fab.get("spines", default_spines(radix, down,
                                                                                  over)), name)
    if tiers > 1 and down + spines > radix:
        raise PlanError(f"cluster {name!r}: a leaf has {down} downlinks (fabric.nodes_per_leaf="
                        f"{per_leaf} x {ports_per_node} NIC port(s)) and one uplink to each of "
                        f"{spines} spine(s): {down + spines} ports, more than "
                        f"fabric.switch_radix={radix}; {leaf_fix()}")
    per_pod, pod_up = nodes, math.inf
    if tiers == 3:
        # A pod: the leaves under one spine layer of radix/2 down ports (per rail).
        sus_per_pod = max(1, (radix // 2) // (nics if topology == "rail-optimized" else 1))
        per_pod = sus_per_pod * per_leaf
        pods = math.ceil(nodes / per_pod)
        if pods > radix:
            raise PlanError(f"cluster {name!r}: nodes={nodes} needs {pods} pods but a 3-tier "
                            f"fabric of switch_radix={radix} switches holds at most {radix}; "
                            f"use a larger switch_radix")
        pod_up = sus_per_pod * leaf_up
    return Fabric(nodes=nodes, per_node=per_node, nics=nics, nic_bw=nic_bw,
                   topology=topology, tiers=tiers, radix=radix, nodes_per_leaf=per_leaf,
                   nodes_per_pod=per_pod if tiers == 3 else 0, spines=spines,
                   oversubscription=over, leaf_uplink_Bps=leaf_up, pod_uplink_Bps=pod_up,
                   nic_lat=float(transport["nic_latency_s"]),
                   sw_lat=check_positive("fabric.switch_latency_s", fab.get(
                       "switch_latency_s", transport["switch_latency_s"]), name, zero_ok=True))


def _add_intra(g: nx.Graph, n: int, per_node: int, intra: dict) -> None:
    bw, lat = float(intra["bandwidth_Bps"]), float(intra["latency_s"])
    if intra["kind"] == "nvswitch":
        # NVSwitch latency splits over the two hops GPU->switch->GPU.
        g.add_edges_from((("gpu", n, i), ("nvswitch", n),
                           {"bandwidth_Bps": bw, "latency_s": lat / 2})
                          for i in range(per_node))
        return
    per_sw = intra.get("gpus_per_switch", per_node)
    for i in range(per_node):
        g.add_edge(("gpu", n, i), ("pcie", n, i // per_sw), bandwidth_Bps=bw,
                   latency_s=lat / 4)
    for s in range(math.ceil(per_node / per_sw)):
        g.add_edge(("pcie", n, s), ("host", n), bandwidth_Bps=bw, latency_s=lat / 4)


def default_spines(radix: int, down: int, over: float) -> int:
    """Spines of a leaf with ``down`` downlinks on ``radix`` ports at ``over``:1 when the file
    gives no ``fabric.spines``: ``ceil(down / over)`` uplinks of the NIC rate (they total
    ``down / over`` NICs' worth), at most the ``radix - down`` ports left over, at least one.

    >>> default_spines(64, 8, 2.0), default_spines(64, 32, 1.0), default_spines(40, 26, 2.0)
    (4, 32, 13)
    """
    # round: 33 / 1.1 is 30.000000000000004 in floating point, 30 ports
    return max(1, min(math.ceil(round(down / over, 9)), radix - down))


def max_nodes_per_leaf(radix: int, ports_per_node: int, nodes: int, tiers: object = None,
                       spines: object = None) -> int:
    """The most nodes a leaf of ``radix`` ports can take, ``ports_per_node`` ports each (1 on
    a rail-optimised fabric, the NIC count on a fat-tree), for ``nodes`` servers: every port
    down while one leaf (per rail) holds them all and ``tiers`` asks for no spines, else one
    port up to each spine (``spines``; `default_spines` takes at least one). 0: none.

    >>> max_nodes_per_leaf(64, 8, 16), max_nodes_per_leaf(64, 8, 8), max_nodes_per_leaf(8, 1, 16)
    (7, 8, 7)
    """
    for per_leaf in range(radix // ports_per_node, 0, -1):
        down = per_leaf * ports_per_node
        uplinks = (tiers or 1) > 1 or math.ceil(nodes / per_leaf) > 1
        if not uplinks or down + (spines or max(1, radix - down)) <= radix:
            return per_leaf
    return 0


def _leaf_fix(radix: int, ports_per_node: int, nodes: int, tiers: object,
              spines: object) -> str:
    most = max_nodes_per_leaf(radix, ports_per_node, nodes, tiers, spines)
    if most:
        return f"use nodes_per_leaf <= {most} (or a larger switch_radix)"
    return "use a larger switch_radix" + (" or fewer spines" if spines else "")


def build_gpu_graph(fab: Fabric, intra: dict) -> nx.Graph:
    """Devices, node switches, NICs, leaves, spines and cores as one NetworkX graph.

    Leaf-to-spine links carry ``leaf_uplink / spines`` each (so a leaf's uplinks total its
    downlinks / oversubscription; with `default_spines`, at most the NIC rate); spine-to-core
    links split a pod's uplink over ``spines x spines`` links (one core layer, non-blocking
    above the leaves).
    """
    g = nx.Graph()
    rail = fab.topology == "rail-optimized"
    nic_attrs = {"bandwidth_Bps": fab.nic_bw, "latency_s": fab.nic_lat}
    up_attrs = {"bandwidth_Bps": fab.nic_bw, "latency_s": fab.sw_lat}
    for n in range(fab.nodes):
        _add_intra(g, n, fab.per_node, intra)
        su = n // fab.nodes_per_leaf
        for i in range(fab.per_node):
            nic = i * fab.nics // fab.per_node
            g.add_edge(("gpu", n, i), ("nic", n, nic), **nic_attrs)
        g.add_edges_from((("nic", n, r), ("leaf", su, r if rail else 0), up_attrs)
                          for r in range(fab.nics))
    if fab.tiers == 1:
        return g
    sus = math.ceil(fab.nodes / fab.nodes_per_leaf)
    rails = fab.nics if rail else 1
    per_pod = fab.nodes_per_pod or fab.nodes
    spine_bw = fab.leaf_uplink_Bps / fab.spines
    for su in range(sus):
        pod = su * fab.nodes_per_leaf // per_pod
        g.add_edges_from((("leaf", su, r), ("spine", pod, s),
                           {"bandwidth_Bps": spine_bw, "latency_s": fab.sw_lat})
                          for r in range(rails) for s in range(fab.spines))
    if fab.tiers == 3:
        pods = math.ceil(fab.nodes / per_pod)
        core_bw = fab.pod_uplink_Bps * rails / fab.spines ** 2
        g.add_edges_from((("spine", p, s), ("core", c),
                           {"bandwidth_Bps": core_bw, "latency_s": fab.sw_lat})
                          for p in range(pods) for s in range(fab.spines)
                          for c in range(fab.spines))
    return g

"""What a cluster looks like: a summary (devices, switches, links, bisection bandwidth) and a
drawing of its NetworkX graph.

Bisection bandwidth is per direction across the worst cut that splits the devices in half:
the smallest of the NICs of half the nodes, the leaf uplinks of half the scalable units and
(3 tiers) the pod uplinks of half the pods; one node: half its GPUs' NVLink / PCIe ports.
"""

from __future__ import annotations

import math
from collections import Counter

import networkx as nx

from simulator.network.cluster import Cluster


def bisection_bandwidth_Bps(cluster: Cluster) -> float:
    """Bytes/s per direction across the worst balanced cut of ``cluster``.

    >>> from simulator.network.cluster import load_cluster
    >>> bisection_bandwidth_Bps(load_cluster("dgx-h100", nodes=4)) / 1e9  # 2 nodes x 8 x 50
    800.0
    """
    if cluster.nics_per_node == 0 or cluster.num_nodes == 1:
        if cluster.intra_kind == "pcie":
            switches = math.ceil(cluster.devices_per_node / max(1, cluster.gpus_per_switch))
            return max(1, switches // 2) * cluster.intra_bandwidth_Bps
        bw = cluster.intra_bandwidth_Bps
        if math.isinf(bw):
            edge = next(iter(cluster.graph.edges(data=True)), None)
            bw = edge[2]["bandwidth_Bps"] if edge else 0.0
        return cluster.devices_per_node // 2 * bw
    half = cluster.num_nodes // 2
    cuts = [half * cluster.nics_per_node * cluster.nic_bandwidth_Bps]
    rails = cluster.nics_per_node if cluster.rail_optimized else 1
    sus = math.ceil(cluster.num_nodes / cluster.nodes_per_leaf)
    if cluster.tiers > 1 and sus > 1:
        cuts.append(max(1, sus // 2) * rails * cluster.leaf_uplink_Bps)
    if cluster.tiers > 2:
        pods = math.ceil(cluster.num_nodes / cluster.nodes_per_pod)
        if pods > 1:
            cuts.append(max(1, pods // 2) * rails * cluster.pod_uplink_Bps)
    return min(cuts)


def summary(cluster: Cluster) -> dict:
    """Devices, switches by kind, links and bisection bandwidth of ``cluster`` (SI units)."""
    kinds = Counter(node[0] for node in cluster.graph.nodes)
    device_kinds = ("gpu", "cpu")
    return {
        "name": cluster.name, "node_type": cluster.node_type or None,
        "device": cluster.device.name, "nodes": cluster.num_nodes,
        "devices_per_node": cluster.devices_per_node, "devices": cluster.num_devices,
        "nvlink_domain_size": cluster.nvlink_domain_size,
        "compute_trays": cluster.compute_trays,
        "intra": cluster.intra_kind, "intra_bandwidth_Bps": _finite(cluster.intra_bandwidth_Bps),
        "in_switch_reduction": cluster.in_switch_reduction,
        "nics_per_node": cluster.nics_per_node, "nic_bandwidth_Bps": cluster.nic_bandwidth_Bps,
        "transport": cluster.transport or None, "topology": cluster.topology,
        "tiers": cluster.tiers, "switch_radix": cluster.switch_radix,
        "nodes_per_leaf": cluster.nodes_per_leaf, "oversubscription": cluster.oversubscription,
        "switches": {k: v for k, v in sorted(kinds.items()) if k not in device_kinds},
        "links": cluster.graph.number_of_edges(),
        "bisection_bandwidth_Bps": bisection_bandwidth_Bps(cluster),
        "source": cluster.source, "defaulted": list(cluster.defaulted),
    }


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


_LAYER = {"gpu": 0, "cpu": 0, "nvswitch": 1, "pcie": 1, "host": 2, "loopback": 1, "nic": 3,
          "leaf": 4, "spine": 5, "core": 6}


def drawing_graph(cluster: Cluster, max_nodes: int = 8) -> nx.Graph:
    """The part of the graph that is drawn: the first ``max_nodes`` servers with their GPUs,
    NICs and switches, and every leaf, spine and core they reach (layer in ``"layer"``)."""
    keep = {v for v in cluster.graph.nodes
            if v[0] in ("leaf", "spine", "core", "loopback")
            or (len(v) > 1 and v[1] < max_nodes)}
    sub = cluster.graph.subgraph(keep).copy()
    leaves = {v for v in sub if v[0] == "leaf" and sub.degree(v) > sum(
        1 for u in sub[v] if u[0] == "spine")}
    sub.remove_nodes_from([v for v in list(sub) if v[0] == "leaf" and v not in leaves])
    for v in sub:
        sub.nodes[v]["layer"] = _LAYER.get(v[0], 7)
    return sub


def draw_png(cluster: Cluster, path: str, max_nodes: int = 8) -> str:
    """Draw ``cluster`` (first ``max_nodes`` servers, layered) to a PNG file; returns path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = drawing_graph(cluster, max_nodes)
    pos = {}
    for layer in {g.nodes[v]["layer"] for v in g}:
        members = sorted((v for v in g if g.nodes[v]["layer"] == layer), key=repr)
        for i, v in enumerate(members):
            pos[v] = ((i + 0.5) / len(members), layer)
    colors = {0: "#4c72b0", 1: "#55a868", 2: "#8172b2", 3: "#c44e52", 4: "#dd8452",
              5: "#937860", 6: "#da8bc3"}
    fig, ax = plt.subplots(figsize=(14, 6))
    nx.draw_networkx_edges(g, pos, ax=ax, alpha=0.25, width=0.5)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_size=18,
                           node_color=[colors.get(g.nodes[v]["layer"], "grey") for v in g])
    shown = min(max_nodes, cluster.num_nodes)
    s = summary(cluster)
    ax.set_title(f"{cluster.name}: {cluster.num_devices} {cluster.device.name} on "
                 f"{cluster.num_nodes} nodes ({shown} drawn), {cluster.topology}, "
                 f"{cluster.tiers} tier(s); bisection {s['bisection_bandwidth_Bps'] / 1e12:.2f} "
                 f"TB/s per direction")
    names = {0: "GPUs", 1: "node switch", 2: "host", 3: "NICs", 4: "leaves", 5: "spines",
             6: "cores"}
    layers = sorted({g.nodes[v]["layer"] for v in g})
    ax.set_yticks(layers, [names.get(i, "") for i in layers])
    ax.tick_params(left=True, labelleft=True)
    ax.set_frame_on(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

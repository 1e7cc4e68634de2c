"""Cluster variants: a preset with another node type, GPU count, NIC line rate or leaf
oversubscription, as a cluster-design sweep asks for (`planner.sweep`).

A variant is the cluster file a user would write (docs/clusters.md): the preset of the node
type when there is one (its fabric is that system's reference architecture), else the base
preset's fabric with ``node_type`` replaced; ``nic.speed_Gbps`` and
``fabric.oversubscription`` overridden where given. It is built by the same loader as every
cluster file, so the same checks apply.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from planner.spec import PlanError
from simulator.network.cluster import (
    Cluster,
    _cluster_presets,
    _gpu_cluster,
    _node_types,
    cluster_names,
    node_type_names,
)


def variant_spec(base: str, node_type: str, nic_Gbps: float | None = None,
                 oversubscription: float | None = None) -> tuple[str, dict]:
    """``(name, cluster-file dict)`` of the variant.

    >>> name, spec = variant_spec("dgx-h100", "dgx-a100", nic_Gbps=400, oversubscription=2)
    >>> name, spec["node_type"], spec["nic"], spec["fabric"]["oversubscription"]
    ('dgx-a100-nic400-over2', 'dgx-a100', {'speed_Gbps': 400}, 2)

    Raises:
        PlanError: an unknown base preset or node type, or a GPU-less base.
    """
    presets = _cluster_presets()
    if base not in presets or presets[base].get("kind") != "gpu":
        raise PlanError(f"base cluster={base!r} is not a GPU preset; use one of "
                        f"{[n for n in cluster_names() if presets[n].get('kind') == 'gpu']}")
    if node_type not in _node_types():
        raise PlanError(f"node_type={node_type!r} is not one of {node_type_names()}")
    source = node_type if presets.get(node_type, {}).get("kind") == "gpu" else base
    spec = copy.deepcopy(presets[source])
    spec["node_type"] = node_type
    name = node_type
    if nic_Gbps is not None:
        spec["nic"] = {**spec.get("nic", {}), "speed_Gbps": nic_Gbps}
        name += f"-nic{nic_Gbps:g}"
    if oversubscription is not None:
        spec["fabric"] = {**spec.get("fabric", {}), "oversubscription": oversubscription}
        name += f"-over{oversubscription:g}"
    return name, spec


def check_variant(base: str, node_type: str, gpus: int, nic_Gbps: float | None = None,
                  oversubscription: float | None = None,
                  names: Mapping[str, str] | None = None) -> None:
    """Check a variant without building its graph; ``names`` calls the arguments in messages
    what the caller's user wrote (e.g. ``{"gpus": "--gpus"}``).

    Raises:
        PlanError: as `variant_spec`; ``gpus`` not a positive multiple of the node type's
            GPUs per node; a NIC speed that is not positive; an oversubscription below 1.
    """
    _, spec = variant_spec(base, node_type, nic_Gbps, oversubscription)
    per_node = spec.get("devices_per_node", _node_types()[node_type]["devices_per_node"])
    name = {"gpus": "gpus", "nic_Gbps": "nic_Gbps", "oversubscription": "oversubscription",
            **(names or {})}
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1 or gpus % per_node:
        near = max(per_node, round(gpus / per_node) * per_node) if isinstance(gpus, int) \
            else per_node
        raise PlanError(f"{name['gpus']}={gpus!r} is not a whole number of {node_type} nodes "
                        f"of {per_node} GPUs; use a positive multiple of {per_node} (e.g. "
                        f"{near})")
    if nic_Gbps is not None and not nic_Gbps > 0:
        raise PlanError(f"{name['nic_Gbps']}={nic_Gbps:g} must be > 0: the line rate of one "
                        f"NIC in Gb/s (e.g. 400)")
    if oversubscription is not None and not oversubscription >= 1:
        raise PlanError(f"{name['oversubscription']}={oversubscription:g} must be >= 1 (leaf "
                        f"downlink / uplink bandwidth; 1 = non-blocking)")


def cluster_variant(base: str, node_type: str, gpus: int, nic_Gbps: float | None = None,
                    oversubscription: float | None = None) -> Cluster:
    """The variant's `Cluster` with ``gpus`` devices.

    >>> c = cluster_variant("dgx-h100", "dgx-a100", 32, nic_Gbps=400)
    >>> c.num_nodes, c.device.name, c.nic_bandwidth_Bps / 1e9
    (4, 'a100-sxm-80gb', 50.0)

    Raises:
        PlanError: as `check_variant`, or the fabric cannot hold that many nodes.
    """
    check_variant(base, node_type, gpus, nic_Gbps, oversubscription)
    name, spec = variant_spec(base, node_type, nic_Gbps, oversubscription)
    per_node = spec.get("devices_per_node", _node_types()[node_type]["devices_per_node"])
    try:
        return _gpu_cluster(name, spec, gpus // per_node, None, None, None)
    except KeyError as exc:
        raise PlanError(f"cluster {name!r} is missing field {exc}") from None

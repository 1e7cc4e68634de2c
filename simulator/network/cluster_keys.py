"""The keys a cluster YAML may have (docs/clusters.md), so that a misspelt one is an error
naming it and the known ones instead of a default silently used in its place."""

from __future__ import annotations

from planner.spec import PlanError, closest

#: Known keys per cluster kind: top-level, and per nested section.
KNOWN_KEYS = {
    "gpu": {
        "": ("kind", "node_type", "nodes", "default_nodes", "devices_per_node",
             "nvlink_domain_size", "compute_trays", "device", "default_dtype", "nic", "fabric",
             "intra", "source"),
        "nic": ("per_node", "speed_Gbps", "bandwidth_Bps", "transport", "latency_s", "source"),
        "fabric": ("topology", "switch_radix", "oversubscription", "tiers", "nodes_per_leaf",
                   "spines", "switch_latency_s", "source"),
        "intra": ("kind", "bandwidth_Bps", "latency_s", "in_switch_reduction",
                  "gpus_per_switch", "source"),
    },
    "localhost": {
        "": ("kind", "default_ranks", "device", "default_dtype", "p2p", "collective",
             "oversubscription", "cpu_profile", "source"),
        "p2p": ("bandwidth_Bps", "latency_s"),
        "collective": ("bandwidth_Bps", "latency_s"),
        "oversubscription": ("latency_exponent", "bandwidth_exponent"),
    },
}


def _hint(key: str, kind: str) -> str:
    # the closest known key anywhere in the file, with its section
    paths = [f"{s}.{k}" if s else k for s, keys in KNOWN_KEYS[kind].items() for k in keys]
    close = closest(key, [p.rsplit(".", 1)[-1] for p in paths])
    if close is None:
        return ""
    where = [p for p in paths if p.rsplit(".", 1)[-1] == close]
    return f" (did you mean {' or '.join(repr(w) for w in where)}?)"


def check_cluster_keys(name: str, spec: dict) -> None:
    """Raise `PlanError` for a key of cluster ``name`` that its kind does not know.

    >>> check_cluster_keys("my", {"kind": "gpu", "node_type": "dgx-h100",
    ...                           "fabric": {"switch_radix": 64, "oversubscripton": 2.0}})
    Traceback (most recent call last):
    ...
    planner.spec.PlanError: cluster 'my': unknown field 'fabric.oversubscripton' (did you mean 'fabric.oversubscription'?); known fabric fields: topology, switch_radix, oversubscription, tiers, nodes_per_leaf, spines, switch_latency_s, source
    """
    known = KNOWN_KEYS[spec["kind"]]
    for section, keys in known.items():
        block = spec if not section else spec.get(section)
        if not isinstance(block, dict):
            continue
        for key in block:
            if key not in keys:
                path = f"{section}.{key}" if section else key
                label = f"{section} fields" if section else "top-level fields"
                raise PlanError(f"cluster {name!r}: unknown field {path!r}"
                                f"{_hint(str(key), spec['kind'])}; known {label}: "
                                f"{', '.join(keys)}")

"""Placement: which device each rank's (pp, dp, cp, tp) coordinate runs on, and which
parallel groups cross node (and leaf) boundaries.

Ranks are numbered as a torch DeviceMesh of dims ``("pp", "dp", "cp", "tp")`` numbers them
(tp fastest; cp has size 1 unless the plan is context-parallel). The device of a coordinate
follows ``plan.placement`` (mesh axes innermost first):
``device = Σ coord[axis] · stride[axis]`` with strides from `mesh_strides`, so the default
``('tp', 'dp', 'pp')`` maps rank r to device r, and ``('dp', 'tp', 'pp')`` spreads each TP
group over DP-many devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.spec import Plan, PlanError
from simulator.cluster import Cluster
from simulator.collectives import mesh_strides

#: Mesh dims in rank order, outermost first (torchtitan / DeviceMesh convention).
RANK_ORDER = ("pp", "dp", "cp", "tp")


def rank_coords(plan: Plan) -> np.ndarray:
    """``(world_size, 4)`` array of each rank's ``(pp, dp, cp, tp)`` coordinate.

    >>> rank_coords(Plan(tp=2, pp=1, dp=2, micro_batch=1, global_batch=2)).tolist()
    [[0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0], [0, 1, 0, 1]]
    """
    sizes = [getattr(plan, a) for a in RANK_ORDER]
    return np.stack(np.unravel_index(np.arange(plan.world_size), sizes), axis=1)


def rank_to_device(plan: Plan) -> np.ndarray:
    """Device index of every rank under ``plan.placement``.

    >>> from planner.spec import Plan
    >>> rank_to_device(Plan(tp=2, pp=1, dp=2, micro_batch=1, global_batch=2,
    ...                     placement=("dp", "tp", "pp"))).tolist()
    [0, 2, 1, 3]
    """
    strides = mesh_strides(plan)
    coords = rank_coords(plan)
    return sum(coords[:, i] * strides[a] for i, a in enumerate(RANK_ORDER))


@dataclass(frozen=True, kw_only=True)
class AxisGroups:
    """The groups of one mesh axis: size, count, device stride, and how many cross nodes."""

    axis: str
    size: int
    groups: int
    stride: int
    crossing_node: int
    max_nodes: int
    crossing_leaf: int

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return dict(self.__dict__)


def placement_report(plan: Plan, cluster: Cluster) -> list[AxisGroups]:
    """For each of tp, cp (when cp > 1), dp and pp: its groups and how many span more than
    one node / leaf.

    Raises:
        PlanError: the plan needs more devices than the cluster has.
    """
    if plan.world_size > cluster.num_devices:
        raise PlanError(f"{plan.degrees} > devices({cluster.num_devices}) of "
                        f"cluster {cluster.name!r}")
    devices = rank_to_device(plan)
    sizes = [getattr(plan, a) for a in RANK_ORDER]
    grid = devices.reshape(sizes)
    strides = mesh_strides(plan)
    out = []
    for i, axis in enumerate(RANK_ORDER):
        if axis == "cp" and plan.cp == 1:
            continue
        groups = np.moveaxis(grid, i, -1).reshape(-1, sizes[i])
        nodes = groups // cluster.devices_per_node
        leaves = nodes // cluster.nodes_per_leaf
        spans = np.array([len(np.unique(r)) for r in nodes]) if sizes[i] > 1 \
            else np.ones(len(groups), dtype=int)
        out.append(AxisGroups(
            axis=axis, size=sizes[i], groups=len(groups), stride=strides[axis],
            crossing_node=int((nodes != nodes[:, :1]).any(axis=1).sum()),
            max_nodes=int(spans.max()),
            crossing_leaf=int((leaves != leaves[:, :1]).any(axis=1).sum())))
    return sorted(out, key=lambda g: ("tp", "cp", "dp", "pp").index(g.axis))

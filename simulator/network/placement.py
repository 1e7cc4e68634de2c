"""Placement: which parallel groups of a plan cross node (and leaf) boundaries.

A rank is a device index; its (pp, dp, cp, tp) coordinate and its groups come from the one
mesh layout, `planner.mesh` (``plan.placement`` orders the axes, innermost first), so the
default ``('tp', 'dp', 'pp')`` keeps each TP group on neighbouring devices and
``('dp', 'tp', 'pp')`` spreads it over DP-many devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.mesh import AXES, mesh_dims, mesh_strides
from planner.spec import Plan, PlanError
from simulator.network.cluster import Cluster


def device_grid(plan: Plan) -> np.ndarray:
    """The device (= rank) of every coordinate, as an array indexed ``[pp, dp, cp, tp]``.

    >>> device_grid(Plan(tp=2, pp=1, dp=2, micro_batch=1, global_batch=2,
    ...                  placement=("dp", "tp", "pp")))[0, :, 0, :].tolist()
    [[0, 2], [1, 3]]
    """
    dims = mesh_dims(plan, keep_unit_cp=True)
    grid = np.arange(plan.world_size).reshape([getattr(plan, d) for d in dims])
    return np.moveaxis(grid, [dims.index(a) for a in AXES], range(len(AXES)))


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
    grid = device_grid(plan)
    sizes = grid.shape
    strides = mesh_strides(plan)
    out = []
    for i, axis in enumerate(AXES):
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

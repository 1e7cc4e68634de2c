"""The one mesh layout (`planner.mesh`): the planner's coordinates, the simulator's device
grid and the runtime's DeviceMesh agree for every placement order.

The reference is torch's own ``init_device_mesh`` (through `runtime.parallelize.build_mesh`),
built once per rank on a fake process group, so each rank's coordinates are what that rank
would see in a run.
"""

from __future__ import annotations

import itertools

import pytest

from planner.mesh import AXES, group_ranks, mesh_strides, rank_coords, rank_of
from planner.spec import MESH_AXES, Plan, PlanError
from simulator.network.placement import device_grid

PLACEMENTS = list(itertools.permutations(MESH_AXES))


def _runtime_coords(plan: Plan) -> list[dict[str, int]]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.parallelize import build_mesh
    out = []
    for rank in range(plan.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank,
                                world_size=plan.world_size)
        try:
            mesh = build_mesh(plan)
            out.append({axis: (mesh[axis].get_local_rank() if axis in mesh.mesh_dim_names
                               else 0) for axis in AXES})
        finally:
            dist.destroy_process_group()
    return out


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=".".join)
def test_planner_simulator_and_runtime_agree(placement, cp):
    plan = Plan(tp=2, cp=cp, pp=2, dp=2, micro_batch=1, global_batch=4, placement=placement)
    runtime = _runtime_coords(plan)
    grid = device_grid(plan)
    for rank in range(plan.world_size):
        coords = rank_coords(plan, rank)
        assert coords == runtime[rank]
        assert grid[tuple(coords[a] for a in AXES)] == rank
        assert rank_of(plan, **coords) == rank


def test_default_layout_by_hand():
    # tp innermost, then dp, then pp (Megatron's order): rank = 8·pp + 2·dp + tp
    plan = Plan(tp=2, pp=2, dp=4, micro_batch=1, global_batch=4)
    assert mesh_strides(plan) == {"pp": 8, "dp": 2, "cp": 2, "tp": 1}
    assert rank_coords(plan, 13) == {"pp": 1, "dp": 2, "cp": 0, "tp": 1}
    assert list(group_ranks(plan, "dp", stage=1)) == [8, 10, 12, 14]
    assert list(group_ranks(plan, "pp")) == [0, 8]


def test_context_parallel_ranks_sit_inside_dp():
    # tp=2, cp=2, dp=2: rank = 4·dp + 2·cp + tp; the ring of (dp 0, tp 0) is [0, 2] and the
    # gradient group (dp·cp) is [0, 2, 4, 6]
    plan = Plan(tp=2, cp=2, pp=1, dp=2, micro_batch=1, global_batch=2)
    assert list(group_ranks(plan, "cp")) == [0, 2]
    assert list(group_ranks(plan, "dp_cp")) == [0, 2, 4, 6]
    assert rank_coords(plan, 6) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}


def test_bad_rank_and_axis_name_the_fix():
    plan = Plan(tp=2, pp=1, dp=2, micro_batch=1, global_batch=2)
    with pytest.raises(PlanError, match=r"rank=4 does not exist.*0\.\.3"):
        rank_coords(plan, 4)
    with pytest.raises(PlanError, match="mesh axis 'ep'"):
        group_ranks(plan, "ep")

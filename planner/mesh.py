"""The mesh layout of a plan: the one place that maps a rank to its (pp, dp, cp, tp)
coordinate, to a device, and to the ranks of its parallel groups.

A rank is a device index: torchrun numbers the workers node by node (rank = node ·
devices_per_node + local rank, local rank = GPU index), and `runtime.parallelize.build_mesh`
lays a row-major torch ``DeviceMesh`` over the ranks 0 .. world − 1. Its dims, outermost
first, are ``plan.placement`` reversed (placement lists the axes innermost first), with the
cp ranks of a context-parallel group innermost inside the ``dp`` axis (Megatron's
tp-cp-dp-pp order). So the default placement ``('tp', 'dp', 'pp')`` gives dims
``('pp', 'dp', 'cp', 'tp')``: TP peers are neighbouring ranks, inside one node.

The simulator (placement, collectives, stragglers), the planner and the runtime's DeviceMesh
all read the layout from here.
"""

from __future__ import annotations

from functools import lru_cache

from planner.spec import V_SCHEDULES, Plan, PlanError

#: Every mesh axis, in the order coordinates are reported (outermost of the default first).
AXES = ("pp", "dp", "cp", "tp")


def mesh_dims(plan: Plan, *, keep_unit_cp: bool = False) -> tuple[str, ...]:
    """The DeviceMesh dim names of ``plan``, outermost (slowest over ranks) first.

    ``cp`` sits innermost inside ``dp``; it is left out when cp = 1 unless ``keep_unit_cp``
    (a size-1 dim adds process groups and changes nothing).

    >>> mesh_dims(Plan(tp=2, pp=2, dp=2, micro_batch=1, global_batch=2))
    ('pp', 'dp', 'tp')
    >>> mesh_dims(Plan(tp=2, cp=2, pp=1, dp=2, micro_batch=1, global_batch=2,
    ...                placement=("dp", "tp", "pp")))
    ('pp', 'tp', 'dp', 'cp')
    """
    dims: list[str] = []
    for axis in reversed(plan.placement):
        dims.append(axis)
        if axis == "dp" and (plan.cp > 1 or keep_unit_cp):
            dims.append("cp")
    return tuple(dims)


def mesh_shape(plan: Plan, *, keep_unit_cp: bool = False) -> tuple[int, ...]:
    """The sizes of `mesh_dims`, in the same order.

    >>> mesh_shape(Plan(tp=4, pp=2, dp=2, micro_batch=1, global_batch=2))
    (2, 2, 4)
    """
    return tuple(getattr(plan, d) for d in mesh_dims(plan, keep_unit_cp=keep_unit_cp))


def mesh_strides(plan: Plan) -> dict[str, int]:
    """Rank (device-index) stride of each axis of ``plan``'s mesh.

    >>> mesh_strides(Plan(tp=8, pp=4, dp=2, micro_batch=1, global_batch=8))
    {'pp': 16, 'dp': 8, 'cp': 8, 'tp': 1}
    >>> mesh_strides(Plan(tp=8, cp=2, pp=4, dp=2, micro_batch=1, global_batch=8))
    {'pp': 32, 'dp': 16, 'cp': 8, 'tp': 1}
    """
    key = (plan.placement, plan.pp, plan.dp, plan.cp, plan.tp)
    found = _STRIDES.get(key)
    if found is None:
        dims = mesh_dims(plan, keep_unit_cp=True)
        strides, stride = {}, 1
        for axis in reversed(dims):                    # innermost first
            strides[axis] = stride
            stride *= getattr(plan, axis)
        found = _STRIDES[key] = {axis: strides[axis] for axis in AXES}
    return dict(found)


#: `mesh_strides` per (placement, pp, dp, cp, tp): the planner asks for the same few layouts
#: hundreds of thousands of times.
_STRIDES: dict[tuple, dict[str, int]] = {}


def _check_rank(plan: Plan, rank: int) -> None:
    world = plan.world_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise PlanError(f"rank={rank!r} does not exist: the plan has {plan.degrees} ranks; "
                        f"use a rank in 0..{world - 1}")


def rank_coords(plan: Plan, rank: int) -> dict[str, int]:
    """``{"pp": stage, "dp": replica, "cp": context rank, "tp": tensor rank}`` of ``rank``.

    >>> rank_coords(Plan(tp=2, pp=2, dp=2, micro_batch=1, global_batch=4), 5)
    {'pp': 1, 'dp': 0, 'cp': 0, 'tp': 1}
    >>> rank_coords(Plan(tp=2, pp=2, dp=2, micro_batch=1, global_batch=4,
    ...                  placement=("dp", "tp", "pp")), 5)
    {'pp': 1, 'dp': 1, 'cp': 0, 'tp': 0}

    Raises:
        PlanError: ``rank`` is not in 0 .. world_size − 1.
    """
    _check_rank(plan, rank)
    strides = mesh_strides(plan)
    return {axis: rank // strides[axis] % getattr(plan, axis) for axis in AXES}


def rank_of(plan: Plan, **coords: int) -> int:
    """The rank at a coordinate; axes not given are 0.

    >>> rank_of(Plan(tp=2, pp=2, dp=2, micro_batch=1, global_batch=4), pp=1, tp=1)
    5

    Raises:
        PlanError: an unknown axis or a coordinate outside its axis.
    """
    strides = mesh_strides(plan)
    rank = 0
    for axis, value in coords.items():
        if axis not in strides:
            raise PlanError(f"mesh axis {axis!r} is not one of {list(AXES)}")
        if not 0 <= value < getattr(plan, axis):
            raise PlanError(f"{axis}={value} is outside 0..{getattr(plan, axis) - 1}")
        rank += value * strides[axis]
    return rank


def group_ranks(plan: Plan, axis: str, *, stage: int = 0) -> range:
    """Ranks of the ``axis`` group ('tp', 'cp', 'dp', 'dp_cp' or 'pp') that holds the first
    rank of pipeline stage ``stage`` (tp, cp and dp coordinate 0). 'dp_cp' is the dp·cp ranks
    that reduce gradients together (the dp group when cp = 1).

    >>> list(group_ranks(Plan(tp=2, pp=2, dp=2, micro_batch=1, global_batch=4), "dp", stage=1))
    [4, 6]
    >>> p = Plan(tp=2, cp=2, pp=1, dp=2, micro_batch=1, global_batch=4)
    >>> list(group_ranks(p, "cp")), list(group_ranks(p, "dp_cp"))
    ([0, 2], [0, 2, 4, 6])

    Raises:
        PlanError: an unknown axis.
    """
    strides = mesh_strides(plan)
    base = 0 if axis == "pp" else stage * strides["pp"]
    if axis == "dp_cp":
        return range(base, base + plan.dp_cp * strides["cp"], strides["cp"])
    if axis not in strides:
        raise PlanError(f"mesh axis {axis!r} is not one of {list(AXES) + ['dp_cp']}")
    return range(base, base + getattr(plan, axis) * strides[axis], strides[axis])


#: The expert axes of Megatron-Core's MoE parallel folding, innermost first: expert tensor
#: parallel, expert parallel, expert data parallel.
EXPERT_AXES = ("etp", "ep", "edp")


def stage_ranks(plan: Plan, stage: int = 0) -> list[int]:
    """The tp·cp·dp ranks of pipeline stage ``stage``, ordered tp fastest, then cp, then dp
    (Megatron's attention order inside a stage), whatever the placement.

    >>> stage_ranks(Plan(tp=2, pp=2, dp=2, micro_batch=1, global_batch=4), stage=1)
    [4, 5, 6, 7]
    >>> stage_ranks(Plan(tp=2, pp=1, dp=2, micro_batch=1, global_batch=4,
    ...                  placement=("dp", "tp", "pp")))
    [0, 2, 1, 3]
    """
    s = mesh_strides(plan)
    base = stage * s["pp"]
    return [base + t * s["tp"] + c * s["cp"] + d * s["dp"]
            for d in range(plan.dp) for c in range(plan.cp) for t in range(plan.tp)]


def expert_group_ranks(plan: Plan, axis: str, *, stage: int = 0, index: int = 0) -> list[int]:
    """Ranks of the ``axis`` group ('etp', 'ep' or 'edp') of Megatron-Core's MoE parallel
    folding that holds the ``index``-th rank of stage ``stage`` (`stage_ranks` order).

    The stage's tp·cp·dp ranks are re-read as an (edp, ep, etp) grid, etp fastest
    (Megatron-Core ``RankGenerator`` with order ``tp-ep-dp-pp`` for the expert groups): an
    EP group is ep ranks etp apart in `stage_ranks` order, so with the default placement it
    spans etp·ep neighbouring devices and stays inside a node (NVLink domain) whenever
    etp·ep fits there.

    >>> p = Plan(tp=2, pp=1, dp=8, ep=4, micro_batch=1, global_batch=8)
    >>> expert_group_ranks(p, "ep"), expert_group_ranks(p, "edp")
    ([0, 1, 2, 3], [0, 4, 8, 12])

    Raises:
        PlanError: an axis that is not one of `EXPERT_AXES`.
    """
    if axis not in EXPERT_AXES:
        raise PlanError(f"expert axis {axis!r} is not one of {list(EXPERT_AXES)}")
    s = mesh_strides(plan)
    base, tp, cp = stage * s["pp"], plan.tp, plan.cp
    size = {"etp": plan.etp, "ep": plan.ep, "edp": plan.edp}[axis]
    stride = {"etp": 1, "ep": plan.etp, "edp": plan.etp * plan.ep}[axis]
    start = index - (index // stride % size) * stride
    out = []
    for j in range(start, start + size * stride, stride):   # `stage_ranks` order, unbuilt
        out.append(base + j % tp * s["tp"] + j // tp % cp * s["cp"] + j // (tp * cp) * s["dp"])
    return out


def chunk_rank(schedule: str, pp: int, chunk: int) -> int:
    """The pipeline rank that runs model chunk ``chunk`` (pipeline order, 0 .. pp·v − 1) under
    ``schedule``.

    Interleaved schedules loop the chunks over the ranks (chunk g on rank g % pp, Narayanan et
    al. 2021 §2.2); ZB-V and DualPipe-V fold them in a V, so rank r holds chunks r and
    2·pp − 1 − r and the first and last chunks share rank 0 (Qi et al. 2024, §6;
    torch.distributed.pipelining ``generate_stage_to_rank_mapping(style="v")``).

    >>> [chunk_rank("zb-v", 2, g) for g in range(4)], [chunk_rank("interleaved-1f1b", 2, g)
    ...                                                for g in range(4)]
    ([0, 1, 1, 0], [0, 1, 0, 1])
    """
    if schedule in V_SCHEDULES and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp


def rank_chunks(plan: Plan, rank: int) -> tuple[int, ...]:
    """The model chunks pipeline rank ``rank`` holds, in increasing order (`chunk_rank`).

    >>> rank_chunks(Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=4, schedule="zb-v",
    ...                  virtual_stages=2), 0)
    (0, 3)
    """
    return _rank_chunks(plan.schedule, plan.pp, plan.virtual_stages, rank)


@lru_cache(maxsize=4096)
def _rank_chunks(schedule: str, pp: int, v: int, rank: int) -> tuple[int, ...]:
    # Cached: the memory and MoE models ask it once per candidate, stage and chunk.
    return tuple(g for g in range(pp * v) if chunk_rank(schedule, pp, g) == rank)

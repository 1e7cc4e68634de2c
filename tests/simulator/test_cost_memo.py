"""The cost memo: each distinct group is routed once per cluster, and memoised costs are
the uncached ones."""

import pytest

from planner.mesh import group_ranks
from planner.presets import load_model
from planner.spec import Plan
from simulator.network.cluster import load_cluster
from simulator.network.collectives import collective_cost, cost_memo, p2p_boundary_time_s
from simulator.step.costs import stage_costs

PLANS = [
    Plan(tp=8, pp=4, dp=4, micro_batch=1, global_batch=64),
    Plan(tp=2, pp=8, dp=8, micro_batch=2, global_batch=64, zero_stage=3,
         placement=("tp", "pp", "dp")),
    Plan(tp=4, pp=4, dp=8, micro_batch=1, global_batch=64, schedule="interleaved-1f1b",
         virtual_stages=2, sequence_parallel=True, zero_stage=1, recompute="selective"),
    Plan(tp=1, pp=2, dp=64, micro_batch=1, global_batch=64, placement=("dp", "tp", "pp")),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id + "-" + ".".join(p.placement))
def test_memoised_stage_costs_equal_the_uncached_ones(plan):
    # reference: the same costs with every collective and P2P routed afresh
    model = load_model("llama3-8b")
    with cost_memo(False):
        fresh = stage_costs(model, plan, load_cluster("dgx-h100", nodes=16))
    cluster = load_cluster("dgx-h100", nodes=16)
    assert stage_costs(model, plan, cluster) == fresh
    assert stage_costs(model, plan, cluster) == fresh  # second call: all from the memo


def test_context_parallel_ring_costs_per_rank_are_kept():
    # cp > 1: the ring's hops depend on the ranks, so chunks are not merged across ranks
    model = load_model("llama3-8b").replace(seq_len=32768)
    plan = Plan(tp=4, cp=4, pp=4, dp=2, micro_batch=1, global_batch=16)
    with cost_memo(False):
        fresh = stage_costs(model, plan, load_cluster("dgx-h100", nodes=16))
    assert stage_costs(model, plan, load_cluster("dgx-h100", nodes=16)) == fresh


def test_each_group_layout_is_routed_once():
    # The DP groups of 8 pipeline stages are translates of one another (stride 8, size 16):
    # one routed shape and one memoised cost for all of them.
    cluster = load_cluster("dgx-h100", nodes=128)
    plan = Plan(tp=8, pp=8, dp=16, micro_batch=1, global_batch=64)
    costs = {collective_cost(cluster, "all_reduce", 1e9, group_ranks(plan, "dp", stage=s))
             for s in range(8)}
    assert len(costs) == 1
    assert [k for k in cluster._links if k[0] == "shape"] == [("shape", ("stride", 8, 16))]
    assert len(cluster._links["costs"]) == 1


def test_p2p_memo_is_per_layout_not_per_size():
    # k·S/B with the same k for every size: 2 MB takes twice the bandwidth term of 1 MB
    cluster = load_cluster("dgx-a100", nodes=4)
    plan = Plan(tp=4, pp=8, dp=1, micro_batch=1, global_batch=8)
    one, two = (p2p_boundary_time_s(cluster, plan, s, 4, 8) for s in (1e6, 2e6))
    link = cluster.link(4, 8)
    assert two - one == pytest.approx(one - link.latency_s, rel=1e-9)
    assert len(cluster._links["p2p"]) == 1


@pytest.mark.parametrize("plan", PLANS + [
    Plan(tp=8, pp=4, dp=4, micro_batch=1, global_batch=64, schedule="gpipe"),
    Plan(tp=8, pp=4, dp=4, micro_batch=1, global_batch=64, stage_layers=(4, 10, 10, 8))],
    ids=lambda p: p.id)
def test_worst_stage_is_the_largest_of_every_stage(plan):
    # reference: every stage's breakdown, the first of the largest
    from simulator.step.memory import memory_per_stage, worst_stage_memory
    model = load_model("llama3-8b")
    stages = memory_per_stage(model, plan, attention="flash")
    worst = max(range(len(stages)), key=lambda i: stages[i].total_bytes)
    assert worst_stage_memory(model, plan, attention="flash") == (worst, stages[worst])


ZB_PLANS = [
    Plan(tp=8, pp=4, dp=4, micro_batch=1, global_batch=64, schedule="zb-h1"),
    Plan(tp=4, pp=4, dp=8, micro_batch=1, global_batch=64, schedule="zb-v", virtual_stages=2),
    Plan(tp=4, pp=4, dp=8, micro_batch=1, global_batch=256, schedule="dualpipe-v",
         virtual_stages=2, zero_stage=1),
    Plan(tp=4, pp=4, dp=8, micro_batch=1, global_batch=64, schedule="interleaved-zb",
         virtual_stages=2, zero_stage=2),
]


@pytest.mark.parametrize("plan", ZB_PLANS, ids=lambda p: p.id)
def test_memoised_zero_bubble_timeline_equals_the_uncached_one(plan):
    # reference: the same closed form with the timeline scheduled afresh (memo off)
    from simulator.step.simulate import estimate
    from simulator.step.zero_bubble import _TIMELINES
    model = load_model("llama3-8b")
    with cost_memo(False):
        fresh = estimate(model, plan, load_cluster("dgx-h100", nodes=16))
    _TIMELINES.clear()
    cluster = load_cluster("dgx-h100", nodes=16)
    first = estimate(model, plan, cluster)
    assert _TIMELINES  # the memo was filled
    again = estimate(model, plan.replace(zero_stage=3 - plan.zero_stage), cluster)
    assert (first.step_time_s, first.compute_s, first.comm_s) == \
        (fresh.step_time_s, fresh.compute_s, fresh.comm_s)
    with cost_memo(False):
        other = estimate(model, plan.replace(zero_stage=3 - plan.zero_stage),
                         load_cluster("dgx-h100", nodes=16))
    assert (again.step_time_s, again.comm_s) == (other.step_time_s, other.comm_s)


# MoE plans that differ in a field the block / layout / bound / dispatch memos key on
# (micro-batch, ep, tp, pp, schedule, placement) and in fields they do not (dp, placement, ZeRO), run one after another
# so each can hit the entries the others left.
MOE_PLANS = [
    Plan(tp=2, pp=4, dp=16, ep=8, micro_batch=1, global_batch=64, sequence_parallel=True),
    Plan(tp=2, pp=4, dp=16, ep=16, micro_batch=1, global_batch=64, sequence_parallel=True),
    Plan(tp=2, pp=4, dp=16, ep=16, micro_batch=2, global_batch=64, sequence_parallel=True,
         zero_stage=1),
    Plan(tp=2, pp=4, dp=16, ep=8, micro_batch=1, global_batch=64, sequence_parallel=True,
         zero_stage=2, placement=("tp", "pp", "dp")),
    Plan(tp=2, pp=8, dp=16, ep=8, micro_batch=1, global_batch=64, sequence_parallel=True),
    Plan(tp=1, pp=8, dp=16, ep=16, micro_batch=1, global_batch=64, schedule="zb-h1",
         dtype="fp8"),
]


def _moe_figures(model, plan, cluster):
    from simulator.step.costs import _device, _efficiency, compute_lower_bounds_s
    from simulator.step.memory import memory_per_stage, worst_stage_memory
    from simulator.step.moe import block_compute, chunk_compute, dispatch_time_s
    from simulator.step.stagecosts import DEFAULT_OPTIONS
    dev, eff = _device(cluster), _efficiency(cluster, DEFAULT_OPTIONS)
    return (stage_costs(model, plan, cluster), compute_lower_bounds_s(model, plan, cluster),
            memory_per_stage(model, plan), worst_stage_memory(model, plan),
            block_compute(model, plan, "unfused", dev, eff, True),
            [chunk_compute(model, plan, g, "unfused", dev, eff, 1.2)
             for g in range(plan.pp * plan.virtual_stages)],
            [dispatch_time_s(model, plan, cluster, s, 1.1, d)
             for s in range(plan.pp) for d in ("alltoall", "deepep")])


def test_memoised_moe_block_layout_and_bound_terms_equal_the_uncached_ones():
    # block / chunk compute, per-stage layouts and in-flight counts of memory, the bound's
    # per-rank terms and the all-to-all:
    # memoised by a subset of the plan's fields, equal to the uncached figures of each plan
    model = load_model("deepseek-v3").replace(num_layers=16, moe_first_dense_layers=2)
    with cost_memo(False):
        fresh = [_moe_figures(model, p, load_cluster("dgx-h100", nodes=32)) for p in MOE_PLANS]
    cluster = load_cluster("dgx-h100", nodes=32)
    memoised = [_moe_figures(model, p, cluster) for p in MOE_PLANS]
    assert memoised == fresh
    assert [_moe_figures(model, p, cluster) for p in MOE_PLANS] == fresh
    assert fresh[0] != fresh[1] and fresh[0] != fresh[2]   # the inputs differ in figures

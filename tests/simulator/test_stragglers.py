"""Stragglers in the step simulation: a slow rank slows its TP group, its pipeline, its DP group.

Expected values are worked out by hand from the schedules (each test says how); the rank
numbering is the one mesh layout's (`planner.mesh`, checked in tests/planner/test_mesh.py).
"""

from __future__ import annotations

import pytest

from planner.mesh import rank_coords
from planner.presets import load_model
from planner.spec import Plan, PlanError
from simulator.failures.stragglers import (
    estimate_with_stragglers,
    simulate_with_stragglers,
)
from simulator.network.cluster import load_cluster
from simulator.step.costs import StageCosts, stage_costs
from simulator.step.pipeline import simulate_pipeline
from simulator.step.simulate import estimate, simulate


def _flat_case(**plan_fields):
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    plan = Plan(micro_batch=1, global_batch=8, **plan_fields)
    return model, plan, cluster, stage_costs(model, plan, cluster)[0]


def test_data_parallel_straggler_doubles_the_compute_and_keeps_the_communication():
    # pp=1, tp=1, dp=2, rank 1 twice as slow. Each replica runs m = 8/2 = 4 micro-batches of
    # forward + backward, then the gradient all-reduce (it needs both replicas, so it starts
    # after the slow one's backward) and the optimizer (rank 1's at half speed):
    # step = m·(2·(t_f + t_b) + c_f + c_b) + dp_comm + 2·optimizer + gather.
    model, plan, cluster, c = _flat_case(tp=1, pp=1, dp=2)
    m = plan.num_microbatches
    assert m == 4
    healthy = (m * (c.fwd_compute_s + c.bwd_compute_s + c.fwd_comm_s + c.bwd_comm_s)
               + c.dp_comm_s + c.optimizer_s + c.dp_gather_s)
    slow = (m * (2 * (c.fwd_compute_s + c.bwd_compute_s) + c.fwd_comm_s + c.bwd_comm_s)
            + c.dp_comm_s + 2 * c.optimizer_s + c.dp_gather_s)
    assert simulate(model, plan, cluster).step_time_s == pytest.approx(healthy, rel=1e-12)
    for predict in (simulate, estimate):
        pred = predict(model, plan, cluster, stragglers={1: 2.0})
        assert pred.step_time_s == pytest.approx(slow, rel=1e-12)
        assert pred.compute_s == pytest.approx(
            2 * (m * (c.fwd_compute_s + c.bwd_compute_s) + c.optimizer_s), rel=1e-12)
    # the healthy replica waits for it too: which rank is slow does not matter
    assert simulate(model, plan, cluster, stragglers={0: 2.0}).step_time_s == \
        pytest.approx(slow, rel=1e-12)


def test_a_slow_tensor_parallel_peer_slows_its_whole_group():
    # tp=2: rank 1's peer (rank 0) meets it at every layer's all-reduce, so the group's compute
    # is 1.5x and its TP communication unchanged: m·(1.5·(t_f + t_b) + c_f + c_b) + 1.5·opt.
    model, plan, cluster, c = _flat_case(tp=2, pp=1, dp=1)
    m = plan.num_microbatches
    want = (m * (1.5 * (c.fwd_compute_s + c.bwd_compute_s) + c.fwd_comm_s + c.bwd_comm_s)
            + c.dp_comm_s + 1.5 * c.optimizer_s + c.dp_gather_s)
    assert c.fwd_comm_s > 0
    for rank in (0, 1):
        assert simulate(model, plan, cluster, stragglers={rank: 1.5}).step_time_s == \
            pytest.approx(want, rel=1e-12)
    # two slow peers: the slower one sets the pace
    assert simulate(model, plan, cluster, stragglers={0: 1.2, 1: 1.5}).step_time_s == \
        pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_slow_stage_sets_the_pipeline_rate(schedule):
    # pp=2, m=4 micro-batches, both stages t_f=1, t_b=2 s; activation send 0.5 s, gradient
    # send 0.25 s; optimizer 0.4 s; stage 1 (rank 1) 3x slow: U_f=3, U_b=6.
    # GPipe: stage 1's forward k ends at 1 + 0.5 + (k+1)·3 (it is slower than stage 0, so it
    # never waits after the first arrival); its backwards follow: the last ends at
    # 1.5 + 4·3 + 4·6 = 37.5; stage 0's last backward gets that gradient at 37.75 and ends
    # at 39.75. 1F1B (worked op by op: s1 F0 1.5-4.5, B0 4.5-10.5, F1 10.5-13.5, ...,
    # B3 31.5-37.5; s0 B3 37.75-39.75) gives the same: the slow stage is busy from its
    # first arrival to its last backward either way. Tails: stage 1 37.5 + 3·0.4 = 38.7,
    # stage 0 39.75 + 0.4 = 40.15. That is m·(U_f + U_b) + (p − 1)·(t_f + t_b) + sends +
    # optimizer: (m + p − 1) x a stage time with the slow stage's time counted m times.
    plan = Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=4, schedule=schedule)
    stage = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, p2p_fwd_s=0.5, p2p_bwd_s=0.25,
                       optimizer_s=0.4)
    result = simulate_with_stragglers([stage, stage], plan, {1: 3.0})
    assert result.step_time_s == pytest.approx(40.15, abs=1e-12)
    assert result.critical_stage == 0
    if schedule == "gpipe":
        # healthy, for scale: (m + p − 1)·3 + sends + optimizer = 15 + 0.75 + 0.4 (in 1F1B
        # the healthy stages also wait for each round trip of sends, so it is longer)
        healthy = simulate_pipeline([stage, stage], schedule, 4)
        assert healthy.step_time_s == pytest.approx(16.15, abs=1e-12)


def test_each_stage_reduction_waits_for_the_latest_replica():
    # pp=2, dp=2, GPipe, one micro-batch; t_f=1, t_b=2, all-reduce 1 s, optimizer 1 s; no
    # sends. Rank 0 = (stage 0, replica 0) 2x slow, rank 3 = (stage 1, replica 1) 3x slow
    # (ranks are pp-major: rank = 2·stage + replica).
    # replica 0: s0 F 0-2, s1 F 2-3, s1 B 3-5, s0 B 5-9   -> backward ends s0 9, s1 5
    # replica 1: s0 F 0-1, s1 F 1-4, s1 B 4-10, s0 B 10-12 -> backward ends s0 12, s1 10
    # stage 0 reduces over both at max(9, 12) = 12 .. 13, then rank 0's optimizer 2 s -> 15;
    # stage 1 at max(5, 10) = 10 .. 11, rank 3's optimizer 3 s -> 14. Step 15; either
    # straggler alone gives 12 (replica 0: 9 + 1 + 2) or 14 (replica 1: 12 + 1 + 1).
    plan = Plan(tp=1, pp=2, dp=2, micro_batch=1, global_batch=2, schedule="gpipe")
    stage = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, dp_comm_s=1.0, optimizer_s=1.0)
    costs = [stage, stage]
    assert rank_coords(plan, 3) == {"pp": 1, "dp": 1, "cp": 0, "tp": 0}
    assert simulate_with_stragglers(costs, plan, {0: 2.0}).step_time_s == 12.0
    assert simulate_with_stragglers(costs, plan, {3: 3.0}).step_time_s == 14.0
    both = simulate_with_stragglers(costs, plan, {0: 2.0, 3: 3.0}, trace=True)
    assert both.step_time_s == 15.0
    assert (0, "comm", "dp-grad-reduce", 12.0, 13.0) in both.events
    # the closed form is the slowest replica's estimate_pipeline: 16 (it appends the longest
    # tail, 1 + 3, to the replica-1 pipeline 3 + 9), an upper bound here
    assert estimate_with_stragglers(costs, plan, {0: 2.0, 3: 3.0})[0] == 16.0


def test_overlapped_reduction_waits_for_the_slow_replicas_buckets():
    # pp=1, dp=2, m=2, t_f=1, t_b=2, all-reduce 2 s in 4 buckets, optimizer 0.3 s; rank 1 2x.
    # The slow replica's last backward runs 8-12, so its buckets are ready at 9, 10, 11, 12
    # (the healthy replica's at 4.5 .. 6, earlier); each takes 0.5 s: the last ends at 12.5;
    # its optimizer 0.6 s -> 13.1 (exposed_dp_s's max(t_b/n + dp, t_b + dp/n) − t_b = 0.5).
    plan = Plan(tp=1, pp=1, dp=2, micro_batch=1, global_batch=4)
    stage = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, dp_comm_s=2.0, dp_buckets=4,
                       optimizer_s=0.3)
    result = simulate_with_stragglers([stage], plan, {1: 2.0}, overlap_dp=True)
    assert result.step_time_s == pytest.approx(13.1, abs=1e-12)
    assert result.comm_s == pytest.approx(0.5, abs=1e-12)
    assert estimate_with_stragglers([stage], plan, {1: 2.0}, overlap_dp=True)[0] == \
        pytest.approx(13.1, abs=1e-12)


@pytest.mark.parametrize("schedule, v, overlap", [("1f1b", 1, False), ("gpipe", 1, True),
                                                  ("interleaved-1f1b", 2, True)])
def test_full_speed_stragglers_change_nothing(schedule, v, overlap):
    plan = Plan(tp=1, pp=2, dp=2, micro_batch=1, global_batch=8, schedule=schedule,
                virtual_stages=v)
    stage = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, fwd_comm_s=0.1, bwd_comm_s=0.2,
                       p2p_fwd_s=0.05, p2p_bwd_s=0.05, dp_comm_s=1.5, dp_buckets=3,
                       optimizer_s=0.3, dp_gather_s=0.2)
    costs = [stage] * (2 * v)
    healthy = simulate_pipeline(costs, schedule, 4, virtual_stages=v, overlap_dp=overlap)
    same = simulate_with_stragglers(costs, plan, {2: 1.0}, overlap_dp=overlap)
    assert (same.step_time_s, same.compute_s, same.comm_s) == pytest.approx(
        (healthy.step_time_s, healthy.compute_s, healthy.comm_s), abs=1e-12)


def test_bad_stragglers_name_the_value_and_the_fix():
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=1)
    plan = Plan(tp=2, pp=2, dp=2, micro_batch=1, global_batch=8)
    with pytest.raises(PlanError, match=r"rank=8 does not exist: the plan has tp\*pp\*dp = "
                                        r"2\*2\*2 = 8 ranks; use a rank in 0..7"):
        simulate(model, plan, cluster, stragglers={8: 2.0})
    with pytest.raises(PlanError, match="factor=0.5 on rank 1 must be a finite number >= 1"):
        estimate(model, plan, cluster, stragglers={1: 0.5})

"""Textbook pipeline cases, exactly: the 1F1B bubble, interleaving, and layer splits."""

import pytest

from planner.spec import ModelSpec, Plan, PlanError
from simulator.step.costs import StageCosts
from simulator.step.pipeline import estimate_pipeline, simulate_pipeline

T_F, T_B = 1.0e-3, 2.0e-3


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 32), (3, 5)])
def test_1f1b_bubble_is_p_minus_1_times_tf_plus_tb(p, m):
    # Narayanan et al. 2021 §2.2: step = m·(t_f + t_b) + (p − 1)·(t_f + t_b).
    result = simulate_pipeline([StageCosts(fwd_compute_s=T_F, bwd_compute_s=T_B)] * p,
                               "1f1b", m)
    assert result.step_time_s - m * (T_F + T_B) == pytest.approx((p - 1) * (T_F + T_B))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 3)])
def test_interleaving_divides_the_bubble_by_v(p, m, v):
    # Each chunk costs 1/v of the stage: bubble = (p − 1)·(t_f + t_b)/v.
    chunk = StageCosts(fwd_compute_s=T_F / v, bwd_compute_s=T_B / v)
    result = simulate_pipeline([chunk] * (p * v), "interleaved-1f1b", m, virtual_stages=v)
    bubble = result.step_time_s - m * (T_F + T_B)
    assert bubble == pytest.approx((p - 1) * (T_F + T_B) / v)
    est, _, _ = estimate_pipeline([chunk] * (p * v), m, virtual_stages=v)
    assert est == pytest.approx(result.step_time_s)


MODEL30 = ModelSpec(name="l30", num_layers=30, hidden=1024, num_heads=16, num_kv_heads=16,
                    ffn_hidden=4096, vocab_size=51200, seq_len=1024, activation="gelu")


def test_30_layers_on_4_stages_without_a_split_is_an_error_naming_both():
    plan = Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=8)
    with pytest.raises(PlanError, match=r"num_layers=30 .*pp\*virtual_stages = 4\*1 = 4"):
        plan.layers_per_stage(MODEL30)


def test_30_layers_on_4_stages_with_an_explicit_split_that_sums_to_30():
    plan = Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=8, stage_layers=(8, 8, 7, 7))
    assert sum(plan.layers_per_stage(MODEL30)) == 30


def test_a_split_that_misses_a_layer_is_an_error_not_a_smaller_model():
    plan = Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=8, stage_layers=(8, 8, 7, 6))
    with pytest.raises(PlanError, match=r"sums to 29, not num_layers=30"):
        plan.layers_per_stage(MODEL30)


def test_uneven_split_makes_the_heavy_stage_critical():
    from simulator.network.cluster import load_cluster
    from simulator.step.simulate import simulate
    cluster = load_cluster("dgx-a100", nodes=1)
    even = Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=8, stage_layers=(8, 8, 7, 7))
    skew = even.replace(stage_layers=(12, 6, 6, 6))
    assert simulate(MODEL30, skew, cluster).step_time_s > \
        simulate(MODEL30, even, cluster).step_time_s

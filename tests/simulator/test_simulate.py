"""Step simulation: exact bubble, monotone in bandwidth, closed form agrees, scale and MFU."""

import json

import pytest

from planner.presets import load_model
from planner.spec import Plan, PlanError
from simulator.network.cluster import load_cluster
from simulator.step.costs import StageCosts, stage_costs
from simulator.step.pipeline import schedule_order, simulate_pipeline
from simulator.step.simulate import estimate, simulate

LLAMA70B = load_model("llama3-70b")
TINY = load_model("tiny-gpt")


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 8), (8, 16), (3, 7)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_bubble_fraction_is_exact_with_free_communication(pp, m, schedule):
    # Narayanan et al. 2021 §2.2 (and GPipe): equal stages, free communication ->
    # bubble / step = (p - 1) / (m + p - 1). Stage costs: a middle stage of tiny-gpt on a
    # localhost cluster whose links are made free.
    free = load_cluster("localhost-cpu", ranks=4).scale_links(bandwidth=1e12, latency=0.0)
    middle = stage_costs(TINY, Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=4,
                                    dtype="fp32"), free)[1]
    costs = [StageCosts(fwd_compute_s=middle.fwd_compute_s,
                        bwd_compute_s=middle.bwd_compute_s)] * pp
    result = simulate_pipeline(costs, schedule, m)
    bubble = result.step_time_s - result.compute_s - result.comm_s
    assert bubble / result.step_time_s == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-9)


def test_1f1b_order_has_pp_minus_stage_minus_one_warmup_forwards():
    # Stage 1 of pp=4: 4 - 1 - 1 = 2 warm-up forwards, then F/B pairs, then 2 cool-down B.
    order = [(kind, k) for kind, _, k in schedule_order("1f1b", 4, 8, 1)]
    assert order[:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]
    assert order[-3:] == [("B", 5), ("B", 6), ("B", 7)] and len(order) == 16


PLANS = [
    Plan(tp=8, pp=4, dp=2, micro_batch=1, global_batch=32),
    Plan(tp=4, pp=2, dp=8, micro_batch=2, global_batch=64, zero_stage=1),
    Plan(tp=2, pp=8, dp=4, micro_batch=1, global_batch=64, recompute="full"),
    Plan(tp=8, pp=1, dp=8, micro_batch=1, global_batch=16, sequence_parallel=True),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_more_bandwidth_never_makes_a_step_slower(plan):
    # Monotonicity: every cost is non-increasing in every link bandwidth.
    base = load_cluster("dgx-a100", nodes=8)
    times = [simulate(LLAMA70B, plan, base.scale_links(bandwidth=f)).step_time_s
             for f in (0.25, 1.0, 4.0, 100.0)]
    assert all(a >= b for a, b in zip(times, times[1:], strict=False))
    assert times[0] > times[-1]


def test_more_bandwidth_never_slower_on_localhost():
    plan = Plan(tp=2, pp=2, dp=1, micro_batch=2, global_batch=8, dtype="fp32")
    base = load_cluster("localhost-cpu", ranks=4)
    times = [simulate(TINY, plan, base.scale_links(bandwidth=f)).step_time_s
             for f in (0.5, 1.0, 8.0)]
    assert times[0] >= times[1] >= times[2]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_estimate_agrees_with_simulation(plan):
    # The closed form (m + p - 1)(t_f + t_b) + DP + optimizer is exact for uniform stages
    # without overlap; the SimPy run must agree within 5%.
    cluster = load_cluster("dgx-h100", nodes=8)
    sim, est = simulate(LLAMA70B, plan, cluster), estimate(LLAMA70B, plan, cluster)
    assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.05)


def test_16384_gpus_simulate():
    # DESIGN: one rank per stage, so 16,384 GPUs cost as much as 64 (speed: see
    # benchmarks/simulator_bench.py).
    cluster = load_cluster("dgx-h100", nodes=2048)
    pred = simulate(LLAMA70B, Plan(tp=8, pp=8, dp=256, micro_batch=1, global_batch=2048),
                    cluster)
    assert pred.step_time_s > 0 and 0 < pred.mfu < 1


def test_llama3_70b_mfu_on_h100_is_plausible():
    # Sanity, not validation: Llama 3 paper (Dubey et al. 2024, Table 4) reports 38-43% BF16
    # MFU on H100 at 8K sequence; our tp8-pp4 plan must land in a plausible 30-60%.
    cluster = load_cluster("dgx-h100", nodes=16)
    pred = simulate(LLAMA70B, Plan(tp=8, pp=4, dp=4, micro_batch=1, global_batch=256),
                    cluster)
    assert 0.30 < pred.mfu < 0.60
    assert pred.hfu == pred.mfu  # no recomputation


def test_breakdown_adds_up_and_serialises():
    cluster = load_cluster("dgx-a100", nodes=8)
    pred = simulate(LLAMA70B, PLANS[0], cluster, trace=True)
    assert pred.compute_s + pred.comm_s + pred.bubble_s == pytest.approx(pred.step_time_s)
    assert pred.tokens_per_s == pytest.approx(32 * 8192 / pred.step_time_s)
    assert pred.peak_memory_bytes == max(m.total_bytes for m in pred.memory)
    assert {e[1] for e in pred.events} >= {"compute", "comm", "p2p"}
    data = json.loads(json.dumps(pred.to_dict()))
    assert "events" not in data and len(data["memory"]) == 4


def test_full_recompute_raises_hfu_above_mfu():
    cluster = load_cluster("dgx-a100", nodes=8)
    pred = simulate(LLAMA70B, PLANS[2], cluster)
    assert pred.hfu > pred.mfu


def test_plan_larger_than_cluster_is_rejected_with_arithmetic():
    cluster = load_cluster("dgx-h100", nodes=2)
    with pytest.raises(PlanError, match=r"tp\*pp\*dp = 8\*4\*2 = 64 > devices\(16\)"):
        simulate(LLAMA70B, PLANS[0], cluster)


def test_localhost_cpu_needs_an_fp32_plan():
    cluster = load_cluster("localhost-cpu", ranks=2)
    with pytest.raises(PlanError, match=r"no peak FLOP/s for dtype='bf16'; it has \['fp32'\]"):
        simulate(TINY, Plan(tp=1, pp=1, dp=2, micro_batch=1, global_batch=2), cluster)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_overlapped_dp_is_never_slower_and_estimate_agrees(plan):
    # Overlap can only hide communication; the closed form of the bucket pipeline
    # (max(t_b/n + dp, t_b + dp/n)) must match the SimPy run within 5%.
    cluster = load_cluster("dgx-a100", nodes=8)
    plain = simulate(LLAMA70B, plan, cluster)
    hidden = simulate(LLAMA70B, plan, cluster, overlap_dp=True)
    assert hidden.step_time_s <= plain.step_time_s
    assert hidden.comm_s <= plain.comm_s
    est = estimate(LLAMA70B, plan, cluster, overlap_dp=True)
    assert est.step_time_s == pytest.approx(hidden.step_time_s, rel=0.05)


def test_overlapped_trace_has_bucket_events():
    cluster = load_cluster("dgx-a100", nodes=8)
    pred = simulate(LLAMA70B, PLANS[0], cluster, overlap_dp=True, trace=True)
    buckets = [e for e in pred.events if e[1] == "dp"]
    assert buckets and all(e[4] >= e[3] for e in buckets)


@pytest.mark.parametrize("pp,m,v", [(2, 2, 2), (4, 8, 2), (4, 4, 3), (8, 16, 4)])
def test_interleaved_bubble_shrinks_by_virtual_stages(pp, m, v):
    # Narayanan et al. 2021 §2.2.2: with v chunks per rank the bubble is (p - 1)/v of a
    # stage's micro-batch time, so bubble / step = (p - 1) / (v·m + p - 1) exactly.
    costs = [StageCosts(fwd_compute_s=1e-3, bwd_compute_s=2e-3)] * (pp * v)
    result = simulate_pipeline(costs, "interleaved-1f1b", m, virtual_stages=v)
    bubble = result.step_time_s - result.compute_s - result.comm_s
    assert bubble / result.step_time_s == pytest.approx((pp - 1) / (v * m + pp - 1), rel=1e-9)


@pytest.mark.parametrize("pp,m,v,stage", [(4, 8, 2, 0), (4, 8, 2, 3), (2, 4, 3, 1)])
def test_interleaved_order_runs_every_chunk_once_forward_first(pp, m, v, stage):
    order = schedule_order("interleaved-1f1b", pp, m, stage, virtual_stages=v)
    fwd = [(c, k) for kind, c, k in order if kind == "F"]
    bwd = [(c, k) for kind, c, k in order if kind == "B"]
    assert sorted(fwd) == sorted(bwd) == [(c, k) for c in range(v) for k in range(m)]
    assert all(order.index(("F", c, k)) < order.index(("B", c, k)) for c, k in fwd)


def test_interleaved_plan_beats_plain_1f1b_and_estimate_agrees():
    cluster = load_cluster("dgx-h100", nodes=8)
    plain = Plan(tp=8, pp=4, dp=2, micro_batch=1, global_batch=16)
    inter = plain.replace(schedule="interleaved-1f1b", virtual_stages=2)
    fast, slow = simulate(LLAMA70B, inter, cluster), simulate(LLAMA70B, plain, cluster)
    assert fast.step_time_s < slow.step_time_s and fast.bubble_s < slow.bubble_s
    assert estimate(LLAMA70B, inter, cluster).step_time_s == pytest.approx(fast.step_time_s,
                                                                            rel=0.05)


def test_trace_exports_to_chrome_format(tmp_path):
    from simulator.step.trace import write_chrome_trace
    pred = simulate(TINY, Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=4, dtype="fp32"),
                    load_cluster("localhost-cpu", ranks=2), trace=True)
    data = json.loads(write_chrome_trace(pred.events, tmp_path / "t.json").read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(pred.events)
    assert all(e["dur"] >= 0 for e in complete)
    assert all(e["ph"] in ("X", "M") for e in data["traceEvents"])

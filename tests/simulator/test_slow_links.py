"""Slow links: a NIC below line rate slows the DP group and the pipeline sends behind it, and
identical replicas are merged, so 2,048 replicas cost two pipelines."""

import dataclasses

import pytest

from planner.mesh import rank_of
from planner.presets import load_model
from planner.spec import Plan, PlanError
from simulator.failures.slow_links import link_slowdowns, replica_costs, slow_nic_cluster
from simulator.failures.stragglers import simulate_replicas
from simulator.network.cluster import load_cluster
from simulator.step.costs import StageCosts, stage_costs
from simulator.step.simulate import estimate, simulate


def test_a_slow_nic_caps_paths_that_leave_the_node_only():
    c = load_cluster("dgx-h100", nodes=2)
    slow = slow_nic_cluster(c, 2.0)
    assert slow.link(0, 1) == c.link(0, 1)  # NVLink, no NIC on the path
    assert slow.link(0, 8).bandwidth_Bps == c.nic_bandwidth_Bps / 2
    assert slow.link(0, 8).latency_s == c.link(0, 8).latency_s


@pytest.mark.parametrize("nodes", [2, 2048])
def test_the_gradient_reduction_waits_for_the_slow_group(nodes):
    # tp=8 inside each node, pp=1, dp = nodes: every DP group crosses every node. With one
    # NIC at 1/2 rate, that GPU's DP group reduces at the slow rate and every replica waits
    # for it; compute and TP traffic are unchanged. With no pipeline, the step is
    # m·(t_f + t_b + TP comm) + reduction + optimizer + gather (`estimate_pipeline`), so it
    # grows by exactly the slower reduction and gather (costed on the slowed cluster).
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=nodes)
    plan = Plan(tp=8, pp=1, dp=nodes, micro_batch=1, global_batch=nodes * 4, zero_stage=1)
    (c,) = stage_costs(model, plan, cluster)
    (s,) = stage_costs(model, plan, slow_nic_cluster(cluster, 2.0))
    assert s.dp_comm_s > c.dp_comm_s and s.fwd_compute_s == c.fwd_compute_s
    healthy = simulate(model, plan, cluster).step_time_s
    want = healthy + (s.dp_comm_s - c.dp_comm_s) + (s.dp_gather_s - c.dp_gather_s)
    device = rank_of(plan, dp=nodes - 1, tp=3)
    for predict in (simulate, estimate):
        got = predict(model, plan, cluster, slow_links={device: 2.0}).step_time_s
        assert got == pytest.approx(want, rel=1e-9)


def test_identical_replicas_are_merged():
    # 2,048 replicas, one of them behind a slow NIC: two distinct pipelines to simulate
    plan = Plan(tp=4, pp=2, dp=2048, micro_batch=1, global_batch=4096)
    cluster = load_cluster("dgx-h100", nodes=2048)
    device = rank_of(plan, pp=1, dp=1000, tp=2)
    links = link_slowdowns(plan, cluster, {device: 3.0})
    assert links == {(1000, 1): 3.0}
    costs = [StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, p2p_fwd_s=0.1, p2p_bwd_s=0.1)] * 2
    replicas, _ = replica_costs(costs, plan, {}, links, lambda f: costs)
    assert len(replicas) == 2


def test_sends_into_and_out_of_the_slow_stage_slow_down():
    # pp=2, one micro-batch, GPipe, t_f=1, t_b=2, activation send 0.5 s, gradient send 0.25
    # s, optimizer 0.4 s; stage 1 behind a NIC at half rate doubles both sends across its
    # boundary. By hand: F0 0-1, send 1.0, F1 2-3, B1 3-5, send 0.5, B0 5.5-7.5, optimizer
    # -> 7.9 (healthy: F1 1.5-2.5, B1 2.5-4.5, B0 4.75-6.75 -> 7.15).
    plan = Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=1, schedule="gpipe")
    stage = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, p2p_fwd_s=0.5, p2p_bwd_s=0.25,
                       optimizer_s=0.4)
    costs = [stage, stage]
    doubled = [dataclasses.replace(stage, p2p_fwd_s=1.0, p2p_bwd_s=0.5)] * 2
    healthy, _ = replica_costs(costs, plan, {}, {}, lambda f: doubled)
    slow, tail = replica_costs(costs, plan, {}, {(0, 1): 2.0}, lambda f: doubled)
    assert simulate_replicas(healthy, costs, plan).step_time_s == pytest.approx(7.15)
    assert simulate_replicas(slow, tail, plan).step_time_s == pytest.approx(7.9)


def test_bad_slow_links_name_the_value_and_the_fix():
    model, plan = load_model("tiny-gpt"), Plan(tp=1, pp=1, dp=2, micro_batch=1, global_batch=2)
    gpus = load_cluster("dgx-h100", nodes=1)
    with pytest.raises(PlanError, match=r"factor=0.5 on device 0 must be a finite number >= 1"):
        simulate(model, plan, gpus, slow_links={0: 0.5})
    with pytest.raises(PlanError, match=r"device=9 is not used by the plan: use a device in 0..1"):
        simulate(model, plan, gpus, slow_links={9: 2.0})
    with pytest.raises(PlanError, match="has no NICs"):
        simulate(model, plan.replace(dtype="fp32"), load_cluster("localhost-cpu", ranks=2),
                 slow_links={0: 2.0})

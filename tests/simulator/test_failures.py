"""Failures over a long run: the closed forms agree with a SimPy Monte Carlo; spares, stragglers."""

import pytest

from planner.spec import PlanError
from simulator.failures.goodput import (
    checkpoint_write_s,
    daly_interval_s,
    exact_goodput,
    expected_goodput,
    job_failure_rate_per_s,
    job_goodput,
)
from simulator.failures.montecarlo import (
    monte_carlo_goodput,
    predicted_run_goodput,
    straggler_step_time_s,
)

#: (checkpoint C s, restart R s, job MTBF M s): a 3 h, a 1.5 h and an 8 h MTBF cluster.
CASES = [(60.0, 600.0, 3 * 3600.0), (120.0, 300.0, 1.5 * 3600.0), (300.0, 900.0, 8 * 3600.0)]


@pytest.mark.parametrize("checkpoint_s, restart_s, mtbf_s", CASES)
def test_closed_forms_match_monte_carlo_within_two_percent(checkpoint_s, restart_s, mtbf_s):
    tau = daly_interval_s(checkpoint_s, mtbf_s)
    mc = monte_carlo_goodput(interval_s=tau, checkpoint_s=checkpoint_s, restart_s=restart_s,
                             mtbf_s=mtbf_s, horizon_s=3000 * mtbf_s, seed=7)
    assert mc.failures > 2500
    assert expected_goodput(tau, checkpoint_s, restart_s, mtbf_s) == pytest.approx(
        mc.goodput, rel=0.02)
    assert exact_goodput(tau, checkpoint_s, restart_s, mtbf_s) == pytest.approx(
        mc.goodput, rel=0.01)


def test_daly_interval_is_near_the_monte_carlo_optimum():
    c, r, m = 60.0, 600.0, 3 * 3600.0
    tau = daly_interval_s(c, m)
    runs = {f: monte_carlo_goodput(interval_s=f * tau, checkpoint_s=c, restart_s=r, mtbf_s=m,
                                   horizon_s=3000 * m, seed=3).goodput
            for f in (0.25, 1.0, 4.0)}
    assert runs[1.0] > runs[0.25] and runs[1.0] > runs[4.0]


def test_failure_rates_add_over_devices_nodes_and_links():
    # 1024 GPUs at 50,000 h, 128 nodes at 100,000 h, 1024 links at 200,000 h
    rate = job_failure_rate_per_s(num_devices=1024, device_mtbf_s=5e4 * 3600, num_nodes=128,
                                  node_mtbf_s=1e5 * 3600, num_links=1024,
                                  link_mtbf_s=2e5 * 3600)
    assert rate * 3600 == pytest.approx(1024 / 5e4 + 128 / 1e5 + 1024 / 2e5)


def test_checkpoint_time_is_state_over_bandwidth():
    assert checkpoint_write_s(840e9, 20e9) == pytest.approx(42.0)
    with pytest.raises(PlanError, match="storage_bandwidth_Bps=0 > 0"):
        checkpoint_write_s(1.0, 0)


def test_spares_shorten_node_failures():
    common = dict(interval_s=1000.0, checkpoint_s=60.0, restart_s=300.0, mtbf_s=3600.0,
                  horizon_s=1000 * 3600.0, node_failure_fraction=0.5, spare_delay_s=600.0,
                  repair_s=12 * 3600.0)
    none = monte_carlo_goodput(spares=0, **common)
    four = monte_carlo_goodput(spares=4, **common)
    assert four.goodput > none.goodput
    assert four.spare_waits < none.spare_waits == none.node_failures


def test_job_goodput_uses_daly_interval_and_the_checkpoint_write():
    g = job_goodput(tokens_per_s=1e6, num_devices=1024, device_mtbf_s=5e4 * 3600,
                    checkpoint_s=checkpoint_write_s(840e9, 20e9), restart_s=600.0)
    assert g.checkpoint_s == pytest.approx(42.0)
    assert g.interval_s == pytest.approx(daly_interval_s(42.0, g.mtbf_s))
    assert 0.8 < g.goodput < 1.0 and g.effective_tokens_per_s == pytest.approx(1e6 * g.goodput)


def test_straggler_stretches_the_critical_compute():
    assert straggler_step_time_s(2.0, 1.5, 2.0) == pytest.approx(3.5)
    assert straggler_step_time_s(2.0, 1.5, 1.0) == 2.0


def test_run_goodput_with_known_failures():
    # 10 steps of 1 s, checkpoints every 3 (0.1 s each), a kill at step 7 costing 5 s + 1 step
    g = predicted_run_goodput(step_time_s=1.0, steps=10, checkpoint_every=3,
                              checkpoint_blocking_s=0.1, restart_s=5.0, failure_steps=[7],
                              interrupted_fraction=1.0)
    assert g == pytest.approx(10 / (10 + 0.3 + 5 + 1))
    # killed at the start of step 8: steps 7 (done since the checkpoint at 6) is lost
    g = predicted_run_goodput(step_time_s=1.0, steps=10, checkpoint_every=3,
                              checkpoint_blocking_s=0.0, restart_s=5.0, failure_steps=[8],
                              interrupted_fraction=0.0)
    assert g == pytest.approx(10 / (10 + 5 + 1))


def test_simulated_straggler_slows_its_stage_pipeline_and_replica():
    from planner.presets import load_model
    from planner.spec import Plan
    from simulator.failures.montecarlo import simulate_straggler
    from simulator.network.cluster import load_cluster
    from simulator.step.simulate import simulate
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=4)
    flat = Plan(tp=4, pp=1, dp=8, micro_batch=1, global_batch=32)
    base = simulate(model, flat, cluster)
    # no pipeline: the whole compute stretches, as the closed form says
    assert simulate_straggler(model, flat, cluster, slow_factor=2.0).step_time_s == \
        pytest.approx(straggler_step_time_s(base.step_time_s, base.compute_s, 2.0))
    piped = Plan(tp=4, pp=4, dp=2, micro_batch=1, global_batch=32)
    base = simulate(model, piped, cluster)
    for stage in range(4):
        one = simulate_straggler(model, piped, cluster, slow_factor=2.0, stage=stage)
        # slower than healthy, faster than if every stage were slow (at most 2x)
        assert base.step_time_s < one.step_time_s < 2.0 * base.step_time_s
    with pytest.raises(PlanError, match="stage=4 must be in"):
        simulate_straggler(model, piped, cluster, slow_factor=2.0, stage=4)


def test_ample_spares_add_the_swap_delay_to_node_failure_restarts():
    # half the failures take a node; a spare is always there and takes 1200 s to swap in, so
    # the mean restart is 600 + 0.5 x 1200 = 1200 s; the exponential model at that restart is
    # within 1% of the Monte Carlo (about 3000 failures)
    mtbf, checkpoint = 3 * 3600.0, 60.0
    tau = daly_interval_s(checkpoint, mtbf)
    mc = monte_carlo_goodput(interval_s=tau, checkpoint_s=checkpoint, restart_s=600.0,
                             mtbf_s=mtbf, horizon_s=3000 * mtbf, node_failure_fraction=0.5,
                             spares=10**6, spare_delay_s=1200.0, repair_s=1.0)
    assert mc.spare_waits == 0
    assert mc.goodput == pytest.approx(exact_goodput(tau, checkpoint, 1200.0, mtbf), rel=0.01)
    # job_goodput's node share: 2 nodes at 1e5 s against 16 devices at 1e6 s -> 5/9
    g = job_goodput(tokens_per_s=1.0, num_devices=16, device_mtbf_s=1e6, checkpoint_s=1.0,
                    restart_s=300.0, node_mtbf_s=1e5, spare_delay_s=900.0)
    assert g.restart_s == pytest.approx(300.0 + 900.0 * 5 / 9)

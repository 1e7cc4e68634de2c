"""Goodput model: Young / Daly checkpoint intervals and expected goodput, by hand."""

import math

import pytest

from planner.spec import PlanError
from simulator.failures.goodput import (
    cluster_mtbf_s,
    daly_interval_s,
    expected_goodput,
    job_goodput,
    young_interval_s,
)


def test_cluster_mtbf_divides_device_mtbf_by_device_count():
    # 50,000 h per GPU over 16,384 GPUs: one failure every ~3.05 h
    assert cluster_mtbf_s(50_000 * 3600, 16_384) == pytest.approx(50_000 * 3600 / 16_384)


def test_young_interval_is_sqrt_two_c_m():
    # C = 2 min, M = 4 h: sqrt(2 * 120 * 14400) = sqrt(3,456,000) = 1859.03 s
    assert young_interval_s(120.0, 14_400.0) == pytest.approx(1859.0320, rel=1e-6)


def test_daly_interval_adds_higher_order_terms():
    # x = C / 2M = 120 / 28800 = 1/240; sqrt(2CM) (1 + sqrt(x)/3 + x/9) - C
    x = 1 / 240
    expected = math.sqrt(3_456_000) * (1 + math.sqrt(x) / 3 + x / 9) - 120
    assert daly_interval_s(120.0, 14_400.0) == pytest.approx(expected, rel=1e-12)
    assert daly_interval_s(120.0, 14_400.0) == pytest.approx(1779.8927, rel=1e-6)


def test_daly_interval_is_mtbf_when_checkpoint_outlasts_two_mtbf():
    assert daly_interval_s(100.0, 40.0) == 40.0


def test_expected_goodput_by_hand():
    # tau 1 h, C 1 min, R 10 min, M 10 h: 3600/3660 * (1 - (600 + 1830)/36000) = 0.917213
    assert expected_goodput(3600.0, 60.0, 600.0, 36_000.0) == pytest.approx(0.9172131, rel=1e-6)


def test_no_failures_leaves_only_checkpoint_cost():
    assert expected_goodput(900.0, 100.0, 0.0, 1e30) == pytest.approx(0.9)


def test_goodput_is_zero_when_failures_outpace_progress():
    assert expected_goodput(3600.0, 60.0, 600.0, 1000.0) == 0.0


def test_daly_interval_beats_nearby_intervals():
    best = daly_interval_s(120.0, 14_400.0)
    at_best = expected_goodput(best, 120.0, 300.0, 14_400.0)
    for scale in (0.5, 0.8, 1.25, 2.0):
        assert expected_goodput(best * scale, 120.0, 300.0, 14_400.0) < at_best


def test_job_goodput_defaults_to_daly_and_scales_tokens():
    g = job_goodput(tokens_per_s=2e6, num_devices=1000, device_mtbf_s=3.6e6,
                    checkpoint_s=50.0, restart_s=0.0)
    assert g.mtbf_s == 3600.0
    assert g.interval_s == g.daly_interval_s
    assert g.goodput == g.optimal_goodput
    assert g.effective_tokens_per_s == pytest.approx(2e6 * g.goodput)


def test_bad_input_names_the_field():
    with pytest.raises(PlanError, match="checkpoint_s=0"):
        young_interval_s(0, 100.0)
    with pytest.raises(PlanError, match="restart_s=-1"):
        expected_goodput(10.0, 1.0, -1, 100.0)

"""Health telemetry: per-rank compute times in every record, and the straggler detector."""

from __future__ import annotations

import json

import pytest

from runtime.health import (
    STRAGGLER_THRESHOLD,
    StragglerDetector,
    compute_time_medians,
    relative_scores,
    straggler_flags_error,
)
from runtime.launch import run_plan


class TestRelativeScores:
    def test_a_rank_three_times_slower_scores_a_third(self):
        # peers' median 0.1 s over the rank's 0.3 s (hand calculation)
        assert relative_scores([0.1, 0.3, 0.1, 0.1])[1] == pytest.approx(1 / 3)

    def test_faster_ranks_score_one(self):
        assert relative_scores([0.1, 0.3, 0.1, 0.1])[0] == 1.0

    def test_one_rank_alone_scores_one(self):
        assert relative_scores([0.5]) == [1.0]


class TestStragglerDetector:
    def test_a_rank_is_confirmed_after_window_slow_steps(self):
        detector = StragglerDetector(threshold=0.7, window=3)
        seen = [detector.observe(step, [0.1, 0.3]) for step in (1, 2, 3, 4)]
        # steps 1 and 2 are slow but not yet a window; step 3 completes it; once per run
        assert [len(x) for x in seen] == [0, 0, 1, 0]
        assert seen[2][0]["rank"] == 1 and seen[2][0]["first_step"] == 1
        assert seen[2][0]["score"] == pytest.approx(0.1 / 0.3)

    def test_a_fast_step_resets_the_window(self):
        detector = StragglerDetector(threshold=0.7, window=3)
        times = [[0.1, 0.3], [0.1, 0.3], [0.1, 0.1], [0.1, 0.3], [0.1, 0.3]]
        assert not any(detector.observe(k + 1, t) for k, t in enumerate(times))

    def test_a_rank_at_the_threshold_is_healthy(self):
        # 0.1 / 0.1375 = 0.727 >= 0.7: not slow
        detector = StragglerDetector(threshold=0.7, window=1)
        assert detector.observe(1, [0.1, 0.1375]) == []

    def test_default_threshold_is_nvidia_resiliency_exts(self):
        # gpu_relative_perf_threshold=0.7 in nvidia-resiliency-ext's straggler callback
        assert STRAGGLER_THRESHOLD == 0.7


def test_flag_errors_name_the_flag():
    assert "--straggler-threshold=1.5" in straggler_flags_error(1.5, 5, "warn")
    assert "--straggler-window=0" in straggler_flags_error(0.7, 0, "warn")
    assert straggler_flags_error(0.7, 5, "evict") is None


def test_compute_time_medians_skip_the_first_step():
    records = [{"compute_time_s": [9.0, 9.0]}, {"compute_time_s": [1.0, 3.0]},
               {"compute_time_s": [2.0, 4.0]}, {"compute_time_s": [3.0, 5.0]}]
    assert compute_time_medians(records) == [2.0, 4.0]


def test_a_slow_rank_is_named_in_the_log_and_the_summary(write_plan, tiny_plan, tiny_model,
                                                         tmp_path, capsys):
    plan_path = write_plan("health-dp2", tiny_plan(dp=2), tiny_model(num_layers=2))
    summary = run_plan(plan_path, steps=8, out_dir=tmp_path, timeout_s=150,
                       inject=["slow:rank=1,factor=3"], straggler_window=4)
    log = capsys.readouterr().out
    assert "meshplan straggler: rank 1 computes" in log
    assert [s["rank"] for s in summary["stragglers"]] == [1]
    # rank 1 sleeps 2x its compute each step, so its median is about 3x rank 0's
    assert summary["compute_time_s"][1] > 2 * summary["compute_time_s"][0]
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert len(first["compute_time_s"]) == 2

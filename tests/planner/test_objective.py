"""Ranking plans by goodput: more devices fail more often; sharded checkpoints write faster."""

import pandas as pd
import pytest

from planner.objective import checkpoint_writers, hours_to_s, rank_by_goodput
from planner.presets import load_model
from planner.search import SearchResult
from planner.spec import Plan


def make_result(rows: list[tuple[Plan, float]], *, step_s: float = 1.0,
                compute_s: float = 0.8) -> SearchResult:
    """A search result of ``(plan, tokens/s)`` rows, each with the same step and critical
    compute time (s)."""
    ranked = pd.DataFrame([{"id": p.id, "tokens_per_s": t, "peak_memory_bytes": 1.0,
                            "step_time_s": step_s, "compute_s": compute_s} for p, t in rows])
    return SearchResult(ranked=ranked, rejected=pd.DataFrame(), plans={p.id: p for p, _ in rows},
                        predictions={})


def test_goodput_ranking_prefers_fewer_failures_at_equal_speed():
    model = load_model("tiny-gpt")
    small = Plan(tp=1, pp=1, dp=8, micro_batch=1, global_batch=64, dtype="bf16")
    large = Plan(tp=1, pp=1, dp=64, micro_batch=1, global_batch=64, dtype="bf16")
    result = rank_by_goodput(make_result([(large, 1.01e6), (small, 1.0e6)]), model,
                             device_mtbf_s=hours_to_s(100.0), restart_s=600.0)
    assert list(result.ranked["id"]) == [small.id, large.id]
    assert result.ranked["goodput"].iloc[0] > result.ranked["goodput"].iloc[1]
    assert result.best == small


def test_zero_shards_write_from_every_rank():
    assert checkpoint_writers(Plan(tp=2, pp=2, dp=4, micro_batch=1, global_batch=8)) == 4
    assert checkpoint_writers(Plan(tp=2, pp=2, dp=4, micro_batch=1, global_batch=8,
                                   zero_stage=3)) == 16


def test_mtbf_hours_must_be_positive():
    with pytest.raises(ValueError, match="--mtbf-hours=0 must be a positive, finite number"):
        hours_to_s(0)

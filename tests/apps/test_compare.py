"""`compare` machinery on this machine: plans, runs and lines up predicted vs measured.

The reduced sweep (three plans, three steps) checks the machinery, not the error bound (the
machines are shared and noisy); `meshplan compare --sweep` measures the bound.
"""

import json

import pytest

from apps.compare import compare, plan_indices, summarize_rows, sweep_plans
from apps.compare_plans import REDUCED_PLANS, SWEEP
from planner.spec import PlanError


def test_sweep_covers_every_parallelism_and_feature():
    plans = sweep_plans()
    assert len(plans) >= 10
    assert {p.world_size for _, p in plans} == {1, 2, 4}
    assert {m.name for m, _ in plans} == {"tiny-gpt", "tiny-gpt-wide"}
    kinds = {(p.tp > 1, p.pp > 1, p.dp > 1) for _, p in plans}
    # DP, TP, PP alone, and the pairs TP x DP, TP x PP and PP x DP
    assert {(False, False, True), (True, False, False), (False, True, False),
            (True, False, True), (True, True, False), (False, True, True)} <= kinds
    # PP x DDP with as many micro-batches as stages (it used to crash DDP's bucket rebuild)
    assert any(p.pp == 2 and p.dp == 2 and p.num_microbatches == 2 for _, p in plans)
    assert {p.recompute for _, p in plans} == {"none", "full"}
    assert any(p.zero_stage == 3 for _, p in plans)
    assert any(p.cp == 2 for _, p in plans)                # ring attention
    assert len({p.num_microbatches for _, p in plans}) >= 3
    assert len(SWEEP) == len(plans)


def test_plans_are_picked_by_id_in_sweep_order():
    assert plan_indices(["tp1-pp1-dp2-mb4-gb8", "tp1-pp1-dp1-mb8-gb8"]) == (0, 3)
    with pytest.raises(PlanError, match="not in the compare sweep: tp9.*choose from"):
        plan_indices(["tp9"])


def test_summary_reports_mape_worst_spearman_and_best_plan():
    rows = [{"id": i, "model": "m", "predicted_step_time_s": p, "measured_step_time_s": m,
             "rel_error": (p - m) / m} for i, p, m in
            [("a", 0.10, 0.10), ("b", 0.22, 0.20), ("c", 0.25, 0.30)]]
    result = summarize_rows(rows)
    assert result["mape"] == pytest.approx((0 + 0.1 + 1 / 6) / 3)
    assert result["worst"]["id"] == "c"
    assert result["spearman"] == pytest.approx(1.0)
    assert result["best_plan_match"] and result["predicted_best"] == "a"


def test_compare_runs_the_reduced_sweep_and_reports_errors(tmp_path):
    result = compare(steps=3, out_dir=tmp_path, plans=REDUCED_PLANS)
    rows = result["rows"]
    assert [r["id"] for r in rows] == [p.id for _, p in sweep_plans(REDUCED_PLANS)]
    for row in rows:
        # rel_error is defined as (predicted - measured) / measured of the step time
        assert row["rel_error"] == pytest.approx(
            (row["predicted_step_time_s"] - row["measured_step_time_s"])
            / row["measured_step_time_s"])
        assert row["measured_step_time_s"] > 0 and row["predicted_step_time_s"] > 0
        assert {"profile", "threads_per_rank", "ranks_per_core"} <= set(row["assumptions"])
        # every run records the prediction it was launched with, and its error
        summary = json.loads((tmp_path / row["id"] / "summary.json").read_text())
        assert summary["prediction"]["step_time_s"] == pytest.approx(
            row["predicted_step_time_s"])
        assert summary["prediction_error"] == pytest.approx(row["rel_error"])
    # every split trains the same model on the same data: identical losses (fp32)
    assert len({round(r["final_loss"], 3) for r in rows}) == 1
    assert result["mape"] == pytest.approx(sum(abs(r["rel_error"]) for r in rows) / len(rows))
    assert -1.0 <= result["spearman"] <= 1.0 and isinstance(result["best_plan_match"], bool)
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["rows"] == rows
    assert (tmp_path / "compare.png").stat().st_size > 1000

"""`compare` machinery on this machine: plans, runs and lines up predicted vs measured.

It checks the machinery, not the error bound (the machines are shared and noisy).
"""

import json

import pytest

from apps.compare import COMPARE_SPLITS, compare


def test_compare_runs_every_split_and_reports_errors(tmp_path):
    result = compare(steps=2, out_dir=tmp_path)
    rows = result["rows"]
    expected = [(tp, pp, dp) for splits in COMPARE_SPLITS.values() for tp, pp, dp in splits]
    assert [(r["id"].split("-")[0], r["id"].split("-")[1], r["id"].split("-")[2])
            for r in rows] == [(f"tp{tp}", f"pp{pp}", f"dp{dp}") for tp, pp, dp in expected]
    for row in rows:
        # rel_error is defined as (predicted - measured) / measured of the step time
        assert row["rel_error"] == pytest.approx(
            (row["predicted_step_time_s"] - row["measured_step_time_s"])
            / row["measured_step_time_s"])
        assert row["measured_step_time_s"] > 0 and row["predicted_step_time_s"] > 0
    # every split trains the same model on the same data: identical losses (fp32)
    losses = {round(r["final_loss"], 3) for r in rows}
    assert len(losses) == 1
    assert result["mape"] == pytest.approx(sum(abs(r["rel_error"]) for r in rows) / len(rows))
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["rows"] == rows
    assert (tmp_path / "compare.png").stat().st_size > 1000
    for row in rows:
        assert (tmp_path / row["id"] / "metrics.jsonl").is_file()

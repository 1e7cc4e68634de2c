"""`meshplan simulate PLAN --trace FILE`: a Chrome trace Perfetto opens."""

import json

import pytest

from apps.cli import main
from planner.planfile import ClusterRef, PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan


def test_simulate_writes_a_chrome_trace_with_one_track_per_stage_and_stream(tmp_path, capsys):
    plan = Plan(tp=2, pp=4, dp=1, micro_batch=1, global_batch=8, schedule="interleaved-1f1b",
                virtual_stages=2)
    path = write_plan_file(tmp_path / "plan.yaml", PlanFile(
        model=load_model("llama3-8b"), plan=plan, prediction={},
        cluster=ClusterRef(name="dgx-h100", nodes=1)))
    trace = tmp_path / "trace.json"
    assert main(["simulate", str(path), "--trace", str(trace), "--json"]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert complete and all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert {e["pid"] for e in complete} == {0, 1, 2, 3}
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "comm", "p2p"} <= tracks
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
        "stage 0", "stage 1", "stage 2", "stage 3"}
    # Micro-seconds: the last event ends at the predicted step time.
    predicted_s = json.loads(capsys.readouterr().out)["step_time_s"]
    end_us = max(e["ts"] + e["dur"] for e in complete)
    assert end_us == pytest.approx(predicted_s * 1e6, rel=1e-9)

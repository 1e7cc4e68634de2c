"""The explorer's view helpers: inputs to library objects, library results to tables/charts."""

import json

import pytest
import yaml

from apps import app_views as views
from planner.planfile import PlanFile, read_plan_file
from planner.presets import PRESET_DIR as MODEL_PRESETS
from planner.presets import load_model
from planner.spec import Plan, PlanError
from simulator.network.cluster import PRESET_DIR, load_cluster
from simulator.step.simulate import simulate
from simulator.step.trace import chrome_trace


@pytest.fixture(scope="module")
def traced():
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=2)
    plan = Plan(tp=2, pp=2, dp=4, micro_batch=1, global_batch=64, recompute="selective")
    return model, cluster, plan, simulate(model, plan, cluster, trace=True)


def test_uploaded_model_yaml_builds_the_spec():
    fields = yaml.safe_load((MODEL_PRESETS / "models.yaml").read_text())["tiny-gpt"]
    text = yaml.safe_dump({"name": "mine", **fields})
    model = views.model_from_inputs("upload", preset="llama3-8b", uploaded=text, seq_len=64)
    assert model.name == "mine" and model.seq_len == 64
    assert model.num_layers == load_model("tiny-gpt").num_layers


def test_uploaded_model_errors_name_the_problem():
    with pytest.raises(PlanError, match="not valid YAML"):
        views.model_from_inputs("upload", preset="llama3-8b", uploaded="a: [1,")
    with pytest.raises(PlanError, match="holds a YAML list, not a mapping"):
        views.model_from_inputs("upload", preset="llama3-8b", uploaded="- 1\n- 2\n")
    with pytest.raises(PlanError, match="unknown model field"):
        views.model_from_inputs("upload", preset="llama3-8b", uploaded="layers: 4\n")
    with pytest.raises(PlanError, match="choose a model YAML"):
        views.model_from_inputs("upload", preset="llama3-8b", uploaded=None)


def test_custom_fields_override_the_preset():
    model = views.model_from_inputs("custom", preset="llama3-8b", custom={"num_layers": 16})
    assert model.num_layers == 16 and model.name == "llama3-8b-custom"


def test_uploaded_cluster_yaml_is_loaded_like_a_preset_file():
    spec = yaml.safe_load((PRESET_DIR / "clusters.yaml").read_text())["dgx-h100"]
    cluster = views.cluster_from_inputs("upload", preset="dgx-h100", nodes=3,
                                        uploaded=yaml.safe_dump(spec))
    assert cluster.name == "uploaded" and cluster.num_devices == 24


def test_uploaded_cluster_keeps_its_own_name_and_node_count():
    # a 4-node DGX H100 file: 4 servers x 8 GPUs = 32 devices (the preset's 8 per node)
    spec = yaml.safe_load((PRESET_DIR / "clusters.yaml").read_text())["dgx-h100"]
    text = yaml.safe_dump({**spec, "nodes": 4})
    cluster = views.cluster_from_inputs("upload", preset="dgx-h100", nodes=None,
                                        uploaded=text, uploaded_name="my-pod.yaml")
    assert cluster.name == "my-pod" and cluster.num_nodes == 4 and cluster.num_devices == 32
    # a size typed in the sidebar still overrides the file's
    assert views.cluster_from_inputs("upload", preset="dgx-h100", nodes=2, uploaded=text,
                                     uploaded_name="my-pod.yaml").num_devices == 16


def test_step_breakdown_adds_up_to_the_step(traced):
    *_, plan, pred = traced
    parts = views.step_breakdown(pred, plan).set_index("part")["seconds"]
    assert parts.sum() == pytest.approx(pred.step_time_s, rel=1e-9)
    assert parts["compute"] == pred.compute_s and parts["pipeline bubble"] == pred.bubble_s
    assert parts.drop(["compute", "pipeline bubble"]).sum() == pytest.approx(pred.comm_s)
    assert "tensor-parallel all-reduce" in parts      # tp = 2 without sequence parallelism


def test_step_breakdown_names_only_the_collectives_the_plan_has():
    # tp = 1 under ZeRO-3: the in-layer events are the per-layer weight gathers and gradient
    # reduce-scatters, not a tensor-parallel all-reduce
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=2)
    plan = Plan(tp=1, pp=1, dp=16, micro_batch=1, global_batch=64, zero_stage=3)
    pred = simulate(model, plan, cluster, trace=True)
    parts = views.step_breakdown(pred, plan)["part"].tolist()
    assert "ZeRO-3 weight gather / gradient reduce-scatter" in parts
    assert not any("tensor-parallel" in p for p in parts)


def test_memory_frame_has_every_part_of_every_stage(traced):
    *_, pred = traced
    frame = views.memory_frame(pred)
    assert len(frame) == 5 * len(pred.memory)
    total = frame[frame.stage == 0]["GiB"].sum() * views.GiB
    assert total == pytest.approx(pred.memory[0].total_bytes)


def test_gantt_frame_has_one_row_per_event_up_to_the_limit(traced):
    *_, pred = traced
    frame = views.gantt_frame(pred.events)
    assert len(frame) == len(pred.events)
    assert set(frame["stage"]) == {0, 1}
    assert {"forward", "backward"} <= set(frame["kind"])
    assert len(views.gantt_frame(pred.events, limit=5)) == 5
    spec = views.gantt_chart(frame).to_dict()
    assert spec["mark"]["type"] == "bar"
    # zoom and pan bind the time (x) scale only: every lane stays labelled
    zoom = [p for p in spec["params"] if p.get("bind") == "scales"]
    assert len(zoom) == 1 and zoom[0]["select"]["encodings"] == ["x"]
    axis = spec["encoding"]["y"]["axis"]
    assert axis["labelOverlap"] is False and axis["labelLimit"] == 0


def test_memory_chart_draws_the_usable_limit(traced):
    _, cluster, _, pred = traced
    # H100 SXM: 80 GB = 80e9 B = 74.5 GiB; 0.9 of it usable = 67.1 GiB
    limits = views.memory_limits(cluster.device.memory_bytes, 0.9).set_index("limit")["GiB"]
    assert limits["device memory"] == pytest.approx(80e9 / 2**30)
    assert limits["usable limit"] == pytest.approx(0.9 * 80e9 / 2**30)
    spec = views.memory_chart(pred, cluster.device.memory_bytes, 0.9).to_dict()
    rules = [layer for layer in spec["layer"] if layer["mark"]["type"] == "rule"]
    assert len(rules) == 1
    data = spec["datasets"][rules[0]["data"]["name"]]
    assert sorted(row["GiB"] for row in data) == pytest.approx(sorted(limits))


def test_cluster_figure_draws_every_device(traced):
    _, cluster, plan, _ = traced
    fig = views.cluster_figure(cluster, plan)
    assert plan.id in fig.axes[0].get_title()


def test_plan_file_download_reads_back(traced, tmp_path):
    model, cluster, plan, pred = traced
    path = tmp_path / "plan.yaml"
    path.write_text(views.plan_file_yaml(model, plan, cluster, pred))
    pf = read_plan_file(path)
    assert isinstance(pf, PlanFile) and pf.plan == plan and pf.model == model
    assert pf.prediction["step_time_s"] == pytest.approx(pred.step_time_s)
    assert json.loads(json.dumps(chrome_trace(pred.events)))["traceEvents"]


def test_measured_results_read_compare_and_run_summaries(tmp_path):
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "compare.json").write_text(json.dumps({"rows": [
        {"id": "a", "predicted_step_time_s": 1.0, "measured_step_time_s": 2.0}]}))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps(
        {"plan_id": "b", "step_time_s": 0.5, "prediction": {"step_time_s": 0.6}}))
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "summary.json").write_text(json.dumps({"step_time_s": 1.0}))
    df = views.measured_results(tmp_path).set_index("id")
    assert sorted(df.index) == ["a", "b"]
    assert df.loc["a", "rel_error"] == pytest.approx(-0.5)
    assert df.loc["b", "rel_error"] == pytest.approx(0.2)
    assert views.measured_results(tmp_path / "missing").empty


def test_launch_files_one_line_per_node_and_a_batch_script(traced):
    model, cluster, plan, pred = traced
    files = views.launch_files(model, plan, cluster, pred, "p.yaml")
    assert files["command"].count("torch.distributed.run") == 2
    assert "--node-rank 1 --nproc-per-node 8" in files["command"]
    assert "runtime.train p.yaml" in files["command"]
    assert "#SBATCH --nodes=2" in files["sbatch"] and "p.yaml" in files["sbatch"]


def test_launch_files_on_one_machine_is_one_torchrun_line():
    model, cluster = load_model("tiny-gpt"), load_cluster("localhost-cpu", ranks=2)
    plan = Plan(tp=1, pp=1, dp=2, micro_batch=1, global_batch=8, dtype="fp32")
    files = views.launch_files(model, plan, cluster, simulate(model, plan, cluster), "p.yaml")
    assert files["sbatch"] == ""
    assert files["command"].startswith("python -m torch.distributed.run --nproc-per-node 2")


def test_launch_files_of_a_context_parallel_plan_give_its_command():
    # cp runs (ring attention): one torchrun line for its 2 ranks
    model, cluster = load_model("tiny-gpt"), load_cluster("localhost-cpu", ranks=2)
    plan = Plan(tp=1, cp=2, pp=1, dp=1, micro_batch=1, global_batch=8, dtype="fp32")
    files = views.launch_files(model, plan, cluster, simulate(model, plan, cluster), "p.yaml")
    assert files["command"].startswith("python -m torch.distributed.run --nproc-per-node 2")
    assert files["sbatch"] == ""


def test_timeline_draws_the_overlapped_zero3_traffic():
    # ZeRO-3 on 16 H100s: each block's weights are all-gathered in the forward (gathered
    # again and the gradients reduce-scattered in the backward) beside the compute. The
    # timeline shows that traffic: the hidden part on the overlap lane, the rest exposed on
    # the comm lane, adding up to the layers' whole gather (32 blocks x one block's gather).
    from simulator.step.costs import _zero3_layer_comm
    from simulator.step.stagecosts import SimOptions
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=2)
    plan = Plan(tp=1, pp=1, dp=16, micro_batch=1, global_batch=64, zero_stage=3)
    pred = simulate(model, plan, cluster, trace=True)
    frame = views.gantt_frame(pred.events)
    hidden = frame[frame["kind"] == "overlapped comm (hidden)"]
    assert set(hidden["lane"]) == {"stage 0 · overlap"}
    assert len(hidden) == 2 * plan.num_microbatches  # one per forward and backward
    gather, gather_scatter = _zero3_layer_comm(model, plan, cluster, 0, SimOptions())
    ms = (frame["end_ms"] - frame["start_ms"]).groupby(frame["name"]).sum()
    assert ms["overlap-F0"] + ms["tp-F0"] == pytest.approx(
        model.num_layers * gather * 1e3, rel=1e-9)
    assert ms["overlap-B0"] + ms["tp-B0"] == pytest.approx(
        model.num_layers * gather_scatter * 1e3, rel=1e-9)
    # hidden under the pass it overlaps, and not counted in the step
    assert ms["overlap-F0"] < ms["F0"] and ms["overlap-B0"] < ms["B0"]
    assert pred.step_time_s == pytest.approx(simulate(model, plan, cluster).step_time_s)


def test_the_expert_all_to_all_is_named_in_layer_comm():
    # tp = cp = 1, no ZeRO-3: at ep = 1 nothing runs on the in-layer events; at ep = 8 the
    # MoE layers' dispatch / combine all-to-all does (simulator.step.costs adds the exposed
    # part to the block's comm), so the label names expert parallelism
    from simulator.step.breakdown import IN_LAYER, comm_by_kind_s
    model, cluster = load_model("mixtral-8x7b"), load_cluster("dgx-h100", nodes=2)
    kinds = {}
    for ep in (1, 8):
        plan = Plan(tp=1, pp=1, dp=16, ep=ep, micro_batch=1, global_batch=16)
        pred = simulate(model, plan, cluster, trace=True)
        kinds[ep] = (comm_by_kind_s(pred.events), views.step_breakdown(pred, plan))
    assert IN_LAYER not in kinds[1][0] and kinds[8][0][IN_LAYER] > 0
    assert "ep" in IN_LAYER.split()[-1].split("/")
    parts = kinds[8][1].set_index("part")["seconds"]
    assert parts["expert-parallel all-to-all"] == pytest.approx(kinds[8][0][IN_LAYER])

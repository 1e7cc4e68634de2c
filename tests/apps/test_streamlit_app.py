"""The Streamlit explorer, driven headless by `streamlit.testing.v1.AppTest`.

Every test starts from the defaults (Llama 3 8B on 2 DGX H100 nodes, global batch 64), changes
widgets by their keys, and checks what the page shows against the library calls it wraps.
"""

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from planner.presets import load_model  # noqa: E402
from planner.search import search  # noqa: E402
from simulator.network.cluster import load_cluster  # noqa: E402
from simulator.step.simulate import simulate  # noqa: E402

APP = str(Path(__file__).resolve().parents[2] / "apps" / "streamlit_app.py")


@pytest.fixture(scope="module")
def reference():
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", nodes=2)
    # the app's defaults
    return model, cluster, search(model, cluster, global_batch=64, top_k=20,
                                  micro_batches=(1, 2, 4, 8))


def _app(**widgets) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    for key, value in widgets.items():
        at.session_state[key] = value
    if widgets:
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def _ms(text: str) -> float:
    return float(text.replace(",", "").removesuffix(" ms"))


def test_default_page_ranks_plans_like_the_library(reference):
    _, _, result = reference
    at = _app()
    assert not at.error
    best = at.table[0].value
    assert best.index[0] == result.best.id
    assert at.selectbox(key="plan_id").value == result.best.id
    assert "tabs" not in [e.value for e in at.error]


def test_filter_and_sort_the_ranked_table():
    at = _app(filter_tp=[2], sort_by="step time")
    table = next(df.value for df in at.dataframe if "plan" in df.value.columns)
    assert len(table) > 0 and set(table["tp"]) == {2}
    assert list(table["step time (ms)"]) == sorted(table["step time (ms)"])
    assert set(at.selectbox(key="plan_id").options) == set(table["plan"])


def test_rejected_plans_carry_their_reasons(reference):
    _, _, result = reference
    at = _app()
    rejected = next(df.value for df in at.dataframe if "reason" in df.value.columns)
    assert len(rejected) == len(result.rejected)
    assert rejected["reason"].str.startswith("out of memory").any()


def test_selected_plan_breakdown_matches_simulate(reference):
    model, cluster, result = reference
    plan_id = result.ranked["id"].iloc[3]
    at = _app(plan_id=plan_id)
    pred = simulate(model, result.plans[plan_id], cluster)
    assert _ms(_metric(at, "step time")) == pytest.approx(pred.step_time_s * 1e3, abs=0.1)
    assert _metric(at, "MFU") == f"{100 * pred.mfu:.1f}%"
    assert _metric(at, "HFU") == f"{100 * pred.hfu:.1f}%"
    parts = next(df.value for df in at.dataframe if "part" in df.value.columns)
    assert {"compute", "pipeline bubble"} <= set(parts["part"])
    # compute + exposed communication by kind + bubble add up to the step
    assert parts["ms"].sum() == pytest.approx(pred.step_time_s * 1e3, rel=1e-3)


def test_what_if_slower_links_and_failures(reference):
    _, _, result = reference
    # a tensor-parallel plan: its all-reduces sit on the critical path
    plan_id = next(i for i in result.ranked["id"] if result.plans[i].tp > 1)
    base = _app(plan_id=plan_id)
    base_step = _ms(_metric(base, "step time"))
    at = _app(plan_id=plan_id, whatif_bandwidth=0.25, device_mtbf_h=500.0)
    steps = [_ms(m.value) for m in at.metric if m.label == "step time"]
    assert steps[0] == pytest.approx(base_step)  # the breakdown tab keeps the plan's own
    assert steps[1] > steps[0]  # a quarter of the link bandwidth costs time
    assert float(_metric(at, "goodput").rstrip("%")) < float(_metric(base, "goodput").rstrip("%"))
    assert _metric(at, "cluster MTBF") == "31.25 h"  # 500 h / 16 GPUs


def test_predicted_vs_measured_reads_a_results_folder(tmp_path):
    rows = [{"id": "tp1-pp1-dp2-mb1-gb8", "world_size": 2, "predicted_step_time_s": 0.10,
             "measured_step_time_s": 0.125, "rel_error": -0.2}]
    (tmp_path / "compare.json").write_text(json.dumps({"rows": rows, "mape": 0.2}))
    at = _app(results_dir=str(tmp_path))
    measured = next(df.value for df in at.dataframe if "measured_step_time (ms)" in df.value)
    assert measured["id"].tolist() == ["tp1-pp1-dp2-mb1-gb8"]
    # the chart's unit: 0.125 s = 125 ms; (0.10 - 0.125) / 0.125 = -20 %
    assert measured["measured_step_time (ms)"].iloc[0] == pytest.approx(125.0)
    assert measured["error (%)"].iloc[0] == pytest.approx(-20.0)
    assert _metric(at, "MAPE") == "20.0%"


def test_measured_tab_lists_a_compare_run_once_with_the_mape(tmp_path):
    # `meshplan compare` writes compare.json and, per row, <id>/summary.json with the plan's
    # prediction: the same run twice unless the tab matches them up
    rows = [{"id": "a", "predicted_step_time_s": 0.10, "measured_step_time_s": 0.125},
            {"id": "b", "predicted_step_time_s": 0.33, "measured_step_time_s": 0.30}]
    (tmp_path / "compare.json").write_text(json.dumps({"rows": rows}))
    for row in rows:
        (tmp_path / row["id"]).mkdir()
        (tmp_path / row["id"] / "summary.json").write_text(json.dumps(
            {"plan_id": row["id"], "step_time_s": row["measured_step_time_s"],
             "prediction": {"step_time_s": row["predicted_step_time_s"]}}))
    (tmp_path / "solo").mkdir()  # a `meshplan run` of its own
    (tmp_path / "solo" / "summary.json").write_text(json.dumps(
        {"plan_id": "c", "step_time_s": 1.0, "prediction": {"step_time_s": 1.0}}))
    at = _app(results_dir=str(tmp_path))
    measured = next(df.value for df in at.dataframe if "measured_step_time (ms)" in df.value)
    assert sorted(measured["id"]) == ["a", "b", "c"]
    # |-0.025/0.125| = 20 %, |0.03/0.30| = 10 %, 0 %: MAPE (20 + 10 + 0) / 3 = 10.0 %
    assert _metric(at, "MAPE") == "10.0%" and _metric(at, "runs") == "3"


def test_empty_results_folder_says_how_to_make_one(tmp_path):
    at = _app(results_dir=str(tmp_path))
    assert any("meshplan compare" in i.value for i in at.info)


def test_downloads_offer_the_launch_command(reference):
    _, _, result = reference
    at = _app()
    command = at.code[0].value
    assert "torch.distributed.run" in command and f"{result.best.id}.yaml" in command
    # the search fills both nodes (all devices by default): one torchrun line per node
    assert result.best.world_size == 16
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 8" in command


def test_plan_that_does_not_fit_shows_the_reason():
    at = _app(use_custom_plan=True, plan_tp=1, plan_pp=1, plan_dp=16, plan_micro_batch=4,
              plan_recompute="none")
    assert len(at.error) == 1
    assert "tp1-pp1-dp16-mb4-gb64 does not fit: out of memory: stage 0 needs" in \
        at.error[0].value
    assert "GiB" in at.error[0].value


def test_illegal_custom_plan_names_the_arithmetic():
    at = _app(use_custom_plan=True, plan_tp=2, plan_pp=2, plan_dp=2)
    assert "tp*pp*dp = 2*2*2 = 8 != world_size(16)" in at.error[0].value


def test_custom_model_with_bad_heads_shows_the_fix():
    at = _app(model_source="custom")
    at.number_input(key="custom_num_heads").set_value(33).run()
    assert not at.exception
    assert "hidden=4096 is not divisible by num_heads=33" in at.error[0].value


def test_no_legal_plan_lists_the_commonest_reasons():
    at = _app(model_preset="llama3-405b")  # 405B on 16 GPUs: nothing fits
    assert at.error and at.error[0].value.startswith("no legal plan:")
    # the heaviest stage is named: with one layer fewer on the edge stages (126 layers on
    # pp=4: 31, 32, 32, 31) it is a middle one
    assert re.search(r"out of memory: stage \d+ needs", at.error[0].value)
    assert at.warning and at.warning[0].value.startswith("no plan fits:")
    # the closest plans in GiB, not bytes: each needs more than the usable 76e9 B = 70.8 GiB
    closest = next(df.value for df in at.dataframe if "usable (GiB)" in df.value)
    assert not [c for c in closest.columns if c.endswith("_bytes")]
    assert closest["usable (GiB)"].iloc[0] == pytest.approx(0.95 * 80e9 / 2**30, abs=0.01)
    assert (closest["peak_memory (GiB)"] > closest["usable (GiB)"]).all()


def test_localhost_cluster_uses_ranks():
    at = _app(model_preset="tiny-gpt", cluster_preset="localhost-cpu", ranks=2,
              global_batch=8)
    assert not at.error
    # the library's own search on the same two ranks (the app's default search options)
    want = search(load_model("tiny-gpt"), load_cluster("localhost-cpu", ranks=2),
                  global_batch=8, top_k=20, micro_batches=(1, 2, 4, 8))
    assert at.table[0].value.index[0] == want.best.id
    assert want.best.world_size == 2


def test_localhost_cluster_says_which_profile_it_assumes(tmp_path):
    at = _app(model_preset="tiny-gpt", cluster_preset="localhost-cpu", ranks=2,
              global_batch=8, cpu_profile="none")
    assert any("assumes the generic CPU preset" in c.value for c in at.caption)
    at = _app(model_preset="tiny-gpt", cluster_preset="localhost-cpu",
              cpu_profile=str(tmp_path / "missing.yaml"))
    assert at.error and "--cpu-profile" in at.error[0].value


def test_every_widget_has_a_stable_key():
    at = _app(model_source="custom", use_custom_plan=True)
    kinds = ("radio", "selectbox", "number_input", "multiselect", "slider", "select_slider",
             "text_input", "checkbox")
    widgets = [w for kind in kinds for w in getattr(at, kind)]
    assert len(widgets) > 30
    assert all(w.key for w in widgets), [w.label for w in widgets if not w.key]


def test_ranked_table_draws_its_one_value_columns_narrow():
    # 17 columns beside the sidebar overflow a 1,440 px window at Streamlit's default widths;
    # the degree and flag columns are drawn "small" so the table fits
    at = _app()
    table = next(df for df in at.dataframe if "plan" in df.value.columns)
    config = json.loads(table.proto.columns)
    shown = [c for c in ("tp", "pp", "dp", "mb", "sp", "zero") if c in table.value.columns]
    assert len(shown) >= 5
    assert all(config[c]["width"] == "small" for c in shown)


def test_custom_model_form_has_every_model_spec_field():
    import dataclasses

    from planner.spec import ModelSpec
    at = _app(model_source="custom")
    keys = {w.key for kind in ("number_input", "selectbox", "checkbox")
            for w in getattr(at, kind)}
    fields = {f.name for f in dataclasses.fields(ModelSpec)} - {"name", "source", "seq_len"}
    assert {f"custom_{f}" for f in fields} <= keys
    # a field beyond the six the form used to have reaches the model: an 8-expert MoE
    at.number_input(key="custom_num_experts").set_value(8)
    at.number_input(key="custom_experts_per_token").set_value(2)
    at.number_input(key="custom_moe_ffn_hidden").set_value(4096).run()
    assert not at.exception and not at.error
    moe = load_model("llama3-8b").replace(num_experts=8, experts_per_token=2,
                                          moe_ffn_hidden=4096)
    assert moe.num_params() != load_model("llama3-8b").num_params()
    assert f"**llama3-8b-custom** ({moe.num_params() / 1e9:.2f}B params" in at.caption[0].value

"""The meshplan explorer: pick a model, a cluster and a batch; see where time and memory go.

Start it with ``meshplan app`` (or ``streamlit run apps/streamlit_app.py``). Every number comes
from the same library calls the CLI makes (`planner.search.search`, `simulator.step.simulate`,
`simulator.failures.goodput`); `apps.app_views` turns them into tables and charts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `streamlit run` puts only apps/ on the path
    sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402

from apps import app_views as views  # noqa: E402
from apps.clusters import cpu_profile_help, profile_line  # noqa: E402
from planner.objective import DEVICE_MTBF_HOURS  # noqa: E402
from planner.presets import load_model, model_names  # noqa: E402
from planner.search import out_of_memory_reason, search  # noqa: E402
from planner.spec import Plan, PlanError, check_plan  # noqa: E402
from simulator.failures.goodput import expected_goodput, job_goodput  # noqa: E402
from simulator.network.cluster import cluster_names  # noqa: E402
from simulator.step.simulate import simulate  # noqa: E402
from simulator.step.trace import chrome_trace  # noqa: E402

#: Default device MTBF: the planner's (`planner.objective.DEVICE_MTBF_HOURS`, Llama 3 405B's
#: 419 unexpected interruptions in 54 days on 16,384 H100s, Dubey et al. 2024, §3.3.4).
DEFAULT_DEVICE_MTBF_H = round(DEVICE_MTBF_HOURS)


def _read_upload(key: str) -> str | None:
    upload = st.session_state.get(key)
    return upload.getvalue().decode("utf-8") if upload is not None else None


def _upload_name(key: str) -> str | None:
    upload = st.session_state.get(key)
    return upload.name if upload is not None else None


def sidebar_inputs() -> dict:
    """Every input widget (each with a stable key); returns their values."""
    sb = st.sidebar
    sb.header("Model")
    source = sb.radio("model from", ["preset", "custom", "upload"], key="model_source",
                      horizontal=True)
    names = model_names()
    preset = sb.selectbox("model preset", names, index=names.index("llama3-8b"),
                          key="model_preset")
    custom = {}
    if source == "custom":  # every ModelSpec field; ModelSpec checks the values
        base = load_model(preset)
        for name, kind, choices in views.custom_model_fields():
            value, key = getattr(base, name), f"custom_{name}"
            if kind == "choice":
                custom[name] = sb.selectbox(name, list(choices), index=choices.index(value),
                                            key=key)
            elif kind == "bool":
                custom[name] = sb.checkbox(name, value=value, key=key)
            elif kind == "optional-float":
                got = sb.number_input(f"{name} (0 = none)", min_value=0.0,
                                      value=float(value or 0.0), step=0.25, key=key)
                custom[name] = float(got) or None
            else:
                custom[name] = int(sb.number_input(name, min_value=0, value=value, step=1,
                                                   key=key))
    elif source == "upload":
        sb.file_uploader("model YAML (ModelSpec fields)", type=["yaml", "yml"],
                         key="model_file")
    sb.header("Cluster")
    csource = sb.radio("cluster from", ["preset", "upload"], key="cluster_source",
                       horizontal=True)
    clusters = cluster_names()
    cpreset = sb.selectbox("cluster preset", clusters, index=clusters.index("dgx-h100"),
                           key="cluster_preset")
    if csource == "upload":
        sb.file_uploader("cluster YAML (one preset entry's fields)", type=["yaml", "yml"],
                         key="cluster_file")
    if csource == "upload":  # 0: the file's own nodes (or default_nodes)
        nodes = int(sb.number_input("nodes (0 = the file's own)", min_value=0, value=0,
                                    step=1, key="upload_nodes")) or None
    else:
        nodes = int(sb.number_input("nodes", min_value=1, value=2, step=1, key="nodes"))
    ranks = int(sb.number_input("ranks (localhost-cpu)", min_value=1, value=4, step=1,
                                key="ranks"))
    cpu_profile = sb.text_input("CPU profile (localhost-cpu; empty: the newest, 'none')",
                                value="", key="cpu_profile", help=cpu_profile_help()).strip()
    sb.header("Batch and constraints")
    gb = int(sb.number_input("global batch (sequences)", min_value=1, value=64, step=1,
                             key="global_batch"))
    seq = int(sb.number_input("sequence length (0 = the model's)", min_value=0, value=0,
                              step=512, key="seq_len"))
    mbs = sb.multiselect("micro-batch sizes (empty: every divisor)", [1, 2, 4, 8, 16],
                         default=[1, 2, 4, 8], key="micro_batches")
    rcs = sb.multiselect("recomputation (empty: all)", ["none", "selective", "full"],
                         default=["none", "selective", "full"], key="recompute")
    devices = int(sb.number_input("devices to use (0 = all)", min_value=0, value=0, step=1,
                                  key="num_devices"))
    headroom = sb.slider("usable memory fraction", 0.5, 1.0, 0.95, 0.01, key="memory_headroom")
    top_k = int(sb.number_input("plans refined by SimPy", min_value=1, value=20, step=1,
                                key="top_k"))
    return {"model_source": source, "model_preset": preset, "custom": custom,
            "model_text": _read_upload("model_file") if source == "upload" else None,
            "seq_len": seq, "cluster_source": csource, "cluster_preset": cpreset,
            "nodes": nodes, "ranks": ranks, "cpu_profile": cpu_profile or None,
            "cluster_text": _read_upload("cluster_file") if csource == "upload" else None,
            "cluster_file_name": _upload_name("cluster_file") if csource == "upload" else None,
            "global_batch": gb, "micro_batches": tuple(sorted(mbs)),
            "recompute": tuple(rcs), "num_devices": devices or None,
            "memory_headroom": float(headroom), "top_k": top_k}


def build_model(inputs: dict):
    return views.model_from_inputs(inputs["model_source"], preset=inputs["model_preset"],
                                   custom=inputs["custom"], uploaded=inputs["model_text"],
                                   seq_len=inputs["seq_len"])


def build_cluster(inputs: dict, bandwidth: float = 1.0, latency: float = 1.0):
    cluster = views.cluster_from_inputs(inputs["cluster_source"],
                                        preset=inputs["cluster_preset"], nodes=inputs["nodes"],
                                        ranks=inputs["ranks"], uploaded=inputs["cluster_text"],
                                        cpu_profile=inputs["cpu_profile"],
                                        uploaded_name=inputs["cluster_file_name"])
    if bandwidth != 1.0 or latency != 1.0:
        cluster = cluster.scale_links(bandwidth=bandwidth, latency=latency)
    return cluster


@st.cache_data(show_spinner=False, max_entries=16)
def cached_search(inputs_json: str):
    """`planner.search.search` on the inputs (JSON, so the cache key is plain text)."""
    inputs = json.loads(inputs_json)
    model, cluster = build_model(inputs), build_cluster(inputs)
    start = time.perf_counter()
    # An empty choice means the planner's own range for that field.
    result = search(model, cluster, global_batch=inputs["global_batch"],
                    num_devices=inputs["num_devices"], top_k=inputs["top_k"],
                    memory_headroom=inputs["memory_headroom"],
                    micro_batches=tuple(inputs["micro_batches"]) or None,
                    recompute=tuple(inputs["recompute"]) or None,
                    explain=importlib.util.find_spec("planner.infeasible") is not None)
    return result, time.perf_counter() - start


@st.cache_data(show_spinner=False, max_entries=64)
def cached_simulate(inputs_json: str, plan_fields: str, bandwidth: float = 1.0,
                    latency: float = 1.0):
    """`simulator.step.simulate` with the trace, for one plan on the (scaled) cluster."""
    inputs = json.loads(inputs_json)
    plan = Plan(**{k: tuple(v) if isinstance(v, list) else v
                   for k, v in json.loads(plan_fields).items()})
    return simulate(build_model(inputs), plan, build_cluster(inputs, bandwidth, latency),
                    trace=True)


def plans_view(result) -> str | None:
    """The ranked table (filterable, sortable), the best plans and the rejected plans."""
    ranked = result.ranked
    st.subheader("Best plans")
    st.table(views.best_table(ranked))
    st.subheader("All ranked plans")
    c1, c2, c3, c4, c5 = st.columns([1, 1, 1.4, 1.4, 1.2])
    tp = c1.multiselect("tp", sorted(ranked["tp"].unique().tolist()), key="filter_tp")
    pp = c2.multiselect("pp", sorted(ranked["pp"].unique().tolist()), key="filter_pp")
    rc = c3.multiselect("recompute", sorted(ranked["recompute"].unique().tolist()),
                        key="filter_recompute")
    text = c4.text_input("plan id contains", key="filter_text")
    sort_by = c5.selectbox("sort by", list(views.SORT_KEYS), key="sort_by")
    shown = views.filter_ranked(ranked, tp=tp, pp=pp, recompute=rc, text=text, sort_by=sort_by)
    narrow = {c: st.column_config.Column(width="small") for c in views.NARROW_COLUMNS}
    st.dataframe(views.ranked_for_display(shown), hide_index=True, width="stretch",
                 column_config=narrow, key="ranked_table")
    st.caption(f"{len(shown)} of {len(ranked)} legal plans shown")
    with st.expander(f"Rejected plans ({len(result.rejected)})"):
        st.dataframe(views.reason_counts(result.rejected), hide_index=True)
        st.dataframe(result.rejected, hide_index=True, width="stretch")
    ids = shown["id"].tolist() or ranked["id"].tolist()
    return st.selectbox("selected plan", ids, key="plan_id") if ids else None


def custom_plan(inputs: dict, model, cluster, default: Plan | None) -> Plan | None:
    """A plan typed in by hand; errors (illegal, out of memory) are shown with their reason."""
    with st.expander("Try a plan of your own", expanded=False):
        use = st.checkbox("use this plan instead of the selected one", key="use_custom_plan")
        cols = st.columns(5)
        base = default or Plan(tp=1, pp=1, dp=1, micro_batch=1,
                               global_batch=inputs["global_batch"])
        fields = {name: int(col.number_input(name, min_value=1, value=getattr(base, name),
                                             step=1, key=f"plan_{name}"))
                  for col, name in zip(cols[:4], ["tp", "pp", "dp", "micro_batch"],
                                       strict=True)}
        recompute = cols[4].selectbox("recompute", ["none", "selective", "full"],
                                      key="plan_recompute")
    if not use:
        return None
    plan = Plan(**fields, global_batch=inputs["global_batch"], recompute=recompute,
                dtype=cluster.default_dtype)
    check_plan(model, plan, world_size=inputs["num_devices"] or cluster.num_devices)
    reason = out_of_memory_reason(model, plan, cluster, inputs["memory_headroom"])
    if reason:
        raise PlanError(f"{plan.id} does not fit: {reason}")
    return plan


def breakdown_view(pred, plan, cluster, memory_headroom: float) -> None:
    """Step-time breakdown, MFU / HFU and memory per stage against device memory."""
    c = st.columns(5)
    c[0].metric("step time", f"{pred.step_time_s * 1e3:,.1f} ms")
    c[1].metric("tokens/s (global)", f"{pred.tokens_per_s:,.0f}")
    c[2].metric("MFU", f"{100 * pred.mfu:.1f}%")
    c[3].metric("HFU", f"{100 * pred.hfu:.1f}%")
    c[4].metric("peak memory / rank", f"{pred.peak_memory_bytes / views.GiB:.1f} GiB")
    parts = views.step_breakdown(pred, plan)
    st.subheader("Where the step time goes (critical stage)")
    st.bar_chart(parts.set_index("part")["ms"], horizontal=True, y_label="ms")
    st.dataframe(parts.round({"ms": 2, "share (%)": 1}).drop(columns="seconds"),
                 hide_index=True)
    st.subheader("Memory per pipeline stage (one rank)")
    st.altair_chart(views.memory_chart(pred, cluster.device.memory_bytes, memory_headroom),
                    width="stretch")
    device_gib = cluster.device.memory_bytes / views.GiB
    st.caption(f"red: usable limit {memory_headroom * device_gib:.1f} GiB "
               f"({100 * memory_headroom:.0f}% of the device, the search's limit); grey: "
               f"device memory {device_gib:.1f} GiB ({cluster.device.name})")


def timeline_view(pred) -> None:
    frame = views.gantt_frame(pred.events)
    if len(pred.events) > len(frame):
        st.info(f"showing the first {len(frame)} of {len(pred.events)} events; the Chrome "
                "trace download has them all")
    st.altair_chart(views.gantt_chart(frame), width="stretch")


def whatif_view(inputs_json: str, plan: Plan, pred, num_devices: int) -> None:
    """Link bandwidth / latency scaling and failures: effect on step time and goodput."""
    c1, c2 = st.columns(2)
    bw = c1.select_slider("link bandwidth ×", [0.25, 0.5, 1.0, 2.0, 4.0], value=1.0,
                          key="whatif_bandwidth")
    lat = c2.select_slider("link latency ×", [0.25, 0.5, 1.0, 2.0, 4.0], value=1.0,
                           key="whatif_latency")
    scaled = cached_simulate(inputs_json, json.dumps(dataclasses.asdict(plan)), bw, lat) \
        if (bw, lat) != (1.0, 1.0) else pred
    c3, c4, c5, c6 = st.columns(4)
    mtbf_h = c3.number_input("device MTBF (h)", min_value=1.0, value=float(DEFAULT_DEVICE_MTBF_H),
                             step=1000.0, key="device_mtbf_h")
    interval_min = c4.number_input("checkpoint interval (min, 0 = Daly optimum)", min_value=0.0,
                                   value=0.0, step=5.0, key="checkpoint_interval_min")
    write_s = c5.number_input("checkpoint write (s)", min_value=0.1, value=60.0, step=10.0,
                              key="checkpoint_write_s")
    restart_s = c6.number_input("restart (s)", min_value=0.0, value=600.0, step=60.0,
                                key="restart_s")
    g = job_goodput(tokens_per_s=scaled.tokens_per_s, num_devices=num_devices,
                    device_mtbf_s=mtbf_h * 3600, checkpoint_s=write_s, restart_s=restart_s,
                    interval_s=interval_min * 60 if interval_min else None)
    m = st.columns(4)
    change = scaled.step_time_s - pred.step_time_s
    m[0].metric("step time", f"{scaled.step_time_s * 1e3:,.1f} ms",
                delta=f"{change * 1e3:+,.1f} ms" if (bw, lat) != (1.0, 1.0) else None,
                delta_color="inverse")
    m[1].metric("goodput", f"{100 * g.goodput:.1f}%")
    m[2].metric("effective tokens/s", f"{g.effective_tokens_per_s:,.0f}")
    m[3].metric("cluster MTBF", f"{g.mtbf_s / 3600:.2f} h")
    st.caption(f"Checkpoint every {g.interval_s / 60:.1f} min of work; optimum: Young "
               f"{g.young_interval_s / 60:.1f} min, Daly {g.daly_interval_s / 60:.1f} min "
               f"(goodput {100 * g.optimal_goodput:.1f}%).")
    taus = [g.daly_interval_s * f for f in (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4)]
    curve = pd.DataFrame({"checkpoint interval (min)": [t / 60 for t in taus],
                          "goodput %": [100 * expected_goodput(t, write_s, restart_s, g.mtbf_s)
                                        for t in taus]})
    st.altair_chart(views.goodput_curve_chart(curve), width="stretch")


def measured_view() -> None:
    folder = st.text_input("results folder (compare.json and run summary.json files)",
                           value="runs", key="results_dir")
    df = views.measured_results(folder)
    if df.empty:
        st.info(f"no compare.json or summary.json with a prediction under {folder!r}; "
                "`meshplan compare` or `meshplan run` writes them")
        return
    report = views.measured_summary(df)
    m = st.columns(3)
    m[0].metric("runs", f"{report['count']}")
    m[1].metric("MAPE", f"{100 * report['mape']:.1f}%")
    m[2].metric("mean error (bias)", f"{100 * report['mean_error']:+.1f}%")
    st.caption(f"worst: {report['worst']['id']} at {100 * report['worst']['rel_error']:+.1f}%")
    st.altair_chart(views.measured_chart(df), width="stretch")
    st.dataframe(views.in_display_units(df), hide_index=True)


def downloads_view(model, plan: Plan, cluster, pred) -> None:
    st.download_button("plan file (YAML)", views.plan_file_yaml(model, plan, cluster, pred),
                       file_name=f"{plan.id}.yaml", key="download_plan")
    launch = views.launch_files(model, plan, cluster, pred, f"{plan.id}.yaml")
    st.code(launch["command"], language="bash")
    st.download_button("launch command", launch["command"] + "\n", file_name=f"{plan.id}.sh",
                       key="download_command")
    if launch["sbatch"]:
        st.download_button("Slurm batch script", launch["sbatch"],
                           file_name=f"{plan.id}.sbatch", key="download_sbatch")
    st.download_button("Chrome trace (open in ui.perfetto.dev)",
                       json.dumps(chrome_trace(pred.events)),
                       file_name=f"{plan.id}.trace.json", key="download_trace")


def main() -> None:
    st.set_page_config(page_title="meshplan explorer", layout="wide")
    st.title("meshplan explorer")
    inputs = sidebar_inputs()
    inputs_json = json.dumps(inputs, sort_keys=True)
    try:
        model, cluster = build_model(inputs), build_cluster(inputs)
        st.caption(f"**{model.name}** ({model.num_params() / 1e9:.2f}B params, seq "
                   f"{model.seq_len}) on **{cluster.name}** ({cluster.num_devices} × "
                   f"{cluster.device.name}), global batch {inputs['global_batch']}")
        if cluster.nics_per_node == 0:
            st.caption(profile_line(cluster))
        with st.spinner("searching every legal plan ..."):
            result, seconds = cached_search(inputs_json)
    except PlanError as exc:
        st.error(str(exc))
        return
    candidates = result.stats.get("candidates", len(result.ranked) + len(result.rejected))
    st.caption(f"{candidates} candidates searched in {seconds:.2f} s (cached for these "
               f"inputs)")
    tabs = st.tabs(["Plans", "Breakdown", "Timeline", "Cluster", "What-if", "Measured",
                    "Downloads"])
    with tabs[5]:
        measured_view()
    with tabs[0]:
        if result.ranked.empty:
            try:
                _ = result.best  # raises with the commonest reasons
            except PlanError as exc:
                st.error(str(exc))
            inf = result.infeasible
            if inf is not None:  # `planner.infeasible`: what comes closest, what blocks
                st.warning(f"no plan fits: {inf.summary}")
                if not inf.closest.empty:
                    st.dataframe(views.in_display_units(inf.closest), hide_index=True,
                                 width="stretch")
                st.markdown("\n".join(f"- blocked by {line}" for line in inf.blocking))
            st.dataframe(result.rejected, hide_index=True, width="stretch")
            return
        selected = plans_view(result)
        try:
            plan = custom_plan(inputs, model, cluster, result.plans.get(selected))
        except PlanError as exc:
            st.error(str(exc))
            return
        plan = plan or result.plans[selected]
    with st.spinner(f"simulating {plan.id} ..."):
        pred = cached_simulate(inputs_json, json.dumps(dataclasses.asdict(plan)))
    with tabs[1]:
        st.markdown(f"**{plan.id}**")
        breakdown_view(pred, plan, cluster, inputs["memory_headroom"])
    with tabs[2]:
        timeline_view(pred)
    with tabs[3]:
        st.pyplot(views.cluster_figure(cluster, plan), clear_figure=True)
    with tabs[4]:
        whatif_view(inputs_json, plan, pred, plan.world_size)
    with tabs[6]:
        downloads_view(model, plan, cluster, pred)


main()

"""What the Streamlit explorer shows, as plain functions of the library's results.

Nothing here imports streamlit: each function turns inputs into library objects or library
results into DataFrames, charts and text, so the app stays a thin layout and the pieces are
testable on their own. Modelling lives in `planner` and `simulator`; this is parsing and display.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

import altair as alt
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from apps.clusters import cluster_from_flags, cluster_ref  # noqa: E402
from apps.format import GiB, fmt_bytes, fmt_pct, fmt_rate, fmt_time_s  # noqa: E402
from planner.mesh import group_ranks, mesh_strides  # noqa: E402
from planner.planfile import PlanFile, check_runnable  # noqa: E402
from planner.presets import load_model, model_from_dict  # noqa: E402
from planner.spec import ModelSpec, Plan, PlanError  # noqa: E402
from planner.userfile import parse_yaml  # noqa: E402
from simulator.network.cluster import Cluster, cluster_from_spec, load_cluster  # noqa: E402
from simulator.step.breakdown import comm_kind  # noqa: E402
from simulator.step.simulate import StepPrediction  # noqa: E402

#: Ranked-table columns shown to people, with human units (the library's are SI).
DISPLAY_COLUMNS = {"id": "plan", "tp": "tp", "pp": "pp", "dp": "dp", "micro_batch": "mb",
                   "recompute": "recompute", "sequence_parallel": "sp",
                   "step_time_ms": "step time (ms)", "tokens_per_s": "tokens/s",
                   "mfu_pct": "MFU %", "hfu_pct": "HFU %", "memory_gib": "mem/rank (GiB)",
                   "schedule": "schedule", "virtual_stages": "v", "zero_stage": "zero",
                   "placement": "placement", "tier": "tier"}
#: Ranked-table columns of one short value (a degree, a flag), drawn narrow so that all
#: columns fit a 1,440 px window beside the sidebar instead of scrolling sideways.
NARROW_COLUMNS = ("tp", "pp", "dp", "mb", "sp", "v", "zero", "tier")
#: Sort keys of the ranked table: label -> (column, ascending by default).
SORT_KEYS = {"tokens/s": ("tokens_per_s", False), "step time": ("step_time_s", True),
             "MFU": ("mfu", False), "memory per rank": ("peak_memory_bytes", True)}
#: Most timeline events drawn; a longer trace is cut (the Chrome trace download has them all).
MAX_GANTT_EVENTS = 4000


def model_from_inputs(source: str, *, preset: str, custom: dict | None = None,
                      uploaded: str | None = None, seq_len: int = 0) -> ModelSpec:
    """The model the sidebar describes: a preset, a preset with custom fields, or a YAML text.

    ``seq_len`` 0 keeps the model's own sequence length.

    Raises:
        PlanError: unknown preset, an illegal field or a bad upload (the message says which).
    """
    if source == "upload":
        if not uploaded:
            raise PlanError("choose a model YAML file to upload, or pick a preset")
        fields = parse_yaml(uploaded, "(uploaded)", "model", also=("plan",))
        if isinstance(fields.get("model"), dict):
            fields = fields["model"]
        fields = dict(fields)
        model = model_from_dict(fields, name=fields.pop("name", "uploaded"))
    elif source == "custom":
        model = load_model(preset).replace(name=f"{preset}-custom", **(custom or {}))
    else:
        model = load_model(preset)
    return model.replace(seq_len=seq_len) if seq_len else model


#: ModelSpec fields the custom-model form leaves out: the name (the app names the model), the
#: citation, and seq_len (the sidebar's own input).
NOT_IN_FORM = ("name", "source", "seq_len")


def custom_model_fields() -> list[tuple[str, str, tuple]]:
    """The custom-model form: every `ModelSpec` field but `NOT_IN_FORM`, in declaration
    order, as ``(name, kind, choices)``; kind is 'int', 'bool', 'choice' (a Literal, with its
    values as choices) or 'optional-float' (a float or None, None shown as 0)."""
    import dataclasses
    import typing
    hints = typing.get_type_hints(ModelSpec)
    out = []
    for f in dataclasses.fields(ModelSpec):
        if f.name in NOT_IN_FORM:
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) is typing.Literal:
            out.append((f.name, "choice", typing.get_args(hint)))
        elif hint is bool:
            out.append((f.name, "bool", ()))
        elif hint is int:
            out.append((f.name, "int", ()))
        elif set(typing.get_args(hint)) == {float, type(None)}:
            out.append((f.name, "optional-float", ()))
        else:
            raise TypeError(f"ModelSpec.{f.name}: {hint} has no form widget")
    return out


def cluster_from_inputs(source: str, *, preset: str, nodes: int | None = 1, ranks: int = 4,
                        uploaded: str | None = None, cpu_profile: str | None = None,
                        uploaded_name: str | None = None) -> Cluster:
    """The cluster the sidebar describes: a preset with its size, or an uploaded YAML text.

    An upload is named after its file (``uploaded_name``'s stem, else 'uploaded') and keeps
    its own size (``nodes`` / ``default_nodes``, `load_cluster`) unless ``nodes`` is given.
    ``cpu_profile`` is the localhost-cpu preset's profile as ``--cpu-profile`` takes it (a
    file, 'none', or None: the newest in the default folder; `apps.clusters`).

    Raises:
        PlanError: unknown preset, bad size, an invalid upload, or a missing profile file.
    """
    if source == "upload":
        if not uploaded:
            raise PlanError("choose a cluster YAML file to upload, or pick a preset")
        spec = parse_yaml(uploaded, "(uploaded)", "cluster")
        name = Path(uploaded_name).stem if uploaded_name else "uploaded"
        local = spec.get("kind") == "localhost"
        return cluster_from_spec(name, spec, nodes=None if local else nodes,
                                 ranks=ranks if local else None)
    if preset == "localhost-cpu":
        return cluster_from_flags(preset, None, ranks, cpu_profile)
    return load_cluster(preset, nodes=nodes)


def ranked_for_display(ranked: pd.DataFrame) -> pd.DataFrame:
    """The ranked table with human units (ms, %, GiB) and short headers."""
    df = ranked.assign(step_time_ms=ranked["step_time_s"] * 1e3, mfu_pct=ranked["mfu"] * 100,
                       hfu_pct=ranked["hfu"] * 100,
                       memory_gib=ranked["peak_memory_bytes"] / GiB)
    if "placement" in df:
        df = df.assign(placement=df["placement"].map(
            lambda p: p if isinstance(p, str) else "-".join(p)))
    columns = [c for c in DISPLAY_COLUMNS if c in df]
    return df[columns].rename(columns=DISPLAY_COLUMNS).round(
        {"step time (ms)": 1, "tokens/s": 0, "MFU %": 1, "HFU %": 1, "mem/rank (GiB)": 1})


def in_display_units(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with the library's SI columns in the explorer's units: ``*_bytes`` in GiB,
    seconds (``*_s``, not rates ``*_per_s``) in ms, ``rel_error`` in %; the unit goes in
    the header ("peak_memory (GiB)")."""
    out = {}
    for col in df.columns:
        name = str(col)
        if name.endswith("_bytes"):
            out[f"{name.removesuffix('_bytes')} (GiB)"] = (df[col] / GiB).round(2)
        elif name.endswith("_s") and not name.endswith("_per_s"):
            out[f"{name.removesuffix('_s')} (ms)"] = (df[col] * 1e3).round(3)
        elif name == "rel_error":
            out["error (%)"] = (100 * df[col]).round(1)
        else:
            out[name] = df[col]
    return pd.DataFrame(out, index=df.index)


def best_table(ranked: pd.DataFrame, n: int = 5) -> pd.DataFrame:
    """The ``n`` best plans as text with units, indexed by plan id (a compact summary)."""
    head = ranked.head(n)
    table = pd.DataFrame({
        "tp × pp × dp": [f"{r.tp} × {r.pp} × {r.dp}" for r in head.itertuples()],
        "mb": head["micro_batch"].astype(str).to_numpy(),
        "recompute": head["recompute"].to_numpy(),
        "step time": head["step_time_s"].map(fmt_time_s).to_numpy(),
        "tokens/s": head["tokens_per_s"].map(fmt_rate).to_numpy(),
        "MFU": head["mfu"].map(fmt_pct).to_numpy(),
        "mem/rank": head["peak_memory_bytes"].map(fmt_bytes).to_numpy()},
        index=pd.Index(head["id"].to_numpy(), name="plan"))
    return table


def filter_ranked(ranked: pd.DataFrame, *, tp: list[int] | None = None,
                  pp: list[int] | None = None, recompute: list[str] | None = None,
                  text: str = "", sort_by: str = "tokens/s",
                  ascending: bool | None = None) -> pd.DataFrame:
    """Rows of ``ranked`` whose tp / pp / recompute are among those chosen (empty: all) and
    whose id contains ``text``, sorted by ``sort_by`` (a `SORT_KEYS` label)."""
    keep = pd.Series(True, index=ranked.index)
    for column, chosen in (("tp", tp), ("pp", pp), ("recompute", recompute)):
        if chosen:
            keep &= ranked[column].isin(chosen)
    if text:
        keep &= ranked["id"].str.contains(text, regex=False)
    column, default_ascending = SORT_KEYS[sort_by]
    order = default_ascending if ascending is None else ascending
    return ranked[keep].sort_values(column, ascending=order, kind="stable")


def reason_counts(rejected: pd.DataFrame) -> pd.DataFrame:
    """Rejection reasons grouped by their rule (the text before the first number or ':')."""
    if rejected.empty:
        return pd.DataFrame(columns=["rule", "plans"])
    rule = rejected["reason"].str.extract(r"^([^:=\d]*)", expand=False).str.strip(" =")
    counts = rule.value_counts()
    return pd.DataFrame({"rule": counts.index, "plans": counts.to_numpy()})


def critical_stage(pred: StepPrediction) -> int:
    """The pipeline stage whose busy compute / exposed communication the prediction reports."""
    stages = sorted({e[0] for e in pred.events}) or [0]

    def mismatch(stage: int) -> float:
        comp = sum(e[4] - e[3] for e in pred.events if e[0] == stage and e[1] == "compute")
        comm = sum(e[4] - e[3] for e in pred.events if e[0] == stage and e[1] == "comm")
        return abs(comp - pred.compute_s) + abs(comm - pred.comm_s)

    return min(stages, key=mismatch)


def step_breakdown(pred: StepPrediction, plan: Plan) -> pd.DataFrame:
    """Seconds of the critical stage's step: compute, exposed communication by kind, bubble.

    The kinds come from the traced events (``pred.events``), labelled for ``plan``
    (`simulator.step.breakdown.comm_kind`); the exposed part of overlapped gradient buckets,
    which are not on the comm stream, is the rest of ``pred.comm_s``.
    """
    stage = critical_stage(pred)
    parts: dict[str, float] = {"compute": pred.compute_s}
    for s, stream, name, start, end in pred.events:
        if s == stage and stream == "comm":
            kind = comm_kind(name, plan)
            parts[kind] = parts.get(kind, 0.0) + end - start
    rest = pred.comm_s - sum(v for k, v in parts.items() if k != "compute")
    if rest > 1e-12:
        key = comm_kind("dp-grad-reduce", plan)
        parts[key] = parts.get(key, 0.0) + rest
    parts["pipeline bubble"] = pred.bubble_s
    df = pd.DataFrame({"part": list(parts), "seconds": list(parts.values())})
    return df.assign(ms=df["seconds"] * 1e3,
                     **{"share (%)": 100 * df["seconds"] / pred.step_time_s})


def memory_frame(pred: StepPrediction) -> pd.DataFrame:
    """Long table (stage, part, GiB) of the memory of one rank of each pipeline stage."""
    rows = []
    for stage, m in enumerate(pred.memory):
        for part in ("weights", "gradients", "optimizer", "activations", "overhead"):
            rows.append({"stage": stage, "part": part,
                         "GiB": getattr(m, f"{part}_bytes") / GiB})
    return pd.DataFrame(rows)


def memory_limits(device_memory_bytes: float, memory_headroom: float = 1.0) -> pd.DataFrame:
    """The memory chart's rules (limit, GiB): the device's memory and the usable part a plan
    must fit in, ``memory_headroom`` × device memory (the search's rule,
    `planner.search.out_of_memory_reason`)."""
    return pd.DataFrame({"limit": ["device memory", "usable limit"],
                         "GiB": [device_memory_bytes / GiB,
                                 memory_headroom * device_memory_bytes / GiB]})


def memory_chart(pred: StepPrediction, device_memory_bytes: float,
                 memory_headroom: float = 1.0) -> alt.LayerChart:
    """Stacked bars of memory per stage, with the device's memory (grey) and the usable limit
    (red, `memory_limits`) as rules."""
    df = memory_frame(pred)
    bars = alt.Chart(df).mark_bar().encode(
        x=alt.X("stage:O", title="pipeline stage"),
        y=alt.Y("sum(GiB):Q", title="GiB per rank"),
        color=alt.Color("part:N", sort=["weights", "gradients", "optimizer", "activations",
                                        "overhead"]),
        tooltip=["stage", "part", alt.Tooltip("GiB:Q", format=".2f")])
    limits = alt.Chart(memory_limits(device_memory_bytes, memory_headroom)).mark_rule(
        strokeDash=[6, 3], strokeWidth=2).encode(
        y="GiB:Q",
        stroke=alt.Stroke("limit:N", scale=alt.Scale(domain=["device memory", "usable limit"],
                                                     range=["grey", "red"]), title=None),
        tooltip=["limit", alt.Tooltip("GiB:Q", format=".1f")])
    return alt.layer(bars, limits).resolve_scale(color="independent").properties(height=260)


def _event_kind(stream: str, name: str) -> str:
    if stream == "compute":
        return {"F": "forward", "B": "backward"}.get(name[0], name)
    if stream == "p2p":
        return "pipeline send"
    if stream == "overlap":
        return "overlapped comm (hidden)"
    # the "tp-" events merge TP, the CP ring, the expert all-to-all and ZeRO-3's per-layer
    # traffic (`simulator.step.breakdown.comm_kind`)
    return "in-layer comm (TP / CP / EP / ZeRO-3)" if name.startswith("tp-") else \
        "data-parallel comm"


def gantt_frame(events: list[tuple], limit: int = MAX_GANTT_EVENTS) -> pd.DataFrame:
    """The trace as rows (lane, kind, name, start_ms, end_ms), at most ``limit`` of them."""
    rows = [{"lane": f"stage {s} · {stream}", "stage": s, "kind": _event_kind(stream, name),
             "name": name, "start_ms": a * 1e3, "end_ms": b * 1e3}
            for s, stream, name, a, b in events[:limit]]
    return pd.DataFrame(rows, columns=["lane", "stage", "kind", "name", "start_ms", "end_ms"])


def gantt_chart(frame: pd.DataFrame) -> alt.Chart:
    """Pipeline timeline: one lane per (stage, stream), bars coloured by kind; the time axis
    zooms (scroll) and pans (drag), the lanes stay put."""
    return alt.Chart(frame).mark_bar(stroke="white", strokeWidth=0.5).encode(
        x=alt.X("start_ms:Q", title="time in step (ms)"), x2="end_ms:Q",
        # every lane keeps its label: none dropped for overlap or cut short
        y=alt.Y("lane:N", sort=sorted(frame["lane"].unique()), title=None,
                axis=alt.Axis(labelOverlap=False, labelLimit=0)),
        color=alt.Color("kind:N", legend=alt.Legend(labelLimit=0)),
        tooltip=["name", "kind", alt.Tooltip("start_ms:Q", format=".3f"),
                 alt.Tooltip("end_ms:Q", format=".3f")],
    # tall enough for every legend entry too: the legend beside the lanes is cut to the
    # chart's height, and a chart of few lanes hid the comm kinds
    ).properties(height=max(120, 22 * frame["lane"].nunique(),
                            30 + 30 * frame["kind"].nunique())).interactive(bind_y=False)


def _layer_of(node: tuple) -> int:
    return {"spine": 0, "leaf": 1, "loopback": 1, "nic": 2, "gpu": 3, "cpu": 3,
            "nvswitch": 4}[node[0]]


def cluster_figure(cluster: Cluster, plan: Plan, max_nodes: int = 4) -> plt.Figure:
    """The cluster's NetworkX graph (first ``max_nodes`` servers) with the plan drawn on it.

    Devices are coloured by pipeline stage (grey: unused); the tensor-parallel group of rank 0
    is outlined in red and its data-parallel group in blue.
    """
    shown = min(cluster.num_nodes, max_nodes)
    keep = [n for n in cluster.graph if n[0] in ("spine", "leaf", "loopback")
            or n[1] < shown]
    g = cluster.graph.subgraph(keep)
    layers: dict[int, list] = {}
    for n in sorted(g, key=lambda n: tuple(str(x) for x in n)):
        layers.setdefault(_layer_of(n), []).append(n)
    pos = {}
    for layer, nodes in layers.items():
        for i, n in enumerate(nodes):
            pos[n] = ((i + 0.5) / len(nodes), -layer)
    strides = mesh_strides(plan)
    tp0 = set(group_ranks(plan, "tp"))
    dp0 = set(group_ranks(plan, "dp"))
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 3.6))
    nx.draw_networkx_edges(g, pos, ax=ax, edge_color="#bbbbbb", width=0.6)
    others = [n for n in g if n[0] not in ("gpu", "cpu")]
    nx.draw_networkx_nodes(g, pos, nodelist=others, ax=ax, node_color="#444444",
                           node_shape="s", node_size=60)
    devices = [n for n in g if n[0] in ("gpu", "cpu")]
    index = {n: n[1] * cluster.devices_per_node + n[2] for n in devices}
    colors = [cmap((index[n] // strides["pp"]) % 10) if index[n] < plan.world_size
              else "#dddddd" for n in devices]
    edge = ["red" if index[n] in tp0 else "blue" if index[n] in dp0 else "white"
            for n in devices]
    nx.draw_networkx_nodes(g, pos, nodelist=devices, ax=ax, node_color=colors,
                           edgecolors=edge, linewidths=2.0, node_size=120)
    title = (f"{cluster.name}: {cluster.num_devices} devices"
             + (f" (first {shown} of {cluster.num_nodes} servers shown)"
                if shown < cluster.num_nodes else "")
             + f" — colour: pipeline stage of {plan.id}; red ring: tp group of rank 0; "
             "blue ring: its dp group")
    names = {0: "spine", 1: "leaf / loopback", 2: "NICs", 3: "devices", 4: "NVSwitch"}
    for layer in layers:
        ax.text(-0.01, -layer, names[layer], ha="right", va="center", fontsize=7)
    ax.set_xlim(-0.12, 1.0)
    ax.set_title(title, fontsize=8)
    ax.axis("off")
    fig.tight_layout()
    return fig


def plan_file_yaml(model: ModelSpec, plan: Plan, cluster: Cluster,
                   pred: StepPrediction) -> str:
    """The plan file `meshplan plan --out` would write for this plan, as YAML text."""
    pf = PlanFile(model=model, plan=plan, cluster=cluster_ref(cluster, plan),
                  prediction=pred.to_dict())
    return yaml.safe_dump(pf.to_dict(), sort_keys=False)


def launch_command(plan: Plan, plan_path: str = "plan.yaml", steps: int = 10) -> str:
    """The torchrun command line (one machine) that trains ``plan_path``."""
    from runtime.launch import local_torchrun_command
    cmd = local_torchrun_command(plan_path, steps=steps, out_dir=f"runs/{plan.id}",
                           nproc=plan.world_size, master_port=29500)
    return shlex.join(["python", *cmd[1:]])


def plan_nodes(plan: Plan, cluster: Cluster) -> int:
    """Servers the plan occupies (1 on localhost-cpu)."""
    if cluster.nics_per_node == 0:
        return 1
    return max(1, -(-plan.world_size // cluster.devices_per_node))


def launch_files(model: ModelSpec, plan: Plan, cluster: Cluster, pred: StepPrediction,
                 plan_name: str, steps: int = 10) -> dict[str, str]:
    """How to launch the plan file ``plan_name``: ``{"command": ..., "sbatch": ...}``.

    One server: a single torchrun line. Several: one line per node (`planner.launch`, the
    rendezvous on ``NODE0_HOST:29500``) and a Slurm batch script; "sbatch" is '' otherwise.
    A plan the runtime cannot execute (`planner.planfile.check_runnable`) gets the reason as a
    comment instead of a command.
    """
    try:
        check_runnable(plan)
    except PlanError as exc:
        return {"command": f"# {exc}", "sbatch": ""}
    nodes = plan_nodes(plan, cluster)
    if nodes == 1:
        return {"command": launch_command(plan, plan_name, steps), "sbatch": ""}
    from planner.launch import sbatch_script, shell_line, torchrun_node_command
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / plan_name
        path.write_text(plan_file_yaml(model, plan, cluster, pred), encoding="utf-8")
        out = f"runs/{plan.id}"
        lines = [f"# node {r} of {nodes}\n" + shell_line(torchrun_node_command(
            path, nodes=nodes, node_rank=r, rdzv_endpoint="NODE0_HOST:29500", steps=steps,
            out_dir=out, launcher=["python", "-m", "torch.distributed.run"]))
            for r in range(nodes)]
        sbatch = sbatch_script(path, nodes=nodes, steps=steps, out_dir=out)
    return {"command": "\n".join(lines).replace(str(path), plan_name),
            "sbatch": sbatch.replace(str(path), plan_name)}


def goodput_curve_chart(curve: pd.DataFrame) -> alt.Chart:
    """Goodput (%) against the checkpoint interval (min), the y axis fitted to the data."""
    return alt.Chart(curve).mark_line(point=True).encode(
        x=alt.X("checkpoint interval (min):Q"),
        y=alt.Y("goodput %:Q", scale=alt.Scale(zero=False)),
        tooltip=list(curve.columns)).properties(height=220)


def measured_results(folder: str | Path) -> pd.DataFrame:
    """Predicted and measured step times found under ``folder``, one row per run.

    Reads every ``compare.json`` (its rows) and every ``summary.json`` of a run that carries
    its plan's prediction; a run of a compare sweep (``<compare folder>/<row id>/``) is listed
    once, from compare.json. Columns id, source (the run's folder), predicted_step_time_s,
    measured_step_time_s, rel_error.
    """
    folder = Path(folder)
    rows: list[dict] = []
    listed: set[Path] = set()
    if folder.is_dir():
        for path in sorted(folder.rglob("compare.json")):
            for row in json.loads(path.read_text()).get("rows", []):
                run = path.parent / row["id"]
                listed.add(run.resolve())
                rows.append({"id": row["id"], "source": run.relative_to(folder).as_posix(),
                             "predicted_step_time_s": row["predicted_step_time_s"],
                             "measured_step_time_s": row["measured_step_time_s"]})
        for path in sorted(folder.rglob("summary.json")):
            if path.parent.resolve() in listed:
                continue
            summary = json.loads(path.read_text())
            pred = summary.get("prediction") or {}
            if "step_time_s" in pred and "step_time_s" in summary:
                rows.append({"id": summary.get("plan_id", path.parent.name),
                             "source": path.parent.relative_to(folder).as_posix(),
                             "predicted_step_time_s": pred["step_time_s"],
                             "measured_step_time_s": summary["step_time_s"]})
    df = pd.DataFrame(rows, columns=["id", "source", "predicted_step_time_s",
                                     "measured_step_time_s"])
    return df.assign(rel_error=(df["predicted_step_time_s"] - df["measured_step_time_s"])
                     / df["measured_step_time_s"])


def measured_summary(df: pd.DataFrame) -> dict:
    """MAPE, mean error and worst run of `measured_results` rows
    (`simulator.validation.report.error_summary`)."""
    from simulator.validation.report import error_summary
    return error_summary(df.to_dict("records"), measured="measured_step_time_s")


def measured_chart(df: pd.DataFrame) -> alt.Chart:
    """Grouped bars of predicted and measured step time (ms) per plan and source."""
    long = df.assign(run=df["id"] + " · " + df["source"]).melt(
        id_vars=["run"], value_vars=["predicted_step_time_s", "measured_step_time_s"],
        var_name="series", value_name="seconds")
    long = long.assign(ms=long["seconds"] * 1e3,
                       series=long["series"].str.replace("_step_time_s", "", regex=False))
    return alt.Chart(long).mark_bar().encode(
        x=alt.X("ms:Q", title="step time (ms)"), y=alt.Y("run:N", title=None),
        yOffset="series:N", color="series:N", tooltip=["run", "series", "ms"])

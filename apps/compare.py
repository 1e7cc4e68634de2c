"""Predicted vs measured on this machine: a sweep of local plans, each predicted on the
calibrated localhost-cpu cluster, run with torchrun, and lined up.

This module orchestrates the library calls behind `meshplan compare`; the modelling lives in
`simulator` (`simulator.step.cpu_model` for the calibrated CPU terms), the execution in `runtime`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from apps.clusters import cluster_from_flags, cluster_ref
from apps.compare_plans import DEFAULT_PLANS, SWEEP, WIDE_CHANGES
from apps.format import dumps_json, fmt_pct, fmt_rate, fmt_time_s, print_table
from planner.planfile import PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import ModelSpec, Plan, PlanError

if TYPE_CHECKING:       # pandas, matplotlib and the simulator load when a sweep runs
    import pandas as pd
    from rich.console import Console

    from simulator.network.cluster import Cluster

COMPARE_GLOBAL_BATCH = 8


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


COMPARE_TABLE = {"id": ("plan", None), "world_size": ("ranks", None),
                 "predicted_step_time_s": ("pred ms", _ms), "measured_step_time_s": ("meas ms", _ms),
                 "rel_error": ("error", lambda x: f"{100 * x:+.1f}%"),
                 "predicted_tokens_per_s": ("pred tok/s", fmt_rate),
                 "measured_tokens_per_s": ("meas tok/s", fmt_rate),
                 "measured_mfu": ("meas MFU", fmt_pct)}
#: A plan within this fraction of the measured best step time counts as the best.
BEST_PLAN_TOLERANCE = 0.03


def sweep_models() -> dict[str, ModelSpec]:
    """The sweep's models: tiny-gpt and its wide variant (`WIDE_CHANGES`)."""
    tiny = load_model("tiny-gpt")
    return {"tiny-gpt": tiny, "tiny-gpt-wide": tiny.replace(**WIDE_CHANGES)}


def sweep_plans(which: tuple[int, ...] | None = None) -> list[tuple[ModelSpec, Plan]]:
    """``(model, plan)`` of each `SWEEP` entry (all, or the indices ``which``)."""
    models = sweep_models()
    picked = range(len(SWEEP)) if which is None else which
    return [(models[SWEEP[i][0]], Plan(global_batch=COMPARE_GLOBAL_BATCH, dtype="fp32",
                                       **SWEEP[i][1])) for i in picked]


def plan_indices(ids: list[str]) -> tuple[int, ...]:
    """`SWEEP` indices of the plans named by ``ids`` (`row_id` strings), in sweep order.

    >>> plan_indices(["tp1-pp1-dp4-mb2-gb8", "tp1-pp1-dp1-mb8-gb8"])
    (0, 8)

    Raises:
        PlanError: an id is not in the sweep (the message lists the ids that are).
    """
    known = [row_id(m, p) for m, p in sweep_plans()]
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise PlanError(f"not in the compare sweep: {', '.join(unknown)}; choose from "
                         f"{', '.join(known)}")
    return tuple(n for n, rid in enumerate(known) if rid in ids)


def row_id(model: ModelSpec, plan: Plan) -> str:
    """The plan id, prefixed by the model name for models other than tiny-gpt."""
    return plan.id if model.name == "tiny-gpt" else f"{model.name}-{plan.id}"


def predict(model: ModelSpec, plan: Plan, cluster: Cluster) -> tuple[dict, dict]:
    """``(prediction dict, assumptions)`` of ``plan`` on ``cluster`` (localhost-cpu with as
    many ranks)."""
    from simulator.step.cpu_model import active_ranks
    from simulator.step.simulate import simulate
    pred = simulate(model, plan, cluster).to_dict()
    pred.pop("memory", None)
    cores = os.cpu_count() or 1
    profile = cluster.cpu_profile
    assumptions = {
        "profile": profile.path if profile is not None else "presets (no calibrated profile)",
        "calibrated_terms": bool(profile is not None and profile.covers(model)),
        "device": cluster.device.name, "peak_flops": cluster.device.peak("fp32"),
        "threads_per_rank": 1, "cores": cores,
        "ranks_per_core": round(plan.world_size / cores, 2),
        "active_ranks": round(active_ranks(plan), 2),
        "global_batch": plan.global_batch, "seq_len": model.seq_len, "dtype": "fp32"}
    pred["assumptions"] = assumptions
    return pred, assumptions


def compare(*, steps: int = 12, out_dir: Path = Path("runs/compare"),
            plans: tuple[int, ...] | None = DEFAULT_PLANS, console: Console | None = None,
            timeout_s: float = 300.0, cpu_profile: str | None = None) -> dict:
    """Predict, run ``steps`` steps and compare each plan of `SWEEP` (indices ``plans``; None:
    the whole sweep), predicting with the profile ``cpu_profile`` names (a ``--cpu-profile``
    value: a file, 'none', or None for the newest in the default folder).

    Returns (and writes to ``out_dir/compare.json``) ``{"rows": [...], "mape", "worst",
    "spearman", "best_plan_match", "predicted_best", "measured_best", "failed",
    "assumptions"}`` (``failed``: runs that exited non-zero, with their first error line). Each
    row has id, predicted / measured step_time_s, tokens_per_s and MFU, rel_error =
    (predicted − measured) / measured of the step time, final_loss and the row's assumptions
    (profile, threads per rank, ranks per core, ...). Also writes ``out_dir/compare.png``.
    """
    import pandas as pd

    from runtime.launch import run_plan
    from simulator.validation.report import rel_error
    if console is None:
        from rich.console import Console  # here: `calibrate --help` reads this module
        console = Console()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = sweep_plans(plans)
    rows, failed = [], []
    for n, (model, plan) in enumerate(chosen, 1):
        rid = row_id(model, plan)
        cluster = cluster_from_flags("localhost-cpu", None, plan.world_size, cpu_profile)
        pred, assumptions = predict(model, plan, cluster)
        run_dir = out_dir / rid
        plan_path = write_plan_file(run_dir / "plan.yaml", PlanFile(
            model=model, plan=plan, prediction=pred,
            cluster=cluster_ref(cluster, plan)))
        console.print(f"[{n}/{len(chosen)}] {rid}: predicted "
                      f"{fmt_time_s(pred['step_time_s'])}, running {plan.world_size} rank(s) "
                      f"for {steps} steps ...", highlight=False)
        try:
            summary = run_plan(plan_path, steps=steps, out_dir=run_dir, quiet=True,
                               timeout_s=timeout_s)
        except RuntimeError as exc:       # keep the sweep going; the failure is reported
            failed.append({"id": rid, "error": str(exc).splitlines()[0]})
            from rich.markup import escape  # names and errors are text, not markup
            console.print(f"  [red]failed:[/] {escape(failed[-1]['error'])}", highlight=False)
            continue
        measured = summary["step_time_s"]
        rows.append({"id": rid, "model": model.name, "world_size": plan.world_size,
                     "predicted_step_time_s": pred["step_time_s"],
                     "measured_step_time_s": measured,
                     "rel_error": rel_error(pred["step_time_s"], measured),
                     "predicted_tokens_per_s": pred["tokens_per_s"],
                     "measured_tokens_per_s": summary["tokens_per_s"],
                     "predicted_mfu": pred["mfu"], "measured_mfu": summary["mfu"],
                     "final_loss": summary["final_loss"],
                     "ranks_per_core": assumptions["ranks_per_core"],
                     "assumptions": assumptions})
    if not rows:
        raise RuntimeError(f"every compare run failed: {failed}")
    result = summarize_rows(rows)
    result |= {"steps": steps, "failed": failed, "assumptions": {
        "profile": rows[0]["assumptions"]["profile"] if rows else None,
        "global_batch": COMPARE_GLOBAL_BATCH, "dtype": "fp32", "threads_per_rank": 1,
        "cores": os.cpu_count(), "load_average_1m": _load_average(),
        "measured": "median step time after the first (warm-up) step, rank 0"}}
    (out_dir / "compare.json").write_text(dumps_json(result, indent=2))
    df = pd.DataFrame(rows)
    plot_compare(df, out_dir / "compare.png", result)
    print_table(console, df, "predicted vs measured (localhost-cpu, 1 thread per rank)",
                COMPARE_TABLE)
    console.print(summary_line(result), highlight=False)
    console.print(f"assumptions: profile {result['assumptions']['profile']}, 1 thread per rank,"
                  f" {os.cpu_count()} cores; wrote {out_dir / 'compare.json'} and "
                  f"{out_dir / 'compare.png'}", highlight=False)
    return result


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def summarize_rows(rows: list[dict]) -> dict:
    """MAPE, worst plan, Spearman rank correlation of predicted vs measured step time, and
    whether the predicted best plan (of the first model) is the measured best, or within
    `BEST_PLAN_TOLERANCE` of it.

    >>> r = summarize_rows([
    ...     {"id": "a", "model": "m", "predicted_step_time_s": 1.0, "measured_step_time_s": 1.0,
    ...      "rel_error": 0.0},
    ...     {"id": "b", "model": "m", "predicted_step_time_s": 2.2, "measured_step_time_s": 2.0,
    ...      "rel_error": 0.1}])
    >>> round(r["mape"], 3), r["worst"]["id"], round(r["spearman"], 6), r["best_plan_match"]
    (0.05, 'b', 1.0, True)
    """
    import pandas as pd

    from simulator.validation.report import error_summary
    if not rows:
        return {"rows": [], "mape": None, "spearman": None, "best_plan_match": False}
    report = error_summary(rows, measured="measured_step_time_s")
    df = pd.DataFrame(rows)
    first = df[df["model"] == df["model"].iloc[0]]
    pred_best = first.loc[first["predicted_step_time_s"].idxmin()]
    meas_best = first.loc[first["measured_step_time_s"].idxmin()]
    gap = pred_best["measured_step_time_s"] / meas_best["measured_step_time_s"] - 1
    return {"rows": rows, "mape": report["mape"], "mean_error": report["mean_error"],
            "worst": report["worst"], "spearman": report["spearman"],
            "best_plan_match": bool(gap <= BEST_PLAN_TOLERANCE),
            "predicted_best": pred_best["id"], "measured_best": meas_best["id"],
            "predicted_best_gap": float(gap)}


def _fmt_corr(value: float | None) -> str:
    return "n/a (needs 2 plans)" if value is None else f"{value:.2f}"


def summary_line(result: dict) -> str:
    """One line: MAPE, worst plan, Spearman, best-plan match."""
    worst = result.get("worst") or {"id": "-", "rel_error": float("nan")}
    match = "yes" if result["best_plan_match"] else "no"
    mape = "n/a" if result["mape"] is None else f"{100 * result['mape']:.1f}%"
    return (f"MAPE {mape} over {len(result['rows'])} plans; worst "
            f"{worst['id']} {100 * worst['rel_error']:+.1f}%; Spearman "
            f"{_fmt_corr(result['spearman'])}; predicted best {result.get('predicted_best')} vs "
            f"measured best {result.get('measured_best')}: {match} "
            f"(a plan within {100 * BEST_PLAN_TOLERANCE:.0f}% of the measured best counts)")


def plot_compare(df: pd.DataFrame, path: Path, result: dict | None = None) -> None:
    """Predicted vs measured step time per plan (log-log scatter, y = x and ±10% band)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5.5))
    meas, pred = df["measured_step_time_s"] * 1e3, df["predicted_step_time_s"] * 1e3
    lo, hi = 0.8 * min(meas.min(), pred.min()), 1.25 * max(meas.max(), pred.max())
    line = [lo, hi]
    ax.plot(line, line, color="grey", lw=1, label="predicted = measured")
    ax.fill_between(line, [0.9 * v for v in line], [1.1 * v for v in line], color="grey",
                    alpha=0.15, label="±10%")
    for ws, marker in ((1, "o"), (2, "s"), (4, "^")):
        sel = df["world_size"] == ws
        ax.scatter(meas[sel], pred[sel], marker=marker, s=40, label=f"{ws} rank(s)")
    for m, p, rid in zip(meas, pred, df["id"], strict=True):
        ax.annotate(rid.replace("-gb8", ""), (m, p), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    title = "localhost-cpu: predicted vs measured"
    if result and result.get("rows"):
        title += (f"\nMAPE {100 * result['mape']:.1f}%, Spearman "
                  f"{_fmt_corr(result['spearman'])}, "
                  f"{len(result['rows'])} plans")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Predicted vs measured on this machine: plan tiny-gpt on localhost-cpu, run the plans, line up.

This module orchestrates the library calls behind `meshplan compare`; the modelling lives in
`simulator`, the execution in `runtime`.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from rich.console import Console  # noqa: E402

from apps.format import fmt_pct, fmt_rate, fmt_time_s, print_table  # noqa: E402
from planner.planfile import PlanFile, write_plan_file  # noqa: E402
from planner.presets import load_model  # noqa: E402
from planner.search import search  # noqa: E402
from planner.spec import ModelSpec, Plan  # noqa: E402

#: The plans `compare` runs: world size -> (tp, pp, dp) splits. One rank is the baseline.
COMPARE_SPLITS = {1: [(1, 1, 1)], 2: [(1, 1, 2), (2, 1, 1), (1, 2, 1)]}
COMPARE_GLOBAL_BATCH = 8
COMPARE_TABLE = {"id": ("plan", None), "world_size": ("ranks", None),
                 "predicted_step_time_s": ("predicted step", fmt_time_s),
                 "measured_step_time_s": ("measured step", fmt_time_s),
                 "rel_error": ("error", fmt_pct),
                 "predicted_tokens_per_s": ("predicted tokens/s", fmt_rate),
                 "measured_tokens_per_s": ("measured tokens/s", fmt_rate)}


def local_plans(model: ModelSpec, profile) -> list[tuple[Plan, object, dict]]:
    """For each split in `COMPARE_SPLITS`, the best micro-batch size the planner finds.

    Returns ``(plan, cluster, prediction dict)`` per split, in `COMPARE_SPLITS` order.
    """
    from simulator.cluster import load_cluster
    chosen = []
    for ranks, splits in COMPARE_SPLITS.items():
        cluster = load_cluster("localhost-cpu", ranks=ranks, profile=profile)
        result = search(model, cluster, global_batch=COMPARE_GLOBAL_BATCH, num_devices=ranks,
                        dtype="fp32", recompute=("none",), top_k=1000)
        for tp, pp, dp in splits:
            rows = result.ranked[(result.ranked.tp == tp) & (result.ranked.pp == pp)
                                 & (result.ranked.dp == dp) & ~result.ranked.sequence_parallel]
            if rows.empty:
                raise RuntimeError(f"the planner found no legal tp{tp}-pp{pp}-dp{dp} plan")
            plan_id = rows.iloc[0]["id"]
            chosen.append((result.plans[plan_id], cluster,
                           result.predictions[plan_id].to_dict()))
    return chosen


def compare(*, steps: int = 8, out_dir: Path = Path("runs/compare"),
            console: Console | None = None) -> dict:
    """Run each local plan for ``steps`` steps and compare predicted with measured step time.

    Returns (and writes to ``out_dir/compare.json``) ``{"rows": [...], "mape": float,
    "assumptions": {...}}``; each row has id, predicted/measured step_time_s and tokens_per_s,
    and rel_error = (predicted − measured) / measured of the step time. Also writes
    ``out_dir/compare.png``.
    """
    from runtime.launch import run_plan
    from simulator.probe import measure_cpu_profile
    console = console or Console()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = load_model("tiny-gpt")
    console.print("measuring this CPU (fp32 GEMM at tiny-gpt's shapes, memory bandwidth) ...")
    profile = measure_cpu_profile(model=model)
    rows = []
    for plan, cluster, pred in local_plans(model, profile):
        run_dir = out_dir / plan.id
        plan_path = write_plan_file(run_dir / "plan.yaml", PlanFile(
            model=model, plan=plan, prediction=pred,
            cluster={"name": cluster.name, "nodes": 1, "ranks": plan.world_size,
                     "peak_flops_per_device": cluster.device.peak(plan.dtype)}))
        console.print(f"running {plan.id} ({plan.world_size} rank(s) on the machine's cores, "
                      f"{steps} steps) ...")
        summary = run_plan(plan_path, steps=steps, out_dir=run_dir)
        measured = summary["step_time_s"]
        rows.append({"id": plan.id, "world_size": plan.world_size,
                     "predicted_step_time_s": pred["step_time_s"],
                     "measured_step_time_s": measured,
                     "rel_error": (pred["step_time_s"] - measured) / measured,
                     "predicted_tokens_per_s": pred["tokens_per_s"],
                     "measured_tokens_per_s": summary["tokens_per_s"],
                     "final_loss": summary["final_loss"]})
    df = pd.DataFrame(rows)
    mape = float(df["rel_error"].abs().mean())
    result = {"rows": rows, "mape": mape, "steps": steps, "assumptions": {
        "model": model.name, "global_batch": COMPARE_GLOBAL_BATCH, "seq_len": model.seq_len,
        "dtype": "fp32", "threads_per_rank": 1, "device_profile": profile_dict(profile),
        "measured": "median step time after the first (warm-up) step, rank 0"}}
    (out_dir / "compare.json").write_text(json.dumps(result, indent=2))
    plot_compare(df, out_dir / "compare.png")
    print_table(console, df, "predicted vs measured (tiny-gpt, localhost-cpu, 1 thread per rank)",
                COMPARE_TABLE)
    console.print(f"MAPE {100 * mape:.1f}% over {len(df)} plans; wrote {out_dir / 'compare.json'}"
                  f" and {out_dir / 'compare.png'}")
    return result


def profile_dict(profile) -> dict:
    """The device profile fields that shaped the predictions (SI units)."""
    return {"name": profile.name, "peak_flops": dict(profile.peak_flops),
            "matmul_efficiency": profile.matmul_efficiency,
            "memory_bandwidth_Bps": profile.memory_bandwidth_Bps,
            "memory_efficiency": profile.memory_efficiency}


def plot_compare(df: pd.DataFrame, path: Path) -> None:
    """Grouped bars of predicted and measured step time per plan, saved as PNG."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(df))
    ax.bar([i - 0.2 for i in x], df["predicted_step_time_s"] * 1e3, 0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], df["measured_step_time_s"] * 1e3, 0.4, label="measured")
    ax.set_xticks(list(x), df["id"], rotation=15, fontsize=8)
    ax.set_ylabel("step time (ms)")
    ax.set_title("tiny-gpt on localhost-cpu: predicted vs measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

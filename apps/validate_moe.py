"""The mixture-of-experts rows of a `meshplan validate --loso` run: each MoE row predicted
with the shipped efficiency entries (SimPy) and held out of the refit of its own source."""

from __future__ import annotations

from rich.console import Console

from apps.format import fmt_pct, fmt_time_s, print_table

MOE_COLUMNS = {"id": ("id", None), "model": ("model", None), "gpu": ("gpu", None),
               "num_gpus": ("gpus", None), "plan": ("plan", None),
               "reference_step_time_s": ("reference", fmt_time_s),
               "predicted_step_time_s": ("predicted", fmt_time_s),
               "rel_error": ("error", lambda x: f"{100 * x:+.1f}%"),
               "held_out_step_time_s": ("held-out", fmt_time_s),
               "held_out_rel_error": ("held-out error", lambda x: _pct_or_dash(x))}


def _pct_or_dash(x: float | None) -> str:
    # pandas turns a missing held-out figure into NaN
    return "-" if x is None or x != x else f"{100 * x:+.1f}%"


def moe_rows(paths: list[str], entries: list[dict]) -> list[dict]:
    """One dict per MoE row of the tables at ``paths``: its SimPy prediction with the shipped
    entries and its held-out (leave-one-source-out) prediction from ``entries``
    (`apps.cmd_validate.loso_report`; None where its source was alone on its device)."""
    from simulator.validation.report import rel_error
    from simulator.validation.validate import predict, read_runs, validation_cluster
    held = {r["id"]: r for e in entries if e["held_out"] for r in e["held_out"]["rows"]}
    out = []
    for path in paths:
        for case in read_runs(path, []):
            if not case.model.is_moe:
                continue
            pred = predict(case)
            h = held.get(case.id)
            out.append({"id": case.id, "model": case.model.name.split(" (")[0],
                        "gpu": validation_cluster(case.cluster_name, 1).device.name,
                        "num_gpus": case.plan.world_size, "plan": case.plan.id,
                        "reference_step_time_s": case.reference_step_time_s,
                        "predicted_step_time_s": pred,
                        "rel_error": rel_error(pred, case.reference_step_time_s),
                        "held_out_step_time_s": h["predicted_step_time_s"] if h else None,
                        "held_out_rel_error": h["rel_error"] if h else None})
    return out


def print_moe(console: Console, rows: list[dict]) -> None:
    """The MoE table and its MAPE, worst row and held-out MAPE (rows that have one)."""
    if not rows:
        return
    import pandas as pd
    df = pd.DataFrame(rows)
    cols = {**MOE_COLUMNS, "held_out_step_time_s": (
        "held-out", lambda x: "-" if x is None or x != x else fmt_time_s(x))}
    print_table(console, df, "mixture-of-experts rows (predicted: shipped entries, SimPy)",
                cols)
    errs = [abs(r["rel_error"]) for r in rows]
    held = [abs(r["held_out_rel_error"]) for r in rows if r["held_out_rel_error"] is not None]
    worst = max(rows, key=lambda r: abs(r["rel_error"]))
    console.print(f"MoE rows: {len(rows)}  MAPE {fmt_pct(sum(errs) / len(errs))}  worst "
                  f"{worst['id']} {100 * worst['rel_error']:+.1f}%  held-out MAPE "
                  f"{fmt_pct(sum(held) / len(held)) if held else '-'} ({len(held)} rows)",
                  highlight=False)

"""`meshplan validate`: predicted vs reference step time of real training runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from apps.format import (
    check_at_least,
    check_image_path,
    check_output_path,
    fmt_pct,
    fmt_time_s,
    output_file,
    print_json,
    print_table,
    write_csv,
)

if TYPE_CHECKING:
    from rich.console import Console

COLUMNS = {"id": ("id", None), "model": ("model", None), "num_gpus": ("gpus", None),
           "tp": ("tp", None), "pp": ("pp", None), "dp": ("dp", None),
           "predicted_step_time_s": ("predicted", fmt_time_s),
           "reference_step_time_s": ("reference", fmt_time_s),
           "rel_error": ("error", lambda x: f"{100 * x:+.1f}%")}
#: The table of ``--context-parallel``: the cp degree and the sequence length beside the rest.
CP_COLUMNS = {**{k: v for k, v in COLUMNS.items() if k != "dp"}, "dp": ("dp", None),
              "cp": ("cp", None), "seq_len": ("seq", None)}


def defaults_used(rows: list[dict], show: int = 6) -> list[str]:
    """One line per flag (a setting a row did not give, or a chosen split) with the ids of
    the rows it applies to, most common first; at most ``show`` ids per line.

    >>> defaults_used([{"id": "a", "flags": ["x=1"]}, {"id": "b", "flags": ["x=1", "y"]}])
    ['x=1: 2 rows (a, b)', 'y: 1 row (b)']
    """
    ids: dict[str, list[str]] = {}
    for row in rows:
        for flag in row["flags"]:
            ids.setdefault(flag, []).append(row["id"])
    lines = []
    for flag, who in sorted(ids.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        more = ", ..." if len(who) > show else ""
        lines.append(f"{flag}: {len(who)} row{'s' if len(who) > 1 else ''} "
                     f"({', '.join(who[:show])}{more})")
    return lines


def plot_scatter(results: dict[str, dict], path: str) -> None:
    """Predicted vs reference step time of each named result (log-log), ±25% band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 6.0))
    lo, hi = float("inf"), 0.0
    for name, result in results.items():
        ref = [r["reference_step_time_s"] for r in result["rows"]]
        pred = [r["predicted_step_time_s"] for r in result["rows"]]
        lo, hi = min(lo, *ref, *pred), max(hi, *ref, *pred)
        ax.scatter(ref, pred, s=10, alpha=0.6,
                   label=f"{name} (n={len(ref)}, MAPE {100 * result['mape']:.1f}%)")
    xs = [lo / 1.5, hi * 1.5]
    ax.plot(xs, xs, "k-", lw=0.8)
    for f in (0.75, 1.25):
        ax.plot(xs, [x * f for x in xs], "k:", lw=0.6)
    ax.set(xscale="log", yscale="log", xlabel="reference step time (s)",
           ylabel="predicted step time (s)", title="meshplan validate: predicted vs measured")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=120)
    plt.close(fig)


def _loso_cell(fig: dict | None, key: str) -> str:
    if fig is None:
        return "-"
    if key == "worst":
        return f"{fig['worst']['id']} {100 * fig['worst']['rel_error']:+.1f}%"
    return f"{100 * fig[key]:+.1f}%" if key == "mean_error" else f"{100 * fig[key]:.1f}%"


def loso_report(paths: list[str], iters: int) -> list[dict]:
    """Leave-one-source-out figures of every device the tables at ``paths`` run on
    (`simulator.validation.fit.leave_one_source_out`, ``iters`` iterations per refit)."""
    from simulator.validation.fit import fitted_devices, leave_one_source_out
    from simulator.validation.validate import read_runs
    tables = [read_runs(p, []) for p in paths]
    out: list[dict] = []
    for device in fitted_devices([c for t in tables for c in t]):
        out += leave_one_source_out(tables, device, iters=iters)
    return out


def print_loso(console: Console, entries: list[dict], iters: int) -> None:
    """The per-source table: rows, MAPE, mean signed error and worst row, in-fit and held
    out."""
    import pandas as pd
    df = pd.DataFrame([{"device": e["device"], "source": e["source"], "rows": e["rows"],
                        **{f"{w}_{k}": _loso_cell(e[w], k) for w in ("in_fit", "held_out")
                           for k in ("mape", "mean_error", "worst")}} for e in entries])
    cols = {"device": ("device", None), "source": ("source", None), "rows": ("rows", None),
            "in_fit_mape": ("in-fit MAPE", None), "in_fit_mean_error": ("in-fit bias", None),
            "in_fit_worst": ("in-fit worst", None),
            "held_out_mape": ("held-out MAPE", None),
            "held_out_mean_error": ("held-out bias", None),
            "held_out_worst": ("held-out worst", None)}
    print_table(console, df, f"leave-one-source-out (closed form, {iters} Nelder-Mead "
                f"iterations per refit)", cols)


#: ``--by`` names of `held_out_report` groups: the GPU (device profile) and the precision.
HELD_OUT_KEYS = {"gpu": "device", "precision": "dtype"}


def held_out_report(paths: list[str], *, by_gpu: bool, by: tuple[str, ...],
                    iters: int, dense: bool = False) -> tuple[list[dict], list[dict]]:
    """Held-out figures of the carried efficiency terms (`simulator.validation.carry`):
    each row predicted with the terms fitted without its source (``by_gpu`` False) or
    without its GPU type (leave-one-GPU-out), grouped by ``by`` (``gpu``, ``precision``);
    ``dense``: the dense rows only (fitted and reported), no mixture-of-experts row.
    Returns the groups (`summarize`) and the per-row errors (`held_out_errors`).

    Raises:
        PlanError: a ``--by`` name other than gpu / precision.
    """
    from planner.spec import PlanError
    from simulator.validation.carry import case_device, held_out_errors, summarize
    from simulator.validation.validate import read_runs
    bad = [b for b in by if b not in HELD_OUT_KEYS]
    if bad:
        raise PlanError(f"--by {','.join(bad)}: with --loso-carried / --logo group by "
                        f"{' and/or '.join(HELD_OUT_KEYS)}")
    cases = [c for p in paths for c in read_runs(p, []) if not (dense and c.model.is_moe)]
    group = (lambda c: case_device(c).name) if by_gpu else (lambda c: c.source)
    errors = held_out_errors(cases, group, iters=iters)
    return summarize(errors, [HELD_OUT_KEYS[b] for b in by or ("gpu",)]), errors


def print_held_out(console: Console, entries: list[dict], title: str) -> None:
    """The held-out table of `held_out_report`."""
    import pandas as pd
    pct, sig = "{:.1%}".format, "{:+.1%}".format
    cols = {k: (k, None) for k in ("device", "dtype") if entries and k in entries[0]}
    cols.update({"rows": ("rows", None), "in_fit_mape": ("in-fit MAPE", pct),
                 "held_out_mape": ("held-out MAPE", pct), "held_out_bias": ("bias", sig),
                 "worst": ("worst", None), "worst_error": ("worst error", sig)})
    print_table(console, pd.DataFrame(entries), title, cols)


def _held_out(args: argparse.Namespace) -> int:
    from rich.console import Console  # here, not at import: `--help` stays fast

    by = tuple(f.strip() for f in args.by.split(",")) if args.by else ()
    paths = [args.runs, *(args.loso_with or [])]
    entries, errors = held_out_report(paths, by_gpu=args.logo, by=by, iters=args.loso_iters,
                                      dense=args.dense)
    kind = "leave-one-GPU-out" if args.logo else "leave-one-source-out"
    if args.json:
        print_json({"held_out": entries, "rows": errors, "kind": kind,
                    "iters": args.loso_iters})
    else:
        print_held_out(Console(), entries, f"{kind}, carried efficiency terms (closed form, "
                       f"{args.loso_iters} Nelder-Mead iterations per refit)")
    return 0


#: The modes of `validate` that replace the table, by flag.
MODES = ("--loso", "--loso-carried", "--logo")


def check_validate_args(args: argparse.Namespace) -> None:
    """Before any work: raise `PlanError` naming the flag when ``validate``'s flags do not go
    together (two modes, a mode's option without its mode) or a count is out of range.

    Raises:
        PlanError: the first such flag, with the fix.
    """
    from planner.spec import PlanError
    given = [m for m in MODES if getattr(args, m.lstrip("-").replace("-", "_"), False)]
    if len(given) > 1:
        raise PlanError(f"{' and '.join(given)}: give one of {', '.join(MODES)} (each prints "
                        f"its own table)")
    mode = given[0] if given else None
    check_at_least("--top", getattr(args, "top", None), hint="rows to print; leave it out "
                   "for all")
    if getattr(args, "dense", False) and mode not in ("--loso-carried", "--logo"):
        raise PlanError("--dense acts only with --loso-carried or --logo; add one, or leave "
                        "--dense out")
    if getattr(args, "loso_with", None) and mode is None:
        raise PlanError(f"--with {' '.join(args.loso_with)}: more tables are read only by "
                        f"{', '.join(MODES)}; add one, or leave --with out")
    if mode is None and getattr(args, "loso_iters", 40) != 40:
        raise PlanError(f"--loso-iters={args.loso_iters} acts only with {', '.join(MODES)}; "
                        f"add one, or leave --loso-iters out")
    check_at_least("--loso-iters", getattr(args, "loso_iters", None), least=0,
                   hint="0: the efficiency.yaml entries, no refit")


def cmd_validate(args: argparse.Namespace) -> int:
    """Simulate every row of ``--runs`` and print the table (or ``--json``)."""
    from rich.console import Console  # here, not at import: `--help` stays fast

    from simulator.validation.validate import validate_runs
    check_validate_args(args)
    check_output_path("--csv", getattr(args, "csv", None))
    check_image_path("--plot", getattr(args, "plot", None))
    from planner.spec import PlanError
    from planner.userfile import read_text
    for flag, path in (("--runs", args.runs), *(("--with", p) for p in args.loso_with or [])):
        if not Path(path).exists():
            raise PlanError(f"{flag} {path!r}: no such file; give published_runs.csv, "
                            f"published_benchmarks.csv or a vTrain ground_truth_*.csv (e.g. "
                            f"../shared/data/published_runs.csv)")
        read_text(path, f"{flag} table")   # a folder, not UTF-8: named here
    if getattr(args, "logo", False) or getattr(args, "loso_carried", False):
        return _held_out(args)
    if getattr(args, "loso", False):
        paths = [args.runs, *(args.loso_with or [])]
        from apps.validate_moe import moe_rows, print_moe
        entries = loso_report(paths, args.loso_iters)
        moe = moe_rows(paths, entries)
        if args.json:
            print_json({"loso": entries, "iters": args.loso_iters, "moe": moe})
        else:
            print_loso(Console(), entries, args.loso_iters)
            print_moe(Console(), moe)
        return 0
    only_cp = getattr(args, "context_parallel", False)
    result = validate_runs(args.runs, keep=(lambda case: case.plan.cp > 1) if only_cp else None)
    if not result["rows"]:
        # only --context-parallel leaves none without an error above: the table has no cp row
        from planner.spec import PlanError
        raise PlanError(f"--context-parallel: {args.runs} has no row with cp > 1 that could "
                        f"be simulated; give a table with context-parallel rows (e.g. "
                        f"../shared/data/published_runs.csv) or leave out --context-parallel")
    if getattr(args, "csv", None):
        write_csv(result["rows"], args.csv)
    if getattr(args, "plot", None) and result["rows"]:
        plot_scatter({Path(args.runs).stem: result}, args.plot)
    by = tuple(f.strip() for f in args.by.split(",")) if getattr(args, "by", None) else ()
    if by and result["rows"]:
        from simulator.validation.validate import error_by
        table = error_by(args.runs, by, result)
    if args.json:
        if by and result["rows"]:
            result = {**result, "by": {"fields": list(by), "groups": table.reset_index()
                                       .to_dict(orient="records"),
                                       "mape_if_unbiased": table.attrs["mape_if_unbiased"]}}
        print_json(result)
        return 0
    console = Console()
    for row in result["skipped"]:
        console.print(f"skipped {row['id']}: {row['reason']}", highlight=False,
                      soft_wrap=True, markup=False)
    import pandas as pd
    df = pd.DataFrame(result["rows"])
    title = "context-parallel rows (cp > 1)" if only_cp else "predicted vs reference step time"
    print_table(console, df, f"{args.runs}: {title}", CP_COLUMNS if only_cp else COLUMNS,
                limit=args.top)
    worst = max(result["rows"], key=lambda r: abs(r["rel_error"]))
    console.print(f"{len(df)} rows  MAPE {fmt_pct(result['mape'])}  worst {worst['id']} "
                  f"({worst['model']}) {100 * worst['rel_error']:+.1f}%", highlight=False)
    if by and result["rows"]:
        pct = "{:.1%}".format

        def cell(x: object) -> str:     # iterrows turns a mixed row's ints into floats
            return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)
        print_table(console, table.reset_index(), f"error by {', '.join(by)}",
                    {**{f: (f, cell) for f in by}, "rows": ("rows", cell),
                     "bias": ("bias", "{:+.1%}".format), "mape": ("MAPE", pct),
                     "spread": ("spread", pct)})
        console.print(f"MAPE once each group's bias is removed: "
                      f"{fmt_pct(table.attrs['mape_if_unbiased'])}", highlight=False)
    lines = defaults_used(result["rows"])
    if lines:
        console.print("settings the rows do not give (documented defaults; per row in "
                      "--json / --csv):", highlight=False)
        for line in lines:
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``validate`` on the subcommand parser ``sub``."""
    sv = sub.add_parser("validate", help="simulate published / vTrain runs, report the error")
    sv.add_argument("--runs", required=True, help="published_runs.csv or a vTrain "
                    "ground_truth_*.csv (format detected by header)")
    sv.add_argument("--top", type=int, help="rows to print (default all)")
    sv.add_argument("--plot", metavar="PNG", help="also write a predicted-vs-reference plot")
    sv.add_argument("--by", metavar="FIELD[,FIELD]", help="also print the error grouped by "
                    "plan or model fields, e.g. --by hidden,tp,micro_batch (bias, MAPE and "
                    "spread per group)")
    sv.add_argument("--context-parallel", action="store_true", help="only the rows with "
                    "cp > 1: their own table and MAPE (with their cp and sequence length)")
    sv.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    sv.add_argument("--csv", metavar="FILE", help="also write the rows as CSV (SI units)")
    sv.add_argument("--loso", action="store_true", help="instead: per source (paper or "
                    "repository), rows / MAPE / mean signed error / worst row, in-fit and "
                    "leave-one-source-out, refitting each device's efficiency parameters")
    sv.add_argument("--with", dest="loso_with", nargs="+", metavar="CSV", help="with --loso, "
                    "--loso-carried or --logo: more tables fitted and reported together with "
                    "--runs")
    sv.add_argument("--loso-iters", type=int, default=40, metavar="N", help="with --loso, "
                    "--loso-carried or --logo: Nelder-Mead iterations per refit (default 40; the shipped fit used 300, "
                    "~0.8 s per iteration on the A100 tables)")
    sv.add_argument("--loso-carried", action="store_true", help="instead: fit the "
                    "efficiency terms that carry across GPU generations (one set, every "
                    "device from its datasheet) without each source in turn; with --by "
                    "gpu,precision the held-out error per GPU and precision")
    sv.add_argument("--logo", action="store_true", help="instead: leave-one-GPU-out: the "
                    "carried terms fitted without every row of one GPU type, that type "
                    "predicted from its datasheet (--by gpu[,precision])")
    sv.add_argument("--dense", action="store_true", help="with --loso-carried / --logo: "
                    "dense rows only (no mixture-of-experts row is fitted or reported)")
    sv.set_defaults(func=cmd_validate)

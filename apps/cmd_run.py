"""`meshplan run PLAN.yaml`: train a plan file with torchrun on this machine; the resolved
configuration is echoed and saved beside the run's outputs (`apps.run_config`).

    meshplan run tiny.yaml --steps 4 --checkpoint-every 2 --out runs/tiny
    meshplan run tiny.yaml --inject kill:rank=1,step=7 --max-restarts 1
"""

from __future__ import annotations

import argparse
import sys

from apps.cmd_faults import add_run_fault_args
from apps.format import command_console, fmt_rate, fmt_time_s, print_json


def cmd_run(args: argparse.Namespace) -> int:
    from apps.cmd_faults import restart_line, run_fault_kwargs
    from apps.run_config import (
        check_run_args,
        echo_run_config,
        resolved_run_config,
        save_run_config,
        with_step_progress,
    )
    from runtime.launch import RunFailed, RunInterrupted, run_plan
    console = command_console(args)
    check_run_args(args)
    config = resolved_run_config(args.plan, steps=args.steps, out_dir=args.out, data=args.data,
                                 faults=run_fault_kwargs(args), ep=args.ep)
    echo_run_config(console, config)
    console.print(f"  saved   {save_run_config(config)}", highlight=False, markup=False)
    try:
        summary = with_step_progress(console, config, lambda: run_plan(
            args.plan, steps=args.steps, out_dir=config["out_dir"], data=args.data, ep=args.ep,
            **run_fault_kwargs(args)))
    except RunInterrupted as exc:         # SIGTERM / Ctrl-C: one line, the shell's status
        print(exc, file=sys.stderr, flush=True)
        return 128 + exc.signum
    except RunFailed as exc:              # one line; the tracebacks are in the run's logs/
        if args.json:
            print_json(exc.summary)
        print(exc.line, file=sys.stderr, flush=True)
        return 1
    if args.json:
        print_json(summary)
    elif not summary["steps"]:              # every step was done before (summarize)
        console.print(f"{summary['plan_id']}: no step left to train", markup=False)
    else:
        console.print(f"{summary['plan_id']}: {summary['steps']} steps, final loss "
                      f"{summary['final_loss']:.4f}, median step {fmt_time_s(summary['step_time_s'])}"
                      f"{' (after step 1)' if summary['steps'] > 1 else ''}, "
                      f"{fmt_rate(summary['tokens_per_s'])} tokens/s", markup=False)
        if (line := restart_line(summary)) is not None and summary["restarts"]:
            console.print(line, highlight=False, markup=False)
        if (line := predicted_line(summary)) is not None:
            console.print(line, highlight=False, markup=False)
    return 0


def predicted_line(summary: dict) -> str | None:
    """``predicted vs measured: step 0.41 s vs 0.44 s (error -6.0%), ...`` from summary.json's
    ``prediction`` (the plan file's) and the run's median figures; None without a prediction.
    The error is predicted / measured − 1 (`simulator.validation.report.rel_error`, as
    `meshplan compare` reports it)."""
    pred = summary.get("prediction") or {}
    if not pred.get("step_time_s") or not summary.get("step_time_s"):
        return None
    from simulator.validation.report import rel_error
    parts = [f"step {fmt_time_s(pred['step_time_s'])} vs {fmt_time_s(summary['step_time_s'])}"
             f" (error {rel_error(pred['step_time_s'], summary['step_time_s']):+.1%})"]
    if pred.get("tokens_per_s") and summary.get("tokens_per_s"):
        parts.append(f"tokens/s {fmt_rate(pred['tokens_per_s'])} vs "
                     f"{fmt_rate(summary['tokens_per_s'])}")
    if pred.get("mfu") is not None and summary.get("mfu") is not None:
        parts.append(f"MFU {pred['mfu']:.1%} vs {summary['mfu']:.1%}")
    return "predicted vs measured: " + ", ".join(parts)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``run`` on the subcommand parser ``sub``."""
    sr = sub.add_parser("run", help="train a plan file with torchrun on this machine")
    sr.add_argument("plan", help="plan file (YAML)")
    sr.add_argument("--steps", type=int, default=10)
    sr.add_argument("--data", help="text file to train on (default: Python stdlib sources)")
    sr.add_argument("--out", help="run folder (default runs/<plan id>)")
    sr.add_argument("--json", action="store_true", help="print summary.json on stdout")
    sr.add_argument("--ep", type=int, default=None, metavar="N",
                    help="expert parallel degree of a mixture-of-experts plan, folded into its "
                         "dp ranks (default: the plan's ep, else 1)")
    add_run_fault_args(sr)
    sr.set_defaults(func=cmd_run)

"""`meshplan compare`: predict, run and compare local plans on this machine (the sweep and its
report live in `apps.compare`).

    meshplan compare                      # the default plans (`apps.compare.DEFAULT_PLANS`)
    meshplan compare --sweep --steps 8    # every `apps.compare.SWEEP` plan, 1, 2 and 4 ranks
"""

from __future__ import annotations

import argparse
from pathlib import Path

from apps.clusters import add_cpu_profile_option
from apps.format import command_console, print_json


def cmd_compare(args: argparse.Namespace) -> int:
    from apps.format import check_at_least
    # checked before the first run starts
    check_at_least("--steps", args.steps, hint="steps each plan runs; default 12")
    from apps.compare import DEFAULT_PLANS, compare, plan_indices
    from apps.format import check_output_path
    check_output_path("--csv", getattr(args, "csv", None))
    check_output_path("--out", args.out, folder=True)
    console = command_console(args)
    plans = None if getattr(args, "sweep", False) else DEFAULT_PLANS
    if getattr(args, "plans", None):
        plans = plan_indices(args.plans)
    result = compare(steps=args.steps, out_dir=Path(args.out), console=console, plans=plans,
                     cpu_profile=getattr(args, "cpu_profile", None))
    if getattr(args, "csv", None):
        from apps.format import write_csv
        write_csv(result["rows"], args.csv)
    if args.json:
        print_json(result)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``compare`` on the subcommand parser ``sub``."""
    sc = sub.add_parser("compare", help="predict, run and compare local DP/TP/PP plans")
    sc.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    from apps.compare_plans import DEFAULT_PLANS, SWEEP  # the counts are the lists' own
    sc.add_argument("--sweep", action="store_true", help=f"the full sweep ({len(SWEEP)} plans, "
                    f"~2-5 min) instead of the {len(DEFAULT_PLANS)} default plans")
    sc.add_argument("--plans", nargs="+", metavar="ID", help="only these sweep plans "
                    "(ids as in the table, e.g. tp1-pp1-dp4-mb2-gb8)")
    sc.add_argument("--out", default="runs/compare")
    sc.add_argument("--json", action="store_true")
    sc.add_argument("--csv", metavar="FILE", help="also write the rows as CSV (SI units)")
    add_cpu_profile_option(sc)
    sc.set_defaults(func=cmd_compare)

"""`meshplan export PLAN.yaml --to megatron|torchtitan|deepspeed`: the plan in the words of
that framework, on stdout; what the framework cannot express, one line each, on stderr.

    meshplan export plan.yaml --to megatron > args.txt      # pretrain_gpt.py arguments
    meshplan export plan.yaml --to torchtitan > job.toml    # a torchtitan job TOML
    meshplan export plan.yaml --to deepspeed > ds.json      # a DeepSpeed config
"""

from __future__ import annotations

import argparse
import dataclasses

from apps.format import print_json
from planner.export import FRAMEWORKS


def cmd_export(args: argparse.Namespace) -> int:
    from apps.format import check_at_least
    from planner.export import export_plan
    from planner.planfile import read_plan_file
    from planner.spec import PlanError
    check_at_least("--steps", args.steps)
    from rich.console import Console
    console = Console(stderr=True)  # stdout holds only what to paste
    pf = read_plan_file(args.plan)
    from apps.clusters import check_plan_on_cluster, cluster_of_plan_file, memory_overrun
    cluster = cluster_of_plan_file(pf)
    check_plan_on_cluster(pf, cluster)
    if (reason := memory_overrun(pf, cluster)) is not None:
        if not args.allow_oom:
            raise PlanError(f"plan {pf.plan.id} does not fit on {cluster.device.name}: "
                            f"{reason}; the {args.to} job would stop out of memory: make a "
                            f"plan that fits (`meshplan plan ... --out`), or give --allow-oom "
                            f"to export it anyway")
        console.print(f"warning: {pf.plan.id} does not fit on {cluster.device.name}: "
                      f"{reason} (exported as --allow-oom asks)", highlight=False, markup=False)
    elif args.allow_oom:
        console.print(f"note: --allow-oom has no effect: {pf.plan.id} fits on "
                      f"{cluster.device.name}", highlight=False, markup=False)
    out = export_plan(pf.model, pf.plan, args.to, steps=args.steps)
    if args.json:
        print_json({"id": pf.plan.id, **dataclasses.asdict(out)})
        return 0
    print(out.text, end="" if out.text.endswith("\n") else "\n")
    for reason in out.unsupported:
        console.print(f"not expressed in {args.to}: {reason}", highlight=False, markup=False)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``export`` on the subcommand parser ``sub``."""
    sp = sub.add_parser("export", help="print a plan file as Megatron-LM arguments, a "
                        "torchtitan TOML or a DeepSpeed JSON")
    sp.add_argument("plan", help="plan file (YAML)")
    sp.add_argument("--to", required=True, choices=FRAMEWORKS, help="target framework")
    sp.add_argument("--steps", type=int, help="training steps to write where the framework "
                    "takes them (Megatron --train-iters, torchtitan training.steps)")
    sp.add_argument("--json", action="store_true", help="one JSON object: names, text, "
                    "unsupported")
    sp.add_argument("--allow-oom", action="store_true", help="export a plan whose peak "
                    "memory per rank exceeds the device's usable memory (refused by default: "
                    "the job would stop out of memory)")
    sp.set_defaults(func=cmd_export)

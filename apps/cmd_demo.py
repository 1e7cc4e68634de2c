"""`meshplan demo`: plan Llama 3 70B on 512 H100s, calibrate this machine if it has no profile
yet, then predict, run and compare tiny-gpt plans here (`make demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from apps.cmd_compare import cmd_compare
    from apps.cmd_plan import cmd_plan
    from apps.format import check_at_least, check_output_path
    check_at_least("--steps", args.steps, hint="steps each tiny-gpt plan runs; default 8")
    from simulator.network.cpu_profile import default_profile_dir, newest_profile
    check_output_path("--out", args.out, folder=True)
    console = Console()
    console.rule("1. plan Llama 3 70B on 64 DGX H100 nodes (512 GPUs)")
    code = cmd_plan(argparse.Namespace(
        model="llama3-70b", cluster="dgx-h100", nodes=64, ranks=None, global_batch=None,
        seq_len=None, top_k=20, top=10, out=str(Path(args.out) / "llama3-70b-plan.yaml"),
        json=False))
    if code:
        return code
    if newest_profile(default_profile_dir()) is None:
        # Without a profile the localhost-cpu cluster only has generic CPU defaults; the
        # comparison is only worth reading against this machine's own measurements.
        console.rule(f"2. no profile of this machine in {default_profile_dir()} yet: "
                     f"meshplan calibrate")
        from apps.cmd_calibrate import cmd_calibrate
        cmd_calibrate(argparse.Namespace(ranks=4, out=None, models=None, iters=5, json=False))
    console.rule("3. predicted vs measured: tiny-gpt on this machine")
    return cmd_compare(argparse.Namespace(steps=args.steps, out=args.out, json=False))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``demo`` on the subcommand parser ``sub``."""
    sd = sub.add_parser("demo", help="plan Llama 3 70B on 512 H100s, calibrate this machine "
                        "if it has no profile yet, then run compare")
    sd.add_argument("--steps", type=int, default=8)
    sd.add_argument("--out", default="runs/demo")
    sd.set_defaults(func=cmd_demo)

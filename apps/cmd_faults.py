"""`meshplan run`'s fault-tolerance flags and the restart line of its report."""

from __future__ import annotations

import argparse


def add_run_fault_args(parser: argparse.ArgumentParser) -> None:
    """--checkpoint-every, --keep, --resume, --inject, --timeout-s, --on-nan, --max-restarts."""
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                        help="asynchronous checkpoint (torch.distributed.checkpoint) every K "
                             "steps into OUT/checkpoints (default 0: none)")
    parser.add_argument("--keep", type=int, default=2, metavar="N",
                        help="newest checkpoints kept (default 2)")
    parser.add_argument("--resume", metavar="DIR",
                        help="start from the newest valid checkpoint in DIR")
    parser.add_argument("--inject", action="append", default=[], metavar="SPEC",
                        help="inject a fault, repeatable: kill:rank=R,step=S, "
                             "hang:rank=R,step=S, slow:rank=R,factor=F, "
                             "corrupt-checkpoint:step=S, nan:step=S")
    parser.add_argument("--timeout-s", type=float, metavar="S",
                        help="collective timeout in seconds (a hung rank becomes an error)")
    parser.add_argument("--on-nan", choices=("stop", "skip"), default="stop",
                        help="a NaN loss stops the run (default) or skips the step's update")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="torchrun restarts of the whole group after a failure")


def run_fault_kwargs(args: argparse.Namespace) -> dict:
    """`runtime.launch.run_plan` keyword arguments from the flags above."""
    return {"checkpoint_every": args.checkpoint_every, "keep": args.keep,
            "resume": args.resume, "inject": args.inject,
            "collective_timeout_s": args.timeout_s, "on_nan": args.on_nan,
            "max_restarts": args.max_restarts}


def restart_line(summary: dict) -> str | None:
    """``restarts: 1  steps_lost: 1  wall_time_lost_s: 7.4  goodput: 0.81`` or None."""
    if "restarts" not in summary:
        return None
    goodput = summary.get("goodput")
    return (f"restarts: {summary['restarts']}  steps_lost: {summary['steps_lost']}  "
            f"wall_time_lost_s: {summary['wall_time_lost_s']:.1f}  checkpoints: "
            f"{summary['checkpoints']}  goodput: "
            f"{'n/a' if goodput is None else f'{goodput:.3f}'}")


def goodput_ranked(console, result, model, cluster, args: argparse.Namespace):
    """`meshplan plan --objective goodput`: re-rank ``result`` and print the best plan's
    goodput figures."""
    from planner.objective import hours_to_s, rank_by_goodput
    node_mtbf = args.node_mtbf_hours
    result = rank_by_goodput(result, model, device_mtbf_s=hours_to_s(args.mtbf_hours),
                             devices_per_node=cluster.devices_per_node,
                             node_mtbf_s=None if node_mtbf is None else hours_to_s(node_mtbf))
    if not result.ranked.empty and not args.json:
        best = result.ranked.iloc[0]
        console.print(
            f"ranked by goodput (device MTBF {args.mtbf_hours:g} h): best {best['id']}: "
            f"goodput {best['goodput']:.3f}, job MTBF {best['job_mtbf_s'] / 3600:.2f} h, "
            f"checkpoint {best['checkpoint_s']:.1f} s every "
            f"{best['checkpoint_interval_s'] / 60:.1f} min (Daly), "
            f"{best['effective_tokens_per_s']:.3g} effective tokens/s", highlight=False)
    return result

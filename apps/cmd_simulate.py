"""`meshplan simulate PLAN.yaml`: simulate one plan file on the cluster it was made for.

    meshplan simulate plan.yaml --trace trace.json          # the trace opens in Perfetto
    meshplan simulate plan.yaml --straggler rank=3,factor=1.5 --json
"""

from __future__ import annotations

import argparse

from apps.clusters import add_cpu_profile_option
from apps.format import (
    check_output_path,
    command_console,
    fmt_bytes,
    fmt_pct,
    fmt_rate,
    fmt_time_s,
    output_file,
    print_json,
)


def cmd_simulate(args: argparse.Namespace) -> int:
    from apps.clusters import (
        check_plan_on_cluster,
        cluster_of_plan_file,
        memory_overrun,
        memory_warning,
        profile_line,
    )
    from apps.cmd_faults import parse_stragglers
    from planner.flops import attention_flops_per_token, training_flops_per_token
    from planner.planfile import read_plan_file
    from simulator.step.simulate import simulate
    console = command_console(args)
    check_output_path("--trace", getattr(args, "trace", None))
    pf = read_plan_file(args.plan)
    cluster = cluster_of_plan_file(pf, getattr(args, "cpu_profile", None))
    check_plan_on_cluster(pf, cluster)
    overrun = memory_overrun(pf, cluster)
    if (warning := memory_warning(pf, cluster)) is not None:
        from rich.console import Console
        Console(stderr=True, soft_wrap=True).print(warning, highlight=False, markup=False)
    stragglers = parse_stragglers(getattr(args, "straggler", None))
    pred = simulate(pf.model, pf.plan, cluster, trace=bool(getattr(args, "trace", None)),
                    stragglers=stragglers)
    if getattr(args, "trace", None):
        from simulator.step.trace import write_chrome_trace
        trace_path = output_file(args.trace)
        write_chrome_trace(pred.events, trace_path)
    # fits: every stage within the memory a search allows (`memory_overrun`); when not, the
    # figures assume it did and out_of_memory says by how much
    out = {"id": pf.plan.id, **pred.to_dict(), "fits": overrun is None,
           "out_of_memory": overrun}
    if stragglers:
        out["stragglers"] = {str(rank): factor for rank, factor in stragglers.items()}
        out["healthy_step_time_s"] = simulate(pf.model, pf.plan, cluster).step_time_s
    if args.json:
        print_json(out)
        return 0
    from rich.markup import escape  # names and errors are text, not markup
    console.print(f"[bold]{pf.plan.id}[/] of {escape(pf.model.name)} on {escape(cluster.name)}")
    if cluster.nics_per_node == 0:
        console.print(f"  {profile_line(cluster)}", highlight=False)
    if stragglers:
        console.print("  stragglers         " + ", ".join(
            f"rank {r} x{f:g}" for r, f in stragglers.items()) + f" (healthy step "
            f"{fmt_time_s(out['healthy_step_time_s'])})", highlight=False)
    notes = {"comm_s": "  exposed: what compute does not hide"}
    for key in ("step_time_s", "compute_s", "comm_s", "bubble_s"):
        console.print(f"  {key:<18} {fmt_time_s(out[key])}{notes.get(key, '')}")
    console.print(f"  {'tokens_per_s':<18} {fmt_rate(out['tokens_per_s'])} (global)")
    console.print(f"  {'mfu':<18} {fmt_pct(out['mfu'])}   hfu {fmt_pct(out['hfu'])}")
    m = pf.model
    share = attention_flops_per_token(m) / training_flops_per_token(m)
    if share > 0.5:
        console.print(f"  {'':<18} (MFU and HFU count the full score matrix, as PaLM and "
                      f"Megatron do: at seq {m.seq_len:,} it is {share:.0%} of the count, "
                      f"and causal attention executes half of it)", highlight=False)
    console.print(f"  {'peak_memory':<18} {fmt_bytes(out['peak_memory_bytes'])} per rank")
    if getattr(args, "trace", None):
        console.print(f"wrote {args.trace} ({len(pred.events)} events; Perfetto opens it)",
                      highlight=False)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``simulate`` on the subcommand parser ``sub``."""
    ss = sub.add_parser("simulate", help="simulate one plan file")
    ss.add_argument("plan", help="plan file (YAML)")
    ss.add_argument("--json", action="store_true")
    ss.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (JSON)")
    ss.add_argument("--straggler", action="append", default=[], metavar="rank=R,factor=F",
                    help="rank R computes F times slower (repeatable); its TP, PP and DP "
                    "groups wait for it")
    add_cpu_profile_option(ss, default="the profile the plan file records")
    ss.set_defaults(func=cmd_simulate)

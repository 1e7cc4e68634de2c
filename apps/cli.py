"""The `meshplan` command: plan, simulate, run, compare, demo.

Exit codes: 0 success, 2 bad input (a `PlanError`), 1 runtime failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from rich.console import Console

from apps.clusters import add_cpu_profile_option
from apps.format import (
    fmt_bytes,
    fmt_flag,
    fmt_gib,
    fmt_krate,
    fmt_pct,
    fmt_rate,
    fmt_recompute,
    fmt_time_s,
    print_table,
)
from apps.plan_options import add_plan_options, global_batch_of, json_extras, report, search_kwargs
from planner import __version__
from planner.flops import attention_flops_per_token, training_flops_per_token
from planner.planfile import PlanFile, read_plan_file, write_plan_file
from planner.presets import load_model, model_names
from planner.spec import PlanError

PLAN_JSON_KEYS = ["id", "tp", "pp", "dp", "micro_batch", "global_batch", "step_time_s",
                  "tokens_per_s", "mfu", "peak_memory_bytes"]
#: Further plan fields the JSON rows carry when the search table has them (as --csv does).
PLAN_JSON_EXTRA = ["cp", "virtual_stages", "schedule", "recompute", "zero_stage",
                   "sequence_parallel", "placement", "hfu", "compute_s", "comm_s", "bubble_s"]
PLAN_TABLE = {"tp": ("tp", None), "pp": ("pp", None), "dp": ("dp", None),
              "micro_batch": ("mb", None), "virtual_stages": ("v", None),
              "zero_stage": ("zero", None), "recompute": ("ac", fmt_recompute),
              "sequence_parallel": ("sp", fmt_flag), "step_time_s": ("step", fmt_time_s),
              "tokens_per_s": ("ktok/s", fmt_krate), "mfu": ("MFU", fmt_pct),
              "peak_memory_bytes": ("GiB/rank", fmt_gib)}
#: Default tokens per global batch on GPU clusters (Llama 3 pre-training started at 4M tokens,
#: Dubey et al. 2024 §3.4.1); the default global batch is this over the sequence length.
DEFAULT_BATCH_TOKENS = 4 * 2**20


def _console(args: argparse.Namespace) -> Console:
    # With --json, human output goes to stderr so stdout is one JSON object.
    return Console(stderr=bool(getattr(args, "json", False)))


def default_global_batch(cluster, seq_len: int) -> int:
    """8 sequences on a CPU cluster; else ~4M tokens rounded to a power of two of sequences."""
    if cluster.default_dtype == "fp32":
        return 8
    return max(1, 2 ** round(math.log2(DEFAULT_BATCH_TOKENS / seq_len)))


def require_positive(args: argparse.Namespace, *flags: str, allow_zero: bool = False) -> None:
    """Raise `PlanError` naming the flag when one of ``flags`` is given and not positive."""
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            raise PlanError(f"{flag}={value} must be {'>= 0' if allow_zero else '> 0'}")


def _profile_line(cluster) -> str:
    """What a localhost prediction assumes about this machine (the profile it was given)."""
    if cluster.cpu_profile is None:
        return ("assumes the generic CPU preset (no profile of this machine: `meshplan "
                "calibrate` measures it in 3-4 minutes on an idle machine)")
    return f"assumes cpu profile {cluster.cpu_profile.path}"


def fmt_params(n: int) -> str:
    """A parameter count as ``'70.55B'`` or ``'3.3M'``."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.search import search
    console = _console(args)
    require_positive(args, "--global-batch", "--seq-len", "--top", "--nodes", "--ranks",
                     "--mtbf-hours", "--node-mtbf-hours")
    require_positive(args, "--restart-s", "--spare-delay-s", allow_zero=True)
    require_positive(args, "--top-k", allow_zero=True)
    model = load_model(args.model)
    if args.seq_len is not None:
        model = model.replace(seq_len=args.seq_len)
    from apps.clusters import cluster_from_flags
    cluster = cluster_from_flags(args.cluster, args.nodes, args.ranks,
                                 getattr(args, "cpu_profile", None))
    gb = global_batch_of(args, model.seq_len) or default_global_batch(cluster, model.seq_len)
    console.print(f"[bold]{model.name}[/] ({fmt_params(model.num_params())} params, seq "
                  f"{model.seq_len}) on [bold]{cluster.name}[/] ({cluster.num_devices} devices, "
                  f"{cluster.device.name}), global batch {gb}")
    if cluster.nics_per_node == 0:
        console.print(_profile_line(cluster), highlight=False)
    with console.status("searching every legal plan ..."):
        result = search(model, cluster, global_batch=gb, top_k=args.top_k,
                        **search_kwargs(args))
    if getattr(args, "objective", "throughput") == "goodput":
        from apps.cmd_faults import goodput_ranked
        result = goodput_ranked(console, result, model, cluster, args)
    ranked, rejected = result.ranked, result.rejected
    from apps.cmd_faults import goodput_json, goodput_table_columns
    from planner.objective import GOODPUT_COLUMNS
    if args.json:
        keys = PLAN_JSON_KEYS + [k for k in PLAN_JSON_EXTRA + list(GOODPUT_COLUMNS)
                                 if k in ranked]
        print(json.dumps({"plans": ranked[keys].to_dict("records"),
                          "rejected": rejected.to_dict("records"), **json_extras(result),
                          **goodput_json(args)}))
    else:
        if not ranked.empty:
            columns = dict(PLAN_TABLE)
            if "cp" in ranked and (ranked["cp"].head(args.top) > 1).any():
                columns = {"tp": columns["tp"], "cp": ("cp", None),
                           **{k: v for k, v in columns.items() if k != "tp"}}
            columns.update({k: v for k, v in goodput_table_columns().items() if k in ranked})
            shown = ranked.head(args.top)
            if (shown["placement"] != "tp.dp.pp").any():
                # Rows that differ only in rank placement would look identical without it.
                columns["placement"] = ("order", None)
            print_table(console, ranked, "ranked plans (best first)", columns, limit=args.top)
        refined = int((ranked["tier"] == "simulated").sum())
        oom = rejected["reason"].str.startswith("out of memory")
        console.print(f"{len(ranked)} legal plans ({refined} best refined by SimPy, the rest "
                      f"analytical); {len(rejected)} rejected: {int(oom.sum())} out of memory, "
                      f"{int((~oom).sum())} illegal (`--json` lists every reason)")
        for kind in (oom, ~oom):
            if kind.any():
                row = rejected[kind].iloc[0]
                console.print(f"  e.g. {row['id']}: {row['reason']}", highlight=False)
    report(console, args, result)
    if args.out:
        best = result.best
        pred = result.predictions[best.id]
        from apps.clusters import cluster_ref
        write_plan_file(args.out, PlanFile(
            model=model, plan=best, prediction=pred.to_dict(),
            cluster=cluster_ref(cluster, best, args.cluster)))
        console.print(f"wrote {args.out} ({best.id})")
    # No legal plan: the inputs cannot be satisfied together (the report says which constraint
    # blocks them), so this is bad input, exit 2, also with --json.
    return 0 if not ranked.empty else 2


def cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.step.simulate import simulate
    console = _console(args)
    pf = read_plan_file(args.plan)
    from apps.clusters import cluster_of_plan_file
    cluster = cluster_of_plan_file(pf)
    from apps.cmd_faults import parse_stragglers
    stragglers = parse_stragglers(getattr(args, "straggler", None))
    pred = simulate(pf.model, pf.plan, cluster, trace=bool(getattr(args, "trace", None)),
                    stragglers=stragglers)
    if getattr(args, "trace", None):
        from simulator.step.trace import write_chrome_trace
        Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
        write_chrome_trace(pred.events, args.trace)
    out = {"id": pf.plan.id, **pred.to_dict()}
    if stragglers:
        out["stragglers"] = {str(rank): factor for rank, factor in stragglers.items()}
        out["healthy_step_time_s"] = simulate(pf.model, pf.plan, cluster).step_time_s
    if args.json:
        print(json.dumps(out))
        return 0
    console.print(f"[bold]{pf.plan.id}[/] of {pf.model.name} on {cluster.name}")
    if cluster.nics_per_node == 0:
        console.print(f"  {_profile_line(cluster)}", highlight=False)
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


def cmd_run(args: argparse.Namespace) -> int:
    from apps.run_config import (
        check_run_args,
        echo_run_config,
        resolved_run_config,
        save_run_config,
        with_step_progress,
    )
    from runtime.launch import run_plan
    console = _console(args)
    check_run_args(args)
    from apps.cmd_faults import restart_line, run_fault_kwargs
    config = resolved_run_config(args.plan, steps=args.steps, out_dir=args.out, data=args.data,
                                 faults=run_fault_kwargs(args))
    echo_run_config(console, config)
    console.print(f"  saved   {save_run_config(config)}", highlight=False)
    summary = with_step_progress(console, config, lambda: run_plan(
        args.plan, steps=args.steps, out_dir=config["out_dir"], data=args.data,
        **run_fault_kwargs(args)))
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(f"{summary['plan_id']}: {summary['steps']} steps, final loss "
                      f"{summary['final_loss']:.4f}, median step {fmt_time_s(summary['step_time_s'])}"
                      f"{' (after step 1)' if summary['steps'] > 1 else ''}, "
                      f"{fmt_rate(summary['tokens_per_s'])} tokens/s")
        if (line := restart_line(summary)) is not None and summary["restarts"]:
            console.print(line, highlight=False)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from apps.compare import DEFAULT_PLANS as DEFAULT_COMPARE_PLANS
    from apps.compare import compare
    console = _console(args)
    from apps.compare import plan_indices
    plans = None if getattr(args, "sweep", False) else DEFAULT_COMPARE_PLANS
    if getattr(args, "plans", None):
        plans = plan_indices(args.plans)
    result = compare(steps=args.steps, out_dir=Path(args.out), console=console, plans=plans)
    if getattr(args, "csv", None):
        from apps.format import write_csv
        write_csv(result["rows"], args.csv)
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    console = Console()
    console.rule("1. plan Llama 3 70B on 64 DGX H100 nodes (512 GPUs)")
    code = cmd_plan(argparse.Namespace(
        model="llama3-70b", cluster="dgx-h100", nodes=64, ranks=None, global_batch=None,
        seq_len=None, top_k=20, top=10, out=str(Path(args.out) / "llama3-70b-plan.yaml"),
        json=False))
    if code:
        return code
    from simulator.network.cpu_profile import default_profile_dir, newest_profile
    if newest_profile(default_profile_dir()) is None:
        # Without a profile the localhost-cpu cluster only has generic CPU defaults; the
        # comparison is only worth reading against this machine's own measurements.
        console.rule(f"2. no profile of this machine in {default_profile_dir()} yet: "
                     f"meshplan calibrate")
        from apps.cmd_calibrate import cmd_calibrate
        cmd_calibrate(argparse.Namespace(ranks=4, out=None, models=None, iters=5, json=False))
    console.rule("3. predicted vs measured: tiny-gpt on this machine")
    return cmd_compare(argparse.Namespace(steps=args.steps, out=args.out, json=False))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="meshplan", description=(
        "Plan, simulate and run distributed LLM training; compare predictions with runs."))
    p.add_argument("--version", action="version", version=f"meshplan {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("plan", help="search tp x pp x dp splits and rank them")
    sp.add_argument("--model", required=True, help=f"preset ({', '.join(model_names())}) or YAML")
    sp.add_argument("--cluster", required=True, help="preset (dgx-a100, dgx-h100, dgx-h200, "
                    "dgx-b200, dgx-h100-roce, pcie-a100, localhost-cpu) or a cluster YAML file")
    sp.add_argument("--nodes", type=int, help="node count of a GPU cluster (default: preset's)")
    sp.add_argument("--ranks", type=int, help="processes on localhost-cpu (default 4)")
    sp.add_argument("--global-batch", type=int, help="sequences per step (default: 4M tokens "
                    "on GPUs, 8 on localhost-cpu)")
    sp.add_argument("--seq-len", type=int, help="override the model's sequence length")
    sp.add_argument("--top-k", type=int, default=20, help="plans refined by SimPy (default 20)")
    sp.add_argument("--top", type=int, default=15, help="rows to print (default 15)")
    sp.add_argument("--out", help="write the best plan to this plan file (YAML)")
    sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    sp.add_argument("--objective", choices=("throughput", "goodput"), default="throughput",
                    help="rank by predicted tokens/s, or by tokens/s x goodput under failures")
    sp.add_argument("--mtbf-hours", type=float, default=50_000.0,
                    help="per-device MTBF in hours for --objective goodput (default 50000)")
    sp.add_argument("--node-mtbf-hours", type=float,
                    help="per-node MTBF in hours (node failures besides device failures)")
    sp.add_argument("--restart-s", type=float, help="seconds from a failure to training "
                    "again, lost work excluded (--objective goodput; default 300)")
    sp.add_argument("--spare-delay-s", type=float, help="seconds to swap a spare node in "
                    "after a node failure (--objective goodput, with --node-mtbf-hours; "
                    "default 0)")
    add_plan_options(sp)
    add_cpu_profile_option(sp)
    sp.set_defaults(func=cmd_plan)

    ss = sub.add_parser("simulate", help="simulate one plan file")
    ss.add_argument("plan", help="plan file (YAML)")
    ss.add_argument("--json", action="store_true")
    ss.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (JSON)")
    ss.add_argument("--straggler", action="append", default=[], metavar="rank=R,factor=F",
                    help="rank R computes F times slower (repeatable); its TP, PP and DP "
                    "groups wait for it")
    ss.set_defaults(func=cmd_simulate)

    sr = sub.add_parser("run", help="train a plan file with torchrun on this machine")
    sr.add_argument("plan", help="plan file (YAML)")
    sr.add_argument("--steps", type=int, default=10)
    sr.add_argument("--data", help="text file to train on (default: Python stdlib sources)")
    sr.add_argument("--out", help="run folder (default runs/<plan id>)")
    sr.add_argument("--json", action="store_true", help="print summary.json on stdout")
    from apps.cmd_faults import add_run_fault_args
    add_run_fault_args(sr)
    sr.set_defaults(func=cmd_run)

    sc = sub.add_parser("compare", help="predict, run and compare local DP/TP/PP plans")
    sc.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    sc.add_argument("--sweep", action="store_true", help="the full sweep (17 plans, ~2-5 min) "
                    "instead of the 4 default plans")
    sc.add_argument("--plans", nargs="+", metavar="ID", help="only these sweep plans "
                    "(ids as in the table, e.g. tp1-pp1-dp4-mb2-gb8)")
    sc.add_argument("--out", default="runs/compare")
    sc.add_argument("--json", action="store_true")
    sc.add_argument("--csv", metavar="FILE", help="also write the rows as CSV (SI units)")
    sc.set_defaults(func=cmd_compare)

    from apps.cmd_validate import add_parser as add_validate
    add_validate(sub)

    from apps.cmd_calibrate import add_calibrate_parser
    add_calibrate_parser(sub)

    sd = sub.add_parser("demo", help="plan Llama 3 70B on 512 H100s, calibrate this machine "
                        "if it has no profile yet, then run compare")
    sd.add_argument("--steps", type=int, default=8)
    sd.add_argument("--out", default="runs/demo")
    sd.set_defaults(func=cmd_demo)

    from apps.cmd_launch import add_launch_parser
    add_launch_parser(sub)

    from apps.cmd_app import add_app_parser
    add_app_parser(sub)

    from apps.cmd_topo import add_collective_parser, add_topo_parser
    add_topo_parser(sub)
    add_collective_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `meshplan` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PlanError as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False)
        return 2
    except BrokenPipeError:
        # The reader went away (``meshplan ... | head``): nothing left to say to it.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps Python's exit flush quiet
        return 1
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        # A path the user gave cannot be read or written: bad input.
        Console(stderr=True).print(f"[red]error:[/] {exc.strerror}: {exc.filename!r}",
                                   highlight=False)
        return 2
    except (RuntimeError, OSError) as exc:
        Console(stderr=True).print(f"[red]failed:[/] {exc}", highlight=False)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""`meshplan sweep`: which cluster trains this model on this token budget soonest (or
cheapest)? A full plan search at every point of a grid of GPU counts, node types, NIC speeds
and leaf oversubscriptions, on the local cores or on a Ray cluster.

    meshplan sweep --model gpt3-175b --tokens 300B --gpus 512,1024,2048 \
        --node-types dgx-a100,dgx-h100 --nic-gbps 200,400 --price dgx-h100=3.0
    meshplan sweep ... --ray-address auto
"""

from __future__ import annotations

import argparse

from apps.format import command_console, fmt_duration_s, fmt_krate, fmt_pct, print_json, print_table
from planner.spec import PlanError, did_you_mean


def _or(blank: str, fmt):
    # A cell formatter that prints ``blank`` for a missing value (None, or NaN in a table).
    return lambda v: blank if v is None or v != v else fmt(v)


SWEEP_TABLE = {"gpus": ("GPUs", None), "node_type": ("node type", None),
               "nic_Gbps": ("NIC Gb/s", _or("preset", lambda v: f"{v:g}")),
               "oversubscription": ("oversub", _or("preset", lambda v: f"{v:g}")),
               "best": ("best plan", _or("nothing fits", str)),
               "tokens_per_s": ("ktok/s", _or("-", fmt_krate)),
               "mfu": ("MFU", _or("-", fmt_pct)),
               "time_to_train_s": ("healthy time", _or("-", fmt_duration_s)),
               "gpu_hours": ("GPU-h", _or("-", lambda v: f"{v:,.0f}")),
               "cost_usd": ("cost $", _or("-", lambda v: f"{v:,.0f}"))}


def _list(flag: str, text: str | None, kind: type) -> list:
    # "1,2,4" -> [1, 2, 4]; None -> [None] (the preset's value)
    if text is None:
        return [None]
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or (kind is int and not all(v.is_integer() for v in values)):
        raise PlanError(f"{flag}={text!r} must be a comma-separated list of "
                        f"{'integers' if kind is int else 'numbers'}, e.g. {flag} 8,16")
    return [kind(v) for v in values]


def _prices(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or price < 0:
            raise PlanError(f"--price {item!r} must look like NODE_TYPE=USD_PER_GPU_HOUR, "
                            f"e.g. --price dgx-h100=3.0")
        out[name] = price
    return out


def cmd_sweep(args: argparse.Namespace) -> int:
    from apps.cmd_plan import gpu_global_batch
    from planner.presets import load_model
    from planner.sweep import run_sweep, sweep_grid
    from planner.time_to_train import HEALTHY_TIME, parse_tokens
    console = command_console(args)
    tokens = parse_tokens(args.tokens)
    if args.workers is not None and args.workers < 1:
        raise PlanError(f"--workers={args.workers} must be >= 1")
    model = load_model(args.model)
    points = sweep_grid(_list("--gpus", args.gpus, int), args.node_types.split(","), _list("--nic-gbps", args.nic_gbps,
                                                                 float),
                        _list("--oversubscription", args.oversubscription, float),
                        base=args.base, names={"gpus": "--gpus", "node_types": "--node-types",
                                               "nic_Gbps": "--nic-gbps",
                                               "oversubscription": "--oversubscription"})
    prices = _prices(args.price)
    grid_types = sorted({p.node_type for p in points})
    for name in prices:
        if name not in grid_types:
            raise PlanError(f"--price {name}=...: {name!r} is not a node type of this sweep"
                            f"{did_you_mean(name, grid_types)}; its node types: "
                            f"{', '.join(grid_types)} (--node-types)")
    from apps.plan_options import global_batch_of
    gb = global_batch_of(args, model.seq_len) or gpu_global_batch(model.seq_len)
    if args.ray_address is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise PlanError("--ray-address needs Ray: pip install 'meshplan[ray]' (or pip "
                            "install ray), or leave --ray-address out to use the local "
                            "cores") from None
    rows = run_sweep(args.model, points, token_budget=tokens, global_batch=gb,
                     prices=prices, workers=args.workers, ray_address=args.ray_address)
    if args.json:
        print_json({"model": model.name, "tokens": tokens, "global_batch": gb,
                    "time_to_train": HEALTHY_TIME, "points": rows})
        return 0
    import pandas as pd
    print_table(console, pd.DataFrame(rows), f"{model.name}, {tokens:.3g} tokens, global "
                f"batch {gb}: {len(rows)} cluster variants, fastest first ({HEALTHY_TIME}; "
                f"`meshplan plan --tokens` adds failures)", SWEEP_TABLE)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``sweep`` on the subcommand parser ``sub``."""
    sp = sub.add_parser("sweep", help="plan search over a grid of cluster variants; rank by "
                        "time-to-train")
    sp.add_argument("--model", required=True, help="model preset or YAML")
    sp.add_argument("--tokens", required=True,
                    help="token budget to train on (e.g. 300B, 15T, 2e9)")
    sp.add_argument("--gpus", required=True, help="GPU counts, comma-separated (whole nodes)")
    sp.add_argument("--node-types", default="dgx-h100",
                    help="node types, comma-separated (default dgx-h100)")
    sp.add_argument("--nic-gbps", help="NIC line rates in Gb/s, comma-separated (default: "
                    "the node type's)")
    sp.add_argument("--oversubscription", help="leaf oversubscriptions, comma-separated "
                    "(default: the preset's)")
    sp.add_argument("--base", default="dgx-h100", help="cluster preset whose fabric a node "
                    "type without its own preset uses (default dgx-h100)")
    sp.add_argument("--global-batch", help="sequences per step (default ~4M tokens)")
    sp.add_argument("--price", action="append", default=[], metavar="NODE_TYPE=USD",
                    help="price per GPU-hour of a node type, for the cost column")
    sp.add_argument("--workers", type=int, help="local processes (default: the cores)")
    sp.add_argument("--ray-address", help="run each point as a Ray task on this cluster "
                    "('auto', 'local', a head's host:port or ray://host:port); needs Ray installed")
    sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    sp.set_defaults(func=cmd_sweep)

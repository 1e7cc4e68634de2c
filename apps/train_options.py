"""`meshplan plan`'s time-to-train options: a token budget (``--tokens 15T`` or ``--steps N``),
a price (``--gpu-hour-usd``), the checkpoint bandwidths, and the checks that a failure flag is
not given where it has no effect.

    meshplan plan --model llama3-405b --cluster dgx-h100 --nodes 2048 --tokens 15T \
        --gpu-hour-usd 2.5 --objective time-to-train
"""

from __future__ import annotations

import argparse

from planner.spec import PlanError

#: Flags of the failure model: they act only under a goodput objective or a token budget.
FAILURE_FLAGS = ("--mtbf-hours", "--node-mtbf-hours", "--restart-s", "--spare-delay-s",
                 "--straggler-rate", "--straggler-factor", "--storage-gbps", "--writer-gbps")


def add_train_options(sp: argparse.ArgumentParser) -> None:
    """Register --tokens, --steps, --gpu-hour-usd, --storage-gbps and --writer-gbps."""
    sp.add_argument("--tokens", help="token budget to train, e.g. 15T, 300B: adds wall days, "
                    "GPU-hours, cost and goodput per plan (failures, checkpoints, restarts)")
    sp.add_argument("--steps", type=int, help="step budget (instead of --tokens): steps x "
                    "global batch x sequence length tokens")
    sp.add_argument("--gpu-hour-usd", type=float, help="price of one device-hour in US "
                    "dollars (adds cost_usd)")
    sp.add_argument("--storage-gbps", type=float, help="checkpoint storage bandwidth, GB/s "
                    "(default 2000: Llama 3's Tectonic, 2 TB/s sustained, Dubey et al. 2024 "
                    "§3.3.1)")
    sp.add_argument("--writer-gbps", type=float, help="one checkpoint writer's bandwidth, "
                    "GB/s (default 2)")


def _given(args: argparse.Namespace, flag: str):
    return getattr(args, flag.lstrip("-").replace("-", "_"), None)


def train_tokens(args: argparse.Namespace, global_batch: int, seq_len: int) -> float | None:
    """The token budget of --tokens or --steps (None: neither), checked before any work.

    Raises:
        PlanError: both given, a bad count or price, ``--objective time-to-train`` without a
            budget, or a failure flag where nothing reads it.
    """
    from planner.time_to_train import parse_tokens
    steps, tokens = getattr(args, "steps", None), getattr(args, "tokens", None)
    if steps is not None and tokens is not None:
        raise PlanError(f"give --tokens or --steps, not both (--tokens={tokens}, "
                        f"--steps={steps})")
    from apps.format import check_at_least
    check_at_least("--steps", steps)
    price = getattr(args, "gpu_hour_usd", None)
    for flag in ("--gpu-hour-usd", "--storage-gbps", "--writer-gbps"):
        value = _given(args, flag)
        if value is not None and not value > 0:
            raise PlanError(f"{flag}={value:g} must be > 0")
    budget = (parse_tokens(tokens) if tokens is not None
              else None if steps is None else float(steps * global_batch * seq_len))
    step_tokens = global_batch * seq_len
    if budget is not None and budget < step_tokens:
        # a budget under one step trains nothing a plan could be ranked by (0 GPU-hours)
        raise PlanError(f"--tokens={tokens} is less than one global batch of {step_tokens:,} "
                        f"tokens ({global_batch} x seq_len {seq_len}); give at least "
                        f"--tokens {step_tokens}, or a smaller --global-batch")
    objective = getattr(args, "objective", "throughput")
    if objective == "time-to-train" and budget is None:
        raise PlanError("--objective time-to-train needs a budget: give --tokens N (e.g. "
                        "--tokens 15T) or --steps N")
    if budget is None and price is not None:
        raise PlanError(f"--gpu-hour-usd={price:g} prices a token budget; give --tokens N "
                        "or --steps N too")
    if budget is None and objective == "throughput":
        given = [f for f in FAILURE_FLAGS if _given(args, f) is not None]
        if given:
            raise PlanError(f"{', '.join(given)} only act(s) on the failure model; it would "
                            "be ignored: add --objective goodput, --objective time-to-train "
                            "or --tokens N")
    return budget


def train_ranked(console, result, model, cluster, args: argparse.Namespace, tokens: float):
    """Add the time-to-train columns to ``result`` (sorted by them under ``--objective
    time-to-train``, else in the order the objective gave) and print the best plan's line."""
    from apps.cmd_faults import eviction_devices, goodput_assumptions, straggler_clause
    from apps.format import fmt_duration_s
    from planner.time_to_train import rank_by_time_to_train
    sort = getattr(args, "objective", "throughput") == "time-to-train"
    result = rank_by_time_to_train(
        result, model, tokens=tokens, gpu_hour_usd=getattr(args, "gpu_hour_usd", None),
        sort=sort, devices_per_node=cluster.devices_per_node,
        evict_devices=eviction_devices(cluster), **goodput_assumptions(args, cluster))
    if not result.ranked.empty and not args.json:
        best = result.ranked.iloc[0]
        cost = "" if best["cost_usd"] != best["cost_usd"] else f", ${best['cost_usd']:,.0f}"
        console.print(
            f"{fmt_tokens(tokens)} tokens on {best['id']}: "
            f"{fmt_duration_s(best['wall_days'] * 86400)} wall time, "
            f"{best['gpu_hours']:,.0f} GPU-hours{cost}, goodput {best['goodput']:.1%} (job "
            f"MTBF {best['job_mtbf_s'] / 3600:.2f} h, checkpoint {best['checkpoint_s']:.1f} s "
            f"every {best['checkpoint_interval_s'] / 60:.1f} min; {straggler_clause(best)})",
            highlight=False)
    return result


def fmt_tokens(tokens: float) -> str:
    """``15T``, ``300B``, ``2.5M``: a token count with its largest whole suffix."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.4g}{suffix}"
    return f"{tokens:.0f}"


def train_table_columns() -> dict:
    """Columns a token budget adds to the `plan` table: key -> (header, formatter)."""
    from apps.format import fmt_duration_s, fmt_pct
    return {"goodput": ("goodput", fmt_pct), "straggler_loss": ("straggler", fmt_pct),
            "straggler_policy": ("on straggler", None),
            "wall_days": ("wall time", lambda d: fmt_duration_s(d * 86400)),
            "gpu_hours": ("GPU-h", lambda h: f"{h:,.0f}"),
            "cost_usd": ("cost $", lambda c: "" if c != c else f"{c:,.0f}")}


def train_json(args: argparse.Namespace, tokens: float | None, cluster=None) -> dict:
    """Top-level ``train_assumptions`` of `plan --json` with a token budget, else {}."""
    if tokens is None:
        return {}
    from apps.cmd_faults import goodput_assumptions
    from planner.time_to_train import WALL_TIME
    return {"train_assumptions": {"tokens": tokens, "time_to_train": WALL_TIME,
                                  "gpu_hour_usd": getattr(args, "gpu_hour_usd", None),
                                  **goodput_assumptions(args, cluster)}}

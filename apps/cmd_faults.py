"""Failure options of the CLI: `meshplan run`'s fault-tolerance flags and the restart line of
its report, `meshplan plan --objective goodput`, and `meshplan simulate --straggler`."""

from __future__ import annotations

import argparse
import math

from planner.spec import PlanError


def add_run_fault_args(parser: argparse.ArgumentParser) -> None:
    """--checkpoint-every, --keep, --checkpoint-dir, --resume, --inject, --timeout-s, --on-nan,
    --max-restarts (`runtime.faults.add_fault_args`, the flags ``runtime.train`` takes too)."""
    from runtime.faults import add_fault_args
    add_fault_args(parser, launcher=True)


def run_fault_kwargs(args: argparse.Namespace) -> dict:
    """`runtime.launch.run_plan` keyword arguments from the flags above."""
    return {"checkpoint_every": args.checkpoint_every, "keep": args.keep,
            "resume": args.resume, "checkpoint_dir": args.checkpoint_dir,
            "inject": args.inject,
            "collective_timeout_s": args.timeout_s, "on_nan": args.on_nan,
            "max_restarts": args.max_restarts,
            "straggler_threshold": args.straggler_threshold,
            "straggler_window": args.straggler_window, "on_straggler": args.on_straggler,
            "spares": args.spares, "ranks_per_node": args.ranks_per_node}


def restart_line(summary: dict) -> str | None:
    """``restarts: 1  steps_lost: 1  wall_time_lost_s: 7.4  goodput: 0.81`` or None."""
    if "restarts" not in summary:
        return None
    goodput = summary.get("goodput")
    return (f"restarts: {summary['restarts']}  steps_lost: {summary['steps_lost']}  "
            f"wall_time_lost_s: {summary['wall_time_lost_s']:.1f}  checkpoints: "
            f"{summary['checkpoints']}  goodput: "
            f"{'n/a' if goodput is None else f'{goodput:.3f}'}")


def goodput_ranked(console, result, model, cluster, args: argparse.Namespace,
                   tokens: float | None = None):
    """`meshplan plan --objective goodput`: re-rank ``result`` and print the best plan's
    goodput figures (``tokens``: the token budget, which bounds a straggler episode)."""
    from planner.objective import rank_by_goodput
    a = goodput_assumptions(args, cluster)
    result = rank_by_goodput(result, model, devices_per_node=cluster.devices_per_node,
                             evict_devices=eviction_devices(cluster), train_tokens=tokens, **a)
    if not result.ranked.empty and not args.json:
        best = result.ranked.iloc[0]
        console.print(
            f"ranked by goodput (device MTBF {a['device_mtbf_s'] / 3600:g} h, restart "
            f"{a['restart_s']:g} s, spare swap {a['spare_delay_s']:g} s): best {best['id']}: "
            f"goodput {best['goodput']:.3f}, job MTBF {best['job_mtbf_s'] / 3600:.2f} h, "
            f"checkpoint {best['checkpoint_s']:.1f} s every "
            f"{best['checkpoint_interval_s'] / 60:.1f} min (Daly), "
            f"{best['effective_tokens_per_s']:.3g} effective tokens/s; "
            f"{straggler_clause(best)}", highlight=False)
    return result


def eviction_devices(cluster) -> int:
    """Devices an eviction leaves out with a straggler: its node on a GPU cluster; one rank on
    localhost, as `meshplan run --ranks-per-node` does by default."""
    return 1 if cluster.nics_per_node == 0 else cluster.devices_per_node


def straggler_clause(row) -> str:
    """``a straggler: evict (62 s per episode of 0.39 h of work (until a failure's restart
    swaps the device: the job MTBF); stay 80 s), 0.05% of wall time``
    for a ranked row with the straggler columns of `planner.objective.rank_by_goodput`."""
    other = "stay" if row["straggler_policy"] == "evict" else "evict"
    other_s = row[f"straggler_{other}_s"]
    episode = row["straggler_episode_s"]
    episode_text = f"{episode:.1f} s" if episode < 3600 else f"{episode / 3600:.2f} h"
    # the episode lasts until a failure's restart swaps the device out (the job MTBF), or
    # with a token budget at most half the run (`planner.objective.rank_by_goodput`): a
    # larger budget makes it longer, up to the MTBF
    mtbf = row.get("job_mtbf_s")
    until = ("until a failure's restart swaps the device: the job MTBF"
             if mtbf is None or episode >= mtbf * (1 - 1e-9)
             else "half the run, the mean time left after an onset: a larger budget lasts "
                  "longer, up to the job MTBF")
    return (f"a straggler: {row['straggler_policy']} ({row['straggler_cost_s']:,.0f} s per "
            f"episode of {episode_text} of work ({until}); {other} "
            f"{'impossible' if math.isinf(other_s) else f'{other_s:,.0f} s'}), "
            f"{row['straggler_loss']:.2%} of wall time")


def add_straggler_options(sp: argparse.ArgumentParser) -> None:
    """--straggler-rate and --straggler-factor of `plan`'s failure model (defaults in
    `planner.objective`)."""
    from planner.objective import STRAGGLER_FACTOR, STRAGGLER_RATE_PER_DEVICE_HOUR
    sp.add_argument("--straggler-rate", type=float, metavar="PER_DEVICE_HOUR",
                    help="slow (not failed) devices per device-hour; each episode is priced "
                    "as meshplan run --on-straggler would handle it, staying slow or evicting "
                    f"(default {STRAGGLER_RATE_PER_DEVICE_HOUR:.3g}: as often as a device "
                    "fails in Llama 3's run, Dubey et al. 2024 §3.3.4; Falcon, Wu et al. "
                    "2024, arXiv:2410.12588, reports fail-slows but no per-device rate; 0: "
                    "none)")
    sp.add_argument("--straggler-factor", type=float, metavar="F",
                    help="a straggler's compute slowdown, >= 1 (default "
                    f"{STRAGGLER_FACTOR:.3g}: 1 / 0.7, the mildest slowdown meshplan run's "
                    "detector confirms at nvidia-resiliency-ext's relative score threshold "
                    "0.7)")


def check_straggler_flags(args: argparse.Namespace) -> None:
    """Reject a bad --straggler-rate or --straggler-factor before any work.

    Raises:
        PlanError: a rate that is not a finite number >= 0, or a factor that is not a
            finite number >= 1.
    """
    rate = getattr(args, "straggler_rate", None)
    if rate is not None and not (math.isfinite(rate) and rate >= 0):
        raise PlanError(f"--straggler-rate={rate:g} must be a finite number >= 0 of slow "
                        "devices per device-hour (e.g. --straggler-rate 2e-5; 0: none)")
    factor = getattr(args, "straggler_factor", None)
    if factor is not None and not (math.isfinite(factor) and factor >= 1):
        raise PlanError(f"--straggler-factor={factor:g} must be a finite number >= 1 (1 = "
                        "full speed, 2 = compute twice as slow)")


def goodput_assumptions(args: argparse.Namespace, cluster=None) -> dict:
    """The failure and checkpoint assumptions of `plan --objective goodput` (SI units). The
    restart without ``--restart-s``: on a localhost ``cluster`` the runtime's own figure for
    this machine (`simulator.failures.eviction.LOCAL_RESTART_S`, what `restart_estimate_s`
    falls back on), else `planner.objective.RESTART_S`.

    Raises:
        PlanError: ``--spare-delay-s`` without ``--node-mtbf-hours`` (only node failures wait
            for a spare, so the delay would change nothing).
    """
    from planner.objective import (
        DEVICE_MTBF_HOURS,
        RESTART_S,
        STORAGE_BANDWIDTH_BPS,
        STRAGGLER_FACTOR,
        STRAGGLER_RATE_PER_DEVICE_HOUR,
        WRITER_BANDWIDTH_BPS,
        hours_to_s,
    )
    from simulator.failures.eviction import LOCAL_RESTART_S
    spare = getattr(args, "spare_delay_s", None)
    node = getattr(args, "node_mtbf_hours", None)
    if spare and node is None:
        raise PlanError(f"--spare-delay-s={spare:g} only delays node failures; give "
                        "--node-mtbf-hours H too (e.g. --node-mtbf-hours 20000)")
    restart = getattr(args, "restart_s", None)
    mtbf = getattr(args, "mtbf_hours", None)
    storage, writer = getattr(args, "storage_gbps", None), getattr(args, "writer_gbps", None)
    rate, factor = getattr(args, "straggler_rate", None), getattr(args, "straggler_factor", None)
    return {"device_mtbf_s": hours_to_s(DEVICE_MTBF_HOURS if mtbf is None else mtbf),
            "node_mtbf_s": None if node is None else hours_to_s(node),
            "restart_s": (restart if restart is not None else LOCAL_RESTART_S
                          if cluster is not None and cluster.nics_per_node == 0
                          else RESTART_S),
            "spare_delay_s": spare or 0.0,
            "storage_bandwidth_Bps": STORAGE_BANDWIDTH_BPS if storage is None else storage * 1e9,
            "writer_bandwidth_Bps": WRITER_BANDWIDTH_BPS if writer is None else writer * 1e9,
            "straggler_rate_per_device_s": (STRAGGLER_RATE_PER_DEVICE_HOUR if rate is None
                                            else rate) / 3600,
            "straggler_factor": STRAGGLER_FACTOR if factor is None else factor}


def goodput_json(args: argparse.Namespace, cluster=None) -> dict:
    """Extra top-level key of `plan --json` under ``--objective goodput``: ``goodput_assumptions``
    (`goodput_assumptions`); {} otherwise."""
    if getattr(args, "objective", "throughput") != "goodput":
        return {}
    return {"goodput_assumptions": goodput_assumptions(args, cluster)}


def goodput_table_columns() -> dict:
    """Columns the goodput objective adds to the `plan` table: key -> (header, formatter).
    The ``--json`` rows and ``--csv`` carry every `planner.objective.GOODPUT_COLUMNS`."""
    from apps.format import fmt_krate, fmt_pct
    return {"goodput": ("goodput", fmt_pct), "straggler_loss": ("straggler", fmt_pct),
            "straggler_policy": ("on straggler", None),
            "effective_tokens_per_s": ("eff ktok/s", fmt_krate)}


STRAGGLER_USAGE = "write --straggler rank=R,factor=F (e.g. --straggler rank=1,factor=2)"


def parse_stragglers(items: list[str] | None) -> dict[int, float]:
    """``meshplan simulate --straggler rank=R,factor=F`` (repeatable) as ``{rank: factor}``.

    >>> parse_stragglers(["rank=1,factor=2", "rank=3,factor=1.5"])
    {1: 2.0, 3: 1.5}

    Whether the rank exists in the plan is checked by the simulator
    (`planner.mesh.rank_coords`).

    Raises:
        PlanError: a missing or unknown field, a rank that is not an integer >= 0, a factor
            that is not a finite number >= 1, or a rank given twice.
    """
    out: dict[int, float] = {}
    for item in items or []:
        fields: dict[str, str] = {}
        for part in filter(None, item.split(",")):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or key not in ("rank", "factor"):
                raise PlanError(f"--straggler {item!r}: field {key!r} is not rank or factor; "
                                f"{STRAGGLER_USAGE}")
            fields[key] = value.strip()
        missing = [k for k in ("rank", "factor") if k not in fields]
        if missing:
            raise PlanError(f"--straggler {item!r}: missing {', '.join(missing)}; "
                            f"{STRAGGLER_USAGE}")
        try:
            rank = int(fields["rank"])
        except ValueError:
            rank = -1
        if rank < 0:
            raise PlanError(f"--straggler {item!r}: rank={fields['rank']!r} must be an "
                            f"integer >= 0 (a global rank of the plan); {STRAGGLER_USAGE}")
        try:
            factor = float(fields["factor"])
        except ValueError:
            factor = math.nan
        if not (math.isfinite(factor) and factor >= 1.0):
            raise PlanError(f"--straggler {item!r}: factor={fields['factor']!r} must be a "
                            "number >= 1 (1 = full speed, 2 = compute twice as slow); "
                            f"{STRAGGLER_USAGE}")
        if rank in out:
            raise PlanError(f"--straggler {item!r}: rank {rank} is given twice; give each "
                            "slow rank once")
        out[rank] = factor
    return out

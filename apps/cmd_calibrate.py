"""`meshplan calibrate`: measure this machine and write a localhost-cpu hardware profile."""

from __future__ import annotations

import argparse
import os

from apps.format import check_output_path, command_console, fmt_time_s, print_json
from planner.spec import PlanError


def load_warning(load: float | None = None, cores: int | None = None) -> str:
    """A warning when other processes keep this machine's cores busy ('' when it is idle):
    a profile measured under load predicts every later, quieter run too slow.

    ``load`` is the 1-minute load average (``os.getloadavg``), ``cores`` the usable cores.

    >>> load_warning(0.2, 2)
    ''
    >>> load_warning(1.6, 2)[:33]
    'warning: load average 1.6 on 2 co'
    """
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:                 # not available on this platform
            return ""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
    if load <= 0.5 * cores:
        return ""
    return (f"warning: load average {load:.1f} on {cores} cores: other processes are "
            f"running, so the profile will measure a busy machine; calibrate when it is idle")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from apps.compare import sweep_models
    from runtime.calibrate.calibrate import calibrate, write_profile
    from simulator.network.cpu_profile import default_profile_dir
    console = command_console(args)
    for flag, value, low in (("--ranks", args.ranks, 1), ("--iters", args.iters, 1)):
        if value is not None and value < low:
            raise PlanError(f"{flag}={value} must be >= {low} (e.g. {flag} 4)")
    check_output_path("--out", args.out)
    models = sweep_models()
    specs = [models[name] for name in args.models] if args.models else list(models.values())
    if warning := load_warning():
        console.print(warning, highlight=False, markup=False)
    console.print(f"calibrating this machine for {', '.join(s.name for s in specs)}: compute "
                  f"with 1..{args.ranks} processes at once, gloo on up to {args.ranks} ranks "
                  f"(1 thread per rank)", highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("starting workers", total=1.0)

        def progress(what: str, fraction: float) -> None:
            bar.update(task, advance=fraction, description=what)

        mapping = calibrate(specs, ranks=args.ranks, iters=args.iters, progress=progress)
    path = write_profile(mapping, args.out)
    device = next(iter(mapping["device"].values()))
    coll = mapping.get("collective", {})
    console.print(f"one core: fp32 GEMM {device['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s best "
                  f"(x{device['matmul_efficiency']:.2f} at the layer shapes), copy "
                  f"{device['memory_bandwidth_Bps'] / 1e9:.1f} GB/s; gloo all-reduce on "
                  f"{args.ranks} ranks: alpha {fmt_time_s(coll.get('latency_s', 0.0))}, "
                  f"{coll.get('bandwidth_Bps', 0.0) / 1e9:.2f} GB/s; took "
                  f"{mapping['calibration']['seconds']:.0f} s", highlight=False)
    where = "" if args.out else (f" (the newest in {default_profile_dir()} is what "
                                 f"--cpu-profile defaults to)")
    console.print(f"wrote {path}{where}", highlight=False, markup=False)
    if args.json:
        print_json({"profile": str(path), **mapping["calibration"]})
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``meshplan calibrate`` on the CLI's subparsers."""
    from apps.compare import sweep_models
    sc = sub.add_parser("calibrate", help="measure this machine (GEMM, attention, gloo, "
                        "framework overhead) into a localhost-cpu profile")
    sc.add_argument("--ranks", type=int, default=4, help="most processes measured at once "
                    "(default 4)")
    sc.add_argument("--out", help="profile file (default: $MESHPLAN_PROFILE_DIR or "
                    "runs/profiles, localhost-cpu-<UTC time>.yaml)")
    sc.add_argument("--models", nargs="+", choices=sorted(sweep_models()),
                    help="model shapes to calibrate (default: both compare models)")
    sc.add_argument("--iters", type=int, default=5, help="timed iterations per benchmark")
    sc.add_argument("--json", action="store_true", help="print the profile path as JSON")
    sc.set_defaults(func=cmd_calibrate)

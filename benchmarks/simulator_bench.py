"""Simulator speed: the closed-form estimate against the SimPy run, and the 16,384-GPU cases.

    python benchmarks/simulator_bench.py [--json]

Cases and targets (wall clock on one core; the machine is shared, so each figure is the best
of ``--repeat`` runs):

- ``estimate`` of Llama 3 70B tp8-pp8-dp8 on 64 DGX H100 nodes: <= 1 ms a call, printed beside
  the SimPy ``simulate`` of the same plan (the ratio is what the planner's two tiers trade);
- ``simulate`` of tp8-pp8-dp256 on 2,048 nodes (16,384 GPUs): <= 2 s (one rank per stage);
- building the 16,384-GPU cluster graph and routing one link: <= 1 s;
- the DP all-reduce over 2,048 nodes: first call <= 1 s, a second size on the same group
  <= 10 ms (identical groups are costed once).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.mesh import group_ranks  # noqa: E402
from planner.presets import load_model  # noqa: E402
from planner.spec import Plan  # noqa: E402
from simulator.network.cluster import load_cluster  # noqa: E402
from simulator.network.collectives import collective_time_s  # noqa: E402
from simulator.step.simulate import estimate, simulate  # noqa: E402


def best_of(fn, repeat: int) -> float:
    """Fastest wall time of ``repeat`` calls of ``fn``, seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(repeat: int) -> list[dict]:
    """Every case as ``{"case", "seconds", "target_s", "ok"}`` (plus extra figures)."""
    llama = load_model("llama3-70b")
    c64 = load_cluster("dgx-h100", nodes=64)
    plan = Plan(tp=8, pp=8, dp=8, micro_batch=1, global_batch=512)
    estimate(llama, plan, c64)
    est = best_of(lambda: [estimate(llama, plan, c64) for _ in range(200)], repeat) / 200
    sim = best_of(lambda: simulate(llama, plan, c64), repeat)
    big_plan = Plan(tp=8, pp=8, dp=256, micro_batch=1, global_batch=2048)
    big_sim = best_of(lambda: simulate(llama, big_plan, load_cluster("dgx-h100", nodes=2048)),
                      repeat)
    build = best_of(lambda: load_cluster("dgx-h100", nodes=2048).link(0, 16383), repeat)
    cluster = load_cluster("dgx-h100", nodes=2048)
    dp_plan = Plan(tp=8, pp=1, dp=2048, micro_batch=1, global_batch=2048)
    start = time.perf_counter()
    collective_time_s(cluster, "all_reduce", 2**30, group_ranks(dp_plan, "dp"))
    first = time.perf_counter() - start
    again = best_of(lambda: collective_time_s(cluster, "all_reduce", 2**31,
                                              group_ranks(dp_plan, "dp")), repeat)
    return [
        {"case": "estimate, llama3-70b tp8-pp8-dp8 on 512 H100", "seconds": est,
         "target_s": 1e-3, "ok": est <= 1e-3, "simulate_s": sim, "simulate_over_estimate": sim / est},
        {"case": "simulate, tp8-pp8-dp256 on 16384 H100", "seconds": big_sim, "target_s": 2.0,
         "ok": big_sim <= 2.0},
        {"case": "build 16384-GPU cluster + one route", "seconds": build, "target_s": 1.0,
         "ok": build <= 1.0},
        {"case": "DP all-reduce over 2048 nodes, first call", "seconds": first,
         "target_s": 1.0, "ok": first <= 1.0},
        {"case": "same group, second size (cached)", "seconds": again, "target_s": 0.01,
         "ok": again <= 0.01},
    ]


def main(argv: list[str] | None = None) -> int:
    """Print the table (or ``--json``); exit 1 when a target is missed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    rows = run(args.repeat)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            extra = (f"  (simulate {r['simulate_s'] * 1e3:.1f} ms = "
                     f"{r['simulate_over_estimate']:.0f}x)" if "simulate_s" in r else "")
            print(f"{r['case']:48s} {r['seconds'] * 1e3:10.3f} ms  target <= "
                  f"{r['target_s'] * 1e3:g} ms  {'ok' if r['ok'] else 'MISSED'}{extra}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

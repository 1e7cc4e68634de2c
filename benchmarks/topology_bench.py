"""Speed of the topology model: build a 16,384-GPU cluster and cost collectives across it.

Run: ``python benchmarks/topology_bench.py`` (prints one line per figure; the issue's bound is
"well under a second" for the build and for a DP all-reduce across the cluster).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.mesh import group_ranks  # noqa: E402
from planner.spec import Plan  # noqa: E402
from simulator.network.cluster import load_cluster  # noqa: E402
from simulator.network.collectives import COLLECTIVES, collective_cost  # noqa: E402
from simulator.network.topology import summary  # noqa: E402


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> int:
    cluster, build_s = _timed(lambda: load_cluster("dgx-h100", nodes=2048))
    info = summary(cluster)
    print(f"build dgx-h100 x 2048 nodes ({cluster.num_devices} GPUs, {info['links']} links, "
          f"{cluster.tiers} tiers): {build_s * 1e3:.0f} ms")
    cases = [("dp all-reduce, tp8 x dp2048 (8 concurrent groups)",
              Plan(tp=8, pp=1, dp=2048, micro_batch=1, global_batch=2048)),
             ("dp all-reduce, tp1 x dp16384 (1 group)",
              Plan(tp=1, pp=1, dp=16384, micro_batch=1, global_batch=16384)),
             ("dp all-reduce, tp8 x pp16 x dp128 (128 concurrent groups)",
              Plan(tp=8, pp=16, dp=128, micro_batch=1, global_batch=128))]
    for name, plan in cases:
        group = group_ranks(plan, "dp")
        cost, first_s = _timed(lambda g=group: collective_cost(cluster, "all_reduce", 2**30, g))
        _, again_s = _timed(lambda g=group: collective_cost(cluster, "all_reduce", 2**31, g))
        print(f"{name}: first {first_s * 1e3:.1f} ms, cached {again_s * 1e6:.0f} us "
              f"({cost.algorithm}/{cost.protocol}, busbw {cost.busbw_Bps / 1e9:.1f} GB/s at 1 GiB)")
    for kind in COLLECTIVES:
        devices = [0, 16383] if kind == "send_recv" else range(0, 16384, 8)
        cost, took = _timed(lambda k=kind, d=devices: collective_cost(cluster, k, 2**28, d))
        print(f"{kind} over {len(devices)} ranks: {took * 1e3:.1f} ms "
              f"({cost.algorithm}, busbw {cost.busbw_Bps / 1e9:.1f} GB/s at 256 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Planner speed: candidates per second of the analytical tier and wall time of full searches.

    python benchmarks/planner_bench.py [--json] [--only search|screen]

Cases and targets:

- analytical tier: >= 1,000 candidate plans per second on one core (Llama 3 70B on 128 DGX
  H100 nodes, SimPy tier off); wall-clock rate, with the per-CPU-second rates beside it (the
  search is single-threaded, so CPU seconds are what one free core would take);
- MT-NLG 530B (105 layers, hidden 20480, 128 heads; Smith et al. 2022) on 5,120 A100s at its
  published global batch of 1,920 sequences: the whole search, all 5,120 devices and at most
  5,120 devices, <= 30 s each;
- Llama 3 70B on 1,024 H100s at sequence 8,192, global batch 4M tokens (512 sequences),
  including the SimPy refinement of the best 20: <= 10 s;
- the screen, uncached path against the memoised and pruned one in the same run (GPT-3 175B
  on 1,024 A100s at its published batch of 1,536 sequences, Brown et al. 2020 Table 2.1;
  MT-NLG 530B on 5,120 A100s): candidates per CPU second of each, the speed-up, and whether
  the top 20 (ids, placements, step times, memory) are the same; target >= 10,000 candidates
  per CPU second for 175B on the new path. The old path turns the cost memo off
  (`simulator.network.collectives.cost_memo`) and costs every plan (no ``prune``);
- the same for an MoE search: DeepSeek-V3 (DeepSeek-AI 2024) on 1,024 H100s at its
  pre-training batch of 15,360 sequences of 4,096 tokens (report §4.2), with ep, dtype
  (``any``) and schedule (every one the planner emits) free; target: the new path's
  analytical tier takes <= 10 CPU seconds, with the same top 20.

``--screen NAME`` (repeatable) runs only the named screen cases (gpt3, mt-nlg, moe).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.presets import load_model  # noqa: E402
from planner.search import search  # noqa: E402
from planner.space import SearchSpace  # noqa: E402
from planner.spec import Schedule as _Schedule  # noqa: E402
from planner.spec import _choices  # noqa: E402
from simulator.network.cluster import load_cluster  # noqa: E402
from simulator.network.collectives import cost_memo  # noqa: E402

CASES = [
    # (name, model, cluster, nodes, search keywords, metric, target)
    ("analytical tier, llama3-70b on 1024 H100", "llama3-70b", "dgx-h100", 128,
     {"global_batch": 512, "top_k": 0}, "candidates_per_s", 1000.0),
    ("mt-nlg-530b on 5120 A100 (all devices)", "mt-nlg-530b", "dgx-a100", 640,
     {"global_batch": 1920}, "wall_s", 30.0),
    ("mt-nlg-530b on <= 5120 A100", "mt-nlg-530b", "dgx-a100", 640,
     {"global_batch": 1920, "max_devices": 5120}, "wall_s", 30.0),
    ("llama3-70b on 1024 H100, seq 8192, SimPy top 20", "llama3-70b", "dgx-h100", 128,
     {"global_batch_tokens": 512 * 8192, "top_k": 20}, "wall_s", 10.0),
]


def run_case(model_name: str, cluster_name: str, nodes: int, kwargs: dict) -> dict:
    """One search, timed from the model and cluster load to the ranked table."""
    start, cpu_start = time.perf_counter(), time.process_time()
    model = load_model(model_name)
    cluster = load_cluster(cluster_name, nodes=nodes)
    result = search(model, cluster, **kwargs)
    wall = time.perf_counter() - start
    stats = result.stats
    best = result.ranked.iloc[0] if not result.ranked.empty else None
    return {"wall_s": wall, "candidates": stats["candidates"],
            "estimated": stats["estimated"], "simulated": stats["simulated"],
            "analytical_s": stats["analytical_s"], "simulation_s": stats["simulation_s"],
            "candidates_per_s": stats["candidates"] / stats["analytical_s"],
            "candidates_per_cpu_s": stats["candidates"] / stats["analytical_cpu_s"],
            "estimates_per_cpu_s": stats["estimated"] / stats["analytical_cpu_s"],
            "cpu_s": time.process_time() - cpu_start,
            "best": None if best is None else best["id"],
            "best_mfu": None if best is None else float(best["mfu"])}


#: Every schedule the planner emits (ZB-H2 is simulated only: `planner.space.ZB_H2_REASON`).
_ALL_SCHEDULES = tuple(s for s in _choices(_Schedule) if s != "zb-h2")
SCREEN_CASES = [
    # (key, name, model, cluster, nodes, global batch, search keywords, target metric, value)
    ("gpt3", "gpt3-175b on 1024 A100", "gpt3-175b", "dgx-a100", 128, 1536, {},
     "candidates_per_cpu_s", 10000.0),
    ("mt-nlg", "mt-nlg-530b on 5120 A100", "mt-nlg-530b", "dgx-a100", 640, 1920, {}, None,
     None),
    ("moe", "deepseek-v3 on 1024 H100, ep/dtype/schedule free", "deepseek-v3", "dgx-h100",
     128, 15360, {"dtype": "any", "space": SearchSpace(schedule=_ALL_SCHEDULES)},
     "analytical_cpu_s", 10.0),
]
#: Plans the pruned screen must keep exactly: the top of the ranking compared.
TOP = 20
TOP_COLUMNS = ["id", "placement", "step_time_s", "tokens_per_s", "peak_memory_bytes"]


def screen_case(model_name: str, cluster_name: str, nodes: int, global_batch: int,
                kwargs: dict | None = None) -> dict:
    """The analytical tier on the old path (no memo, every plan costed) and the new one
    (memo, pruned to the best `TOP`), each on a freshly loaded cluster (empty caches);
    ``kwargs``: more `planner.search.search` keywords (dtype, space)."""
    model = load_model(model_name)
    out, tops = {}, {}
    for path, memo, prune in (("old", False, None), ("new", True, TOP)):
        cluster = load_cluster(cluster_name, nodes=nodes)
        with cost_memo(memo):
            result = search(model, cluster, global_batch=global_batch, top_k=0, prune=prune,
                            **(kwargs or {}))
        st = result.stats
        out[path] = {"candidates": st["candidates"], "estimated": st["estimated"],
                     "pruned": st["pruned"], "analytical_s": st["analytical_s"],
                     "analytical_cpu_s": st["analytical_cpu_s"],
                     "candidates_per_s": st["candidates"] / st["analytical_s"],
                     "candidates_per_cpu_s": st["candidates"] / st["analytical_cpu_s"]}
        tops[path] = result.ranked[TOP_COLUMNS].head(TOP).reset_index(drop=True)
    out["top_equal"] = bool(tops["old"].equals(tops["new"]))
    out["speedup"] = out["new"]["candidates_per_cpu_s"] / out["old"]["candidates_per_cpu_s"]
    out["best"] = tops["new"]["id"].iloc[0] if len(tops["new"]) else None
    return out


def _screen_line(name: str, row: dict) -> str:
    old, new = row["old"], row["new"]
    metric, target = row["metric"], row["target"]
    verdict = "" if target is None else (
        f"; target {'>=' if metric == 'candidates_per_cpu_s' else '<='} {target:,.0f} "
        f"{'per CPU-s' if metric == 'candidates_per_cpu_s' else 'CPU-s'}: "
        f"{'PASS' if row['pass'] else 'FAIL'}")
    return (f"screen {name}: {new['candidates']:,} candidates; old path "
            f"{old['candidates_per_cpu_s']:,.0f} per CPU-s ({old['analytical_cpu_s']:.2f} "
            f"CPU-s, {old['candidates_per_s']:,.0f}/s wall, {old['estimated']:,} costed) | "
            f"new path {new['candidates_per_cpu_s']:,.0f} per CPU-s "
            f"({new['analytical_cpu_s']:.2f} CPU-s, {new['candidates_per_s']:,.0f}/s wall, "
            f"{new['estimated']:,} costed, {new['pruned']:,} pruned); "
            f"x{row['speedup']:.1f}; top {TOP} equal: {row['top_equal']}; best {row['best']}"
            f"{verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--only", choices=("search", "screen"),
                        help="run only the search cases or only the old/new screen cases")
    parser.add_argument("--screen", action="append", choices=[c[0] for c in SCREEN_CASES],
                        help="run only this screen case (repeatable; default all)")
    args = parser.parse_args(argv)
    rows, ok = [], True
    for name, model, cluster, nodes, kwargs, metric, target in (
            CASES if args.only != "screen" else []):
        row = {"case": name, **run_case(model, cluster, nodes, kwargs), "metric": metric,
               "target": target}
        row["pass"] = (row[metric] >= target if metric == "candidates_per_s"
                       else row[metric] <= target)
        ok &= row["pass"]
        rows.append(row)
        if not args.json:
            print(f"{name}: {row['candidates']:,} candidates ({row['estimated']:,} fit, "
                  f"{row['simulated']} simulated), {row['candidates_per_s']:,.0f} candidates/s "
                  f"analytical ({row['candidates_per_cpu_s']:,.0f} per CPU-s, "
                  f"{row['estimates_per_cpu_s']:,.0f} estimates per CPU-s), wall "
                  f"{row['wall_s']:.2f} s, CPU {row['cpu_s']:.2f} s (analytical "
                  f"{row['analytical_s']:.2f} s, SimPy {row['simulation_s']:.2f} s); "
                  f"best {row['best']} MFU {100 * (row['best_mfu'] or 0):.1f}%; target "
                  f"{metric} {'>=' if metric == 'candidates_per_s' else '<='} {target:g}: "
                  f"{'PASS' if row['pass'] else 'FAIL'}", flush=True)
    screens = []
    for key, name, model, cluster, nodes, gb, kwargs, metric, target in (
            SCREEN_CASES if args.only != "search" else []):
        if args.screen and key not in args.screen:
            continue
        row = {"case": name, **screen_case(model, cluster, nodes, gb, kwargs),
               "metric": metric, "target": target}
        value = None if metric is None else row["new"][metric]
        row["pass"] = row["top_equal"] and (target is None or (
            value >= target if metric == "candidates_per_cpu_s" else value <= target))
        ok &= row["pass"]
        screens.append(row)
        if not args.json:
            print(_screen_line(name, row), flush=True)
    if args.json:
        print(json.dumps({"cpu_count": os.cpu_count(), "cases": rows, "screens": screens}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

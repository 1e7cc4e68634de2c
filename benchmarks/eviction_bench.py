"""Evicting a straggler against staying with it, measured, and the predicted goodput.

    python benchmarks/eviction_bench.py [--steps 100] [--factor 3] [--window 5]
        [--ranks-per-node 1] [--layers 2] [--out DIR] [--json]

Three torchrun runs of tiny-gpt (global batch 8, micro-batch 1) at dp=4 on this machine, with
``--inject slow:rank=1,factor=F`` from step 1:

1. **stay** (``--on-straggler warn``): the straggler is named, the job keeps it;
2. **evict** (``--on-straggler evict``): after ``window`` slow steps the job checkpoints, leaves
   the straggler's node out, re-plans (`runtime.evict`) and resumes on the new plan (the ranks
   that stay, in their own processes);
3. **new layout**: the new plan resumed from run 2's checkpoint in another folder, for its
   healthy step time.

Printed: each run's wall time (first step start to last step end, `runtime.accounting`) and
its launch-to-exit time as `meshplan run` sees it (start-up and teardown included), run
2's restart time and measured goodput, and the predicted goodput of run 2
(`simulator.failures.eviction.predicted_eviction_goodput`) fed with run 1's median step time
(staying), run 3's (after) and the restart run 2 predicted when it decided to evict (from its
own evidence before the restart, `simulator.failures.eviction.restart_estimate_s`): nothing
run 2 measured after its decision.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from planner.planfile import ClusterRef, PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan
from runtime.launch import run_plan
from simulator.failures.eviction import predicted_eviction_goodput


def step_times(out: Path) -> list[float]:
    return [json.loads(x)["step_time_s"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def measure(root: Path, args: argparse.Namespace) -> dict:
    model = load_model("tiny-gpt").replace(seq_len=64, num_layers=args.layers)
    plan = Plan(tp=1, pp=1, dp=4, micro_batch=1, global_batch=8, dtype="fp32")
    path = write_plan_file(root / "dp4.yaml", PlanFile(
        model=model, plan=plan, cluster=ClusterRef(name="localhost-cpu", nodes=1, ranks=4),
        prediction={}))
    common = {"steps": args.steps, "quiet": True, "timeout_s": 1800,
              "inject": [f"slow:rank=1,factor={args.factor}"], "straggler_window": args.window}
    loads = [os.getloadavg()[0]]
    t0 = time.time()
    stay = run_plan(path, out_dir=root / "stay", on_straggler="warn", **common)
    t1 = time.time()
    loads.append(os.getloadavg()[0])
    evict = run_plan(path, out_dir=root / "evict", on_straggler="evict",
                     ranks_per_node=args.ranks_per_node, **common)
    t2 = time.time()
    (decision,) = evict["evictions"]
    at = decision["step"]
    copy = root / "checkpoint"
    shutil.copytree(root / "evict" / "checkpoints" / f"step{at:08d}", copy / f"step{at:08d}")
    loads.append(os.getloadavg()[0])
    run_plan(decision["plan_file"], steps=args.steps, out_dir=root / "after",
             quiet=True, timeout_s=1800, resume=copy)
    stay_s = statistics.median(step_times(root / "stay")[1:])
    after_s = statistics.median(step_times(root / "after")[1:])
    predicted = predicted_eviction_goodput(
        steps=args.steps, step_s=stay_s, step_s_staying=stay_s, step_s_after=after_s, onset=1,
        window=at, restart_s=decision["restart_s"])
    return {"steps": args.steps, "factor": args.factor, "window": args.window,
            "evicted_after_step": at, "old_plan": decision["old_plan"],
            "new_plan": decision["new_plan"], "decision": decision["line"],
            "stay_wall_s": stay["wall_time_s"], "evict_wall_s": evict["wall_time_s"],
            "stay_launch_to_exit_s": t1 - t0, "evict_launch_to_exit_s": t2 - t1,
            "evict_in_place": decision["in_place"],
            "stay_step_s": stay_s, "after_step_s": after_s,
            "restart_s": evict["restart_times_s"], "measured_goodput": evict["goodput"],
            "predicted_goodput": predicted, "predicted_restart_s": decision["restart_s"],
            "restart_basis": decision["restart_basis"],
            "load_average": loads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="eviction-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    r = measure(root, args)
    if args.json:
        print(json.dumps(r))
        return
    error = (r["predicted_goodput"] - r["measured_goodput"]) / r["measured_goodput"]
    print(r["decision"])
    print(f"stay : wall {r['stay_wall_s']:.1f} s (launch to exit "
          f"{r['stay_launch_to_exit_s']:.1f} s), median step {r['stay_step_s']:.3f} s")
    print(f"evict: wall {r['evict_wall_s']:.1f} s ({r['stay_wall_s'] / r['evict_wall_s']:.2f}x "
          f"faster; launch to exit {r['evict_launch_to_exit_s']:.1f} s), restart "
          f"{', '.join(f'{x:.1f}' for x in r['restart_s'])} s "
          f"({'in place' if r['evict_in_place'] else 'relaunched'}), median step "
          f"after {r['after_step_s']:.3f} s ({r['new_plan']})")
    print(f"goodput of the evicting run: measured {r['measured_goodput']:.3f}, predicted "
          f"{r['predicted_goodput']:.3f} (restart {r['predicted_restart_s']:.1f} s predicted: "
          f"{r['restart_basis']}), "
          f"error {100 * error:+.1f}%; load average {r['load_average']}")


if __name__ == "__main__":
    main()

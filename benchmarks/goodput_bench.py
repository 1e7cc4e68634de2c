"""Predicted vs measured goodput of a local run with injected kills.

    python benchmarks/goodput_bench.py [--steps 24] [--every 4] [--kills 1@9,0@18]
        [--layers 2] [--out DIR] [--json]

Three torchrun runs of the 2-layer tiny-gpt at dp=2 on this machine:

1. no faults: the measured mean step time and the median checkpoint blocking time;
2. one kill: the measured restart time (from the failed attempt's last step to training again:
   detection, torchrun's restart, process start-up, the checkpoint load);
3. the kills of ``--kills`` (``rank@step``): the measured goodput (kept steps' time over the job's
   wall time, `runtime.elastic.job_accounting`).

The prediction for run 3 comes from the simulator's model of a run with failures at known
steps (`simulator.failures.predicted_run_goodput`) fed with run 1's step and checkpoint times
and run 2's restart time; the script prints both and the error (the target is within 15%), and
the same prediction fed with run 3's own measured step, checkpoint and restart times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from planner.planfile import PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan
from runtime.elastic import checkpoint_blocking_times_s, read_events
from runtime.launch import run_plan
from simulator.failures import predicted_run_goodput


def checkpoint_blocking_s(out: Path) -> float:
    return statistics.median(checkpoint_blocking_times_s(read_events(out)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kills", default="1@9,0@18", help="rank@step,... of run 3")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=10.0, help="collective timeout")
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    root = Path(args.out or tempfile.mkdtemp(prefix="goodput_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    model = load_model("tiny-gpt").replace(num_layers=args.layers, seq_len=64)
    plan = Plan(tp=1, pp=1, dp=2, micro_batch=2, global_batch=8, dtype="fp32")
    path = write_plan_file(root / "plan.yaml", PlanFile(
        model=model, plan=plan, cluster={"name": "localhost-cpu", "nodes": 1}, prediction={}))
    kills = [(int(r), int(s)) for r, s in (k.split("@") for k in args.kills.split(","))]
    common = {"steps": args.steps, "checkpoint_every": args.every, "max_restarts": len(kills),
              "collective_timeout_s": args.timeout_s, "quiet": True, "timeout_s": 600}

    base = run_plan(path, out_dir=root / "no-faults", **common)
    step_time = base["useful_time_s"] / base["steps"]
    blocking = checkpoint_blocking_s(root / "no-faults")
    calib = run_plan(path, out_dir=root / "one-kill", inject=[f"kill:rank=1,step={kills[0][1]}"],
                     **common)
    restart = calib["restart_times_s"][0]
    measured = run_plan(path, out_dir=root / "kills",
                        inject=[f"kill:rank={r},step={s}" for r, s in kills], **common)
    # a rank killed at the start of step S has done none of S
    predicted = predicted_run_goodput(
        step_time_s=step_time, steps=args.steps, checkpoint_every=args.every,
        checkpoint_blocking_s=blocking, restart_s=restart,
        failure_steps=[s for _, s in kills], interrupted_fraction=0.0)
    # the same model fed with run 3's own measured step, checkpoint and restart times
    own = predicted_run_goodput(
        step_time_s=measured["useful_time_s"] / measured["steps"], steps=args.steps,
        checkpoint_every=args.every, checkpoint_blocking_s=checkpoint_blocking_s(root / "kills"),
        restart_s=statistics.mean(measured["restart_times_s"]),
        failure_steps=[s for _, s in kills], interrupted_fraction=0.0)
    result = {"step_time_s": step_time, "checkpoint_blocking_s": blocking,
              "restart_s": restart, "kills": args.kills, "restarts": measured["restarts"],
              "steps_lost": measured["steps_lost"],
              "wall_time_s": measured["wall_time_s"], "measured_goodput": measured["goodput"],
              "predicted_goodput": predicted,
              "error_pct": 100 * (predicted / measured["goodput"] - 1),
              "run3_restart_times_s": measured["restart_times_s"],
              "predicted_goodput_own_inputs": own,
              "error_own_inputs_pct": 100 * (own / measured["goodput"] - 1)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"inputs: step_time_s {step_time:.3f} (run 1), checkpoint_blocking_s {blocking:.4f} "
          f"(run 1), restart_s {restart:.2f} (run 2)")
    print(f"run 3: kills {args.kills}, {measured['restarts']} restarts, "
          f"{measured['steps_lost']} steps lost, wall {measured['wall_time_s']:.1f} s")
    print(f"goodput measured {measured['goodput']:.3f}  predicted {predicted:.3f}  "
          f"error {result['error_pct']:+.1f}% (target within 15%)")
    print(f"  from run 3's own step, checkpoint and restart times "
          f"(restarts {', '.join(f'{t:.2f}' for t in measured['restart_times_s'])} s): "
          f"predicted {own:.3f}, error {result['error_own_inputs_pct']:+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

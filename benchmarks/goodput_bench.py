"""Predicted vs measured goodput of a local run with injected kills.

    python benchmarks/goodput_bench.py [--steps 24] [--every 4] [--kills 1@9,0@18]
        [--calibration-kills 1@5,0@14] [--layers 2] [--tries 1] [--out DIR] [--json]

Each try makes three torchrun runs of the 2-layer tiny-gpt at dp=2 on this machine:

1. no faults: step times and checkpoint blocking times;
2. calibration: the kills of ``--calibration-kills`` (``rank@step``): restart times (from the
   failed attempt's last step to training again: detection, torchrun's restart, process
   start-up, the checkpoint load), and more step and checkpoint times;
3. measured: the kills of ``--kills``: the measured goodput (kept steps' time over the job's
   wall time, `runtime.resilience.job_accounting`).

The prediction for run 3 is the simulator's model of a run with failures at known steps
(`simulator.failures.montecarlo.predicted_run_goodput`) fed only with runs 1 and 2: the mean step time
of their kept steps, the median time a save blocks the loop between steps, and run 2's mean
restart time. Both sides count the same things: the staging wait of an asynchronous save runs
inside the next step, so it is in the step time and not added again; the save after the last
step is outside the measured wall time and not counted; the default calibration kills sit at
the same places relative to the checkpoints as the measured ones (one and two steps after a
checkpoint), so their restarts include the same wait for the newest checkpoint to land.

The script also prints the same model fed with run 3's own measured times: that checks the
accounting (what the model counts against what the measurement counts) without the
run-to-run noise of this machine's step and restart times, which dominates the first figure
(each input's spread over the runs is printed, and the machine's load average at the start of
each run: other processes on the machine stretch the CPU-bound restart, mostly Python imports,
more than the steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from planner.planfile import ClusterRef, PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan
from runtime.launch import run_plan
from runtime.resilience import checkpoint_blocking_times_s, read_events
from simulator.failures.montecarlo import predicted_run_goodput


def between_steps_blocking_s(out: Path) -> list[float]:
    """The save calls' blocking times of run folder ``out`` (staging waits excluded)."""
    return checkpoint_blocking_times_s(read_events(out), staging=False)


def restart_phases_s(out: Path) -> list[dict]:
    """Per restart of run folder ``out``: ``land`` (last step end to the kill: waiting for the
    newest checkpoint to land, logging the fault), ``start`` (kill to the new attempt's first
    event: torchrun's detection and respawn, process start-up and imports, model build, process
    group) and ``load`` (to training again: verify and load the checkpoint), seconds."""
    events = read_events(out)
    fired_path = out / "faults" / "fired.jsonl"
    fired = [json.loads(x) for x in fired_path.read_text().splitlines() if x]
    phases = []
    for f in fired:
        last = [e for e in events if e["event"] == "step" and e["attempt"] == f["attempt"]]
        nxt = [e for e in events if e["attempt"] == f["attempt"] + 1]
        if not last or len(nxt) < 2:
            continue
        phases.append({"land": f["time_unix_s"] - last[-1]["time_unix_s"],
                       "start": nxt[0]["time_unix_s"] - f["time_unix_s"],
                       "load": nxt[1]["time_unix_s"] - nxt[0]["time_unix_s"]})
    return phases


def parse_kills(text: str) -> list[tuple[int, int]]:
    """``"1@9,0@18"`` as ``[(1, 9), (0, 18)]`` (rank, step)."""
    return [(int(r), int(s)) for r, s in (k.split("@") for k in text.split(","))]


def one_try(root: Path, path: Path, args: argparse.Namespace) -> dict:
    """Runs 1-3 of the module docstring in ``root``; the inputs, prediction and measurement."""
    kills, calib_kills = parse_kills(args.kills), parse_kills(args.calibration_kills)
    common = {"steps": args.steps, "checkpoint_every": args.every,
              "collective_timeout_s": args.timeout_s, "quiet": True, "timeout_s": 600}

    loads = []                         # 1-minute load average at each run's start

    def run(name, faults):
        loads.append(os.getloadavg()[0])
        return run_plan(path, out_dir=root / name, max_restarts=len(faults),
                        inject=[f"kill:rank={r},step={s}" for r, s in faults], **common)

    base, calib = run("no-faults", []), run("calibration", calib_kills)
    measured = run("kills", kills)
    step_times = [base["useful_time_s"] / base["steps"], calib["useful_time_s"] / calib["steps"]]
    step_time = statistics.mean(step_times)
    blocking = statistics.median(between_steps_blocking_s(root / "no-faults")
                                 + between_steps_blocking_s(root / "calibration"))
    restart = statistics.mean(calib["restart_times_s"])
    failure_steps = [s for _, s in kills]
    # a rank killed at the start of step S has done none of S
    predicted = predicted_run_goodput(
        step_time_s=step_time, steps=args.steps, checkpoint_every=args.every,
        checkpoint_blocking_s=blocking, restart_s=restart, failure_steps=failure_steps,
        interrupted_fraction=0.0)
    own_step = measured["useful_time_s"] / measured["steps"]
    own = predicted_run_goodput(
        step_time_s=own_step, steps=args.steps, checkpoint_every=args.every,
        checkpoint_blocking_s=statistics.median(between_steps_blocking_s(root / "kills")),
        restart_s=statistics.mean(measured["restart_times_s"]), failure_steps=failure_steps,
        interrupted_fraction=0.0)
    good = measured["goodput"]
    return {"step_time_s": step_time, "step_time_runs_s": step_times + [own_step],
            "checkpoint_blocking_s": blocking, "restart_s": restart,
            "calibration_restart_times_s": calib["restart_times_s"],
            "run3_restart_times_s": measured["restart_times_s"], "kills": args.kills,
            "calibration_kills": args.calibration_kills, "restarts": measured["restarts"],
            "steps_lost": measured["steps_lost"], "wall_time_s": measured["wall_time_s"],
            "measured_goodput": good, "predicted_goodput": predicted,
            "error_pct": 100 * (predicted / good - 1), "predicted_goodput_own_inputs": own,
            "error_own_inputs_pct": 100 * (own / good - 1), "load_averages": loads,
            "calibration_restart_phases_s": restart_phases_s(root / "calibration"),
            "run3_restart_phases_s": restart_phases_s(root / "kills"),
            "cpu_count": os.cpu_count()}


def print_try(i: int, r: dict) -> None:
    runs = ", ".join(f"{t:.3f}" for t in r["step_time_runs_s"])
    print(f"try {i}: inputs (runs 1, 2): step_time_s {r['step_time_s']:.3f}, "
          f"checkpoint_blocking_s {r['checkpoint_blocking_s']:.4f}, restart_s "
          f"{r['restart_s']:.2f} (restarts "
          f"{', '.join(f'{t:.2f}' for t in r['calibration_restart_times_s'])} s)")
    print(f"  run 3: kills {r['kills']}, {r['restarts']} restarts, {r['steps_lost']} steps "
          f"lost, wall {r['wall_time_s']:.1f} s; step time per run (1, 2, 3): {runs} s; "
          f"restarts {', '.join(f'{t:.2f}' for t in r['run3_restart_times_s'])} s")
    for name in ("calibration", "run3"):
        parts = "; ".join(f"land {p['land']:.2f} + start {p['start']:.2f} + load "
                          f"{p['load']:.2f}" for p in r[f"{name}_restart_phases_s"])
        print(f"  {name} restarts: {parts} s")
    print(f"  load average at the runs' starts (1, 2, 3): "
          f"{', '.join(f'{x:.1f}' for x in r['load_averages'])} on {r['cpu_count']} cores")
    if max(r["load_averages"]) > (r["cpu_count"] or 1):
        print("  note: the load average exceeded the core count: other processes share the "
              "cores, and the restarts' start-up stretches by up to several times")
    print(f"  goodput measured {r['measured_goodput']:.3f}  predicted "
          f"{r['predicted_goodput']:.3f}  error {r['error_pct']:+.1f}% (target within 15%)")
    print(f"  from run 3's own step, checkpoint and restart times: predicted "
          f"{r['predicted_goodput_own_inputs']:.3f}, error {r['error_own_inputs_pct']:+.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kills", default="1@9,0@18", help="rank@step,... of run 3")
    parser.add_argument("--calibration-kills", default="1@5,0@14",
                        help="rank@step,... of run 2 (restart times)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tries", type=int, default=1, help="repeat runs 1-3 this often")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="collective timeout")
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    root = Path(args.out or tempfile.mkdtemp(prefix="goodput_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    model = load_model("tiny-gpt").replace(num_layers=args.layers, seq_len=64)
    plan = Plan(tp=1, pp=1, dp=2, micro_batch=2, global_batch=8, dtype="fp32")
    path = write_plan_file(root / "plan.yaml", PlanFile(
        model=model, plan=plan, cluster=ClusterRef(name="localhost-cpu", nodes=1), prediction={}))
    results = []
    for i in range(1, args.tries + 1):
        results.append(one_try(root / f"try{i}", path, args))
        if not args.json:
            print_try(i, results[-1])
    if args.json:
        print(json.dumps(results if args.tries > 1 else results[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

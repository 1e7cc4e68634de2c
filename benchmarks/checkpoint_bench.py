"""How long a checkpoint blocks the training loop: asynchronous vs synchronous DCP saves.

    python benchmarks/checkpoint_bench.py [--store s3|local] [--model tiny-gpt] [--layers 4]
        [--seq-len 128] [--dp 2] [--steps 13] [--every 3] [--out runs/checkpoint_bench]

Two torchrun runs of the same plan, one with ``--sync-checkpoint``
(blocking ``dcp.save``) and one with the default ``dcp.async_save`` on its own gloo group.
``--store s3`` (the default) writes both to an object store, ``s3://bench/<mode>``: Debian's
radosgw on a one-node Ceph started on 127.0.0.1 for the benchmark (`runtime.radosgw`; its
start-up time is printed); ``--store local`` into the run folder.
Each save's blocking time is what the training loop waits: for the synchronous save the whole
write; for the asynchronous one the wait for the previous save, the state dict, the staging
copy and the save plan. It prints the median of each, their ratio (the target is <= 10%), the
state size and the median step time; ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from planner.planfile import ClusterRef, PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan
from runtime.checkpoint import CheckpointStore, list_checkpoints
from runtime.faults import fault_cli_args
from runtime.launch import local_torchrun_command
from runtime.radosgw import Radosgw, missing_binaries
from runtime.resilience import checkpoint_blocking_times_s, read_events


def blocking_times_s(out: Path) -> list[float]:
    return checkpoint_blocking_times_s(read_events(out))


def state_bytes(folder: Path | str) -> int:
    """Bytes of the newest checkpoint in ``folder`` (a path or an object-store URL)."""
    newest = list_checkpoints(folder)[0]
    return sum(CheckpointStore(folder).files(newest).values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("s3", "local"), default="s3",
                        help="where the checkpoints go (default s3: radosgw on 127.0.0.1)")
    parser.add_argument("--model", default="tiny-gpt")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--out", default=None, help="run folders (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.store == "s3" and (missing := missing_binaries()):
        parser.error(f"--store s3 starts radosgw, but these Ceph programs are missing: "
                     f"{', '.join(missing)}; install Debian's ceph-mon ceph-osd radosgw "
                     "ceph-common (make ceph), or use --store local")

    root = Path(args.out or tempfile.mkdtemp(prefix="checkpoint_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model).replace(num_layers=args.layers, seq_len=args.seq_len)
    plan = Plan(tp=1, pp=1, dp=args.dp, micro_batch=2, global_batch=4 * args.dp, dtype="fp32")
    cluster = ClusterRef(name="localhost-cpu", nodes=1, ranks=plan.world_size)
    path = write_plan_file(root / "plan.yaml", PlanFile(model=model, plan=plan, cluster=cluster,
                                                        prediction={}))
    result = {"store": args.store}
    gateway = Radosgw(root / "ceph").start() if args.store == "s3" else None
    try:
        env = {}
        if gateway is not None:
            result["radosgw_startup_s"] = gateway.startup_s
            env = gateway.env
            os.environ.update(env)          # this process reads the store too (state_bytes)
            CheckpointStore("s3://bench").fs.mkdir("bench")
        for mode, sync in (("sync", True), ("async", False)):
            out = root / mode
            where = f"s3://bench/{mode}" if gateway is not None else out / "checkpoints"
            extra = (["--sync-checkpoint"] if sync else []) + \
                (["--checkpoint-dir", where] if gateway is not None else [])
            summary = _run(path, out, args.steps, args.every, extra, env)
            times = blocking_times_s(out)
            result[mode] = {"blocking_s_median": statistics.median(times), "blocking_s": times,
                            "step_time_s": summary["step_time_s"]}
        result["state_bytes"] = state_bytes(where)
    finally:
        if gateway is not None:
            gateway.stop()
    result["ratio"] = result["async"]["blocking_s_median"] / result["sync"]["blocking_s_median"]
    if args.json:
        print(json.dumps(result))
        return 0
    store = "local disk" if gateway is None else \
        f"object store (radosgw, up in {result['radosgw_startup_s']:.1f} s)"
    print(f"plan {plan.id}, {args.model} x{args.layers} layers, state "
          f"{result['state_bytes'] / 2**20:.1f} MiB, a checkpoint every {args.every} steps, "
          f"to the {store}")
    for mode in ("sync", "async"):
        r = result[mode]
        print(f"  {mode:5s}  blocking_s median {r['blocking_s_median']:.4f}  "
              f"(n={len(r['blocking_s'])})  step_time_s {r['step_time_s']:.3f}")
    print(f"  async blocks for {100 * result['ratio']:.1f}% of a synchronous save "
          f"(target <= 10%)")
    return 0


def _run(path: Path, out: Path, steps: int, every: int, extra: list[str],
         env_extra: dict[str, str]) -> dict:
    """One torchrun run of ``path``; ``extra`` are more runtime.train flags, ``env_extra``
    more environment variables (the object store's credentials)."""
    cmd = local_torchrun_command(path, steps=steps, out_dir=out,
                           train_args=fault_cli_args(checkpoint_every=every) + extra)
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, **env_extra, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return json.loads((out / "summary.json").read_text())


if __name__ == "__main__":
    raise SystemExit(main())

"""`meshplan launch PLAN.yaml`: print or run one node's torchrun command, or write an sbatch script.

    meshplan launch plan.yaml --nodes 2 --rdzv-endpoint 10.0.0.1:29500            # every node
    meshplan launch plan.yaml --nodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29500 --run
    meshplan launch plan.yaml --nodes 64 --slurm train.sbatch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from apps.format import command_console
from planner.spec import PlanError

_REPO_ROOT = Path(__file__).resolve().parent.parent


def launch_env() -> dict[str, str]:
    """The environment a launched agent gets: one OpenMP thread unless set, this checkout first
    on PYTHONPATH (so ``-m runtime.train`` resolves without an install)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def check_nproc_per_node(nproc: int | None, world: int, nodes: int, cluster) -> None:
    """Raise `PlanError` when ``--nproc-per-node`` is not world / nodes or is more than the
    node has devices (``cluster``: None when unknown, localhost: no device bound)."""
    if nproc is None:
        return
    if nproc < 1 or nproc * nodes != world:
        raise PlanError(f"--nproc-per-node={nproc} x --nodes={nodes} = {nproc * nodes} != "
                        f"the plan's tp*pp*dp = {world}; use --nproc-per-node "
                        f"{max(1, world // nodes)} with --nodes {nodes}")
    if cluster is not None and cluster.nics_per_node and nproc > cluster.devices_per_node:
        raise PlanError(f"--nproc-per-node={nproc} is more than the {cluster.devices_per_node} "
                        f"GPUs of a {cluster.name!r} node; use --nodes "
                        f"{-(-world // cluster.devices_per_node)}")


def check_nodes_fit(plan_path: str, nodes: int, nproc: int | None = None) -> None:
    """Raise `PlanError` when the runtime cannot run the plan (`check_runnable`), or when
    ``nodes`` would put more workers on a node than the plan's cluster has devices per node (a
    GPU cluster named in the plan file), naming the node count that fits; localhost plans and
    user clusters that cannot be loaded pass the second check."""
    from apps.clusters import cluster_of_plan_file
    from planner.planfile import check_runnable, read_plan_file
    pf = read_plan_file(plan_path)
    check_runnable(pf.plan)
    try:
        cluster = cluster_of_plan_file(pf)
    except PlanError:
        cluster = None
    check_nproc_per_node(nproc, pf.plan.world_size, nodes, cluster)
    if cluster is None or cluster.nics_per_node == 0:    # localhost-cpu: one node
        return
    world, per_node = pf.plan.world_size, cluster.devices_per_node
    if world > nodes * per_node:
        need = -(-world // per_node)
        raise PlanError(f"--nodes={nodes} puts more than {per_node} workers on a node, but "
                        f"{cluster.name!r} nodes have {per_node} devices and the plan needs "
                        f"tp*pp*dp = {world}: use --nodes {need}")


def cmd_launch(args: argparse.Namespace) -> int:
    """Print (default) or ``--run`` the torchrun command(s); ``--slurm`` writes a batch script."""
    from planner.launch import parse_endpoint, sbatch_script, shell_line, torchrun_node_command
    console = command_console(args)
    for flag, value in (("--nodes", args.nodes), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise PlanError(f"{flag}={value} must be a positive integer")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nodes:
        raise PlanError(f"--node-rank={args.node_rank} must be in 0..{args.nodes - 1}")
    check_nodes_fit(args.plan, args.nodes, getattr(args, "nproc_per_node", None))
    if args.slurm and (args.rdzv_endpoint or args.node_rank is not None or args.run):
        given = [f for f, v in (("--rdzv-endpoint", args.rdzv_endpoint),
                                ("--node-rank", args.node_rank), ("--run", args.run or None))
                 if v is not None]
        raise PlanError(f"--slurm {args.slurm} and {' '.join(given)} exclude each other: the "
                        f"batch script takes node 0 of the allocation as the rendezvous (its "
                        f"port: --port); leave {given[0]} out, or --slurm to print the torchrun "
                        f"lines")
    out = {}
    if args.slurm:
        script = sbatch_script(args.plan, nodes=args.nodes, port=args.port, steps=args.steps,
                               out_dir=args.out, data=args.data, time_limit=args.time,
                               partition=args.partition)
        Path(args.slurm).write_text(script, encoding="utf-8")
        console.print(f"wrote {args.slurm} (sbatch {args.slurm})", highlight=False)
        out["slurm"] = str(args.slurm)
        if args.json:
            print(json.dumps(out))
        return 0
    if not args.rdzv_endpoint:
        raise PlanError("--rdzv-endpoint HOST:PORT is needed (or --slurm FILE)")
    parse_endpoint(args.rdzv_endpoint)  # HOST:PORT, a port in 1..65535
    ranks = [args.node_rank] if args.node_rank is not None else list(range(args.nodes))
    if args.run and args.node_rank is None:
        raise PlanError("--run starts one node's agent; give --node-rank R")
    commands = [torchrun_node_command(args.plan, nodes=args.nodes, node_rank=r,
                                      rdzv_endpoint=args.rdzv_endpoint, steps=args.steps,
                                      out_dir=args.out, data=args.data, rdzv_id=args.rdzv_id,
                                      # Printed lines run on other nodes: name the launcher
                                      # portably; --run starts it here with this interpreter.
                                      launcher=None if args.run else ["torchrun"])
                for r in ranks]
    out["commands"] = [{"node_rank": r, "argv": c, "line": shell_line(c)}
                       for r, c in zip(ranks, commands, strict=True)]
    if args.json:
        print(json.dumps(out))
    elif not args.run:
        for r, c in zip(ranks, commands, strict=True):
            console.print(f"# node {r} of {args.nodes}", highlight=False)
            print(shell_line(c, {"OMP_NUM_THREADS": "1"}), flush=True)
    if args.run:
        return subprocess.run(commands[0], env=launch_env(), check=False).returncode
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `launch` on the CLI's subparsers."""
    sl = sub.add_parser("launch", help="print or run torchrun per node, or write an sbatch "
                        "script, for a plan file")
    sl.add_argument("plan", help="plan file (YAML), readable at the same path on every node")
    sl.add_argument("--nodes", type=int, required=True, help="nodes; each runs world/nodes "
                    "workers")
    sl.add_argument("--node-rank", type=int, help="this node (default: print every node)")
    sl.add_argument("--nproc-per-node", type=int, help="workers per node, checked against "
                    "the plan (world / nodes) and the node's GPUs (default: world / nodes)")
    sl.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (node 0)")
    sl.add_argument("--rdzv-id", help="job id shared by the nodes (default: the plan id)")
    sl.add_argument("--steps", type=int, default=10)
    sl.add_argument("--out", help="run folder (default runs/<plan id>)")
    sl.add_argument("--data", help="text file to train on")
    sl.add_argument("--run", action="store_true", help="run this node's command, not print it")
    sl.add_argument("--slurm", help="write an sbatch script to this file")
    sl.add_argument("--port", type=int, default=29500, help="rendezvous port in the sbatch "
                    "script (default 29500)")
    sl.add_argument("--time", default="01:00:00", help="sbatch --time (default 01:00:00)")
    sl.add_argument("--partition", help="sbatch --partition")
    sl.add_argument("--json", action="store_true", help="print the commands as JSON")
    sl.set_defaults(func=cmd_launch)

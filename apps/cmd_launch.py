"""`meshplan launch PLAN.yaml`: print or run one node's torchrun command, or write an sbatch script.

    meshplan launch plan.yaml --nodes 2 --rdzv-endpoint 10.0.0.1:29500            # every node
    meshplan launch plan.yaml --nodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29500 --run
    meshplan launch plan.yaml --nodes 64 --slurm train.sbatch
    # elastic: runs on 1 to 2 nodes, the rendezvous in etcd, restarts from checkpoints
    meshplan launch plan.yaml --nodes 2 --min-nodes 1 --rdzv-backend etcd-v2 \
        --rdzv-endpoint 10.0.0.9:2379 --max-restarts 3 --checkpoint-every 5
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from apps.format import check_output_path, command_console, output_file, print_json
from planner.spec import PlanError

_REPO_ROOT = Path(__file__).resolve().parent.parent


def launch_env(elastic: bool = False) -> dict[str, str]:
    """The environment a launched agent gets: one OpenMP thread unless set, this checkout first
    on PYTHONPATH (so ``-m runtime.train`` resolves without an install), and for an elastic
    range `planner.launch.ELASTIC_ENV`."""
    from planner.launch import ELASTIC_ENV
    env = dict(os.environ) | (ELASTIC_ENV if elastic else {})
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


def check_nodes_fit(plan_path: str, nodes: int, nproc: int | None = None):
    """Raise `PlanError` when the runtime cannot run the plan (`check_runnable`), or when
    ``nodes`` would put more workers on a node than the plan's cluster has devices per node (a
    GPU cluster named in the plan file), naming the node count that fits; localhost plans and
    user clusters that cannot be loaded pass the second check. Returns the plan's cluster
    (`Cluster`), or None when it cannot be loaded."""
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
        return cluster
    world, per_node = pf.plan.world_size, cluster.devices_per_node
    if world > nodes * per_node:
        need = -(-world // per_node)
        raise PlanError(f"--nodes={nodes} puts more than {per_node} workers on a node, but "
                        f"{cluster.name!r} nodes have {per_node} devices and the plan needs "
                        f"tp*pp*dp = {world}: use --nodes {need}")
    return cluster


def check_etcd_rendezvous(endpoint: str, rdzv_conf: str | None = None) -> None:
    """Raise `PlanError` when this node cannot meet at torchrun's etcd-v2 rendezvous on
    ``endpoint`` (``HOST:PORT``, etcd's client port): the python-etcd package is missing, nothing
    answers, or etcd answers without its v2 API (etcd 3.4 serves ``/v2/keys`` only with
    ``--enable-v2``; else 404). Otherwise torchrun ends in a traceback of the rendezvous. An
    https endpoint (``protocol=https`` in ``rdzv_conf``) is not probed: that needs the
    client certificates torchrun is given."""
    from planner.launch import parse_endpoint
    if importlib.util.find_spec("etcd") is None:
        raise PlanError("--rdzv-backend etcd-v2 needs the python-etcd package on every node: "
                        "pip install python-etcd==0.4.5")
    host, port = parse_endpoint(endpoint)
    if "protocol=https" in (rdzv_conf or ""):
        return
    url = f"http://{host}:{port}/v2/keys"
    try:
        urllib.request.urlopen(url, timeout=10).close()
    except urllib.error.HTTPError as exc:
        hint = ("start etcd with --enable-v2" if exc.code == 404 else "check the server's log")
        raise PlanError(f"--rdzv-endpoint {endpoint}: etcd answers {exc.code} for {url}, the "
                        f"v2 API torchrun's etcd-v2 rendezvous uses; {hint}") from None
    except OSError as exc:
        raise PlanError(f"--rdzv-endpoint {endpoint}: no etcd answers there "
                        f"({getattr(exc, 'reason', exc)}); start one on a host every node "
                        "reaches (etcd --enable-v2 --listen-client-urls http://0.0.0.0:2379 "
                        "--advertise-client-urls http://HOST:2379) or fix the endpoint") from None


def elastic_train_args(args: argparse.Namespace) -> list[str]:
    """The `runtime.train` checkpoint flags of a launch, checked by `TrainConfig` (its
    `PlanError` names the flag); an elastic range (``--min-nodes`` below ``--nodes``) needs
    ``--max-restarts`` >= 1 and ``--checkpoint-every`` >= 1, or losing a node ends the job or
    restarts it from step 0, and a plan on every world size of the range
    (`runtime.evict.plan_for_world`)."""
    from planner.launch import node_range
    from planner.planfile import read_plan_file
    from runtime.config import TrainConfig
    from runtime.evict import plan_for_world
    from runtime.faults import fault_cli_args
    TrainConfig(plan_path=args.plan, out_dir=args.out or "runs", steps=args.steps,
                checkpoint_every=args.checkpoint_every, keep=args.keep,
                checkpoint_dir=args.checkpoint_dir, resume=args.resume,
                timeout_s=args.timeout_s)
    if args.max_restarts < 0:
        raise PlanError(f"--max-restarts={args.max_restarts} must be >= 0")
    min_nodes = node_range(args.nodes, args.min_nodes, names=("--min-nodes", "--nodes"))
    if min_nodes < args.nodes:
        if args.max_restarts < 1 or args.checkpoint_every < 1:
            raise PlanError(f"--min-nodes={min_nodes} < --nodes={args.nodes} is an elastic "
                            f"launch: it needs --max-restarts >= 1 (now {args.max_restarts}) "
                            f"and --checkpoint-every >= 1 (now {args.checkpoint_every}) to "
                            "continue after a node is lost; e.g. --max-restarts 3 "
                            "--checkpoint-every 5")
        pf = read_plan_file(args.plan)
        per_node = pf.plan.world_size // args.nodes
        # from the top: the first node count without a plan bounds every --min-nodes that works
        for nodes in range(args.nodes - 1, min_nodes - 1, -1):
            try:
                plan_for_world(pf, nodes * per_node)
            except PlanError:
                fix = (f"give --min-nodes {nodes + 1} or more (every node count from "
                       f"{nodes + 1} to {args.nodes} has a plan)" if nodes + 1 < args.nodes
                       else f"no --min-nodes below --nodes={args.nodes} works: launch a "
                       "fixed size (leave --min-nodes out)")
                raise PlanError(f"--min-nodes={min_nodes}: no plan of {pf.model.name} with "
                                f"global_batch={pf.plan.global_batch} runs on {nodes} nodes "
                                f"({nodes * per_node} devices), and an elastic launch needs "
                                f"one on every node count of its range; {fix}") from None
    return fault_cli_args(checkpoint_every=args.checkpoint_every, keep=args.keep,
                          checkpoint_dir=args.checkpoint_dir, resume=args.resume,
                          timeout_s=args.timeout_s)


def cmd_launch(args: argparse.Namespace) -> int:
    """Print (default) or ``--run`` the torchrun command(s); ``--slurm`` writes a batch script."""
    from planner.launch import (
        ELASTIC_ENV,
        parse_endpoint,
        sbatch_script,
        shell_line,
        torchrun_node_command,
    )
    console = command_console(args)
    for flag, value in (("--nodes", args.nodes), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise PlanError(f"{flag}={value} must be a positive integer")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nodes:
        raise PlanError(f"--node-rank={args.node_rank} must be in 0..{args.nodes - 1}")
    check_output_path("--slurm", args.slurm)
    if args.run:    # this host runs its node's workers: their run folder is written here
        check_output_path("--out", args.out, folder=True)
    cluster = check_nodes_fit(args.plan, args.nodes, getattr(args, "nproc_per_node", None))
    train_args = elastic_train_args(args)
    etcd = args.rdzv_backend == "etcd-v2"
    # under etcd-v2 the endpoint is the etcd server the batch script's nodes meet at; a c10d
    # batch script takes node 0 of the allocation as the rendezvous instead
    c10d_endpoint = None if etcd else args.rdzv_endpoint
    if args.slurm and (c10d_endpoint or args.node_rank is not None or args.run):
        given = [f for f, v in (("--rdzv-endpoint", c10d_endpoint),
                                ("--node-rank", args.node_rank), ("--run", args.run or None))
                 if v is not None]
        raise PlanError(f"--slurm {args.slurm} and {' '.join(given)} exclude each other: the "
                        f"batch script takes node 0 of the allocation as the rendezvous (its "
                        f"port: --port; an etcd-v2 launch meets at --rdzv-endpoint); leave "
                        f"{given[0]} out, or --slurm to print the torchrun lines")
    out = {}
    if args.slurm:
        script = sbatch_script(args.plan, nodes=args.nodes, port=args.port, steps=args.steps,
                               out_dir=args.out, data=args.data, time_limit=args.time,
                               partition=args.partition, min_nodes=args.min_nodes,
                               rdzv_backend=args.rdzv_backend,
                               rdzv_endpoint=args.rdzv_endpoint if etcd else None,
                               rdzv_conf=args.rdzv_conf,
                               max_restarts=args.max_restarts or None, train_args=train_args,
                               transport=cluster.transport if cluster else "",
                               socket_ifname=args.socket_ifname, gid_index=args.gid_index)
        output_file(args.slurm).write_text(script, encoding="utf-8")
        console.print(f"wrote {args.slurm} (sbatch {shlex.quote(str(args.slurm))})",
                      highlight=False, markup=False)
        out["slurm"] = str(args.slurm)
        if args.json:
            print_json(out)
        return 0
    if not args.rdzv_endpoint:
        raise PlanError("--rdzv-endpoint HOST:PORT is needed (or --slurm FILE)")
    parse_endpoint(args.rdzv_endpoint)  # HOST:PORT, a port in 1..65535
    if args.run and args.node_rank is None and args.nodes == 1:
        args.node_rank = 0                    # the only node
    ranks = [args.node_rank] if args.node_rank is not None else list(range(args.nodes))
    if args.run and args.node_rank is None:
        raise PlanError(f"--run starts one node's agent; give --node-rank R (R in "
                        f"0..{args.nodes - 1}: this node's place among --nodes={args.nodes})")
    if args.run and args.rdzv_backend == "etcd-v2":
        check_etcd_rendezvous(args.rdzv_endpoint, args.rdzv_conf)
    commands = [torchrun_node_command(args.plan, nodes=args.nodes, node_rank=r,
                                      rdzv_endpoint=args.rdzv_endpoint, steps=args.steps,
                                      out_dir=args.out, data=args.data, rdzv_id=args.rdzv_id,
                                      min_nodes=args.min_nodes, rdzv_backend=args.rdzv_backend,
                                      rdzv_conf=args.rdzv_conf,
                                      max_restarts=args.max_restarts or None,
                                      train_args=train_args,
                                      # Printed lines run on other nodes: name the launcher
                                      # portably; --run starts it here with this interpreter.
                                      launcher=None if args.run else ["torchrun"])
                for r in ranks]
    elastic = "--elastic" in commands[0]
    agent_vars = {"OMP_NUM_THREADS": "1"} | (ELASTIC_ENV if elastic else {})
    out["commands"] = [{"node_rank": r, "argv": c, "env": agent_vars,
                        "line": shell_line(c, agent_vars)}
                       for r, c in zip(ranks, commands, strict=True)]
    if args.json:
        print_json(out)
    elif not args.run:
        for r, c in zip(ranks, commands, strict=True):
            console.print(f"# node {r} of {args.nodes}", highlight=False, markup=False)
            print(shell_line(c, agent_vars), flush=True)
    if args.run:
        return subprocess.run(commands[0], env=launch_env(elastic), check=False).returncode
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `launch` on the CLI's subparsers."""
    from planner.launch import RDZV_BACKENDS, ROCE_GID_INDEX, SOCKET_IFNAME
    from runtime.faults import add_checkpoint_args, add_max_restarts_arg, add_timeout_arg
    sl = sub.add_parser("launch", help="print or run torchrun per node, or write an sbatch "
                        "script, for a plan file")
    sl.add_argument("plan", help="plan file (YAML), readable at the same path on every node")
    sl.add_argument("--nodes", type=int, required=True, help="nodes; each runs world/nodes "
                    "workers")
    sl.add_argument("--node-rank", type=int, help="this node, 0..nodes-1 (default: print "
                    "every node; with --run and --nodes 1: 0)")
    sl.add_argument("--nproc-per-node", type=int, help="workers per node, checked against "
                    "the plan (world / nodes) and the node's GPUs (default: world / nodes)")
    sl.add_argument("--min-nodes", type=int, help="fewest nodes the job runs on (default "
                    "--nodes); below --nodes the launch is elastic (torchrun --nnodes MIN:MAX): "
                    "after a lost node the rest re-plan and continue from the checkpoint")
    sl.add_argument("--rdzv-backend", choices=RDZV_BACKENDS, default="c10d",
                    help="c10d: the rendezvous lives on node 0 and ends with it; etcd-v2: in "
                         "an etcd server (etcd --enable-v2; pip install python-etcd) that "
                         "outlives any node (default c10d)")
    sl.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous: node 0 (c10d) or "
                    "the etcd server (etcd-v2, port 2379 by default)")
    sl.add_argument("--rdzv-id", help="job id shared by the nodes (default: the plan id)")
    sl.add_argument("--rdzv-conf", metavar="K=V,...", help="torchrun --rdzv-conf, e.g. "
                    "last_call_timeout=10,keep_alive_interval=2")
    add_max_restarts_arg(sl)
    add_checkpoint_args(sl)
    add_timeout_arg(sl)
    sl.add_argument("--steps", type=int, default=10)
    sl.add_argument("--out", help="run folder (default runs/<plan id>)")
    sl.add_argument("--data", help="text file to train on")
    sl.add_argument("--run", action="store_true", help="run this node's command, not print it")
    sl.add_argument("--slurm", help="write an sbatch script to this file")
    sl.add_argument("--port", type=int, default=29500, help="rendezvous port in the sbatch "
                    "script (default 29500)")
    sl.add_argument("--time", default="01:00:00", help="sbatch --time (default 01:00:00)")
    sl.add_argument("--partition", help="sbatch --partition")
    sl.add_argument("--socket-ifname", default=SOCKET_IFNAME, metavar="PREFIXES",
                    help="NCCL_SOCKET_IFNAME in the sbatch script: the interfaces NCCL "
                    "bootstraps over, as prefixes ('^' excludes, '=' an exact name, e.g. "
                    f"=eth0) (default {SOCKET_IFNAME}: all but loopback and docker)")
    sl.add_argument("--gid-index", type=int, metavar="N",
                    help="NCCL_IB_GID_INDEX in the sbatch script of a RoCE cluster: the GID "
                    f"that carries RoCE v2, as show_gids lists it (default {ROCE_GID_INDEX})")
    sl.add_argument("--json", action="store_true", help="print the commands as JSON")
    sl.set_defaults(func=cmd_launch)

"""Launch commands for a plan file: the one torchrun command line (`torchrun_command`), one per
node of a multi-node job (`torchrun_node_command`), and a Slurm batch script.

One machine: torchrun's static rendezvous on 127.0.0.1 (``--master-addr`` / ``--master-port``),
which `runtime.launch.run_plan` runs. Several nodes: every node runs one torchrun agent with
``world_size / nodes`` workers; the agents meet at a rendezvous, which hands the workers of
`runtime.train` the store they share. The same plan file must be readable on every node.

Rendezvous backends (`RDZV_BACKENDS`): ``c10d`` keeps the rendezvous in a TCP store that the
agent of the endpoint's host serves, so the job ends when that node goes. ``etcd-v2`` keeps it in
an etcd server (v2 API: ``etcd --enable-v2``; the agents need the ``python-etcd`` package), a
service that outlives any one node. With an elastic node range (``min_nodes`` < ``nodes``:
``--nnodes MIN:MAX``) and ``--max-restarts``, the agents that remain after a node is lost meet
again and the workers continue from the job's checkpoint on the plan the planner picks for the
ranks left (``runtime.train --elastic``).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from planner.planfile import read_plan_file
from planner.spec import PlanError

#: The module every worker runs.
TRAIN_MODULE = "runtime.train"
#: torchrun rendezvous backends a multi-node launch may use (module docstring).
RDZV_BACKENDS = ("c10d", "etcd-v2")
#: Environment of every agent of an elastic launch. By default the rank-0 agent of the first
#: round keeps serving the workers' store in later rounds and publishes its address once; a
#: node that joins a running job waits for that address forever (measured on torch 2.13 with
#: etcd-v2: both agents stalled in the rendezvous of the larger round). With the opt-out,
#: every round's rank 0 publishes a fresh store, which the workers' rank 0 serves.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
#: NCCL_SOCKET_IFNAME of a batch script unless told otherwise: every interface but loopback and
#: docker bridges, which is NCCL's own default filter, written out so it is visible and easy to
#: change (NCCL docs, "Environment Variables": NCCL_SOCKET_IFNAME takes prefixes, ``^``
#: excludes, ``=`` matches a whole name; "By default, NCCL ignores docker and lo interfaces").
SOCKET_IFNAME = "^docker,lo"
#: NCCL_IB_GID_INDEX on a RoCE fabric: the GID table entry that carries RoCE v2 (routable
#: UDP/IP). Index 3 is where mlx5 drivers put the IPv4 RoCE v2 GID of the first address
#: (``show_gids``; NCCL docs, "Environment Variables", NCCL_IB_GID_INDEX: "the Global ID index
#: used in RoCE mode. See the InfiniBand show_gids command in order to set this value").
ROCE_GID_INDEX = 3


def nccl_env(transport: str, *, socket_ifname: str = SOCKET_IFNAME,
             gid_index: int | None = None) -> dict[str, str]:
    """The NCCL variables a job on a fabric of ``transport`` ('infiniband', 'roce' or '' for
    none) needs: NCCL_SOCKET_IFNAME (the bootstrap and socket interface, `SOCKET_IFNAME` by
    default) and, on RoCE, NCCL_IB_GID_INDEX (``gid_index``, `ROCE_GID_INDEX` by default).

    >>> nccl_env("roce")
    {'NCCL_SOCKET_IFNAME': '^docker,lo', 'NCCL_IB_GID_INDEX': '3'}

    Raises:
        PlanError: an empty ``socket_ifname``, or a ``gid_index`` below 0.
    """
    if not socket_ifname:
        raise PlanError(f"socket_ifname={socket_ifname!r} must name interfaces, e.g. "
                        f"{SOCKET_IFNAME!r} or '=eth0'")
    env = {"NCCL_SOCKET_IFNAME": socket_ifname}
    if gid_index is not None and gid_index < 0:
        raise PlanError(f"gid_index={gid_index} must be >= 0 (show_gids lists the indices)")
    if transport == "roce":
        env["NCCL_IB_GID_INDEX"] = str(ROCE_GID_INDEX if gid_index is None else gid_index)
    return env


def activate_lines(prefix: str | None = None) -> list[str]:
    """Shell lines that activate the Python environment ``prefix`` (default `sys.prefix`, the
    one meshplan runs from) in a batch job: a venv's ``bin/activate``; a conda env (a
    ``conda-meta`` folder) through conda's shell hook; else its ``bin`` first on PATH."""
    prefix = sys.prefix if prefix is None else prefix
    root = Path(prefix)
    if (root / "conda-meta").is_dir():
        conda = os.environ.get("CONDA_EXE") or "conda"
        return [f'eval "$({shlex.quote(conda)} shell.bash hook)"',
                f"conda activate {shlex.quote(prefix)}"]
    if (root / "bin" / "activate").is_file():
        return [f"source {shlex.quote(str(root / 'bin' / 'activate'))}"]
    return [f'export PATH={shlex.quote(str(root / "bin"))}:"$PATH"']


def procs_per_node(world_size: int, nodes: int) -> int:
    """Workers per node: world_size / nodes.

    >>> procs_per_node(16, 2)
    8

    Raises:
        PlanError: nodes is not positive or does not divide the world size.
    """
    if nodes < 1:
        raise PlanError(f"nodes={nodes} must be a positive integer")
    if world_size % nodes:
        choices = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise PlanError(f"the plan's world_size tp*pp*dp = {world_size} does not split over "
                        f"nodes={nodes}; use nodes in {choices}")
    return world_size // nodes


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"HOST:PORT"`` as (host, port).

    >>> parse_endpoint("10.0.0.1:29500")
    ('10.0.0.1', 29500)

    Raises:
        PlanError: no port, or a port outside 1..65535.
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PlanError(f"rdzv endpoint {endpoint!r} must be HOST:PORT with a port in 1..65535")
    return host, int(port)


def torchrun_command(plan_path: str | Path, *, nproc_per_node: int | str, steps: int,
                     out_dir: str | Path, data: str | Path | None = None,
                     master_port: int | None = None, nnodes: int | str = 1,
                     node_rank: int | str | None = None, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None, max_restarts: int | None = None,
                     rdzv_backend: str = "c10d", rdzv_conf: str | None = None,
                     launcher: list[str] | None = None,
                     train_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The torchrun command line that trains ``plan_path`` with `runtime.train` (no checks).

    One machine (``rdzv_endpoint`` None): ``--nproc-per-node N --master-addr 127.0.0.1
    --master-port P``. Several nodes: ``--nnodes N --node-rank R --nproc-per-node N
    --rdzv-backend B --rdzv-endpoint HOST:PORT --rdzv-id ID [--rdzv-conf K=V,...]`` (``nnodes``
    may be an elastic range ``"MIN:MAX"``). Then ``--max-restarts``
    (when given), ``-m runtime.train PLAN --steps S --out DIR [--data FILE]`` and
    ``train_args`` (more `runtime.train` flags). Values may be shell variables (``"$SLURM_NODEID"``)
    for a script.

    Args:
        launcher: the torchrun executable as a list (default ``python -m torch.distributed.run``
            with this interpreter).

    >>> torchrun_command("p.yaml", nproc_per_node=2, steps=3, out_dir="o", master_port=29500,
    ...                  launcher=["torchrun"])  # doctest: +NORMALIZE_WHITESPACE
    ['torchrun', '--nproc-per-node', '2', '--master-addr', '127.0.0.1', '--master-port',
     '29500', '-m', 'runtime.train', 'p.yaml', '--steps', '3', '--out', 'o']
    """
    cmd = list(launcher or [sys.executable, "-m", "torch.distributed.run"])
    if rdzv_endpoint is None:
        cmd += ["--nproc-per-node", str(nproc_per_node), "--master-addr", "127.0.0.1",
                "--master-port", str(master_port)]
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", rdzv_backend,
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", str(rdzv_id)]
        if rdzv_conf:
            cmd += ["--rdzv-conf", rdzv_conf]
    if max_restarts is not None:
        cmd += ["--max-restarts", str(max_restarts)]
    cmd += ["-m", TRAIN_MODULE, str(plan_path), "--steps", str(steps), "--out", str(out_dir)]
    if data:
        cmd += ["--data", str(data)]
    return cmd + list(train_args)


def node_range(nodes: int, min_nodes: int | None, *, names: tuple[str, str] = ("min_nodes",
                                                                             "nodes")) -> int:
    """The fewest nodes of a launch: ``min_nodes``, or ``nodes`` when None (a fixed size).

    A range with ``min_nodes < nodes`` is elastic (torchrun ``--nnodes MIN:MAX``).

    Raises:
        PlanError: ``min_nodes`` outside [1, nodes], named by ``names`` (the arguments', or a
            command line's flags).
    """
    min_nodes = nodes if min_nodes is None else min_nodes
    if not 1 <= min_nodes <= nodes:
        raise PlanError(f"{names[0]}={min_nodes} must be in [1, {names[1]}={nodes}]")
    return min_nodes


def torchrun_node_command(plan_path: str | Path, *, nodes: int, node_rank: int,
                          rdzv_endpoint: str, steps: int = 10, out_dir: str | Path | None = None,
                          data: str | Path | None = None, rdzv_id: str | None = None,
                          min_nodes: int | None = None, rdzv_backend: str = "c10d",
                          rdzv_conf: str | None = None, max_restarts: int | None = None,
                          train_args: list[str] | tuple[str, ...] = (),
                          launcher: list[str] | None = None) -> list[str]:
    """The torchrun command line of node ``node_rank`` of ``nodes``.

    Args:
        plan_path: the plan file (the same path must exist on every node).
        rdzv_endpoint: ``HOST:PORT`` of the rendezvous: node 0's address for ``c10d``, the
            etcd server's (client port, 2379 by default) for ``etcd-v2``.
        out_dir: run folder written by global rank 0 (default ``runs/<plan id>``).
        rdzv_id: job id shared by all nodes (default: the plan id).
        min_nodes: fewest nodes the job runs on (None: ``nodes``). Below ``nodes`` the launch
            is elastic: ``--nnodes MIN:MAX`` and ``runtime.train --elastic``.
        rdzv_backend: one of `RDZV_BACKENDS`; rdzv_conf: torchrun's ``--rdzv-conf``
            (``K=V,...``, e.g. ``last_call_timeout=10``).
        max_restarts: torchrun ``--max-restarts`` (None: torchrun's default, 0).
        train_args: more `runtime.train` flags (`runtime.faults.fault_cli_args`).
        launcher: the torchrun executable as a list (default ``python -m torch.distributed.run``
            with this interpreter).
    Raises:
        PlanError: the plan file is invalid, nodes does not divide its world size, node_rank
            is outside [0, nodes), min_nodes outside [1, nodes], an unknown backend, or a
            malformed endpoint.
    """
    pf = read_plan_file(plan_path)
    nproc = procs_per_node(pf.plan.world_size, nodes)
    if not 0 <= node_rank < nodes:
        raise PlanError(f"node_rank={node_rank} must be in [0, nodes={nodes})")
    min_nodes = node_range(nodes, min_nodes)
    if rdzv_backend not in RDZV_BACKENDS:
        raise PlanError(f"rdzv_backend={rdzv_backend!r} is not one of {list(RDZV_BACKENDS)}")
    parse_endpoint(rdzv_endpoint)
    out = str(out_dir) if out_dir is not None else str(Path("runs") / pf.plan.id)
    elastic = min_nodes < nodes
    return torchrun_command(plan_path, nproc_per_node=nproc, steps=steps, out_dir=out,
                            data=data, nnodes=f"{min_nodes}:{nodes}" if elastic else nodes,
                            node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                            rdzv_id=rdzv_id or pf.plan.id, max_restarts=max_restarts,
                            rdzv_backend=rdzv_backend, rdzv_conf=rdzv_conf, launcher=launcher,
                            train_args=list(train_args) + (["--elastic"] if elastic else []))


def sbatch_script(plan_path: str | Path, *, nodes: int, port: int = 29500, steps: int = 10,
                  out_dir: str | Path | None = None, data: str | Path | None = None,
                  job_name: str | None = None, time_limit: str = "01:00:00",
                  partition: str | None = None, min_nodes: int | None = None,
                  rdzv_backend: str = "c10d", rdzv_endpoint: str | None = None,
                  rdzv_conf: str | None = None, max_restarts: int | None = None,
                  train_args: list[str] | tuple[str, ...] = (), transport: str = "",
                  socket_ifname: str = SOCKET_IFNAME, gid_index: int | None = None,
                  env_prefix: str | None = None) -> str:
    """A Slurm batch script that trains ``plan_path`` on ``nodes`` nodes.

    The script activates the Python environment ``env_prefix`` (default: the one running
    this, `activate_lines`) and exports the NCCL variables of the cluster's fabric
    ``transport`` (`nccl_env`: the socket interface, and the GID index on RoCE).

    One task per node runs torchrun with ``world_size / nodes`` workers (and as many GPUs;
    a localhost-cpu plan's task asks for as many CPU cores, and gets no NCCL variables);
    the first node of the allocation hosts the c10d rendezvous on ``port``, or, with
    ``rdzv_backend="etcd-v2"``, the agents meet at the etcd server ``rdzv_endpoint``. With
    ``min_nodes`` below ``nodes`` the range is elastic (`torchrun_node_command`) and srun
    gets ``--no-kill``: srun(1), "Do not automatically terminate a job if one of the nodes it
    has been allocated fails".

    Raises:
        PlanError: as `torchrun_node_command` and `nccl_env`; etcd-v2 without
            ``rdzv_endpoint``.
    """
    nccl = nccl_env(transport, socket_ifname=socket_ifname, gid_index=gid_index)
    pf = read_plan_file(plan_path)
    gpus = procs_per_node(pf.plan.world_size, nodes)
    # a localhost-cpu plan trains on CPU cores over gloo (torchrun runs as well on a CPU
    # partition): its task asks for one core per worker, and neither GPUs nor NCCL variables
    cpu = pf.cluster.is_localhost
    if cpu:
        nccl = {}
    if not 0 < port < 65536:
        raise PlanError(f"port={port} must be in 1..65535")
    min_nodes = node_range(nodes, min_nodes)
    if rdzv_backend not in RDZV_BACKENDS:
        raise PlanError(f"rdzv_backend={rdzv_backend!r} is not one of {list(RDZV_BACKENDS)}")
    if rdzv_backend == "etcd-v2" and rdzv_endpoint is None:
        raise PlanError("rdzv_backend='etcd-v2' needs rdzv_endpoint, the etcd server's "
                        "HOST:PORT (it runs outside the allocation's nodes)")
    if rdzv_endpoint is not None:
        parse_endpoint(rdzv_endpoint)
    elastic = min_nodes < nodes
    plan_id = pf.plan.id
    out = str(out_dir) if out_dir is not None else f"runs/{plan_id}"
    torchrun = shell_line(torchrun_command(
        plan_path, nproc_per_node=gpus, steps=steps, out_dir=out, data=data,
        nnodes=f"{min_nodes}:{nodes}" if elastic else "$SLURM_NNODES",
        node_rank="$SLURM_NODEID", rdzv_endpoint=rdzv_endpoint or "$RDZV_HOST:$RDZV_PORT",
        rdzv_id="$SLURM_JOB_ID", rdzv_backend=rdzv_backend, rdzv_conf=rdzv_conf,
        max_restarts=max_restarts, launcher=["torchrun"],
        train_args=list(train_args) + (["--elastic"] if elastic else [])))
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={job_name or plan_id}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --cpus-per-task={gpus}" if cpu else f"#SBATCH --gpus-per-node={gpus}",
             f"#SBATCH --time={time_limit}"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [
        f"#SBATCH --output={job_name or plan_id}-%j.out",
        "",
        f"# {plan_id} of {pf.model.name}: {pf.plan.degrees} workers, {gpus} per node"
        + (" (CPU, gloo)" if cpu else ""),
        "set -euo pipefail",
        'export RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export RDZV_PORT={port}",
        *activate_lines(env_prefix),
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        *(f"export {k}={shlex.quote(v)}" for k, v in nccl.items()),
        *(f"export {k}={v}" for k, v in (ELASTIC_ENV if elastic else {}).items()),
        "# single-quoted: each task expands its own $SLURM_NODEID",
        ("srun --no-kill bash -c " if elastic else "srun bash -c ")
        + shlex.quote(f"exec {torchrun}"),
        ""]
    return "\n".join(lines)


def shell_line(command: list[str], env: dict[str, str] | None = None) -> str:
    """``command`` as one copy-pasteable shell line, with ``env`` assignments in front; an
    argument that names shell variables (``$NAME``) is double-quoted so they expand.

    >>> print(shell_line(["torchrun", "--node-rank", "$SLURM_NODEID", "my plan.yaml"]))
    torchrun --node-rank "$SLURM_NODEID" 'my plan.yaml'
    """
    def quote(arg: str) -> str:
        if arg.startswith("$") and all(c.isalnum() or c in "$_:" for c in arg):
            return f'"{arg}"'
        return shlex.quote(arg)
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join(prefix + [quote(a) for a in command])

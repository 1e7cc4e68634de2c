"""Launch commands: per-node torchrun lines, the sbatch script, and a real two-node run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.launch import (
    activate_lines,
    nccl_env,
    procs_per_node,
    sbatch_script,
    torchrun_node_command,
)
from planner.planfile import ClusterRef, PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan, PlanError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def dp2_plan(tmp_path):
    plan = Plan(tp=1, pp=1, dp=2, micro_batch=2, global_batch=4, dtype="fp32")
    return write_plan_file(tmp_path / "plan.yaml", PlanFile(
        model=load_model("tiny-gpt"), plan=plan,
        cluster=ClusterRef(name="localhost-cpu", nodes=2)))


@pytest.fixture
def big_plan(tmp_path):
    plan = Plan(tp=8, pp=4, dp=4, micro_batch=1, global_batch=64)
    return write_plan_file(tmp_path / "big.yaml", PlanFile(
        model=load_model("llama3-70b"), plan=plan, cluster=ClusterRef(name="dgx-h100", nodes=16)))


def test_each_node_gets_its_share_of_the_ranks(big_plan):
    cmd = torchrun_node_command(big_plan, nodes=16, node_rank=3,
                                rdzv_endpoint="10.0.0.1:29500", steps=5, out_dir="runs/x",
                                launcher=["torchrun"])
    assert cmd[:13] == ["torchrun", "--nnodes", "16", "--node-rank", "3",
                        "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "10.0.0.1:29500", "--rdzv-id",
                        "tp8-pp4-dp4-mb1-gb64"]
    assert cmd[13:] == ["-m", "runtime.train", str(big_plan), "--steps", "5",
                        "--out", "runs/x"]


def test_nodes_must_divide_the_world_size(big_plan):
    assert procs_per_node(128, 16) == 8
    with pytest.raises(PlanError, match=r"world_size tp\*pp\*dp = 128 does not split over "
                                        r"nodes=3"):
        torchrun_node_command(big_plan, nodes=3, node_rank=0, rdzv_endpoint="h:1")
    with pytest.raises(PlanError, match=r"node_rank=16 must be in \[0, nodes=16\)"):
        torchrun_node_command(big_plan, nodes=16, node_rank=16, rdzv_endpoint="h:1")
    with pytest.raises(PlanError, match="must be HOST:PORT"):
        torchrun_node_command(big_plan, nodes=16, node_rank=0, rdzv_endpoint="host")


def test_sbatch_script(big_plan):
    script = sbatch_script(big_plan, nodes=16, port=29400, steps=20, out_dir="runs/big")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("#SBATCH --nodes=16", "#SBATCH --ntasks-per-node=1",
                      "#SBATCH --gpus-per-node=8", "#SBATCH --job-name=tp8-pp4-dp4-mb1-gb64"):
        assert directive in lines
    srun = next(ln for ln in lines if ln.startswith("srun "))
    # Single-quoted so each task expands its own node id, not the batch host's.
    assert srun.startswith("srun bash -c 'exec torchrun ")
    for part in ('--nnodes "$SLURM_NNODES"', '--node-rank "$SLURM_NODEID"',
                 "--nproc-per-node 8", "--rdzv-backend c10d",
                 '--rdzv-endpoint "$RDZV_HOST:$RDZV_PORT"',
                 f"-m runtime.train {big_plan} --steps 20 --out runs/big"):
        assert part in srun
    assert "export RDZV_PORT=29400" in lines
    assert any(ln.startswith("export RDZV_HOST=$(scontrol show hostnames") for ln in lines)
    # bash can parse it
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_sbatch_script_activates_this_environment_and_sets_the_fabrics_nccl_variables(
        big_plan, tmp_path):
    # NCCL docs, "Environment Variables": NCCL_IB_GID_INDEX selects the RoCE GID (RoCE v2
    # is index 3 on mlx5 by show_gids); NCCL_SOCKET_IFNAME filters interfaces by prefix.
    roce = sbatch_script(big_plan, nodes=16, transport="roce").splitlines()
    assert "export NCCL_IB_GID_INDEX=3" in roce
    assert "export NCCL_SOCKET_IFNAME='^docker,lo'" in roce
    ib = sbatch_script(big_plan, nodes=16, transport="infiniband", socket_ifname="=ens1f0")
    assert "NCCL_IB_GID_INDEX" not in ib  # InfiniBand addresses by LID, no GID to pick
    assert "export NCCL_SOCKET_IFNAME==ens1f0" in ib.splitlines()
    assert nccl_env("roce", gid_index=5)["NCCL_IB_GID_INDEX"] == "5"
    with pytest.raises(PlanError, match="gid_index=-1 must be >= 0"):
        sbatch_script(big_plan, nodes=16, transport="roce", gid_index=-1)
    # the environment meshplan runs from (sys.prefix) is activated before srun
    lines = sbatch_script(big_plan, nodes=16).splitlines()
    activate = lines.index(activate_lines()[-1])
    assert activate < next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text("")
    assert activate_lines(str(tmp_path / "venv")) == [
        f"source {tmp_path / 'venv' / 'bin' / 'activate'}"]
    (tmp_path / "conda" / "conda-meta").mkdir(parents=True)
    assert activate_lines(str(tmp_path / "conda"))[-1] == f"conda activate {tmp_path / 'conda'}"
    subprocess.run(["bash", "-n"], input="\n".join(roce), text=True, check=True)


def test_launch_cli_script_carries_the_run_flags_and_the_clusters_fabric(tmp_path):
    plan = write_plan_file(tmp_path / "roce.yaml", PlanFile(
        model=load_model("llama3-70b"), plan=Plan(tp=8, pp=1, dp=2, micro_batch=1,
                                                  global_batch=16),
        cluster=ClusterRef(name="dgx-h100-roce", nodes=2)))
    script = tmp_path / "train.sbatch"
    proc = subprocess.run([sys.executable, "-m", "apps.cli", "launch", str(plan), "--nodes",
                           "2", "--slurm", str(script), "--steps", "37", "--checkpoint-every",
                           "5", "--gid-index", "1", "--socket-ifname", "=eth0"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert "--steps 37" in text and "--checkpoint-every 5" in text and "--steps 10" not in text
    assert "export NCCL_IB_GID_INDEX=1" in text.splitlines()
    assert "export NCCL_SOCKET_IFNAME==eth0" in text.splitlines()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_run_end_to_end(dp2_plan, tmp_path):
    # Two torchrun agents on 127.0.0.1, one rank each, meet at a c10d rendezvous and train
    # tiny-gpt with DP=2 for 3 steps; rank 0 writes summary.json.
    endpoint = f"127.0.0.1:{_free_port()}"
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen(
        torchrun_node_command(dp2_plan, nodes=2, node_rank=r, rdzv_endpoint=endpoint,
                              steps=3, out_dir=out),
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan_id"] == "tp1-pp1-dp2-mb2-gb4"
    assert summary["world_size"] == 2
    assert summary["steps"] == 3 and len(summary["losses"]) == 3
    assert all(loss == loss and loss > 0 for loss in summary["losses"])  # finite, positive
    assert len(summary["peak_memory_bytes"]) == 2  # one entry per rank, both nodes reported


def test_launch_cli_prints_every_node_and_writes_sbatch(dp2_plan, tmp_path):
    script = tmp_path / "train.sbatch"
    def launch(*args):
        return subprocess.run([sys.executable, "-m", "apps.cli", "launch", str(dp2_plan),
                               "--nodes", "2", *args], capture_output=True, text=True, cwd=REPO,
                              timeout=120)

    proc = launch("--rdzv-endpoint", "127.0.0.1:29555", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [c["node_rank"] for c in data["commands"]] == [0, 1]
    assert data["commands"][1]["argv"][-9:-7] == ["--rdzv-id", "tp1-pp1-dp2-mb2-gb4"]
    assert "--nproc-per-node 1" in data["commands"][0]["line"]
    proc = launch("--slurm", str(script), "--port", "29555", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"slurm": str(script)}
    assert "#SBATCH --nodes=2" in script.read_text() and "29555" in script.read_text()
    # the README gives them as alternatives: the script picks its own rendezvous host
    both = launch("--rdzv-endpoint", "head:29500", "--slurm", str(tmp_path / "x.sbatch"))
    assert both.returncode == 2 and not (tmp_path / "x.sbatch").exists()
    assert "and --rdzv-endpoint exclude each other" in both.stderr
    bad = subprocess.run([sys.executable, "-m", "apps.cli", "launch", str(dp2_plan), "--nodes",
                          "3", "--rdzv-endpoint", "h:1"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "does not split over nodes=3" in bad.stderr


def test_an_elastic_line_has_the_node_range_the_etcd_rendezvous_and_the_checkpoints(dp2_plan):
    cmd = torchrun_node_command(dp2_plan, nodes=2, node_rank=1, rdzv_endpoint="10.0.0.9:2379",
                                steps=20, out_dir="runs/x", min_nodes=1, rdzv_backend="etcd-v2",
                                rdzv_conf="last_call_timeout=10", max_restarts=3,
                                train_args=["--checkpoint-every", "5"], launcher=["torchrun"])
    assert cmd == ["torchrun", "--nnodes", "1:2", "--node-rank", "1", "--nproc-per-node", "1",
                   "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "10.0.0.9:2379",
                   "--rdzv-id", "tp1-pp1-dp2-mb2-gb4", "--rdzv-conf", "last_call_timeout=10",
                   "--max-restarts", "3", "-m", "runtime.train", str(dp2_plan), "--steps", "20",
                   "--out", "runs/x", "--checkpoint-every", "5", "--elastic"]
    fixed = torchrun_node_command(dp2_plan, nodes=2, node_rank=0, rdzv_endpoint="h:1")
    assert fixed[fixed.index("--nnodes") + 1] == "2" and "--elastic" not in fixed
    with pytest.raises(PlanError, match=r"min_nodes=3 must be in \[1, nodes=2\]"):
        torchrun_node_command(dp2_plan, nodes=2, node_rank=0, rdzv_endpoint="h:1", min_nodes=3)
    with pytest.raises(PlanError, match=r"rdzv_backend='zk' is not one of \['c10d', 'etcd-v2'\]"):
        torchrun_node_command(dp2_plan, nodes=2, node_rank=0, rdzv_endpoint="h:1",
                              rdzv_backend="zk")


def _launch(capsys, *args: str) -> tuple[int, str, str]:
    """``meshplan launch ARGS`` in this process: (exit code, stdout, stderr on one line)."""
    from apps.cli import main
    code = main(["launch", *args])
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())        # the console wraps long lines


def test_launch_cli_prints_elastic_lines_and_refuses_a_range_that_cannot_restart(dp2_plan,
                                                                                  capsys):
    common = [str(dp2_plan), "--nodes", "2", "--min-nodes", "1", "--rdzv-backend", "etcd-v2",
              "--rdzv-endpoint", "10.0.0.9:2379"]
    code, out, err = _launch(capsys, *common, "--max-restarts", "3", "--checkpoint-every", "5",
                             "--keep", "3", "--timeout-s", "60", "--json")
    assert code == 0, err
    line = json.loads(out)["commands"][0]["line"]
    # every round's rank 0 serves a fresh store: a node that joins later finds it
    assert line.startswith("OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ")
    for part in ("--nnodes 1:2", "--rdzv-backend etcd-v2", "--max-restarts 3",
                 "--checkpoint-every 5 --keep 3 --timeout-s 60.0 --elastic"):
        assert part in line
    code, _, err = _launch(capsys, *common, "--checkpoint-every", "5")
    assert code == 2 and "needs --max-restarts >= 1 (now 0)" in err
    code, _, err = _launch(capsys, *common, "--max-restarts", "3", "--checkpoint-every", "-1")
    assert code == 2 and "--checkpoint-every=-1" in err
    code, _, err = _launch(capsys, *common[:4], "3", *common[5:])
    assert code == 2 and "--min-nodes=3 must be in [1, --nodes=2]" in err


def test_an_elastic_sbatch_script_meets_at_etcd_and_survives_a_node(big_plan):
    script = sbatch_script(big_plan, nodes=16, min_nodes=12, rdzv_backend="etcd-v2",
                           rdzv_endpoint="etcd.example:2379", max_restarts=3,
                           train_args=["--checkpoint-every", "100"])
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    assert srun.startswith("srun --no-kill bash -c 'exec torchrun ")
    for part in ("--nnodes 12:16", "--rdzv-backend etcd-v2", "--rdzv-endpoint etcd.example:2379",
                 "--max-restarts 3", "--checkpoint-every 100 --elastic"):
        assert part in srun
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script.splitlines()
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    with pytest.raises(PlanError, match="etcd-v2' needs rdzv_endpoint"):
        sbatch_script(big_plan, nodes=16, rdzv_backend="etcd-v2")


def test_sbatch_script_of_a_cpu_plan_asks_for_cores_not_gpus(dp2_plan):
    script = sbatch_script(dp2_plan, nodes=2, transport="ib")
    # dp2 on 2 nodes: 1 worker per node, a gloo job on CPU cores
    assert "#SBATCH --cpus-per-task=1" in script.splitlines()
    assert "--gpus-per-node" not in script and "NCCL_" not in script


def test_launch_run_of_one_node_is_node_0_and_the_sbatch_hint_quotes_the_path(
        tiny_plan_file, tmp_path, capsys, monkeypatch):
    import apps.cmd_launch
    plan = tiny_plan_file(tp=1, pp=1, dp=1)
    started = []
    monkeypatch.setattr(apps.cmd_launch.subprocess, "run",
                        lambda argv, **kw: started.append(argv) or
                        subprocess.CompletedProcess(argv, 0))
    code, _, err = _launch(capsys, str(plan), "--nodes", "1", "--rdzv-endpoint",
                           "127.0.0.1:29555", "--run", "--out", str(tmp_path / "r"))
    assert code == 0, err
    (argv,) = started
    assert argv[argv.index("--node-rank") + 1] == "0"
    script = tmp_path / "my jobs" / "t p.sbatch"
    script.parent.mkdir()
    code, out, err = _launch(capsys, str(plan), "--nodes", "1", "--slurm", str(script))
    assert code == 0, err
    assert f"(sbatch '{script}')" in " ".join(out.split())
    two = tiny_plan_file(tp=1, pp=1, dp=2)
    code, _, err = _launch(capsys, str(two), "--nodes", "2", "--rdzv-endpoint", "h:1", "--run")
    assert code == 2 and "give --node-rank R (R in 0..1" in err


def test_elastic_range_without_a_plan_names_the_min_nodes_that_works(tiny_plan_file, capsys):
    # tiny-gpt has 4 layers and 4 heads: 5 devices need dp 5 (tp or pp 5 exceeds them), and
    # global batch 42 = 2*3*7 does not split over 5; 6 (dp 6) and 7 (dp 7) nodes have a plan
    plan = tiny_plan_file(tp=1, pp=1, dp=7, global_batch=42)
    common = [str(plan), "--nodes", "7", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint",
              "10.0.0.9:2379", "--max-restarts", "3", "--checkpoint-every", "5"]
    code, _, err = _launch(capsys, *common, "--min-nodes", "2")
    assert code == 2
    assert "--min-nodes=2: no plan of tiny-gpt with global_batch=42 runs on 5 nodes" in err
    assert "give --min-nodes 6 or more" in err
    code, _, err = _launch(capsys, *common, "--min-nodes", "6")
    assert code == 0, err
    # global batch 6 on 6 nodes: 5 has no plan, so nothing below 6 works
    plan = tiny_plan_file(tp=1, pp=1, dp=6, global_batch=6)
    code, _, err = _launch(capsys, str(plan), "--nodes", "6", *common[3:], "--min-nodes", "3")
    assert code == 2 and "no --min-nodes below --nodes=6 works" in err

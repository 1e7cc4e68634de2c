"""Multi-node launch that restarts: two torchrun agents ("nodes", one worker each) meet at an
etcd rendezvous (Debian's etcd-server, v2 API) on 127.0.0.1 with an elastic node range 1:2.
The node that holds global rank 0 is lost (its agent and worker are killed); the other node
meets the rendezvous again alone, the planner re-plans tiny-gpt for 1 rank, DCP reshards the
dp=2 checkpoint and the job ends all its steps.

References are independent of the elastic path: an uninterrupted single-process run of a dp=1
plan with the same global batch gives every step's loss (dp=2 and dp=1 average the gradient of
the same 8 sequences) and every step's sample ids (step k trains samples [8k, 8k + 8)).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from planner.launch import ELASTIC_ENV, parse_endpoint, torchrun_node_command
from planner.planfile import ClusterRef, PlanFile, read_plan_file
from planner.presets import load_model
from planner.spec import Plan, PlanError
from runtime.evict import plan_for_world

REPO = Path(__file__).resolve().parents[2]
ETCD = shutil.which("etcd")
#: Steps of the job; node 0 is lost after step LOSE_AFTER (checkpoints every 2 steps).
STEPS, LOSE_AFTER = 16, 5
#: Rendezvous settings that find a lost node in seconds on 127.0.0.1 (torchrun's defaults:
#: 5 s x 3 heartbeats, 30 s last call): a node is dead after 3 missed 1 s heartbeats, and a
#: round that has MIN nodes waits 10 s for more: the first round's second agent must join
#: within that of the first (both import torch meanwhile, on a loaded machine).
RDZV_CONF = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def etcd_server(folder: Path, *, v2: bool = True):
    """A one-member etcd server with the v2 API (torchrun's etcd-v2 rendezvous uses it; without
    it when ``v2`` is False) on free ports of 127.0.0.1; yields its client endpoint
    ``127.0.0.1:PORT``."""
    client, peer = _free_port(), _free_port()
    log = (folder / "etcd.log").open("w")
    proc = subprocess.Popen(
        [ETCD, *(["--enable-v2"] if v2 else []), "--name", "meshplan-test",
         "--data-dir", str(folder / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"meshplan-test=http://127.0.0.1:{peer}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{client}/version", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("etcd did not start: "
                                         + (folder / "etcd.log").read_text()[-2000:]) from None
                time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().split(")")[-1].split()[1]) == pid:
                    kids.append(int(entry.name))
            except OSError:
                continue
    return kids


def _global_ranks(agent_pid: int) -> set[int]:
    """RANK of each worker of a torchrun agent (torchrun sets it in the worker's env)."""
    ranks = set()
    for kid in _children(agent_pid):
        try:
            env = (Path("/proc") / str(kid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks |= {int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")}
    return ranks


def lose_node(agent: subprocess.Popen) -> list[int]:
    """SIGKILL a node: its torchrun agent and its workers (they run in their own sessions,
    so killing the agent alone would leave them training)."""
    pids = [agent.pid] + _children(agent.pid)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    agent.wait(timeout=30)
    return pids


def agent_env() -> dict[str, str]:
    """What `meshplan launch` gives an elastic agent: one thread, this checkout on PYTHONPATH,
    `planner.launch.ELASTIC_ENV`."""
    return dict(os.environ, OMP_NUM_THREADS="1", **ELASTIC_ENV, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _samples_by_step(out: Path) -> dict[int, list[int]]:
    """{step: sorted sample ids of every DP rank}, from OUT/consumed/dp*.jsonl."""
    by_step: dict[int, list[int]] = {}
    for path in (out / "consumed").glob("dp*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_step.setdefault(record["step"], []).extend(record["samples"])
    return {step: sorted(ids) for step, ids in sorted(by_step.items())}


@pytest.fixture(scope="module")
def dp2_plan(write_plan, tiny_plan, tiny_model):
    return write_plan("elastic-dp2", tiny_plan(dp=2), tiny_model(num_layers=2))


@pytest.fixture(scope="module")
def dp1_plan(write_plan, tiny_plan, tiny_model):
    return write_plan("elastic-dp1", tiny_plan(dp=1), tiny_model(num_layers=2))


def test_an_elastic_world_trains_the_planners_plan_for_the_ranks_that_joined(dp2_plan):
    pf = read_plan_file(dp2_plan)
    assert plan_for_world(pf, 2) is pf                          # the plan's own world size
    one = plan_for_world(pf, 1)
    assert one.plan.world_size == 1 and one.cluster.ranks == 1
    assert one.plan.global_batch == pf.plan.global_batch == 8   # the data position continues
    with pytest.raises(PlanError, match="no plan of tiny-gpt with global_batch=8 runs on 3"):
        plan_for_world(pf, 3)          # 3 divides neither the batch of 8 nor the 2 layers


def test_an_elastic_gpu_job_is_re_planned_on_whole_nodes():
    big = PlanFile(model=load_model("llama3-70b"), cluster=ClusterRef(name="dgx-h100", nodes=16),
                   plan=Plan(tp=8, pp=4, dp=4, micro_batch=1, global_batch=64))
    half = plan_for_world(big, 64)
    assert (half.plan.world_size, half.cluster.nodes, half.plan.global_batch) == (64, 8, 64)
    # 15 nodes: tp and dp are powers of 2 (64 heads, batch 64), so pp is a multiple of 15,
    # which does not divide the 80 layers
    with pytest.raises(PlanError, match="runs on 120 devices"):
        plan_for_world(big, 120)
    with pytest.raises(PlanError, match="runs on 100 devices"):
        plan_for_world(big, 100)       # not whole nodes of 8 GPUs


without_etcd = pytest.mark.skipif(
    ETCD is None, reason="needs Debian's etcd-server (`make test` installs it as root: "
    "apt-get install etcd-server)")
without_python_etcd = pytest.mark.skipif(
    importlib.util.find_spec("etcd") is None, reason="torchrun's etcd-v2 rendezvous needs the "
    "python-etcd package (pip install -e '.[dev]')")


@without_python_etcd
@pytest.mark.parametrize("server", ["none", pytest.param("without-v2", marks=without_etcd)])
def test_launch_run_refuses_an_etcd_endpoint_it_cannot_meet_at(server, dp2_plan, tmp_path,
                                                                capsys):
    from apps.cli import main

    def launch(endpoint):
        code = main(["launch", str(dp2_plan), "--nodes", "2", "--node-rank", "0",
                     "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", endpoint, "--run"])
        return code, " ".join(capsys.readouterr().err.split())
    if server == "none":
        code, err = launch(f"127.0.0.1:{_free_port()}")
        assert code == 2 and "no etcd answers there" in err
    else:
        with etcd_server(tmp_path, v2=False) as endpoint:
            code, err = launch(endpoint)
        assert code == 2 and "etcd answers 404" in err and "--enable-v2" in err


@without_etcd
@without_python_etcd
def test_losing_node_0_continues_on_the_other_node_from_its_checkpoint(dp2_plan, dp1_plan,
                                                                        tmp_path):
    out, ref = tmp_path / "run", tmp_path / "ref"
    env = agent_env()
    with etcd_server(tmp_path) as endpoint:
        agents, logs = [], []
        for node in (0, 1):
            cmd = torchrun_node_command(
                dp2_plan, nodes=2, node_rank=node, rdzv_endpoint=endpoint, steps=STEPS,
                out_dir=out, min_nodes=1, rdzv_backend="etcd-v2", rdzv_conf=RDZV_CONF,
                max_restarts=1, train_args=["--checkpoint-every", "2"])
            assert cmd[cmd.index("--nnodes") + 1] == "1:2" and cmd[-1] == "--elastic"
            logs.append(tmp_path / f"node{node}.log")
            agents.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=logs[-1].open("w"),
                                           stderr=subprocess.STDOUT))
        reference_run = None
        try:
            deadline = time.monotonic() + 180
            while _steps_logged(out) < LOSE_AFTER:
                assert time.monotonic() < deadline and all(a.poll() is None for a in agents), \
                    "\n".join(p.read_text()[-2000:] for p in logs)
                time.sleep(0.05)
            node0 = next(i for i, a in enumerate(agents) if 0 in _global_ranks(a.pid))
            lose_node(agents[node0])
            # the reference (one process, a dp=1 plan, same global batch, never interrupted)
            # trains while the survivor waits out the dead node's heartbeats
            reference_run = subprocess.Popen(
                [sys.executable, "-m", "runtime.train", str(dp1_plan), "--steps", str(STEPS),
                 "--out", str(ref)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
            rc = agents[1 - node0].wait(timeout=240)
            assert reference_run.wait(timeout=240) == 0, reference_run.stdout.read()[-3000:]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    lose_node(agent)
            if reference_run is not None and reference_run.poll() is None:
                reference_run.kill()
                reference_run.wait()
    text = logs[1 - node0].read_text()
    assert rc == 0, text[-3000:]
    assert "RendezvousConnectionError" not in text
    summary = json.loads((out / "summary.json").read_text())
    one = plan_for_world(read_plan_file(dp2_plan), 1).plan
    assert (summary["plan_id"], summary["world_size"], summary["steps"]) == (one.id, 1, STEPS)
    assert summary["restarts"] == 1 and 1 <= summary["steps_lost"] <= STEPS // 2
    assert any(note.startswith("elastic: 1 rank(s) joined") for note in summary["notes"])
    assert read_plan_file(out / "plan.yaml").plan.id == one.id
    reference = json.loads((ref / "summary.json").read_text())
    # every step trained its 8 samples once: none lost, none repeated
    assert _samples_by_step(out) == _samples_by_step(ref) == {
        k: list(range(8 * (k - 1), 8 * k)) for k in range(1, STEPS + 1)}
    # fp32 sums in another order (2 ranks x 2 micro-batches, then 1 x 8, vs 1 x 4): measured
    # 1.2e-7 apart at most; a step trained on other samples differs by > 1e-2
    assert summary["losses"] == pytest.approx(reference["losses"], rel=1e-5)


@pytest.mark.slow
def test_losing_the_node_that_serves_a_c10d_rendezvous_ends_the_job(dp2_plan, tmp_path):
    # why the elastic launch keeps its rendezvous in etcd: with torchrun's c10d backend the
    # store lives in the agent of the endpoint's host (the first to bind the port)
    out, endpoint = tmp_path / "run", f"127.0.0.1:{_free_port()}"
    env = agent_env()
    agents, logs = [], []
    try:
        for node in (0, 1):
            cmd = torchrun_node_command(
                dp2_plan, nodes=2, node_rank=node, rdzv_endpoint=endpoint, steps=STEPS,
                out_dir=out, min_nodes=1, rdzv_conf=RDZV_CONF, max_restarts=1,
                train_args=["--checkpoint-every", "2"])
            logs.append(tmp_path / f"node{node}.log")
            agents.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=logs[-1].open("w"),
                                           stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 120
            while node == 0:                  # node 0 serves the store before node 1 starts
                with socket.socket() as s:
                    if s.connect_ex(parse_endpoint(endpoint)) == 0:
                        break
                assert time.monotonic() < deadline, logs[0].read_text()[-2000:]
                time.sleep(0.1)
        deadline = time.monotonic() + 180
        while _steps_logged(out) < LOSE_AFTER:
            assert time.monotonic() < deadline, "\n".join(p.read_text()[-2000:] for p in logs)
            time.sleep(0.05)
        lose_node(agents[0])
        rc = agents[1].wait(timeout=240)
    finally:
        for agent in agents:
            if agent.poll() is None:
                lose_node(agent)
    assert rc != 0
    assert "RendezvousConnectionError" in logs[1].read_text()


@without_etcd
@without_python_etcd
@pytest.mark.slow
def test_a_node_that_joins_a_running_job_grows_it_back_to_the_plan(dp2_plan, dp1_plan, tmp_path):
    # node 0 alone trains the planner's 1-rank plan; node 1 joins after step 3: the agents stop
    # the group for a round of 2 (not counted as a restart), and the dp=2 plan continues
    out, ref, steps = tmp_path / "run", tmp_path / "ref", 4 * STEPS   # node 1 takes a while
    env = agent_env()
    with etcd_server(tmp_path) as endpoint:
        def start(node):
            cmd = torchrun_node_command(
                dp2_plan, nodes=2, node_rank=node, rdzv_endpoint=endpoint, steps=steps,
                out_dir=out, min_nodes=1, rdzv_backend="etcd-v2", rdzv_conf=RDZV_CONF,
                max_restarts=1, train_args=["--checkpoint-every", "2"])
            return subprocess.Popen(cmd, env=env, cwd=REPO, stderr=subprocess.STDOUT,
                                    stdout=(tmp_path / f"node{node}.log").open("w"))
        agents = [start(0)]
        try:
            deadline = time.monotonic() + 180
            while _steps_logged(out) < 3:
                assert time.monotonic() < deadline, (tmp_path / "node0.log").read_text()[-2000:]
                time.sleep(0.05)
            agents.append(start(1))
            subprocess.run([sys.executable, "-m", "runtime.train", str(dp1_plan), "--steps",
                            str(steps), "--out", str(ref)], env=env, cwd=REPO, check=True,
                           capture_output=True, timeout=240)
            codes = [a.wait(timeout=240) for a in agents]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    lose_node(agent)
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["plan_id"], summary["world_size"], summary["steps"]) == (
        read_plan_file(dp2_plan).plan.id, 2, steps)
    resumed = [json.loads(x) for x in (out / "faults" / "events.jsonl").read_text().splitlines()
               if '"resumed"' in x]
    grown_at = resumed[-1]["from_step"]        # the 2-rank group trained the steps after it
    assert len(resumed) == 2 and 3 <= grown_at < steps and summary["steps_lost"] == 0
    consumed = (out / "consumed" / "dp1.jsonl").read_text().splitlines()
    dp1 = [json.loads(line)["step"] for line in consumed]
    assert dp1 == list(range(grown_at + 1, steps + 1))
    reference = json.loads((ref / "summary.json").read_text())
    assert _samples_by_step(out) == _samples_by_step(ref)
    assert summary["losses"] == pytest.approx(reference["losses"], rel=1e-5)

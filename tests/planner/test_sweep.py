"""Cluster-design sweeps: every point is the plan search a user would run on that cluster
file, locally in a process pool and on a local Ray instance alike."""

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from planner.presets import load_model
from planner.search import search
from planner.spec import PlanError
from planner.sweep import SWEEP_PRUNE, run_point, run_sweep, sweep_grid
from simulator.network.cluster import load_cluster

REPO = Path(__file__).resolve().parents[2]
GRID = dict(gpus=[8, 16], node_types=["dgx-h100"], nic_Gbps=[100, 400])


def _reference(tmp_path, gpus: int, nic_Gbps: float) -> tuple[str, float]:
    # the same point as a user's cluster file (docs/clusters.md), loaded and searched directly
    path = tmp_path / f"h100-nic{nic_Gbps:g}.yaml"
    path.write_text(yaml.safe_dump({"kind": "gpu", "node_type": "dgx-h100",
                                    "nic": {"speed_Gbps": nic_Gbps},
                                    "fabric": {"topology": "rail-optimized",
                                               "switch_radix": 64, "nodes_per_leaf": 32}}))
    result = search(load_model("tiny-gpt"), load_cluster(str(path), nodes=gpus // 8),
                    global_batch=16, top_k=0, prune=SWEEP_PRUNE)
    best = result.ranked.iloc[0]
    return best["id"], float(best["tokens_per_s"])


def test_local_sweep_is_the_search_of_each_cluster_file(tmp_path):
    points = sweep_grid(**GRID)
    assert len(points) == 4
    rows = run_sweep("tiny-gpt", points, token_budget=1e9, global_batch=16, workers=2)
    assert sorted((r["gpus"], r["nic_Gbps"]) for r in rows) == [
        (8, 100), (8, 400), (16, 100), (16, 400)]
    for row in rows:
        best, tps = _reference(tmp_path, row["gpus"], row["nic_Gbps"])
        assert (row["best"], row["tokens_per_s"]) == (best, tps)
        assert row["time_to_train_s"] == pytest.approx(1e9 / tps, rel=1e-12)
        assert row["gpu_hours"] == pytest.approx(1e9 / tps * row["gpus"] / 3600, rel=1e-12)
    times = [r["time_to_train_s"] for r in rows]
    assert times == sorted(times)


def test_a_price_gives_the_cost():
    (point,) = sweep_grid([8], ["dgx-h100"])
    row = run_point("tiny-gpt", point, 1e9, 16, {"dgx-h100": 2.5})
    assert row["cost_usd"] == pytest.approx(row["gpu_hours"] * 2.5, rel=1e-12)


def test_ray_tasks_give_the_local_rows():
    ray = pytest.importorskip("ray")
    points = sweep_grid(**GRID)
    local = run_sweep("tiny-gpt", points, token_budget=1e9, global_batch=16, workers=1)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir="/tmp/r")
    try:
        remote = run_sweep("tiny-gpt", points, token_budget=1e9, global_batch=16,
                           ray_address="auto")
    finally:
        ray.shutdown()
    assert remote == local


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_sweep_of_4_by_3_variants_on_a_ray_head_gives_the_local_rows():
    # A real Ray cluster: `ray start --head` in its own processes, the CLI connecting to it
    # by address as a user's sweep would; the local process pool is the reference.
    pytest.importorskip("ray")
    ray_cli = Path(sys.executable).with_name("ray")
    port = _free_port()
    env = {**__import__("os").environ, "RAY_USAGE_STATS_ENABLED": "0"}
    grid = ["--gpus", "8,16,32,64", "--nic-gbps", "100,200,400", "--json"]

    def sweep(*args):
        out = subprocess.run([sys.executable, "-m", "apps.cli", "sweep", "--model", "tiny-gpt",
                              "--tokens", "1e9", "--global-batch", "16", *grid, *args],
                             capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["points"]

    local = sweep("--workers", "2")
    assert len(local) == 12
    # Ray's sockets live under its temp folder and AF_UNIX paths stop at 107 bytes: a short one
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    start = subprocess.run([str(ray_cli), "start", "--head", "--port", str(port),
                            "--num-cpus", "1", "--include-dashboard=false", "--temp-dir", temp],
                           capture_output=True, text=True, timeout=180, env=env)
    assert start.returncode == 0, start.stderr
    try:
        remote = sweep("--ray-address", f"127.0.0.1:{port}")
    finally:
        subprocess.run([str(ray_cli), "stop", "--force"], capture_output=True, timeout=120,
                       env=env)
        shutil.rmtree(temp, ignore_errors=True)
    assert remote == local


def test_bad_grids_name_the_value_and_the_fix():
    with pytest.raises(PlanError, match="gpus=12 is not a whole number of dgx-h100 nodes of 8"):
        sweep_grid([12], ["dgx-h100"])
    with pytest.raises(PlanError, match="node_type='dgx-z9' is not one of"):
        sweep_grid([8], ["dgx-z9"])
    with pytest.raises(PlanError, match="oversubscription=0.5 must be >= 1"):
        sweep_grid([8], ["dgx-h100"], oversubscription=[0.5])


def test_cli_sweep_json_and_bad_input():
    def sweep(*args):
        return subprocess.run([sys.executable, "-m", "apps.cli", "sweep", "--model", "tiny-gpt",
                               "--tokens", "1e9", "--global-batch", "16", *args],
                              capture_output=True, text=True, timeout=300, cwd=REPO)

    ok = sweep("--gpus", "8", "--node-types", "dgx-a100,dgx-h100", "--workers", "1", "--json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert {p["node_type"] for p in data["points"]} == {"dgx-a100", "dgx-h100"}
    bad = sweep("--gpus", "8,x")
    assert bad.returncode == 2 and "--gpus='8,x' must be a comma-separated list" in bad.stderr


def test_a_price_for_a_node_type_outside_the_grid_is_refused_with_a_suggestion(capsys):
    from apps.cli import main
    code = main(["sweep", "--model", "tiny-gpt", "--tokens", "1e9", "--gpus", "8",
                 "--node-types", "dgx-a100,dgx-h100", "--price", "dgx-h101=3.0"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    assert ("--price dgx-h101=...: 'dgx-h101' is not a node type of this sweep (did you mean "
            "'dgx-h100'?); its node types: dgx-a100, dgx-h100") in err

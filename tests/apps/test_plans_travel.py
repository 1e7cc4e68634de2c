"""Plans that travel: a plan made from a user's cluster file simulates without that file; a
misspelt cluster key is an error naming it; launch checks --nproc-per-node."""

import json

import pytest

from apps.cli import main

CLUSTER = """kind: gpu
node_type: dgx-h100
nodes: 2
fabric:
  topology: rail-optimized
  switch_radix: 64
  {key}: 2.0
"""


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def _plan(tmp_path, capsys):
    cluster = tmp_path / "mine.yaml"
    cluster.write_text(CLUSTER.format(key="oversubscription"))
    plan = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "llama3-8b", "--cluster", str(cluster), "--global-batch",
                 "64", "--top-k", "2", "--json", "--out", str(plan)]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    return cluster, plan, best


def test_a_plan_from_a_cluster_file_simulates_without_the_file(tmp_path, capsys):
    cluster, plan, best = _plan(tmp_path, capsys)
    cluster.unlink()  # the plan file carries the cluster
    assert main(["simulate", str(plan), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the same cluster gives the same step the search predicted for that plan
    assert out["id"] == best["id"]
    assert out["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-9)


@pytest.mark.parametrize("text, field, hint", [
    (CLUSTER.format(key="oversubscripton"), "'fabric.oversubscripton'",
     "did you mean 'fabric.oversubscription'"),
    (CLUSTER.format(key="oversubscription") + "nic:\n  speed_gbps: 400\n", "'nic.speed_gbps'",
     "did you mean 'nic.speed_Gbps'"),
])
def test_a_misspelt_cluster_key_is_named_with_the_known_ones(tmp_path, capsys, text, field,
                                                              hint):
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    assert main(["plan", "--model", "llama3-8b", "--cluster", str(path)]) == 2
    err = _err(capsys)
    assert f"unknown field {field}" in err and hint in err and "known" in err


def test_launch_checks_nproc_per_node_against_the_plan_and_the_gpus(tmp_path, capsys):
    _, plan, best = _plan(tmp_path, capsys)
    world = best["tp"] * best["pp"] * best["dp"]  # 16 on two 8-GPU nodes
    assert main(["launch", str(plan), "--nodes", "1", "--nproc-per-node", str(world),
                 "--rdzv-endpoint", "h:1"]) == 2
    assert f"more than the 8 GPUs of a 'mine' node; use --nodes {world // 8}" in _err(capsys)
    assert main(["launch", str(plan), "--nodes", "2", "--nproc-per-node", "4",
                 "--rdzv-endpoint", "h:1"]) == 2
    assert f"--nproc-per-node=4 x --nodes=2 = 8 != the plan's tp*pp*dp = {world}" in \
        _err(capsys)
    assert main(["launch", str(plan), "--nodes", "2", "--nproc-per-node", "8",
                 "--rdzv-endpoint", "h:1", "--json"]) == 0

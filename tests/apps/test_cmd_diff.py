"""`meshplan diff`: two plans side by side; the parts add up and the memory is the plan's."""

import json

import pytest

from apps.cli import main
from planner.planfile import PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import Plan
from simulator.step.simulate import simulate


def _plan_file(tmp_path, name, plan, nodes=2):
    from apps.clusters import cluster_from_flags, cluster_ref
    model = load_model("llama3-8b")
    cluster = cluster_from_flags("dgx-h100", nodes, None, None)
    pred = simulate(model, plan, cluster)
    path = tmp_path / name
    write_plan_file(path, PlanFile(model=model, plan=plan, prediction=pred.to_dict(),
                                   cluster=cluster_ref(cluster, plan, "dgx-h100")))
    return str(path), model, pred


def test_diff_parts_add_up_and_memory_is_by_hand(tmp_path, capsys):
    a_plan = Plan(tp=8, pp=1, dp=2, micro_batch=4, global_batch=64)
    b_plan = Plan(tp=2, pp=1, dp=8, micro_batch=2, global_batch=64, zero_stage=3,
                  sequence_parallel=True)
    a, model, a_pred = _plan_file(tmp_path, "a.yaml", a_plan)
    b, _, b_pred = _plan_file(tmp_path, "b.yaml", b_plan)
    assert main(["diff", a, b, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for side, pred in (("a", a_pred), ("b", b_pred)):
        view = data[side]
        assert view["step_time_s"] == pytest.approx(pred.step_time_s)
        # the op classes re-add the simulator's compute (the same per-op costs)
        assert sum(view["compute_by_class_s"].values()) == pytest.approx(pred.compute_s)
        # pp=1, one stage: the comm stream of the stage holds the exposed comm
        assert sum(view["comm_by_kind_s"].values()) == pytest.approx(pred.comm_s, rel=1e-6)
    # by hand (ZeRO §3.1): bf16 weights 2 bytes per parameter over tp=8 (A) and over
    # tp·dp = 16 under ZeRO-3 (B); untied llama3-8b on one stage holds num_params (the final
    # norm's 4,096 weights sit whole on every TP rank: within 1e-5); B also holds the block
    # computing and the next one prefetched, gathered over dp (PyTorch FSDP, Zhao et al. 2023,
    # §3.3): llama3-8b's block is q,o 4096² each, k,v 4096 x 1024 each, SwiGLU 3 x 4096 x 14336
    # and two norms, over tp = 2, in bf16
    n = model.num_params()
    block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert data["a"]["memory_bytes"]["weights"] == pytest.approx(2 * n / 8, rel=1e-5)
    assert data["b"]["memory_bytes"]["weights"] == pytest.approx(2 * n / 16 + 2 * 2 * block / 2,
                                                                 rel=1e-5)
    # 8 GPUs a node: A's dp pair (stride 8) and B's dp group (stride 2, 8 ranks) cross nodes;
    # A's tp group (8 ranks, stride 1) stays inside one
    assert data["a"]["crossing"] == {"dp": 2} and data["b"]["crossing"] == {"dp": 2}
    assert data["summary"].startswith("B is ")


def test_diff_table_names_the_largest_change(tmp_path, capsys):
    a, _, _ = _plan_file(tmp_path, "a.yaml", Plan(tp=8, pp=1, dp=2, micro_batch=4,
                                                  global_batch=64))
    b, _, _ = _plan_file(tmp_path, "b.yaml", Plan(tp=8, pp=1, dp=2, micro_batch=4,
                                                  global_batch=64, sequence_parallel=True))
    assert main(["diff", a, b]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # sequence parallelism splits the norms and dropouts over tp (Korthikanti et al. 2022)
    assert "the largest change is compute memory-bound" in out


def test_diff_of_a_plan_with_itself_says_they_are_the_same(tmp_path, capsys):
    a, _, _ = _plan_file(tmp_path, "a.yaml", Plan(tp=8, pp=1, dp=2, micro_batch=4,
                                                     global_batch=64))
    assert main(["diff", a, a, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"].startswith(
        "A and B predict the same step within 0.5%")


def test_diff_warns_when_the_device_counts_differ(tmp_path, capsys):
    # 2 DGX H100 nodes (16 GPUs) against 1 (8 GPUs)
    a, _, _ = _plan_file(tmp_path, "a.yaml", Plan(tp=8, pp=1, dp=2, micro_batch=4,
                                                  global_batch=64))
    b, _, _ = _plan_file(tmp_path, "b.yaml", Plan(tp=8, pp=1, dp=1, micro_batch=4,
                                                  global_batch=64), nodes=1)
    assert main(["diff", a, b]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: A runs on 16 devices, B on 8: the step times compare two machine sizes" \
        in err

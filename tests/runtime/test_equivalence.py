"""Distributed runs train exactly the single-process model: DP=2, TP=2 and PP=2 under torchrun.

The single-process run (`runtime.reference.reference_losses`: one process, the whole global
batch in one forward, no DTensor, no process group) is the independent reference. Every step's
loss of every plan must match it within a relative 1e-4 (fp32; AdamW amplifies float noise of
the reduction order a little each step).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from runtime.launch import run_plan
from runtime.reference import reference_losses

STEPS = 5
REL_TOL = 1e-4


def assert_same_losses(measured: list[float], reference: list[float]) -> None:
    assert len(measured) == len(reference) == STEPS
    for step, (got, want) in enumerate(zip(measured, reference, strict=True), start=1):
        assert got == pytest.approx(want, rel=REL_TOL), f"step {step}: {got} vs {want}"


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_plan) -> list[float]:
    return reference_losses(tiny_model(), tiny_plan(), STEPS)


@pytest.mark.parametrize("name, changes", [
    pytest.param("dp2", {"dp": 2}, id="dp2"),
    pytest.param("tp2", {"tp": 2}, id="tp2"),
    # 4 micro-batches of 2 through 2 stages
    pytest.param("pp2-1f1b", {"pp": 2, "schedule": "1f1b"}, id="pp2-1f1b"),
])
def test_two_rank_plan_matches_single_process(write_plan, tiny_plan, tmp_path, reference, name,
                                                 changes):
    plan = tiny_plan(**changes)
    path = write_plan(name, plan)
    summary = run_plan(path, steps=STEPS, out_dir=tmp_path / name, quiet=True, timeout_s=120)
    assert_same_losses(summary["losses"], reference)
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS
    assert (tmp_path / name / "plan.yaml").read_text() == path.read_text()


def test_llama_style_model_under_tp2_matches_single_process(write_plan, tiny_model, tiny_plan, tmp_path):
    # SwiGLU (w3 column-parallel), RMSNorm and grouped-query attention (1 local KV head per rank)
    model = tiny_model(activation="swiglu", norm="rmsnorm", num_kv_heads=2, ffn_hidden=688)
    plan = tiny_plan(tp=2)
    path = write_plan("llama-tp2", plan, model)
    summary = run_plan(path, steps=STEPS, out_dir=tmp_path / "llama", quiet=True, timeout_s=120)
    assert_same_losses(summary["losses"], reference_losses(model, plan, STEPS))


def test_tp2_dp2_on_four_ranks_matches_single_process(write_plan, tiny_plan, tmp_path,
                                                      reference):
    # TP x DP: FSDP2 on the dp sub-mesh of the TP model (DDP cannot wrap DTensor parameters)
    path = write_plan("tp2-dp2", tiny_plan(tp=2, dp=2, micro_batch=1))
    summary = run_plan(path, steps=STEPS, out_dir=tmp_path, quiet=True, timeout_s=180)
    assert_same_losses(summary["losses"], reference)


def test_pp2_gpipe_with_selective_recompute_matches_single_process(write_plan, tiny_plan,
                                                                  tmp_path, reference):
    path = write_plan("pp2-gpipe-ac", tiny_plan(pp=2, schedule="gpipe", recompute="selective"))
    summary = run_plan(path, steps=STEPS, out_dir=tmp_path, quiet=True, timeout_s=120)
    assert_same_losses(summary["losses"], reference)


def test_world_size_mismatch_fails_fast_with_one_line(write_plan, tiny_plan, tmp_path):
    path = write_plan("mismatch", tiny_plan(dp=2))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_plan(path, steps=1, out_dir=tmp_path, nproc=1, quiet=True, timeout_s=60)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert message.splitlines()[1].startswith("meshplan run: error (rank 0): plan tp1-pp1-dp2")
    lines = [ln for ln in message.splitlines()[2:] if "needs world_size" in ln]
    assert len(lines) == 1
    assert "= 2, but 1 process(es) were started" in lines[0]


def test_missing_data_file_is_named(write_plan, tiny_plan, tmp_path):
    path = write_plan("single", tiny_plan())
    missing = tmp_path / "no-such-corpus.txt"
    result = subprocess.run(
        [sys.executable, "-m", "runtime.train", str(path), "--steps", "1", "--out",
         str(tmp_path / "run"), "--data", str(missing)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert str(missing) in result.stderr

"""Every plan kind trains exactly the single-process model: each torchrun launch runs 10 steps.

The single-process run (`runtime.reference.reference_run`: one process, the whole global
batch in one forward, no DTensor, no process group) is the independent reference. Every step's
loss of every plan must match it within a relative 1e-4 (fp32; AdamW amplifies float noise of
the reduction order a little each step), and so must every parameter after the last optimizer
step (``--save-params``: full tensors gathered to rank 0): ``||p - p_ref|| <= 1e-4 ·
max(||p_ref||, 1)`` per tensor (Frobenius norms; the floor keeps near-zero biases from turning
float noise into a large relative error, as Adam updates elements whose gradient is pure noise
by a sizeable fraction of the learning rate).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from planner.presets import load_model
from runtime.launch import run_plan
from runtime.reference import reference_run

STEPS = 10
REL_TOL = 1e-4


def assert_same_losses(measured: list[float], reference: list[float]) -> None:
    assert len(measured) == len(reference) == STEPS
    for step, (got, want) in enumerate(zip(measured, reference, strict=True), start=1):
        assert got == pytest.approx(want, rel=REL_TOL), f"step {step}: {got} vs {want}"


def assert_same_params(path, reference: dict[str, torch.Tensor]) -> None:
    measured = torch.load(path)
    assert sorted(measured) == sorted(reference)
    for name, want in reference.items():
        err = float((measured[name] - want).norm())
        scale = max(float(want.norm()), 1.0)
        assert err <= REL_TOL * scale, f"{name}: error norm {err:.3g} vs {REL_TOL} x {scale:.3g}"


@pytest.fixture(scope="module")
def reference_state(tiny_model, tiny_plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_run(tiny_model(), tiny_plan(), STEPS)


@pytest.fixture(scope="module")
def reference(reference_state) -> list[float]:
    return reference_state[0]


def run_and_compare(write_plan, tmp_path, name, plan, reference_state, *, model=None,
                    timeout_s=180, **options) -> dict:
    """Train ``plan`` for STEPS steps; assert losses and final parameters match the reference."""
    path = write_plan(name, plan, model)
    params = tmp_path / f"{name}.pt"
    summary = run_plan(path, steps=STEPS, out_dir=tmp_path / name, quiet=True,
                       timeout_s=timeout_s, save_params=params, **options)
    assert_same_losses(summary["losses"], reference_state[0])
    assert_same_params(params, reference_state[1])
    return summary


@pytest.mark.parametrize("name, changes", [
    pytest.param("dp2", {"dp": 2}, id="dp2"),
    # plain TP paths run in the fast suite as tp2-dp2 (vocabulary-parallel head) and
    # tp2-sp-tied (replicated head): this one only in the slow suite
    pytest.param("tp2", {"tp": 2}, id="tp2", marks=pytest.mark.slow),
    # 4 micro-batches of 2 through 2 stages
    pytest.param("pp2-1f1b", {"pp": 2, "schedule": "1f1b"}, id="pp2-1f1b"),
])
def test_two_rank_plan_matches_single_process(write_plan, tiny_plan, tmp_path, reference_state,
                                              name, changes):
    path = write_plan(name, tiny_plan(**changes))
    summary = run_and_compare(write_plan, tmp_path, name, tiny_plan(**changes), reference_state)
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS
    assert (tmp_path / name / "plan.yaml").read_text() == path.read_text()


@pytest.mark.slow
def test_llama_style_model_under_tp2_matches_single_process(write_plan, tiny_model, tiny_plan, tmp_path):
    # SwiGLU (w3 column-parallel), RMSNorm and grouped-query attention (1 local KV head per rank)
    model = tiny_model(activation="swiglu", norm="rmsnorm", num_kv_heads=2, ffn_hidden=688)
    plan = tiny_plan(tp=2)
    run_and_compare(write_plan, tmp_path, "llama-tp2", plan, reference_run(model, plan, STEPS),
                    model=model)


def test_tp2_dp2_on_four_ranks_matches_single_process(write_plan, tiny_plan, tmp_path,
                                                      reference_state):
    # TP x DP: FSDP2 on the dp sub-mesh of the TP model (DDP cannot wrap DTensor parameters)
    run_and_compare(write_plan, tmp_path, "tp2-dp2", tiny_plan(tp=2, dp=2, micro_batch=1),
                    reference_state)


def test_pp2_gpipe_with_selective_recompute_matches_single_process(write_plan, tiny_plan,
                                                                  tmp_path, reference_state):
    run_and_compare(write_plan, tmp_path, "pp2-gpipe-ac",
                    tiny_plan(pp=2, schedule="gpipe", recompute="selective"), reference_state)


@pytest.mark.parametrize("name, changes", [
    # 4 chunks of 1 layer, 2 per rank; 4 micro-batches (a multiple of pp)
    pytest.param("pp2-interleaved", {"pp": 2, "schedule": "interleaved-1f1b",
                                     "virtual_stages": 2}, id="pp2-interleaved-1f1b"),
    # uneven split: 1 layer on stage 0, 3 on stage 1
    pytest.param("pp2-uneven", {"pp": 2, "schedule": "1f1b", "stage_layers": (1, 3)},
                 id="pp2-uneven"),
    pytest.param("dp2-zero3", {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
    pytest.param("dp2-zero1", {"dp": 2, "zero_stage": 1}, id="dp2-zero1",
                 marks=pytest.mark.slow),
    # sequence parallelism, vocabulary-parallel embedding and loss, full recomputation
    pytest.param("tp2-sp-full", {"tp": 2, "sequence_parallel": True, "recompute": "full"},
                 id="tp2-sp-full-recompute"),
])
def test_more_two_rank_plans_match_single_process(write_plan, tiny_plan, tmp_path,
                                                  reference_state, name, changes):
    run_and_compare(write_plan, tmp_path, name, tiny_plan(**changes), reference_state)


@pytest.mark.parametrize("name, changes", [
    pytest.param("pp2-dp2", {"pp": 2, "dp": 2, "micro_batch": 1, "schedule": "1f1b"},
                 id="pp2-dp2"),
    # as many micro-batches (2) as stages: stage 0 runs both backwards back to back, the case
    # in which DDP's bucket rebuild failed before `DataParallelAwareStage`
    pytest.param("pp2-dp2-2mb", {"pp": 2, "dp": 2, "micro_batch": 2, "schedule": "1f1b"},
                 id="pp2-dp2-two-micro-batches"),
    pytest.param("tp2-pp2", {"tp": 2, "pp": 2, "schedule": "gpipe", "sequence_parallel": True},
                 id="tp2-pp2-sp"),
])
def test_four_rank_pairs_match_single_process(write_plan, tiny_plan, tmp_path, reference_state,
                                              name, changes):
    run_and_compare(write_plan, tmp_path, name, tiny_plan(**changes), reference_state)


def test_cp2_matches_single_process_across_a_checkpoint_resume(write_plan, tiny_plan,
                                                               tmp_path, reference_state):
    # ring attention over 2 ranks, each holding chunks (0, 3) or (1, 2) of every sequence;
    # 6 steps, a DCP checkpoint, then a second launch resumes it for steps 7..10
    path = write_plan("cp2", tiny_plan(cp=2))
    first = run_plan(path, steps=6, out_dir=tmp_path / "cp2", quiet=True, timeout_s=180,
                     checkpoint_every=6)
    params = tmp_path / "cp2.pt"
    resumed = run_plan(path, steps=STEPS, out_dir=tmp_path / "cp2-resumed", quiet=True,
                       timeout_s=180, resume=tmp_path / "cp2" / "checkpoints",
                       save_params=params)
    assert_same_losses(first["losses"] + resumed["losses"], reference_state[0])
    assert_same_params(params, reference_state[1])


@pytest.mark.slow
@pytest.mark.parametrize("name, changes", [
    pytest.param("cp2-dp2", {"cp": 2, "dp": 2, "micro_batch": 1}, id="cp2-dp2"),
    # TP inside each cp rank: the ring runs on each rank's local heads
    pytest.param("cp2-tp2", {"cp": 2, "tp": 2}, id="cp2-tp2"),
    # two pipeline stages, each ring over its own cp pair; 4 micro-batches of 2
    pytest.param("cp2-pp2", {"cp": 2, "pp": 2, "schedule": "1f1b"}, id="cp2-pp2"),
])
def test_context_parallel_pairs_match_single_process(write_plan, tiny_plan, tmp_path,
                                                     reference_state, name, changes):
    run_and_compare(write_plan, tmp_path, name, tiny_plan(**changes), reference_state)


@pytest.mark.slow
def test_meshplan_runs_the_best_cp_plan_of_tiny_gpt_at_seq_512_on_two_ranks(tmp_path):
    # the planner searches cp from 16K tokens on, so cp is fixed; its best cp plan then runs
    plan = tmp_path / "cp.yaml"
    cli = [sys.executable, "-m", "apps.cli"]
    made = subprocess.run([*cli, "plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu",
                           "--ranks", "2", "--seq-len", "512", "--fix", "cp=2", "--out",
                           str(plan)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    ran = subprocess.run([*cli, "run", str(plan), "--steps", "2", "--out", str(tmp_path / "run"),
                          "--json"], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    summary = json.loads(ran.stdout.strip().splitlines()[-1])
    assert summary["plan_id"].startswith("tp1-cp2-pp1-dp1") and summary["steps"] == 2
    assert summary["world_size"] == 2


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


def test_profiled_dp2_run_with_tiled_attention_writes_metrics_and_traces(
        write_plan, tiny_plan, tmp_path, reference_state):
    # our FlashAttention-2 kernel in the model trains the same model as SDPA
    summary = run_and_compare(write_plan, tmp_path, "dp2-tiled", tiny_plan(dp=2),
                              reference_state, profile=True, attention="tiled")
    run = tmp_path / "dp2-tiled"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert len(record["peak_memory_bytes"]) == 2 and min(record["peak_memory_bytes"]) > 0
        assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 2)
        assert record["device_profile"] == "localhost-cpu" and 0 < record["mfu"] < 1
        assert 0 < record["comm_time_s"] < record["step_time_s"]
    assert summary["peak_flops_per_device"] == pytest.approx(1.05e11)
    for rank in (0, 1):
        trace = json.loads((run / f"trace_rank{rank}.json").read_text())
        assert any(e.get("name", "").startswith("gloo:") for e in trace["traceEvents"])


def test_tied_embeddings_under_interleaved_pp2_match_single_process(write_plan, tiny_model,
                                                                    tiny_plan, tmp_path):
    # the tied matrix lives on chunk 0 (rank 0) and chunk 3 (rank 1); its grads are summed
    model = tiny_model(tied_embeddings=True)
    plan = tiny_plan(pp=2, schedule="interleaved-1f1b", virtual_stages=2)
    run_and_compare(write_plan, tmp_path, "pp2-tied", plan, reference_run(model, plan, STEPS),
                    model=model)


def test_unbuildable_model_fails_on_every_rank_with_one_line(write_plan, tiny_model, tiny_plan,
                                                             tmp_path):
    path = write_plan("small-vocab", tiny_plan(dp=2), tiny_model(vocab_size=128))
    with pytest.raises(RuntimeError) as info:
        run_plan(path, steps=1, out_dir=tmp_path, quiet=True, timeout_s=60)
    lines = str(info.value).splitlines()
    errors = [ln for ln in lines[1:3] if ln.startswith("meshplan run: error (rank ")]
    # Every rank fails the same check; torchrun may stop the second before it reports, so
    # one or two one-line errors come first, each naming its rank and the cause.
    assert errors and errors == lines[1:1 + len(errors)]
    assert {ln[:28] for ln in errors} <= {"meshplan run: error (rank 0)",
                                          "meshplan run: error (rank 1)"}
    assert all("vocab_size=128 is too small for byte tokens" in ln for ln in errors)


def test_sequence_parallel_under_cp_needs_tp_to_divide_the_local_tokens(write_plan, tiny_plan,
                                                                         tmp_path):
    # seq 20 over cp = 2: 10 tokens per rank, which tp = 4 cannot shard (20 alone it could)
    plan = tiny_plan(tp=4, cp=2, sequence_parallel=True)
    path = write_plan("sp-cp", plan, load_model("tiny-gpt").replace(seq_len=20))
    result = subprocess.run(
        [sys.executable, "-m", "runtime.train", str(path), "--steps", "1", "--out",
         str(tmp_path / "run")], capture_output=True, text=True, timeout=60,
        env={**os.environ, "WORLD_SIZE": "8"})
    assert result.returncode == 2
    assert "seq_len/cp = 10 tokens of a rank over tp=4" in result.stderr
    assert "multiple of cp*tp = 8" in result.stderr


def test_tied_embeddings_under_tp2_with_sequence_parallel_match_single_process(
        write_plan, tiny_model, tiny_plan, tmp_path):
    # tied: tok/out stay replicated, so the head takes the all-gathered (B, T, h) activations
    # of the sequence-parallel norm and must see them as a plain tensor, like its weight
    model = tiny_model(tied_embeddings=True)
    plan = tiny_plan(tp=2, sequence_parallel=True)
    run_and_compare(write_plan, tmp_path, "tp2-sp-tied", plan, reference_run(model, plan, STEPS),
                    model=model)

"""Time to train and the per-plan checkpoint: plans differ in checkpoint time and goodput."""

import json

import pytest

from apps.cli import main
from planner.objective import checkpoint_bytes, plan_checkpoint_s
from planner.presets import load_model
from planner.spec import Plan
from planner.time_to_train import parse_tokens


def test_checkpoint_bytes_by_hand_bf16_zero1():
    # bf16 weights (2 bytes) + Adam's fp32 master weights and moments (12 bytes), ZeRO paper
    # §3.1; llama3-8b has untied embeddings, so pp=1 holds exactly num_params; tp=2 and
    # ZeRO-1 over dp=4 split it over tp·dp = 8 writers.
    model = load_model("llama3-8b")
    plan = Plan(tp=2, pp=1, dp=4, micro_batch=1, global_batch=8, zero_stage=1)
    total, largest = checkpoint_bytes(model, plan)
    assert total == pytest.approx(14 * model.num_params())
    assert largest == pytest.approx(14 * model.num_params() / 8)


def test_checkpoint_time_is_bound_by_the_largest_writer_or_the_storage():
    model = load_model("llama3-8b")
    n = model.num_params()
    replicated = Plan(tp=2, pp=1, dp=4, micro_batch=1, global_batch=8)
    sharded = replicated.replace(zero_stage=1)
    # by hand: 2 writers of 7N bytes at 2 GB/s; storage 14N at 2 TB/s is faster
    assert plan_checkpoint_s(model, replicated) == pytest.approx(7 * n / 2e9)
    # 8 writers of 14N/8 at 2 GB/s against 14N over a 10 GB/s storage: the storage binds
    assert plan_checkpoint_s(model, sharded, storage_bandwidth_Bps=10e9) == \
        pytest.approx(14 * n / 10e9)


def test_parse_tokens_suffixes_and_errors():
    assert parse_tokens("15T") == 15e12
    assert parse_tokens("300b") == 300e9
    with pytest.raises(ValueError, match="--tokens='15X' must be a positive token count"):
        parse_tokens("15X")


def _plan_json(capsys, *extra):
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                 "--global-batch", "64", "--top-k", "3", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_time_to_train_days_gpu_hours_cost_by_hand(capsys):
    data = _plan_json(capsys, "--tokens", "1T", "--gpu-hour-usd", "2.5",
                      "--objective", "time-to-train")
    rows = data["plans"]
    # by hand: wall = tokens / (tokens/s × goodput); GPU-hours = wall hours × 16 devices
    for row in rows[:5]:
        wall_s = 1e12 / (row["tokens_per_s"] * row["goodput"])
        assert row["wall_days"] == pytest.approx(wall_s / 86400)
        assert row["gpu_hours"] == pytest.approx(wall_s / 3600 * 16)
        assert row["cost_usd"] == pytest.approx(row["gpu_hours"] * 2.5)
    days = [r["wall_days"] for r in rows]
    assert days == sorted(days)
    assert data["train_assumptions"]["tokens"] == 1e12
    # the checkpoint depends on the plan: not every plan gets the same goodput
    assert len({round(r["goodput"], 6) for r in rows}) > 1


def test_steps_budget_is_steps_times_batch_tokens(capsys):
    data = _plan_json(capsys, "--steps", "1000")
    # 1000 steps × 64 sequences × 8192 tokens (llama3-8b's seq_len)
    assert data["train_assumptions"]["tokens"] == 1000 * 64 * 8192
    ids = [r["id"] for r in data["plans"]]
    throughput = _plan_json(capsys)
    assert ids == [r["id"] for r in throughput["plans"]]  # the budget does not re-rank


@pytest.mark.parametrize("flags, message", [
    (["--objective", "time-to-train"], "--objective time-to-train needs a budget"),
    (["--mtbf-hours", "1000"], "--mtbf-hours only act(s) on the failure model"),
    (["--gpu-hour-usd", "2"], "--gpu-hour-usd=2 prices a token budget"),
    (["--tokens", "1T", "--steps", "5"], "give --tokens or --steps, not both"),
    (["--top-k", "0"], "--top-k=0 must be > 0"),
])
def test_budget_flags_are_checked_before_the_search(capsys, flags, message):
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", *flags]) == 2
    assert message in " ".join(capsys.readouterr().err.split())

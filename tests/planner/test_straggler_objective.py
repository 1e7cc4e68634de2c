"""The straggler term of the goodput objective: each episode priced with the runtime's
eviction policy (`simulator.failures.eviction`), staying or evicting, whichever is cheaper."""

import csv
import json
import math

import pytest

from apps.cli import main
from planner.objective import (
    checkpoint_bytes,
    evicted_step_s,
    eviction_restart_s,
    hours_to_s,
    rank_by_goodput,
    straggler_episode,
)
from planner.presets import load_model
from planner.spec import Plan
from simulator.failures.eviction import predicted_eviction_goodput
from simulator.failures.goodput import job_goodput
from tests.planner.test_objective import make_result

MODEL = load_model("tiny-gpt")
DP4 = Plan(tp=1, pp=1, dp=4, micro_batch=1, global_batch=8, dtype="fp32")


def _rank(*, factor: float, write_s: float, restart_s: float = 20.0):
    """DP4 ranked with a step of 1.0 s (0.8 s of it the critical stage's compute), a checkpoint
    of ``write_s`` seconds, one onset per 900 s (1 per device-hour on 4 devices), episodes
    capped at 100 s (a budget of 200 s of healthy training) and one rank per eviction."""
    total, _ = checkpoint_bytes(MODEL, DP4)   # dp replicated: one writer holds it all
    tokens_per_s = 8 * MODEL.seq_len / 1.0
    result = rank_by_goodput(
        make_result([(DP4, tokens_per_s)]), MODEL, device_mtbf_s=hours_to_s(1e6),
        storage_bandwidth_Bps=total / write_s, writer_bandwidth_Bps=total / write_s,
        restart_s=restart_s, straggler_rate_per_device_s=1 / 3600, straggler_factor=factor,
        straggler_window=5, train_tokens=200 * tokens_per_s, devices_per_node=1)
    row = result.ranked.iloc[0]
    fail = job_goodput(tokens_per_s=tokens_per_s, num_devices=4, device_mtbf_s=hours_to_s(1e6),
                       checkpoint_s=write_s, restart_s=restart_s, devices_per_node=1).goodput
    return row, fail


def test_evict_when_staying_is_dearer_by_hand():
    # By hand. Slowed step (factor 3): 1.0 + (3 - 1) x 0.8 = 2.6 s. After evicting rank 1's
    # replica: 3 replicas share 8 micro-batches, ceil(8/3) = 3 instead of 2, so the compute
    # grows 1.5x: 1.0 + 0.5 x 0.8 = 1.4 s. Restart: stop (checkpoint write 10) + start-up 20
    # + load 10 = 40 s. Episode: min(job MTBF 2.5e5 h, 200 s / 2) = 100 s = 100 steps.
    # Stay: 100 x 2.6 - 100 = 160 s. Evict: 5 x 2.6 + 40 + 95 x 1.4 - 100 = 86 s: evict.
    # Episodes: 1 / (900 + 100) s = 1e-3 /s, so 0.086 of wall time is lost.
    row, fail = _rank(factor=3.0, write_s=10.0)
    assert row["step_time_slow_s"] == pytest.approx(2.6)
    assert row["step_time_evicted_s"] == pytest.approx(1.4)
    assert row["evict_restart_s"] == pytest.approx(40.0)
    assert row["straggler_episode_s"] == pytest.approx(100.0)
    assert (row["straggler_stay_s"], row["straggler_evict_s"]) == pytest.approx((160.0, 86.0))
    assert row["straggler_policy"] == "evict"
    assert row["straggler_episodes_per_s"] == pytest.approx(1e-3)
    assert row["straggler_loss"] == pytest.approx(0.086)
    assert row["failure_goodput"] == pytest.approx(fail)
    assert row["goodput"] == pytest.approx(fail * (1 - 0.086))


def test_stay_when_evicting_is_dearer_by_hand():
    # Factor 1.25: the slowed step 1.0 + 0.25 x 0.8 = 1.2 s beats the evicted 1.4 s, so no
    # restart can pay. Stay: 100 x 1.2 - 100 = 20 s; evict: 5 x 1.2 + 40 + 95 x 1.4 - 100 =
    # 79 s. Loss 1e-3 x 20 = 0.02.
    row, fail = _rank(factor=1.25, write_s=10.0)
    assert (row["straggler_stay_s"], row["straggler_evict_s"]) == pytest.approx((20.0, 79.0))
    assert row["straggler_policy"] == "stay"
    assert row["goodput"] == pytest.approx(fail * (1 - 0.02))


def test_a_large_checkpoint_makes_eviction_dearer():
    # Factor 3 again, but a 100 s checkpoint: restart 100 + 20 + 100 = 220 s, so evicting
    # costs 13 + 220 + 133 - 100 = 266 s > staying's 160 s: stay.
    row, _ = _rank(factor=3.0, write_s=100.0)
    assert row["evict_restart_s"] == pytest.approx(220.0)
    assert row["straggler_evict_s"] == pytest.approx(266.0)
    assert row["straggler_policy"] == "stay"
    assert eviction_restart_s(100.0, 20.0) > eviction_restart_s(10.0, 20.0)


def test_a_larger_dp_group_loses_less_per_evicted_node():
    plan = DP4.replace(global_batch=64)
    # dp 4 -> 3: ceil(64/3) = 22 micro-batches instead of 16 (1.375x compute);
    # dp 16 -> 15: ceil(64/15) = 5 instead of 4 (1.25x): 1 + 0.375 x 0.8 and 1 + 0.25 x 0.8.
    assert evicted_step_s(plan, step_s=1.0, compute_s=0.8, devices_per_node=1) == \
        pytest.approx(1.3)
    assert evicted_step_s(plan.replace(dp=16), step_s=1.0, compute_s=0.8,
                          devices_per_node=1) == pytest.approx(1.2)
    # a node of 8 ranks holds 2 of a tp4 x dp4 plan's replicas (tp fastest): 2 left,
    # 32 micro-batches instead of 16
    tp4 = plan.replace(tp=4)
    assert evicted_step_s(tp4, step_s=1.0, compute_s=0.8, devices_per_node=8) == \
        pytest.approx(1.8)
    # a node that holds every replica leaves nothing to resume on
    assert evicted_step_s(plan, step_s=1.0, compute_s=0.8, devices_per_node=4) == float("inf")


def test_episode_of_the_eviction_bench_gives_the_bench_prediction():
    # benchmarks/eviction_bench.py's run in docs/faults.md: 100 steps, the staying median
    # 0.351 s, the new layout's 0.068 s, evicted after step 5, restart predicted 1.24 s;
    # it predicted a goodput of 0.869: wall = 5 x 0.351 + 1.24 + 95 x 0.068 = 9.455 s,
    # (9.455 - 1.24) / 9.455 = 0.8689.
    e = straggler_episode(step_s=0.351, step_s_slow=0.351, step_s_evicted=0.068,
                          episode_s=100 * 0.351, window=5, restart_s=1.24)
    assert e.policy == "evict"
    wall = e.evict_s + 100 * 0.351
    assert wall == pytest.approx(9.455)
    assert (wall - 1.24) / wall == pytest.approx(0.8689, abs=1e-4)
    assert (wall - 1.24) / wall == pytest.approx(predicted_eviction_goodput(
        steps=100, step_s=0.351, step_s_staying=0.351, step_s_after=0.068, onset=1,
        window=5, restart_s=1.24))


def _plan(*extra):
    return main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                 "--global-batch", "64", "--top-k", "3", *extra])


@pytest.mark.parametrize("flags, message", [
    (["--straggler-rate", "-1"], "--straggler-rate=-1 must be a finite number >= 0"),
    (["--straggler-rate", "nan"], "--straggler-rate=nan must be a finite number >= 0"),
    (["--straggler-factor", "0.5"], "--straggler-factor=0.5 must be a finite number >= 1"),
    (["--straggler-factor", "inf"], "--straggler-factor=inf must be a finite number >= 1"),
])
def test_bad_straggler_flags_exit_2_with_one_line(capsys, flags, message):
    assert _plan("--objective", "goodput", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "searching" not in err
    assert len(err.splitlines()) == 1


def test_straggler_flags_need_the_failure_model(capsys):
    assert _plan("--straggler-factor", "2") == 2
    assert "--straggler-factor only act(s) on the failure model" in \
        " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("objective", ["goodput", "time-to-train"])
def test_json_csv_and_table_carry_the_straggler_term_and_rank_by_it(capsys, tmp_path,
                                                                      objective):
    assert _plan("--objective", objective, "--tokens", "1T", "--straggler-rate", "1e-3",
                 "--straggler-factor", "2", "--json", "--csv", str(tmp_path)) == 0
    rows = json.loads(capsys.readouterr().out)["plans"]
    for r in rows:
        assert r["goodput"] == pytest.approx(r["failure_goodput"] * (1 - r["straggler_loss"]))
        # JSON has no infinity: an eviction that cannot run (no replica left) is null
        evict = math.inf if r["straggler_evict_s"] is None else r["straggler_evict_s"]
        assert r["straggler_cost_s"] == min(r["straggler_stay_s"], evict)
    assert len({round(r["straggler_loss"], 6) for r in rows}) > 1   # plans differ by it
    key, reverse = (("effective_tokens_per_s", True) if objective == "goodput"
                    else ("wall_days", False))
    assert [r[key] for r in rows] == sorted((r[key] for r in rows), reverse=reverse)
    with open(tmp_path / "ranked.csv") as f:
        first = next(csv.DictReader(f))
    assert first["straggler_policy"] == rows[0]["straggler_policy"]
    assert float(first["straggler_loss"]) == pytest.approx(rows[0]["straggler_loss"])
    assert _plan("--objective", objective, "--tokens", "1T", "--straggler-rate", "1e-3") == 0
    out = capsys.readouterr().out
    assert "on straggler" in out and "a straggler: " in " ".join(out.split())


@pytest.mark.parametrize("episode_s, says", [
    # the episode ran to the job MTBF (no budget, or a budget whose half-run is longer)
    (3600.0, "(until a failure's restart swaps the device: the job MTBF)"),
    # half of a shorter run: grows with the token budget, up to the MTBF
    (1800.0, "(half the run, the mean time left after an onset: a larger budget lasts "
             "longer, up to the job MTBF)"),
])
def test_the_straggler_clause_says_what_ends_the_episode(episode_s, says):
    from apps.cmd_faults import straggler_clause
    row = {"straggler_policy": "evict", "straggler_stay_s": 80.0, "straggler_evict_s": 62.0,
           "straggler_cost_s": 62.0, "straggler_episode_s": episode_s, "job_mtbf_s": 3600.0,
           "straggler_loss": 0.0005}
    assert says in straggler_clause(row)

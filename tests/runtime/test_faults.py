"""Failures lose nothing: injected kills, hangs, damaged checkpoints and NaN losses under torchrun.

Every run is the 2-layer tiny-gpt at dp=2 with gradient accumulation (global batch 8, micro-batch
2: two micro-batches per DP rank), 10 steps, checkpoints every 3. A run that fails and restarts
must end with the same losses, step by step and bitwise (CPU, fp32), and the same ordered list
of consumed sample ids per DP rank, as the uninterrupted run.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from runtime.faults import parse_fault
from runtime.launch import run_plan

STEPS = 10
EVERY = 3
#: Collective timeout of the runs: a hung rank turns into an error after this long.
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def plan_path(write_plan, tiny_plan, tiny_model):
    return write_plan("faults-dp2", tiny_plan(dp=2), tiny_model(num_layers=2))


def consumed(folder) -> dict[int, list[int]]:
    """DP rank -> the ordered sample ids it trained on."""
    ids = {}
    for path in sorted((folder / "consumed").glob("dp*.jsonl")):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        ids[lines[0]["dp_rank"]] = [i for line in lines for i in line["samples"]]
    return ids


def launch(plan_path, out, **options) -> dict:
    options = {"steps": STEPS, "checkpoint_every": EVERY, "max_restarts": 2,
               "collective_timeout_s": TIMEOUT_S, "timeout_s": 150, **options}
    return run_plan(plan_path, out_dir=out, quiet=True, **options)


@pytest.fixture(scope="module")
def uninterrupted(plan_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    summary = run_plan(plan_path, steps=STEPS, out_dir=out, quiet=True, timeout_s=120)
    return summary, consumed(out)


def assert_same_job(summary, out, uninterrupted) -> None:
    want, want_ids = uninterrupted
    assert summary["losses"] == want["losses"]                 # bitwise, step by step
    assert consumed(out) == want_ids
    assert want_ids[0] == [i for s in range(STEPS) for i in range(8 * s, 8 * s + 4)]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, STEPS + 1))


def test_killed_rank_restarts_from_the_last_checkpoint(plan_path, tmp_path, uninterrupted):
    summary = launch(plan_path, tmp_path, inject=["kill:rank=1,step=7"])
    assert_same_job(summary, tmp_path, uninterrupted)
    assert summary["restarts"] == 1
    assert summary["steps_lost"] == 1                 # step 7, interrupted, computed again
    assert summary["wall_time_lost_s"] > 0 and summary["wall_time_s"] > summary["useful_time_s"]
    assert summary["checkpoint_fallbacks"] == []


def test_hung_rank_times_out_and_restarts(plan_path, tmp_path, uninterrupted):
    summary = launch(plan_path, tmp_path, inject=["hang:rank=1,step=7"])
    assert_same_job(summary, tmp_path, uninterrupted)
    assert summary["restarts"] == 1
    assert summary["restart_times_s"][0] >= TIMEOUT_S   # the collective timeout caught it


def test_damaged_newest_checkpoint_falls_back_to_the_previous(plan_path, tmp_path,
                                                              uninterrupted):
    summary = launch(plan_path, tmp_path,
                     inject=["corrupt-checkpoint:step=6", "kill:rank=1,step=7"])
    assert_same_job(summary, tmp_path, uninterrupted)
    assert len(summary["checkpoint_fallbacks"]) == 1
    assert "step00000006" in summary["checkpoint_fallbacks"][0]
    assert summary["steps_lost"] == 4                 # steps 4..7 again, from step 3


def test_resume_with_a_different_number_of_steps(plan_path, tmp_path, uninterrupted):
    first = launch(plan_path, tmp_path / "first", steps=6, max_restarts=0)
    assert first["losses"] == uninterrupted[0]["losses"][:6]
    summary = launch(plan_path, tmp_path / "second", resume=tmp_path / "first" / "checkpoints",
                     max_restarts=0)
    assert summary["losses"] == uninterrupted[0]["losses"][6:]
    ids = consumed(tmp_path / "second")
    assert ids == {r: v[6 * 4:] for r, v in uninterrupted[1].items()}


def test_nan_loss_stops_with_a_clear_error(plan_path, tmp_path):
    with pytest.raises(RuntimeError, match="loss is nan at step 4"):
        launch(plan_path, tmp_path, inject=["nan:step=4"], max_restarts=1)
    assert '"attempt": 1' not in (tmp_path / "faults" / "events.jsonl").read_text()


def test_nan_loss_skips_the_step_and_a_straggler_slows_the_group(plan_path, tmp_path,
                                                                  uninterrupted):
    summary = launch(plan_path, tmp_path, inject=["nan:step=4", "slow:rank=1,factor=6,step=6"],
                     on_nan="skip", checkpoint_every=0)
    assert summary["skipped_steps"] == [4]
    assert math.isnan(summary["losses"][3])
    assert summary["losses"][:3] == uninterrupted[0]["losses"][:3]
    assert all(math.isfinite(x) for x in summary["losses"][4:])
    times = [json.loads(x)["step_time_s"]
             for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # rank 1 computes 6x slower from step 6; rank 0 waits for it in every step's all-reduce
    assert statistics.median(times[5:]) > 2 * statistics.median(times[1:5])


def test_fault_specs_name_their_fields():
    assert parse_fault("hang:rank=0,step=3").spec == "hang:rank=0,step=3"
    assert parse_fault("slow:rank=1,factor=2,step=4").spec == "slow:rank=1,factor=2.0,step=4"
    with pytest.raises(ValueError, match="missing step; write kill:rank=...,step=..."):
        parse_fault("kill:rank=1")
    with pytest.raises(ValueError, match="fault kind 'explode' is unknown"):
        parse_fault("explode:rank=1")
    with pytest.raises(ValueError, match="factor=0.5 must be >= 1"):
        parse_fault("slow:rank=1,factor=0.5")


def test_plan_file_faults_are_read(tmp_path):
    from runtime.faults import plan_file_faults
    path = tmp_path / "plan.yaml"
    path.write_text("model: {}\nfaults:\n  - kill:rank=1,step=7\n  - nan:step=3\n")
    assert plan_file_faults(path) == ["kill:rank=1,step=7", "nan:step=3"]
    path.write_text("model: {}\n")
    assert plan_file_faults(path) == []


@pytest.mark.parametrize("first_dp, then_dp", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_resume_on_another_world_size_continues_the_sample_sequence(
        first_dp, then_dp, write_plan, tiny_plan, tiny_model, tmp_path, uninterrupted):
    # 6 steps on first_dp ranks, checkpoint at 3 and 6, then steps 7..10 on then_dp ranks from
    # that checkpoint: DCP reshards model and optimizer, the data position is job-wide
    # (6 x 8 samples), so the resumed run trains on samples 48..79 in order and its losses
    # are the uninterrupted 2-rank run's (within float rounding: another reduction order)
    model = tiny_model(num_layers=2)
    first = launch(write_plan(f"reshard-dp{first_dp}", tiny_plan(dp=first_dp), model),
                   tmp_path / "first", steps=6, max_restarts=0)
    then = launch(write_plan(f"reshard-dp{then_dp}", tiny_plan(dp=then_dp), model),
                  tmp_path / "then", resume=tmp_path / "first" / "checkpoints", max_restarts=0)
    want, _ = uninterrupted
    assert first["losses"] == pytest.approx(want["losses"][:6], rel=1e-6)
    assert then["losses"] == pytest.approx(want["losses"][6:], rel=1e-6)
    ids = consumed(tmp_path / "then")
    per_rank = 8 // then_dp
    for r in range(then_dp):
        assert ids[r] == [i for s in range(6, STEPS)
                          for i in range(8 * s + r * per_rank, 8 * s + (r + 1) * per_rank)]
    joined = sorted(i for v in consumed(tmp_path / "first").values() for i in v) + \
        sorted(i for v in ids.values() for i in v)
    assert joined == list(range(8 * STEPS))         # nothing skipped, nothing repeated


# -- pipeline parallelism: two stages hold different parameters (and optimizer groups) -------

@pytest.fixture(scope="module")
def pp_plan_path(write_plan, tiny_plan, tiny_model):
    return write_plan("faults-pp2", tiny_plan(pp=2), tiny_model(num_layers=2))


@pytest.fixture(scope="module")
def pp_uninterrupted(pp_plan_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("pp-uninterrupted")
    return run_plan(pp_plan_path, steps=STEPS, out_dir=out, quiet=True, timeout_s=120)


def test_killed_pipeline_stage_restarts_from_the_last_checkpoint(pp_plan_path, tmp_path,
                                                                 pp_uninterrupted):
    # each stage saves its own optimizer param groups (keyed by parameter name): with list
    # keys the stages overwrote each other's and the restart failed in AdamW.step
    summary = launch(pp_plan_path, tmp_path, inject=["kill:rank=1,step=7"], max_restarts=1)
    assert summary["losses"] == pp_uninterrupted["losses"]      # bitwise, step by step
    assert summary["restarts"] == 1 and summary["steps_lost"] == 1


def test_failed_run_ends_with_the_resume_command_and_resumes_from_its_folder(
        pp_plan_path, tmp_path, pp_uninterrupted):
    first = tmp_path / "first"
    with pytest.raises(RuntimeError) as info:
        launch(pp_plan_path, first, inject=["kill:rank=1,step=7"], max_restarts=0)
    last = str(info.value).splitlines()[-1]
    assert last.startswith("meshplan run: rank 1 failed after step 6 of 10 (exit code -9, "
                           "SIGKILL; injected fault kill:rank=1,step=7)")
    assert f"--resume {first / 'checkpoints'} --checkpoint-every 3 --timeout-s 10.0`" in last
    # --resume takes the run folder too (its checkpoints/)
    summary = launch(pp_plan_path, tmp_path / "second", resume=first, max_restarts=0)
    assert summary["losses"] == pp_uninterrupted["losses"][6:]


def test_failure_hint_without_checkpoints_says_how_to_survive_one(tmp_path):
    from runtime.launch import failure_hint
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    report = ["Root Cause (first observed failure):\n", "[0]:\n",
              "  rank      : 0 (local_rank: 0)\n", "  exitcode  : 1 (pid: 12)\n"]
    hint = failure_hint(report, "plan.yaml", tmp_path, 5, 0)
    assert hint == ("meshplan run: rank 0 failed after step 2 of 5 (exit code 1); no "
                    "checkpoint to resume from: run again with --checkpoint-every K "
                    "--max-restarts N to survive a failure\n")
    assert failure_hint(report, "plan.yaml", tmp_path, 5, 0, input_error=True) is None

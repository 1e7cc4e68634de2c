"""Evict and continue: a confirmed straggler's node leaves, the planner re-plans on the ranks
left, and the job resumes from the checkpoint of the confirming step on the new layout."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from planner.spec import PlanError
from runtime.accounting import restart_evidence
from runtime.config import TrainConfig
from runtime.evict import (
    await_decision,
    decide_eviction,
    eviction_number,
    next_layout,
    publish_decision,
    remap_faults,
    role_after,
    surviving_ranks,
)
from runtime.launch import run_plan
from simulator.failures.eviction import (
    LOCAL_RESTART_S,
    RestartEvidence,
    eviction_pays,
    predicted_eviction_goodput,
    restart_estimate_s,
    straggler_run_time_s,
)

SLOW = {"step": 3, "ranks": [1], "stragglers": [
    {"rank": 1, "step": 3, "first_step": 1, "score": 0.33, "compute_time_s": 0.3,
     "peers_median_s": 0.1}]}


def event(name: str, attempt: int, t: float, **fields) -> dict:
    return {"event": name, "attempt": attempt, "time_unix_s": t, **fields}


#: A job launched at t = 100 s: its processes were up at 112 s (0.5 s of it the process
#: group, mesh, model and optimizer), it trained steps 1-3 and stopped after step 3 for an
#: eviction, whose checkpoint landed 1.5 s after the step.
EVICTED_JOB = [event("attempt_start", 0, 112.0, build_s=0.5),
               event("resumed", 0, 112.05, from_step=0, source=None),
               event("step", 0, 120.0, step=1), event("step", 0, 125.0, step=2),
               event("step", 0, 130.0, step=3), event("checkpoint", 0, 130.1, step=3),
               event("evict", 0, 131.5, step=3), event("finished", 0, 131.6, step=3)]


@pytest.fixture(scope="module")
def dp4_plan(write_plan, tiny_plan, tiny_model):
    return write_plan("evict-dp4", tiny_plan(dp=4, micro_batch=1), tiny_model(num_layers=2))


class TestSurvivingRanks:
    def test_one_rank_per_node_leaves_only_the_straggler(self):
        assert surviving_ranks(4, [1]) == ([0, 2, 3], [1], 0)

    def test_a_node_of_two_ranks_leaves_with_its_straggler(self):
        assert surviving_ranks(4, [1], ranks_per_node=2) == ([2, 3], [0], 0)

    def test_a_spare_node_takes_the_bad_nodes_place(self):
        assert surviving_ranks(4, [3], ranks_per_node=2, spares=1) == ([0, 1, None, None],
                                                                       [1], 1)

    def test_ranks_per_node_must_divide_the_world(self):
        with pytest.raises(PlanError, match="--ranks-per-node=3 must divide"):
            surviving_ranks(4, [1], ranks_per_node=3)


def test_faults_of_the_evicted_rank_leave_with_it_and_the_rest_are_renumbered():
    # old ranks [0, 2, 3] become new ranks [0, 1, 2]
    assert remap_faults(["slow:rank=1,factor=3", "hang:rank=2,step=9", "nan:step=8"],
                        [0, 2, 3]) == ["hang:rank=1,step=9", "nan:step=8"]


class TestDecision:
    def test_the_new_plan_fits_the_ranks_left_and_keeps_the_global_batch(self, dp4_plan):
        decision, pf = decide_eviction(dp4_plan, SLOW, steps=20, ranks_per_node=2, spares=0)
        assert pf.plan.world_size <= 2 and pf.plan.global_batch == 8
        assert pf.cluster.ranks == pf.plan.world_size
        assert decision.old_plan == "tp1-pp1-dp4-mb1-gb8" and decision.new_plan == pf.plan.id
        assert decision.kept_ranks == [2, 3] and decision.bad_nodes == [0]

    def test_a_spare_keeps_the_plan(self, dp4_plan):
        decision, pf = decide_eviction(dp4_plan, SLOW, steps=20, ranks_per_node=1, spares=1)
        assert pf.plan.id == "tp1-pp1-dp4-mb1-gb8" and decision.spares_used == 1
        # healthy again: the straggler's prediction is never faster than the healthy one
        assert decision.predicted_step_s_after <= decision.predicted_step_s_before


    def test_staying_ranks_predict_their_restart_from_their_own_build(self, dp4_plan):
        # decided at t = 134 s: stop 134 - 130 = 4 s, build 0.5 s, load taken as the
        # checkpoint's write 131.5 - 130 = 1.5 s; 4 + 0.5 + 1.5 = 6 s (hand sum)
        decision, _ = decide_eviction(dp4_plan, SLOW, steps=20, ranks_per_node=1, spares=0,
                                      events=EVICTED_JOB, launched_unix_s=100.0,
                                      clock=lambda: 134.0)
        assert decision.in_place
        assert decision.restart_s == pytest.approx(6.0)
        assert "restart 6.0 s" in decision.reason
        assert decision.restart_basis == ("stop 4.0 + build 0.5 + load 1.5 s, measured by "
                                          "this job")
        # the decision rule is fed the same figure
        assert decision.pays == eviction_pays(
            step_s_staying=decision.predicted_step_s_before,
            step_s_after=decision.predicted_step_s_after, steps_left=17, restart_s=6.0)

    def test_a_relaunch_for_a_spare_predicts_the_jobs_whole_start_up(self, dp4_plan):
        # new processes: stop 4 s + start-up 112 - 100 = 12 s + load 1.5 s = 17.5 s
        decision, _ = decide_eviction(dp4_plan, SLOW, steps=20, ranks_per_node=1, spares=1,
                                      events=EVICTED_JOB, launched_unix_s=100.0,
                                      clock=lambda: 134.0)
        assert not decision.in_place
        assert decision.restart_s == pytest.approx(17.5)

    def test_without_evidence_the_restart_is_the_default(self, dp4_plan):
        decision, _ = decide_eviction(dp4_plan, SLOW, steps=20, ranks_per_node=1, spares=0)
        assert decision.restart_s == LOCAL_RESTART_S == 8.0
        assert decision.restart_basis == "default, nothing measured"


class TestInPlace:
    """The ranks that stay form the smaller group in their own processes."""

    SHRINK = {"in_place": True, "kept_ranks": [0, 2, 3], "new_world": 2}

    def test_the_first_ranks_left_take_the_new_plans_ranks_in_order(self):
        # kept [0, 2, 3] and a 2-rank plan: old rank 0 -> 0, old rank 2 -> 1, old rank 3 leaves
        assert [role_after(self.SHRINK, r) for r in range(4)] == [0, None, 1, None]

    def test_every_rank_leaves_for_a_relaunch_or_an_error(self):
        assert role_after(self.SHRINK | {"in_place": False}, 0) is None
        assert role_after({"error": "nothing is left"}, 0) is None

    def test_a_published_decision_is_what_the_ranks_read(self, tmp_path):
        (tmp_path / "faults").mkdir()
        publish_decision(tmp_path, 2, self.SHRINK)
        assert await_decision(tmp_path, 2, timeout_s=1.0) == self.SHRINK

    def test_a_stop_signal_ends_the_wait(self, tmp_path):
        assert await_decision(tmp_path, 1, stopped=lambda: True, timeout_s=60.0) is None

    def test_a_staying_rank_takes_its_new_role_the_new_plan_and_its_renumbered_faults(
            self, tmp_path, monkeypatch):
        (tmp_path / "faults").mkdir()
        (tmp_path / "faults" / "events.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in EVICTED_JOB))
        publish_decision(tmp_path, 1, self.SHRINK | {"plan_file": "new.yaml",
                                                     "inject": ["kill:rank=1,step=9"]})
        # set through monkeypatch, so that what next_layout rewrites is undone after the test
        for name in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MESHPLAN_LAYOUT"):
            monkeypatch.setenv(name, "0")
        monkeypatch.setenv("RANK", "2")
        monkeypatch.setenv("LOCAL_RANK", "2")
        config = TrainConfig(plan_path="old.yaml", out_dir=str(tmp_path),
                             inject=("slow:rank=1,factor=3", "kill:rank=2,step=9"),
                             on_straggler="evict")
        new = next_layout(config)
        # old rank 2 is new rank 1 of 2, in the rendezvous of the job's first eviction; its
        # device (LOCAL_RANK) is the one it had
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MESHPLAN_LAYOUT"],
                os.environ["LOCAL_RANK"]) == ("1", "2", "1", "2")
        assert new.plan_path == "new.yaml" and new.inject == ("kill:rank=1,step=9",)
        assert new.resume == str(tmp_path / "checkpoints")

    def test_a_rank_beyond_the_new_plan_leaves(self, tmp_path, monkeypatch):
        (tmp_path / "faults").mkdir()
        (tmp_path / "faults" / "events.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in EVICTED_JOB))
        publish_decision(tmp_path, 1, self.SHRINK | {"plan_file": "new.yaml", "inject": []})
        monkeypatch.setenv("RANK", "3")
        config = TrainConfig(plan_path="old.yaml", out_dir=str(tmp_path), on_straggler="evict")
        assert next_layout(config) is None

    def test_evictions_are_numbered_over_the_whole_job(self):
        assert eviction_number(EVICTED_JOB) == 1
        assert eviction_number(EVICTED_JOB + [event("evict", 1, 140.0, step=6)]) == 2


class TestRestartEstimate:
    def test_a_relaunch_repeats_the_stop_the_start_up_and_a_load(self):
        # 4 + 12 + 1.5 = 17.5 s (hand sum)
        assert restart_estimate_s(RestartEvidence(stop_s=4.0, start_up_s=12.0, load_s=1.5))[0] \
            == 17.5

    def test_in_place_the_build_replaces_the_start_up(self):
        # 4 + 0.5 + 1.5 = 6 s (hand sum)
        evidence = RestartEvidence(stop_s=4.0, start_up_s=12.0, build_s=0.5, load_s=1.5)
        assert restart_estimate_s(evidence, in_place=True)[0] == 6.0

    def test_without_a_start_up_the_median_of_measured_restarts(self):
        # sorted [9, 11, 30]: the median is 11
        assert restart_estimate_s(RestartEvidence(restarts_s=[30.0, 9.0, 11.0]))[0] == 11.0

    def test_nothing_measured_is_the_default(self):
        assert restart_estimate_s(RestartEvidence()) == (8.0, "default, nothing measured")

    def test_a_duration_cannot_be_negative(self):
        with pytest.raises(PlanError, match="start_up_s=-1.0 must be >= 0"):
            RestartEvidence(start_up_s=-1.0)


class TestRestartEvidence:
    def test_stop_start_up_and_write_of_an_evicted_job(self):
        e = restart_evidence(EVICTED_JOB, launched_unix_s=100.0, now_unix_s=134.0)
        assert (e.stop_s, e.start_up_s, e.build_s, e.load_s) == pytest.approx(
            (4.0, 12.0, 0.5, 1.5))
        assert e.restarts_s == []

    def test_a_timed_load_replaces_the_write(self):
        # relaunched at t = 190 s from step 3's checkpoint: up at 200 s, loaded by 200.4 s
        job = EVICTED_JOB + [event("attempt_start", 1, 200.0),
                             event("resumed", 1, 200.4, from_step=3, source="ckpt"),
                             event("step", 1, 201.0, step=4), event("step", 1, 202.0, step=5),
                             event("evict", 1, 203.0, step=5)]
        e = restart_evidence(job, launched_unix_s=190.0, now_unix_s=205.0)
        # stop 205 - 202 = 3 s; start-up 200 - 190 = 10 s; load 200.4 - 200 = 0.4 s; the one
        # restart so far: step 3's end (130) to training again (200.4) = 70.4 s
        assert (e.stop_s, e.start_up_s, e.load_s) == pytest.approx((3.0, 10.0, 0.4))
        assert e.restarts_s == pytest.approx([70.4])

    def test_an_unknown_launch_leaves_the_start_up_unmeasured(self):
        e = restart_evidence(EVICTED_JOB, launched_unix_s=None, now_unix_s=134.0)
        assert e.start_up_s is None
        assert restart_estimate_s(e)[0] == LOCAL_RESTART_S


class TestEvictionCost:
    def test_eviction_pays_when_the_steps_left_save_more_than_a_restart(self):
        # 10 steps x (3 - 2) s = 10 s > 5 s; 4 steps x 1 s = 4 s < 5 s (hand calculation)
        assert eviction_pays(step_s_staying=3, step_s_after=2, steps_left=10, restart_s=5)
        assert not eviction_pays(step_s_staying=3, step_s_after=2, steps_left=4, restart_s=5)

    def test_run_time_of_each_policy(self):
        common = {"steps": 10, "step_s": 1.0, "step_s_staying": 3.0, "step_s_after": 2.0,
                  "onset": 2, "window": 3, "restart_s": 5.0}
        # stay: 1 healthy step + 9 slow = 1 + 27; evict: 1 + 3 x 3 + 5 + 6 x 2 = 27
        assert straggler_run_time_s(**common, evict=False) == 28.0
        assert straggler_run_time_s(**common, evict=True) == 27.0
        assert predicted_eviction_goodput(**common) == pytest.approx(22.0 / 27.0)


def global_sample_ids(out) -> list[int]:
    """The job's samples in training order: per step, DP rank 0's, then 1's, ..."""
    lines = [json.loads(x) for path in (out / "consumed").glob("dp*.jsonl")
             for x in path.read_text().splitlines()]
    lines.sort(key=lambda line: (line["step"], line["dp_rank"]))
    return [i for line in lines for i in line["samples"]]


def evicting_run(plan, out, steps: int, **options) -> tuple[dict, dict]:
    """(summary, its one eviction) of a 4-rank job whose rank 1 computes 3x slower."""
    summary = run_plan(plan, steps=steps, out_dir=out, quiet=True, timeout_s=300,
                       inject=["slow:rank=1,factor=3"], on_straggler="evict",
                       straggler_window=3, **options)
    (decision,) = summary["evictions"]
    return summary, decision


@pytest.mark.slow
def test_a_slowed_rank_is_evicted_and_the_job_ends_on_fewer_ranks(dp4_plan, tmp_path):
    out = tmp_path / "job"
    steps = 10
    summary, decision = evicting_run(dp4_plan, out, steps)
    assert [s["rank"] for s in decision["seen"]] == [1]
    assert decision["in_place"]               # the ranks that stayed kept their processes
    assert summary["world_size"] in (2, 3) and summary["plan_id"] == decision["new_plan"]
    # step k trains on samples [8k, 8k + 8) on any layout (runtime.data), so the whole job
    # saw samples 0 .. 79 in order, none lost or repeated
    assert global_sample_ids(out) == list(range(steps * 8))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, steps + 1))
    # the same steps on the new layout, resumed from the same checkpoint in another folder
    at = decision["step"]
    copy = tmp_path / "same-checkpoint"
    shutil.copytree(out / "checkpoints" / f"step{at:08d}", copy / f"step{at:08d}")
    again = run_plan(decision["plan_file"], steps=steps, out_dir=tmp_path / "again",
                     quiet=True, timeout_s=150, resume=copy)
    assert summary["losses"][at:] == again["losses"]


@pytest.mark.slow
def test_a_spare_takes_the_bad_nodes_place_on_new_processes(dp4_plan, tmp_path):
    out = tmp_path / "job"
    steps = 8
    summary, decision = evicting_run(dp4_plan, out, steps, spares=1)
    # the spare needs a process of its own: the job was relaunched on the same 4-rank plan
    assert not decision["in_place"] and decision["spares_used"] == 1
    assert summary["world_size"] == 4 and summary["plan_id"] == decision["old_plan"]
    assert summary["restarts"] == 1
    assert global_sample_ids(out) == list(range(steps * 8))

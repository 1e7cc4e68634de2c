"""Evict and continue: a confirmed straggler's node leaves, the planner re-plans on the ranks
left, and the job resumes from the checkpoint of the confirming step on the new layout."""

from __future__ import annotations

import json
import shutil

import pytest

from planner.spec import PlanError
from runtime.evict import decide_eviction, remap_faults, surviving_ranks
from runtime.launch import run_plan
from simulator.failures.eviction import (
    eviction_pays,
    predicted_eviction_goodput,
    straggler_run_time_s,
)

SLOW = {"step": 3, "ranks": [1], "stragglers": [
    {"rank": 1, "step": 3, "first_step": 1, "score": 0.33, "compute_time_s": 0.3,
     "peers_median_s": 0.1}]}


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
        decision, pf = decide_eviction(dp4_plan, SLOW, steps=20, ranks_per_node=2, spares=0,
                                       restart_s=8.0)
        assert pf.plan.world_size <= 2 and pf.plan.global_batch == 8
        assert pf.cluster.ranks == pf.plan.world_size
        assert decision.old_plan == "tp1-pp1-dp4-mb1-gb8" and decision.new_plan == pf.plan.id
        assert decision.kept_ranks == [2, 3] and decision.bad_nodes == [0]

    def test_a_spare_keeps_the_plan(self, dp4_plan):
        decision, pf = decide_eviction(dp4_plan, SLOW, steps=20, ranks_per_node=1, spares=1,
                                       restart_s=8.0)
        assert pf.plan.id == "tp1-pp1-dp4-mb1-gb8" and decision.spares_used == 1
        # healthy again: the straggler's prediction is never faster than the healthy one
        assert decision.predicted_step_s_after <= decision.predicted_step_s_before


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


@pytest.mark.slow
def test_a_slowed_rank_is_evicted_and_the_job_ends_on_fewer_ranks(dp4_plan, tmp_path):
    out = tmp_path / "job"
    steps = 10
    summary = run_plan(dp4_plan, steps=steps, out_dir=out, quiet=True, timeout_s=300,
                       inject=["slow:rank=1,factor=3"], on_straggler="evict",
                       straggler_window=3)
    (decision,) = summary["evictions"]
    assert [s["rank"] for s in decision["seen"]] == [1]
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

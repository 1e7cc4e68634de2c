"""Expert parallelism trains exactly the single-process tiny-moe: each torchrun launch runs 10
steps and every step's loss and every final parameter match `runtime.reference.reference_run`
(one process, the whole global batch, all experts local) within a relative 1e-4 (fp32), as the
dense plans of test_equivalence do.

ep folds into the data-parallel ranks (dp = ep·edp): ep=2 is dp=2 with both ranks one expert
group (edp=1); ep=2 × dp=2 is dp=4 with two expert groups whose expert gradients are reduced
over edp=2; ep=2 × pp=2 runs two pipeline stages, each with its own ep group. ep=2 and
ep=2 × dp=2 run in the default suite; the others (40-60 s each here) are marked slow.
"""

from __future__ import annotations

import pytest

from planner.presets import load_model
from runtime.reference import reference_run
from tests.runtime.test_equivalence import STEPS, run_and_compare


@pytest.fixture(scope="module")
def moe_model():
    return load_model("tiny-moe")


@pytest.fixture(scope="module")
def moe_reference(moe_model, tiny_plan):
    # the single-process run is the independent reference (every plan below has global batch 8)
    return reference_run(moe_model, tiny_plan(), STEPS)


def test_ep2_matches_single_process(write_plan, tiny_plan, moe_model, moe_reference, tmp_path):
    # a dp=2 plan run with --ep 2 (the plan files below carry ep themselves)
    summary = run_and_compare(write_plan, tmp_path, "moe-ep2", tiny_plan(dp=2), moe_reference,
                              model=moe_model, ep=2)
    assert summary["world_size"] == 2 and summary["ep"] == 2
    assert summary["plan_id"] == "tp1-pp1-dp2-ep2-mb2-gb8"


@pytest.mark.parametrize("name, changes", [
    pytest.param("moe-ep2-dp2", {"dp": 4, "ep": 2, "micro_batch": 1}, id="ep2-edp2"),
    # two stages, each with its own ep group; 1F1B over 4 micro-batches
    pytest.param("moe-ep2-pp2", {"dp": 2, "ep": 2, "pp": 2, "micro_batch": 1,
                                 "schedule": "1f1b"}, id="ep2-pp2", marks=pytest.mark.slow),
])
def test_four_rank_expert_parallel_plans_match_single_process(
        write_plan, tiny_plan, moe_model, moe_reference, tmp_path, name, changes):
    run_and_compare(write_plan, tmp_path, name, tiny_plan(**changes), moe_reference,
                    model=moe_model, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("name, changes", [
    # FSDP2 shards the dense parameters over dp; the experts stay out of it (ignored_params)
    pytest.param("moe-ep2-zero3", {"dp": 2, "ep": 2, "zero_stage": 3}, id="ep2-zero3"),
    # TP shards attention; the MoE blocks stay whole on both TP ranks (ep = 1)
    pytest.param("moe-tp2", {"tp": 2}, id="tp2"),
])
def test_more_moe_plans_match_single_process(write_plan, tiny_plan, moe_model, moe_reference,
                                             tmp_path, name, changes):
    run_and_compare(write_plan, tmp_path, name, tiny_plan(**changes), moe_reference,
                    model=moe_model)


@pytest.mark.slow
def test_deepseek_style_moe_under_ep2_matches_single_process(write_plan, tiny_plan, moe_model,
                                                             tmp_path):
    # sigmoid gates, grouped top-k, a shared expert and a leading dense block (DeepSeek-V3's
    # router and layout) under ep=2
    model = moe_model.replace(router="sigmoid", router_groups=2, router_group_topk=1,
                              num_shared_experts=1, moe_first_dense_layers=1)
    plan = tiny_plan(dp=2, ep=2)
    run_and_compare(write_plan, tmp_path, "moe-deepseek-ep2", plan,
                    reference_run(model, tiny_plan(), STEPS), model=model)

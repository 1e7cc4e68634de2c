"""Expert parallelism trains exactly the single-process tiny-moe: each torchrun launch runs 10
steps and every step's loss and every final parameter match `runtime.reference.reference_run`
(one process, the whole global batch, all experts local) within a relative 1e-4 (fp32), as the
dense plans of test_equivalence do.

ep folds into the data-parallel ranks (dp = ep·edp): ep=2 is dp=2 with both ranks one expert
group (edp=1); ep=2 × dp=2 is dp=4 with two expert groups whose expert gradients are reduced
over edp=2; ep=2 × pp=2 runs two pipeline stages, each with its own ep group. ep=2 and
ep=2 × dp=2 run in the default suite; the others (about 40 s each here) are marked slow.
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
    summary = run_and_compare(write_plan, tmp_path, "moe-ep2", tiny_plan(dp=2), moe_reference,
                              model=moe_model, ep=2)
    assert summary["world_size"] == 2


@pytest.mark.parametrize("name, changes", [
    pytest.param("moe-ep2-dp2", {"dp": 4, "micro_batch": 1}, id="ep2-edp2"),
    # two stages, each with its own ep group; 1F1B over 4 micro-batches
    pytest.param("moe-ep2-pp2", {"dp": 2, "pp": 2, "micro_batch": 1, "schedule": "1f1b"},
                 id="ep2-pp2", marks=pytest.mark.slow),
    # TP shards attention; the MoE blocks stay whole per TP rank, one ep group per TP rank;
    # FSDP2 (TP x DP) reduces the dense parameters and leaves the experts out
    pytest.param("moe-tp2-ep2", {"tp": 2, "dp": 2, "micro_batch": 1}, id="tp2-ep2",
                 marks=pytest.mark.slow),
])
def test_four_rank_expert_parallel_plans_match_single_process(
        write_plan, tiny_plan, moe_model, moe_reference, tmp_path, name, changes):
    run_and_compare(write_plan, tmp_path, name, tiny_plan(**changes), moe_reference,
                    model=moe_model, ep=2, timeout_s=300)


@pytest.mark.slow
def test_ep2_with_zero3_matches_single_process(write_plan, tiny_plan, moe_model,
                                               moe_reference, tmp_path):
    # FSDP2 shards the dense parameters over dp; the experts stay out of it (ignored_params)
    run_and_compare(write_plan, tmp_path, "moe-ep2-zero3", tiny_plan(dp=2, zero_stage=3),
                    moe_reference, model=moe_model, ep=2)

"""An expert-parallel tiny-moe run survives failures like a dense one (test_faults' machinery):
a killed rank restarts from the last DCP checkpoint and ends with the uninterrupted run's
losses, bitwise (CPU, fp32), and an ep=2 checkpoint, its experts sharded over two ranks,
resumes in one process with every expert whole (DCP reshards the expert stacks and their
AdamW state).
"""

from __future__ import annotations

import pytest

from planner.presets import load_model
from runtime.launch import run_plan
from tests.runtime.test_faults import STEPS, launch


@pytest.fixture(scope="module")
def moe_plan_path(write_plan, tiny_plan):
    return write_plan("moe-faults-ep2", tiny_plan(dp=2), load_model("tiny-moe"))


@pytest.fixture(scope="module")
def moe_uninterrupted(moe_plan_path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe-uninterrupted")
    return run_plan(moe_plan_path, steps=STEPS, out_dir=out, quiet=True, timeout_s=180, ep=2)


def test_killed_expert_parallel_rank_resumes_bitwise(moe_plan_path, tmp_path,
                                                     moe_uninterrupted):
    summary = launch(moe_plan_path, tmp_path, inject=["kill:rank=1,step=7"], ep=2,
                     timeout_s=240)
    assert summary["losses"] == moe_uninterrupted["losses"]      # bitwise, step by step
    assert summary["restarts"] == 1 and summary["steps_lost"] == 1
    assert summary["ep"] == 2


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_in_one_process(write_plan, tiny_plan, tmp_path,
                                                           moe_plan_path, moe_uninterrupted):
    # 6 steps at ep=2 (checkpoints at 3 and 6), then steps 7..10 in one process from that
    # checkpoint: the losses are the uninterrupted ep=2 run's, within float rounding (another
    # reduction order), so the resharded experts and optimizer state are the saved ones
    first = launch(moe_plan_path, tmp_path / "first", steps=6, max_restarts=0, ep=2,
                   timeout_s=240)
    single = write_plan("moe-faults-single", tiny_plan(), load_model("tiny-moe"))
    then = launch(single, tmp_path / "then", resume=tmp_path / "first" / "checkpoints",
                  max_restarts=0, timeout_s=240)
    want = moe_uninterrupted["losses"]
    assert first["losses"] == want[:6]
    assert then["losses"] == pytest.approx(want[6:], rel=1e-5)

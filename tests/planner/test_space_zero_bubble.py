"""The zero-bubble schedules in the search space, counted by hand."""

import pytest

from planner.presets import load_model
from planner.space import Rejection, SearchSpace, enumerate_candidates
from planner.spec import Plan, PlanError


def _walk(space, *, devices, global_batch):
    items = list(enumerate_candidates(load_model("tiny-gpt"), space, devices_per_node=8,
                                      global_batch=global_batch, dtype="bf16",
                                      num_devices=devices))
    return ([i for i in items if isinstance(i, Plan)],
            {i.id: i.reason for i in items if isinstance(i, Rejection)})


def test_v_schedules_get_two_chunks_and_dualpipe_v_its_micro_batch_floor():
    # tiny-gpt (4 layers) at tp1-pp2-dp1, gb 4, no recomputation: mb {1, 2, 4} gives m = 4,
    # 2, 1. ZB-V takes any m (3 plans, v = 2); DualPipe-V needs m >= 2·pp = 4: mb 1 only,
    # mb 2 and 4 rejected. pp = 1 runs no zero-bubble plan at all.
    space = SearchSpace(tp=(1,), pp=(1, 2), recompute=("none",), schedule=("zb-v", "dualpipe-v"))
    plans, rejected = _walk(space, devices=2, global_batch=4)
    assert sorted((p.schedule, p.micro_batch, p.virtual_stages) for p in plans) == [
        ("dualpipe-v", 1, 2), ("zb-v", 1, 2), ("zb-v", 2, 2), ("zb-v", 4, 2)]
    assert rejected["tp1-pp2-dp1-mb2-gb4-v2-dualpipe-v"] == (
        "schedule='dualpipe-v' needs at least 2*pp = 4 micro-batches (2 given); raise "
        "global_batch or lower micro_batch")
    assert set(rejected) == {"tp1-pp2-dp1-mb2-gb4-v2-dualpipe-v",
                             "tp1-pp2-dp1-mb4-gb4-v2-dualpipe-v"}


def test_zb_h1_rounds_must_divide_the_micro_batches():
    # pp = 4 (1 layer each), gb 10, mb 1: m = 10, rounds max(1, 10 // 4) = 2 divide 10: legal;
    # mb 2: m = 5, rounds 1: legal; mb 5: m = 2: legal; tiny-gpt on 4 devices, dp = 1.
    # gb 9 mb 1: m = 9, rounds 2 do not divide 9: rejected.
    space = SearchSpace(tp=(1,), pp=(4,), recompute=("none",), schedule=("zb-h1",))
    plans, _ = _walk(space, devices=4, global_batch=10)
    assert sorted(p.num_microbatches for p in plans) == [2, 5, 10]
    _, rejected = _walk(space.replace(micro_batch=(1,)), devices=4, global_batch=9)
    assert rejected["tp1-pp4-dp1-mb1-gb9-v1-zb-h1"].startswith(
        "schedule='zb-h1' needs the micro-batch count (9) to be a multiple of its rounds "
        "max(1, m // pp) = 2")


def test_zb_h2_is_rejected_with_the_reason():
    # simulated only: the runtime has no ZB-H2 schedule class to run it with
    space = SearchSpace(tp=(1,), pp=(2,), recompute=("none",), micro_batch=(1,),
                        schedule=("zb-h2",))
    plans, rejected = _walk(space, devices=2, global_batch=4)
    assert plans == []
    assert rejected["tp1-pp2-dp1-mb1-gb4-v1-zb-h2"].startswith(
        "schedule='zb-h2' is simulated only")


def test_a_fixed_virtual_stages_binds_the_schedules():
    # ZB-V and DualPipe-V run two chunks per rank by definition (Qi et al. 2024 §6): a fix of
    # virtual_stages=1 leaves only the single-chunk schedules, a fix of 2 only the multi-chunk ones
    plans, _ = _walk(SearchSpace(tp=(1,), pp=(2,), virtual_stages=(1,)), devices=2,
                     global_batch=4)
    assert plans and {p.virtual_stages for p in plans} == {1}
    assert not {p.schedule for p in plans} & {"zb-v", "dualpipe-v", "interleaved-1f1b"}
    plans, _ = _walk(SearchSpace(tp=(1,), pp=(2,), virtual_stages=(2,)), devices=2,
                     global_batch=4)
    assert plans and {p.virtual_stages for p in plans} == {2}


def test_a_schedule_and_virtual_stages_that_exclude_each_other_are_refused():
    with pytest.raises(PlanError, match=r"schedule=1f1b and virtual_stages=2 exclude each other"):
        SearchSpace(schedule=("1f1b",), virtual_stages=(2,))
    with pytest.raises(PlanError, match=r"schedule=zb-v and virtual_stages=1"):
        SearchSpace(schedule=("zb-v",), virtual_stages=(1,))
    SearchSpace(schedule=("1f1b", "zb-v"), virtual_stages=(1,))  # 1f1b takes v = 1

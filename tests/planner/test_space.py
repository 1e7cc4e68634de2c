"""Every rejection reason of the search space, on small inputs worked out by hand."""

import pytest

from planner.presets import load_model
from planner.space import Rejection, SearchSpace, enumerate_candidates
from planner.spec import Plan, PlanError


def _walk(model, space, *, devices, global_batch, per_node=8, exact=True):
    items = list(enumerate_candidates(
        model, space, devices_per_node=per_node, global_batch=global_batch, dtype="bf16",
        num_devices=devices if exact else None, max_devices=None if exact else devices))
    plans = [i for i in items if isinstance(i, Plan)]
    rejected = {i.id: i for i in items if isinstance(i, Rejection)}
    return plans, rejected


def test_tp16_does_not_divide_llama2_70b_kv_heads():
    # Llama 2 70B: 64 query heads, 8 KV heads; 64 % 16 == 0 but 8 % 16 == 8.
    model = load_model("llama2-70b")
    plans, rejected = _walk(model, SearchSpace(tp=(16,), pp=(1,)), devices=16,
                            global_batch=16, per_node=16)
    assert plans == []
    assert rejected["tp16-pp1-dp1"].kind == "tp"
    assert rejected["tp16-pp1-dp1"].reason == (
        "tp=16 does not divide num_kv_heads=8; use tp in [1, 2, 4, 8]")


def test_29_layers_do_not_split_over_pp4():
    # 29 / 4 = 7.25 layers per stage, and (29 + 2) / 4 = 7.75 gives no edge split either.
    model = load_model("tiny-gpt").replace(num_layers=29)
    plans, rejected = _walk(model, SearchSpace(pp=(4,), tp=(1,)), devices=20,
                            global_batch=20)
    assert rejected["tp1-pp4-dp5"].reason.startswith(
        "num_layers=29 does not split over pp*virtual_stages = 4*1 = 4")
    assert plans == []


def test_30_layers_on_pp4_take_one_fewer_on_the_edge_stages():
    # 30 / 4 = 7.5, but 30 + 2 = 32 = 4 x 8: the first and last stages hold 7 (Llama 3
    # §3.3.2: 126 layers on 16 stages); 30 / 5 = 6 splits evenly.
    model = load_model("tiny-gpt").replace(num_layers=30)
    plans, _ = _walk(model, SearchSpace(pp=(4, 5), tp=(1,)), devices=20, global_batch=20)
    assert {p.stage_layers for p in plans if p.pp == 4 and p.virtual_stages == 1} == \
        {(7, 8, 8, 7)}
    # interleaved, v=4: 16 chunks of (30 + 2) / 16 = 2, the first and last of 1
    assert {p.stage_layers for p in plans if p.pp == 4 and p.virtual_stages == 4} == \
        {(1,) + (2,) * 14 + (1,)}
    assert {p.stage_layers for p in plans if p.pp == 5} == {None}


def test_layers_do_not_split_over_pp_times_v():
    # pp=5 splits 30 layers (6 each) but v=4 gives 20 chunks: 30 / 20 = 1.5.
    model = load_model("tiny-gpt").replace(num_layers=30)
    space = SearchSpace(tp=(1,), pp=(5,), schedule=("interleaved-1f1b",), virtual_stages=(4,))
    plans, rejected = _walk(model, space, devices=5, global_batch=10)
    assert plans == []
    assert rejected["tp1-pp5-dp1-v4"].reason.startswith(
        "num_layers=30 does not split over pp*virtual_stages = 5*4 = 20")


def test_interleaved_refuses_9_microbatches_on_4_stages():
    # gb=9, dp=1, mb=1: m = 9 micro-batches, 9 % 4 = 1 (Megatron needs m % pp == 0).
    model = load_model("tiny-gpt").replace(num_layers=8)
    space = SearchSpace(tp=(1,), pp=(4,), micro_batch=(1,), schedule=("interleaved-1f1b",),
                        virtual_stages=(2,))
    plans, rejected = _walk(model, space, devices=4, global_batch=9)
    assert plans == []
    assert rejected["tp1-pp4-dp1-mb1-gb9-v2"].reason == (
        "schedule='interleaved-1f1b' needs the micro-batch count (9) to be a multiple of pp=4")
    # With 1F1B the same 9 micro-batches are fine.
    plans, _ = _walk(model, space.replace(schedule=("1f1b",), virtual_stages=(1,)), devices=4,
                     global_batch=9)
    assert plans and all(p.num_microbatches == 9 for p in plans)


def test_global_batch_not_divisible_by_dp_times_micro_batch():
    model = load_model("tiny-gpt")
    # dp=4 does not divide gb=10 at all: one row for the split, with micro_batch 1.
    _, rejected = _walk(model, SearchSpace(tp=(1,), pp=(1,)), devices=4, global_batch=10)
    assert rejected["tp1-pp1-dp4-gb10"].reason.startswith(
        "global_batch=10 is not divisible by dp*micro_batch = 4*1 = 4")
    # dp=4 divides gb=12 (3 each) but micro_batch=2 does not divide 3.
    _, rejected = _walk(model, SearchSpace(tp=(1,), pp=(1,), micro_batch=(2,)), devices=4,
                        global_batch=12)
    assert rejected["tp1-pp1-dp4-mb2-gb12"].reason.startswith(
        "global_batch=12 is not divisible by dp*micro_batch = 4*2 = 8")


def test_fixed_degrees_that_cannot_fill_the_devices():
    model = load_model("tiny-gpt")
    _, rejected = _walk(model, SearchSpace(tp=(3,)), devices=8, global_batch=8)
    assert rejected["tp3"].reason == "tp=3 does not divide num_devices=8"
    _, rejected = _walk(model, SearchSpace(tp=(2,), pp=(1,), dp=(2,)), devices=8,
                        global_batch=8)
    assert rejected["tp2-pp1-dp2"].reason == "tp*pp*dp = 2*1*2 = 4 != num_devices(8)"


def test_default_space_counts_by_hand():
    # tiny-gpt (4 layers, 4 heads) on 2 devices, gb 4, 2 per node. Splits (tp, pp, dp):
    # (1,1,2), (1,2,1), (2,1,1). Micro-batches: divisors of 4/dp up to 8.
    #   (1,1,2): mb {1,2} x recompute 3 x zero 4                           = 24
    #   (1,2,1): mb {1,2,4} x (1f1b + interleaved v=2 + zb-h1 + zb-v) x recompute 3; the
    #            interleaved schedule needs m = 4/mb even: mb {1, 2}; zb-h1's rounds
    #            max(1, m // 2) divide m = 4, 2, 1; zb-v takes any m  = 9 + 6 + 9 + 9 = 33
    #   (2,1,1): mb {1,2,4} x recompute 3 x sp 2                           = 18
    model = load_model("tiny-gpt")
    plans, rejected = _walk(model, SearchSpace(), devices=2, global_batch=4, per_node=2)
    assert len(plans) == 24 + 33 + 18
    assert len({p.id for p in plans}) == len(plans)  # ids are unique
    assert list(rejected) == ["tp1-pp2-dp1-mb4-gb4-v2"]  # m = 1 on 2 stages


def test_at_most_n_devices():
    # max_devices=4: every plan uses <= 4 devices and dp divides the global batch (6).
    model = load_model("tiny-gpt")
    plans, _ = _walk(model, SearchSpace(recompute=("none",)), devices=4, global_batch=6,
                     per_node=4, exact=False)
    worlds = {p.world_size for p in plans}
    assert worlds == {1, 2, 3, 4}
    assert all(6 % p.dp == 0 and p.world_size <= 4 for p in plans)


def test_space_validates_values():
    with pytest.raises(PlanError, match=r"unknown search field\(s\) \['tensor'\]"):
        SearchSpace.from_fixed({"tensor": 2})
    with pytest.raises(PlanError, match="recompute='some' is not one of"):
        SearchSpace(recompute=("some",))
    assert SearchSpace.from_fixed({"tp": 8, "placement": ("tp", "pp", "dp")}).fixed() == {
        "tp": (8,), "placement": (("tp", "pp", "dp"),)}


def test_non_default_placement_is_in_the_plan_id():
    plan = Plan(tp=2, pp=4, dp=8, micro_batch=1, global_batch=512)
    assert plan.id == "tp2-pp4-dp8-mb1-gb512"
    assert plan.replace(placement=("tp", "pp", "dp")).id == "tp2-pp4-dp8-mb1-gb512-place.tp.pp.dp"


def test_a_field_fixed_twice_is_refused_naming_it():
    from apps.plan_options import parse_fixed
    with pytest.raises(PlanError, match=r"--fix tp given twice \(tp=8 and tp=4\); give it once, "
                                        r"e.g. --fix tp=8,4"):
        parse_fixed(["tp=8", "tp=4"])


def test_zero_needs_more_than_one_data_parallel_rank():
    # ZeRO partitions optimizer state, gradients and parameters over the dp ranks (Rajbhandari
    # et al. 2020 §5): with dp = cp = 1 there is nothing to shard over
    with pytest.raises(PlanError, match=r"zero_stage=3 with dp=1: ZeRO shards over the dp\*cp"):
        SearchSpace(zero_stage=(3,), dp=(1,))
    SearchSpace(zero_stage=(3,), dp=(1,), cp=(2,))  # the cp ranks shard it
    plans, rejected = _walk(load_model("tiny-gpt"), SearchSpace(tp=(1,), zero_stage=(3,)),
                            devices=2, global_batch=8)
    assert plans and {p.dp for p in plans} == {2}
    assert rejected["tp1-pp2-dp1-zero3"].reason == (
        "zero_stage=3 shards over dp*cp ranks and tp1-pp2-dp1 has one")

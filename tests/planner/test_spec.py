"""ModelSpec / Plan validation and the FLOPs-per-token formula."""

import pytest

from planner.flops import training_flops_per_token
from planner.presets import load_model, model_names
from planner.spec import ModelSpec, Plan, PlanError, check_plan


def test_presets_load_and_name_their_source():
    for name in model_names():
        model = load_model(name)
        assert model.name == name
        assert model.source


def test_llama3_parameter_counts_match_published_sizes():
    # Published sizes: 8.03B, 70.6B, 405.9B parameters (Llama 3 model cards / Herd paper).
    assert load_model("llama3-8b").num_params() == pytest.approx(8.03e9, rel=2e-3)
    assert load_model("llama3-70b").num_params() == pytest.approx(70.6e9, rel=2e-3)
    assert load_model("llama3-405b").num_params() == pytest.approx(405.9e9, rel=2e-3)


def test_flops_per_token_gpt3_175b_by_hand():
    # Korthikanti et al. 2022 eq. (7) per token: 72·L·h²·(1 + s/(6h) + V/(12·L·h)),
    # L=96, h=12288, s=2048, V=50257 (evaluated here by hand, independent of the code's 6N form).
    L, h, s, V = 96, 12288, 2048, 50257
    expected = 72 * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert training_flops_per_token(load_model("gpt3-175b")) == pytest.approx(expected, rel=1e-12)


def test_flops_per_token_llama3_8b_by_hand():
    # PaLM appendix B: 6N + 12·L·H·Q·T, N = matmul parameters. By hand for Llama 3 8B:
    # per layer q,o: 2·4096² ; k,v: 2·4096·1024 ; SwiGLU: 3·4096·14336 ; plus the output head
    # 4096·128256. L=32, H=32, Q=128, T=8192.
    per_layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    n = 32 * per_layer + 4096 * 128256
    expected = 6 * n + 12 * 32 * 32 * 128 * 8192
    assert expected == 57_912_852_480  # the same arithmetic, written out
    assert training_flops_per_token(load_model("llama3-8b")) == expected


def test_tp_must_divide_heads():
    model = load_model("llama3-70b")  # 64 heads, 8 KV heads
    plan = Plan(tp=16, pp=1, dp=1, micro_batch=1, global_batch=1)
    with pytest.raises(PlanError, match=r"tp=16 does not divide num_kv_heads=8; use tp in \[1, 2, 4, 8\]"):
        check_plan(model, plan)


def test_layers_must_split_over_pp():
    model = load_model("tiny-gpt").replace(num_layers=30)
    with pytest.raises(PlanError, match="num_layers=30 does not split over pp\\*virtual_stages = 4\\*1 = 4"):
        Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=4).layers_per_stage(model)
    split = Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=4, stage_layers=(8, 8, 7, 7))
    assert split.layers_per_stage(model) == (8, 8, 7, 7)
    with pytest.raises(PlanError, match="sums to 29, not num_layers=30"):
        split.replace(stage_layers=(8, 7, 7, 7)).layers_per_stage(model)


def test_global_batch_divisible_by_dp_times_micro_batch():
    with pytest.raises(PlanError, match=r"global_batch=10 is not divisible by dp\*micro_batch = 4\*2 = 8"):
        Plan(tp=1, pp=1, dp=4, micro_batch=2, global_batch=10)


def test_bad_enum_names_the_choices():
    with pytest.raises(PlanError, match=r"schedule='zigzag' is not one of \['gpipe', '1f1b', 'interleaved-1f1b', "
                                    r"'zb-h1', 'interleaved-zb', 'zb-v', 'dualpipe-v', 'zb-h2'\]"):
        Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1, schedule="zigzag")
    with pytest.raises(PlanError, match="activation='relu'"):
        load_model("tiny-gpt").replace(activation="relu")


def test_non_positive_degree_rejected():
    with pytest.raises(PlanError, match="tp=0 must be a positive integer"):
        Plan(tp=0, pp=1, dp=1, micro_batch=1, global_batch=1)


def test_world_size_mismatch_shows_the_arithmetic():
    plan = Plan(tp=2, pp=4, dp=2, micro_batch=1, global_batch=8)
    with pytest.raises(PlanError, match=r"tp\*pp\*dp = 2\*4\*2 = 16 != world_size\(8\)"):
        check_plan(load_model("llama3-8b"), plan, world_size=8)


def test_interleaved_needs_microbatches_multiple_of_pp():
    # 4 stages, 9 micro-batches: Megatron's interleaved schedule needs m % pp == 0.
    with pytest.raises(PlanError, match=r"micro-batch count \(9\) to be a multiple of pp=4"):
        Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=9, schedule="interleaved-1f1b",
             virtual_stages=2)


def test_plan_id_is_canonical():
    plan = Plan(tp=2, pp=4, dp=8, micro_batch=1, global_batch=512)
    assert plan.id == "tp2-pp4-dp8-mb1-gb512"
    assert plan.num_microbatches == 64


def test_head_dim_must_divide():
    with pytest.raises(PlanError, match="hidden=100 is not divisible by num_heads=3"):
        ModelSpec(name="x", num_layers=1, hidden=100, num_heads=3, num_kv_heads=3,
                  ffn_hidden=400, vocab_size=10, seq_len=8, activation="gelu")


@pytest.mark.parametrize("value", ["false", "nope", 2, 0, None])
def test_boolean_fields_of_model_plan_and_cluster_files_take_only_booleans(value):
    # YAML reads unquoted true/false as booleans; anything else ("false" quoted, 2) would be
    # truthy or falsy by accident
    from planner.planfile import plan_from_dict
    from planner.presets import model_from_dict
    from simulator.network.cluster import cluster_from_spec
    fields = dict(num_layers=2, hidden=64, num_heads=4, num_kv_heads=4, ffn_hidden=256,
                  vocab_size=128, seq_len=16, activation="gelu", norm="layernorm")
    with pytest.raises(PlanError, match=rf"tied_embeddings={value!r} must be a boolean"):
        model_from_dict({**fields, "tied_embeddings": value})
    with pytest.raises(PlanError, match=rf"sequence_parallel={value!r} must be a boolean"):
        plan_from_dict({"tp": 2, "pp": 1, "dp": 1, "micro_batch": 1, "global_batch": 1,
                        "sequence_parallel": value})
    with pytest.raises(PlanError, match=rf"'c': intra.in_switch_reduction={value!r} must be"):
        cluster_from_spec("c", {"kind": "gpu", "node_type": "dgx-h100", "nodes": 1,
                                "fabric": {"switch_radix": 64},
                                "intra": {"in_switch_reduction": value}})
    assert model_from_dict({**fields, "tied_embeddings": False}).tied_embeddings is False


def test_a_misspelt_model_field_gets_a_suggestion_like_a_cluster_key(tmp_path):
    # the user's Llama-style file with num_kv_head for num_kv_heads
    path = tmp_path / "m.yaml"
    path.write_text("num_layers: 2\nhidden: 64\nnum_heads: 4\nnum_kv_head: 2\nffn_hidden: 256\n"
                    "vocab_size: 128\nseq_len: 16\nactivation: gelu\nnorm: layernorm\n")
    with pytest.raises(PlanError, match=r"unknown model field\(s\) \['num_kv_head'\] \(did you "
                                        r"mean 'num_kv_heads'\?\); known fields are \["):
        load_model(str(path))
    from planner.planfile import plan_from_dict
    with pytest.raises(PlanError, match=r"\['zero_stages'\] \(did you mean 'zero_stage'\?\)"):
        plan_from_dict({"tp": 1, "pp": 1, "dp": 1, "micro_batch": 1, "global_batch": 1,
                        "zero_stages": 1})


def test_cached_choices_and_bool_fields_equal_the_uncached_ones():
    # two Literals and two dataclasses, each asked twice (the second from the cache)
    import dataclasses
    from typing import get_args

    from planner.spec import Dtype, ModelSpec, Plan, Schedule, _bool_fields, _choices
    for _ in range(2):
        assert _choices(Schedule) == get_args(Schedule)
        assert _choices(Dtype) == get_args(Dtype)
        for cls in (Plan, ModelSpec):
            assert _bool_fields(cls) == tuple(f.name for f in dataclasses.fields(cls)
                                              if f.type == "bool")
    assert _choices(Schedule) != _choices(Dtype) and "sequence_parallel" in _bool_fields(Plan)

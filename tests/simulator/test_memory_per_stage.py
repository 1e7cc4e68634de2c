"""Memory per stage against hand-worked examples (Korthikanti et al. 2022; ZeRO)."""

import pytest

from planner.presets import load_model
from planner.spec import Plan
from simulator.step.memory import layer_activation_bytes, memory_per_stage

GPT3 = load_model("gpt3-175b")  # s=2048, h=12288, a=96, f=4h (Brown et al. 2020)


def plan(**kw):
    base = dict(tp=1, pp=1, dp=1, micro_batch=1, global_batch=8)
    return Plan(**{**base, **kw})


def test_gpt3_layer_activations_without_tp():
    # Korthikanti et al. 2022, eq. 1: 34·s·b·h + 5·a·s²·b with s=2048, b=1, h=12288, a=96:
    # 34·2048·12288 = 855,638,016 and 5·96·2048² = 2,013,265,920 -> 2,868,903,936 bytes.
    assert layer_activation_bytes(GPT3, plan()) == 2_868_903_936


def test_gpt3_layer_activations_with_tp8():
    # Table 2, TP: s·b·h·(10 + 24/8) + 5·a·s²·b/8 = 327,155,712 + 251,658,240 = 578,813,952.
    assert layer_activation_bytes(GPT3, plan(tp=8)) == pytest.approx(578_813_952)


def test_gpt3_layer_activations_with_sp_and_selective_recompute():
    # Table 2, TP + SP + selective: 34·s·b·h/8 = 106,954,752.
    p = plan(tp=8, sequence_parallel=True, recompute="selective")
    assert layer_activation_bytes(GPT3, p) == pytest.approx(106_954_752)


def test_full_recompute_keeps_only_the_layer_input():
    # Table 2, full recomputation: 2·s·b·h = 50,331,648.
    assert layer_activation_bytes(GPT3, plan(recompute="full")) == 50_331_648


def test_fused_attention_stores_no_score_matrix():
    # FlashAttention keeps the output and an fp32 log-sum-exp per query row (Dao et al. 2022,
    # §3.1), not the 5·a·s²·b scores: 34·s·b·h + 4·a·s·b = 855,638,016 + 786,432 bytes.
    assert layer_activation_bytes(GPT3, plan(), "flash") == 855_638_016 + 786_432
    # Selective recomputation has nothing left to drop; full keeps the layer input only.
    assert layer_activation_bytes(GPT3, plan(recompute="selective"), "flash") == \
        855_638_016 + 786_432
    assert layer_activation_bytes(GPT3, plan(recompute="full"), "flash") == 50_331_648


def test_fp32_doubles_activation_bytes():
    assert layer_activation_bytes(GPT3, plan(dtype="fp32")) == 2 * 2_868_903_936


def test_weights_grads_and_adam_states_follow_zero_paper():
    # ZeRO §3.1: 2 + 2 + 12 bytes/param in mixed precision; ZeRO-1 shards the 12 over dp,
    # ZeRO-3 all three. pp=1, tp=1, tied: the stage holds every parameter once.
    n = GPT3.num_params()
    (full,) = memory_per_stage(GPT3, plan())
    assert (full.weights_bytes, full.gradients_bytes, full.optimizer_bytes) == (2 * n, 2 * n,
                                                                                12 * n)
    (z1,) = memory_per_stage(GPT3, plan(dp=8, global_batch=8, zero_stage=1))
    assert z1.optimizer_bytes == pytest.approx(12 * n / 8) and z1.gradients_bytes == 2 * n
    # ZeRO-3 also holds two blocks' gathered bf16 weights (the computing one and the
    # prefetched next): a GPT-3 block is 12h² + 4h = 1,811,988,480 parameters (h = 12288;
    # bias-free linears, two LayerNorms) -> 2 x 2 bytes x that = 7,247,953,920 bytes.
    (z3,) = memory_per_stage(GPT3, plan(dp=8, global_batch=8, zero_stage=3))
    assert z3.total_bytes - z3.activations_bytes == pytest.approx(16 * n / 8 + 7_247_953_920)


def test_1f1b_first_stage_holds_pp_microbatches():
    # Narayanan et al. 2021 §2.2: under 1F1B stage i keeps min(pp - i, m) micro-batches; GPipe m.
    tiny = load_model("tiny-gpt")
    p = plan(pp=4, global_batch=16, dtype="fp32")
    per_layer = layer_activation_bytes(tiny, p)
    stages = memory_per_stage(tiny, p)
    # Stage 1 (1 layer, no embedding or logits) holds pp - 1 = 3 micro-batches.
    assert stages[1].activations_bytes == pytest.approx(3 * per_layer)
    assert stages[2].activations_bytes == pytest.approx(2 * per_layer)
    gpipe = memory_per_stage(tiny, p.replace(schedule="gpipe"))
    assert gpipe[1].activations_bytes == pytest.approx(16 * per_layer)
    assert stages[0].to_dict()["total_bytes"] == stages[0].total_bytes


def test_interleaved_first_rank_holds_pp_times_one_plus_one_over_v():
    # Megatron-LM interleaved warm-up: rank 0 holds 2(pp-1) + (v-1)pp + 1 chunk micro-batches,
    # each 1/v of the stage: pp=4, v=2 -> (6 + 4 + 1)/2 = 5.5 stage micro-batches.
    from simulator.step.memory import microbatches_in_flight
    p = plan(pp=4, global_batch=16, schedule="interleaved-1f1b", virtual_stages=2)
    assert microbatches_in_flight(p, 0) == 5.5
    assert microbatches_in_flight(p, 3) == (0 + 4 + 1) / 2


def test_nvfp4_keeps_bf16_weights_beside_its_casts():
    # Megatron-Bridge's FP8 / MXFP8 recipes hold the linear weights as their casts
    # (--fp8-param-gather); its NVFP4 recipe (bf16_with_nvfp4_mixed, fp8_param_gather=False)
    # keeps them in bf16 and caches the casts beside them. On Blackwell (block-scaled) a cast
    # is two copies (row- and column-wise scales): MXFP8 2 x (1 + 1/32) = 2.0625 B a weight,
    # NVFP4 2 x (0.5 + 1/16) = 1.125 B. Against bf16 (2 B): MXFP8 holds 2.0625 instead of 2,
    # +0.0625 B; NVFP4 holds 2 + 1.125, +1.125 B, per linear parameter.
    m = load_model("llama3-8b")
    linear = 32 * m.layer_matmul_params()  # QKV, output, MLP up / down of the 32 blocks

    def weights(dtype):
        return memory_per_stage(m, plan(dtype=dtype), block_scaled=True)[0].weights_bytes

    assert weights("mxfp8") - weights("bf16") == pytest.approx(linear * 0.0625, rel=1e-9)
    assert weights("nvfp4") - weights("bf16") == pytest.approx(linear * 1.125, rel=1e-9)

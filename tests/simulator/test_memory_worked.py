"""Activation memory against worked examples computed by hand (Korthikanti et al. 2022,
Table 2, generalised to GQA and SwiGLU as `layer_activation_bytes` documents)."""

import pytest

from planner.presets import load_model
from planner.spec import Plan
from simulator.step.memory import layer_activation_bytes, memory_per_stage

LLAMA8B = load_model("llama3-8b")  # s=8192, h=4096, kv=8 heads of 128 -> k=1024, f=14336


def test_llama3_8b_layer_with_tp8_sp_and_selective_recompute():
    # Per token: attention 7h + 4k = 28,672 + 4,096; SwiGLU MLP 3h + 6f = 12,288 + 86,016;
    # norms 4h = 16,384 -> 147,456; SP shards all of it over tp=8 -> 18,432 bytes/token;
    # x s·b = 8192 -> 150,994,944 bytes (selective drops the 5·a·s²·b scores).
    plan = Plan(tp=8, pp=1, dp=1, micro_batch=1, global_batch=1, sequence_parallel=True,
                recompute="selective")
    assert layer_activation_bytes(LLAMA8B, plan) == pytest.approx(150_994_944)


def test_llama3_8b_layer_with_tp8_no_sp_no_recompute():
    # Replicated 10h = 40,960 + the rest (147,456 - 40,960)/8 = 13,312 -> 54,272 per token
    # -> x 8192 = 444,596,224; scores 5·a·s²·b/tp = 5·32·8192²/8 = 1,342,177,280.
    plan = Plan(tp=8, pp=1, dp=1, micro_batch=1, global_batch=1)
    assert layer_activation_bytes(LLAMA8B, plan) == pytest.approx(444_596_224 + 1_342_177_280)


def test_first_1f1b_stage_holds_pp_micro_batches_of_full_recompute_inputs():
    # Full recomputation keeps 2·s·b·h per layer (with SP: / tp): 2·8192·4096/8 = 8,388,608;
    # stage 0 of pp=4 holds 4 micro-batches of its 8 layers plus the embedding output.
    plan = Plan(tp=8, pp=4, dp=1, micro_batch=1, global_batch=8, sequence_parallel=True,
                recompute="full")
    stage0 = memory_per_stage(LLAMA8B, plan)[0]
    per_mb = 8 * 8_388_608 + 2 * 8192 * 4096
    assert stage0.activations_bytes == pytest.approx(4 * per_mb)


def test_dense_zero3_holds_two_gathered_blocks_beside_its_shard():
    # Llama 3 8B block: attention 4096·(4096 + 2·1024 + 4096) = 41,943,040, SwiGLU MLP
    # 3·4096·14336 = 176,160,768, two RMSNorm weights 8,192 -> 218,112,000 parameters. FSDP
    # holds the computing block and the prefetched next one unsharded: 2 x 218,112,000 / tp 2
    # x 2 bytes = 436,224,000 bytes more weight memory than the ZeRO-3 shard alone; with
    # dp = 1 nothing is gathered.
    sharded = Plan(tp=2, pp=1, dp=8, micro_batch=1, global_batch=8, zero_stage=3)
    z1 = sharded.replace(zero_stage=2)
    w3 = memory_per_stage(LLAMA8B, sharded)[0].weights_bytes
    w2 = memory_per_stage(LLAMA8B, z1)[0].weights_bytes
    assert w3 - w2 / 8 == pytest.approx(436_224_000)
    alone = Plan(tp=2, pp=1, dp=1, micro_batch=1, global_batch=1, zero_stage=3)
    assert memory_per_stage(LLAMA8B, alone)[0].weights_bytes == \
        pytest.approx(memory_per_stage(LLAMA8B, alone.replace(zero_stage=0))[0].weights_bytes)

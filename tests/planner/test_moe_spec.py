"""Mixture-of-experts and MLA fields of ModelSpec: parameter counts and FLOPs per token."""

import pytest

from planner.flops import attention_flops_per_token, matmul_params, training_flops_per_token
from planner.presets import load_model, model_from_dict
from planner.spec import ModelSpec, PlanError


def test_mixtral_8x7b_total_and_active_params():
    # Hand count (Jiang et al. 2024, Table 1 shapes). Per block: attention
    # 4096*(4096+2*1024) + 4096^2 = 41,943,040; one SwiGLU expert 3*4096*14336 = 176,160,768;
    # router 4096*8 = 32,768; two RMSNorms 8,192. Embedding and untied output 2*32000*4096.
    attn, expert, router, norms = 41_943_040, 176_160_768, 32_768, 8_192
    emb, final = 2 * 32000 * 4096, 4096
    m = load_model("mixtral-8x7b")
    assert m.num_params() == 32 * (attn + 8 * expert + router + norms) + emb + final
    assert m.active_params() == 32 * (attn + 2 * expert + router + norms) + emb + final
    # The paper's own rounding: 46.7B total, 12.9B active.
    assert m.num_params() / 1e9 == pytest.approx(46.7, abs=0.05)
    assert m.active_params() / 1e9 == pytest.approx(12.9, abs=0.05)


def test_deepseek_v3_total_and_active_params():
    # DeepSeek-V3 report §4.2: 671B total, 37B active (MTP module excluded).
    m = load_model("deepseek-v3")
    assert m.num_moe_layers == 58
    # MLA per block by hand (DeepSeek-V2 §2.1): W_DQ 7168*1536 + W_UQ 1536*128*192
    # + W_DKV/W_KR 7168*576 + W_UK/W_UV 512*128*256 + W_O 128*128*7168.
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert m.attention_matmul_params() == mla
    assert m.num_params() / 1e9 == pytest.approx(671, abs=1)
    assert m.active_params() / 1e9 == pytest.approx(37, abs=1)


@pytest.mark.parametrize(("name", "total_b", "active_b", "tol"), [
    ("mixtral-8x22b", 141, 39, 1),      # Mistral release: 141B total, 39B active
    ("qwen3-30b-a3b", 30.5, 3.3, 0.1),    # Qwen3 report Table 2
    ("qwen3-235b-a22b", 235, 22, 0.5),   # Qwen3 report Table 2
    ("llama4-scout", 108, 17, 1),        # 17B active; 109B release figure includes vision
])
def test_preset_param_counts_match_publications(name, total_b, active_b, tol):
    m = load_model(name)
    assert m.num_params() / 1e9 == pytest.approx(total_b, abs=tol)
    assert m.active_params() / 1e9 == pytest.approx(active_b, abs=tol)


def test_gpt_oss_active_params_without_embeddings():
    # Model card Table 1: 116.83B total, 5.13B active counting the unembedding but not the
    # input embedding.
    m = load_model("gpt-oss-120b")
    assert m.num_params() / 1e9 == pytest.approx(116.83, abs=0.05)
    assert (m.active_params() - m.embedding_params()) / 1e9 == pytest.approx(5.13, abs=0.02)


def test_moe_flops_count_active_experts_and_router():
    # Megatron-Core convention: 6 * (active matrices) per token + attention.
    m = load_model("mixtral-8x7b")
    per_block = 41_943_040 + 2 * 176_160_768 + 32_768
    assert matmul_params(m) == 32 * per_block + 32000 * 4096
    assert training_flops_per_token(m) == 6.0 * matmul_params(m) + 12.0 * 32 * 32 * 128 * 4096


def test_mla_attention_flops_use_qk_and_v_widths():
    # Score GEMM on 128+64, value GEMM on 128: 6*L*H*(192+128)*T.
    m = load_model("deepseek-v3")
    assert attention_flops_per_token(m) == 6.0 * 61 * 128 * (192 + 128) * 4096


def test_dense_models_unchanged():
    # The MoE fields default to a dense model: Llama 3 8B stays 8.03B parameters.
    m = load_model("llama3-8b")
    assert not m.is_moe and m.num_params() == m.active_params()
    assert m.num_params() == 8_030_261_248


def test_moe_layer_pattern_first_dense_then_every_nth():
    m = load_model("tiny-moe").replace(moe_first_dense_layers=1, moe_layer_freq=2)
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize(("changes", "field"), [
    ({"experts_per_token": 5}, "experts_per_token"),
    ({"experts_per_token": 0}, "experts_per_token"),
    ({"router": "relu"}, "router"),
    ({"capacity_factor": 0.0}, "capacity_factor"),
    ({"moe_first_dense_layers": 4}, "moe_first_dense_layers"),
    ({"router_groups": 3}, "router_groups"),
])
def test_bad_moe_fields_name_the_field(changes, field):
    with pytest.raises(PlanError, match=field):
        load_model("tiny-moe").replace(**changes)


def test_experts_fields_need_num_experts():
    with pytest.raises(PlanError, match="num_experts"):
        load_model("tiny-gpt").replace(experts_per_token=2)


def test_model_file_accepts_moe_fields():
    m = model_from_dict({"num_layers": 2, "hidden": 64, "num_heads": 4, "num_kv_heads": 4,
                         "ffn_hidden": 128, "vocab_size": 256, "seq_len": 32,
                         "activation": "swiglu", "num_experts": 4, "experts_per_token": 1})
    assert isinstance(m, ModelSpec) and m.num_moe_layers == 2

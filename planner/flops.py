"""The FLOP count of training, in one place: model FLOPs per token (for MFU) and the
recomputation FLOPs the hardware runs on top (for HFU).

MFU counts model FLOPs only, 6·N per token plus attention (PaLM, Chowdhery et al. 2022,
appendix B; Megatron, Narayanan et al. 2021, eq. 3); HFU adds what recomputation repeats
(Korthikanti et al. 2022, §5 and eq. 7). The simulator's predictions and the runtime's
measurements both report MFU and HFU with `mfu` and `hfu`, so the two compare.
"""

from __future__ import annotations

from functools import lru_cache

from planner.spec import ModelSpec, Plan


def matmul_params(model: ModelSpec) -> int:
    """Parameters that take part in a matrix multiply for every token.

    Every block matrix and the output projection (a (h, V) GEMM even when tied); the input
    embedding is a table lookup and norms are elementwise, so neither counts. For a
    mixture-of-experts model only the *active* matrices count: per MoE block the top-k routed
    experts, the shared experts and the router (h·E), the convention of Megatron-Core's
    ``num_floating_point_operations`` (megatron/training/training.py: the MLP term uses
    ``moe_ffn_hidden_size · moe_router_topk`` plus the shared-expert width, and the router
    logits ``hidden · num_experts``), which is 6·N_active per token.
    """
    if model.is_moe:
        return _moe_matmul_params(model)
    return model.num_layers * model.layer_matmul_params() + model.vocab_size * model.hidden


@lru_cache(maxsize=256)
def _moe_matmul_params(model: ModelSpec) -> int:
    # Cached per model: MFU and HFU ask for it once per estimated plan, and an MoE model's
    # blocks differ (dense first blocks), so it is a sum over all of them.
    return sum(model.block_params(i, active=True, matmul_only=True)
               for i in range(model.num_layers)) + model.vocab_size * model.hidden


def training_flops_per_token(model: ModelSpec, seq_len: int | None = None) -> float:
    """Model FLOPs to train on one token (forward + backward, no recomputation).

    ``6·N + 12·L·H·Q·T`` from PaLM (Chowdhery et al. 2022, appendix B), where N counts the
    parameters used in matrix multiplies (`matmul_params`), L layers, H heads, Q head dim and T the
    sequence length. The attention term counts the full (non-causal) score matrix, as PaLM and
    Megatron (Narayanan et al. 2021, eq. 3) do, so MFU figures compare with theirs. For a GPT-3
    style model this equals Korthikanti et al. 2022 eq. (7): 72·L·h²·(1 + s/6h + V/12Lh) per
    token.

    Args:
        model: the model.
        seq_len: tokens per sequence; defaults to ``model.seq_len``.
    Returns:
        FLOPs per token (float).
    """
    return 6.0 * matmul_params(model) + attention_flops_per_token(model, seq_len)


def attention_flops_per_token(model: ModelSpec, seq_len: int | None = None) -> float:
    """The attention term of `training_flops_per_token`: ``12·L·H·Q·T`` (PaLM appendix B),
    the full (non-causal) score matrix, forward and backward.

    With multi-head latent attention the score GEMM runs on the q/k width (head_dim +
    qk_rope_head_dim) and the value GEMM on v_head_dim, so the term is
    ``6·L·H·(d_qk + d_v)·T``, which is 12·L·H·Q·T when both widths equal Q (Megatron-Core's
    MLA branch of ``num_floating_point_operations`` counts the same two GEMMs).
    """
    t = model.seq_len if seq_len is None else seq_len
    if model.is_mla:
        d_qk = model.head_dim + model.qk_rope_head_dim
        d_v = model.v_head_dim or model.head_dim
        return 6.0 * model.num_layers * model.num_heads * (d_qk + d_v) * t
    return 12.0 * model.num_layers * model.num_heads * model.head_dim * t


def recompute_flops_per_token(model: ModelSpec, plan: Plan) -> float:
    """Extra FLOPs per token that recomputation adds (for HFU): full = the blocks' forward
    (2·P_blocks + 4·L·s·h; with ``recompute_num_layers`` the share of blocks it repeats,
    `planner.spec.Plan.full_recompute_share`); selective = the attention core (4·L·s·h) (Korthikanti et al. 2022,
    §5)."""
    attn_core = 4.0 * model.num_layers * model.seq_len * model.hidden
    if plan.recompute == "full":
        # the block method repeats the first N blocks of each chunk only
        return plan.model_full_recompute_share(model) * (2.0 * model.num_layers * model.layer_matmul_params() + attn_core)
    return attn_core if plan.recompute == "selective" else 0.0


def mfu(model: ModelSpec, tokens_per_s: float, num_devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``training_flops_per_token · tokens/s / (devices · peak)``.

    >>> from planner.presets import load_model
    >>> m = load_model("gpt3-175b")
    >>> round(mfu(m, tokens_per_s=1e6 / training_flops_per_token(m), num_devices=1,
    ...           peak_flops=2e6), 6)
    0.5
    """
    return training_flops_per_token(model) * tokens_per_s / (num_devices * peak_flops)


def hfu(model: ModelSpec, plan: Plan, tokens_per_s: float, num_devices: int,
        peak_flops: float) -> float:
    """Hardware FLOPs utilisation: `mfu` with `recompute_flops_per_token` added."""
    flops = training_flops_per_token(model) + recompute_flops_per_token(model, plan)
    return flops * tokens_per_s / (num_devices * peak_flops)

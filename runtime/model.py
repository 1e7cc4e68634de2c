"""The decoder-only transformer that the runtime trains, built from a `ModelSpec`.

Module names follow torchtitan's Llama so the parallel plans read the same: ``tok`` (token
embedding), ``pos`` (learned absolute positions), ``layers`` (an ``nn.ModuleDict`` keyed
"0".."L-1", so a pipeline stage deletes the layers it does not own), ``norm`` and ``out``. A
pipeline stage sets ``tok``/``pos`` (first stage only) and ``norm``/``out`` (last stage only) to
None; `Transformer.forward` skips whatever is None.

Shapes: B sequences, T tokens, h hidden, a query heads, k key/value heads, d head dim, V vocab.
Under tensor parallelism the attention sees only its local heads (a/tp, k/tp), which the
``view(b, t, -1, d)`` reshapes pick up.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.spec import ModelSpec
from runtime.attention import flash_attention
from runtime.moe import MoE
from runtime.ring_attention import ring_attention

#: Standard deviation of the normal init of matrices and embeddings (GPT-2).
INIT_STD = 0.02
#: Parameter name endings of the residual output projections (scaled init).
_RESIDUAL_OUTPUTS = ("wo.weight", "w2.weight", "experts.w2")


def _norm(spec: ModelSpec) -> nn.Module:
    """LayerNorm (weight and bias) or RMSNorm (weight), as the spec says."""
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden, eps=1e-5)
    return nn.LayerNorm(spec.hidden, eps=1e-5)


#: Attention implementations: PyTorch's fused SDPA (the default fast path on CPU) or our tiled
#: FlashAttention-2 kernel (`runtime.attention`; its Triton kernel on CUDA).
ATTENTION_IMPLS = ("sdpa", "tiled")


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query KV heads.

    Args:
        spec: the model.
        impl: "sdpa" (``F.scaled_dot_product_attention``; KV heads repeated to match the query
            heads) or "tiled" (`runtime.attention.flash_attention`, which reads the shared KV
            heads directly).

    ``cp_group`` (set by `runtime.parallel.cp.apply_cp`): under context parallelism the tokens
    are this rank's load-balanced share of the sequence and attention is the ring over that
    group (`runtime.ring_attention`, our FlashAttention-2 tiles whatever ``impl`` says).
    """

    def __init__(self, spec: ModelSpec, impl: str = "sdpa") -> None:
        super().__init__()
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention={impl!r} is not one of {list(ATTENTION_IMPLS)}")
        self.impl = impl
        self.head_dim = spec.head_dim
        self.wq = nn.Linear(spec.hidden, spec.hidden, bias=False)
        self.wk = nn.Linear(spec.hidden, spec.kv_hidden, bias=False)
        self.wv = nn.Linear(spec.hidden, spec.kv_hidden, bias=False)
        self.wo = nn.Linear(spec.hidden, spec.hidden, bias=False)
        self.cp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h); T is the local T/cp tokens under context parallelism."""
        b, t, _ = x.shape
        d = self.head_dim
        q = self.wq(x).view(b, t, -1, d).transpose(1, 2)     # (B, a, T, d)
        k = self.wk(x).view(b, t, -1, d).transpose(1, 2)     # (B, k, T, d)
        v = self.wv(x).view(b, t, -1, d).transpose(1, 2)     # (B, k, T, d)
        if self.cp_group is not None:
            o = ring_attention(q, k, v, self.cp_group)        # (B, a, T, d)
        elif self.impl == "tiled":
            o = flash_attention(q, k, v, causal=True)         # (B, a, T, d)
        else:
            groups = q.shape[1] // k.shape[1]
            if groups > 1:                                    # GQA: repeat each KV head
                k = k.repeat_interleave(groups, dim=1)        # (B, a, T, d)
                v = v.repeat_interleave(groups, dim=1)        # (B, a, T, d)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (B, a, T, d)
        o = o.transpose(1, 2).reshape(b, t, -1)               # (B, T, a·d)
        return self.wo(o)                                     # (B, T, h)


class MLP(nn.Module):
    """GeLU MLP (``w2(gelu(w1 x))``) or SwiGLU (``w2(silu(w1 x) * w3 x)``), of inner width
    ``width`` (default ``spec.ffn_hidden``; the shared experts of an MoE block use their own)."""

    def __init__(self, spec: ModelSpec, width: int | None = None) -> None:
        super().__init__()
        width = width or spec.ffn_hidden
        self.swiglu = spec.activation == "swiglu"
        self.w1 = nn.Linear(spec.hidden, width, bias=False)
        self.w2 = nn.Linear(width, spec.hidden, bias=False)
        self.w3 = nn.Linear(spec.hidden, width, bias=False) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h); the inner width is ffn_hidden (or ffn_hidden/tp under TP)."""
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))   # (B, T, h)
        return self.w2(F.gelu(self.w1(x)))                    # (B, T, h)


def _mlp(spec: ModelSpec, index: int) -> nn.Module:
    """Block ``index``'s MLP: a mixture of experts (`runtime.moe.MoE`, with its shared experts
    as one `MLP`) where ``spec.is_moe_layer(index)``, else the dense `MLP`."""
    if not spec.is_moe_layer(index):
        return MLP(spec)
    shared = (MLP(spec, spec.num_shared_experts * spec.expert_hidden)
              if spec.num_shared_experts else None)
    return MoE(spec, shared)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(attn_norm(x))``, then ``x + mlp(ffn_norm(x))``;
    ``mlp`` is dense or a mixture of experts (block ``index`` of ``spec``)."""

    def __init__(self, spec: ModelSpec, attention: str = "sdpa", index: int = 0) -> None:
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec, attention)
        self.ffn_norm = _norm(spec)
        self.mlp = _mlp(spec, index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h)."""
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.ffn_norm(x))


class Transformer(nn.Module):
    """A GPT / Llama style decoder built from ``spec``, initialised deterministically from ``seed``.

    Every rank builds the full model with the same seed and then shards it, so the distributed
    model starts from exactly the single-process parameters.

    Args:
        spec: the model.
        seed: seeds the parameter init (independent of the global torch RNG).
        attention: "sdpa" or "tiled" (see `Attention`); the parameters do not depend on it.
    Raises:
        ValueError: unknown ``attention``.
    """

    def __init__(self, spec: ModelSpec, seed: int = 0, attention: str = "sdpa") -> None:
        super().__init__()
        self.spec = spec
        self.tok = nn.Embedding(spec.vocab_size, spec.hidden)
        self.pos = nn.Embedding(spec.seq_len, spec.hidden)
        self.layers = nn.ModuleDict({str(i): Block(spec, attention, i)
                                     for i in range(spec.num_layers)})
        self.norm = _norm(spec)
        self.out = nn.Linear(spec.hidden, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.out.weight = self.tok.weight
        #: Global positions of the tokens this rank holds (context parallelism,
        #: `runtime.parallel.cp.apply_cp`); None: positions 0 .. T-1.
        self.position_ids: torch.Tensor | None = None
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) matrices and embeddings, norms at weight 1 / bias 0.

        The residual output projections (``wo``, ``w2``, the experts' ``w2``) use std
        0.02/sqrt(2L) (GPT-2, Radford et al. 2019, section 2.3). Parameters are drawn in ``named_parameters`` order from one
        generator, so the init depends on the spec and the seed only.
        """
        g = torch.Generator().manual_seed(seed)
        residual_std = INIT_STD / math.sqrt(2 * self.spec.num_layers)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                std = residual_std if name.endswith(_RESIDUAL_OUTPUTS) else INIT_STD
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) int64 -> logits (B, T, V); on a pipeline stage (B, T, h) in or out."""
        if self.tok is not None:
            positions = (torch.arange(x.shape[1], device=x.device) if self.position_ids is None
                         else self.position_ids)                      # (T,)
            x = self.tok(x) + self.pos(positions)                     # (B, T, h)
        for layer in self.layers.values():
            x = layer(x)                                              # (B, T, h)
        if self.norm is not None:
            x = self.norm(x)                                          # (B, T, h)
        if self.out is not None:
            x = self.out(x)                                           # (B, T, V)
        return x


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats): logits (B, T, V), targets (B, T) -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

"""What a model is and what a plan is: the bottom layer of meshplan.

`ModelSpec` describes a decoder-only transformer; `Plan` describes how a training step of it is
split over devices (tensor / pipeline / data parallel, micro-batches, schedule, recomputation).
Both are frozen, keyword-only dataclasses that validate themselves on construction and raise
`PlanError` (a `ValueError`) naming the field, the value and the fix.

This module imports nothing from the other meshplan packages.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Literal, get_args

Activation = Literal["gelu", "swiglu"]
Norm = Literal["layernorm", "rmsnorm"]
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb", "zb-v",
                   "dualpipe-v", "zb-h2"]
#: Schedules that split the backward into input-gradient (B) and weight-gradient (W) work
#: (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"; DeepSeek-V3's DualPipe-V).
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "interleaved-zb", "zb-v", "dualpipe-v", "zb-h2")
#: Schedules whose pipeline ranks hold several model chunks.
MULTI_CHUNK_SCHEDULES = ("interleaved-1f1b", "interleaved-zb", "zb-v", "dualpipe-v")
#: Schedules that place two chunks per rank in a V: rank r holds stages r and 2·pp − 1 − r.
V_SCHEDULES = ("zb-v", "dualpipe-v")
Recompute = Literal["none", "selective", "full"]
Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "fp8-current", "mxfp8", "nvfp4"]
ZeroStage = Literal[0, 1, 2, 3]
Router = Literal["softmax", "sigmoid"]

#: Bytes per stored element (weights, activations, gradients) of each training dtype: tf32 is
#: stored as fp32; the low-precision recipes (`planner.precision`) store bf16 and cast only
#: the linear GEMMs' operands.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 2,
                               "fp8-current": 2, "mxfp8": 2, "nvfp4": 2}

#: Fraction of device memory a plan may use by default: the rest is left to the CUDA context,
#: NCCL's buffers and the allocator's fragmentation, which the memory model does not count.
MEMORY_HEADROOM = 0.95

#: Axis names of a plan's device mesh, the order `placement` permutes.
MESH_AXES = ("tp", "dp", "pp")


class PlanError(ValueError):
    """A model or plan field has an illegal value; the message names the field, value and fix."""


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


#: `_choices` by the id of the Literal (kept with the entry and checked, so a reused id of
#: a freed object never hits): hashing a Literal hashes its arguments on every call.
_CHOICES: dict[int, tuple[object, tuple]] = {}


def _choices(literal: object) -> tuple:
    # Cached: every plan checks its schedule, recomputation, ZeRO stage and dtype.
    hit = _CHOICES.get(id(literal))
    if hit is None or hit[0] is not literal:
        hit = _CHOICES[id(literal)] = (literal, get_args(literal))
    return hit[1]


def _require_positive_int(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fix = (f"; write {int(value)} (no decimal point)" if isinstance(value, float)
                   and value.is_integer() and value >= 1 else "")
            raise PlanError(f"{name}={value!r} must be a positive integer{fix}")


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to a misspelt ``word`` (difflib ratio >= 0.75), or None: the one
    suggestion rule for misspelt keys and names of every input file and flag."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return close[0] if close else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` for `closest`, else ''.

    >>> did_you_mean("num_kv_head", ["num_heads", "num_kv_heads"])
    " (did you mean 'num_kv_heads'?)"
    """
    close = closest(word, choices)
    return f" (did you mean {close!r}?)" if close else ""


def unknown_fields_message(kind: str, unknown: Iterable[str], known: Iterable[str]) -> str:
    """``unknown model field(s) ['x'] (did you mean 'y'?); known fields are [...]``."""
    unknown, known = sorted(unknown), sorted(known)
    hints = "".join(did_you_mean(str(u), known) for u in unknown)
    return f"unknown {kind} field(s) {unknown}{hints}; known fields are {known}"


def require_bool(name: str, value: object, where: str = "") -> bool:
    """``value`` if it is a boolean, else `PlanError` naming ``where`` + ``name`` and the value.

    The one check for boolean fields of model, cluster and plan files and of ``--fix``: a
    YAML file must write ``true`` / ``false`` unquoted (the string ``"false"`` or the number
    2 would otherwise read as true).
    """
    if not isinstance(value, bool):
        raise PlanError(f"{where}{name}={value!r} must be a boolean: write true or false "
                        f"(unquoted in YAML)")
    return value


def _require_bool_fields(obj: object) -> None:
    # every field the dataclass declares as bool (annotations are strings here)
    for name in _bool_fields(type(obj)):
        require_bool(name, getattr(obj, name))


@cache
def _bool_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.type == "bool")


def _require_choice(obj: object, name: str, literal: object) -> None:
    value = getattr(obj, name)
    choices = _choices(literal)
    if value not in choices:
        raise PlanError(f"{name}={value!r} is not one of {list(choices)}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer (GPT / Llama family).

    Attributes:
        name: preset or user name, used in tables and plan files.
        num_layers: transformer blocks (L).
        hidden: model width (h).
        num_heads: attention (query) heads (a).
        num_kv_heads: key/value heads; fewer than ``num_heads`` means grouped-query attention.
        ffn_hidden: MLP inner width (4h for GPT-3; 3.5h for Llama 3 8B's SwiGLU).
        vocab_size: vocabulary size (V).
        seq_len: training sequence length in tokens (s).
        activation: "gelu" (two-matrix MLP) or "swiglu" (three-matrix gated MLP).
        norm: "layernorm" (weight and bias) or "rmsnorm" (weight only).
        tied_embeddings: input embedding and output projection share one matrix.
        source: where the numbers come from (paper, config file).
        attention_head_dim: head width when it is not hidden / num_heads (Qwen3, GPT-OSS);
            0 means hidden / num_heads.
        num_experts: routed experts of a mixture-of-experts (MoE) MLP; 0 is a dense model.
        experts_per_token: routed experts each token visits (top-k).
        moe_ffn_hidden: inner width of one expert (0 means ffn_hidden).
        num_shared_experts: experts every token visits besides its top-k (DeepSeekMoE).
        moe_first_dense_layers: leading blocks with a dense MLP (DeepSeek-V3: 3).
        moe_layer_freq: every n-th block after those is MoE, the rest dense (1 = all).
        router: gate score function, "softmax" (Mixtral, Qwen3) or "sigmoid" (DeepSeek-V3).
        router_groups, router_group_topk: grouped (node-limited) top-k routing: experts in
            ``router_groups`` groups, a token picks from its best ``router_group_topk`` groups
            (DeepSeek-V3: 8 and 4); 1 and 1 mean plain top-k.
        capacity_factor: expert capacity as a multiple of the balanced load, tokens beyond it
            dropped (Fedus et al. 2021, Switch Transformer); None is dropless.
        q_lora_rank, kv_lora_rank, qk_rope_head_dim, v_head_dim: multi-head latent attention
            (DeepSeek-V2, Liu et al. 2024, §2.1): low-rank query / key-value compression, the
            decoupled rope part of each query/key head and the value head width; MLA is on when
            ``kv_lora_rank > 0``, and then ``attention_head_dim`` is the non-rope q/k part.
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int
    activation: Activation
    norm: Norm = "layernorm"
    tied_embeddings: bool = False
    source: str = ""
    attention_head_dim: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden: int = 0
    num_shared_experts: int = 0
    moe_first_dense_layers: int = 0
    moe_layer_freq: int = 1
    router: Router = "softmax"
    router_groups: int = 1
    router_group_topk: int = 1
    capacity_factor: float | None = None
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            fix = "give the model a name, e.g. name: my-model" if isinstance(self.name, str) \
                else f"quote it in YAML (e.g. name: \"{self.name}\")"
            raise PlanError(f"name={self.name!r} must be a non-empty string; {fix}")
        _require_positive_int(
            self, "num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden",
            "vocab_size", "seq_len",
        )
        _require_bool_fields(self)
        _require_choice(self, "activation", Activation)
        _require_choice(self, "norm", Norm)
        _check_moe_fields(self)
        if self.hidden % self.num_heads and not self.attention_head_dim:
            raise PlanError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                f"use a hidden size that is, e.g. "
                f"{max(self.num_heads, round(self.hidden / self.num_heads) * self.num_heads)}"
                f", or num_heads in {divisors(self.hidden)} (or set attention_head_dim)"
            )
        if self.num_heads % self.num_kv_heads:
            raise PlanError(
                f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}; "
                f"use num_kv_heads in {divisors(self.num_heads)}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head, hidden / num_heads (or ``attention_head_dim``)."""
        return self.attention_head_dim or self.hidden // self.num_heads

    @property
    def kv_hidden(self) -> int:
        """Width of the key (or value) projection output: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def layer_matmul_params(self) -> int:
        """Matrix parameters of one transformer block: QKV + output projection
        h·(h + 2·kv_hidden) + h·h, and the MLP 2·h·ffn (GeLU) or 3·h·ffn (SwiGLU).

        For an MoE model this is the mean over blocks of the *active* matrices per token
        (`moe_layer_matmul_params` with ``active=True``), so per-token costs stay
        ``num_layers · layer_matmul_params()``.
        """
        if self.is_moe:
            return self.moe_mean_layer_params(active=True, matmul_only=True)
        h = self.hidden
        attn = self.attention_matmul_params()
        return attn + (3 if self.activation == "swiglu" else 2) * h * self.ffn_hidden

    def layer_params(self) -> int:
        """Parameters of one transformer block (biases omitted): its matrices
        (`layer_matmul_params`) and two norms, 2h (RMSNorm) or 4h (LayerNorm weight and bias).
        For an MoE model: the mean over blocks of all parameters, every expert included.
        """
        if self.is_moe:
            return self.moe_mean_layer_params(active=False, matmul_only=False)
        return self.layer_matmul_params() + (4 if self.norm == "layernorm" else 2) * self.hidden

    def embedding_params(self) -> int:
        """Parameters of the input embedding (V·h)."""
        return self.vocab_size * self.hidden

    def output_params(self) -> int:
        """Parameters of the output projection that are not shared with the input embedding."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden

    def num_params(self) -> int:
        """All parameters: blocks, embedding, untied output projection and the final norm."""
        final_norm = (2 if self.norm == "layernorm" else 1) * self.hidden
        if self.is_moe:
            blocks = sum(self.block_params(i, active=False) for i in range(self.num_layers))
            return blocks + self.embedding_params() + self.output_params() + final_norm
        return (self.num_layers * self.layer_params() + self.embedding_params()
                + self.output_params() + final_norm)

    # -- mixture of experts and multi-head latent attention ---------------------------------

    @property
    def is_moe(self) -> bool:
        """Whether some blocks have a mixture-of-experts MLP (``num_experts > 0``)."""
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def expert_hidden(self) -> int:
        """Inner width of one expert MLP: ``moe_ffn_hidden``, or ``ffn_hidden`` when 0."""
        return self.moe_ffn_hidden or self.ffn_hidden

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE MLP: after the first
        ``moe_first_dense_layers`` blocks, every ``moe_layer_freq``-th one (Megatron-Core's
        ``--moe-layer-freq``; the DeepSeek-V3 ``first_k_dense_replace``).

        >>> m = ModelSpec(name="x", num_layers=6, hidden=64, num_heads=4, num_kv_heads=4,
        ...     ffn_hidden=128, vocab_size=100, seq_len=16, activation="swiglu",
        ...     num_experts=4, experts_per_token=2, moe_first_dense_layers=1, moe_layer_freq=2)
        >>> [m.is_moe_layer(i) for i in range(6)]
        [False, True, False, True, False, True]
        """
        if not self.is_moe or index < self.moe_first_dense_layers:
            return False
        return (index - self.moe_first_dense_layers) % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        """Blocks with an MoE MLP (cached per model: the memory model asks once per stage)."""
        return _moe_layer_count(self)

    def attention_matmul_params(self) -> int:
        """Matrix parameters of one attention block.

        Standard / grouped-query: Q and O h·(a·d) each, K and V h·(kv·d) each. MLA
        (DeepSeek-V2 §2.1.2-2.1.3): W_DQ h·r_q and W_UQ r_q·a·(d+d_r) (or h·a·(d+d_r) with
        no query compression), W_DKV+W_KR h·(r_kv+d_r), W_UK+W_UV r_kv·a·(d+d_v), W_O a·d_v·h.
        """
        h, a, d = self.hidden, self.num_heads, self.head_dim
        if not self.is_mla:
            return h * a * d * 2 + 2 * h * self.num_kv_heads * d
        qk = d + self.qk_rope_head_dim
        vd = self.v_head_dim or d
        q = (h * self.q_lora_rank + self.q_lora_rank * a * qk) if self.q_lora_rank \
            else h * a * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * a * (d + vd)
        return q + kv + a * vd * h

    def expert_params(self) -> int:
        """Matrix parameters of one expert MLP: 3·h·f_e (SwiGLU) or 2·h·f_e (GeLU)."""
        return (3 if self.activation == "swiglu" else 2) * self.hidden * self.expert_hidden

    def router_params(self) -> int:
        """Router (gate) matrix of one MoE block: h·num_experts."""
        return self.hidden * self.num_experts

    def block_params(self, index: int, *, active: bool, matmul_only: bool = False) -> int:
        """Parameters of block ``index``; ``active`` counts only what one token uses (top-k
        routed experts plus shared experts plus router), else every expert.

        Norms: two per block (plus the MLA latent norms) unless ``matmul_only``.
        """
        h = self.hidden
        attn = self.attention_matmul_params()
        if self.is_moe_layer(index):
            routed = self.experts_per_token if active else self.num_experts
            mlp = (routed + self.num_shared_experts) * self.expert_params() \
                + self.router_params()
        else:
            mlp = (3 if self.activation == "swiglu" else 2) * h * self.ffn_hidden
        if matmul_only:
            return attn + mlp
        norms = (4 if self.norm == "layernorm" else 2) * h
        if self.is_mla:
            norms += self.q_lora_rank + self.kv_lora_rank
        return attn + mlp + norms

    def moe_mean_layer_params(self, *, active: bool, matmul_only: bool) -> int:
        """`block_params` averaged over the blocks (rounded down; cached per model, as the
        planner asks for it once per candidate)."""
        return _mean_block_params(self, active, matmul_only)

    def active_params(self) -> int:
        """Parameters one token uses: the blocks' active parameters (`block_params` with
        ``active=True``), embedding, untied output projection and final norm."""
        final_norm = (2 if self.norm == "layernorm" else 1) * self.hidden
        blocks = sum(self.block_params(i, active=True) for i in range(self.num_layers))
        return blocks + self.embedding_params() + self.output_params() + final_norm

    def replace(self, **changes: object) -> ModelSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@lru_cache(maxsize=256)
def _moe_layer_count(model: ModelSpec) -> int:
    return sum(model.is_moe_layer(i) for i in range(model.num_layers))


@lru_cache(maxsize=256)
def _mean_block_params(model: ModelSpec, active: bool, matmul_only: bool) -> int:
    total = sum(model.block_params(i, active=active, matmul_only=matmul_only)
                for i in range(model.num_layers))
    return total // model.num_layers


#: Fields that mean something only for a model with experts, with their defaults: a dense
#: model (num_experts=0) that sets one would have it silently ignored.
_MOE_ONLY_DEFAULTS = {"experts_per_token": 0, "num_shared_experts": 0, "moe_ffn_hidden": 0,
                      "moe_first_dense_layers": 0, "moe_layer_freq": 1, "router": "softmax",
                      "router_groups": 1, "router_group_topk": 1, "capacity_factor": None}


def _check_moe_fields(m: ModelSpec) -> None:
    """Validate the MoE / MLA fields of a `ModelSpec` (raises `PlanError` naming the field)."""
    for name in ("attention_head_dim", "num_experts", "experts_per_token", "moe_ffn_hidden",
                 "num_shared_experts", "moe_first_dense_layers", "q_lora_rank",
                 "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(m, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"{name}={value!r} must be a non-negative integer")
    _require_positive_int(m, "moe_layer_freq", "router_groups", "router_group_topk")
    _require_choice(m, "router", Router)
    if m.num_experts:
        if not 1 <= m.experts_per_token <= m.num_experts:
            raise PlanError(f"experts_per_token={m.experts_per_token} must be in "
                            f"1..num_experts={m.num_experts}")
        if m.num_experts % m.router_groups or m.router_group_topk > m.router_groups:
            raise PlanError(f"router_groups={m.router_groups} must divide num_experts="
                            f"{m.num_experts} and be >= router_group_topk="
                            f"{m.router_group_topk}")
        if m.moe_first_dense_layers >= m.num_layers:
            raise PlanError(f"moe_first_dense_layers={m.moe_first_dense_layers} leaves no MoE "
                            f"block of num_layers={m.num_layers}; use fewer, or num_experts=0")
        spaced = m.num_layers - m.moe_first_dense_layers
        if m.moe_layer_freq > spaced:
            # block first_dense is MoE, the next would be first_dense + freq: past the last
            raise PlanError(f"moe_layer_freq={m.moe_layer_freq} is more than the {spaced} "
                            f"blocks after moe_first_dense_layers={m.moe_first_dense_layers} "
                            f"(num_layers={m.num_layers}): only one block would be MoE; use "
                            f"1..{spaced} (1: every block)")
    else:
        moe_only = {name: getattr(m, name) for name, default in _MOE_ONLY_DEFAULTS.items()
                    if getattr(m, name) != default}
        if moe_only:
            given = ", ".join(f"{k}={v!r}" for k, v in moe_only.items())
            raise PlanError(f"{given} describe(s) mixture-of-experts blocks, but num_experts is "
                            f"0 (the default: a dense model); give num_experts (e.g. "
                            f"num_experts: 8), or leave these fields out")
    if m.capacity_factor is not None:
        cf = m.capacity_factor
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0:
            raise PlanError(f"capacity_factor={cf!r} must be a positive number, or null "
                            f"(left out) for dropless routing")
    if (m.q_lora_rank or m.qk_rope_head_dim or m.v_head_dim) and not m.kv_lora_rank:
        raise PlanError("q_lora_rank / qk_rope_head_dim / v_head_dim are multi-head latent "
                        "attention fields and need kv_lora_rank > 0 (0 given)")


def zero_bubble_reason(schedule: str, pp: int, virtual_stages: int, num_microbatches: int
                       ) -> str:
    """'' if ``schedule`` runs v chunks per rank and m micro-batches on pp stages, else why
    not: the rules of torch.distributed.pipelining's zero-bubble schedules (torch 2.13
    ``schedules.py``). ZB-V and DualPipe-V hold exactly two chunks per rank; interleaved zero
    bubble at least two; ZB-H1 and interleaved zero bubble split m into max(1, m // pp) equal
    rounds; DualPipe-V needs m >= 2·pp.

    >>> zero_bubble_reason("dualpipe-v", 4, 2, 6)
    "schedule='dualpipe-v' needs at least 2*pp = 8 micro-batches (6 given); raise global_batch or lower micro_batch"
    """
    v, m = virtual_stages, num_microbatches
    rounds = max(1, m // pp)
    if schedule in V_SCHEDULES and v != 2:
        return (f"schedule={schedule!r} places two chunks per rank in a V; use "
                f"virtual_stages=2, not {v}")
    if schedule == "interleaved-zb" and v < 2:
        return (f"schedule='interleaved-zb' needs virtual_stages >= 2 ({v} given); use "
                f"schedule='zb-h1' for one chunk per rank")
    if schedule in ("zb-h1", "interleaved-zb") and m % rounds:
        return (f"schedule={schedule!r} needs the micro-batch count ({m}) to be a multiple "
                f"of its rounds max(1, m // pp) = {rounds}; use a micro-batch count that is "
                f"a multiple of pp={pp}")
    if schedule == "dualpipe-v" and m < 2 * pp:
        return (f"schedule='dualpipe-v' needs at least 2*pp = {2 * pp} micro-batches ({m} "
                f"given); raise global_batch or lower micro_batch")
    return ""


def _check_expert_folding(plan: Plan) -> None:
    # Megatron-Core MoE parallel folding: etp·ep·edp = tp·cp·dp on every pipeline stage.
    attn = plan.tp * plan.cp * plan.dp
    if attn % (plan.etp * plan.ep):
        fits = divisors(attn // plan.etp) if attn % plan.etp == 0 else [1]
        raise PlanError(
            f"ep={plan.ep}, etp={plan.etp}: expert folding needs etp*ep = {plan.etp}*{plan.ep}"
            f" = {plan.etp * plan.ep} to divide the attention ranks tp*cp*dp = {plan.tp}*"
            f"{plan.cp}*{plan.dp} = {attn}; use ep in "
            f"{fits} (etp in {divisors(attn)})")


def balanced_split(layers: int, stages: int) -> tuple[int, ...] | None:
    """Layers per stage, the larger stages first (DeepSpeed / Megatron balanced split); None
    when they split evenly.

    >>> balanced_split(70, 12)
    (6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5)
    >>> balanced_split(96, 8) is None
    True
    """
    if layers % stages == 0:
        return None
    q, r = divmod(layers, stages)
    return (q + 1,) * r + (q,) * (stages - r)


def degrees_text(tp: int, cp: int, pp: int, dp: int | None = None) -> str:
    """``tp*pp*dp = 2*1*2 = 4``: parallel degrees and their product, cp named only when > 1
    (and dp left out when None, for a partial split).

    >>> degrees_text(2, 1, 1, 2), degrees_text(8, 4, 2)
    ('tp*pp*dp = 2*1*2 = 4', 'tp*cp*pp = 8*4*2 = 64')
    """
    pairs = [("tp", tp)] + ([("cp", cp)] if cp > 1 else []) + [("pp", pp)] \
        + ([("dp", dp)] if dp is not None else [])
    names, values = zip(*pairs, strict=True)
    return f"{'*'.join(names)} = {'*'.join(map(str, values))} = {math.prod(values)}"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How one training step is split over devices.

    Attributes:
        tp, pp, dp: tensor-, pipeline- and data-parallel degrees; world size is tp·cp·pp·dp.
        cp: context-parallel degree: each sequence's tokens split over cp ranks, attention
            by ring exchange of key/value blocks (Liu et al. 2023, "Ring Attention"); the cp
            ranks of a group sit innermost in the ``dp`` axis of ``placement`` (Megatron's
            tp-cp-dp-pp order) and reduce gradients with the dp ranks (dp·cp ranks in all).
        micro_batch: sequences per micro-batch on one data-parallel rank.
        global_batch: sequences per optimizer step, all DP ranks together.
        schedule: pipeline schedule: "gpipe", "1f1b", "interleaved-1f1b", or one that splits
            the backward into input- and weight-gradient work (`ZERO_BUBBLE_SCHEDULES`):
            "zb-h1" (Qi et al. 2024, §2.1), "interleaved-zb" (its interleaved form, ZB-1p
            over v chunks), "zb-v" (Qi et al. 2024, §6), "dualpipe-v" (DeepSeek-V3, §3.2.1,
            cut in half) and "zb-h2" (Qi et al. 2024, §2.2: 2·pp − 1 micro-batches of
            activations, zero bubble with optimizer post-validation); see
            `simulator.step.zero_bubble`.
        virtual_stages: model chunks per pipeline rank (> 1 only with a multi-chunk schedule,
            `MULTI_CHUNK_SCHEDULES`; exactly 2 with "zb-v" and "dualpipe-v").
        recompute: activation recomputation policy ("none", "selective", "full").
        recompute_num_layers: under ``recompute="full"``, the blocks of each model chunk that
            recompute: 0 every block (Megatron-LM ``--recompute-method uniform
            --recompute-num-layers 1``); N > 0 only the first N of each chunk, the others
            keeping all their activations (``--recompute-method block
            --recompute-num-layers N``, Korthikanti et al. 2022 §5; Megatron-LM
            ``TransformerBlock._checkpointed_forward``); `full_recompute_share`.
        zero_stage: ZeRO stage of the data-parallel optimizer (0 = plain DDP; 3 = FSDP).
        sequence_parallel: shard norms/dropout activations over tp (Korthikanti et al. 2022).
        dtype: compute dtype of the step, or a low-precision recipe for the linear GEMMs
            (``fp8``, ``fp8-current``, ``mxfp8``, ``nvfp4``; `planner.precision`).
        placement: mesh axes from innermost (fastest varying over device ids) to outermost.
        stage_layers: layers per pipeline stage; None splits layers evenly.
        ep: expert-parallel degree of a mixture-of-experts model: the routed experts of each
            MoE block are split over ep ranks, tokens reach them by all-to-all.
        etp: expert tensor-parallel degree: each expert's matrices split over etp ranks.
            Megatron-Core's MoE parallel folding (Liu et al. 2025, "MoE Parallel Folding",
            arXiv:2504.14960; Megatron-Core ``docs/source/api-guide/moe.rst``): attention runs
            on tp·cp·dp ranks of a pipeline stage and the experts on etp·ep·edp of the same
            ranks, so etp·ep must divide tp·cp·dp and the expert data-parallel degree is
            ``edp = tp·cp·dp / (etp·ep)``.
    """

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch: int
    global_batch: int
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    recompute: Recompute = "none"
    recompute_num_layers: int = 0
    zero_stage: ZeroStage = 0
    sequence_parallel: bool = False
    dtype: Dtype = "bf16"
    placement: tuple[str, ...] = MESH_AXES
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _require_positive_int(self, "tp", "pp", "dp", "cp", "ep", "etp", "micro_batch",
                              "global_batch", "virtual_stages")
        _require_bool_fields(self)
        _check_expert_folding(self)
        _require_choice(self, "schedule", Schedule)
        _require_choice(self, "recompute", Recompute)
        n = self.recompute_num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PlanError(f"recompute_num_layers={n!r} must be a non-negative integer (0: "
                            f"every block)")
        if n and self.recompute != "full":
            raise PlanError(f"recompute_num_layers={n} needs recompute='full' (it counts the "
                            f"blocks of each chunk that recompute in full), not "
                            f"{self.recompute!r}; set recompute: full, or leave it out")
        _require_choice(self, "zero_stage", ZeroStage)
        _require_choice(self, "dtype", Dtype)
        if tuple(sorted(self.placement)) != tuple(sorted(MESH_AXES)):
            raise PlanError(f"placement={list(self.placement)} must order each of "
                            f"{list(MESH_AXES)} exactly once, innermost first")
        object.__setattr__(self, "placement", tuple(self.placement))
        per_step = self.dp * self.micro_batch
        if self.global_batch % per_step:
            raise PlanError(
                f"global_batch={self.global_batch} is not divisible by dp*micro_batch = "
                f"{self.dp}*{self.micro_batch} = {per_step}; use global_batch a multiple of "
                f"{per_step}"
            )
        if self.virtual_stages > 1 and self.schedule not in MULTI_CHUNK_SCHEDULES:
            raise PlanError(f"virtual_stages={self.virtual_stages} needs a multi-chunk "
                            f"schedule ({', '.join(MULTI_CHUNK_SCHEDULES)}), not "
                            f"{self.schedule!r}; or set virtual_stages: 1")
        self._check_zero_bubble()
        if self.schedule == "interleaved-1f1b" and self.pp > 1 and \
                self.num_microbatches % self.pp:
            raise PlanError(
                f"schedule='interleaved-1f1b' needs the micro-batch count "
                f"({self.num_microbatches}) to be a multiple of pp={self.pp}")
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("sequence_parallel=True needs tp > 1 (tp=1 given)")
        if self.stage_layers is not None:
            layers = tuple(self.stage_layers)
            object.__setattr__(self, "stage_layers", layers)
            if len(layers) != self.pp * self.virtual_stages or min(layers) < 1:
                raise PlanError(
                    f"stage_layers={list(layers)} must list pp*virtual_stages = "
                    f"{self.pp * self.virtual_stages} positive layer counts")

    def _check_zero_bubble(self) -> None:
        reason = zero_bubble_reason(self.schedule, self.pp, self.virtual_stages,
                                    self.num_microbatches)
        if reason:
            raise PlanError(reason)

    @property
    def world_size(self) -> int:
        """Devices the plan occupies: tp·cp·pp·dp."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same weights and reduce gradients together, dp·cp (Megatron's
        data-parallel group with context parallelism); ZeRO shards over them."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: ranks holding the same experts, tp·cp·dp / (etp·ep)
        (Megatron-Core MoE parallel folding; 1·1·dp when ep = etp = 1 and tp = cp = 1).

        >>> Plan(tp=2, pp=1, dp=8, ep=4, micro_batch=1, global_batch=8).edp
        4
        """
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def degrees(self) -> str:
        """The world size as its product, e.g. ``tp*pp*dp = 8*4*2 = 64`` (`degrees_text`).

        >>> Plan(tp=8, cp=2, pp=1, dp=2, micro_batch=1, global_batch=2).degrees
        'tp*cp*pp*dp = 8*2*1*2 = 32'
        """
        return degrees_text(self.tp, self.cp, self.pp, self.dp)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each pipeline: global_batch / (dp·micro_batch)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def id(self) -> str:
        """Canonical plan id, e.g. ``tp2-pp4-dp8-mb1-gb512`` (non-default fields appended;
        a non-default placement as ``place.tp.pp.dp``, innermost axis first)."""
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}", f"mb{self.micro_batch}",
                 f"gb{self.global_batch}"]
        if self.ep > 1 or self.etp > 1:
            parts.insert(3, f"ep{self.ep}" + (f"-etp{self.etp}" if self.etp > 1 else ""))
        if self.cp > 1:
            parts.insert(1, f"cp{self.cp}")
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.schedule not in ("1f1b", "interleaved-1f1b"):
            parts.append(self.schedule)
        if self.recompute_num_layers:
            parts.append(f"ac-block{self.recompute_num_layers}")
        elif self.recompute != "none":
            parts.append(f"ac-{self.recompute}")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.placement != MESH_AXES:
            parts.append("place." + ".".join(self.placement))
        if self.dtype in ("fp8", "fp8-current", "mxfp8", "nvfp4"):
            parts.append(self.dtype)
        return "-".join(parts)

    def full_recompute_share(self, chunk_layers: int) -> float:
        """Fraction of a chunk of ``chunk_layers`` blocks that full recomputation repeats in
        the backward (and keeps only the inputs of): 1 under ``recompute="full"`` with
        ``recompute_num_layers`` 0 or at least the chunk's blocks, min(N, L) / L with the
        block method, 0 without full recomputation.

        >>> p = Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1, recompute="full",
        ...          recompute_num_layers=5)
        >>> p.full_recompute_share(32), p.full_recompute_share(4), p.replace(
        ...     recompute_num_layers=0).full_recompute_share(32)
        (0.15625, 1.0, 1.0)
        """
        if self.recompute != "full" or chunk_layers < 1:
            return 0.0
        n = self.recompute_num_layers
        return 1.0 if not n or n >= chunk_layers else n / chunk_layers

    def model_full_recompute_share(self, model: ModelSpec) -> float:
        """`full_recompute_share` over all of ``model``'s blocks: the fraction of them that
        full recomputation repeats (each chunk's own share, weighted by its blocks).

        Raises:
            PlanError: the layers do not split over the chunks (`layers_per_stage`).
        """
        if self.recompute != "full" or not self.recompute_num_layers:
            return float(self.recompute == "full")
        chunks = self.layers_per_stage(model)
        return sum(self.full_recompute_share(c) * c for c in chunks) / sum(chunks)

    def replace(self, **changes: object) -> Plan:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def layers_per_stage(self, model: ModelSpec) -> tuple[int, ...]:
        """Layers of each of the pp·virtual_stages model chunks, in pipeline order.

        Raises:
            PlanError: the layers do not split evenly and no ``stage_layers`` was given, or
                ``stage_layers`` does not sum to ``model.num_layers``.
        """
        chunks = self.pp * self.virtual_stages
        if self.stage_layers is not None:
            if sum(self.stage_layers) != model.num_layers:
                raise PlanError(
                    f"stage_layers={list(self.stage_layers)} sums to {sum(self.stage_layers)}, "
                    f"not num_layers={model.num_layers}")
            return self.stage_layers
        if model.num_layers % chunks:
            raise PlanError(
                f"num_layers={model.num_layers} does not split over pp*virtual_stages = "
                f"{self.pp}*{self.virtual_stages} = {chunks}; give stage_layers explicitly "
                f"or use pp*virtual_stages in {divisors(model.num_layers)}")
        return (model.num_layers // chunks,) * chunks


def check_plan(model: ModelSpec, plan: Plan, world_size: int | None = None) -> None:
    """Check that ``plan`` can run ``model`` (and fill ``world_size`` devices, when given).

    Raises:
        PlanError: tp does not divide heads, KV heads or ffn_hidden; 2·cp does not divide
            seq_len (each rank holds two sequence chunks, one early and one late, which
            balances causal attention); the layers do not split over pp·virtual_stages; the
            expert split does not fit the model (`check_experts`); or tp·cp·pp·dp differs
            from ``world_size``.
    """
    for field, value in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                         ("ffn_hidden", model.ffn_hidden)):
        if value % plan.tp:
            raise PlanError(f"tp={plan.tp} does not divide {field}={value}; use tp in "
                            f"{divisors(math.gcd(model.num_heads, model.num_kv_heads, model.ffn_hidden))}")
    if plan.cp > 1 and model.seq_len % (2 * plan.cp):
        raise PlanError(f"cp={plan.cp} needs seq_len={model.seq_len} divisible by 2*cp = "
                        f"{2 * plan.cp} (two balanced chunks per rank); use cp in "
                        f"{[d for d in divisors(model.seq_len // 2) if d > 1][:8]}")
    plan.layers_per_stage(model)
    check_experts(model, plan)
    if world_size is not None and plan.world_size != world_size:
        raise PlanError(f"{plan.degrees} != world_size({world_size})")


def check_experts(model: ModelSpec, plan: Plan) -> None:
    """Check the expert split of ``plan`` against ``model``.

    Raises:
        PlanError: ep > 1 or etp > 1 on a dense model; ep does not divide num_experts (each
            EP rank holds num_experts / ep whole experts, Megatron-Core
            ``num_local_experts``); etp does not divide the expert width.
    """
    if not model.is_moe:
        if plan.ep > 1 or plan.etp > 1:
            raise PlanError(f"ep={plan.ep}, etp={plan.etp}: expert parallelism needs a "
                            f"mixture-of-experts model (num_experts > 0; {model.name!r} is "
                            f"dense); use ep=1 etp=1")
        return
    if model.num_experts % plan.ep:
        raise PlanError(f"ep={plan.ep} does not divide num_experts={model.num_experts}; use "
                        f"ep in {divisors(model.num_experts)}")
    if model.expert_hidden % plan.etp:
        raise PlanError(f"etp={plan.etp} does not divide the expert width moe_ffn_hidden="
                        f"{model.expert_hidden}; use etp in "
                        f"{divisors(math.gcd(model.expert_hidden, 64))}")

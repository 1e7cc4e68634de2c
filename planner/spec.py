"""What a model is and what a plan is: the bottom layer of meshplan.

`ModelSpec` describes a decoder-only transformer; `Plan` describes how a training step of it is
split over devices (tensor / pipeline / data parallel, micro-batches, schedule, recomputation).
Both are frozen, keyword-only dataclasses that validate themselves on construction and raise
`PlanError` (a `ValueError`) naming the field, the value and the fix.

This module imports nothing from the other meshplan packages.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args

Activation = Literal["gelu", "swiglu"]
Norm = Literal["layernorm", "rmsnorm"]
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
Recompute = Literal["none", "selective", "full"]
Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
ZeroStage = Literal[0, 1, 2, 3]

#: Bytes per element of each training dtype (tf32 is stored as fp32).
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

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


def _choices(literal: object) -> tuple:
    return get_args(literal)


def _require_positive_int(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")


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

    def __post_init__(self) -> None:
        _require_positive_int(
            self, "num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden",
            "vocab_size", "seq_len",
        )
        _require_choice(self, "activation", Activation)
        _require_choice(self, "norm", Norm)
        if self.hidden % self.num_heads:
            raise PlanError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                f"use num_heads in {divisors(self.hidden)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise PlanError(
                f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}; "
                f"use num_kv_heads in {divisors(self.num_heads)}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head, hidden / num_heads."""
        return self.hidden // self.num_heads

    @property
    def kv_hidden(self) -> int:
        """Width of the key (or value) projection output: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def layer_matmul_params(self) -> int:
        """Matrix parameters of one transformer block: QKV + output projection
        h·(h + 2·kv_hidden) + h·h, and the MLP 2·h·ffn (GeLU) or 3·h·ffn (SwiGLU)."""
        h = self.hidden
        attn = h * (h + 2 * self.kv_hidden) + h * h
        return attn + (3 if self.activation == "swiglu" else 2) * h * self.ffn_hidden

    def layer_params(self) -> int:
        """Parameters of one transformer block (biases omitted): its matrices
        (`layer_matmul_params`) and two norms, 2h (RMSNorm) or 4h (LayerNorm weight and bias).
        """
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
        return (self.num_layers * self.layer_params() + self.embedding_params()
                + self.output_params() + final_norm)

    def replace(self, **changes: object) -> ModelSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


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
        schedule: pipeline schedule ("gpipe", "1f1b", "interleaved-1f1b").
        virtual_stages: model chunks per pipeline rank (> 1 only with "interleaved-1f1b").
        recompute: activation recomputation policy ("none", "selective", "full").
        zero_stage: ZeRO stage of the data-parallel optimizer (0 = plain DDP; 3 = FSDP).
        sequence_parallel: shard norms/dropout activations over tp (Korthikanti et al. 2022).
        dtype: compute dtype of the step.
        placement: mesh axes from innermost (fastest varying over device ids) to outermost.
        stage_layers: layers per pipeline stage; None splits layers evenly.
    """

    tp: int
    pp: int
    dp: int
    cp: int = 1
    micro_batch: int
    global_batch: int
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    recompute: Recompute = "none"
    zero_stage: ZeroStage = 0
    sequence_parallel: bool = False
    dtype: Dtype = "bf16"
    placement: tuple[str, ...] = MESH_AXES
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _require_positive_int(self, "tp", "pp", "dp", "cp", "micro_batch", "global_batch",
                              "virtual_stages")
        _require_choice(self, "schedule", Schedule)
        _require_choice(self, "recompute", Recompute)
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
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise PlanError(f"virtual_stages={self.virtual_stages} needs "
                            f"schedule='interleaved-1f1b', not {self.schedule!r}")
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
        if self.cp > 1:
            parts.insert(1, f"cp{self.cp}")
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.schedule not in ("1f1b", "interleaved-1f1b"):
            parts.append(self.schedule)
        if self.recompute != "none":
            parts.append(f"ac-{self.recompute}")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.placement != MESH_AXES:
            parts.append("place." + ".".join(self.placement))
        return "-".join(parts)

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
            balances causal attention); the layers do not split over pp·virtual_stages; or
            tp·cp·pp·dp differs from ``world_size``.
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
    if world_size is not None and plan.world_size != world_size:
        raise PlanError(f"{plan.degrees} != world_size({world_size})")

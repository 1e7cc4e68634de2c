"""Training precision: which GEMMs run in a low-precision format and what that costs.

A plan's ``dtype`` names its precision recipe. ``bf16`` (and fp16 / fp32 / tf32) runs every
op in that dtype. The low-precision recipes run only the linear layers' GEMMs (QKV, output
projection, MLP up and down; forward, input-gradient and weight-gradient GEMMs) in the
low-precision format, as Transformer Engine and torchao do; attention, norms, the router,
the embedding and the output layer stay in bf16, and weights, gradients and activations are
stored in bf16 with fp32 master weights (mixed precision, Micikevicius et al. 2022, "FP8
Formats for Deep Learning", §4):

=============  =====================================  ==================================
dtype          format and scaling                      source
=============  =====================================  ==================================
fp8            E4M3 forward, E5M2 gradients; per-      Micikevicius et al. 2022 §4.3;
               tensor delayed scaling (amax history,   Transformer Engine ``DelayedScaling``
               the amaxes all-reduced every step)
fp8-current    E4M3 / E5M2, per-tensor current         Transformer Engine
               scaling: an amax pass before each cast  ``Float8CurrentScaling``; torchao
                                                       ``tensorwise``
mxfp8          E4M3 elements, one E8M0 scale per 32    OCP Microscaling Formats (MX) v1.0
               consecutive elements, scaled in the     §5.3; Transformer Engine
               cast kernel                             ``MXFP8BlockScaling``
nvfp4          E2M1 elements, one E4M3 scale per 16    NVIDIA 2025, "Pretraining Large
               elements and an fp32 per-tensor scale   Language Models with NVFP4" §3
               (an amax pass before each cast)
=============  =====================================  ==================================

Costs besides the faster GEMM, per GEMM with input X (m×k), weight W (n×k) and output
gradient dY (m×n): each cast reads the bf16 tensor (2 bytes an element) and writes the
format's bytes (`Recipe.operand_bytes`, scales included); current scaling and NVFP4 read the
tensor once more for its amax; Hopper's FP8 tensor cores take only the K-major (TN) layout,
so a per-tensor FP8 cast also writes the transpose of X and dY for the weight-gradient GEMM
and of W for the input-gradient GEMM (Transformer Engine's fused cast-transpose), and a
block-scaled cast writes a second, column-wise scaled copy (the blocks run along K of the
other GEMM). Weights are cast once per step and kept for every micro-batch (Megatron-Core /
Transformer Engine's ``is_first_microbatch`` weight cache); with primary low-precision weights
(Megatron-Core ``--fp8-param-gather``, NeMo's FP8 recipes) those copies replace the bf16
linear weights in memory (`weight_cache_bytes_per_param` instead of 2 bytes a parameter);
NVFP4 keeps the bf16 weights and caches its copies beside them (`Recipe.primary_weights`).
Each linear input saved for the weight gradient is kept as its cast.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from planner.spec import Dtype, PlanError, did_you_mean

Scaling = Literal["delayed", "current", "block"]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One low-precision training recipe.

    Attributes:
        name: the plan dtype (``fp8``, ``fp8-current``, ``mxfp8``, ``nvfp4``).
        peak_key: the device ``peak_flops`` entry its GEMMs run at.
        operand_bytes: bytes per element of a cast GEMM operand, block scales included
            (MXFP8: 1 + 1/32; NVFP4: 0.5 + 1/16).
        scaling: ``delayed`` (amax of earlier steps), ``current`` (amax of this tensor) or
            ``block`` (scales per block, computed in the cast kernel).
        amax_pass: the cast needs a separate amax reduction over the tensor first.
        amax_allreduce: the amaxes are all-reduced over the ranks that share the weights
            (tp·dp·cp) once per forward and once per backward (delayed scaling).
        block_scaled: two copies per cast (row- and column-wise scales) on every device.
        primary_weights: the frameworks hold the linear weights as their casts instead of
            bf16 (Megatron-Core ``--fp8-param-gather``: Megatron-Bridge's FP8 and MXFP8 mixed
            precision recipes); False for NVFP4, whose recipe keeps bf16 weights and caches
            the casts beside them (Megatron-Bridge ``bf16_with_nvfp4_mixed``:
            ``fp8_param_gather=False``, "FP4 doesn't use param gather").
        needs: human name of the tensor cores the recipe needs.
        source: where the recipe is defined.
    """

    name: str
    peak_key: str
    operand_bytes: float
    scaling: Scaling
    amax_pass: bool
    amax_allreduce: bool
    block_scaled: bool
    needs: str
    source: str
    primary_weights: bool = True


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe(name="fp8", peak_key="fp8", operand_bytes=1.0, scaling="delayed", amax_pass=False,
           amax_allreduce=True, block_scaled=False, needs="FP8 tensor cores (Hopper, Ada, "
           "Blackwell)", source="Micikevicius et al. 2022 §4.3; TE DelayedScaling"),
    Recipe(name="fp8-current", peak_key="fp8", operand_bytes=1.0, scaling="current",
           amax_pass=True, amax_allreduce=False, block_scaled=False,
           needs="FP8 tensor cores (Hopper, Ada, Blackwell)",
           source="TE Float8CurrentScaling; torchao Float8LinearConfig 'tensorwise'"),
    Recipe(name="mxfp8", peak_key="mxfp8", operand_bytes=1.0 + 1.0 / 32, scaling="block",
           amax_pass=False, amax_allreduce=False, block_scaled=True,
           needs="block-scaled (MX) tensor cores (Blackwell)",
           source="OCP MX v1.0 §5.3; TE MXFP8BlockScaling"),
    Recipe(name="nvfp4", peak_key="nvfp4", operand_bytes=0.5 + 1.0 / 16, scaling="block",
           amax_pass=True, amax_allreduce=False, block_scaled=True,
           needs="FP4 tensor cores (Blackwell)", primary_weights=False,
           source="NVIDIA 2025, Pretraining LLMs with NVFP4 §3; TE NVFP4BlockScaling"),
)}
#: Dtypes a search tries for ``meshplan plan --dtype any``: bf16 and the low-precision recipes.
PLAN_DTYPES = ("bf16", *RECIPES)
#: Every plan dtype (`planner.spec.Dtype`): the ``--dtype`` choices (with ``any``) and the
#: values a cluster file's ``default_dtype`` takes.
DTYPES: tuple[str, ...] = get_args(Dtype)
#: The dtype of the CPU test bed (gloo runs fp32), the default of a localhost cluster.
CPU_DTYPE = "fp32"


def check_default_dtype(value: object, cluster: str, device_name: str,
                        peak_flops: Mapping[str, float]) -> str:
    """A cluster file's ``default_dtype``: one of `DTYPES`, the ``--dtype`` choices, that the
    cluster's device runs (`unsupported_dtype_reason`, the rule a search applies), so that a
    plan never blames a ``--dtype`` nobody gave.

    Raises:
        PlanError: any other value, naming the field, the reason and the accepted ones.
    """
    if value not in DTYPES:
        raise PlanError(f"cluster {cluster!r}: default_dtype={value!r} is not one of "
                        f"{', '.join(DTYPES)}{did_you_mean(str(value), DTYPES)} (the --dtype "
                        f"choices)")
    reason = unsupported_dtype_reason(value, device_name, peak_flops, field="default_dtype",
                                      use="default_dtype: ")
    if reason:
        raise PlanError(f"cluster {cluster!r}: {reason}")
    return value
#: Forward ops of a block that run in the recipe's format (`simulator.step.compute` names).
LINEAR_GEMMS = ("qkv", "out-proj", "mlp-up", "mlp-down")
#: The linear GEMMs of an MoE / MLA block (`simulator.step.moe` names) that run in the
#: recipe's format too: the routed experts' grouped GEMMs (Megatron-Core ``TEGroupedMLP``
#: under ``fp8_autocast``), the shared experts and the MLA projections (Transformer Engine
#: linears). The router GEMM stays in higher precision, as do attention, norms, embedding and
#: output head (DeepSeek-V3 technical report, arXiv:2412.19437, §3.3.1: FP8 for the GEMMs
#: of the linear operators; the gating module, normalisation and attention kept in BF16/FP32).
MOE_LINEAR_GEMMS = ("expert-up", "expert-down", "shared-up", "shared-down", "mla-q",
                    "mla-q-down", "mla-q-up", "mla-kv-down", "mla-kv-up")
#: Every GEMM a low-precision recipe runs at its rate: dense blocks' and MoE / MLA blocks'.
LOWP_GEMMS = LINEAR_GEMMS + MOE_LINEAR_GEMMS
#: Linear GEMM inputs whose cast Transformer Engine fuses into the norm before it
#: (``LayerNormLinear``, ``LayerNormMLP``): the cast writes, it does not read again.
NORM_FUSED_INPUTS = ("qkv", "mlp-up")


def recipe(dtype: str) -> Recipe | None:
    """The low-precision `Recipe` of a plan dtype, None for bf16 / fp16 / fp32 / tf32.

    >>> recipe("mxfp8").operand_bytes, recipe("bf16")
    (1.03125, None)
    """
    return RECIPES.get(dtype)


def storage_dtype(dtype: str) -> str:
    """The dtype weights, activations, gradients and the non-linear ops use: bf16 for a
    low-precision recipe (mixed precision), else ``dtype`` itself.

    >>> storage_dtype("nvfp4"), storage_dtype("fp16")
    ('bf16', 'fp16')
    """
    return "bf16" if dtype in RECIPES else dtype


def gemm_peak_key(dtype: str) -> str:
    """The ``peak_flops`` key the linear GEMMs of ``dtype`` run at (``fp8-current`` -> fp8)."""
    r = RECIPES.get(dtype)
    return r.peak_key if r else dtype


def unsupported_dtype_reason(dtype: str, device_name: str, peak_flops: Mapping[str, float],
                             *, field: str = "dtype", use: str = "--dtype ") -> str | None:
    """Why a device cannot train in ``dtype`` (it has no peak for the recipe's format), or
    None when it can; ``field`` names where the dtype came from and ``use`` how to give
    another (a cluster file's ``default_dtype: `` rather than the flag).

    >>> unsupported_dtype_reason("fp8", "a100-sxm-80gb", {"bf16": 3.12e14})[:44]
    'dtype=fp8: a100-sxm-80gb has no FP8 tensor c'
    >>> unsupported_dtype_reason("fp8", "h100-sxm-80gb", {"bf16": 1.0, "fp8": 2.0}) is None
    True
    """
    key = gemm_peak_key(dtype)
    if key in peak_flops:
        return None
    r = RECIPES.get(dtype)
    runs = [d for d in PLAN_DTYPES if gemm_peak_key(d) in peak_flops] or sorted(peak_flops)
    need = r.needs if r else f"{dtype} peak FLOP/s"
    # the suggestion is a dtype the device runs (a CPU has only fp32), never the refused one
    return (f"{field}={dtype}: {device_name} has no {need}; it runs {', '.join(runs)}; use "
            f"{use}{runs[-1]} or a device that has them")


def search_dtypes(dtype: str, device_name: str, peak_flops: Mapping[str, float]) -> list[str]:
    """The dtypes a plan search tries: every `PLAN_DTYPES` entry the device runs for
    ``any``, else ``[dtype]``.

    Raises:
        PlanError: the device cannot run ``dtype`` (`unsupported_dtype_reason`).

    >>> search_dtypes("any", "h100", {"bf16": 1.0, "fp8": 2.0})
    ['bf16', 'fp8', 'fp8-current']
    """
    if dtype == "any":
        return [d for d in PLAN_DTYPES if gemm_peak_key(d) in peak_flops]
    reason = unsupported_dtype_reason(dtype, device_name, peak_flops)
    if reason:
        raise PlanError(reason)
    return [dtype]


def cast_copies(r: Recipe, block_scaled_device: bool) -> int:
    """Low-precision copies one cast writes: 2 (row- and column-wise) for a block-scaled
    recipe, or for per-tensor FP8 on a device without block-scaled tensor cores (Hopper,
    Ada: TN-only FP8 GEMMs need the transpose); else 1 (Blackwell takes either layout).

    >>> cast_copies(RECIPES["fp8"], False), cast_copies(RECIPES["fp8"], True)
    (2, 1)
    """
    return 2 if r.block_scaled or not block_scaled_device else 1


def cast_bytes(r: Recipe, elements: float, copies: int, *, fused_read: bool = False) -> float:
    """Bytes one quantize kernel moves for a bf16 tensor of ``elements``: read it (unless the
    cast is fused into the kernel that produced it), read it again for the amax when the
    recipe needs an amax pass, write ``copies`` low-precision copies.

    >>> cast_bytes(RECIPES["fp8-current"], 1000, 2)  # 2 kB read twice, 2 x 1 kB written
    6000.0
    """
    reads = (0 if fused_read else 1) + (1 if r.amax_pass else 0)
    return elements * (2.0 * reads + r.operand_bytes * copies)


def weight_cache_bytes_per_param(dtype: str, block_scaled_device: bool) -> float:
    """Memory the low-precision copies of a linear weight take per parameter (the copies
    cached across micro-batches, `cast_copies` of them); 0 for bf16.

    >>> weight_cache_bytes_per_param("fp8", False), weight_cache_bytes_per_param("nvfp4", True)
    (2.0, 1.125)
    """
    r = RECIPES.get(dtype)
    return 0.0 if r is None else r.operand_bytes * cast_copies(r, block_scaled_device)


def block_scaled_device(peak_flops: Mapping[str, float]) -> bool:
    """Whether a device has block-scaled (MX) tensor cores, which take FP8 operands in either
    layout (Blackwell); Hopper and Ada take K-major FP8 only."""
    return "mxfp8" in peak_flops

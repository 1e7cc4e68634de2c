"""Compute time of one transformer layer, op by op: GEMMs at a shape-dependent efficiency,
memory-bound ops at achievable bandwidth, and the host time that launches them.

Every op of a Megatron-style GPT / Llama block is listed with its FLOPs, bytes and GEMM shape
(m, n, k) for one TP rank and one micro-batch of T = b·s tokens:

====================  ==========================================  =============================
op                    GEMM (m, n, k) or bytes                      source
====================  ==========================================  =============================
norm 1, norm 2        read + write T·h (/tp with SP)               Korthikanti et al. 2022 §4.2
QKV projection        (T, (h + 2·kv)/tp, h), GQA via kv            Shoeybi et al. 2019 §3
attention core        QKᵀ and AV: 2 × 2·T·s·h/tp FLOPs; unfused:   Narayanan et al. 2021 eq. 3;
                      softmax + dropout over b·a/tp·s² scores;     Dao et al. 2022 (flash)
                      flash: causal, half the score blocks, no s²
output projection     (T, h, h/tp)                                 Shoeybi et al. 2019 §3
dropout + residual ×2 read 2·T·h, write T·h, 1-byte mask           Korthikanti et al. 2022 §4.1
MLP up                (T, f/tp, h); SwiGLU (T, 2f/tp, h)           Shazeer 2020 (GLU variants)
activation            GeLU read + write T·f/tp; SwiGLU 2 in 1 out
MLP down              (T, h, f/tp)
====================  ==========================================  =============================

The backward of a GEMM is two GEMMs of the same FLOPs (input and weight gradient); of a
memory-bound op, twice its bytes (Narayanan et al. 2021 §3.1: backward = 2 × forward).

GEMM time is ``2mnk / (peak · gemm_max_fraction · wave(m, n) · sat(2mnk)) + kernel_s``:
``wave`` is the wave-quantisation of 128×128 output tiles over the SMs (a GEMM with 1.1 waves
of tiles pays for 2), ``sat(W) = W / (W + gemm_half_flops)`` the saturating curve that makes
small or skinny GEMMs run far below peak. Memory-bound ops take ``bytes / (bandwidth ·
memory_fraction) + kernel_s``. Eager frameworks also spend ``host_op_s`` of CPU time per op;
the GPU cannot run ahead of its launches, so a micro-batch takes max(device, host).
The parameters per GPU type live in ``simulator/presets/efficiency.yaml``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, NamedTuple, get_args

import yaml

from planner.precision import (
    LOWP_GEMMS,
    NORM_FUSED_INPUTS,
    block_scaled_device,
    cast_bytes,
    cast_copies,
    recipe,
    storage_dtype,
)
from planner.spec import DTYPE_BYTES, ModelSpec, PlanError
from simulator import PRESET_DIR
from simulator.network.hardware import DeviceProfile

PRESET = PRESET_DIR / "efficiency.yaml"
#: Attention kernels' published rates per GPU generation and the kernel each framework's
#: attention call runs (`attention_kernel_rate`).
KERNEL_PRESET = PRESET_DIR / "attention_kernels.yaml"
#: A FlashAttention backward's FLOPs over its forward's: five matmuls against two, the scores
#: recomputed (Dao 2023, "FlashAttention-2", §3.1 and its FLOP count).
FLASH_BWD_FLOPS = 2.5

Attention = Literal["flash", "flash-triton", "unfused"]
#: How context-parallel attention exchanges keys and values (`SimOptions.cp_attention`):
#: 'ring' passes each rank's compact (GQA) K/V block to the next rank, one hop per block
#: (Liu et al. 2023, "Ring Attention"; Megatron-Core / Transformer Engine CP); 'pytorch' is
#: PyTorch's ``context_parallel`` SDPA as torchtitan runs it (`torch_cp_merge_bytes`,
#: `simulator.step.costs.torch_cp_comm`).
CpAttention = Literal["ring", "pytorch"]
CP_ATTENTIONS = get_args(CpAttention)
#: FlashAttention in Triton (the FlashAttention-1 algorithm, e.g. llm-foundry's
#: ``attn_impl: triton``) relative to FlashAttention-2: Dao 2023 ("FlashAttention-2", §4.1)
#: measures FlashAttention-2 1.3-2.5x faster on A100; the geometric middle, 1.8x, is used.
TRITON_FLASH_RATE = 1 / 1.8
TILE = 128  # output tile edge of cuBLAS/CUTLASS tensor-core GEMMs on A100/H100


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fitted compute-efficiency parameters of one GPU type (see ``efficiency.yaml``).

    Attributes:
        gemm_max_fraction: fraction of dense peak a large, well-shaped GEMM reaches.
        gemm_half_flops: GEMM FLOPs at which the saturating curve is at half of its maximum.
        num_sms: streaming multiprocessors (wave quantisation).
        memory_fraction: achieved fraction of HBM bandwidth for memory-bound kernels.
        kernel_s: fixed device time per kernel (launch gap, tail).
        host_op_s: CPU time per launched op in an eager framework (forward op; the backward
            launches twice as many).
        flash_fraction: the attention kernel's FLOP rate relative to a large GEMM; a property
            of the generation's kernel (FlashAttention-2 on Hopper, cuDNN on Blackwell:
            ``efficiency.yaml``), not carried across generations.
        flash_ceiling: the GEMM ceiling ``flash_fraction`` is stated against, held fixed:
            the attention kernel then runs at ``flash_fraction · flash_ceiling`` of the dense
            peak whatever ``gemm_max_fraction`` is (`attention_peak_fraction`). None (a
            device's own entry, and its per-device fit): ``gemm_max_fraction``, so attention
            moves with the device's fitted GEMM ceiling. The carry rule sets it to the
            device entry's documented ceiling (`simulator.validation.carry`): a ceiling
            refitted as one term for every GPU is no property of any one GPU's attention
            kernel.
        fp8_fraction: an FP8 / MXFP8 GEMM's ceiling (fraction of the FP8 peak) relative to
            a bf16 GEMM's ``gemm_max_fraction`` of the bf16 peak (`lowp_efficiency`).
        fp4_fraction: the same for NVFP4 GEMMs against the FP4 peak.
        source: how the numbers were obtained.
    """

    gemm_max_fraction: float
    gemm_half_flops: float
    num_sms: int
    memory_fraction: float
    kernel_s: float
    host_op_s: float
    flash_fraction: float = 0.8
    flash_ceiling: float | None = None
    fp8_fraction: float = 1.0
    fp4_fraction: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("gemm_max_fraction", "memory_fraction", "flash_fraction", "fp8_fraction",
                     "fp4_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise PlanError(f"{name}={getattr(self, name)!r} must be in (0, 1]")
        if self.flash_ceiling is not None and not 0 < self.flash_ceiling <= 1:
            raise PlanError(f"flash_ceiling={self.flash_ceiling!r} must be in (0, 1] or None")
        for name in ("gemm_half_flops", "kernel_s", "host_op_s"):
            if getattr(self, name) < 0:
                raise PlanError(f"{name}={getattr(self, name)!r} must be >= 0")


@lru_cache(maxsize=1)
def _presets() -> dict[str, dict]:
    with open(PRESET, encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_efficiency(device: str) -> Efficiency:
    """Efficiency parameters of ``device`` (a device preset name); a generic profile (no host
    overhead, no saturation) for devices without an entry, e.g. the CPU core."""
    data = _presets().get(device)
    if data is None or device == "frameworks":
        return Efficiency(gemm_max_fraction=1.0, gemm_half_flops=0.0, num_sms=1,
                          memory_fraction=1.0, kernel_s=0.0, host_op_s=0.0,
                          flash_fraction=1.0, source="generic: device profile efficiencies")
    return Efficiency(**data)


def attention_peak_fraction(eff: Efficiency) -> float:
    """The fused attention kernel's FLOP rate as a fraction of the dense peak:
    ``flash_fraction`` times ``flash_ceiling`` (``gemm_max_fraction`` where that is None).

    >>> e = Efficiency(gemm_max_fraction=0.5, gemm_half_flops=0.0, num_sms=1,
    ...                memory_fraction=1.0, kernel_s=0.0, host_op_s=0.0, flash_fraction=0.8)
    >>> attention_peak_fraction(e), attention_peak_fraction(
    ...     dataclasses.replace(e, flash_ceiling=0.7))
    (0.4, 0.5599999999999999)
    """
    ceiling = eff.gemm_max_fraction if eff.flash_ceiling is None else eff.flash_ceiling
    return eff.flash_fraction * ceiling


def load_framework(name: str) -> dict[str, float]:
    """Fitted framework parameters (``frameworks`` in ``efficiency.yaml``) of ``name``, e.g.
    ``{'p2p_overhead_s': 0.002}``; empty for a framework without an entry."""
    data = dict(_presets().get("frameworks", {}).get(name, {}))
    data.pop("source", None)
    return {k: float(v) for k, v in data.items()}


@lru_cache(maxsize=1)
def _kernel_presets() -> dict:
    with open(KERNEL_PRESET, encoding="utf-8") as f:
        return yaml.safe_load(f)


def attention_kernel_names() -> list[str]:
    """Every name an ``attention_kernel`` setting may take: the framework dispatchers
    (``dispatch`` in ``attention_kernels.yaml``) and the kernels themselves.

    >>> attention_kernel_names()
    ['cudnn', 'fa2', 'fa3', 'sdpa', 'te-fused']
    """
    data = _kernel_presets()
    return sorted([*data["dispatch"], *data["kernels"]])


class KernelRate(NamedTuple):
    """One attention kernel's training rate on one GPU generation (`attention_kernel_rate`)."""

    kernel: str
    generation: str
    fraction: float
    source: str


def kernel_training_fraction(fwd_tflops: float, bwd_tflops: float, peak_tflops: float) -> float:
    """Training rate of an attention kernel as a fraction of the dense peak: a step runs its
    forward (F FLOPs at ``fwd_tflops``) and backward (2.5·F at ``bwd_tflops``;
    `FLASH_BWD_FLOPS`), so the rate is (1 + 2.5) / (1/fwd + 2.5/bwd), over ``peak_tflops``.

    >>> round(kernel_training_fraction(300, 300, 1000), 3)  # one rate both ways: itself
    0.3
    >>> round(kernel_training_fraction(400, 200, 1000), 4)  # 3.5 / (1/400 + 2.5/200)
    0.2333
    """
    return (1 + FLASH_BWD_FLOPS) / (1 / fwd_tflops + FLASH_BWD_FLOPS / bwd_tflops) / peak_tflops


def attention_kernel_rate(kernel: str, device: str) -> KernelRate | None:
    """The published training rate of attention ``kernel`` (a kernel or a framework
    dispatcher of ``attention_kernels.yaml``, e.g. ``te-fused``) on ``device`` (a device
    preset name): the dispatcher resolved for the device's generation, the rate by
    `kernel_training_fraction`. None where no rate is published for that generation (the
    device's ``efficiency.yaml`` default applies).

    >>> r = attention_kernel_rate("te-fused", "h100-sxm-80gb")  # cuDNN: 534 fwd, 517 bwd
    >>> r.kernel, r.generation, round(r.fraction, 4)
    ('cudnn', 'hopper', 0.5275)
    >>> attention_kernel_rate("sdpa", "a100-sxm-80gb") is None  # no A100 entry
    True

    Raises:
        PlanError: ``kernel`` is not a name of ``attention_kernels.yaml``.
    """
    data = _kernel_presets()
    if kernel not in attention_kernel_names():
        raise PlanError(f"attention_kernel={kernel!r} is not one of {attention_kernel_names()} "
                        f"({KERNEL_PRESET.name}); name one of them or add its benchmark there")
    generation = next((g for g, devices in data["generations"].items() if device in devices),
                      None)
    if generation is None:
        return None
    name = data["dispatch"].get(kernel, {}).get(generation) if kernel in data["dispatch"] \
        else kernel
    entry = data["kernels"].get(name, {}).get(generation) if name else None
    if entry is None:
        return None
    return KernelRate(name, generation, kernel_training_fraction(
        float(entry["fwd_tflops"]), float(entry["bwd_tflops"]), float(entry["peak_tflops"])),
        entry["source"])


def with_attention_kernel(eff: Efficiency, device: str, kernel: str | None) -> Efficiency:
    """``eff`` with the ``flash_fraction`` of attention ``kernel`` on ``device``: the
    kernel's published training rate (`attention_kernel_rate`, a fraction of the dense peak)
    over the GEMM ceiling of the device's ``efficiency.yaml`` entry, the documented
    isolated-GEMM ceiling every ``flash_fraction`` is measured against (H100: 0.713), so a
    per-device refit of the GEMM terms moves attention with the GEMMs as it does for every
    device default; over ``eff.flash_ceiling`` where that is set (the carry rule), so the
    kernel stays at its published fraction of the peak. ``eff`` itself when ``kernel`` is
    None or has no published rate on the device's generation.

    >>> e = with_attention_kernel(load_efficiency("h100-sxm-80gb"), "h100-sxm-80gb", "te-fused")
    >>> round(e.flash_fraction, 4)  # cuDNN 0.5275 of the peak / the 0.713 ceiling
    0.7399
    >>> with_attention_kernel(e, "h100-sxm-80gb", None) is e
    True
    """
    rate = attention_kernel_rate(kernel, device) if kernel else None
    if rate is None:
        return eff
    ceiling = load_efficiency(device).gemm_max_fraction if eff.flash_ceiling is None \
        else eff.flash_ceiling
    return dataclasses.replace(eff, flash_fraction=rate.fraction / ceiling)


class Op(NamedTuple):
    """One forward op: GEMM shape (m, n, k) and count (batched GEMMs), or memory bytes."""

    name: str
    m: int = 0
    n: int = 0
    k: int = 0
    count: int = 1
    flops: float = 0.0
    bytes: float = 0.0
    rate: float = 1.0  # FLOP rate of a fused (flops) op relative to FlashAttention-2
    #: Backward bytes of a memory-bound op when not twice the forward's (a quantize op: the
    #: output gradient's cast), None: twice ``bytes``.
    bwd_bytes: float | None = None


def wave_efficiency(m: int, n: int, num_sms: int) -> float:
    """Useful fraction of the last wave of 128×128 tiles over ``num_sms`` SMs.

    >>> wave_efficiency(128 * 108, 128, 108)  # exactly one full wave
    1.0
    >>> round(wave_efficiency(128 * 109, 128, 108), 3)  # 109 tiles need 2 waves
    0.505
    """
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / num_sms)
    return tiles / (waves * num_sms)


def gemm_time_s(m: int, n: int, k: int, peak_flops: float, eff: Efficiency,
                count: int = 1) -> float:
    """Time of ``count`` (m, n, k) GEMMs run as one batched kernel.

    >>> e = Efficiency(gemm_max_fraction=0.5, gemm_half_flops=0.0, num_sms=1,
    ...                memory_fraction=1.0, kernel_s=0.0, host_op_s=0.0)
    >>> gemm_time_s(128, 128, 1000, 2 * 128 * 128 * 1000 / 0.5, e)
    1.0
    """
    flops = 2.0 * m * n * k * count
    # Batched GEMMs fill the SMs with tiles from every batch entry.
    wave = wave_efficiency(m * count, n, eff.num_sms) if count > 1 else \
        wave_efficiency(m, n, eff.num_sms)
    sat = flops / (flops + eff.gemm_half_flops)
    return flops / (peak_flops * eff.gemm_max_fraction * wave * sat) + eff.kernel_s


def megatron_fused_softmax(micro_batch: int, heads_per_rank: int, seq_len: int,
                           dtype: str) -> bool:
    """Whether Megatron's fused scale-mask-softmax kernel runs for these scores.

    Megatron-LM's ``FusedScaleMaskSoftmax.is_kernel_available`` takes the fused CUDA kernel
    only for 16-bit input with ``16 < s <= 4096``, ``s % 4 == 0`` and ``b · np % 4 == 0``
    (b the micro-batch, np the heads per TP rank; the causal kernel's 4 batches per block).
    Otherwise it falls back to five PyTorch kernels in fp32 (cast, scale, mask, softmax,
    cast back; query-key layer scaling forces fp32), which matter where a step is bound by
    kernel launches.

    >>> megatron_fused_softmax(2, 2, 1024, "fp16"), megatron_fused_softmax(1, 2, 1024, "fp16")
    (True, False)
    """
    return (dtype in ("fp16", "bf16") and 16 < seq_len <= 4096 and seq_len % 4 == 0
            and micro_batch * heads_per_rank % 4 == 0)


def torch_cp_merge_bytes(cp: int) -> tuple[int, int]:
    """(forward, backward) bytes per element of a rank's attention output that PyTorch's
    context-parallel SDPA moves beside its ``cp`` attention kernels, on the last CP rank
    (the one whose every block after the first is a full one, so it sets the ring's pace).

    Counted op by op from ``_templated_ring_attention`` and its backward in PyTorch's
    ``torch/distributed/tensor/experimental/_attention.py`` (the merger and the two-chunk
    load balancing that PyTorch PR #132442 added in August 2024, as the stored 2025 source
    has them; the torchtitan benchmarks ran torch 1963fc8 of December 2024):
    ``convert_to_f32`` keeps the merged output and the gradients in fp32, bf16 in and out.
    Per element E of the output (b·(s/cp) queries × the rank's query heads × head width):

    ==============================================  ====================  ==================
    op                                              bytes per E           how often
    ==============================================  ====================  ==================
    pack K, V for the next rank (``cat``)           read 4, write 4 = 8   blocks 0 .. cp−2
    block output to fp32                            read 2, write 4 = 6   every block
    merge ``out − σ(lse_b − lse)·(out − out_b)``    12 + 8 + 12 = 32      blocks 1 .. cp−1
    merged output back to bf16                      read 4, write 2 = 6   once
    backward: zero dQ, dK, dV (fp32)                write 12              once
    dK, dV += (first block: full)                   2 × 10 = 20           block 0
    dK, dV += (later blocks: half, then ``cat``)    2 × (5 + 8) = 26      blocks 1 .. cp−1
    pack dK, dV for the next rank (fp32 ``cat``)    read 8, write 8 = 16  every block
    dQ +=                                           read 6, write 4 = 10  every block
    pack K, V for the next rank                     8                     blocks 0 .. cp−2
    dQ, dK, dV back to bf16                         6 + 12 = 18           once
    ==============================================  ====================  ==================

    Forward: 8(cp − 1) + 6cp + 32(cp − 1) + 6 = 46cp − 34; backward: 12 + 20 + 26(cp − 1)
    + 26cp + 8(cp − 1) + 18 = 60cp + 16.

    These are the eager kernels, counted like every other memory-bound op of the block (the
    model costs no framework's kernel fusion). Under torch.compile (torchtitan compiles each
    block with ``fullgraph=True``) the pointwise merge of a block can run as one kernel that
    reads the block output and the fp32 accumulator and writes it back, about 10cp + 6
    forward and 28cp + 12 backward: a lower bound.

    >>> torch_cp_merge_bytes(2), torch_cp_merge_bytes(8)
    ((58, 136), (334, 496))
    """
    if cp < 2:
        return 0, 0
    return 46 * cp - 34, 60 * cp + 16


def eager_pointwise_bytes(model: ModelSpec, tokens: int, replicated: int, tp: int) -> int:
    """Forward HBM bytes one block's pointwise ops move in eager PyTorch beyond the fused
    kernels the block's other ops are costed as (torch.compile / inductor fuses each chain
    into one read and one write), for ``tokens`` TP-sharded and ``replicated`` tokens of the
    norms' (sequence-parallel) region, bf16 activations. The eager chains, as torchtitan's
    Llama model runs them (``torchtitan/models/llama3/model.py``) on PyTorch's composite ops:

    * RMSNorm (``nn.RMSNorm``, ATen's composite ``rms_norm``: the input upcast to fp32,
      ``pow``, ``mean``, ``mul`` by the ``rsqrt``, back to bf16, ``mul`` by the weight): per
      element 6 + 8 + 4 + 8 + 6 + 4 = 36 bytes against the fused 4; two per block;
    * rotary embedding of q and k (``apply_rotary_emb``: ``float()``, complex ``mul``,
      ``type_as``): 6 + 8 + 6 = 20 bytes per element of q and k, against a fused 4;
    * SwiGLU (``silu(w1 x) * w3 x``): ``silu`` 4 and ``mul`` 6 bytes per element of the hidden
      width, against the fused 6.

    >>> from planner.presets import load_model
    >>> m = load_model("llama3-8b")
    >>> # one token, tp 1: 2 x 32 x 4096 + 16 x (4096 + 1024) + 4 x 14336
    >>> eager_pointwise_bytes(m, 1, 1, 1)
    401408
    """
    norms = 2 * (36 - 4) * replicated * model.hidden
    rope = (20 - 4) * tokens * (model.num_heads * model.head_dim + model.kv_hidden) // tp
    swiglu = (10 - 6) * tokens * model.ffn_hidden // tp if model.activation == "swiglu" else 0
    return norms + rope + swiglu


def layer_forward_ops(model: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                      attention: Attention, dtype: str, cp: int = 1,
                      cp_attention: CpAttention = "ring",
                      eager_pointwise: bool = False) -> list[Op]:
    """Forward ops of one block on one TP rank (see the module table).

    With context parallelism (``cp`` > 1) the rank holds T = b·s/cp tokens of each sequence
    and its queries meet all s keys, block by block as the key/value ring passes (Liu et al.
    2023, "Ring Attention"); with two balanced chunks per rank the causal half is the same on
    every rank, so attention FLOPs are 1/cp of the whole. PyTorch's context-parallel SDPA
    (``cp_attention='pytorch'``) adds one memory-bound op, ``cp-merge``: its fp32 merges of
    the blocks' partial outputs and gradients (`torch_cp_merge_bytes`). ``eager_pointwise``
    (a model run without torch.compile) adds ``eager-pointwise``, the unfused pointwise
    chains' extra traffic (`eager_pointwise_bytes`).
    """
    s, h, f, kv = model.seq_len, model.hidden, model.ffn_hidden, model.kv_hidden
    t, d = micro_batch * s // cp, DTYPE_BYTES[dtype]
    q = s // cp  # queries of one sequence on this rank
    rep = t // tp if sequence_parallel else t  # tokens of the replicated (non-TP) region
    heads = model.num_heads // tp
    ops = [Op("norm1", bytes=2 * rep * h * d),
           Op("qkv", m=t, n=(h + 2 * kv) // tp, k=h)]
    if attention in ("flash", "flash-triton"):
        # Causal FlashAttention skips the masked upper half of the score blocks.
        ops.append(Op("attn-core", flops=2 * t * s * h / tp,
                      rate=TRITON_FLASH_RATE if attention == "flash-triton" else 1.0))
    else:
        scores = micro_batch * heads * q * s
        ops.append(Op("attn-qk", m=q, n=s, k=model.head_dim, count=micro_batch * heads))
        if megatron_fused_softmax(micro_batch, heads, s, storage_dtype(dtype)):
            ops.append(Op("attn-softmax", bytes=2 * scores * d))
        else:
            # The unfused fallback in fp32: cast up, scale, mask, softmax, cast down.
            ops += [Op("attn-softmax-cast", bytes=scores * (d + 4)),
                    Op("attn-softmax-scale", bytes=8 * scores),
                    Op("attn-softmax-mask", bytes=8 * scores),
                    Op("attn-softmax", bytes=8 * scores),
                    Op("attn-softmax-uncast", bytes=scores * (4 + d))]
        ops += [Op("attn-dropout", bytes=2 * scores * d + scores),
                Op("attn-av", m=q, n=model.head_dim, k=s, count=micro_batch * heads)]
    ops += [Op("out-proj", m=t, n=h, k=h // tp),
            Op("dropout-add1", bytes=3 * rep * h * d + rep * h),
            Op("norm2", bytes=2 * rep * h * d)]
    if model.activation == "swiglu":
        ops += [Op("mlp-up", m=t, n=2 * f // tp, k=h), Op("swiglu", bytes=3 * t * f // tp * d)]
    else:
        ops += [Op("mlp-up", m=t, n=f // tp, k=h), Op("gelu", bytes=2 * t * f // tp * d)]
    ops += [Op("mlp-down", m=t, n=h, k=f // tp),
            Op("dropout-add2", bytes=3 * rep * h * d + rep * h)]
    if cp > 1 and cp_attention == "pytorch":
        fwd, bwd = torch_cp_merge_bytes(cp)
        out = t * model.num_heads * model.head_dim // tp  # the rank's attention output
        ops.append(Op("cp-merge", bytes=fwd * out, bwd_bytes=bwd * out))
    if eager_pointwise:
        ops.append(Op("eager-pointwise", bytes=eager_pointwise_bytes(model, t, rep, tp)))
    return ops


def cast_ops(ops: list[Op], dtype: str, block_scaled: bool) -> list[Op]:
    """The quantize ops a low-precision recipe adds for the linear GEMMs of ``ops`` (none for
    bf16): per GEMM (m, n, k) the cast of its input (m×k, fused into the norm before QKV and
    MLP up) forward and of its output gradient (m×n) backward (`planner.precision`).

    >>> ops = [Op("qkv", m=4, n=6, k=8), Op("norm2", bytes=1)]
    >>> [(o.name, o.bytes, o.bwd_bytes) for o in cast_ops(ops, "fp8", True)]
    [('qkv-cast', 32.0, 72.0)]
    """
    r = recipe(dtype)
    if r is None:
        return []
    copies = cast_copies(r, block_scaled)
    return [Op(f"{op.name}-cast", bytes=cast_bytes(r, op.m * op.k * op.count, copies,
                                                   fused_read=op.name in NORM_FUSED_INPUTS),
               bwd_bytes=cast_bytes(r, op.m * op.n * op.count, copies))
            for op in ops if op.name in LOWP_GEMMS]


def lowp_efficiency(eff: Efficiency, device: DeviceProfile, dtype: str) -> Efficiency:
    """The GEMM efficiency of a recipe's linear GEMMs: the bf16 ceiling times
    ``fp8_fraction`` (``fp4_fraction`` for NVFP4) and the saturation point scaled by the
    peak ratio (the same fixed per-GEMM latency at the faster rate, as H100's entry scales
    A100's); ``eff`` itself for bf16.

    >>> e = Efficiency(gemm_max_fraction=0.8, gemm_half_flops=1e9, num_sms=132,
    ...                memory_fraction=0.6, kernel_s=0.0, host_op_s=0.0, fp8_fraction=0.9)
    >>> from simulator.network.hardware import load_device
    >>> f = lowp_efficiency(e, load_device("h100-sxm-80gb"), "fp8")
    >>> round(f.gemm_max_fraction, 3), round(f.gemm_half_flops / 1e9, 3)
    (0.72, 2.001)
    """
    r = recipe(dtype)
    if r is None:
        return eff
    ratio = device.peak(r.peak_key) / device.peak(storage_dtype(dtype))
    frac = eff.fp4_fraction if r.peak_key == "nvfp4" else eff.fp8_fraction
    return dataclasses.replace(eff, gemm_max_fraction=eff.gemm_max_fraction * frac,
                               gemm_half_flops=eff.gemm_half_flops * ratio)


ATTENTION_CORE = ("attn-core", "attn-qk", "attn-softmax", "attn-softmax-cast",
                  "attn-softmax-scale", "attn-softmax-mask", "attn-softmax-uncast",
                  "attn-dropout", "attn-av")


def op_time_s(op: Op, device: DeviceProfile, eff: Efficiency, dtype: str) -> float:
    """Forward device time of ``op``; a linear GEMM of a low-precision recipe runs at the
    recipe's peak and `lowp_efficiency`, every other op in the storage dtype (bf16)."""
    peak = device.peak(storage_dtype(dtype))
    if op.m and op.name in LOWP_GEMMS and recipe(dtype) is not None:
        low = recipe(dtype)
        return gemm_time_s(op.m, op.n, op.k, device.peak(low.peak_key),
                           lowp_efficiency(eff, device, dtype), op.count)
    if op.m:
        return gemm_time_s(op.m, op.n, op.k, peak, eff, op.count)
    if op.flops:
        return op.flops / (peak * attention_peak_fraction(eff) * op.rate) \
            + eff.kernel_s
    return op.bytes / (device.memory_bandwidth_Bps * eff.memory_fraction) + eff.kernel_s


#: The GEMMs next to a block's TP collectives (sequence parallelism), in block order: the
#: all-gather feeds ``qkv``, ``out-proj`` feeds a reduce-scatter, the all-gather feeds
#: ``mlp-up``, ``mlp-down`` feeds a reduce-scatter (Korthikanti et al. 2022, Fig. 5).
TP_GEMMS = ("qkv", "out-proj", "mlp-up", "mlp-down")


@dataclass(frozen=True)
class LayerCompute:
    """Seconds one block takes on one TP rank for one micro-batch.

    fwd_s / bwd_s are device times (bwd without recomputation); attn_core_fwd_s is the part
    of fwd_s that selective recomputation repeats; host_fwd_s / host_bwd_s are CPU launch
    times; kernels_fwd counts forward ops. tp_gemms_s: forward seconds of the four GEMMs a
    tensor-parallel collective feeds or is fed by, in block order (QKV projection, output
    projection, MLP up, MLP down), each as (one GEMM, the same work as ``tp`` row chunks of
    ``m / tp``: micro-pipelined TP's decomposition); empty when the block has no such
    GEMMs or is a mixture of block kinds.
    """

    fwd_s: float
    bwd_s: float
    attn_core_fwd_s: float
    host_fwd_s: float
    host_bwd_s: float
    kernels_fwd: int
    tp_gemms_s: tuple[tuple[float, float], ...] = ()

    def recompute_s(self, recompute: str, full_share: float = 1.0) -> float:
        """Device seconds per block the backward repeats of the forward: ``full_share`` of
        the whole forward under full recomputation (`planner.spec.Plan.full_recompute_share`:
        1 for every block, N/L for the block method's first N of L), the attention core under
        selective (Korthikanti et al. 2022 §4.2), none otherwise.

        >>> lc = LayerCompute(fwd_s=4.0, bwd_s=8.0, attn_core_fwd_s=1.0, host_fwd_s=0.0,
        ...                   host_bwd_s=0.0, kernels_fwd=1)
        >>> lc.recompute_s("full"), lc.recompute_s("full", 0.25), lc.recompute_s("selective")
        (4.0, 1.0, 1.0)
        """
        if recompute == "full":
            return full_share * self.fwd_s
        return self.attn_core_fwd_s if recompute == "selective" else 0.0


@lru_cache(maxsize=4096)
def layer_compute(model: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                  attention: Attention, dtype: str, device: DeviceProfile,
                  eff: Efficiency, cp: int = 1, cp_attention: CpAttention = "ring",
                  eager_pointwise: bool = False) -> LayerCompute:
    """`LayerCompute` of one block (cached: the planner calls it for many plans)."""
    ops = layer_forward_ops(model, micro_batch, tp, sequence_parallel, attention, dtype, cp,
                            cp_attention, eager_pointwise)
    ops += cast_ops(ops, dtype, block_scaled_device(device.peak_flops))
    lc = ops_compute(tuple(ops), device, eff, dtype)
    gemms = {op.name: op for op in ops if op.name in TP_GEMMS}
    if tp == 1 or len(gemms) != len(TP_GEMMS):
        return lc
    chunked = tuple(
        (op_time_s(gemms[name], device, eff, dtype),
         tp * op_time_s(gemms[name]._replace(m=max(1, gemms[name].m // tp)), device, eff,
                        dtype))
        for name in TP_GEMMS)
    return dataclasses.replace(lc, tp_gemms_s=chunked)


def ops_compute(ops: tuple[Op, ...], device: DeviceProfile, eff: Efficiency,
                dtype: str) -> LayerCompute:
    """`LayerCompute` of a block made of forward ``ops``: each op's `op_time_s`, the backward
    as below, host time ``host_op_s`` per op (twice in backward)."""
    fwd = bwd = core = 0.0
    for op in ops:
        t = op_time_s(op, device, eff, dtype)
        fwd += t
        # Backward: two GEMMs per GEMM (dgrad, wgrad); FlashAttention's backward is 2.5x its
        # forward (it recomputes the scores; Dao 2023 §3.1); memory ops move twice the bytes
        # (a cast: the output gradient's cast, ``bwd_bytes``).
        if op.bwd_bytes is not None:
            bwd += op_time_s(op._replace(bytes=op.bwd_bytes), device, eff, dtype)
        else:
            bwd += FLASH_BWD_FLOPS * t if op.flops else 2 * t
        if op.name in ATTENTION_CORE:
            core += t
    host = eff.host_op_s * len(ops)
    return LayerCompute(fwd, bwd, core, host, 2 * host, len(ops))


def edge_compute(model: ModelSpec, micro_batch: int, tp: int, dtype: str,
                 device: DeviceProfile, eff: Efficiency, *, first: bool,
                 last: bool, cp: int = 1) -> tuple[float, float, float]:
    """(forward device s, backward device s, host s) the first / last stage adds: embedding
    lookup (read + write T·h) and position add; final norm, logits GEMM (T, V/tp, h) and the
    vocab-parallel fp32 cross-entropy (3 passes over T·V/tp fp32); T = b·s/cp tokens."""
    t, d = micro_batch * model.seq_len // cp, DTYPE_BYTES[dtype]
    bw = device.memory_bandwidth_Bps * eff.memory_fraction
    fwd = bwd = host = 0.0
    if first:
        fwd += 3 * t * model.hidden * d / bw + 2 * eff.kernel_s
        bwd += 3 * t * model.hidden * d / bw + 2 * eff.kernel_s
        host += 3 * eff.host_op_s
    if last:
        logits = gemm_time_s(t, model.vocab_size // tp, model.hidden,
                             device.peak(storage_dtype(dtype)), eff)
        loss = (2 * t * model.hidden * d + 3 * t * model.vocab_size / tp * 4) / bw \
            + 4 * eff.kernel_s
        fwd += logits + loss
        bwd += 2 * logits + loss
        host += 8 * eff.host_op_s
    return fwd, bwd, host

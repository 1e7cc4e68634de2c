"""Measure this machine's CPU core as a `DeviceProfile` (for the localhost-cpu cluster).

Single-thread fp32 ``torch.matmul`` at a few GEMM shapes gives the FLOP/s one rank gets from
one core; a large tensor copy gives the memory bandwidth. Takes about ``seconds`` in all.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence

import torch

from planner.spec import ModelSpec
from simulator.network.hardware import DeviceProfile

#: Default GEMM shapes (m, k, n): square and tiny-gpt-like (tokens, hidden, 4·hidden).
DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = (
    (512, 512, 512), (1024, 1024, 1024), (256, 256, 1024))


def layer_gemm_shapes(model: ModelSpec, micro_batch: int = 1,
                      tp: int = 1) -> list[tuple[int, int, int]]:
    """GEMM shapes ``(m, k, n)`` of one transformer layer on one TP rank: QKV, attention
    output, MLP up (x2 gated for SwiGLU) and down, with m = micro_batch · seq_len tokens.

    >>> from planner.presets import load_model
    >>> layer_gemm_shapes(load_model("tiny-gpt"))
    [(128, 256, 768), (128, 256, 256), (128, 256, 1024), (128, 1024, 256)]
    """
    tokens, h = micro_batch * model.seq_len, model.hidden
    up = (2 if model.activation == "swiglu" else 1) * model.ffn_hidden // tp
    return [(tokens, h, (h + 2 * model.kv_hidden) // tp), (tokens, h // tp, h),
            (tokens, h, up), (tokens, model.ffn_hidden // tp, h)]


def _time_op(op, seconds: float) -> float:
    # Seconds per call of ``op``: one warm-up, then as many calls as fit in ``seconds``.
    op()
    calls, start = 0, time.perf_counter()
    while True:
        op()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def _total_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 4.0e9


def measure_cpu_profile(shapes: Sequence[tuple[int, int, int]] | None = None,
                        seconds: float = 2.0, *,
                        model: ModelSpec | None = None) -> DeviceProfile:
    """Time single-thread fp32 GEMMs and a 64 MiB copy; return a one-core `DeviceProfile`.

    Args:
        shapes: GEMM shapes ``(m, k, n)``, e.g. `layer_gemm_shapes` of the model to run;
            defaults to the ``model``'s layer shapes (micro-batch 1, tp 1), else
            `DEFAULT_SHAPES`.
        seconds: total time budget (about 3/4 for GEMMs, 1/4 for the copy).
        model: the model whose layer GEMMs to time when ``shapes`` is not given.
    Returns:
        ``peak_flops['fp32']`` = the best GEMM rate measured (2·m·k·n / time);
        ``matmul_efficiency`` = harmonic mean of the rates over the shapes / that best (so the
        given shapes' average speed is reproduced); ``memory_bandwidth_Bps`` = 2·bytes / time of
        the copy (read + write), ``memory_efficiency`` = 1 (already achieved);
        ``memory_bytes`` = physical memory / cores (one rank's share).
    """
    if shapes is None and model is not None:
        shapes = layer_gemm_shapes(model)
    shapes = list(shapes or DEFAULT_SHAPES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = []
        for m, k, n in shapes:
            a, b = torch.randn(m, k), torch.randn(k, n)
            per_call = _time_op(lambda a=a, b=b: torch.matmul(a, b), 0.75 * seconds / len(shapes))
            rates.append(2.0 * m * k * n / per_call)
        src = torch.empty(16 * 2**20)  # 64 MiB of fp32
        dst = torch.empty_like(src)
        per_copy = _time_op(lambda: dst.copy_(src), 0.25 * seconds)
        bandwidth = 2 * src.numel() * src.element_size() / per_copy
    finally:
        torch.set_num_threads(threads)
    best = max(rates)
    return DeviceProfile(
        name="localhost-cpu-core-measured", peak_flops={"fp32": best},
        memory_bytes=_total_memory_bytes() / (os.cpu_count() or 1), memory_bandwidth_Bps=bandwidth,
        matmul_efficiency=min(1.0, statistics.harmonic_mean(rates) / best),
        memory_efficiency=1.0,
        source=f"measured by runtime.calibrate.probe on {platform.processor() or platform.machine()}, "
               f"torch {torch.__version__}, 1 thread, shapes {shapes}")

"""Our tiled attention against ``scaled_dot_product_attention``: values, gradients, memory.

The reference is SDPA in float64 on the same (rounded) inputs; errors are relative to the
largest reference magnitude (at least 1, so an all-zero gradient, e.g. dq at seq 1, passes on
absolute float noise). The Triton kernel runs under Triton's interpreter in a subprocess
(``TRITON_INTERPRET=1`` must be set before ``import triton``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.attention import flash_attention, naive_attention
from runtime.memtrack import PeakTensorBytes

FP32_TOL, BF16_TOL = 1e-5, 2e-2


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = float((got.double() - want).abs().max())
    scale = max(float(want.abs().max()), 1.0)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def check_against_sdpa(b, h, hk, n, d, causal, dtype, tol, **blocks) -> None:
    g = torch.Generator().manual_seed(n * 131 + h * 7 + hk + int(causal))
    q, k, v, do = (torch.randn(b, hh, n, d, generator=g).to(dtype)
                   for hh in (h, hk, hk, h))
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, enable_gqa=hk < h)
    ref.backward(do.double())
    ours_in = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*ours_in, causal=causal, **blocks)
    out.backward(do)
    assert out.dtype == dtype and out.shape == (b, h, n, d)
    assert_close_rel(out.detach(), ref.detach(), tol, "o")
    for name, ours, want in zip("qkv", ours_in, ref_in, strict=True):
        assert ours.grad.dtype == dtype
        assert_close_rel(ours.grad, want.grad, tol, f"d{name}")


@pytest.mark.parametrize("n", [1, 17, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_matches_sdpa_at_odd_lengths(n, causal):
    check_against_sdpa(2, 4, 4, n, 24, causal, torch.float32, FP32_TOL, block_q=96, block_k=40)


def test_strided_inputs_of_several_sequences_match_sdpa():
    # the model passes (B, T, H, d) projections transposed to (B, H, T, d): not contiguous,
    # and with B > 1 their heads do not flatten to a view; gradients against float64 SDPA
    g = torch.Generator().manual_seed(5)
    b, n, h, hk, d = 3, 70, 4, 2, 16
    q, k, v, do = (torch.randn(b, n, hh, d, generator=g).transpose(1, 2)
                   for hh in (h, hk, hk, h))
    assert not q.is_contiguous()
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    ref.backward(do.double())
    leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*(t.transpose(1, 2) for t in leaves), causal=True,
                          block_q=32, block_k=16)
    out.backward(do)
    assert_close_rel(out.detach(), ref.detach(), FP32_TOL, "o")
    for name, ours, want in zip("qkv", leaves, ref_in, strict=True):
        assert_close_rel(ours.grad.transpose(1, 2), want.grad, FP32_TOL, f"d{name}")


@pytest.mark.parametrize("n", [17, 1000])
def test_grouped_query_attention_matches_sdpa(n):
    check_against_sdpa(1, 6, 2, n, 16, True, torch.float32, FP32_TOL, block_q=64, block_k=48)


def test_default_blocks_match_sdpa():
    check_against_sdpa(1, 2, 2, 1000, 32, True, torch.float32, FP32_TOL)


@pytest.mark.parametrize("n", [1, 17, 1000])
def test_bf16_matches_sdpa(n):
    check_against_sdpa(1, 2, 1, n, 16, True, torch.bfloat16, BF16_TOL, block_q=32, block_k=16)


def test_tiles_smaller_than_one_row_block_and_single_key():
    check_against_sdpa(1, 1, 1, 5, 8, True, torch.float32, FP32_TOL, block_q=1, block_k=1)


def test_shape_errors_name_the_shapes():
    q = torch.zeros(1, 3, 4, 8)
    with pytest.raises(ValueError, match=r"multiple of key/value heads \(2\)"):
        flash_attention(q, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="batch, heads, seq, head_dim"):
        flash_attention(q[0], q[0], q[0])


def peak_fwd_bwd_bytes(fn, n: int) -> int:
    q, k, v = (torch.randn(1, 1, n, 32, requires_grad=True) for _ in range(3))
    with PeakTensorBytes() as mem:
        out = fn(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        del out
    return mem.peak_bytes


def test_peak_memory_is_linear_in_sequence_length_and_small_against_naive():
    # Doubling n at most about doubles ours (linear); the naive n x n scores are ~40x ours at 4096.
    ours = {n: peak_fwd_bwd_bytes(flash_attention, n) for n in (1024, 2048, 4096)}
    assert ours[2048] / ours[1024] < 2.3 and ours[4096] / ours[2048] < 2.3
    naive = peak_fwd_bwd_bytes(naive_attention, 4096)
    assert ours[4096] < naive / 8, f"{ours[4096]} vs naive {naive} bytes"


_INTERPRETER_CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from runtime.attention_triton import triton_flash_attention
    worst = 0.0
    for b, h, hk, n, d, causal in [(1, 2, 2, 17, 16, True), (1, 4, 2, 33, 16, False),
                                   (1, 2, 1, 1, 16, True), (2, 2, 2, 64, 16, True),
                                   (1, 2, 2, 40, 12, False)]:
        g = torch.Generator().manual_seed(n)
        q, k, v, do = (torch.randn(b, hh, n, d, generator=g) for hh in (h, hk, hk, h))
        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, enable_gqa=hk < h)
        ref.backward(do.double())
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        out = triton_flash_attention(*ours, causal=causal, block_m=16, block_n=16)
        out.backward(do)
        pairs = [(out.detach(), ref.detach())] + [(a.grad, r.grad) for a, r in zip(ours, ref_in)]
        for got, want in pairs:
            err = float((got.double() - want).abs().max()) / max(float(want.abs().max()), 1.0)
            worst = max(worst, err)
    print("worst", worst)
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (pip install triton) ")
def test_triton_kernel_matches_sdpa_under_the_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    result = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    worst = float(result.stdout.split("worst")[-1])
    assert worst <= FP32_TOL, result.stdout

"""Attention kernels as a framework × GPU-generation fact (presets/attention_kernels.yaml): the
training rate of each kernel from its published forward and backward figures, the kernel a
framework's attention call resolves to per generation, and one layer's attention time with it.
Expected values are worked by hand from the benchmark figures the preset cites."""

import csv

import pytest

from planner.presets import load_model
from planner.spec import Plan, PlanError
from simulator.network.cluster import load_cluster
from simulator.network.hardware import load_device
from simulator.step.breakdown import compute_by_class_s
from simulator.step.compute import (
    Op,
    attention_kernel_rate,
    kernel_training_fraction,
    layer_forward_ops,
    load_efficiency,
    op_time_s,
    with_attention_kernel,
)
from simulator.step.stagecosts import SimOptions
from simulator.validation.carry import case_device
from simulator.validation.validate import read_runs
from tests.simulator.test_validate_benchmarks import HEADER, N283

H100 = load_device("h100-sxm-80gb")
LLAMA8B = load_model("llama3-8b")


def test_training_rate_combines_forward_and_backward():
    # (1 + 2.5) / (1/fwd + 2.5/bwd): a backward of 2.5x the forward's FLOPs at its own rate.
    # FlashAttention-2 on H100 (Shah et al. 2024, Figs. 5-6, mean of 8K and 16K): fwd 334, bwd
    # 320 TFLOP/s: 1/334 = 0.0029940, 2.5/320 = 0.0078125, 3.5 / 0.0108065 = 323.88 TFLOP/s,
    # / 989 = 0.32748 of the H100 peak.
    assert kernel_training_fraction(334, 320, 989) == pytest.approx(0.32748, abs=1e-5)
    # cuDNN on H100: fwd 534, bwd 517: 3.5 / (0.0018727 + 0.0048356) = 521.75, / 989 = 0.52755.
    assert kernel_training_fraction(534, 517, 989) == pytest.approx(0.52755, abs=1e-5)


def test_kernel_rate_lookup_per_framework_and_generation():
    # PyTorch SDPA runs FlashAttention-2 on Hopper at the torch builds of the rows.
    r = attention_kernel_rate("sdpa", "h100-sxm-80gb")
    assert (r.kernel, r.generation) == ("fa2", "hopper")
    assert r.fraction == pytest.approx(0.32748, abs=1e-5)
    # The same chip at 500 W and H200 are Hopper: the same kernel and fraction of their peak.
    assert attention_kernel_rate("sdpa", "h100-sxm-96gb-500w") == r
    assert attention_kernel_rate("sdpa", "h200-sxm-141gb") == r
    # Transformer Engine runs cuDNN on Hopper and Blackwell.
    assert attention_kernel_rate("te-fused", "h200-sxm-141gb").kernel == "cudnn"
    # FlashAttention-3 on H100: fwd 609, bwd 560: 3.5 / (0.0016420 + 0.0044643) = 573.18 / 989.
    assert attention_kernel_rate("fa3", "h100-sxm-80gb").fraction == pytest.approx(0.57955,
                                                                                  abs=1e-5)
    # cuDNN 9.13 on B200: FlashAttention-4's 71% of peak / its 1.3x speed-up = 0.54615, both
    # passes (1228.8 TFLOP/s of 2,250); GB200 is the same Blackwell kernel.
    b = attention_kernel_rate("te-fused", "gb200")
    assert (b.kernel, b.generation) == ("cudnn", "blackwell")
    assert b.fraction == pytest.approx(0.71 / 1.3, abs=1e-4)
    # No published A100 entry, and FlashAttention-3 does not run on Blackwell: the device's
    # efficiency.yaml default applies.
    assert attention_kernel_rate("te-fused", "a100-sxm-80gb") is None
    assert attention_kernel_rate("fa3", "b200-sxm-180gb") is None


def test_unknown_kernel_is_rejected_with_the_names():
    with pytest.raises(PlanError, match=r"attention_kernel='fa9' is not one of \['cudnn', "
                                        r"'fa2', 'fa3', 'sdpa', 'te-fused'\]"):
        SimOptions(attention_kernel="fa9")
    with pytest.raises(PlanError, match="attention_kernel='fa9'"):
        attention_kernel_rate("fa9", "h100-sxm-80gb")


def test_one_layer_attention_time_with_the_kernel():
    # Llama 3 8B, one 8,192-token sequence, tp 1: the causal attention core is
    # 2·T·s·h = 2·8192·8192·4096 = 549,755,813,888 FLOPs.
    eff = load_efficiency("h100-sxm-80gb")
    core = next(o for o in layer_forward_ops(LLAMA8B, 1, 1, False, "flash", "bf16")
                if o.name == "attn-core")
    assert core.flops == 549_755_813_888
    # SDPA's FlashAttention-2: 323.88 TFLOP/s, so 5.49756e11 / 3.2388e14 = 1.69741 ms plus
    # the 8.851 us kernel time = 1.70626 ms (flash_fraction 0.32748 / 0.713 = 0.45930).
    sdpa = with_attention_kernel(eff, "h100-sxm-80gb", "sdpa")
    assert sdpa.flash_fraction == pytest.approx(0.45930, abs=1e-5)
    assert op_time_s(core, H100, sdpa, "bf16") == pytest.approx(1.70626e-3, rel=1e-4)
    # The device default (0.49 of the 0.713 ceiling: 345.52 TFLOP/s): 1.59108 + 0.00885 ms.
    assert op_time_s(core, H100, eff, "bf16") == pytest.approx(1.59994e-3, rel=1e-4)
    # A GEMM does not move with the attention kernel.
    gemm = Op("qkv", m=8192, n=6144, k=4096)
    assert op_time_s(gemm, H100, sdpa, "bf16") == op_time_s(gemm, H100, eff, "bf16")


def test_simulator_runs_the_options_kernel():
    # The step's attention seconds scale by the ratio of the two per-op times above (the same
    # layers, micro-batches and passes): (1.69741 + 0.00885) / (1.59108 + 0.00885) = 1.06646.
    cluster = load_cluster("dgx-h100", nodes=1)
    plan = Plan(tp=1, pp=1, dp=8, micro_batch=1, global_batch=8, dtype="bf16")
    sdpa = compute_by_class_s(LLAMA8B, plan, cluster, SimOptions(attention_kernel="sdpa"))
    default = compute_by_class_s(LLAMA8B, plan, cluster, SimOptions())
    assert sdpa["attention"] / default["attention"] == pytest.approx(1.06646, rel=1e-4)
    assert sdpa["gemm"] == default["gemm"]
    # Unfused attention runs its own GEMMs and softmax: the kernel does not apply.
    unfused = SimOptions(attention="unfused")
    assert compute_by_class_s(LLAMA8B, plan, cluster, unfused) == compute_by_class_s(
        LLAMA8B, plan, cluster, SimOptions(attention="unfused", attention_kernel="sdpa"))


def test_reader_takes_the_framework_kernel_and_flags_it(tmp_path):
    # n283 is a torchtitan row on the 500 W H100: SDPA's FlashAttention-2, flagged.
    path = tmp_path / "bench.csv"
    unknown = {**N283, "id": "x001", "source": "Some lab, internal cluster (2025)"}
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=HEADER)
        w.writeheader()
        w.writerows([{**dict.fromkeys(HEADER, ""), **N283},
                     {**dict.fromkeys(HEADER, ""), **unknown}])
    titan, other = read_runs(path)
    assert titan.options.attention_kernel == "sdpa"
    assert case_device(titan).name == "h100-sxm-96gb-500w"
    assert "attention: fa2 on hopper at 32.7% of peak (sdpa; presets/attention_kernels.yaml)" \
        in titan.flags
    # A source naming no known framework keeps the device's default attention rate.
    assert other.options.attention_kernel is None
    assert not any(f.startswith("attention:") for f in other.flags)

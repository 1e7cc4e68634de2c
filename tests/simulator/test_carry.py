"""Efficiency terms carried across GPU generations: the carry rule, and a fit that recovers a
known ceiling from rows of other GPUs (leave-one-GPU-out)."""

import dataclasses

import pytest

from planner.presets import load_model
from planner.spec import Plan
from simulator.network.hardware import load_device
from simulator.step.compute import Op, attention_peak_fraction, load_efficiency, op_time_s
from simulator.step.stagecosts import SimOptions
from simulator.validation.carry import (
    carried_efficiency,
    case_device,
    fit_carried,
    held_out_errors,
    summarize,
)
from simulator.validation.validate import RunCase, predict


def test_shipped_blackwell_entries_are_the_carry_rule():
    # efficiency.yaml carries H100's entry to B200 and GB200 with the saturation point
    # scaled by the datasheet bf16 peaks (2250 and 2500 vs 989 TFLOP/s) and 148 SMs.
    h100 = load_device("h100-sxm-80gb")
    for name in ("b200-sxm-180gb", "gb200"):
        want = load_efficiency(name)
        got = carried_efficiency(load_efficiency("h100-sxm-80gb"), h100, load_device(name))
        assert got.num_sms == want.num_sms == 148
        assert got.gemm_half_flops == pytest.approx(want.gemm_half_flops, rel=2e-3)
        assert got.gemm_max_fraction == want.gemm_max_fraction
        assert got.flash_fraction == want.flash_fraction


def test_blackwell_ultra_entries_are_the_carry_rule():
    # No B300 / GB300 row exists: their entries are the carry rule applied to their datasheets,
    # 160 SMs (640 tensor cores / 4 per SM, NVIDIA "Inside Blackwell Ultra") and the saturation
    # point scaled by the bf16 peak: 8.372e8 x 2250/989 = 1.905e9 (B300), x 2500/989 = 2.116e9.
    h100 = load_device("h100-sxm-80gb")
    for name, half in (("b300-sxm-288gb", 1.905e9), ("gb300", 2.116e9)):
        want = load_efficiency(name)
        got = carried_efficiency(load_efficiency("h100-sxm-80gb"), h100, load_device(name))
        assert want.num_sms == got.num_sms == 160
        assert want.gemm_half_flops == pytest.approx(half, rel=1e-3)
        assert got.gemm_half_flops == pytest.approx(want.gemm_half_flops, rel=2e-3)
        assert got.flash_fraction == want.flash_fraction == load_efficiency("b200-sxm-180gb").flash_fraction


def test_blackwell_attention_is_cudnns_rate_at_hoppers_share_of_its_benchmark():
    # FlashAttention-4 (Zadouri et al. 2026, abstract): 1,613 TFLOP/s = 71% of the B200 BF16
    # peak, up to 1.3x cuDNN 9.13, so cuDNN's benchmark is 0.71 / 1.3 = 0.5462 of the peak.
    # On Hopper cuDNN's benchmark training rate is 3.5 / (1/534 + 2.5/517) / 989 = 0.52755
    # (Shah et al. 2024, Figures 5-6) and the H100 entry runs at FlashAttention-2's 0.35:
    # training reaches 0.35 / 0.52755 = 0.6634 of the benchmark. On Blackwell: 0.6634 x
    # 0.5462 = 0.3623 of the peak, over the GEMM ceiling 0.713: 0.5082.
    h100 = load_efficiency("h100-sxm-80gb")
    for name in ("b200-sxm-180gb", "gb200"):
        eff = load_efficiency(name)
        assert eff.flash_fraction == pytest.approx(0.35 / 0.52755 * 0.71 / 1.3 / 0.713,
                                                   abs=1e-3)
    assert h100.flash_fraction == pytest.approx(0.35 / 0.713, abs=1e-3)


def test_attention_kernel_rate_is_not_refitted():
    # flash_fraction is the generation's kernel (efficiency.yaml), not a carried term: a refit
    # over every carried term leaves it where the device's own entry puts it.
    cases = _cases(0.55)
    fitted = fit_carried(cases, load_efficiency("h100-sxm-80gb"), load_device("h100-sxm-80gb"),
                         iters=5)
    assert fitted.flash_fraction == load_efficiency("h100-sxm-80gb").flash_fraction
    b200 = carried_efficiency(fitted, load_device("h100-sxm-80gb"), load_device("b200-sxm-180gb"))
    assert b200.flash_fraction == load_efficiency("b200-sxm-180gb").flash_fraction


def test_a_carried_refit_leaves_each_attention_kernel_at_its_benchmark_rate():
    # The fused attention kernel is not a cuBLAS GEMM: under the carry rule its rate is the
    # fraction of the dense peak its device entry states (H100: FlashAttention-2's 35%, 0.49 x
    # the 0.713 ceiling it is stated against; B200: 0.508 x 0.713 = 36.2%), and a refit that
    # moves the one carried GEMM ceiling (here towards 0.55) leaves it there.
    h100, b200 = load_device("h100-sxm-80gb"), load_device("b200-sxm-180gb")
    fitted = fit_carried(_cases(0.55), load_efficiency("h100-sxm-80gb"), h100, iters=40,
                         free=("gemm_max_fraction",))
    assert fitted.gemm_max_fraction == pytest.approx(0.55, rel=0.01)
    on_h100, on_b200 = carried_efficiency(fitted, h100, h100), carried_efficiency(fitted, h100, b200)
    assert attention_peak_fraction(on_h100) == pytest.approx(0.49 * 0.713, rel=1e-9)
    assert attention_peak_fraction(on_b200) == pytest.approx(0.508 * 0.713, rel=1e-9)
    # One causal attention core of 2·T·s·h = 2 x 8192 x 8192 x 4096 = 5.498e11 FLOPs on H100:
    # 5.498e11 / (989e12 x 0.34937) + the 8.851 us kernel time = 1.5999 ms, shipped or refitted.
    core = Op("attn-core", flops=2 * 8192 * 8192 * 4096)
    for eff in (load_efficiency("h100-sxm-80gb"), on_h100):
        assert op_time_s(core, h100, eff, "bf16") == pytest.approx(1.5999e-3, rel=1e-4)
    # A device's own entry (its per-device fit) keeps attention on its own ceiling.
    own = dataclasses.replace(load_efficiency("h100-sxm-80gb"), gemm_max_fraction=0.55)
    assert attention_peak_fraction(own) == pytest.approx(0.49 * 0.55, rel=1e-9)


def _cases(true_fraction: float) -> list[RunCase]:
    # Rows whose "measured" step is the model's own prediction with a known GEMM ceiling:
    # a fit that works must find that ceiling again.
    model = load_model("llama3-8b")
    truth = dataclasses.replace(load_efficiency("h100-sxm-80gb"),
                                gemm_max_fraction=true_fraction)
    cases = []
    for i, (cluster, dtype, dp) in enumerate([("dgx-h100", "bf16", 8), ("dgx-h100", "fp8", 4),
                                               ("dgx-b200", "fp8", 8), ("dgx-b200", "bf16", 4)]):
        plan = Plan(tp=1, pp=1, dp=dp, micro_batch=1, global_batch=2 * dp, dtype=dtype,
                    recompute="full", zero_stage=1)
        case = RunCase(id=f"r{i}", model=model, plan=plan, cluster_name=cluster, nodes=1,
                       options=SimOptions(), overlap_dp=True, reference_step_time_s=1.0)
        dev = case_device(case)
        eff = carried_efficiency(truth, load_device("h100-sxm-80gb"), dev)
        ref = predict(dataclasses.replace(case, options=SimOptions(efficiency=eff)), fast=True)
        cases.append(dataclasses.replace(case, reference_step_time_s=ref))
    return cases


def test_fit_recovers_a_known_ceiling():
    cases = _cases(0.55)
    start = load_efficiency("h100-sxm-80gb")          # 0.713
    fitted = fit_carried(cases, start, load_device("h100-sxm-80gb"), iters=40,
                         free=("gemm_max_fraction",))
    assert fitted.gemm_max_fraction == pytest.approx(0.55, rel=0.01)


def test_leave_one_gpu_out_predicts_the_held_out_gpu_from_the_other():
    cases = _cases(0.55)
    errors = held_out_errors(cases, lambda c: case_device(c).name, iters=40,
                             start=load_efficiency("h100-sxm-80gb"),
                             free=("gemm_max_fraction",))
    # Each GPU's rows are predicted from a ceiling fitted on the other GPU's rows only; the
    # ceiling carries, so the held-out error is small (the start, 0.713, is 30% off).
    assert {e["group"] for e in errors} == {"h100-sxm-80gb", "b200-sxm-180gb"}
    for row in summarize(errors, ["device"]):
        assert row["held_out_mape"] < 0.03, row

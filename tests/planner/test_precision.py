"""Precision recipes: plan ids, device support, cast bytes, GEMM times and weight copies."""

import dataclasses

import pytest

from planner.precision import RECIPES, cast_bytes, search_dtypes, storage_dtype
from planner.presets import load_model
from planner.search import search
from planner.spec import Plan, PlanError
from simulator.network.cluster import load_cluster
from simulator.network.hardware import load_device
from simulator.step.compute import Op, load_efficiency, op_time_s
from simulator.step.memory import memory_per_stage

PLAN = dict(tp=2, pp=1, dp=4, micro_batch=1, global_batch=8)


def test_bf16_plan_id_unchanged_and_recipe_appended():
    # The id format of Plan.id: bf16 adds nothing, a recipe adds its name.
    assert Plan(**PLAN).id == "tp2-pp1-dp4-mb1-gb8"
    assert Plan(**PLAN, dtype="fp8").id == "tp2-pp1-dp4-mb1-gb8-fp8"
    assert Plan(**PLAN, dtype="mxfp8").id.endswith("-mxfp8")


def test_unknown_dtype_names_the_field():
    with pytest.raises(PlanError, match="dtype"):
        Plan(**PLAN, dtype="int4")


@pytest.mark.parametrize("dtype, device", [("fp8", "a100-sxm-80gb"),
                                           ("nvfp4", "h100-sxm-80gb"),
                                           ("mxfp8", "h100-sxm-80gb")])
def test_device_without_the_tensor_cores_is_rejected(dtype, device):
    # A100 datasheet: no FP8; H100 datasheet: FP8 but no FP4 / MX block scaling.
    d = load_device(device)
    with pytest.raises(PlanError, match=rf"dtype={dtype}: {device} has no"):
        search_dtypes(dtype, d.name, d.peak_flops)


def test_any_searches_every_recipe_the_device_runs():
    # B200 datasheet: FP8, MXFP8 (FP8 rate) and FP4 tensor cores.
    b200 = load_device("b200-sxm-180gb")
    assert search_dtypes("any", b200.name, b200.peak_flops) == \
        ["bf16", "fp8", "fp8-current", "mxfp8", "nvfp4"]


def test_cast_bytes_by_hand():
    # 1000 bf16 elements (2 kB): MXFP8 writes 1 B + 1/32 B of E8M0 scale per element, twice
    # (row- and column-wise); no amax pass. NVFP4: 0.5 + 1/16 B, plus one amax read.
    assert cast_bytes(RECIPES["mxfp8"], 1000, 2) == pytest.approx(2000 + 2 * 1031.25)
    assert cast_bytes(RECIPES["nvfp4"], 1000, 2) == pytest.approx(4000 + 2 * 562.5)
    assert cast_bytes(RECIPES["fp8"], 1000, 1, fused_read=True) == pytest.approx(1000)


def test_linear_gemm_runs_at_fp8_peak_attention_and_norms_stay_bf16():
    # A GEMM with no saturation or tail runs at peak x ceiling: at 2x the peak (H100
    # datasheet 1979 vs 989 TFLOP/s) and fp8_fraction of the ceiling it takes
    # 1 / (2 x fp8_fraction) of the bf16 time; a norm and the attention core do not change.
    dev = load_device("h100-sxm-80gb")
    eff = dataclasses.replace(load_efficiency("h100-sxm-80gb"), gemm_half_flops=0.0,
                              kernel_s=0.0, fp8_fraction=0.8)
    gemm = Op("mlp-up", m=132 * 128, n=128, k=8192)
    ratio = op_time_s(gemm, dev, eff, "fp8") / op_time_s(gemm, dev, eff, "bf16")
    assert ratio == pytest.approx(989 / 1979 / 0.8)
    for op in (Op("norm1", bytes=1e6), Op("attn-core", flops=1e12)):
        assert op_time_s(op, dev, eff, "fp8") == op_time_s(op, dev, eff, "bf16")


def test_fp8_weight_and_transpose_copies_in_memory():
    # Hopper: the FP8 weight and its transpose (2 B per linear parameter, tp-sharded);
    # Blackwell (block_scaled): one copy, 1 B.
    model = load_model("llama3-8b")
    bf16 = memory_per_stage(model, Plan(**PLAN))[0].weights_bytes
    fp8 = memory_per_stage(model, Plan(**PLAN, dtype="fp8"))[0].weights_bytes
    fp8_bw = memory_per_stage(model, Plan(**PLAN, dtype="fp8"), block_scaled=True)[0]
    linear = model.layer_matmul_params() * model.num_layers / 2
    assert fp8 - bf16 == pytest.approx(2 * linear)
    assert fp8_bw.weights_bytes - bf16 == pytest.approx(linear)
    assert storage_dtype("fp8") == "bf16"


def test_search_any_ranks_fp8_plans_beside_bf16():
    model = load_model("llama3-8b")
    result = search(model, load_cluster("dgx-h100", nodes=1), global_batch=16, top_k=2,
                    dtype="any")
    assert set(result.ranked["dtype"]) == {"bf16", "fp8", "fp8-current"}
    # FP8 GEMMs at twice the rate: the best plan is a low-precision one.
    assert result.ranked.iloc[0]["dtype"] != "bf16"


def test_plan_cli_refuses_fp8_on_a100_with_exit_2():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "apps.cli", "plan", "--model", "llama3-8b",
                          "--cluster", "dgx-a100", "--nodes", "1", "--dtype", "fp8"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "dtype=fp8: a100-sxm-80gb has no FP8 tensor cores" in " ".join(out.stderr.split())
    assert "Traceback" not in out.stderr

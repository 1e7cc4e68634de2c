"""ZeRO-3 / FSDP gradient reduce-scatters travel in the reduction dtype: fp32 for bf16
training unless the framework reduces in 16 bits (PyTorch FSDP MixedPrecision reduce_dtype;
torchtitan's mixed_precision_reduce = float32, Composer's PURE = bf16), the same convention as
the ZeRO 0-2 gradient reduction."""

import pytest

from planner.mesh import group_ranks
from planner.presets import load_model
from planner.spec import Plan
from simulator.network.cluster import load_cluster
from simulator.network.collectives import collective_time_s
from simulator.step.costs import _zero3_layer_comm
from simulator.step.stagecosts import SimOptions

MODEL = load_model("llama3-8b")
PLAN = Plan(tp=1, pp=1, dp=8, micro_batch=2, global_batch=16, zero_stage=3, dtype="bf16")


def test_reduce_scatter_moves_fp32_gradients_by_default():
    cluster = load_cluster("dgx-h100", nodes=1)
    fwd, bwd = _zero3_layer_comm(MODEL, PLAN, cluster, 0, SimOptions())
    group = group_ranks(PLAN, "dp_cp", stage=0)
    layer = MODEL.layer_params()          # 218.1M parameters per Llama 3 8B block
    assert layer == pytest.approx(218.1e6, rel=1e-3)
    # forward: one all-gather of the bf16 block (2 bytes/param);
    assert fwd == pytest.approx(collective_time_s(cluster, "all_gather", layer * 2, group))
    # backward: the gather again plus the reduce-scatter of fp32 gradients (4 bytes/param).
    assert bwd - fwd == pytest.approx(
        collective_time_s(cluster, "reduce_scatter", layer * 4, group))


def test_bf16_reduce_halves_the_reduce_scatter():
    # A 436-872 MB message is bandwidth-bound: the ring's time is (n-1)/n * bytes / busbw
    # plus a latency term that is microseconds, so halving the bytes about halves the time
    # (a little less than half: the achieved bus bandwidth still rises with message size).
    cluster = load_cluster("dgx-h100", nodes=1)
    f32 = _zero3_layer_comm(MODEL, PLAN, cluster, 0, SimOptions())
    b16 = _zero3_layer_comm(MODEL, PLAN, cluster, 0, SimOptions(grad_reduce_bytes=2))
    assert f32[0] == b16[0]                               # the gathers do not change
    assert 1.9 < (f32[1] - f32[0]) / (b16[1] - b16[0]) <= 2.0


def test_fp16_reduces_in_fp16():
    cluster = load_cluster("dgx-h100", nodes=1)
    plan = PLAN.replace(dtype="fp16")
    fwd, bwd = _zero3_layer_comm(MODEL, plan, cluster, 0, SimOptions())
    assert bwd - fwd == pytest.approx(fwd, rel=1e-6)       # 2 bytes each way

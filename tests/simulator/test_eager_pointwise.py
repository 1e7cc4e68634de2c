"""A model run without torch.compile pays for its unfused pointwise chains (RMSNorm, rotary
embedding, SwiGLU), read from the row's notes."""

import pytest

from planner.presets import load_model
from simulator.network.hardware import load_device
from simulator.step.compute import eager_pointwise_bytes, layer_compute, load_efficiency
from simulator.validation.frameworks import framework

LLAMA8B = load_model("llama3-8b")
DEVICE = load_device("h100-sxm-80gb")
EFF = load_efficiency("h100-sxm-80gb")


def test_eager_block_adds_the_unfused_bytes_at_the_memory_rate_forward_and_twice_backward():
    t = 2 * LLAMA8B.seq_len
    fused = layer_compute(LLAMA8B, 2, 1, False, "flash", "bf16", DEVICE, EFF)
    eager = layer_compute(LLAMA8B, 2, 1, False, "flash", "bf16", DEVICE, EFF,
                          eager_pointwise=True)
    # hand count per token (tp 1): norms 2 x 32 x h, rope 16 x (h + kv), SwiGLU 4 x ffn
    per_token = 2 * 32 * 4096 + 16 * (4096 + 1024) + 4 * 14336
    assert eager_pointwise_bytes(LLAMA8B, t, t, 1) == per_token * t
    one = per_token * t / (DEVICE.memory_bandwidth_Bps * EFF.memory_fraction) + EFF.kernel_s
    assert eager.fwd_s - fused.fwd_s == pytest.approx(one, rel=1e-9)
    assert eager.bwd_s - fused.bwd_s == pytest.approx(2 * one, rel=1e-9)


@pytest.mark.parametrize(("notes", "eager"), [("precision=bf16; torch.compile=False", True),
                                              ("precision=bf16; torch.compile=True", False),
                                              ("", False)])
def test_torchtitan_rows_run_eagerly_only_when_the_notes_say_so(notes, eager):
    values, _ = framework("torchtitan").settings({"notes": notes})
    assert values["eager_pointwise"] is eager

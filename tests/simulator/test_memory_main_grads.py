"""Model-state memory of frameworks that keep fp32 main gradients: Megatron-LM's
bytes-per-parameter table (docs/source/api-guide/dist_optimizer.md): 18 bytes per parameter in
bf16 without the distributed optimizer, 6 + 12/dp with it; 20 in fp16 (also DeepSpeed ZeRO-0),
4 + 16/dp with the distributed optimizer."""

import pytest

from planner.spec import ModelSpec, Plan
from simulator.step.memory import memory_per_stage

# Two layers of h = 1024 with a 4h MLP, no biases counted separately: the exact count does not
# matter, only bytes per parameter, so each check divides by the model's own count.
MODEL = ModelSpec(name="t", num_layers=2, hidden=1024, num_heads=16, num_kv_heads=16,
                  ffn_hidden=4096, vocab_size=32000, seq_len=1024, activation="gelu")


def _state_bytes_per_param(plan, **kw):
    (m,) = memory_per_stage(MODEL, plan, **kw)
    params = m.weights_bytes * (plan.dp if plan.zero_stage >= 3 else 1) / 2  # 16-bit weights
    return (m.weights_bytes + m.gradients_bytes + m.optimizer_bytes) / params


@pytest.mark.parametrize("dtype, zero, dp, expected", [
    ("bf16", 0, 8, 18.0),              # 2 weights + 4 fp32 main grads + 12 Adam
    ("bf16", 1, 8, 6 + 12 / 8),        # distributed optimizer: 7.5
    ("fp16", 0, 8, 20.0),              # Megatron fp16 / DeepSpeed ZeRO-0: 20
    ("fp16", 1, 4, 4 + 16 / 4),        # 8.0
])
def test_megatron_bytes_per_parameter_table(dtype, zero, dp, expected):
    plan = Plan(tp=1, pp=1, dp=dp, micro_batch=1, global_batch=dp, zero_stage=zero,
                dtype=dtype)
    assert _state_bytes_per_param(plan, fp32_main_grads=True) == pytest.approx(expected)


def test_zero_paper_accounting_is_kept_by_default():
    # Rajbhandari et al. 2020 §3.1: 2 + 2 + K with K = 12, i.e. 16 bytes per parameter.
    plan = Plan(tp=1, pp=1, dp=8, micro_batch=1, global_batch=8, zero_stage=0, dtype="bf16")
    assert _state_bytes_per_param(plan) == pytest.approx(16.0)


@pytest.mark.parametrize("zero, dp, expected", [
    (0, 8, 16.0),            # 2 weights + 2 bf16 gradient buffer + 12 Adam (fp32 master + m, v)
    (1, 8, 4 + 12 / 8),      # distributed optimizer: 2 + 2 + 12/8 = 5.5
])
def test_megatron_bf16_gradient_buffer(zero, dp, expected):
    # Megatron-Core DDP with grad_reduce_in_fp32=False keeps the gradient buffer in bf16
    # (DistributedDataParallelConfig): the 18 B (6 + 12/dp) of the table less 2 B.
    plan = Plan(tp=1, pp=1, dp=dp, micro_batch=1, global_batch=dp, zero_stage=zero,
                dtype="bf16")
    assert _state_bytes_per_param(plan, fp32_main_grads=True, main_grad_bytes=2) \
        == pytest.approx(expected)


def test_bf16_gradient_buffer_is_a_megatron_setting_only():
    # Without fp32 main gradients (FSDP2) the gradients are already in the param dtype:
    # the reduction bytes do not change the ZeRO paper's 16.
    plan = Plan(tp=1, pp=1, dp=8, micro_batch=1, global_batch=8, zero_stage=0, dtype="bf16")
    assert _state_bytes_per_param(plan, main_grad_bytes=4) == pytest.approx(16.0)

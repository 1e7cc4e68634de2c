"""Per-op compute: GEMM efficiency by shape, GQA, SwiGLU, attention kinds, recomputation,
sequence parallelism."""

import dataclasses

import pytest

from planner.mesh import group_ranks
from planner.presets import load_model
from planner.spec import Plan
from simulator.network.cluster import load_cluster
from simulator.network.collectives import collective_time_s
from simulator.network.hardware import load_device
from simulator.step.compute import (
    gemm_time_s,
    layer_compute,
    layer_forward_ops,
    load_efficiency,
)
from simulator.step.costs import (
    OVERLAP_COMPUTE_SLOWDOWN,
    SimOptions,
    _zero3_layer_comm,
    stage_costs,
)

A100 = load_device("a100-sxm-80gb")
EFF = load_efficiency("a100-sxm-80gb")
PEAK = A100.peak("bf16")
GPT3 = load_model("gpt3-175b")
LLAMA8B = load_model("llama3-8b")


def _achieved(m, n, k):
    return 2 * m * n * k / gemm_time_s(m, n, k, PEAK, EFF) / PEAK


def test_small_and_skinny_gemms_run_far_below_peak():
    big = _achieved(8192, 8192, 8192)
    assert 0.5 < big <= EFF.gemm_max_fraction
    assert _achieved(256, 256, 256) < 0.2 * big
    assert _achieved(8192, 64, 8192) < 0.8 * big


def test_wave_quantisation_penalises_one_tile_too_many():
    # 108 SMs: 108 tiles of 128x128 fill one wave; 109 need two.
    full = _achieved(128 * 108, 128, 4096)
    over = _achieved(128 * 109, 128, 4096)
    assert over < 0.6 * full


def test_gqa_shrinks_the_qkv_projection():
    mha = LLAMA8B.replace(num_kv_heads=32)
    qkv = {m.num_kv_heads: next(op for op in layer_forward_ops(m, 1, 1, False, "flash", "bf16")
                                if op.name == "qkv") for m in (LLAMA8B, mha)}
    h = LLAMA8B.hidden
    assert qkv[8].n == h + 2 * 8 * LLAMA8B.head_dim and qkv[32].n == 3 * h


def test_swiglu_has_three_matrices_and_gelu_two():
    ops = {op.name: op for op in layer_forward_ops(LLAMA8B, 1, 1, False, "flash", "bf16")}
    assert ops["mlp-up"].n == 2 * LLAMA8B.ffn_hidden and "swiglu" in ops
    gelu = {op.name: op for op in layer_forward_ops(GPT3, 1, 1, False, "flash", "bf16")}
    assert gelu["mlp-up"].n == GPT3.ffn_hidden and "gelu" in gelu


def test_unfused_attention_pays_for_the_score_matrix():
    flash = layer_compute(GPT3, 1, 8, False, "flash", "bf16", A100, EFF)
    unfused = layer_compute(GPT3, 1, 8, False, "unfused", "bf16", A100, EFF)
    assert unfused.attn_core_fwd_s > flash.attn_core_fwd_s


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_adds_the_right_forward_to_the_backward(recompute):
    cluster = load_cluster("dgx-a100", nodes=1)
    base = Plan(tp=8, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="bf16")
    opts = SimOptions(attention="unfused")
    lc = layer_compute(GPT3, 1, 8, False, "unfused", "bf16", A100, EFF)
    none = stage_costs(GPT3, base, cluster, opts)[0]
    more = stage_costs(GPT3, base.replace(recompute=recompute), cluster, opts)[0]
    extra = lc.fwd_s if recompute == "full" else lc.attn_core_fwd_s
    assert more.bwd_compute_s - none.bwd_compute_s == pytest.approx(
        GPT3.num_layers * extra, rel=1e-6)
    assert more.fwd_compute_s == pytest.approx(none.fwd_compute_s)


def test_sequence_parallel_turns_each_all_reduce_into_reduce_scatter_plus_all_gather():
    cluster = load_cluster("dgx-a100", nodes=1)
    plan = Plan(tp=8, pp=1, dp=1, micro_batch=1, global_batch=1, sequence_parallel=True)
    act = GPT3.seq_len * GPT3.hidden * 2
    group = group_ranks(plan, "tp")
    pair = (collective_time_s(cluster, "reduce_scatter", act, group)
            + collective_time_s(cluster, "all_gather", act, group))
    costs = stage_costs(GPT3, plan, cluster)[0]
    assert costs.fwd_comm_s == pytest.approx(GPT3.num_layers * 2 * pair)


def test_zero3_gathers_weights_every_micro_batch_and_overlap_hides_it_when_compute_is_long():
    cluster = load_cluster("dgx-a100", nodes=4)
    z0 = Plan(tp=1, pp=1, dp=32, micro_batch=1, global_batch=32, recompute="full")
    z3 = z0.replace(zero_stage=3)
    slow = cluster.scale_links(bandwidth=0.01)
    hidden = stage_costs(LLAMA8B, z3, cluster)[0]
    exposed = stage_costs(LLAMA8B, z3, slow)[0]
    # Compute outlasts every gather: the first block's gather shows, and each of the other
    # L - 1 gathers slows the block it overlaps by OVERLAP_COMPUTE_SLOWDOWN (Lee et al. 2025).
    g = _zero3_layer_comm(LLAMA8B, z3, cluster, 0, SimOptions())[0]
    # One block's forward gather: Llama 3 8B's 218.1M block parameters in bf16 over the
    # 32-rank dp group (the count is checked in test_fsdp_reduce_dtype.py).
    assert g == pytest.approx(collective_time_s(
        cluster, "all_gather", LLAMA8B.layer_params() * 2, group_ranks(z3, "dp_cp", stage=0)))
    k = OVERLAP_COMPUTE_SLOWDOWN
    assert hidden.fwd_comm_s == pytest.approx(
        stage_costs(LLAMA8B, z0, cluster)[0].fwd_comm_s
        + g + (LLAMA8B.num_layers - 1) * g * k / (1 + k))
    assert exposed.fwd_comm_s > 0 and exposed.bwd_comm_s > exposed.fwd_comm_s


def test_host_bound_micro_batches_take_the_host_time():
    cluster = load_cluster("dgx-a100", nodes=1)
    tiny = load_model("tiny-gpt")
    plan = Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1)
    slow_host = dataclasses.replace(EFF, host_op_s=1e-3)
    costs = stage_costs(tiny, plan, cluster, SimOptions(efficiency=slow_host))[0]
    ops = len(layer_forward_ops(tiny, 1, 1, False, "flash", "bf16"))
    assert costs.fwd_compute_s >= tiny.num_layers * ops * 1e-3


def test_zero3_on_cpu_does_not_overlap_because_gloo_computes_on_the_same_cores():
    cpu = load_cluster("localhost-cpu", ranks=2)
    tiny = load_model("tiny-gpt")
    z3 = Plan(tp=1, pp=1, dp=2, micro_batch=1, global_batch=2, dtype="fp32", zero_stage=3)
    costs = stage_costs(tiny, z3, cpu)[0]
    group = range(2)
    layer_bytes = tiny.layer_params() * 4
    gather = collective_time_s(cpu, "all_gather", layer_bytes, group)
    assert costs.fwd_comm_s == pytest.approx(tiny.num_layers * gather)

"""ZeRO-3 / FSDP overlap, worked by hand: each block's gather is prefetched under the previous
block's compute, which the collective slows by OVERLAP_COMPUTE_SLOWDOWN (Lee et al. 2025,
18.9% mean compute slowdown under overlap); per micro-batch the first gather and the last
reduce-scatter are exposed (Rajbhandari et al. 2020 §5.3; Zhao et al. 2023 §3.3)."""

import pytest

from planner.mesh import group_ranks
from planner.spec import ModelSpec, Plan
from simulator.network.cluster import load_cluster
from simulator.network.collectives import collective_time_s
from simulator.step.costs import (
    OVERLAP_COMPUTE_SLOWDOWN,
    _compute_setup,
    _zero3_layer_comm,
    overlapped_s,
    stage_costs,
    zero3_exposed_s,
)
from simulator.step.stagecosts import SimOptions

K = OVERLAP_COMPUTE_SLOWDOWN


def test_slowdown_is_the_published_mean():
    assert K == 0.189      # Lee et al. 2025 (arXiv 2507.03114), abstract: 18.9% on average


def test_overlap_of_a_short_collective_costs_its_slowed_share():
    # 10 ms of compute, a 4 ms collective beside it at slowdown 0.189: during the 4 ms the
    # compute does 4 / 1.189 = 3.364 ms of work; the other 6.636 ms run after: 10.636 ms.
    assert overlapped_s(10.0, 4.0) == pytest.approx(4.0 + (10.0 - 4.0 / 1.189))
    assert overlapped_s(10.0, 4.0) == pytest.approx(10.636, abs=1e-3)
    # A collective longer than the slowed compute (11.89 ms) sets the time.
    assert overlapped_s(10.0, 12.0) == 12.0


def test_first_gather_and_last_reduce_scatter_are_exposed_once_per_chunk():
    # 48 blocks, gather 15 ms, reduce-scatter 30 ms, 25 ms forward and 50 ms backward per
    # block, no slowdown: every prefetch hides, so a micro-batch exposes one gather (15 ms,
    # forward) and one reduce-scatter (30 ms, backward).
    per_f, per_b, once_f, once_b = zero3_exposed_s(0.015, 0.030, 0.025, 0.050, slowdown=0.0)
    assert 48 * per_f + once_f == pytest.approx(0.015)
    assert 48 * per_b + once_b == pytest.approx(0.030)
    # With the slowdown: 47 prefetch windows each cost 15 · 0.189/1.189 ms forward and
    # 45 · 0.189/1.189 ms backward, on top of the two exposed ends.
    per_f, per_b, once_f, once_b = zero3_exposed_s(0.015, 0.030, 0.025, 0.050)
    assert 48 * per_f + once_f == pytest.approx(0.015 + 47 * 0.015 * K / (1 + K))
    assert 48 * per_b + once_b == pytest.approx(0.030 + 47 * 0.045 * K / (1 + K))


def test_stage_costs_of_a_34b_fsdp_run_across_16_nodes():
    # 34B GQA model (h = 8192, 48 blocks) on 16 DGX A100 nodes, ZeRO-3 over all 128 GPUs.
    m = ModelSpec(name="m34b", num_layers=48, hidden=8192, num_heads=64, num_kv_heads=8,
                  ffn_hidden=22016, vocab_size=32000, seq_len=4096, activation="swiglu")
    cluster = load_cluster("dgx-a100", nodes=16)
    plan = Plan(tp=1, pp=1, dp=128, micro_batch=1, global_batch=1024, zero_stage=3)
    opts = SimOptions()
    g, gs = _zero3_layer_comm(m, plan, cluster, 0, opts)
    rs = gs - g
    # The per-block traffic, by hand: a block of this shape holds 2h² (q, o) + 2·h·(h/8)
    # (k, v with 8 of 64 heads) + 3·h·f (SwiGLU) + 4h (two LayerNorms, the ModelSpec
    # default) = 692.1M parameters; the
    # forward gathers them in bf16 (2 bytes each), the backward gathers them again and
    # reduce-scatters fp32 gradients (4 bytes each), all over the 128-rank dp group.
    h, f = 8192, 22016
    block = 2 * h * h + 2 * h * (h // 8) + 3 * h * f + 4 * h
    assert block == m.layer_params() == 692_092_928
    group = group_ranks(plan, "dp_cp", stage=0)
    assert g == pytest.approx(collective_time_s(cluster, "all_gather", block * 2, group))
    assert rs == pytest.approx(collective_time_s(cluster, "reduce_scatter", block * 4, group))
    _, _, lc, _ = _compute_setup(m, plan, cluster, opts)
    assert g < lc.fwd_s and gs < lc.bwd_s           # every prefetch fits under its block
    costs = stage_costs(m, plan, cluster, opts)[0]
    L = m.num_layers
    assert costs.fwd_comm_s == pytest.approx(g + (L - 1) * g * K / (1 + K), rel=1e-6)
    assert costs.bwd_comm_s == pytest.approx(rs + (L - 1) * gs * K / (1 + K), rel=1e-6)


def test_fsdp2_under_pipelining_gathers_and_reduces_once_per_step():
    # torch.distributed.pipelining keeps FSDP2's weights gathered between micro-batches and
    # reduce-scatters after the last backward only (stage.py backward_maybe_with_nosync):
    # per micro-batch no ZeRO-3 traffic; per step the 16 blocks of a rank reduce-scatter once
    # (beside the last backward, as DP buckets) and gather once, under the first forward.
    m = ModelSpec(name="m", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                  ffn_hidden=14336, vocab_size=128256, seq_len=8192, activation="swiglu")
    cluster = load_cluster("dgx-h100", nodes=4)
    plan = Plan(tp=1, pp=2, dp=16, micro_batch=1, global_batch=128, zero_stage=3)
    every = stage_costs(m, plan, cluster, SimOptions())[0]
    once_opts = SimOptions(zero3_pp_unsharded=True)
    once = stage_costs(m, plan, cluster, once_opts)[0]
    g, gs = _zero3_layer_comm(m, plan, cluster, 0, once_opts)
    held = m.num_layers // plan.pp
    assert every.fwd_comm_s > 0 and once.fwd_comm_s == 0.0 and once.bwd_comm_s == 0.0
    assert every.dp_comm_s == 0.0 and once.dp_comm_s == pytest.approx(held * (gs - g))
    assert once.dp_gather_s == pytest.approx(max(g, held * g - once.fwd_compute_s))

"""PyTorch async TP (micro-pipelined all-gather-matmul / matmul-reduce-scatter): each TP
collective hides only under its own GEMM, and the backward reduce-scatters stay exposed."""

import pytest

from planner.mesh import group_ranks
from planner.presets import load_model
from planner.spec import Plan
from simulator.network.cluster import load_cluster
from simulator.network.collectives import collective_time_s
from simulator.network.hardware import load_device
from simulator.step.compute import layer_compute, load_efficiency
from simulator.step.costs import SimOptions, micro_pipelined_s, stage_costs

LLAMA70B = load_model("llama3-70b")
PLAN = Plan(tp=8, pp=1, dp=1, micro_batch=2, global_batch=2, sequence_parallel=True,
            recompute="none")
CLUSTER = load_cluster("dgx-h100", nodes=1)
DEVICE = load_device("h100-sxm-80gb")
EFF = load_efficiency("h100-sxm-80gb")


def _collectives():
    act = PLAN.micro_batch * LLAMA70B.seq_len * LLAMA70B.hidden * 2
    group = group_ranks(PLAN, "tp")
    return (collective_time_s(CLUSTER, "all_gather", act, group),
            collective_time_s(CLUSTER, "reduce_scatter", act, group))


def test_micro_pipeline_hides_a_transfer_shorter_than_the_gemm_and_exposes_the_rest():
    # Hand-worked: 8 chunks; the pair takes max(chunked, chunked/8 + comm).
    assert micro_pipelined_s(1.0, 8.0, 8.0, 8) == pytest.approx(0.0)
    assert micro_pipelined_s(4.0, 2.0, 2.4, 8) == pytest.approx(0.3 + 4.0 - 2.0)


def test_block_exposure_is_the_sum_over_its_four_gemm_collective_pairs():
    lc = layer_compute(LLAMA70B, PLAN.micro_batch, PLAN.tp, True, "flash", "bf16", DEVICE,
                       EFF)
    ag, rs = _collectives()
    (qkv, qc), (out, oc), (up, uc), (down, dc) = lc.tp_gemms_s
    # forward: every pair fused; backward: the output-gradient all-gathers fused with the
    # output / down projections' dgrad, both reduce-scatters exposed whole
    fwd = sum(max(c, c / 8 + comm) - g for comm, g, c in
              ((ag, qkv, qc), (rs, out, oc), (ag, up, uc), (rs, down, dc)))
    bwd = sum(max(c, c / 8 + ag) - g for g, c in ((out, oc), (down, dc))) + 2 * rs
    costs = stage_costs(LLAMA70B, PLAN, CLUSTER,
                        SimOptions(tp_comm_overlap=True, tp_overlap_kind="async-tp"))[0]
    layers = LLAMA70B.num_layers
    assert costs.fwd_comm_s == pytest.approx(layers * fwd, rel=1e-6)
    assert costs.bwd_comm_s == pytest.approx(layers * bwd, rel=1e-6)


def test_async_tp_exposes_more_than_block_overlap_and_less_than_none():
    def comm(**kw):
        c = stage_costs(LLAMA70B, PLAN, CLUSTER, SimOptions(**kw))[0]
        return c.fwd_comm_s + c.bwd_comm_s

    none = comm()
    block = comm(tp_comm_overlap=True)
    async_tp = comm(tp_comm_overlap=True, tp_overlap_kind="async-tp")
    assert block < async_tp < none
    # the backward reduce-scatters alone stay exposed: a floor of 2 per block
    assert async_tp >= LLAMA70B.num_layers * 2 * _collectives()[1]

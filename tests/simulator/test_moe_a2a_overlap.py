"""The EP all-to-all overlap of Megatron-Core's combined 1F1B (``overlap_moe_expert_parallel_comm``):
a steady-state forward runs beside the backward of another micro-batch and hides its
all-to-alls; the warm-up forwards and cool-down backwards have no partner and show theirs."""

import pytest

from planner.presets import load_model
from planner.spec import Plan
from simulator.network.cluster import load_cluster
from simulator.step.costs import stage_costs
from simulator.step.pipeline import simulate_pipeline, unpaired_passes, warmup_passes
from simulator.step.stagecosts import SimOptions, StageCosts


def test_unpaired_passes_are_the_warm_up_and_cool_down():
    # 1F1B, pp = 2, m = 3: rank 0 warms up with 1 forward; rank 1 (w = 0) runs F0 before its
    # own B0, so its first forward and last backward are alone too. Interleaved pp = 8,
    # v = 4: rank 0 warms up with 2·7 + 3·8 = 38 chunk forwards, rank 7 with 24. GPipe: all.
    assert [unpaired_passes("1f1b", 2, 3, r) for r in (0, 1)] == [1, 1]
    assert warmup_passes("interleaved-1f1b", 8, 128, 0, 4) == 38
    assert [unpaired_passes("interleaved-1f1b", 8, 128, r, 4) for r in (0, 7)] == [38, 24]
    assert unpaired_passes("gpipe", 4, 6, 0) == 6
    assert unpaired_passes("1f1b", 4, 2, 0) == 2      # w = min(3, m) = every pass


def test_unpaired_all_to_all_by_hand():
    # pp = 2, 1F1B, m = 2, F = 1 s, B = 2 s, unpaired all-to-all 0.25 s forward, 0.5 s
    # backward. Rank 0: F0 + 0.25 ends 1.25, F1 ends 2.25. Rank 1: F0 1.25-2.25 + 0.25 ->
    # 2.5, B0 -> 4.5, F1 -> 5.5, B1 -> 7.5 + 0.5 -> 8.0. Rank 0: B0 4.5-6.5, B1 (its gradient
    # arrives at 8.0) -> 10.0 + 0.5 = 10.5 s, against (m + pp - 1)(F + B) = 9 s paired.
    c = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, fwd_unpaired_s=0.25,
                   bwd_unpaired_s=0.5)
    assert simulate_pipeline([c, c], "1f1b", 2).step_time_s == pytest.approx(10.5)
    plain = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0)
    assert simulate_pipeline([plain, plain], "1f1b", 2).step_time_s == pytest.approx(9.0)


def test_only_an_overlapped_moe_plan_has_unpaired_time():
    # DeepSeek-V3 over two DGX H100 nodes (ep = 16, pp = 2): with the overlap an unpaired
    # pass shows what the overlap hid (positive); without it, or for a dense model, nothing.
    m, c = load_model("deepseek-v3"), load_cluster("dgx-h100", nodes=4)
    plan = Plan(tp=1, pp=2, dp=16, ep=16, micro_batch=1, global_batch=64,
                stage_layers=(31, 30))
    deepep = SimOptions(moe_dispatcher="deepep")
    paired = stage_costs(m, plan, c, SimOptions(moe_dispatcher="deepep", moe_a2a_overlap=True))
    alone = stage_costs(m, plan, c, deepep)
    for p, a in zip(paired, alone, strict=True):
        assert p.fwd_unpaired_s > 0 and p.bwd_unpaired_s > 0
        assert p.fwd_comm_s + p.fwd_unpaired_s == pytest.approx(a.fwd_comm_s)
        assert p.bwd_comm_s + p.bwd_unpaired_s == pytest.approx(a.bwd_comm_s)
        assert a.fwd_unpaired_s == a.bwd_unpaired_s == 0.0
    dense = stage_costs(load_model("llama3-8b"), Plan(tp=1, pp=2, dp=16, micro_batch=1,
                                                      global_batch=64), c)
    assert all(s.fwd_unpaired_s == s.bwd_unpaired_s == 0.0 for s in dense)

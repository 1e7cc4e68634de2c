"""Zero-bubble schedules in the SimPy step: orders, bubbles and memory against the papers."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from planner.spec import Plan, PlanError
from simulator.step.stagecosts import StageCosts
from simulator.step.zb_orders import peak_in_flight, rank_order
from simulator.step.zero_bubble import simulate_schedule

#: F = B = W = 1 per chunk, no communication: the units of the papers' bubble formulas.
UNIT = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, wgrad_s=1.0)

TORCH_CLASSES = {"zb-h1": (torch_schedules.ScheduleInterleavedZeroBubble, 1),
                 "interleaved-zb": (torch_schedules.ScheduleInterleavedZeroBubble, 2),
                 "zb-v": (torch_schedules.ScheduleZBVZeroBubble, 2),
                 "dualpipe-v": (torch_schedules.ScheduleDualPipeV, 2)}
TORCH_KIND = {"F": "F", "I": "B", "W": "W", "B": "BW"}


def _torch_order(schedule: str, pp: int, m: int, rank: int) -> list[tuple]:
    # torch's own per-rank order generator, run without building stages or a process group.
    cls, v = TORCH_CLASSES[schedule]
    state = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, n_local_stages=v,
                            num_stages=pp * v, microbatches_per_round=m // max(1, m // pp))
    steps = []
    for action in cls._calculate_single_rank_operations(state, rank):
        if action is not None:
            ops = action.sub_actions or (action,)
            steps.append(tuple((TORCH_KIND[a.computation_type.value], a.stage_index,
                                a.microbatch_index) for a in ops))
    return steps


@pytest.mark.parametrize("schedule", sorted(TORCH_CLASSES))
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (3, 9)])
def test_orders_are_the_ones_torch_runs(schedule, pp, m):
    # Reference: torch 2.13 torch.distributed.pipelining's schedule classes, which the
    # runtime executes; the simulator must model the same op order on every rank.
    v = TORCH_CLASSES[schedule][1]
    for rank in range(pp):
        assert rank_order(schedule, pp, m, rank, v) == _torch_order(schedule, pp, m, rank)


def _span_bubbles(events: list[tuple], pp: int) -> list[float]:
    # Idle compute time of each rank between its first and last op: the bubble the papers
    # count (Qi et al. 2024 Table 2, DeepSeek-V3 report Table 2).
    out = []
    for r in range(pp):
        ops = [e for e in events if e[0] == r and e[1] == "compute"]
        out.append(max(e[4] for e in ops) - min(e[3] for e in ops)
                   - sum(e[4] - e[3] for e in ops))
    return out


def _run(schedule: str, pp: int, m: int, v: int = 1):
    return simulate_schedule([UNIT] * (pp * v), schedule, m, virtual_stages=v, trace=True)


def test_zb_h1_two_stages_four_microbatches_worked_by_hand():
    # By hand, F = B = W = 1, p = 2, m = 4. Rank 0: F0 [0,1] F1 [1,2], idle [2,3] until rank
    # 1's B0 [2,3] arrives, then B0 W0 F2 B1 W1 F3 B2 W2 B3 W3 back to back to 13. Rank 1
    # defers one W: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3, ending at 13 = 3m + (p − 1).
    run = _run("zb-h1", 2, 4)
    assert run.step_time_s == 13.0
    assert _span_bubbles(run.events, 2) == [1.0, 0.0]


@pytest.mark.parametrize("pp", [2, 4, 6])
def test_bubbles_with_unit_times_match_the_papers(pp):
    # F = B = W = 1, m = 3p. Qi et al. 2024 Table 2: 1F1B (p − 1)(F + B + W) = 3(p − 1);
    # ZB-H1 (p − 1)(F + B − W) = p − 1 (DeepSeek-V3 Table 2 writes it (PP − 1)(F + B − 2W)
    # with B the whole backward). Interleaved ZB over v = 2 chunks of F = B = W = 1: the
    # same p − 1 in chunk times. ZB-V (Qi et al. §6): zero bubble when F = B = W.
    # DualPipe-V (DeepSeek-V3 Table 2, PP = 2p stages): (PP/2 − 1)(F&B + B − 3W) with F&B =
    # F + B + W = 3 (no compute overlap), B = 2 (whole backward): (p − 1)·2.
    m = 3 * pp
    expected = {("1f1b", 1): 3 * (pp - 1), ("zb-h1", 1): pp - 1,
                ("interleaved-zb", 2): pp - 1, ("zb-v", 2): 0, ("dualpipe-v", 2): 2 * (pp - 1)}
    for (schedule, v), bubble in expected.items():
        run = _run(schedule, pp, m, v)
        assert max(_span_bubbles(run.events, pp)) == pytest.approx(bubble), schedule


def test_step_time_of_zb_h1_against_1f1b():
    # 1F1B: (m + p − 1)(F + B + W) = 3(m + p − 1) (Narayanan et al. 2021 §2.2); ZB-H1 with the
    # last rank starting (p − 1)F late and never idle after: 3m + (p − 1). p = 4, m = 8.
    assert _run("1f1b", 4, 8).step_time_s == 33.0
    assert _run("zb-h1", 4, 8).step_time_s == 27.0


@pytest.mark.parametrize("pp", [2, 4])
def test_activation_peaks_match_the_papers(pp):
    # Qi et al. 2024 Table 2: ZB-H1 peaks at p micro-batches of a stage, as 1F1B; §6: ZB-V
    # the same, 2p chunk micro-batches of half a stage; DeepSeek-V3 Table 2: DualPipe PP + 1
    # chunk micro-batches with PP = 2p stages.
    m = 4 * pp
    assert max(peak_in_flight(rank_order("zb-h1", pp, m, r)) for r in range(pp)) == pp
    assert max(peak_in_flight(rank_order("zb-v", pp, m, r, 2)) for r in range(pp)) == 2 * pp
    assert peak_in_flight(rank_order("dualpipe-v", pp, m, 0, 2)) == 2 * pp + 1


def test_v_schedules_need_two_chunks():
    with pytest.raises(PlanError, match="schedule='zb-v' places two chunks per rank in a V; "
                                        "use virtual_stages=2, not 1"):
        Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=8, schedule="zb-v")


def test_dualpipe_v_needs_two_microbatches_per_stage():
    with pytest.raises(PlanError, match=r"needs at least 2\*pp = 8 micro-batches \(4 given\)"):
        Plan(tp=1, pp=4, dp=1, micro_batch=1, global_batch=4, schedule="dualpipe-v",
             virtual_stages=2)


@pytest.mark.parametrize("schedule,v", [("zb-h1", 1), ("interleaved-zb", 2), ("zb-v", 2),
                                        ("dualpipe-v", 2)])
def test_closed_form_matches_simpy_on_equal_stages(schedule, v):
    # Reference: the SimPy run of the same orders; with equal stages the sends never contend,
    # so list scheduling must give the same step (and m = 24 > 2p exercises the steady-state
    # extrapolation of the closed form).
    from simulator.step.zero_bubble import estimate_zero_bubble
    c = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.5, wgrad_s=1.0, p2p_fwd_s=0.1,
                   p2p_bwd_s=0.1, optimizer_s=0.3)
    sim = simulate_schedule([c] * (4 * v), schedule, 24, virtual_stages=v)
    step, compute, _ = estimate_zero_bubble([c] * (4 * v), schedule, 24, False, v)
    assert step == pytest.approx(sim.step_time_s)
    assert compute == pytest.approx(sim.compute_s)


def test_a_straggler_slows_both_chunks_of_its_v_rank():
    # ZB-V, p = 2, m = 4, F = B = W = 1: rank 1 holds chunks 1 and 2 (Qi et al. §6). Slowing
    # rank 1 by 2x stretches those chunks only, so the SimPy straggler run and the closed form
    # both equal the plain run of costs with chunks 1 and 2 doubled.
    from simulator.failures.stragglers import estimate_with_stragglers, slowed_costs
    from simulator.step.zero_bubble import estimate_zero_bubble
    plan = Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=4, schedule="zb-v",
                virtual_stages=2)
    slow = StageCosts(fwd_compute_s=2.0, bwd_compute_s=4.0, wgrad_s=2.0)
    assert slowed_costs([UNIT] * 4, (1.0, 2.0), "zb-v") == [UNIT, slow, slow, UNIT]
    step, _, _ = estimate_with_stragglers([UNIT] * 4, plan, {1: 2.0})
    assert step == estimate_zero_bubble([UNIT, slow, slow, UNIT], "zb-v", 4, False, 2)[0]


#: Qi et al. 2024 Figure 3 (bottom), ZB-H2 with p = 4, m = 8: each device's passes in order,
#: micro-batches numbered from 1 (F, B and W read off the figure's colours).
FIGURE3_ZB_H2 = [
    "F1 F2 F3 F4 F5 F6 F7 B1 W1 F8 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7 B8 W8",
    "F1 F2 F3 F4 F5 B1 F6 B2 F7 B3 W1 F8 B4 W2 B5 W3 B6 W4 B7 W5 B8 W6 W7 W8",
    "F1 F2 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 W1 F8 B6 W2 B7 W3 B8 W4 W5 W6 W7 W8",
    "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W1 F8 B8 W2 W3 W4 W5 W6 W7 W8",
]


def test_zb_h2_order_is_figure_3():
    for rank, row in enumerate(FIGURE3_ZB_H2):
        order = rank_order("zb-h2", 4, 8, rank)
        assert " ".join(f"{s[0][0]}{s[0][2] + 1}" for s in order) == row


@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 1.0), (1.2, 1.3, 0.8)])
def test_zb_h2_with_post_validation_has_the_papers_bubble(f, b, w):
    # Qi et al. 2024 Table 2: ZB-H2's bubble is (p − 1)(F + B − 2W), 0 when F = B = W, once the
    # optimizer step no longer synchronises the stages (§4): the longest rank span, minus the
    # m(F + B + W) of work, is that bubble. ZB-H1 keeps (p − 1)(F + B − W). p = 4, m = 12.
    c = StageCosts(fwd_compute_s=f, bwd_compute_s=b + w, wgrad_s=w)
    work = 12 * (f + b + w)
    h2 = simulate_schedule([c] * 4, "zb-h2", 12, post_validation=True).step_time_s
    h1 = simulate_schedule([c] * 4, "zb-h1", 12, post_validation=True).step_time_s
    assert h2 - work == pytest.approx(3 * (f + b - 2 * w))
    assert h1 - work == pytest.approx(3 * (f + b - w))
    assert peak_in_flight(rank_order("zb-h2", 4, 12, 0)) == 2 * 4 - 1  # (2p − 1) M_B


def test_zb_h2_is_never_planned_or_run():
    from planner.planfile import check_runnable
    from planner.space import ZB_H2_REASON
    plan = Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=4, schedule="zb-h2")
    with pytest.raises(PlanError, match="torch.distributed.pipelining has no ZB-H2 schedule"):
        check_runnable(plan)
    assert "simulated only" in ZB_H2_REASON


def test_the_memoised_peak_is_the_peak_of_the_order():
    # ZB-H1 rank 0 holds pp micro-batches at its peak, as 1F1B (Qi et al. 2024, Table 2)
    from simulator.step.zb_orders import peak_in_flight, rank_order, rank_peak_in_flight
    assert rank_peak_in_flight("zb-h1", 4, 8, 0) == 4
    for schedule, v in (("zb-h1", 1), ("interleaved-zb", 2), ("zb-v", 2), ("dualpipe-v", 2)):
        for rank in range(4):
            assert rank_peak_in_flight(schedule, 4, 8, rank, v) == \
                peak_in_flight(rank_order(schedule, 4, 8, rank, v))


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "interleaved-zb", "zb-v", "dualpipe-v"])
def test_the_activation_peak_stops_growing_after_the_warm_up(schedule):
    # the peak of the whole order, built for every m up to 3x the cap, is the cap's: the
    # warm-up (at most 2*pp - 1 micro-batches, ZB-H2) is over long before 8*pp
    from simulator.step.zb_orders import PEAK_SATURATES, _peak, rank_peak_in_flight
    v = {"zb-h1": 1, "zb-h2": 1, "zb-v": 2, "dualpipe-v": 2}.get(schedule, 2)
    for pp in (2, 4):
        cap = PEAK_SATURATES * pp
        for rank in range(pp):
            for m in range(cap, 3 * cap + 1, pp):
                assert _peak(schedule, pp, m, rank, v) == rank_peak_in_flight(
                    schedule, pp, m, rank, v), (pp, rank, m)

"""The SimPy pipeline's exact event log on small schedules, as SimPy's own tests check traces.

Every expected interval is worked out by hand from the schedule rules in
`simulator.step.pipeline` (each test says how): a rank's compute, comm, dp and P2P streams are
resources of capacity one; a receiver waits for the send's end; zero-length work is not logged.
"""

from simulator.step.pipeline import simulate_pipeline
from simulator.step.stagecosts import StageCosts


def test_one_f_one_b_on_two_stages_by_hand():
    # F = 1, B = 2, each send 0.5. Stage 0: F0 0-1, F1 1-2 (warm-up 1, then F1 before B0);
    # stage 1 gets act0 at 1.5: F0 1.5-2.5, B0 2.5-4.5, grad0 reaches stage 0 at 5; F1 4.5-5.5
    # (act1 arrived at 2.5), B1 5.5-7.5, grad1 at 8. Stage 0: B0 5-7, B1 8-10.
    c = StageCosts(fwd_compute_s=1.0, bwd_compute_s=2.0, p2p_fwd_s=0.5, p2p_bwd_s=0.5)
    run = simulate_pipeline([c, c], "1f1b", 2, trace=True)
    assert run.events == [
        (0, "compute", "F0", 0.0, 1.0),
        (0, "p2p", "send-act0", 1.0, 1.5),
        (0, "compute", "F1", 1.0, 2.0),
        (1, "compute", "F0", 1.5, 2.5),
        (0, "p2p", "send-act1", 2.0, 2.5),
        (1, "compute", "B0", 2.5, 4.5),
        (1, "p2p", "send-grad0", 4.5, 5.0),
        (1, "compute", "F1", 4.5, 5.5),
        (0, "compute", "B0", 5.0, 7.0),
        (1, "compute", "B1", 5.5, 7.5),
        (1, "p2p", "send-grad1", 7.5, 8.0),
        (0, "compute", "B1", 8.0, 10.0),
    ]
    assert run.step_time_s == 10.0 and run.critical_stage == 0
    assert run.compute_s == 6.0 and run.comm_s == 0.0


def test_sends_in_one_direction_queue_on_the_stream():
    # GPipe, F = B = 1, a 3 s activation send: act0 1-4; act1 is ready at 2 but the stream is
    # busy until 4, so it runs 4-7. Stage 1: F0 4-5, F1 7-8, B0 8-9, B1 9-10 (free gradient
    # sends); stage 0: B0 9-10, B1 10-11.
    first = StageCosts(fwd_compute_s=1.0, bwd_compute_s=1.0, p2p_fwd_s=3.0)
    last = StageCosts(fwd_compute_s=1.0, bwd_compute_s=1.0)
    run = simulate_pipeline([first, last], "gpipe", 2, trace=True)
    sends = [e for e in run.events if e[1] == "p2p"]
    assert sends == [(0, "p2p", "send-act0", 1.0, 4.0), (0, "p2p", "send-act1", 4.0, 7.0)]
    assert [e for e in run.events if e[0] == 1] == [
        (1, "compute", "F0", 4.0, 5.0), (1, "compute", "F1", 7.0, 8.0),
        (1, "compute", "B0", 8.0, 9.0), (1, "compute", "B1", 9.0, 10.0)]
    assert run.step_time_s == 11.0


def test_gradient_buckets_reduce_beside_the_last_backward():
    # One stage, F = 1, B = 4, a 2 s reduction in 4 buckets, a 1 s optimizer. Bucket i is
    # ready at 1 + (i + 1) and takes 0.5: 2-2.5, 3-3.5, 4-4.5, 5-5.5; the backward ends at 5,
    # the optimizer runs 5.5-6.5 (exposed reduction 0.5, as `exposed_dp_s` says).
    c = StageCosts(fwd_compute_s=1.0, bwd_compute_s=4.0, dp_comm_s=2.0, dp_buckets=4,
                   optimizer_s=1.0)
    run = simulate_pipeline([c], "1f1b", 1, trace=True, overlap_dp=True)
    assert run.events == [
        (0, "compute", "F0", 0.0, 1.0),
        (0, "compute", "B0", 1.0, 5.0),
        (0, "dp", "dp-bucket0", 2.0, 2.5),
        (0, "dp", "dp-bucket1", 3.0, 3.5),
        (0, "dp", "dp-bucket2", 4.0, 4.5),
        (0, "dp", "dp-bucket3", 5.0, 5.5),
        (0, "compute", "optimizer", 5.5, 6.5),
    ]
    assert run.step_time_s == 6.5 and run.comm_s == 0.5

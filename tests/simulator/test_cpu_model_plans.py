"""The calibrated localhost-cpu model on interleaved schedules, selective recomputation and
sequence parallelism: expected values worked out by hand from a small synthetic profile."""

import copy

import pytest

from planner.presets import load_model
from planner.spec import Plan
from runtime.calibrate.calibrate import _terms_from_models, write_profile
from simulator.network.cluster import load_cluster
from simulator.network.cpu_profile import shape_key
from simulator.step.costs import stage_costs
from simulator.step.cpu_model import active_ranks, cpu_stage_costs
from simulator.step.memory import chunk_params, stage_params
from tests.runtime.test_calibrate import _terms, synthetic_profile

TINY = load_model("tiny-gpt")                  # 4 layers, h 256, seq 128
ACTION_S = 5e-4                                # one pipeline action (synthetic)
LINK = {"latency_s": 1e-3, "bandwidth_Bps": 1e9}


def _with_selective(terms: dict) -> dict:
    # selective: forward 1.2x the plain layer forward, backward 2.5x it (plain: 2x)
    fwd = terms["layer_fwd"]
    return terms | {"layer_fwd_selective": {t: 1.2 * v for t, v in fwd.items()},
                    "layer_bwd_selective": {t: 2.5 * v for t, v in fwd.items()}}


def profile(selective: bool = True) -> dict:
    """`synthetic_profile` plus a pipeline action, selective terms, ZeRO-3 and TP + SP."""
    data = copy.deepcopy(synthetic_profile())
    entry = data["cpu_costs"]["compute"][shape_key(TINY)]
    if selective:
        entry["local"] = {k: _with_selective(v) for k, v in entry["local"].items()}
    entry["zero3"] = {"dp2": {2: _terms(1.5)}}
    entry["tp_sp"] = {"tp2": {2: _terms(0.8)}}
    for coll in data["cpu_costs"]["collectives"].values():
        coll["pipeline_action_s"] = ACTION_S
    return data


def _costs(plan: Plan, selective: bool = True):
    path = write_profile(profile(selective))
    return cpu_stage_costs(TINY, plan, load_cluster("localhost-cpu", ranks=plan.world_size,
                                                    cpu_profile=path))


def test_interleaved_chunks_are_stages_of_fewer_layers_that_pay_each_action():
    plan = Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=8, dtype="fp32",
                schedule="interleaved-1f1b", virtual_stages=2)
    costs = _costs(plan)
    # 8 micro-batches x 2 chunks: 2·16/(16 + 1) ranks busy, between the 1- (x1.0) and
    # 2-process (x1.1) terms; a 1-layer chunk at 128 tokens is 10 ms x that scale
    assert active_ranks(plan) == pytest.approx(32 / 17)
    scale = 1.0 + 0.1 * (32 / 17 - 1)
    layer_f, layer_b = 0.01 * scale, 0.02 * scale
    assert len(costs) == 4
    assert costs[0].fwd_compute_s == pytest.approx(layer_f + 1e-4 + ACTION_S)      # + embedding
    assert costs[1].fwd_compute_s == pytest.approx(layer_f + ACTION_S)
    assert costs[2].bwd_compute_s == pytest.approx(layer_b + ACTION_S)
    assert costs[3].fwd_compute_s == pytest.approx(layer_f + (layer_f - 1e-4) + ACTION_S)
    # every chunk boundary sends the (1, 128, 256) fp32 activation: 131,072 B at 1 GB/s
    assert [c.p2p_fwd_s for c in costs] == pytest.approx([1.31072e-4] * 3 + [0.0])
    assert [c.p2p_bwd_s for c in costs] == pytest.approx([0.0] + [1.31072e-4] * 3)
    # once per step on each rank's first chunk: 2 layers of AdamW + its edge share, and the
    # 32-byte loss all-gather (1 ms + 32 B / 1 GB/s); nothing on the later chunks
    emb = TINY.embedding_params() / (TINY.embedding_params() + TINY.vocab_size * TINY.hidden)
    assert costs[0].optimizer_s == pytest.approx(2 * 0.002 + 0.001 * emb)
    assert costs[1].optimizer_s == pytest.approx(2 * 0.002 + 0.001 * (1 - emb))
    assert costs[0].dp_comm_s == pytest.approx(1e-3 + 32 / 1e9)
    assert costs[2].optimizer_s == costs[3].dp_comm_s == 0.0


def test_interleaved_ddp_reduces_each_chunk_module_on_its_rank():
    plan = Plan(tp=1, pp=2, dp=2, micro_batch=1, global_batch=8, dtype="fp32",
                schedule="interleaved-1f1b", virtual_stages=2)
    costs = _costs(plan)
    # rank 0 holds chunks 0 and 2; each DDP module's first 1 MiB bucket and the rest
    # all-reduce apart (alpha-beta: 1 ms + bytes / 1 GB/s), plus the 64-byte all-gather
    grads = [chunk_params(TINY, plan, c) * 4 for c in (0, 2)]
    reduce = sum(1e-3 + 2**20 / 1e9 + 1e-3 + (b - 2**20) / 1e9 for b in grads)
    assert costs[0].dp_comm_s == pytest.approx(reduce + 1e-3 + 64 / 1e9)


def test_chunk_params_of_one_chunk_per_rank_are_the_stage_params():
    plan = Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=8, dtype="fp32")
    assert [chunk_params(TINY, plan, g) for g in range(2)] == pytest.approx(
        [stage_params(TINY, plan, g) for g in range(2)])


def test_selective_recomputation_uses_its_measured_forward_and_backward():
    plan = Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="fp32",
                recompute="selective")
    c, = _costs(plan)
    # 4 layers x 12 ms + embedding 0.1 ms + head (edge 10 ms - embedding)
    assert c.fwd_compute_s == pytest.approx(4 * 0.012 + 1e-4 + (0.01 - 1e-4))
    assert c.bwd_compute_s == pytest.approx(4 * 0.025 + 1e-4 + (0.01 - 1e-4))


def test_selective_under_measured_zero3_adds_the_local_selective_extra():
    plan = Plan(tp=1, pp=1, dp=2, micro_batch=4, global_batch=8, dtype="fp32",
                zero_stage=3, recompute="selective")
    c, = _costs(plan)
    # 512 tokens: the 10 ms / 80 ms points give 40 ms (x scale). ZeRO-3 layer: 60 ms fwd,
    # 120 ms bwd; what selective adds locally at 2 processes (x1.1): 0.2 x 44 = 8.8 ms
    # forward, 0.5 x 44 = 22 ms backward; embedding 0.4 ms, ZeRO-3 edges 60 ms each way
    assert c.fwd_compute_s == pytest.approx(4 * (0.06 + 0.0088) + 4e-4 + (0.06 - 4e-4))
    assert c.bwd_compute_s == pytest.approx(4 * (0.12 + 0.022) + 4e-4 + (0.06 - 4e-4))


def test_sequence_parallel_uses_its_measured_tp_terms():
    plan = Plan(tp=2, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="fp32",
                sequence_parallel=True)
    c, = _costs(plan)
    assert c.fwd_compute_s == pytest.approx(4 * 0.008 + 1e-4 + (0.008 - 1e-4))
    assert c.bwd_compute_s == pytest.approx(4 * 0.016 + 1e-4 + (0.008 - 1e-4))


def test_sequence_parallel_with_dp_adds_fsdp_gathers_to_the_sp_layers():
    plan = Plan(tp=2, pp=1, dp=2, micro_batch=1, global_batch=2, dtype="fp32",
                sequence_parallel=True)
    c, = _costs(plan)
    # the SP terms (measured at 2 processes only, so also at 4), and FSDP2 over dp=2:
    # 4 blocks + the root each all-gather their share of the fp32 weights (1 ms + bytes / 1
    # GB/s), before the forward only (ZeRO-0 keeps them gathered for the backward)
    assert c.fwd_compute_s == pytest.approx(4 * 0.008 + 1e-4 + (0.008 - 1e-4))
    grad_bytes = chunk_params(TINY, plan, 0) * 4
    assert c.fwd_comm_s == pytest.approx(5 * 1e-3 + grad_bytes / 1e9)


@pytest.mark.parametrize("plan", [
    Plan(tp=2, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="fp32",
         sequence_parallel=True, recompute="selective"),
    Plan(tp=2, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="fp32",
         recompute="selective"),                 # the synthetic TP terms have no selective
], ids=lambda p: p.id)
def test_uncalibrated_combinations_fall_back_to_the_generic_model(plan):
    assert _costs(plan) is None
    assert stage_costs(TINY, plan, load_cluster("localhost-cpu", ranks=plan.world_size))


def test_a_profile_without_selective_terms_falls_back():
    plan = Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="fp32",
                recompute="selective")
    assert _costs(plan, selective=False) is None


def test_calibration_derives_selective_layer_terms_from_1_and_3_layer_timings():
    def t(fwd, bwd):
        return {"fwd": fwd, "bwd": bwd, "opt": 0.001}
    timings = {(1, 1, "none"): t(0.011, 0.022), (3, 1, "none"): t(0.031, 0.062),
               (1, 1, "selective"): t(0.013, 0.030), (3, 1, "selective"): t(0.037, 0.080)}
    terms = _terms_from_models(TINY, timings, (1,))
    # (3-layer - 1-layer) / 2 at 128 tokens
    assert terms["layer_fwd"] == pytest.approx({128: 0.01})
    assert terms["layer_fwd_selective"] == pytest.approx({128: 0.012})
    assert terms["layer_bwd_selective"] == pytest.approx({128: 0.025})
    assert "layer_fwd_selective" not in _terms_from_models(
        TINY, {k: v for k, v in timings.items() if k[2] == "none"}, (1,))


def test_an_interleaved_schedule_pays_its_own_measured_action_cost():
    data = profile()
    for coll in data["cpu_costs"]["collectives"].values():
        coll["pipeline_action_interleaved_s"] = 7e-4
    path = write_profile(data)
    v1 = Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=8, dtype="fp32")
    v2 = v1.replace(schedule="interleaved-1f1b", virtual_stages=2)
    cluster = load_cluster("localhost-cpu", ranks=2, cpu_profile=path)
    scale1, scale2 = 1.0 + 0.1 * (16 / 9 - 1), 1.0 + 0.1 * (32 / 17 - 1)   # busy ranks
    assert cpu_stage_costs(TINY, v1, cluster)[1].bwd_compute_s == pytest.approx(
        2 * 0.02 * scale1 + (0.01 * scale1 - 1e-4) + 5e-4)
    assert cpu_stage_costs(TINY, v2, cluster)[1].bwd_compute_s == pytest.approx(
        0.02 * scale2 + 7e-4)


def test_cp_plan_uses_the_measured_ring_layers_not_the_sdpa_ones():
    # cp = 2 on 2 ranks, 2 micro-batches of 4 sequences: the layer terms come from the "cp"
    # entry (the ring on the tiled kernel, synthetic scale 3.0), keyed by the micro-batch's
    # whole b·s = 512 tokens: 0.01·3 + (0.08 − 0.01)·3·(512 − 128)/(1024 − 128) = 0.12 s
    data = profile(selective=False)
    data["cpu_costs"]["compute"][shape_key(TINY)]["cp"] = {"cp2": {2: _terms(3.0)}}
    path = write_profile(data)
    plan = Plan(tp=1, cp=2, pp=1, dp=1, micro_batch=4, global_batch=8, dtype="fp32")
    (c,) = cpu_stage_costs(TINY, plan, load_cluster("localhost-cpu", ranks=2, cpu_profile=path))
    layer_f = 0.03 + 0.21 * 384 / 896                      # 0.12 s
    # the embedding is the rank's 256 tokens (local, 2 processes: x1.1): 1e-4·1.1·256/128;
    # the head is the measured edge (0.12 s) less that
    emb = 1.1e-4 * 2
    assert c.fwd_compute_s == pytest.approx(4 * layer_f + emb + (layer_f - emb))
    assert c.bwd_compute_s == pytest.approx(4 * 2 * layer_f + emb + (layer_f - emb))
    # DDP over the dp·cp = 2 ranks: the 1 MiB bucket and the rest of the fp32 gradients
    # (alpha-beta 1 ms + bytes / 1 GB/s each), plus the 32-byte loss all-gather
    grad = chunk_params(TINY, plan, 0) * 4
    assert c.dp_comm_s == pytest.approx(2e-3 + grad / 1e9 + 1e-3 + 32 / 1e9)
    # the same plan without a "cp" entry is not covered (the generic model takes it)
    assert cpu_stage_costs(TINY, plan, load_cluster(
        "localhost-cpu", ranks=2, cpu_profile=write_profile(profile(selective=False)))) is None


def test_cp_selective_adds_what_the_policy_replays_on_the_ranks_tokens():
    # the cp entry has no selective terms: the plain ring layer (0.12 s fwd, 0.24 s bwd at
    # b·s = 512 tokens, scale 3.0) plus what selective adds locally at the rank's 256 tokens
    # (2 processes, x1.1): local fwd there 1.1·(0.01 + 0.07·128/896) = 0.022 s; selective
    # forward 1.2x (+0.0044 s), backward 2.5x the forward instead of 2x (+0.011 s)
    from simulator.network.cpu_profile import read_profile
    from simulator.step.cpu_model import compute_terms
    data = profile(selective=True)
    data["cpu_costs"]["compute"][shape_key(TINY)]["cp"] = {"cp2": {2: _terms(3.0)}}
    plan = Plan(tp=1, cp=2, pp=1, dp=1, micro_batch=4, global_batch=8, dtype="fp32",
                recompute="selective")
    terms = compute_terms(read_profile(write_profile(data)), TINY, plan)
    assert terms["layer_fwd_selective"] == pytest.approx(0.12 + 0.0044)
    assert terms["layer_bwd_selective"] == pytest.approx(0.24 + 0.011)

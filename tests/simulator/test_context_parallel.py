"""Context parallelism (ring attention): each CP rank holds s/cp tokens of every sequence, the
key/value blocks pass round the cp ring, gradients reduce over dp·cp ranks. Expected values
are hand calculations from the formulas the docstrings cite."""

import pytest

from planner.mesh import group_ranks
from planner.planfile import plan_from_dict
from planner.presets import load_model
from planner.search import search
from planner.space import SearchSpace, enumerate_candidates
from planner.spec import DTYPE_BYTES, ModelSpec, Plan, PlanError, check_plan
from simulator.network.cluster import load_cluster
from simulator.step.compute import layer_forward_ops
from simulator.step.costs import SimOptions, cp_ring_comm, stage_costs
from simulator.step.memory import layer_activation_bytes, memory_per_stage
from simulator.step.simulate import simulate

GPT = ModelSpec(name="gpt", num_layers=8, hidden=4096, num_heads=32, num_kv_heads=32,
                ffn_hidden=16384, vocab_size=51200, seq_len=32768, activation="gelu")


def _plan(cp, **kw):
    base = dict(tp=1, pp=1, dp=1, micro_batch=1, global_batch=4, recompute="selective")
    base.update(kw)
    return Plan(cp=cp, **base)


def test_world_size_id_and_seq_len_check():
    plan = _plan(4, tp=8, dp=2)
    assert plan.world_size == 8 * 4 * 2 and plan.id.startswith("tp8-cp4-pp1-dp2")
    check_plan(GPT, plan)
    odd = GPT.replace(seq_len=32766)     # 32766 / (2*4) is not whole
    with pytest.raises(PlanError, match=r"cp=4 needs seq_len=32766 divisible by 2\*cp = 8"):
        check_plan(odd, plan)
    with pytest.raises(PlanError, match="cp=0"):
        _plan(0)
    # Plan files written before cp existed read as cp = 1.
    assert plan_from_dict({"tp": 2, "pp": 1, "dp": 2, "micro_batch": 1,
                           "global_batch": 2}).cp == 1


def test_cp_ranks_sit_inside_the_dp_axis():
    # Megatron order tp-cp-dp-pp: tp=2 innermost, then cp=2, then dp=2.
    plan = _plan(2, tp=2, dp=2, global_batch=2)
    assert list(group_ranks(plan, "tp")) == [0, 1]
    assert list(group_ranks(plan, "cp")) == [0, 2]
    assert list(group_ranks(plan, "dp")) == [0, 4]
    assert list(group_ranks(plan, "dp_cp")) == [0, 2, 4, 6]


def test_ops_hold_s_over_cp_tokens_and_attend_to_all_keys():
    s, h, b = GPT.seq_len, GPT.hidden, 1
    one = {o.name: o for o in layer_forward_ops(GPT, b, 1, False, "flash", "bf16", cp=1)}
    four = {o.name: o for o in layer_forward_ops(GPT, b, 1, False, "flash", "bf16", cp=4)}
    assert four["qkv"].m == b * s // 4 and four["mlp-up"].m == b * s // 4
    # Causal flash attention, 2·T·s·h FLOPs with T the rank's tokens: 1/cp of the whole.
    assert four["attn-core"].flops == 2 * (b * s // 4) * s * h
    assert four["attn-core"].flops * 4 == one["attn-core"].flops
    # Unfused: the rank's s/cp queries against all s keys.
    qk = {o.name: o for o in layer_forward_ops(GPT, b, 1, False, "unfused", "bf16", cp=4)}
    assert (qk["attn-qk"].m, qk["attn-qk"].n) == (s // 4, s)


def test_activation_memory_is_divided_by_cp():
    # Korthikanti et al. 2022 Table 2 with selective recomputation and tp = 1: 34·s·b·h bytes
    # (16-bit) per layer; with cp ranks each holds s/cp of the tokens.
    s, b, h = GPT.seq_len, 1, GPT.hidden
    assert layer_activation_bytes(GPT, _plan(1)) == 34 * s * b * h
    assert layer_activation_bytes(GPT, _plan(4)) == 34 * (s // 4) * b * h


def test_zero1_shards_optimizer_states_over_dp_times_cp():
    params_bytes = memory_per_stage(GPT, _plan(1, dp=2, zero_stage=1))[0].weights_bytes
    params = params_bytes / DTYPE_BYTES["bf16"]
    cp4 = memory_per_stage(GPT, _plan(4, dp=2, zero_stage=1, global_batch=4))[0]
    assert cp4.optimizer_bytes == pytest.approx(params * 12 / (2 * 4))
    assert cp4.weights_bytes == params_bytes          # weights replicate over cp


def test_ring_hides_under_attention_on_nvlink_and_shows_across_nodes():
    # One layer's ring inside a DGX H100 (NVLink4) is far shorter than the attention it feeds
    # at s = 32768: no exposed communication beyond cp = 1's.
    cluster = load_cluster("dgx-h100", nodes=2)
    opts = SimOptions(dp_bucket_bytes=None)
    cp8 = stage_costs(GPT, _plan(8, tp=1, dp=1), cluster, opts)[0]
    assert cp8.fwd_comm_s == 0.0
    f, b = cp_ring_comm(GPT, _plan(8), cluster, 0)
    assert 0 < f and b == pytest.approx(2 * f, rel=0.05)
    # Spread over 16 ranks of two nodes (tp = 1, cp = 16), every step waits for the NIC hop:
    # the step takes 400 Gb/s, not 450 GB/s, so it is several times slower.
    f16, _ = cp_ring_comm(GPT, _plan(16), cluster, 0)
    block = 2 * (GPT.seq_len // 16) * GPT.kv_hidden * 2
    assert f16 / 15 > block / cluster.nic_bandwidth_Bps


def test_cp_shortens_a_long_sequence_step():
    # Same global batch on 8 H100s: tp = 8 (no cp) vs tp = 1, cp = 8. Both split every GEMM's
    # FLOPs 8 ways, but tp = 8 adds two 8-way all-reduces of the whole 32K-token activation
    # per layer and direction (2 x 256 MiB) where cp = 8 sends 7 K/V blocks of 16 MiB that
    # hide under attention; only its gradient all-reduce over the 8 cp ranks shows.
    cluster = load_cluster("dgx-h100", nodes=1)
    tp8 = simulate(GPT, _plan(1, tp=8), cluster)
    cp8 = simulate(GPT, _plan(8), cluster)
    assert cp8.step_time_s < tp8.step_time_s
    assert 0.0 < cp8.comm_s < tp8.comm_s


def test_planner_searches_cp_for_long_sequences():
    model = load_model("llama3-8b").replace(seq_len=131072)
    cluster = load_cluster("dgx-h100", nodes=4)
    result = search(model, cluster, global_batch=32, top_k=5, explain=False)
    assert result.best.cp > 1
    # Short sequences search cp = 1 only unless asked.
    short = list(enumerate_candidates(load_model("tiny-gpt"), SearchSpace(), devices_per_node=8,
                                      global_batch=8, dtype="bf16", num_devices=8))
    assert {p.cp for p in short if isinstance(p, Plan)} == {1}
    asked = list(enumerate_candidates(load_model("tiny-gpt"), SearchSpace(cp=(2,)),
                                      devices_per_node=8, global_batch=8, dtype="bf16",
                                      num_devices=8))
    assert {p.cp for p in asked if isinstance(p, Plan)} == {2}

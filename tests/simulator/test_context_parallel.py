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


# PyTorch's context-parallel SDPA (torchtitan): hand counts from
# torch/distributed/tensor/experimental/_attention.py and torchtitan's model.py.
LLAMA = ModelSpec(name="llama", num_layers=4, hidden=4096, num_heads=32, num_kv_heads=8,
                  ffn_hidden=14336, vocab_size=128256, seq_len=65536, activation="swiglu")


def test_torch_cp_merge_bytes_counted_op_by_op():
    from simulator.step.compute import torch_cp_merge_bytes
    # cp = 4, bytes per output element E on the last CP rank. Forward: pack K,V for the
    # next rank on blocks 0..2 (3 x 8), every block's output to fp32 (4 x 6), three fp32
    # merge kernels on blocks 1..3 (3 x (12 + 8 + 12)), the merged output back to bf16 (6).
    fwd = 3 * 8 + 4 * 6 + 3 * 32 + 6
    # Backward: zero dQ, dK, dV in fp32 (12), dK,dV += on block 0 (2 x 10) and, half then
    # cat, on blocks 1..3 (3 x 2 x 13), pack dK,dV in fp32 (4 x 16), dQ += (4 x 10), pack
    # K,V (3 x 8), casts back to bf16 (6 + 12).
    bwd = 12 + 20 + 3 * 26 + 4 * 16 + 4 * 10 + 3 * 8 + 18
    assert (fwd, bwd) == (150, 256)
    assert torch_cp_merge_bytes(4) == (fwd, bwd)
    assert torch_cp_merge_bytes(1) == (0, 0)


def test_pytorch_cp_adds_one_merge_op_the_ring_does_not():
    b, cp = 1, 4
    ring = {o.name: o for o in layer_forward_ops(LLAMA, b, 1, False, "flash", "bf16", cp=cp)}
    torch = {o.name: o for o in layer_forward_ops(LLAMA, b, 1, False, "flash", "bf16", cp=cp,
                                                  cp_attention="pytorch")}
    assert set(torch) - set(ring) == {"cp-merge"}
    # E = the rank's 16384 queries x 32 heads x 128: 150 B forward, 256 B backward each.
    e = (LLAMA.seq_len // cp) * 32 * 128
    assert (torch["cp-merge"].bytes, torch["cp-merge"].bwd_bytes) == (150 * e, 256 * e)
    one = layer_forward_ops(LLAMA, b, 1, False, "flash", "bf16", cp=1, cp_attention="pytorch")
    assert "cp-merge" not in {o.name for o in one}


def test_pytorch_cp_gathers_kv_at_the_query_heads_width():
    from simulator.network.collectives import collective_time_s, p2p_time_on_cluster_s
    from simulator.step.costs import torch_cp_comm
    cluster = load_cluster("dgx-h100", nodes=1)
    plan = _plan(4, dp=2, global_batch=2)
    gather, hop = torch_cp_comm(LLAMA, plan, cluster, 0)
    # torchtitan repeats the 8 K/V heads to 32 before SDPA: a rank's K and V are
    # 2 x 16384 tokens x 32 x 128 x 2 B = 268 MB, 4x the ring's GQA block.
    kv = 2 * 16384 * 32 * 128 * 2
    ranks = list(group_ranks(plan, "cp"))
    assert ranks == [0, 1, 2, 3]
    assert gather == collective_time_s(cluster, "all_gather", 4 * kv, ranks)
    # Gradients travel in fp32: twice the bytes, one NVLink hop (450 GB/s, 1 us).
    assert hop == pytest.approx(2 * kv / 450e9 + 1e-6, rel=1e-6)
    assert hop == p2p_time_on_cluster_s(cluster, 2 * kv, 0, 1)


def test_pytorch_cp_hides_the_gather_under_one_block_and_shows_the_last_hop():
    from simulator.step.compute import LayerCompute
    from simulator.step.costs import cp_exposed_s, torch_cp_comm
    cluster = load_cluster("dgx-h100", nodes=1)
    plan, opts = _plan(4, dp=2, global_batch=2), SimOptions(cp_attention="pytorch")
    gather, hop = torch_cp_comm(LLAMA, plan, cluster, 0)
    # Attention 4 x shorter than the gather: each of the 4 blocks takes gather / 16.
    core = gather / 4
    lc = LayerCompute(fwd_s=2 * core, bwd_s=5 * core, attn_core_fwd_s=core, host_fwd_s=0.0,
                      host_bwd_s=0.0, kernels_fwd=1)
    f, b = cp_exposed_s(LLAMA, plan, cluster, 0, lc, opts)
    block_f, block_b = core / 4, 2.5 * core / 4
    assert f == pytest.approx(gather - block_f)
    assert b == pytest.approx(gather - block_b + 3 * max(0.0, hop - block_b) + hop)
    # A long attention hides all but the last gradient hop, awaited after the last block.
    big = LayerCompute(fwd_s=1.0, bwd_s=3.0, attn_core_fwd_s=1.0, host_fwd_s=0.0,
                       host_bwd_s=0.0, kernels_fwd=1)
    assert cp_exposed_s(LLAMA, plan, cluster, 0, big, opts) == (0.0, hop)
    # The ring (the default) compares its hops with the whole core, as before.
    ring_f, _ = cp_ring_comm(LLAMA, plan, cluster, 0)
    assert cp_exposed_s(LLAMA, plan, cluster, 0, lc, SimOptions())[0] == \
        max(0.0, ring_f - core)


def test_cp_attention_is_checked_and_read_from_the_framework_file():
    with pytest.raises(PlanError, match=r"cp_attention='allgather' is not one of"):
        SimOptions(cp_attention="allgather")
    from simulator.validation.frameworks import framework
    from simulator.validation.validate import framework_options
    got = {name: framework_options(framework(name), dict(framework(name).defaults),
                                   overlap_dp=True).cp_attention
           for name in ("torchtitan", "megatron-core", "megatron-lm")}
    assert got == {"torchtitan": "pytorch", "megatron-core": "ring", "megatron-lm": "ring"}


def test_pytorch_cp_merges_are_input_gradient_work_in_zero_bubble_schedules():
    # The fp32 merges sit beside attention, which has no weights: a zero-bubble schedule's W
    # (weight-gradient GEMMs, Qi et al. 2024 §2) takes the same seconds under both exchanges,
    # and all of the merges' backward lands in B.
    cluster = load_cluster("dgx-h100", nodes=1)
    plan = Plan(tp=1, cp=2, pp=2, dp=1, micro_batch=1, global_batch=4, schedule="zb-h1",
                recompute="none")
    ring = stage_costs(LLAMA, plan, cluster, SimOptions())
    torch = stage_costs(LLAMA, plan, cluster, SimOptions(cp_attention="pytorch"))
    for r, t in zip(ring, torch, strict=True):
        assert t.bwd_compute_s > r.bwd_compute_s
        assert t.wgrad_s == pytest.approx(r.wgrad_s, rel=1e-9)

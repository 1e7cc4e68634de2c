"""Mixture-of-experts step costs: all-to-all bytes, expert sharding over edp, grouped GEMMs."""

import pytest

from planner.presets import load_model
from planner.spec import Plan
from simulator.network.cluster import load_cluster
from simulator.network.collectives import collective_time_s
from simulator.step.compute import gemm_time_s, load_efficiency
from simulator.step.memory import memory_per_stage, stage_param_split
from simulator.step.moe import (
    dispatch_bytes_per_rank,
    dispatch_time_s,
    expert_ops,
    node_dedup_factor,
)
from simulator.step.simulate import estimate

MIXTRAL = load_model("mixtral-8x7b")
EXPERT = 3 * 4096 * 14336          # one SwiGLU expert of Mixtral 8x7B: 176,160,768


def _plan(**kw):
    return Plan(**{**dict(tp=1, pp=1, dp=8, micro_batch=1, global_batch=8), **kw})


def test_dispatch_bytes_per_rank_by_hand():
    # tokens*k*hidden*bytes*(ep-1)/ep: 4096 tokens (b=1, s=4096), top-2, h=4096, bf16,
    # ep=8: 4096*2*4096*2*7/8 = 58,720,256 bytes; tp=2 halves the tokens (sequence parallel).
    assert dispatch_bytes_per_rank(MIXTRAL, _plan(ep=8)) == 58_720_256
    assert dispatch_bytes_per_rank(MIXTRAL, _plan(tp=2, dp=4, ep=8)) == 29_360_128
    assert dispatch_bytes_per_rank(MIXTRAL, _plan(ep=1)) == 0


def test_dispatch_is_the_ep_group_all_to_all():
    # One dispatch = the all-to-all of t*k*h*2 bytes per rank over the 8 GPUs of one node
    # (ep=8 sits inside the NVLink domain); the routing imbalance scales the bytes.
    c = load_cluster("dgx-h100", nodes=1)
    size = 4096 * 2 * 4096 * 2
    assert dispatch_time_s(MIXTRAL, _plan(ep=8), c, 0) == \
        collective_time_s(c, "all_to_all", size, range(8))
    assert dispatch_time_s(MIXTRAL, _plan(ep=8), c, 0, imbalance=1.5) == \
        collective_time_s(c, "all_to_all", 1.5 * size, range(8))


def test_cross_node_dispatch_is_slower_than_inside_the_node():
    # ep=16 spans two DGX nodes: half the copies leave through the NICs (50 GB/s per GPU)
    # instead of NVLink (450 GB/s), so one dispatch takes longer per byte.
    c = load_cluster("dgx-h100", nodes=2)
    m = load_model("deepseek-v3")
    inside = dispatch_time_s(m, _plan(dp=16, global_batch=16, ep=8), c, 0)
    across = dispatch_time_s(m, _plan(dp=16, global_batch=16, ep=16), c, 0)
    assert across > 3 * inside


def test_deepep_dedup_factor():
    # Uniform top-2 over 2 nodes: a token touches 2*(1 - 1/4) = 1.5 nodes, so 1.5/2 = 0.75
    # of the copies cross; DeepSeek-V3 at 8 nodes: node-limited to 4 of top-8 -> 0.5.
    assert node_dedup_factor(MIXTRAL, 2) == pytest.approx(0.75)
    assert node_dedup_factor(load_model("deepseek-v3"), 8) == 0.5
    assert node_dedup_factor(MIXTRAL, 1) == 1.0


def test_expert_weights_and_optimizer_shard_over_edp():
    # Mixtral, dp=8, ep=8 -> edp = 1: each rank holds 1 of 8 experts in each of 32 blocks,
    # 32 * 176,160,768 expert parameters, unsharded by ZeRO-1 (edp = 1); the rest (total
    # minus the 256 experts) is sharded over dp = 8. ZeRO paper: 12 optimizer bytes/param.
    dense, experts = stage_param_split(MIXTRAL, _plan(ep=8, zero_stage=1), 0)
    assert experts == 32 * EXPERT
    assert dense == MIXTRAL.num_params() - 32 * 8 * EXPERT
    mem = memory_per_stage(MIXTRAL, _plan(ep=8, zero_stage=1))[0]
    assert mem.optimizer_bytes == pytest.approx(12 * (dense / 8 + experts / 1))
    assert mem.weights_bytes == pytest.approx(2 * (dense + experts))
    # ep=2 -> edp = 4: 4 experts per block per rank, optimizer state over 4 ranks
    dense2, experts2 = stage_param_split(MIXTRAL, _plan(ep=2, zero_stage=1), 0)
    assert experts2 == 32 * 4 * EXPERT
    mem2 = memory_per_stage(MIXTRAL, _plan(ep=2, zero_stage=1))[0]
    assert mem2.optimizer_bytes == pytest.approx(12 * (dense2 / 8 + experts2 / 4))


def test_grouped_gemm_of_small_experts_runs_below_dense_efficiency():
    # Many experts with few tokens each: the (m, 2*f_e, h) GEMM per expert pays for tile
    # quantisation and saturation. Qwen3-30B-A3B at b=1: 4096 tokens x top-8 over 128
    # experts = 256 tokens per expert; per FLOP slower than one GEMM of all 32,768 copies.
    m = load_model("qwen3-30b-a3b")
    ops = {op.name: op for op in expert_ops(m, _plan(ep=1), 1.0)}
    up = ops["expert-up"]
    assert (up.m, up.n, up.k, up.count) == (256, 2 * 768, 2048, 128)
    eff, peak = load_efficiency("h100-sxm-80gb"), 989e12
    grouped = gemm_time_s(up.m, up.n, up.k, peak, eff, up.count)
    single = gemm_time_s(up.m * up.count, up.n, up.k, peak, eff)
    assert grouped >= single


def test_moe_step_pays_for_cross_node_all_to_all():
    # The same DeepSeek-V3 plan with EP inside a node (ep=8) and across 8 nodes (ep=64):
    # the step with the cross-node all-to-all exposes more communication.
    m = load_model("deepseek-v3")
    c = load_cluster("dgx-h100", nodes=64)
    base = dict(tp=1, pp=8, dp=64, micro_batch=1, global_batch=512, zero_stage=1,
                stage_layers=(8, 8, 8, 8, 8, 7, 7, 7))
    near = estimate(m, Plan(**base, ep=8), c)
    far = estimate(m, Plan(**base, ep=64), c)
    assert far.comm_s > near.comm_s


def test_fsdp_holds_two_gathered_blocks_of_local_experts():
    # ZeRO-3 gathers a block before use and prefetches the next: two MoE blocks unsharded.
    # DeepSeek-V3 block: 256 routed experts of 3*7168*2048 = 44,040,192 parameters; with
    # ep=64 a rank gathers its 4 local experts, with ep=1 all 256.
    from simulator.step.memory import zero3_buffer_bytes
    m = load_model("deepseek-v3")
    p = Plan(tp=1, pp=1, dp=64, micro_batch=1, global_batch=64, zero_stage=3)
    routed = 3 * 7168 * 2048
    assert zero3_buffer_bytes(m, p) - zero3_buffer_bytes(m, p.replace(ep=64)) == \
        pytest.approx(2 * (256 - 4) * routed * 2)
    assert zero3_buffer_bytes(m, p.replace(zero_stage=1)) == 0.0


def test_fp8_weight_cache_counts_only_local_experts():
    # A low-precision recipe caches cast copies of the rank's own matrices: for Mixtral at
    # ep=8 one expert per block, not all eight. Going from ep=1 to ep=8 removes 7 of 8
    # experts in each of 32 blocks from weights and from the cast cache alike.
    from simulator.step.memory import weight_cache_bytes_per_param
    base = _plan(ep=1, dtype="fp8")
    w1 = memory_per_stage(MIXTRAL, base)[0].weights_bytes
    w8 = memory_per_stage(MIXTRAL, base.replace(ep=8))[0].weights_bytes
    # the linear weights are held as their casts (planner.precision), not in bf16 as well
    per_param = weight_cache_bytes_per_param("fp8", False)
    assert w1 - w8 == pytest.approx(32 * 7 * EXPERT * per_param)


def test_deepep_inside_one_nvlink_domain_is_its_copy_kernel():
    # DeepEP inside one DGX H100 (ep=8): the 7/8 of t*k*h*2 bytes that leave the rank at
    # 153/160 of 450 GB/s NVLink (DeepEP README, intranode row), plus one 42 us launch.
    # Mixtral b=1: 4096*2*4096*2 = 67,108,864 B; 7/8 -> 58,720,256 B / 430.3125e9 B/s
    # = 136.46 us; + 42 us = 178.46 us.
    c = load_cluster("dgx-h100", nodes=1)
    t = dispatch_time_s(MIXTRAL, _plan(ep=8), c, 0, dispatcher="deepep")
    assert t == pytest.approx(58_720_256 / (450e9 * 153 / 160) + 42e-6, rel=1e-9)
    assert t == pytest.approx(178.46e-6, abs=0.01e-6)
    # Across nodes it stays the node-deduplicated all-to-all over the NICs.
    c2 = load_cluster("dgx-h100", nodes=2)
    m = load_model("deepseek-v3")
    plan = _plan(dp=16, global_batch=16, ep=16)
    size = 4096 * 8 * 7168 * 2 * node_dedup_factor(m, 2)
    assert dispatch_time_s(m, plan, c2, 0, dispatcher="deepep") == \
        collective_time_s(c2, "all_to_all", size, range(16))


def test_fp8_recipe_runs_the_expert_and_mla_gemms_at_its_rate():
    # Under FP8 the routed experts' grouped GEMMs, the shared experts and the MLA
    # projections run at the recipe's peak and efficiency (DeepSeek-V3 report §3.3.1), the
    # router GEMM at bf16; each gets a quantize op whose bytes count every expert.
    from planner.precision import block_scaled_device, cast_bytes, cast_copies, recipe
    from simulator.network.hardware import load_device
    from simulator.step.compute import Op, cast_ops, lowp_efficiency, op_time_s
    dev, eff = load_device("h100-sxm-80gb"), load_efficiency("h100-sxm-80gb")
    up = Op("expert-up", m=1024, n=4096, k=7168, count=4)
    fp8 = gemm_time_s(1024, 4096, 7168, dev.peak("fp8"), lowp_efficiency(eff, dev, "fp8"), 4)
    assert op_time_s(up, dev, eff, "fp8") == fp8
    router = Op("router", m=4096, n=256, k=7168)
    assert op_time_s(router, dev, eff, "fp8") == gemm_time_s(4096, 256, 7168, dev.peak("bf16"),
                                                            eff)
    # Input cast of the 4 experts' 1024 x 7168 inputs: cast_bytes of 4*1024*7168 elements.
    r = recipe("fp8")
    copies = cast_copies(r, block_scaled_device(dev.peak_flops))
    (cast,) = cast_ops([up, router], "fp8", block_scaled_device(dev.peak_flops))
    assert cast.bytes == cast_bytes(r, 4 * 1024 * 7168, copies)
    assert cast.bwd_bytes == cast_bytes(r, 4 * 1024 * 4096, copies)


def test_selective_recompute_repeats_the_named_modules():
    # recompute_modules=['mla_up_proj'] repeats the MLA q / kv up projections (and their
    # casts) instead of the attention core: their forward times summed, by hand from the ops.
    from simulator.network.hardware import load_device
    from simulator.step.compute import op_time_s
    from simulator.step.moe import block_compute, mla_ops
    m, dev = load_model("deepseek-v3"), load_device("h100-sxm-80gb")
    eff = load_efficiency("h100-sxm-80gb")
    plan = _plan(ep=8, recompute="selective")
    up = sum(op_time_s(op, dev, eff, "bf16") for op in mla_ops(m, 4096, 1, "bf16")
             if op.name in ("mla-q-up", "mla-kv-up"))
    lc = block_compute(m, plan, "flash", dev, eff, True, recompute_modules=("mla_up_proj",))
    assert lc.attn_core_fwd_s == pytest.approx(up, rel=1e-12)
    core = block_compute(m, plan, "flash", dev, eff, True)
    attn = next(op for op in mla_ops(m, 4096, 1, "bf16") if op.name == "attn-core")
    assert core.attn_core_fwd_s == pytest.approx(op_time_s(attn, dev, eff, "bf16"))
    # Unknown module names fail with the choices.
    from planner.spec import PlanError
    from simulator.step.stagecosts import SimOptions
    with pytest.raises(PlanError, match="recompute_modules"):
        SimOptions(recompute_modules=("attention",))


def test_small_expert_weight_gradients_pay_for_their_accumulation():
    # The backward of a block with 32 local experts of m = 1024 copies (DeepSeek-V3 at ep=8,
    # b=1) adds, per expert GEMM, the 8 B per weight element of the gradient accumulation
    # beyond its wgrad compute; with 4 experts of m = 8192 (ep=64) the GEMMs stay
    # compute-bound and nothing is added. By hand (H100: 3.35 TB/s x 0.6222):
    # up 32 x 4096 x 7168 x 8 B = 7.516 GB -> 3.606 ms, down 32 x 7168 x 2048 x 8 B
    # = 3.758 GB -> 1.803 ms, each less its own wgrad (= forward) GEMM time.
    from simulator.network.hardware import load_device
    from simulator.step.compute import op_time_s, ops_compute
    from simulator.step.moe import block_compute, wgrad_accumulation_excess_s
    m, dev = load_model("deepseek-v3"), load_device("h100-sxm-80gb")
    eff = load_efficiency("h100-sxm-80gb")
    plan = _plan(ep=8)
    ops = {op.name: op for op in expert_ops(m, plan, 1.0)}
    up, down = ops["expert-up"], ops["expert-down"]
    assert (up.m, up.count, down.m) == (1024, 32, 1024)
    bw = 3.35e12 * eff.memory_fraction
    want = sum(max(0.0, 8 * op.count * op.n * op.k / bw - op_time_s(op, dev, eff, "bf16"))
               for op in (up, down))
    assert 8 * 32 * 4096 * 7168 / bw == pytest.approx(3.606e-3, rel=1e-3)
    # The GEMMs at 989 TF x 0.713: up 1.924 TFLOP -> 2.726 ms, down 0.962 TFLOP -> 1.364 ms,
    # so 0.880 + 0.439 = 1.319 ms of excess before wave quantisation (which slows the GEMMs
    # and leaves a little less).
    assert want == pytest.approx(1.319e-3, rel=0.06)
    lc = block_compute(m, plan, "flash", dev, eff, True)
    assert wgrad_accumulation_excess_s(up, op_time_s(up, dev, eff, "bf16"), dev, eff) \
        + wgrad_accumulation_excess_s(down, op_time_s(down, dev, eff, "bf16"), dev, eff) \
        == pytest.approx(want)
    wide = _plan(dp=64, global_batch=64, ep=64)
    big = {op.name: op for op in expert_ops(m, wide, 1.0)}["expert-up"]
    assert big.m == 8192
    assert wgrad_accumulation_excess_s(big, op_time_s(big, dev, eff, "bf16"), dev, eff) == 0.0
    # The block's backward is the ops' backward plus exactly that excess.
    from simulator.step.moe import block_ops
    base = ops_compute(tuple(block_ops(m, plan, "flash", dev, True)), dev, eff, "bf16")
    assert lc.bwd_s == pytest.approx(base.bwd_s + want, rel=1e-12)


def test_fp8_keeps_the_expert_inputs_as_their_casts():
    # Mixtral 8x7B, b=1, ep=8 (4096 tokens, 8192 copies, no shared experts): bf16 stores
    # 4096*(2*4096 + 4*8) + 8192*(4*4096 + 6*14336) - 4096*(3*4096 + 6*14336) = 469,893,120 B
    # beyond the dense block; FP8 keeps each copy's permuted input (4096) and activation
    # output (14336) at 1 B instead of 2 and gives back the dense MLP-down input the dense
    # saving took off (4096*14336): 469,893,120 - (8192*18432 - 4096*14336) = 377,618,432.
    from simulator.step.moe import activation_delta_bytes
    p = _plan(ep=8)
    assert activation_delta_bytes(MIXTRAL, p) == 469_893_120
    assert activation_delta_bytes(MIXTRAL, p.replace(dtype="fp8")) == 377_618_432
    assert activation_delta_bytes(MIXTRAL, p.replace(dtype="fp8", recompute="full")) == 0


def test_output_discarding_recompute_keeps_fewer_activations():
    # Selective recomputation of ['moe_act', 'layernorm'] on Mixtral 8x7B, b=1, ep=8, FP8:
    # per block the two norm outputs (4096 tokens x 2 x 4096 x 1 B = 33,554,432) and per
    # MoE block each copy's activation output (8192 x 14336 x 1 B = 117,440,512) are not
    # kept; 32 MoE blocks on one stage with one micro-batch in flight (pp=1):
    # 32 x 150,994,944 = 4,831,838,208 B less than without the modules.
    from simulator.step.moe import selective_saving_bytes
    p = _plan(ep=8, dtype="fp8", recompute="selective")
    mods = ("moe_act", "layernorm")
    assert selective_saving_bytes(MIXTRAL, p, mods, True) == 33_554_432 + 117_440_512
    assert selective_saving_bytes(MIXTRAL, p, mods, False) == 33_554_432
    assert selective_saving_bytes(MIXTRAL, p.replace(recompute="none"), mods, True) == 0
    plain = memory_per_stage(MIXTRAL, p, attention="flash")[0].activations_bytes
    light = memory_per_stage(MIXTRAL, p, attention="flash",
                             recompute_modules=mods)[0].activations_bytes
    assert plain - light == 32 * 150_994_944


def test_reader_reaches_for_the_light_moe_recompute_before_full():
    # An MoE plan that does not fit without recomputation but fits once the norms and the
    # experts' activation are recomputed gets selective ['moe_act', 'layernorm'], not full.
    from simulator.step.stagecosts import SimOptions
    from simulator.validation.memory_default import MOE_LIGHT_RECOMPUTE, recompute_that_fits
    p = _plan(ep=8, dtype="fp8")
    o = SimOptions(attention="flash")
    need = memory_per_stage(MIXTRAL, p, attention="flash")[0].total_bytes
    light = memory_per_stage(MIXTRAL, p.replace(recompute="selective"), attention="flash",
                             recompute_modules=MOE_LIGHT_RECOMPUTE)[0].total_bytes
    assert light < need
    plan, opts, flag = recompute_that_fits(MIXTRAL, p, o, (light + need) / 2)
    assert (plan.recompute, opts.recompute_modules) == ("selective", MOE_LIGHT_RECOMPUTE)
    assert "moe_act" in flag
    plan, opts, flag = recompute_that_fits(MIXTRAL, p, o, need)
    assert (plan, opts, flag) == (p, o, None)


def test_overlapped_all_to_all_pays_for_the_dispatcher_sms():
    # Beside another micro-batch's compute, DeepEP's kernels hold 20 of an H100's 132 SMs
    # (DeepEP Buffer.num_sms, Megatron-Core moe_deepep_num_sms): compute C finishes after
    # C + A * 20/132 when the all-to-all A is shorter. By hand: A = 4 ms beside C = 10 ms
    # shows 4 * 20/132 = 0.60606 ms; A = 6.6 ms beside C = 5 ms shows A - C = 1.6 ms.
    from simulator.step.moe import DISPATCHER_SMS, overlapped_exposed_s
    assert DISPATCHER_SMS["deepep"] == 20
    assert overlapped_exposed_s(4e-3, 10e-3, 20 / 132) == pytest.approx(0.60606e-3, abs=1e-8)
    assert overlapped_exposed_s(6.6e-3, 5e-3, 20 / 132) == pytest.approx(1.6e-3, rel=1e-12)
    assert overlapped_exposed_s(4e-3, 10e-3) == 0.0
    # In a chunk: DeepSeek-V3 over two DGX H100 nodes (ep=16), every block an MoE block
    # after the 3 dense ones; forward exposed = share of MoE blocks x max(2A - C, 2A x 20/132).
    from simulator.network.hardware import load_device
    from simulator.step.moe import block_compute, chunk_moe_terms
    m, c = load_model("deepseek-v3"), load_cluster("dgx-h100", nodes=2)
    dev, eff = load_device("h100-sxm-80gb"), load_efficiency("h100-sxm-80gb")
    assert dev.sm_count == 132
    plan = _plan(dp=16, global_batch=16, ep=16)
    a2a = dispatch_time_s(m, plan, c, 0, dispatcher="deepep")
    block = block_compute(m, plan, "flash", dev, eff, True)
    moe_share = (m.num_layers - 3) / m.num_layers
    _, fwd, bwd = chunk_moe_terms(m, plan, c, 0, 0, "flash", dev, eff, dispatcher="deepep",
                                  overlap=True)
    assert fwd == pytest.approx(moe_share * max(2 * a2a - block.fwd_s, 2 * a2a * 20 / 132))
    assert bwd == pytest.approx(moe_share * max(2 * a2a - block.bwd_s, 2 * a2a * 20 / 132))
    # A device whose SM count is not known keeps the plain overlap.
    _, fwd0, _ = chunk_moe_terms(m, plan, c, 0, 0, "flash", dev.replace(sm_count=None), eff,
                                 dispatcher="deepep", overlap=True)
    assert fwd0 == pytest.approx(moe_share * max(0.0, 2 * a2a - block.fwd_s))

"""Mechanisms behind the training-run validation: NIC sharing of pipeline sends, ZeRO-3
prefetch limits (DeepSpeed defaults), and the 40 GB A100 of 2020 DGX systems.

Expected values are hand calculations from the cluster's own link parameters."""

import pytest

from planner.mesh import group_ranks
from planner.presets import load_model
from planner.spec import Plan
from simulator.network.cluster import load_cluster
from simulator.network.collectives import (
    collective_time_s,
    p2p_boundary_time_s,
    p2p_time_on_cluster_s,
)
from simulator.step.compute import layer_compute, load_efficiency
from simulator.step.costs import SimOptions, _device, stage_costs
from simulator.validation.validate import CLUSTER_DIR, _a100_40gb, validation_cluster

GPT3 = load_model("gpt3-175b")


def test_pipeline_sends_of_a_tp8_stage_share_four_nics_two_flows_each():
    # Jean Zay: 8 GPUs, 4 NICs. A tp=8 stage fills a node; all 8 ranks send to the next
    # node at once, two through each NIC: alpha + 2 S / B (B: one NIC's bandwidth).
    jz = validation_cluster("jean-zay-a100", 2)
    plan = Plan(tp=8, pp=2, dp=1, micro_batch=1, global_batch=8)
    size = 64e6
    link = jz.link(0, 8)
    assert p2p_boundary_time_s(jz, plan, size, 0, 8) == pytest.approx(
        link.latency_s + 2 * size / link.bandwidth_Bps)
    # DGX A100: one NIC per GPU, so each flow has its own rail: alpha + S / B.
    dgx = load_cluster("dgx-a100", nodes=2)
    assert p2p_boundary_time_s(dgx, plan, size, 0, 8) == pytest.approx(
        p2p_time_on_cluster_s(dgx, size, 0, 8))


def test_pipeline_sends_inside_a_node_are_not_shared():
    jz = validation_cluster("jean-zay-a100", 1)
    plan = Plan(tp=4, pp=2, dp=1, micro_batch=1, global_batch=8)
    assert p2p_boundary_time_s(jz, plan, 1e6, 0, 4) == p2p_time_on_cluster_s(jz, 1e6, 0, 4)


def _zero3(options):
    cluster = load_cluster("dgx-a100", nodes=4)
    plan = Plan(tp=1, pp=1, dp=32, micro_batch=1, global_batch=32, recompute="full",
                zero_stage=3, dtype="fp16")
    return cluster, plan, stage_costs(GPT3, plan, cluster, options)[0]


def test_zero3_without_prefetch_or_reduce_overlap_exposes_every_collective():
    # Nothing prefetched, reduce-scatters blocking: per layer the forward waits for one
    # weight gather, the backward for a second gather and the reduce-scatter.
    cluster, plan, costs = _zero3(SimOptions(zero3_prefetch_params=0.0,
                                             zero3_overlap_reduce=False))
    group = group_ranks(plan, "dp")
    nbytes = GPT3.layer_params() * 2
    gather = collective_time_s(cluster, "all_gather", nbytes, group)
    scatter = collective_time_s(cluster, "reduce_scatter", nbytes, group)
    assert costs.fwd_comm_s == pytest.approx(GPT3.num_layers * gather)
    assert costs.bwd_comm_s == pytest.approx(GPT3.num_layers * (gather + scatter))


def test_zero3_prefetch_of_a_fraction_exposes_the_rest():
    # Prefetching a quarter of a layer hides at most that quarter of its gather.
    cluster, plan, full = _zero3(SimOptions())
    quarter = GPT3.layer_params() / 4
    _, _, part = _zero3(SimOptions(zero3_prefetch_params=quarter))
    gather = collective_time_s(cluster, "all_gather", GPT3.layer_params() * 2,
                               group_ranks(plan, "dp"))
    assert part.fwd_comm_s >= GPT3.num_layers * 0.75 * gather * (1 - 1e-9)
    assert part.fwd_comm_s > full.fwd_comm_s


def test_2020_dgx_a100_rows_run_on_the_40gb_part():
    assert _a100_40gb({"gpu": "A100 (DGX-A100 cluster, 2020)", "source": "README (2020-09)"})
    assert _a100_40gb({"gpu": "A100 40GB", "source": "x"})
    assert not _a100_40gb({"gpu": "A100-SXM4-80GB (Selene)", "source": "2021"})
    assert (CLUSTER_DIR / "dgx-a100-40gb.yaml").is_file()
    c40 = validation_cluster("dgx-a100-40gb", 1)
    c80 = load_cluster("dgx-a100", nodes=1)
    assert c40.device.name == "a100-sxm-40gb"
    # Same chip: the same GEMM speed; memory-bound ops slower by 2,039 / 1,555 GB/s.
    eff40, eff80 = load_efficiency("a100-sxm-40gb"), load_efficiency("a100-sxm-80gb")
    assert eff40.gemm_half_flops == eff80.gemm_half_flops
    assert c40.device.memory_bandwidth_Bps == pytest.approx(1.555e12)
    f40 = layer_compute(GPT3, 1, 8, False, "unfused", "fp16", _device(c40), eff40)
    f80 = layer_compute(GPT3, 1, 8, False, "unfused", "fp16", _device(c80), eff80)
    # Only the memory-bound share slows down: 1 < ratio < 2039 / 1555.
    assert 1.0 < f40.fwd_s / f80.fwd_s < 2.039 / 1.555


def test_triton_flash_attention_runs_at_one_over_1_8_of_flashattention_2():
    # Dao 2023 §4.1: FlashAttention-2 is 1.3-2.5x faster than FlashAttention in Triton; the
    # model takes 1.8x. Only the attention core changes; GEMMs and memory ops do not.
    from simulator.network.hardware import load_device
    from simulator.step.compute import layer_forward_ops, op_time_s
    a100, eff = load_device("a100-sxm-80gb"), load_efficiency("a100-sxm-80gb")
    mpt = load_model("llama3-8b")
    fa2 = {o.name: o for o in layer_forward_ops(mpt, 1, 1, False, "flash", "bf16")}
    tri = {o.name: o for o in layer_forward_ops(mpt, 1, 1, False, "flash-triton", "bf16")}
    assert fa2.keys() == tri.keys()
    core = (op_time_s(tri["attn-core"], a100, eff, "bf16") - eff.kernel_s) / \
        (op_time_s(fa2["attn-core"], a100, eff, "bf16") - eff.kernel_s)
    assert core == pytest.approx(1.8)
    assert op_time_s(tri["qkv"], a100, eff, "bf16") == op_time_s(fa2["qkv"], a100, eff, "bf16")


def test_deepspeed_partition_counts_the_tied_embedding_as_a_layer_on_both_ends():
    # 72 layers + 2 embedding units = 74 units on 12 stages: no split has every stage <= 6
    # units (6 x 12 = 72 < 74), so the bottleneck is 7 units; filled greedily, the first
    # stage holds the embedding + 6 layers and the middle ones 7 layers: 7/6 of an even split.
    from simulator.validation.validate import deepspeed_split
    split = deepspeed_split(72, 12)
    assert sum(split) == 72 and len(split) == 12 and min(split) >= 1
    assert split[0] == 6 and max(split) == 7
    # 70 layers + 2 = 72 units = 6 x 12: the BLOOM 176B split, first and last 5 layers.
    assert deepspeed_split(70, 12) == (5,) + (6,) * 10 + (5,)


def test_megatron_softmax_falls_back_to_five_fp32_kernels_when_b_times_heads_is_not_a_multiple_of_4():
    # Megatron-LM FusedScaleMaskSoftmax.is_kernel_available: fp16/bf16, 16 < s <= 4096,
    # s % 4 == 0 and b * np % 4 == 0. 16 heads on tp8 = 2 per rank: b=1 -> 2 (fallback),
    # b=2 -> 4 (fused).
    from planner.spec import ModelSpec
    from simulator.step.compute import layer_forward_ops, megatron_fused_softmax
    assert megatron_fused_softmax(2, 2, 1024, "fp16")
    assert not megatron_fused_softmax(1, 2, 1024, "fp16")
    assert not megatron_fused_softmax(4, 4, 8192, "fp16")     # s > 4096
    assert not megatron_fused_softmax(4, 4, 1024, "fp32")     # fp32 input
    m = ModelSpec(name="gpt-h1024", num_layers=24, hidden=1024, num_heads=16,
                  num_kv_heads=16, ffn_hidden=4096, vocab_size=50257, seq_len=1024,
                  activation="gelu")
    fused = layer_forward_ops(m, 2, 8, False, "unfused", "fp16")
    fallback = layer_forward_ops(m, 1, 8, False, "unfused", "fp16")
    assert len(fallback) == len(fused) + 4
    scores = 1 * 2 * 1024 * 1024            # b * heads per rank * s * s
    soft = [o for o in fallback if o.name.startswith("attn-softmax")]
    # cast up (2 + 4 B), scale, mask, softmax (4 + 4 B each), cast down (4 + 2 B).
    assert sum(o.bytes for o in soft) == scores * (6 + 8 + 8 + 8 + 6)
    # FlashAttention does not use it.
    assert not any(o.name.startswith("attn-softmax")
                   for o in layer_forward_ops(m, 1, 8, False, "flash", "fp16"))


def test_narayanan_table_1_rows_take_the_released_launch_script_settings():
    # Megatron-LM examples/sc21/run_table_1.sh: 18B MBS=8 DDP=torch; 76B MBS=2 with 5 layers
    # per virtual stage (60 layers / pp 4 = 15 -> 3 virtual stages), DDP=local.
    from simulator.validation.validate import read_runs
    from tests.validation.test_runs_validation import FILES
    if not FILES["published"].is_file():
        pytest.skip("reference data not found")
    cases = {c.model.name: c for c in read_runs(FILES["published"])
             if c.id in {"r003", "r005"}}
    c18, c76 = cases["GPT 18.4B"], cases["GPT 76.1B"]
    assert (c18.plan.micro_batch, c18.plan.virtual_stages, c18.overlap_dp) == (8, 1, True)
    assert (c76.plan.micro_batch, c76.plan.virtual_stages, c76.overlap_dp) == (2, 3, False)
    assert any("run_table_1.sh" in f for f in c18.flags)


def test_vtrain_cluster_all_reduce_matches_its_own_nccl_tests_within_10_percent():
    # vTrain's nccl-tests on 8 A100s of its cluster: 256 MiB all-reduce in 2.162 ms
    # (busbw 217 GB/s, ../shared/data/vtrain/nccl_allreduce_a100/allreduce_8gpu.csv).
    c = validation_cluster("vtrain-a100", 1)
    t = collective_time_s(c, "all_reduce", 256 * 2**20, list(range(8)))
    assert t == pytest.approx(2.1623e-3, rel=0.10)

"""Full recomputation of the first N blocks of each chunk (Megatron-LM ``--recompute-method
block --recompute-num-layers N``): plan field, step time, memory, FLOPs, export, reader and
the runtime (tests/runtime/test_block_recompute_runtime.py), each against what the block method does by definition (Korthikanti et al. 2022
§5: a recomputed block repeats its forward and keeps only its input; the others run and keep
as without recomputation)."""

from __future__ import annotations

import pytest

from planner.export import to_megatron
from planner.flops import recompute_flops_per_token
from planner.presets import load_model
from planner.spec import Plan, PlanError
from simulator.network.cluster import load_cluster
from simulator.step.compute import layer_compute, load_efficiency
from simulator.step.costs import stage_costs
from simulator.step.memory import _edge_activation_bytes, layer_activation_bytes, memory_per_stage
from simulator.validation.validate import block_recompute_layers

LLAMA8B = load_model("llama3-8b")  # 32 blocks, h 4096, seq 8192 (Meta's config.json)
H100 = load_cluster("dgx-h100", nodes=1)
BASE = Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=8)


def _plan(recompute: str, n: int = 0) -> Plan:
    return BASE.replace(recompute=recompute, recompute_num_layers=n)


def test_the_field_needs_full_recomputation_and_names_itself():
    with pytest.raises(PlanError, match="recompute_num_layers=5 needs recompute='full'"):
        _plan("selective", 5)
    with pytest.raises(PlanError, match="recompute_num_layers=-1 must be a non-negative"):
        _plan("full", -1)
    assert _plan("full", 5).id == "tp1-pp1-dp1-mb1-gb8-ac-block5"
    assert _plan("full").id == "tp1-pp1-dp1-mb1-gb8-ac-full"


def test_a_chunk_recomputes_its_first_n_blocks():
    # pp=4 over 32 blocks: chunks of 8; N=5 recomputes 5 of each, N=10 all 8
    p = BASE.replace(pp=4, recompute="full", recompute_num_layers=5)
    assert p.full_recompute_share(8) == 5 / 8
    assert p.model_full_recompute_share(LLAMA8B) == 5 / 8
    assert p.replace(recompute_num_layers=10).model_full_recompute_share(LLAMA8B) == 1.0


def test_backward_pays_one_forward_per_recomputed_block():
    # bwd(N) - bwd(none) = N forwards of a block: the backward repeats exactly those
    costs = {n: stage_costs(LLAMA8B, _plan("full", n) if n is not None else _plan("none"),
                            H100)[0] for n in (None, 0, 5)}
    eff = load_efficiency(H100.device.name)
    lc = layer_compute(LLAMA8B, 1, 1, False, "flash", "bf16", H100.device, eff)
    none, every, five = costs[None].bwd_compute_s, costs[0].bwd_compute_s, costs[5].bwd_compute_s
    assert every - none == pytest.approx(32 * lc.fwd_s, rel=1e-9)
    assert five - none == pytest.approx(5 * lc.fwd_s, rel=1e-9)
    assert costs[5].fwd_compute_s == costs[None].fwd_compute_s


def test_kept_blocks_hold_their_activations():
    # one micro-batch in flight (pp=1): N recomputed blocks keep their input, 2·s·b·h bytes in
    # bf16 (Korthikanti §5), the other 32 - N what recompute="none" keeps
    s, h = 8192, 4096
    assert layer_activation_bytes(LLAMA8B, _plan("full")) == 2 * s * h
    kept = layer_activation_bytes(LLAMA8B, _plan("none"), "flash")
    edge = _edge_activation_bytes(LLAMA8B, _plan("none"), 0)
    got = memory_per_stage(LLAMA8B, _plan("full", 5), attention="flash")[0].activations_bytes
    assert got == pytest.approx(5 * 2 * s * h + 27 * kept + edge, rel=1e-12)


def test_hfu_counts_the_recomputed_share():
    assert recompute_flops_per_token(LLAMA8B, _plan("full", 8)) == pytest.approx(
        recompute_flops_per_token(LLAMA8B, _plan("full")) / 4, rel=1e-12)


def test_megatron_export_names_the_block_method():
    text = to_megatron(LLAMA8B, _plan("full", 5)).text
    assert "--recompute-method block" in text and "--recompute-num-layers 5" in text
    text = to_megatron(LLAMA8B, _plan("full")).text
    assert "--recompute-method uniform" in text and "--recompute-num-layers 1" in text


def test_the_reader_takes_the_block_count_from_the_cell():
    # published_benchmarks.csv n250's cell (Megatron-Bridge recipe recompute_num_layers=5)
    assert block_recompute_layers("full, block, 5 layers (preset recompute_num_layers)") == 5
    assert block_recompute_layers("full AC (2 layers/stage)") == 0

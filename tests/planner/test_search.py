"""The search: two tiers, memory rejections with the breakdown, constraints, infeasibility."""

import pytest

from planner.presets import load_model
from planner.search import search
from planner.space import SearchSpace
from planner.spec import Plan, PlanError
from simulator.network.cluster import load_cluster
from simulator.step.simulate import estimate, simulate

GiB = 2**30


@pytest.fixture(scope="module")
def h100x16():
    return load_cluster("dgx-h100", nodes=2)


@pytest.fixture(scope="module")
def llama8b_result(h100x16):
    return search(load_model("llama3-8b"), h100x16, global_batch=64, top_k=5)


def test_every_candidate_is_ranked_or_rejected(llama8b_result):
    r = llama8b_result
    plan_rows = r.rejected[r.rejected.kind == "memory"]
    assert r.stats["candidates"] == len(r.ranked) + len(r.rejected)
    assert r.stats["estimated"] == len(r.ranked)
    assert len(plan_rows) + len(r.ranked) > 1000  # the whole space, not a sample
    assert r.rejected["reason"].str.len().min() > 0
    assert r.ranked["id"].is_unique


def test_ranked_best_first_refined_rows_lead(llama8b_result):
    ranked = llama8b_result.ranked
    # top_k=5 best estimates, plus up to 2 x 5 whose lower bound could beat them
    refined = int((ranked["tier"] == "simulated").sum())
    assert 5 <= refined <= 15
    assert (ranked["tier"][:refined] == "simulated").all()
    assert (ranked["tier"][refined:] == "estimated").all()
    top = list(ranked["tokens_per_s"][:refined])
    assert top == sorted(top, reverse=True)
    for row in ranked.itertuples():
        assert row.tp * row.pp * row.dp == 16
        assert row.tokens_per_s == pytest.approx(64 * 8192 / row.step_time_s, rel=1e-9)
    # the search covers every knob of the space
    for column, values in {"zero_stage": {0, 1, 2, 3}, "recompute": {"none", "selective", "full"},
                           "schedule": {"1f1b", "interleaved-1f1b", "zb-h1", "zb-v"},
                           "sequence_parallel": {False, True}}.items():
        assert set(ranked[column]) == values, column


def test_out_of_memory_reason_has_the_breakdown():
    # Llama 2 70B, tp=8, pp=1, dp=1, no recomputation, ZeRO-0 on 8 A100-80GB. By hand, per rank:
    # params = 80 layers x 855,654,400 / 8 + (embedding + output) 2 x 32000 x 8192 / 8
    #        + final norm 8192 = 8,622,088,192; weights = gradients = 2 B/param = 16.1 GiB;
    # Adam (fp32 master + 2 moments) 12 B/param = 96.4 GiB. Usable: 0.95 x 80e9 B = 70.8 GiB.
    model = load_model("llama2-70b")
    space = SearchSpace(tp=(8,), pp=(1,), micro_batch=(1,), recompute=("none",),
                        zero_stage=(0,), sequence_parallel=(False,))
    r = search(model, load_cluster("dgx-a100", nodes=1), global_batch=8, space=space,
               explain=False)
    assert r.ranked.empty
    row = r.rejected.set_index("id").loc["tp8-pp1-dp1-mb1-gb8"]
    assert row.kind == "memory"
    assert row.reason.startswith("out of memory: stage 0 needs ")
    assert "device has 70.8 GiB usable, " in row.reason and "GiB over (weights 16.1, gradients "\
        "16.1, optimizer 96.4," in row.reason


def test_global_batch_in_tokens(h100x16):
    model = load_model("llama3-8b")
    space = SearchSpace(tp=(8,), pp=(1,), recompute=("full",), zero_stage=(1,))
    by_tokens = search(model, h100x16, global_batch_tokens=64 * 8192, space=space, top_k=1)
    assert set(by_tokens.ranked["global_batch"]) == {64}
    with pytest.raises(PlanError, match="global_batch_tokens=1000 must be a positive multiple "
                                        "of seq_len=8192"):
        search(model, h100x16, global_batch_tokens=1000)


def test_at_most_n_devices(h100x16):
    r = search(load_model("llama3-8b"), h100x16, global_batch=24, max_devices=12,
               space=SearchSpace(recompute=("full",), zero_stage=(0, 1)), top_k=3)
    sizes = r.ranked["tp"] * r.ranked["pp"] * r.ranked["dp"]
    # 8B needs 16 B/param = 128 GB of states: one 80 GB device cannot hold it, two can (tp2
    # or pp2 at dp=1, where ZeRO has nothing to shard: zero 0)
    assert sizes.max() <= 12 and sizes.min() == 2 and sizes.nunique() >= 4
    assert (24 % r.ranked["dp"] == 0).all()


@pytest.mark.parametrize("kw", [
    dict(tp=8, pp=8, dp=1, micro_batch=1, global_batch=32),
    dict(tp=4, pp=4, dp=4, micro_batch=2, global_batch=64, recompute="full", zero_stage=1),
    dict(tp=8, pp=4, dp=2, micro_batch=1, global_batch=64, schedule="gpipe"),
    dict(tp=8, pp=8, dp=1, micro_batch=1, global_batch=32, schedule="interleaved-1f1b",
         virtual_stages=5),
])
def test_two_tiers_agree_on_uniform_plans(kw):
    # Uniform stages (a 256-token vocabulary makes embedding and logits negligible), no
    # DP overlap: the closed form and the SimPy run agree within 5%.
    model = load_model("llama3-70b").replace(vocab_size=256, seq_len=2048)
    cluster = load_cluster("dgx-h100", nodes=8)
    plan = Plan(**kw)
    est, sim = estimate(model, plan, cluster), simulate(model, plan, cluster)
    assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.05)


def test_impossible_request_gets_an_answer():
    # Llama 3 405B on one 8-GPU node: weights, gradients and Adam states alone are
    # 16 B x 405.9e9 params = 6.5e12 B, 85 devices' worth of 76e9 usable B, so no split of
    # 8, 16, 32 or 64 devices can hold it; the search names the closest plans and 128 devices.
    model = load_model("llama3-405b")
    r = search(model, load_cluster("dgx-h100", nodes=1), global_batch=16)
    assert r.ranked.empty
    inf = r.infeasible
    assert 16 * model.num_params() / 76e9 > 64
    assert inf.min_devices == 128
    assert inf.summary.startswith("no plan of llama3-405b fits on 8 x h100")
    assert len(inf.closest) == 5
    lean = inf.closest.iloc[0]
    assert lean.peak_memory_bytes > lean.usable_bytes == pytest.approx(0.95 * 80e9)
    assert list(inf.closest.peak_memory_bytes) == sorted(inf.closest.peak_memory_bytes)
    assert any(line.startswith("devices: 8 is too few;") and "128 devices (16 nodes)" in line
               for line in inf.blocking)


def test_fixed_field_that_blocks_is_named():
    # Llama 2 70B fits 16 A100s only with recomputation or sharding; fixing tp=16 can never
    # work (8 KV heads).
    model = load_model("llama2-70b")
    r = search(model, load_cluster("dgx-a100", nodes=2), global_batch=16,
               space=SearchSpace(tp=(16,)))
    assert r.ranked.empty
    assert "tp=16 (fixed): tp=16 does not divide num_kv_heads=8; use tp in [1, 2, 4, 8]" \
        in r.infeasible.blocking
    with pytest.raises(PlanError, match="no legal plan"):
        _ = r.best


def test_closed_form_ranks_interleaved_plans_as_the_simulation_does():
    # GPT-3 175B on 64 H100s: the best plan is interleaved, and its chunks are unequal (the
    # last carries the logits). The closed form charges the busiest rank's rounds plus 1/v of
    # a round per other rank for fill and drain (`estimate_pipeline`), so it follows the SimPy
    # run: the simulated best is among the 10 best estimates, within 2% of its simulated time.
    model, cluster = load_model("gpt3-175b"), load_cluster("dgx-h100", nodes=8)
    r = search(model, cluster, global_batch=128, top_k=10,
               space=SearchSpace(schedule=("1f1b", "interleaved-1f1b")))
    best = r.best
    refined = [r.plans[i] for i in r.ranked.loc[r.ranked.tier == "simulated", "id"]]
    by_estimate = sorted(refined, key=lambda p: estimate(model, p, cluster).step_time_s)
    assert best.schedule == "interleaved-1f1b" and best.virtual_stages > 1
    assert best in by_estimate[:10]
    assert estimate(model, best, cluster).step_time_s == pytest.approx(
        r.ranked.iloc[0]["step_time_s"], rel=0.02)
    assert r.ranked.iloc[0]["tier"] == "simulated"
    assert r.stats["simulated"] > 10

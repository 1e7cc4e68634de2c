"""Branch and bound in the analytical tier: the compute-only lower bound never exceeds the
closed form, and pruning by it keeps the best plans and their order."""

import pytest

from planner.presets import load_model
from planner.search import search
from planner.space import SearchSpace, enumerate_candidates
from planner.spec import Plan, PlanError
from simulator.network.cluster import load_cluster
from simulator.step.costs import stage_costs, step_lower_bound_s
from simulator.step.simulate import estimate


@pytest.fixture(scope="module")
def a100x32():
    return load_cluster("dgx-a100", nodes=4)


def test_bound_is_the_step_without_comm_on_one_gpu():
    # One GPU, no parallelism: nothing to communicate, so the closed form is m·(t_f + t_b)
    # of the one stage plus its optimizer step (`estimate_pipeline`); the bound is the first
    # term alone, computed here by hand from the stage's costs.
    model, cluster = load_model("tiny-gpt"), load_cluster("dgx-a100", nodes=1)
    plan = Plan(tp=1, pp=1, dp=1, micro_batch=2, global_batch=8)
    (c,) = stage_costs(model, plan, cluster)
    step = estimate(model, plan, cluster).step_time_s
    bound = step_lower_bound_s(model, plan, cluster)
    assert bound == pytest.approx(4 * (c.fwd_compute_s + c.bwd_compute_s), rel=1e-12)
    assert step == pytest.approx(bound + c.optimizer_s, rel=1e-12)


def test_bound_never_exceeds_the_estimate(a100x32):
    # every legal plan of a 32-GPU space, all schedules, placements and ZeRO stages
    model = load_model("llama3-8b")
    seen = 0
    for plan in enumerate_candidates(model, SearchSpace(), devices_per_node=8,
                                     global_batch=64, dtype="bf16", num_devices=32,
                                     max_devices=None):
        if not isinstance(plan, Plan):
            continue
        seen += 1
        assert step_lower_bound_s(model, plan, a100x32) <= \
            estimate(model, plan, a100x32).step_time_s, plan.id
    assert seen > 200


def test_pruned_search_keeps_the_top_and_its_order(a100x32):
    # reference: the same search costing every plan
    model = load_model("llama3-8b")
    full = search(model, a100x32, global_batch=64, top_k=0)
    pruned = search(model, a100x32, global_batch=64, top_k=0, prune=20)
    cols = ["id", "placement", "step_time_s", "tokens_per_s", "peak_memory_bytes"]
    assert pruned.ranked[cols].head(20).equals(full.ranked[cols].head(20))
    assert pruned.stats["pruned"] > 0
    assert pruned.stats["pruned"] + pruned.stats["estimated"] == full.stats["estimated"]


def test_prune_must_be_positive(a100x32):
    with pytest.raises(PlanError, match="prune=0 must be an integer >= 1"):
        search(load_model("tiny-gpt"), a100x32, global_batch=8, prune=0)


def test_cli_prune_keeps_the_top_plans():
    # reference: the same `meshplan plan` without --prune
    import json
    import subprocess
    import sys
    from pathlib import Path

    def plans(*extra):
        proc = subprocess.run(
            [sys.executable, "-m", "apps.cli", "plan", "--model", "llama3-8b", "--cluster",
             "dgx-a100", "--nodes", "2", "--global-batch", "32", "--top-k", "1", "--json",
             *extra], capture_output=True, text=True, timeout=300,
            cwd=Path(__file__).resolve().parents[2])
        return proc.returncode, proc.stdout, proc.stderr

    rc, out, err = plans()
    rc5, out5, err5 = plans("--prune", "5")
    assert rc == rc5 == 0, err + err5
    full, pruned = json.loads(out)["plans"], json.loads(out5)["plans"]
    assert [p["id"] for p in pruned[:5]] == [p["id"] for p in full[:5]]
    assert 5 <= len(pruned) < len(full)
    rc0, _, err0 = plans("--prune", "0")
    assert rc0 == 2 and "--prune=0 must be > 0" in err0


ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb", "zb-v",
                 "dualpipe-v")


@pytest.mark.parametrize("post_validation", [False, True])
def test_zero_bubble_bound_never_exceeds_the_estimate(a100x32, post_validation):
    # every zero-bubble schedule (the closed form's timeline, extended past 2·pp or 3·pp
    # micro-batches), with and without the optimizer's post-validation
    import dataclasses

    from simulator.step.costs import DEFAULT_OPTIONS, compute_lower_bounds_s
    options = dataclasses.replace(DEFAULT_OPTIONS, optimizer_post_validation=post_validation)
    model = load_model("llama3-8b")
    space = SearchSpace(schedule=ALL_SCHEDULES[3:], zero_stage=(1,), placement=(
        ("tp", "pp", "dp"),))
    seen = set()
    for gb in (32, 256):
        for plan in enumerate_candidates(model, space, devices_per_node=8, global_batch=gb,
                                         dtype="bf16", num_devices=32, max_devices=None):
            if not isinstance(plan, Plan):
                continue
            seen.add(plan.schedule)
            est = estimate(model, plan, a100x32, options=options)
            step, busy = compute_lower_bounds_s(model, plan, a100x32, options)
            assert 0 < step <= est.step_time_s, plan.id
            assert 0 < busy <= est.compute_s + est.comm_s, plan.id
    assert seen == set(ALL_SCHEDULES[3:])


@pytest.mark.parametrize("changes", [{}, {"moe_a2a_overlap": True},
                                     {"moe_dispatcher": "deepep", "moe_imbalance": 1.3}],
                         ids=["alltoall", "overlap", "deepep"])
def test_moe_bound_never_exceeds_the_estimate(a100x32, changes):
    # the MoE chunks' own compute (dense and expert blocks) and their exposed all-to-all,
    # every schedule, ep and recomputation, each dispatcher, with and without the overlap
    import dataclasses

    from simulator.step.costs import DEFAULT_OPTIONS, compute_lower_bounds_s
    options = dataclasses.replace(DEFAULT_OPTIONS, **changes)
    # tiny-moe is host-bound (its all-to-all hides in the launch time); a cut DeepSeek-V3
    # is not, so its bound rises by the all-to-all
    deepseek = load_model("deepseek-v3").replace(num_layers=8, moe_first_dense_layers=1)
    seen, raised = 0, 0
    for model, plan in [(m, p) for m in (load_model("tiny-moe"), deepseek)
                        for p in enumerate_candidates(
                            m, SearchSpace(schedule=ALL_SCHEDULES, zero_stage=(1,)),
                            devices_per_node=8, global_batch=64, dtype="bf16",
                            num_devices=32, max_devices=None)
                        if isinstance(p, Plan)][::3]:
        seen += 1
        est = estimate(model, plan, a100x32, options=options)
        step, busy = compute_lower_bounds_s(model, plan, a100x32, options)
        assert 0 < step <= est.step_time_s * (1 + 1e-12), plan.id
        assert 0 < busy <= (est.compute_s + est.comm_s) * (1 + 1e-12), plan.id
        no_a2a = compute_lower_bounds_s(model, plan, a100x32, dataclasses.replace(
            options, recompute_modules=("core_attn",)))[0]   # the compute-only bound
        raised += step > no_a2a
    assert seen > 100 and raised > 0


# the fast core: each model once; the other two (30-40 s each on 2 shared cores) are opt-in
@pytest.mark.parametrize("model_name,top_k", [
    ("llama3-8b", 0), pytest.param("llama3-8b", 3, marks=pytest.mark.slow),
    pytest.param("tiny-moe", 0, marks=pytest.mark.slow), ("tiny-moe", 3)])
def test_pruned_search_keeps_the_top_with_every_schedule(a100x32, model_name, top_k):
    # reference: the same search costing every plan; zero-bubble and MoE plans are pruned by
    # their own bounds, and with top_k the SimPy tier refines the same plans
    model = load_model(model_name)
    space = SearchSpace(schedule=ALL_SCHEDULES)
    full = search(model, a100x32, global_batch=64, top_k=top_k, space=space)
    pruned = search(model, a100x32, global_batch=64, top_k=top_k, space=space, prune=20)
    cols = ["id", "placement", "step_time_s", "tokens_per_s", "peak_memory_bytes", "tier"]
    assert pruned.ranked[cols].head(20).equals(full.ranked[cols].head(20))
    assert pruned.stats["simulated"] == full.stats["simulated"]
    assert pruned.stats["pruned"] > 0

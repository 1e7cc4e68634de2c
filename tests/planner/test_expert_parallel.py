"""Expert parallelism in `Plan`: ep / etp fields, MoE parallel folding, legality, plan files."""

import pytest

from planner.mesh import expert_group_ranks, stage_ranks
from planner.planfile import ClusterRef, PlanFile, plan_from_dict
from planner.presets import load_model
from planner.spec import Plan, PlanError, check_plan


def _plan(**kw):
    base = dict(tp=1, pp=1, dp=8, micro_batch=1, global_batch=8)
    return Plan(**{**base, **kw})


def test_defaults_leave_dense_plans_and_ids_unchanged():
    p = Plan(tp=2, pp=4, dp=8, micro_batch=1, global_batch=512)
    assert (p.ep, p.etp) == (1, 1)
    assert p.id == "tp2-pp4-dp8-mb1-gb512"


def test_id_names_ep_only_when_above_one():
    assert _plan(ep=8).id == "tp1-pp1-dp8-ep8-mb1-gb8"
    assert _plan(tp=2, dp=4, ep=4, etp=2).id == "tp2-pp1-dp4-ep4-etp2-mb1-gb8"


def test_edp_is_attention_ranks_over_etp_times_ep():
    # Megatron-Core folding: etp*ep*edp = tp*cp*dp. tp=2, cp=2, dp=8 -> 32 ranks;
    # etp=1, ep=8 -> edp = 32 / 8 = 4; etp=2, ep=4 -> edp = 32 / 8 = 4; ep=32 -> edp=1.
    assert _plan(tp=2, cp=2, ep=8).edp == 4
    assert _plan(tp=2, cp=2, ep=4, etp=2).edp == 4
    assert _plan(tp=2, cp=2, ep=32).edp == 1
    assert _plan().edp == 8  # dense: expert data parallel = dp


def test_folding_must_divide_attention_ranks():
    # tp*cp*dp = 1*1*8 = 8; etp*ep = 16 does not divide it.
    with pytest.raises(PlanError, match=r"etp\*ep = 1\*16 = 16 to divide the attention ranks "
                                        r"tp\*cp\*dp = 1\*1\*8 = 8"):
        _plan(ep=16)


def test_ep_must_divide_experts():
    # Mixtral has 8 experts; ep=16 (ranks 16) cannot hold whole experts.
    with pytest.raises(PlanError, match=r"ep=16 does not divide num_experts=8; use ep in "
                                        r"\[1, 2, 4, 8\]"):
        check_plan(load_model("mixtral-8x7b"), _plan(dp=16, global_batch=16, ep=16))


def test_ep_needs_moe_model():
    with pytest.raises(PlanError, match="expert parallelism needs a mixture-of-experts model"):
        check_plan(load_model("llama3-8b"), _plan(ep=2))


def test_moe_plan_is_legal():
    check_plan(load_model("deepseek-v3"), Plan(tp=1, pp=4, dp=64, ep=64, micro_batch=1,
                                               global_batch=4096, stage_layers=(16, 15, 15, 15)))


def test_ep_group_stays_inside_node_with_default_placement():
    # 8 GPUs per DGX node: with tp=1, dp=64 and ep=8 the EP group of rank 0 is devices 0..7
    # (etp fastest, then ep: Megatron-Core's tp-ep-dp-pp order), and the edp group strides 8.
    p = Plan(tp=1, pp=1, dp=64, ep=8, micro_batch=1, global_batch=64)
    assert expert_group_ranks(p, "ep") == list(range(8))
    assert expert_group_ranks(p, "edp", index=9) == list(range(1, 64, 8))


def test_expert_groups_with_pipeline_stage():
    # tp=2, pp=2, dp=4: stage 1 holds ranks 8..15; etp=2, ep=2 -> edp=2.
    p = Plan(tp=2, pp=2, dp=4, ep=2, etp=2, micro_batch=1, global_batch=4)
    assert stage_ranks(p, 1) == list(range(8, 16))
    assert expert_group_ranks(p, "etp", stage=1) == [8, 9]
    assert expert_group_ranks(p, "ep", stage=1) == [8, 10]
    assert expert_group_ranks(p, "edp", stage=1, index=3) == [11, 15]


def test_plan_file_round_trip_keeps_ep():
    p = Plan(tp=1, pp=4, dp=64, ep=64, etp=1, micro_batch=1, global_batch=4096)
    data = PlanFile(model=load_model("deepseek-v3"), plan=p,
                    cluster=ClusterRef(name="dgx-h100", nodes=32)).to_dict()
    assert data["plan"]["ep"] == 64
    assert plan_from_dict(data["plan"]) == p
    # a plan file written before ep existed loads with ep = etp = 1
    old = {k: v for k, v in data["plan"].items() if k not in ("ep", "etp")}
    assert plan_from_dict(old).ep == 1


def test_search_enumerates_ep_for_moe_only():
    from planner.search import search
    from planner.space import SearchSpace
    from simulator.network.cluster import load_cluster
    c = load_cluster("dgx-h100", nodes=2)
    space = SearchSpace.from_fixed({"pp": 1, "recompute": "full", "zero_stage": 1})
    moe = search(load_model("mixtral-8x7b"), c, global_batch=64, space=space, top_k=0)
    # Mixtral's 8 experts: ep in the divisors of 8 that divide tp*dp = 16.
    assert set(moe.ranked["ep"]) <= {1, 2, 4, 8} and moe.ranked["ep"].max() == 8
    dense = search(load_model("llama3-8b"), c, global_batch=64, space=space, top_k=0)
    assert set(dense.ranked["ep"]) == {1} and set(dense.ranked["etp"]) == {1}


def test_fix_ep_restricts_and_names_the_rule():
    from planner.search import search
    from planner.space import SearchSpace
    from simulator.network.cluster import load_cluster
    c = load_cluster("dgx-h100", nodes=2)
    space = SearchSpace.from_fixed({"pp": 1, "recompute": "full", "zero_stage": 1, "ep": 8})
    moe = search(load_model("mixtral-8x7b"), c, global_batch=64, space=space, top_k=0)
    assert set(moe.ranked["ep"]) == {8}
    assert all("-ep8-" in i for i in moe.ranked["id"])
    dense = search(load_model("llama3-8b"), c, global_batch=64, space=space, top_k=0)
    assert dense.ranked.empty
    assert (dense.rejected["kind"] == "ep").any()
    assert dense.rejected["reason"].str.contains("needs a mixture-of-experts model").any()


def test_plan_cli_fix_ep_shows_ep_column():
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "apps.cli", "plan", "--model", "mixtral-8x7b", "--cluster",
         "dgx-h100", "--nodes", "2", "--global-batch", "64", "--fix", "ep=8", "--fix", "pp=1",
         "--fix", "recompute=full", "--top-k", "1", "--top", "3"],
        capture_output=True, text=True, timeout=300, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if " tp " in line)
    assert header.split()[:4] == ["tp", "pp", "dp", "ep"]

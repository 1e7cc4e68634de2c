"""What a user reads: errors that say what is wrong with a file or a path, warnings where a
figure is out of range, and `--json` output that is standard JSON."""

import json

import pytest

from apps.cli import main


def _strict_json(text: str) -> dict:
    # json.loads accepts NaN and Infinity by default; RFC 8259 JSON has neither
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def test_plan_json_without_a_price_writes_null_cost(capsys):
    # --tokens with no --gpu-hour-usd: the cost is unknown, which JSON spells null
    code = main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks", "2",
                 "--tokens", "1B", "--json"])
    out = _strict_json(capsys.readouterr().out)
    assert code == 0
    assert out["plans"] and all(p["cost_usd"] is None for p in out["plans"])


def test_dumps_json_replaces_nan_and_infinity():
    import numpy as np

    from apps.format import dumps_json
    text = dumps_json({"a": float("nan"), "b": [np.float64("inf"), 1.5], "c": (np.int64(3),)})
    assert text == '{"a": null, "b": [null, 1.5], "c": [3]}'


MODEL_YAML = """name: my-llama-13b
num_layers: 40
hidden: 5120
num_heads: 40
ffn_hidden: 13824
vocab_size: 32000
seq_len: 4096
"""


@pytest.mark.parametrize("content, message", [
    (MODEL_YAML, "looks like a model file, not a plan file (a plan file has schema_version, "
                 "model, plan and cluster)"),
    ("kind: gpu\nnode_type: dgx-h100\nnodes: 2\n", "looks like a cluster file, not a plan "
                                                   "file"),
    ("", "is empty; write one with `meshplan plan ... --out"),
])
def test_simulate_names_what_is_wrong_with_the_plan_file(capsys, tmp_path, content, message):
    path = tmp_path / "p.yaml"
    path.write_text(content)
    assert main(["simulate", str(path)]) == 2
    assert message in _err(capsys)


def test_an_empty_cluster_file_is_called_empty(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("")
    assert main(["plan", "--model", "tiny-gpt", "--cluster", str(path)]) == 2
    assert f"cluster file {str(path)!r} is empty; a cluster file holds kind: gpu" in _err(capsys)


def _not_a_folder(tmp_path):
    # a path whose parent is a regular file: every OS refuses to create anything inside it
    (tmp_path / "afile").write_text("")
    return tmp_path / "afile"


@pytest.mark.parametrize("argv, flag, name", [
    (["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--out"], "--out", "x.yaml"),
    (["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--csv"], "--csv", "csv"),
    (["topo", "localhost-cpu", "--png"], "--png", "t.png"),
    (["calibrate", "--out"], "--out", "p.yaml"),
    (["demo", "--out"], "--out", "demo"),
    (["collective", "all_reduce", "--cluster", "dgx-h100", "--csv"], "--csv", "c.csv"),
    (["validate", "--runs", "runs.csv", "--plot"], "--plot", "p.png"),
    (["validate", "--runs", "runs.csv", "--csv"], "--csv", "v.csv"),
    (["compare", "--csv"], "--csv", "c.csv"),
    (["compare", "--out"], "--out", "cmp"),
])
def test_an_unwritable_output_path_names_the_flag_before_any_work(capsys, tmp_path, argv,
                                                                  flag, name):
    bad = _not_a_folder(tmp_path) / name
    assert main([*argv, str(bad)]) == 2
    err = capsys.readouterr().err
    # one line, and nothing before it: no search header, no calibration, no run started
    assert err == (f"error: {flag} {str(bad)!r}: cannot write there (Not a directory); "
                   f"choose a writable folder\n")


@pytest.mark.parametrize("argv_of, flag", [
    (lambda plan, bad: ["simulate", str(plan), "--trace", str(bad)], "--trace"),
    (lambda plan, bad: ["launch", str(plan), "--nodes", "1", "--slurm", str(bad)], "--slurm"),
    (lambda plan, bad: ["run", str(plan), "--steps", "1", "--out", str(bad)], "--out"),
])
def test_plan_file_commands_check_their_output_path_first(capsys, tmp_path, tiny_plan_file,
                                                          argv_of, flag):
    plan = tiny_plan_file(tp=1, pp=2, dp=1)
    bad = _not_a_folder(tmp_path) / "x"
    assert main(argv_of(plan, bad)) == 2
    assert capsys.readouterr().err == (f"error: {flag} {str(bad)!r}: cannot write there (Not "
                                       f"a directory); choose a writable folder\n")


def test_the_output_path_check_leaves_no_probe_behind(tmp_path):
    from apps.format import check_output_path
    check_output_path("--out", tmp_path / "new" / "deeper" / "x.yaml")
    check_output_path("--out", tmp_path / "x.yaml")
    check_output_path("--out", tmp_path / "run", folder=True)
    assert list(tmp_path.iterdir()) == []


LLAMA_13B = {"name": "my-llama-13b", "num_layers": 40, "hidden": 5120, "num_heads": 40,
             "num_kv_heads": 40, "ffn_hidden": 13824, "vocab_size": 32000, "seq_len": 4096,
             "activation": "swiglu", "norm": "rmsnorm"}
MOE_16X = {"name": "my-moe-16x3b", "num_layers": 24, "hidden": 2048, "num_heads": 16,
           "num_kv_heads": 4, "ffn_hidden": 8192, "vocab_size": 50304, "seq_len": 4096,
           "activation": "swiglu", "norm": "rmsnorm",
           "num_experts": 16, "experts_per_token": 2, "moe_ffn_hidden": 4096,
           "num_shared_experts": 1}


def _plan_file(path, model: dict, **plan_fields):
    # a plan file of `model` on 32 DGX H100 nodes (256 x 80 GB), as `meshplan plan --out` writes
    from planner.planfile import ClusterRef, PlanFile, write_plan_file
    from planner.presets import model_from_dict
    from planner.spec import Plan
    fields = dict(model)
    plan = Plan(**{"tp": 1, "pp": 1, "dp": 256, "micro_batch": 2, "global_batch": 1024,
                   "zero_stage": 3, **plan_fields})
    return write_plan_file(path, PlanFile(
        model=model_from_dict(fields, name=fields.pop("name")), plan=plan,
        cluster=ClusterRef(name="dgx-h100", nodes=32)))


def _oom_plan(tmp_path):
    # ZeRO-0: every rank holds Adam's fp32 master weights, m and v, 12 bytes x 13.0B params =
    # 145.5 GiB on its own (Rajbhandari et al. 2020 §3.1), twice the 80 GB x 0.95 = 70.8 GiB
    # usable of an H100
    return _plan_file(tmp_path / "oom.yaml", LLAMA_13B, micro_batch=4, zero_stage=0)


def _needs_gib(err: str) -> float:
    import re
    return float(re.search(r"stage 0 needs ([\d.]+) GiB", err).group(1))


def test_simulate_warns_when_the_plan_does_not_fit_and_still_prints(capsys, tmp_path):
    assert main(["simulate", str(_oom_plan(tmp_path))]) == 0
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert err.startswith("warning: tp1-pp1-dp256-mb4-gb1024 does not fit on h100-sxm-80gb: "
                          "out of memory: stage 0 needs ")
    assert "device has 70.8 GiB usable" in err and _needs_gib(err) > 145.5
    assert "peak_memory" in captured.out          # the figures are still shown


def test_a_plan_that_fits_simulates_without_a_warning(capsys, tmp_path):
    assert main(["simulate", str(_plan_file(tmp_path / "ok.yaml", LLAMA_13B))]) == 0
    assert capsys.readouterr().err == ""


def test_export_refuses_a_plan_that_does_not_fit_unless_allowed(capsys, tmp_path):
    plan = str(_oom_plan(tmp_path))
    assert main(["export", plan, "--to", "megatron"]) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert captured.out == "" and err.startswith("error: plan tp1-pp1-dp256-mb4-gb1024 does not "
                                                 "fit on h100-sxm-80gb: out of memory")
    assert err.endswith("the megatron job would stop out of memory: make a plan that fits "
                        "(`meshplan plan ... --out`), or give --allow-oom to export it anyway")
    assert main(["export", plan, "--to", "megatron", "--allow-oom"]) == 0
    captured = capsys.readouterr()
    assert "--micro-batch-size 4" in captured.out
    assert " ".join(captured.err.split()).startswith("warning: tp1-pp1-dp256-mb4-gb1024 does "
                                                     "not fit")


def test_diff_names_models_and_clusters_and_warns_when_models_differ(capsys, tmp_path):
    a = _plan_file(tmp_path / "a.yaml", LLAMA_13B)
    b = _plan_file(tmp_path / "b.yaml", MOE_16X, micro_batch=4)
    assert main(["diff", str(a), str(b)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ("warning: A trains my-llama-13b, B trains my-moe-16x3b: the step "
                            "times compare two different models, not two plans of one\n")
    assert "A = tp1-pp1-dp256-mb2-gb1024-zero3 (my-llama-13b on dgx-h100, 256 devices)" \
        in captured.out
    assert "B = tp1-pp1-dp256-mb4-gb1024-zero3 (my-moe-16x3b on dgx-h100, 256 devices)" \
        in captured.out


def test_diff_of_one_model_has_no_model_warning(capsys, tmp_path):
    a = _plan_file(tmp_path / "a.yaml", LLAMA_13B)
    b = _plan_file(tmp_path / "b.yaml", LLAMA_13B, micro_batch=1)
    assert main(["diff", str(a), str(b), "--json"]) == 0
    captured = capsys.readouterr()
    out = _strict_json(captured.out)
    assert captured.err == "" and out["a"]["model"] == out["b"]["model"] == "my-llama-13b"


def test_diff_warns_about_a_plan_that_does_not_fit(capsys, tmp_path):
    a = _plan_file(tmp_path / "a.yaml", LLAMA_13B)
    assert main(["diff", str(a), str(_oom_plan(tmp_path)), "--json"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("warning: B = tp1-pp1-dp256-mb4-gb1024 does not fit on "
                          "h100-sxm-80gb: out of memory: stage 0 needs ")


def test_an_overrun_smaller_than_the_rounding_is_still_visible():
    from planner.search import GiB, memory_reason
    from simulator.step.memory import MemoryBreakdown
    # 70.83 vs 70.78 GiB: one decimal would print 70.8 twice; the gap is 0.05 GiB = 51.2 MiB
    need = MemoryBreakdown(weights_bytes=40 * GiB, gradients_bytes=0, optimizer_bytes=0,
                           activations_bytes=30.83 * GiB)
    reason = memory_reason(need, 0, 70.78 * GiB)
    assert reason.startswith("out of memory: stage 0 needs 70.83 GiB, device has 70.78 GiB "
                             "usable, 51.2 MiB over (weights 40.0,")


RUNS_HEADER = ("id,source,table,model,params_b,layers,hidden,heads,kv_heads,ffn_hidden,vocab,"
               "seq_len,gpu,num_gpus,tp,pp,dp,cp,vpp,micro_batch,global_batch,recompute,"
               "sequence_parallel,zero_stage,ref_step_time_s,ref_step_time_kind,"
               "reported_tflops_per_gpu,reported_mfu,reported_hfu,notes\n")
RUN_ROW = ("x001,my cluster,mine,Llama 13B,13,40,5120,40,40,13824,32000,4096,H100-SXM5-80GB,"
           "256,1,1,256,,,2,1024,none,no,3,{ref},measured,,,,own run\n")


@pytest.mark.parametrize("ref, message", [
    ("0", "error: runs.csv x001: ref_step_time_s='0' is not a step time > 0; give the "
          "measured seconds per step"),
    ("", "error: runs.csv: no row could be simulated; x001: ref_step_time_s is empty; fill it "
         "in (the row cannot be simulated without it)"),
])
def test_validate_refuses_a_user_table_with_exit_2(capsys, tmp_path, ref, message):
    path = tmp_path / "runs.csv"
    path.write_text(RUNS_HEADER + RUN_ROW.format(ref=ref))
    assert main(["validate", "--runs", str(path)]) == 2
    captured = capsys.readouterr()
    assert _err_of(captured) == message and captured.out == ""


def _err_of(captured) -> str:
    return " ".join(captured.err.split())


def test_an_expert_split_rejection_states_each_broken_rule(capsys):
    # tiny-moe on 2 ranks, tp1 pp2 dp1: the attention ranks tp*cp*dp = 1 cannot hold ep=2
    code = main(["plan", "--model", "tiny-moe", "--cluster", "localhost-cpu", "--ranks", "2",
                 "--fix", "ep=2", "--fix", "pp=2", "--json"])
    out = _strict_json(capsys.readouterr().out)
    reasons = [r["reason"] for r in out["rejected"] if r["id"] == "tp1-pp2-dp1-ep2-etp1"]
    assert code == 2 and "ep=2, etp=1: etp*ep = 2 must divide the attention ranks " \
                         "tp*cp*dp = 1" in reasons


@pytest.mark.parametrize("value", ["pp,dp,tp", "[pp,dp,tp]", "pp.dp"])
def test_a_placement_in_another_syntax_is_shown_the_accepted_one(value):
    from apps.plan_options import parse_fixed
    from planner.spec import PlanError
    with pytest.raises(PlanError) as info:
        parse_fixed([f"placement={value}"])
    assert str(info.value) == (f"--fix placement={value}: a placement is tp, dp, pp in rank "
                               "order joined by dots, innermost first, e.g. --fix "
                               "placement=pp.dp.tp; commas separate placements to search "
                               "(--fix placement=tp.dp.pp,tp.pp.dp)")


def test_dotted_placements_are_searched():
    from apps.plan_options import parse_fixed
    assert parse_fixed(["placement=pp.dp.tp,tp.dp.pp"]).placement == (("pp", "dp", "tp"),
                                                                      ("tp", "dp", "pp"))


def test_negative_show_rejected_is_refused(capsys):
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu",
                 "--show-rejected", "-1"]) == 2
    assert capsys.readouterr().err == "error: --show-rejected=-1 must be >= 0\n"


def test_plan_header_counts_the_devices_searched(capsys):
    # 4 localhost ranks, --devices 2: the plans use 2 of the 4
    main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--devices", "2",
          "--json"])
    assert "on localhost-cpu (2 of 4 devices, localhost-cpu-core)" in _err(capsys)


def test_a_short_budget_is_shown_in_hours_or_minutes(capsys):
    import re
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks", "2",
                 "--steps", "100"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # 100 steps x 8 sequences x 128 tokens (tiny-gpt) = 102,400 tokens at thousands of
    # tokens/s: seconds, not days
    assert "0.0 days" not in out
    assert re.search(r"102.4K tokens on \S+: [\d.]+ (s|min) wall time", out)


def test_plan_and_sweep_json_say_which_time_to_train_they_give(capsys):
    from planner.time_to_train import HEALTHY_TIME, WALL_TIME
    assert WALL_TIME == "wall time = tokens / (tokens/s x goodput): failures, checkpoints, " \
                        "restarts"
    assert HEALTHY_TIME == "healthy time = tokens / tokens/s: no failures, checkpoints or " \
                           "restarts"
    main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks", "2",
          "--tokens", "1M", "--json"])
    plan = _strict_json(capsys.readouterr().out)
    assert plan["train_assumptions"]["time_to_train"] == WALL_TIME
    row = plan["plans"][0]
    # wall time: tokens / (tokens/s x goodput), in days
    assert row["wall_days"] * 86400 == pytest.approx(1e6 / (row["tokens_per_s"] * row["goodput"]))
    main(["sweep", "--model", "tiny-gpt", "--tokens", "1B", "--gpus", "8", "--workers", "1",
          "--json"])
    sweep = _strict_json(capsys.readouterr().out)
    point = sweep["points"][0]
    assert sweep["time_to_train"] == HEALTHY_TIME
    assert point["time_to_train_s"] == pytest.approx(1e9 / point["tokens_per_s"])


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_the_stated_device_mtbf_is_the_one_computed():
    from apps.cli import build_parser
    from planner.objective import DEVICE_MTBF_HOURS
    # Dubey et al. 2024 §3.3.4: 16,384 GPUs x 54 days x 24 h / 419 interruptions = 50,677 h
    assert round(DEVICE_MTBF_HOURS) == round(16384 * 54 * 24 / 419) == 50677
    plan = next(a for a in build_parser()._subparsers._group_actions[0].choices["plan"]._actions
                if "--mtbf-hours" in a.option_strings)
    assert f"(default {round(DEVICE_MTBF_HOURS)}:" in plan.help
    docs = (ROOT / "docs" / "planner.md").read_text()
    assert f"device MTBF {round(DEVICE_MTBF_HOURS):,} h" in docs and "50,675" not in docs


def test_docs_list_every_node_type_the_cluster_files_accept():
    from simulator.network.cluster import node_type_names
    docs = (ROOT / "docs" / "clusters.md").read_text()
    for name in node_type_names():
        assert f"\n| {name} |" in docs, name


def test_compare_help_and_readme_count_the_plans_the_lists_hold():
    from apps.cli import build_parser
    from apps.compare_plans import DEFAULT_PLANS, SWEEP
    compare = build_parser()._subparsers._group_actions[0].choices["compare"]
    sweep = next(a for a in compare._actions if "--sweep" in a.option_strings)
    assert sweep.help == (f"the full sweep ({len(SWEEP)} plans, ~2-5 min) instead of the "
                          f"{len(DEFAULT_PLANS)} default plans")
    words = {6: "six"}
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"`meshplan compare` then predicts, runs and compares {words[len(DEFAULT_PLANS)]} "
            f"local plans (`--sweep`: {len(SWEEP)} plans over") in readme
    validation = (ROOT / "docs" / "validation.md").read_text()
    assert f"meshplan compare --sweep      # {len(SWEEP)} plans" in validation
    assert f"meshplan compare              # {len(DEFAULT_PLANS)} plans" in validation

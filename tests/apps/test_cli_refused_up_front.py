"""Input whose answer is known before the search is refused before anything is printed: exit 2
and one ``error:`` line naming the flag or field, the value and a fix, with no search header
ahead of it (a user reading the header would take the search as started)."""

from __future__ import annotations

import pytest

from apps.cli import main
from planner.presets import load_model
from planner.spec import PlanError

PLAN = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1"]


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("flags, message", [
    # the default batch is 4,194,304 tokens (Llama 3's first batch, `DEFAULT_BATCH_TOKENS`):
    # a sequence of 1e8 tokens would round it to one sequence nobody asked for
    (["--seq-len", "100000000"],
     "--seq-len 100000000 is longer than the default global batch of 4194304 tokens"),
    (["--fix", "tpp=2"], "--fix tpp=2: unknown search field(s) ['tpp'] (did you mean 'tp'?)"),
    (["--fix", "schedule=foo"], "--fix schedule=foo: schedule='foo' is not one of"),
    (["--fix", "placement=tp.tp.dp"], "--fix placement=tp.tp.dp: a placement is tp, dp, pp"),
    (["--fix", "tp=2", "--fix", "tp=4"], "--fix tp given twice (tp=2 and tp=4)"),
    (["--memory-headroom", "1.5"], "--memory-headroom=1.5 must be in (0, 1]"),
    # llama3-8b: 32 heads, 8 KV heads, FFN 14336 (Meta's config.json); gcd 8, divisors 1, 2, 4, 8
    (["--fix", "tp=3"], "--fix tp=3: tp=3 does not divide num_heads=32; use tp in [1, 2, 4, 8]"),
    (["--fix", "tp=3,5"], "--fix tp=3,5: tp=3 does not divide num_heads=32, tp=5 does not "
                          "divide num_heads=32; use tp in [1, 2, 4, 8]"),
])
def test_plan_refuses_before_the_header(capsys, flags, message):
    assert main(PLAN + flags) == 2
    err = _err(capsys)
    assert err.startswith("error: ") and "global batch" not in err.split(message)[0]
    assert message in err


def test_a_legal_tp_among_the_fixed_values_is_searched(capsys):
    # tp=4 divides 32, 8 and 14336: the illegal 3 beside it is one rejected branch, no error
    assert main(PLAN + ["--fix", "tp=3,4", "--top-k", "1", "--json"]) == 0


@pytest.mark.parametrize("fields, message", [
    # 32 blocks after no dense ones: a frequency of 40 would make block 0 the only MoE block
    ({"moe_layer_freq": 40},
     "moe_layer_freq=40 is more than the 32 blocks after moe_first_dense_layers=0"),
])
def test_moe_layer_frequency_beyond_the_blocks_is_refused(fields, message):
    moe = load_model("tiny-moe")
    layers = moe.num_layers
    with pytest.raises(PlanError, match="moe_layer_freq"):
        moe.replace(moe_layer_freq=layers + 1)
    # the message as worked for a 32-block model
    with pytest.raises(PlanError) as exc:
        moe.replace(num_layers=32, moe_first_dense_layers=0, **fields)
    assert message in str(exc.value)
    assert moe.replace(moe_layer_freq=layers).moe_layer_freq == layers  # one block: legal


@pytest.mark.parametrize("field, value", [
    ("experts_per_token", 2), ("moe_ffn_hidden", 1024), ("moe_layer_freq", 2),
    ("router", "sigmoid"), ("capacity_factor", 1.25),
])
def test_expert_fields_on_a_dense_model_are_refused(field, value):
    with pytest.raises(PlanError) as exc:
        load_model("llama3-8b").replace(**{field: value})
    text = str(exc.value)
    assert f"{field}={value!r}" in text and "num_experts is 0 (the default: a dense model)" in text


def test_topo_marks_the_fabric_defaults_a_file_left_out(tmp_path, capsys):
    path = tmp_path / "mini.yaml"
    path.write_text("kind: gpu\nnode_type: dgx-h100\nnodes: 4\nfabric: {switch_radix: 64}\n")
    assert main(["topo", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # the cluster is named after the file; docs/clusters.md: fat-tree and 1:1 are the defaults
    assert out.startswith("mini: 32 x h100-sxm-80gb")
    assert "fat-tree (default)" in out and "oversubscription 1:1 (default)" in out
    path.write_text("kind: gpu\nnode_type: dgx-h100\nnodes: 4\n"
                    "fabric: {switch_radix: 64, topology: fat-tree, oversubscription: 2.0}\n")
    assert main(["topo", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "fat-tree," in out and "(default)" not in out


def test_a_missing_switch_radix_says_where_the_fields_are(tmp_path, capsys):
    path = tmp_path / "mini.yaml"
    path.write_text("kind: gpu\nnode_type: dgx-h100\nnodes: 4\n")
    assert main(["topo", str(path)]) == 2
    assert ("cluster 'mini' is missing field fabric.switch_radix; add it (every field of a "
            "cluster file is in docs/clusters.md, Format)") in _err(capsys)


def test_help_lists_every_cluster_preset():
    # `--help` imports no simulator, so the list is written out: it must be the presets'
    from apps.format import CLUSTER_PRESETS
    from simulator.network.cluster import cluster_names
    assert sorted(CLUSTER_PRESETS) == sorted(cluster_names())


@pytest.mark.parametrize("argv, message", [
    # 1M sequences of 8192 tokens = 8.4e9 tokens, past the 1e9 bound (60x Llama 3's 16M)
    (PLAN + ["--global-batch", "1M"], "--global-batch='1M' is more than 1.22e+05 sequences"),
    (PLAN + ["--global-batch", "0"], "--global-batch='0' must be a positive count of "
                                     "sequences of 8192 tokens such as 512"),
    # a CPU has only an fp32 peak: the fix names fp32, not the refused bf16
    (["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks", "2", "--dtype",
      "bf16"], "dtype=bf16: localhost-cpu-core has no bf16 peak FLOP/s; it runs fp32; use "
               "--dtype fp32"),
    (["topo", "dgx-h100", "--draw-nodes", "4"],
     "--draw-nodes 4 has no effect without --png FILE"),
    (["plan", "--model", "llama3-8B", "--cluster", "dgx-h100"],
     "model='llama3-8B' is neither a preset (did you mean 'llama3-8b'?)"),
    (["plan", "--model", "llama3-8b", "--cluster", "dgx_h100"],
     "cluster='dgx_h100' is neither a preset (did you mean 'dgx-h100'?)"),
    (["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--globl-batch", "8"],
     "unrecognized arguments: --globl-batch 8 (did you mean '--global-batch'?)"),
    # a flag is its whole name: argparse would otherwise run --dev 8 as --devices 8
    (["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--dev", "8"],
     "unrecognized arguments: --dev 8"),
])
def test_more_input_refused_before_any_work(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as exc:      # argparse's own errors exit through the parser
        code = exc.code
    assert code == 2
    err = _err(capsys)
    assert err.startswith("error: ") and message in err


def test_no_plan_on_one_nvl72_rack_names_the_batch_fix(capsys):
    # 512 sequences do not split over 72 GPUs, and tp must divide llama3-8b's 32 heads
    assert main(["plan", "--model", "llama3-8b", "--cluster", "gb200-nvl72", "--nodes",
                 "1"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "give --global-batch 504 (a multiple of 72) or --devices 64" in out
    # the devices asked for, not the cluster's: 512 over 5 GPUs (5 is prime, 32 heads)
    assert main(["plan", "--model", "llama3-8b", "--cluster", "gb200-nvl72", "--nodes", "1",
                 "--devices", "5"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "not a multiple of the 5 devices; give --global-batch 510 (a multiple of 5) or " \
           "--devices 4" in out


def test_a_plan_file_error_names_the_file_and_the_section(tmp_path, capsys):
    plan = tmp_path / "p.yaml"
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--top-k", "1",
                 "--out", str(plan)]) == 0
    text = plan.read_text()
    import re
    # tiny-gpt: 4 heads (planner/presets), so tp=3 cannot split them
    plan.write_text(re.sub(r"(?m)^  tp: \d+$", "  tp: 3", text))
    capsys.readouterr()
    assert main(["simulate", str(plan)]) == 2
    err = _err(capsys)
    assert f"plan file {plan}, plan: tp=3 does not divide num_heads=4" in err


@pytest.mark.parametrize("command", [["topo", "{path}"],
                                     ["plan", "--model", "llama3-8b", "--cluster", "{path}"]])
def test_a_default_dtype_the_device_cannot_run_is_refused_at_load(tmp_path, capsys, command):
    # H100 (Hopper) has FP8 tensor cores but neither MX block scaling nor FP4 (Blackwell's):
    # the file's key is to blame, not a --dtype nobody gave
    path = tmp_path / "mini.yaml"
    path.write_text("kind: gpu\nnode_type: dgx-h100\nnodes: 2\ndefault_dtype: nvfp4\n"
                    "fabric: {switch_radix: 64}\n")
    assert main([a.format(path=path) for a in command]) == 2
    assert _err(capsys) == (
        "error: cluster 'mini': default_dtype=nvfp4: h100-sxm-80gb has no FP4 tensor cores "
        "(Blackwell); it runs bf16, fp8, fp8-current; use default_dtype: fp8-current or a "
        "device that has them")


def test_a_cluster_file_without_kind_says_the_field_is_missing(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("node_type: dgx-h100\nnodes: 2\nfabric: {switch_radix: 64}\n")
    assert main(["topo", str(path)]) == 2
    assert _err(capsys) == "error: cluster 'bad' is missing field kind; add kind: gpu (or localhost)"


def test_topo_says_when_the_oversubscription_changes_nothing(tmp_path, capsys):
    from apps.cmd_topo import collective_rows
    from simulator.network.cluster import load_cluster
    spec = ("kind: gpu\nnode_type: dgx-h100\nnodes: 16\n"
            "nic: {{per_node: 2, speed_Gbps: 400, transport: roce}}\n"
            "fabric: {{topology: fat-tree, switch_radix: 64, oversubscription: {over}{extra}}}\n")
    path = tmp_path / "mini.yaml"
    times = []
    for over in ("1.0", "2.0"):
        # 64 ports at 2:1: 42 down = 21 nodes of 2 NICs, so one leaf holds all 16
        path.write_text(spec.format(over=over, extra=""))
        times.append(collective_rows(load_cluster(str(path)), "all_reduce", [2**30],
                                     None)[0]["time_s"])
    assert times[0] == times[1]
    assert main(["topo", str(path)]) == 0
    assert ("fat-tree, 1 tier(s), radix 64, 21 nodes per leaf, oversubscription 2:1 (no "
            "effect: one leaf holds all 16 nodes; give nodes_per_leaf below 16 to spread "
            "them)") in _out(capsys)
    path.write_text(spec.format(over="2.0", extra=", nodes_per_leaf: 8"))
    assert main(["topo", str(path)]) == 0
    out = _out(capsys)
    assert "oversubscription 2:1 switches" in out and "no effect" not in out


def _out(capsys) -> str:
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, message", [
    (["export", "p.yaml", "--to", "megatron", "--nodes", "4"],
     "meshplan export: unrecognized arguments: --nodes 4 (--nodes is an option of plan, "
     "launch, topo, collective, not of this command); see `meshplan export --help`"),
    (PLAN + ["--mtbf-hours", "inf", "--tokens", "1T"], "--mtbf-hours=inf must be a finite number"),
])
def test_flags_of_another_command_and_infinite_values_are_named(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and message in _err(capsys)


def test_a_tiny_mtbf_gives_zero_goodput_not_a_traceback(capsys):
    # an MTBF of 3.6 s per device on 16 GPUs: e**(segment / MTBF) overflows a float; the
    # job never completes a checkpoint segment, so its goodput is 0 (Daly 2006's limit)
    assert main(PLAN[:-1] + ["2", "--fix", "tp=8", "--fix", "pp=1", "--tokens", "1T",
                             "--mtbf-hours", "0.001", "--top-k", "1", "--json"]) == 0
    import json
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["goodput"] == 0.0 for p in plans)


def test_out_may_not_replace_an_input_file(tmp_path, capsys):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("kind: gpu\nnode_type: dgx-h100\nnodes: 2\nfabric: {switch_radix: 64}\n")
    before = cluster.read_text()
    assert main(["plan", "--model", "llama3-8b", "--cluster", str(cluster), "--out",
                 str(cluster)]) == 2
    assert "is the --cluster file: the plan would replace it" in _err(capsys)
    assert cluster.read_text() == before


def test_export_refuses_a_plan_with_more_ranks_than_its_cluster(tmp_path, capsys):
    import re
    plan = tmp_path / "p.yaml"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                 "--fix", "tp=8", "--top-k", "1", "--out", str(plan)]) == 0
    plan.write_text(re.sub(r"(?m)^  dp: \d+$", "  dp: 2", plan.read_text()))
    capsys.readouterr()
    # tp 8 x dp 2 = 16 ranks on one 8-GPU node
    assert main(["export", str(plan), "--to", "megatron"]) == 2
    assert "plan file: tp*pp*dp = 8*1*2 = 16 > devices(8)" in _err(capsys)

"""`meshplan export`: every emitted name is one the framework's own parser or schema defines
(planner/presets/export_names.yaml, read from each framework's source at a cited commit)."""

import json
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from apps.cli import main
from planner.export import export_plan
from planner.presets import load_model
from planner.spec import Plan

NAMES = yaml.safe_load((Path(__file__).parents[2] / "planner" / "presets"
                        / "export_names.yaml").read_text())
PLANS = [
    Plan(tp=8, pp=16, dp=128, micro_batch=1, global_batch=2048, zero_stage=2,
         sequence_parallel=True, recompute="full", stage_layers=(7,) + (8,) * 14 + (7,)),
    Plan(tp=2, pp=2, dp=2, micro_batch=2, global_batch=16, schedule="interleaved-1f1b",
         virtual_stages=2, recompute="selective", dtype="fp8", placement=("tp", "pp", "dp")),
    Plan(tp=1, pp=1, dp=8, cp=2, micro_batch=1, global_batch=8, zero_stage=3, dtype="fp16"),
    Plan(tp=4, pp=1, dp=2, micro_batch=1, global_batch=8, zero_stage=1),
    Plan(tp=2, pp=2, dp=4, ep=4, etp=2, micro_batch=1, global_batch=16, dtype="mxfp8"),
    Plan(tp=2, pp=1, dp=2, ep=2, micro_batch=1, global_batch=8, dtype="nvfp4", zero_stage=1),
    Plan(tp=2, pp=2, dp=4, ep=4, micro_batch=1, global_batch=16, stage_layers=(30, 31)),
]
MODELS = {0: "llama3-405b", 1: "llama3-8b", 2: "llama3-8b", 3: "tiny-gpt", 4: "mixtral-8x7b",
          5: "tiny-moe", 6: "deepseek-v3"}


def _check(framework: str, name: str, value: object) -> None:
    spec = NAMES[framework]["names"]
    assert name in spec, f"{name} is not a {framework} name"
    kind = spec[name]
    if kind == "switch":
        assert value is None, f"{name} takes no value"
    elif isinstance(kind, list):
        assert value in kind or (isinstance(value, list) and set(value) <= set(kind)), \
            f"{name}={value!r} is not one of {kind}"
    else:
        assert value is not None, f"{name} needs a value"


def _megatron_args(text: str) -> list[tuple[str, object]]:
    words = shlex.split(text.replace("\\\n", " "))
    out = []
    for i, word in enumerate(words):
        if word.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else None
            out.append((word, None if nxt is None or nxt.startswith("--") else nxt))
    return out


def _walk(prefix: str, table: dict):
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):  # a TOML table or a JSON object: its keys are nested
            yield from _walk(name + ".", value)
        else:
            yield name, value


@pytest.mark.parametrize("index", range(len(PLANS)))
def test_every_emitted_name_is_the_frameworks_own(index):
    model, plan = load_model(MODELS[index]), PLANS[index]
    megatron = export_plan(model, plan, "megatron", steps=100)
    pairs = _megatron_args(megatron.text)
    assert [n for n, _ in pairs] == megatron.names
    for name, value in pairs:
        _check("megatron", name, value)
    titan = export_plan(model, plan, "torchtitan", steps=100)
    parsed = list(_walk("", tomllib.loads(titan.text)))
    assert sorted(n for n, _ in parsed) == sorted(titan.names)
    for name, value in parsed:
        _check("torchtitan", name, value)
    ds = export_plan(model, plan, "deepspeed")
    parsed = list(_walk("", json.loads(ds.text)))
    assert [n for n, _ in parsed] == ds.names
    for name, value in parsed:
        _check("deepspeed", name, value)


def test_llama3_405b_plan_by_hand():
    # Llama 3 §3.3.2: 126 layers on 16 stages, one fewer on the first and last
    model, plan = load_model("llama3-405b"), PLANS[0]
    args = dict(_megatron_args(export_plan(model, plan, "megatron").text))
    assert args["--decoder-first-pipeline-num-layers"] == "7"
    assert args["--decoder-last-pipeline-num-layers"] == "7"
    assert args["--data-parallel-sharding-strategy"] == "optim_grads"  # ZeRO-2
    titan = tomllib.loads(export_plan(model, plan, "torchtitan").text)
    # 2048 sequences over dp=128 replicas: 16 per data-parallel rank
    assert titan["training"]["local_batch_size"] == 16
    assert titan["parallelism"]["pipeline_parallel_layers_per_stage"] == 8
    ds = json.loads(export_plan(model, plan, "deepspeed").text)
    # DeepSpeed: train_batch_size = micro-batch x accumulation x dp = 1 x 16 x 128
    assert ds["gradient_accumulation_steps"] == 16
    assert any(r.startswith("pp=16") for r in export_plan(model, plan, "deepspeed").unsupported)


def test_precision_recipes_and_experts_by_name():
    # Megatron-LM: MXFP8 is --fp8-format e4m3 with --fp8-recipe mxfp8; EP and ETP their sizes
    model, plan = load_model("mixtral-8x7b"), PLANS[4]
    args = dict(_megatron_args(export_plan(model, plan, "megatron").text))
    assert (args["--fp8-format"], args["--fp8-recipe"]) == ("e4m3", "mxfp8")
    assert (args["--expert-model-parallel-size"], args["--expert-tensor-parallel-size"]) == \
        ("4", "2")
    titan = tomllib.loads(export_plan(model, plan, "torchtitan").text)
    assert titan["model"]["converters"] == ["quantize.linear.mx"]
    assert titan["parallelism"]["expert_parallel_degree"] == 4
    nvfp4 = export_plan(load_model("tiny-moe"), PLANS[5], "torchtitan")
    assert any(r.startswith("dtype=nvfp4") for r in nvfp4.unsupported)


def test_export_cli_prints_text_and_reasons(tmp_path, capsys):
    from apps.clusters import cluster_from_flags, cluster_ref
    from planner.planfile import PlanFile, write_plan_file
    model, plan = load_model("llama3-8b"), PLANS[3].replace(global_batch=8)
    cluster = cluster_from_flags("dgx-h100", 1, None, None)
    path = tmp_path / "plan.yaml"
    write_plan_file(path, PlanFile(model=model, plan=plan, prediction={},
                                   cluster=cluster_ref(cluster, plan, "dgx-h100")))
    assert main(["export", str(path), "--to", "torchtitan"]) == 0
    captured = capsys.readouterr()
    assert tomllib.loads(captured.out)["parallelism"]["tensor_parallel_degree"] == 4
    assert "not expressed in torchtitan: zero_stage=1" in " ".join(captured.err.split())
    assert main(["export", str(path), "--to", "deepspeed", "--steps", "0"]) == 2


def test_a_plan_edited_to_a_dtype_its_device_lacks_is_refused_by_export_as_by_simulate(
        tmp_path, capsys):
    # A100 has no FP8 tensor cores (NVIDIA A100 datasheet: TF32/BF16/FP16/INT8 only)
    from apps.cli import main
    plan = tmp_path / "a100.yaml"
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "dgx-a100", "--nodes", "1",
                 "--global-batch", "8", "--top-k", "2", "--out", str(plan)]) == 0
    text = plan.read_text()
    assert "  dtype: bf16\n" in text
    plan.write_text(text.replace("  dtype: bf16\n", "  dtype: fp8\n"))
    capsys.readouterr()
    errors = []
    for command in (["simulate", str(plan)], ["export", str(plan), "--to", "megatron"]):
        assert main(command) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        errors.append(" ".join(captured.err.split()))
    assert errors[0] == errors[1]
    assert "dtype=fp8: a100-sxm-80gb has no FP8 tensor cores" in errors[0]


def test_deepseek_v3_experts_as_megatrons_own_recipe_writes_them():
    # Megatron-LM examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh (the V3
    # architecture) at the commit of export_names.yaml: --moe-layer-freq [0]*3+[1]*58,
    # --moe-shared-expert-intermediate-size 2048, sigmoid scores, 8 groups, top-4 groups
    args = dict(_megatron_args(export_plan(load_model("deepseek-v3"), PLANS[6], "megatron").text))
    assert args["--moe-shared-expert-intermediate-size"] == "2048"
    assert args["--moe-layer-freq"] == "[0]*3+[1]*58"
    assert args["--moe-router-score-function"] == "sigmoid"
    assert (args["--moe-router-num-groups"], args["--moe-router-group-topk"]) == ("8", "4")
    assert (args["--num-experts"], args["--moe-router-topk"], args["--moe-ffn-hidden-size"]) \
        == ("256", "8", "2048")


def test_a_shared_expert_is_exported_or_named_by_every_framework():
    from planner.presets import model_from_dict
    fields = {"num_layers": 24, "hidden": 2048, "num_heads": 16, "num_kv_heads": 4,
              "ffn_hidden": 8192, "vocab_size": 50304, "seq_len": 4096,
              "activation": "swiglu", "norm": "rmsnorm", "num_experts": 16,
              "experts_per_token": 2, "moe_ffn_hidden": 4096, "num_shared_experts": 1}
    model = model_from_dict(fields, name="my-moe-16x3b")
    plan = Plan(tp=1, pp=1, dp=256, micro_batch=4, global_batch=1024, zero_stage=3)
    megatron = export_plan(model, plan, "megatron")
    # one shared expert of the routed experts' width: 1 x 4096
    assert dict(_megatron_args(megatron.text))["--moe-shared-expert-intermediate-size"] == "4096"
    assert "--moe-layer-freq" not in megatron.names          # every block is MoE: the default
    ds = export_plan(model, plan, "deepspeed")
    assert any(r.startswith("num_experts=16: experts are built in code") and "1 shared "
               "expert(s) have no key either" in r for r in ds.unsupported)
    titan = export_plan(model, plan, "torchtitan")
    assert any(r.startswith("model=my-moe-16x3b: torchtitan builds models from registered "
                            "flavors") for r in titan.unsupported)

"""Framework families as data (presets/frameworks/*.yaml): each file parses with every
required default, the row's source / table picks the family (not its year), recipes and
notes switches apply, and the values are those the frameworks document."""

import pytest

from planner.spec import PlanError
from simulator.validation.frameworks import REQUIRED, framework, load_frameworks, pick_framework
from simulator.validation.validate import framework_options

FAMILIES = {"megatron-lm", "megatron-core", "megatron-deepspeed", "deepspeed-zero",
            "torchtitan", "llm-foundry"}


def test_one_file_per_family_with_every_default():
    fws = load_frameworks()
    assert {fw.name for fw in fws} == FAMILIES
    for fw in fws:
        assert set(REQUIRED) <= set(fw.defaults), fw.name
    # Tried from the most specific: ZeRO-3-as-baseline before Megatron-LM.
    order = [fw.name for fw in fws]
    assert order.index("deepspeed-zero") < order.index("megatron-lm")
    assert order.index("megatron-core") < order.index("megatron-lm")


@pytest.mark.parametrize("row, name", [
    ({"source": "NVIDIA/Megatron-LM README.md (commit f2e5db402c, 2024-07-15, Megatron-Core "
                "r0.8.0)"}, "megatron-core"),
    ({"source": "NVIDIA/Megatron-LM README (2020-09, commit 5281919420)"}, "megatron-lm"),
    ({"source": "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md"}, "megatron-core"),
    ({"source": "NVIDIA-NeMo/Automodel docs/performance-summary.mdx"}, "torchtitan"),
    ({"source": "BigScience bigscience-workshop/bigscience train/tr11-176B-ml/README.md"},
     "megatron-deepspeed"),
    ({"source": "Narayanan et al. 2021 (SC21)", "table": "Table 2 (PTD-P vs ZeRO-3)"},
     "deepspeed-zero"),
    ({"source": "Narayanan et al. 2021 (SC21)", "table": "Table 1"}, "megatron-lm"),
    ({"source": "mosaicml/llm-foundry scripts/train/benchmarking/README.md"}, "llm-foundry"),
    # The year does not pick: a 2025 torchtitan table and a 2019 paper.
    ({"source": "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06"}, "torchtitan"),
    ({"source": "Shoeybi et al. 2019 'Megatron-LM'"}, "megatron-lm"),
])
def test_family_is_picked_by_source_and_table(row, name):
    fw, flags = pick_framework(row)
    assert fw.name == name and flags == []


def test_documented_values():
    # DeepSpeed configuration docs (zero_optimization): stage3_prefetch_bucket_size 5e7,
    # overlap_comm false.
    zero = framework("deepspeed-zero")
    o = framework_options(zero, dict(zero.defaults), overlap_dp=False)
    assert o.zero3_prefetch_params == 5e7 and not o.zero3_overlap_reduce
    assert o.zero3_unaggregated
    # torch DDP bucket_cap_mb = 25 (MiB), used only when the reduction overlaps the backward.
    mlm = framework("megatron-lm")
    assert framework_options(mlm, dict(mlm.defaults), overlap_dp=True).dp_bucket_bytes == \
        25 * 2**20
    assert framework_options(mlm, dict(mlm.defaults), overlap_dp=False).dp_bucket_bytes is None
    # Megatron-Core perf recipes: TP-comm overlap, overlapped param gather, distributed
    # optimizer; the fitted megatron-deepspeed P2P overhead comes from efficiency.yaml.
    core = framework("megatron-core")
    oc = framework_options(core, dict(core.defaults), overlap_dp=True)
    assert oc.tp_comm_overlap and oc.overlap_param_gather and core.defaults["zero_stage"] == 1
    mds = framework("megatron-deepspeed")
    assert framework_options(mds, dict(mds.defaults), overlap_dp=False).p2p_overhead_s > 0


def test_recipes_and_notes_switches():
    mds = framework("megatron-deepspeed")
    values, notes = mds.settings({"source": "BigScience bigscience-workshop/bigscience"})
    assert (values["dtype"], values["vocab"], values["cluster"]) == \
        ("bf16", 250680, "jean-zay-a100") and notes
    assert mds.settings({"source": "microsoft/Megatron-DeepSpeed"})[0]["dtype"] == "fp16"
    titan = framework("torchtitan")
    assert titan.settings({"notes": "tp mode=async tp"})[0]["tp_comm_overlap"] is True
    assert titan.settings({"notes": "TP mode=vanilla TP"})[0]["tp_comm_overlap"] is False


def test_megatron_bridge_deepseek_v3_h100_script():
    # Megatron-Bridge scripts/performance/run_script.py @fa0315ae2 (25.09): on H100 the
    # DeepSeek-V3 script turns on DeepEP (flex dispatcher), the combined-1F1B EP all-to-all
    # overlap, recompute_modules ["mla_up_proj", "mlp"] and overlap_grad_reduce=False; on
    # B200 / GB200 none of these.
    core = framework("megatron-core")
    row = {"source": "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md",
           "table": "25.09 NeMo Container / Pre-Training Performance / System: DGX-H100",
           "model": "DeepSeek-V3 671B-A37B (DeepSeekV3 (dropless))",
           "gpu": "H100 SXM 80GB (DGX-H100)"}
    values, notes = core.settings(row)
    o = framework_options(core, values, overlap_dp=values["overlap_dp"])
    assert (o.moe_dispatcher, o.moe_a2a_overlap, o.recompute_modules) == \
        ("deepep", True, ("mla_up_proj", "mlp"))
    assert values["overlap_dp"] is False and o.dp_bucket_bytes is None
    assert any("DeepSeek-V3 H100" in n for n in notes)
    for other in ({**row, "gpu": "GB200 (DGX-GB200)"}, {**row, "model": "Llama 3 70B"},
                  {**row, "table": "25.11 NeMo Container / Pre-Training Performance"}):
        o = framework_options(core, core.settings(other)[0], overlap_dp=True)
        assert (o.moe_dispatcher, o.moe_a2a_overlap, o.recompute_modules) == \
            ("alltoall", False, None)


def test_unknown_family_name_is_a_clear_error():
    with pytest.raises(PlanError, match="framework='jax'.*torchtitan"):
        framework("jax")

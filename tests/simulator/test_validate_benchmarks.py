"""The reader on published_benchmarks.csv rows (framework teams' release benchmarks): the
torchtitan Llama 3 8B rows are read as torchtitan FSDP2 runs, FP8 / MXFP8 / NVFP4 rows in their
precision, GB200 rows on NVL72 racks, and MoE rows are listed under ``skipped`` with their
reason instead of being simulated as something else. Rows below are copied cell by cell from ../shared/data/published_benchmarks.csv
(ids kept) and checked by hand against the table's README."""

import csv
from pathlib import Path

import pytest

from simulator.validation.validate import (
    predict,
    read_runs,
    row_precision,
    unsupported_reason,
    validate_runs,
)

HEADER = ["id", "source", "table", "model", "params_b", "layers", "hidden", "heads",
          "kv_heads", "ffn_hidden", "vocab", "seq_len", "gpu", "num_gpus", "tp", "pp", "dp",
          "cp", "vpp", "micro_batch", "global_batch", "recompute", "sequence_parallel",
          "zero_stage", "ref_step_time_s", "ref_step_time_kind", "reported_tflops_per_gpu",
          "reported_mfu", "reported_hfu", "notes"]
TITAN_SRC = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @b5bcd76c66d0 "
             "(added at 820504e20d11; same tables in docs/performance.md @d4c86e375; run on "
             "torchtitan 9dec370, torch 1963fc8, torchao eab345c)")
TITAN_GPU = ("H100 SXM 96GB HBM2e, 500W limit (Meta Grand Teton: 8 GPUs/host on NVLink, "
             "400 Gb/s RDMA per GPU)")
# n283: Llama 3 8B, 1D FSDP on 8 H100, local batch 2, GBS 16, selective (op) AC, eager.
N283 = {"id": "n283", "source": TITAN_SRC,
        "table": "Table 1 (1D FSDP, Llama 3.1 8B, 8 GPUs, local bs 2, GBS 16, selective AC)",
        "model": "Llama 3 8B", "params_b": "8.03", "layers": "32", "hidden": "4096",
        "heads": "32", "kv_heads": "8", "ffn_hidden": "14336", "vocab": "128256",
        "seq_len": "8192", "gpu": TITAN_GPU, "num_gpus": "8", "tp": "1", "pp": "1",
        "dp": "8", "cp": "1", "micro_batch": "2", "global_batch": "16",
        "recompute": "selective (toml selective_ac_option=op)",
        "zero_stage": "FSDP2 (ZeRO-3-like), 8-way", "ref_step_time_s": "2.8435",
        "ref_step_time_kind": "derived",
        "notes": "tokens_per_s_per_gpu (TPS/GPU, read at iteration 90)=5762; "
                 "step_time=GBS*seq/(TPS*num_gpus); TPS per device = tokens/(time*TP*PP*CP) "
                 "(torchtitan train.py @9dec370); peak_mem_GiB=82.4; techniques=FSDP; "
                 "precision=bf16; torch.compile=False"}


def _row(**cells):
    row = dict.fromkeys(HEADER, "")
    row.update(N283)
    row.update({k: str(v) for k, v in cells.items()})
    return row


def _write(tmp_path, rows):
    path = tmp_path / "bench.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=HEADER)
        w.writeheader()
        w.writerows(rows)
    return path


def test_torchtitan_8b_row_reads_as_torchtitan_fsdp2(tmp_path):
    case = read_runs(_write(tmp_path, [_row()]))[0]
    p = case.plan
    # The row's own cells: 8 GPUs, FSDP 8-way (ZeRO-3), local batch 2, GBS 16, bf16.
    assert (p.tp, p.pp, p.dp, p.cp, p.micro_batch, p.global_batch) == (1, 1, 8, 1, 2, 16)
    assert (p.zero_stage, p.recompute, p.dtype) == (3, "selective", "bf16")
    # torchtitan is PyTorch FSDP2: the next block's gather prefetched whole (no DeepSpeed
    # 5e7-parameter prefetch bucket), reduce-scatters overlapped, per-node aggregation,
    # SDPA flash attention, no blocking pipeline sends; gradients reduced under the backward.
    o = case.options
    assert o.zero3_prefetch_params is None and o.zero3_overlap_reduce
    assert not o.zero3_unaggregated and not o.blocking_p2p and o.attention == "flash"
    # Its gpu cell names the 96 GB HBM2e H100 at a 500 W limit: Meta's Grand Teton hosts.
    assert case.overlap_dp and case.cluster_name == "grand-teton-h100"
    # The step time as the README defines it: GBS·seq / (TPS/GPU · GPUs) = 16·8192/(5762·8).
    assert case.reference_step_time_s == pytest.approx(16 * 8192 / (5762 * 8), rel=1e-4)


def test_torchtitan_8b_prediction_is_bounded_by_the_peak(tmp_path):
    # A lower bound from first principles: 6·N FLOPs per token (Kaplan et al. 2020) for
    # N = 8.03e9 parameters over 2·8192 tokens per GPU, at the H100 SXM dense bf16 peak of
    # 989 TFLOP/s: 6 · 8.03e9 · 16384 / 989e12 = 0.798 s. The misread row (DeepSpeed ZeRO-3
    # prefetch, fp16, unfused attention) predicted 12.6 s, 16x this bound; the FSDP2 read is
    # within 4x of it (the row's own MFU is 28%: 0.798 / 2.84).
    case = read_runs(_write(tmp_path, [_row()]))[0]
    bound = 6 * 8.03e9 * 16384 / 989e12
    assert bound == pytest.approx(0.798, abs=1e-3)
    assert bound < predict(case, fast=True) < 4 * bound


def test_async_tp_in_notes_turns_on_tp_comm_overlap(tmp_path):
    # n311: TP 8 x FSDP 8 on 64 H100, "TP mode=async TP"; n310: the same with vanilla TP.
    cells = {"num_gpus": 64, "tp": 8, "dp": 8, "micro_batch": 12, "global_batch": 96,
             "zero_stage": "FSDP2 (ZeRO-3-like), 8-way",
             "sequence_parallel": "True (torchtitan TP)"}
    rows = [_row(id="n310", notes="tokens/s (per GPU)=4378; TP mode=vanilla TP; "
                 "quantization=None (bfloat16)", **cells),
            _row(id="n311", notes="tokens/s (per GPU)=4809.4; TP mode=async TP; "
                 "quantization=None (bfloat16)", **cells)]
    cases = {c.id: c for c in read_runs(_write(tmp_path, rows))}
    assert not cases["n310"].options.tp_comm_overlap
    assert cases["n311"].options.tp_comm_overlap and cases["n311"].plan.sequence_parallel


def test_precision_is_read_from_the_notes():
    assert row_precision({"notes": "a=1; precision=nvfp4; b"}) == "nvfp4"
    assert row_precision({"notes": "TP mode=async TP; quantization=float8 rowwise; GBS"}) \
        == "float8 rowwise"
    assert row_precision({"notes": "WPS=109; optimizations=None; MFU"}) == "None"
    assert row_precision({"notes": "tokens/s=1"}) is None


@pytest.mark.parametrize("notes, dtype", [
    # published_benchmarks.csv README: notes name the precision and the scaling recipe.
    ("precision=fp8 (table: FP8, delayed scaling); GBS", "fp8"),
    ("precision=fp8;fp8_recipe=current-scaling (per-tensor); GBS", "fp8-current"),
    ("precision=mxfp8;fp8_recipe=MX block scaling (32-element blocks)", "mxfp8"),
    ("precision=nvfp4", "nvfp4"),
    # torchao float8 training: dynamic per-tensor ("tensorwise") scaling.
    ("tokens/s=942.4; TP mode=async TP; quantization=float8 tensorwise", "fp8-current"),
    ("TPS/GPU=10938; command: llama3_8b.toml + compile, float8 linear converter with fsdp "
     "float8 all-gather", "fp8-current"),
])
def test_low_precision_rows_are_read_in_their_precision(tmp_path, notes, dtype):
    assert unsupported_reason({"notes": notes}) is None
    case = read_runs(_write(tmp_path, [_row(id="x", notes=notes)]))[0]
    assert case.plan.dtype == dtype


def test_torchao_rowwise_float8_is_skipped_not_run_as_tensorwise(tmp_path):
    # n308: "quantization=float8 rowwise" measures at bf16 speed (599.6 vs 597.3 tokens/s
    # of n304): a different recipe, not tensorwise FP8.
    notes = "tokens/s=599.6; TP mode=vanilla TP; quantization=float8 rowwise; GBS"
    result = validate_runs(_write(tmp_path, [_row(id="x", notes=notes), _row(id="ok")]))
    assert [r["id"] for r in result["rows"]] == ["ok"]
    assert "rowwise" in result["skipped"][0]["reason"]


def test_ddp_cell_with_fsdp_0_is_not_zero3(tmp_path):
    # "DDP (table FSDP=0; ...)": FSDP off. It read as ZeRO-3 ("fsdp" in the cell); the
    # Megatron-Core default (distributed optimizer, ZeRO-1) holds instead.
    row = _row(source="NVIDIA/NeMo docs/source/performance/performance_summary.md",
               zero_stage="DDP (table FSDP=0; optimizer sharding not read)",
               notes="precision=fp8 (table: FP8; scaling recipe not printed)")
    case = read_runs(_write(tmp_path, [row]))[0]
    assert case.plan.zero_stage == 1 and "zero_stage=1 (default)" in case.flags


def test_bf16_rows_are_not_skipped():
    for notes in ("precision=bf16; techniques=FSDP", "quantization=None (bfloat16)",
                  "optimizations=None; step_time=GBS*seq/(WPS*num_gpus)"):
        assert unsupported_reason({"notes": notes}) is None


def test_gb200_row_runs_on_nvl72_racks_not_b200_nodes(tmp_path):
    # A DGX-GB200 row runs on NVL72 racks scheduled in 64-GPU segments (16 of 18 trays).
    (case,) = read_runs(_write(tmp_path, [_row(id="g", gpu="GB200 (DGX-GB200 NVL72)")]))
    assert case.cluster_name == "gb200-nvl72-seg16"
    assert case.nodes == 1 and any("--segment=16" in f for f in case.flags)


def test_bf16_moe_row_is_read_with_its_experts(tmp_path):
    # The table README's MoE notes: experts, top-k, expert width, EP degree, dispatcher.
    notes = ("precision=bf16; EP=8; num_experts=8;top_k=2;moe_ffn_hidden=14336;"
             "shared_experts=0; kernels=TE + DeepEP")
    (case,) = read_runs(_write(tmp_path, [_row(id="m", notes=notes)]))
    assert (case.model.num_experts, case.model.experts_per_token,
            case.model.moe_ffn_hidden) == (8, 2, 14336)
    assert case.plan.ep == 8 and case.options.moe_dispatcher == "deepep"


DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


@pytest.mark.skipif(not (DATA / "published_benchmarks.csv").is_file(),
                    reason="../shared/data/published_benchmarks.csv not found")
def test_shipped_table_every_row_is_simulated_or_skipped_with_reason():
    path = DATA / "published_benchmarks.csv"
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    skipped: list[dict] = []
    cases = read_runs(path, skipped)
    assert len(cases) + len(skipped) == len(rows)
    by_id = {r["id"]: r for r in rows}
    for s in skipped:                       # every skip says why
        assert s["reason"]
    for c in cases:                         # every simulated row is in its precision
        assert unsupported_reason(by_id[c.id]) is None
    assert {c.plan.dtype for c in cases} == {"bf16", "fp8", "fp8-current", "mxfp8", "nvfp4"}


def test_sequence_parallel_cell_with_a_remark_is_read(tmp_path):
    # n301's cell: "True (torchtitan TP)": given, so not flagged as a default.
    row = _row(num_gpus=16, tp=8, dp=2, global_batch=4,
               sequence_parallel="True (torchtitan TP)")
    case = read_runs(_write(tmp_path, [row]))[0]
    assert case.plan.sequence_parallel and not any("sequence_parallel" in f
                                                   for f in case.flags)


@pytest.mark.skipif(not (DATA / "published_benchmarks.csv").is_file(),
                    reason="../shared/data/published_benchmarks.csv not found")
def test_shipped_deepseek_v3_row_reads_as_the_published_model():
    # n371's notes give DeepSeek-V3's shape; the parameter counts of the report (§4.2):
    # 671B total, 37B active; EP=64 over dp=256 gives edp = 256 / 64 = 4.
    cases = {c.id: c for c in read_runs(DATA / "published_benchmarks.csv", [])}
    m, p = cases["n371"].model, cases["n371"].plan
    assert m.is_mla and m.num_moe_layers == 58
    assert m.num_params() / 1e9 == pytest.approx(671, abs=1)
    assert m.active_params() / 1e9 == pytest.approx(37, abs=1)
    assert (p.ep, p.edp) == (64, 4)


def test_loso_moe_section_lists_only_expert_rows(tmp_path):
    # `meshplan validate --loso` MoE section: one Mixtral-shaped bf16 row (EP=8 over dp=8)
    # and one dense row; only the first is listed.
    from apps.validate_moe import moe_rows
    notes = "precision=bf16; EP=8; num_experts=8;top_k=2;moe_ffn_hidden=14336;shared_experts=0"
    path = _write(tmp_path, [_row(id="m", notes=notes), _row(id="d")])
    (row,) = moe_rows([str(path)], [])
    assert row["id"] == "m" and "-ep8-" in row["plan"]
    # error = predicted / reference - 1 (the validate convention); no held-out without --loso
    assert row["rel_error"] == row["predicted_step_time_s"] / row["reference_step_time_s"] - 1
    assert row["held_out_rel_error"] is None

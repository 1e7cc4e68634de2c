"""The published-runs reader on rows beyond the shipped table: the GPU named in the row picks
the cluster, Llama-family models get their MLP and norm, and a row that cannot be simulated is
reported with its reason instead of stopping the whole validation."""

import csv
from pathlib import Path

import pytest

from planner.spec import PlanError
from simulator.validation.frameworks import pick_framework
from simulator.validation.validate import gpu_cluster, read_runs, validate_runs

HEADER = ["id", "source", "table", "model", "params_b", "layers", "hidden", "heads",
          "kv_heads", "ffn_hidden", "vocab", "seq_len", "gpu", "num_gpus", "tp", "pp", "dp",
          "cp", "vpp", "micro_batch", "global_batch", "recompute", "sequence_parallel",
          "zero_stage", "ref_step_time_s", "ref_step_time_kind", "reported_tflops_per_gpu",
          "reported_mfu", "reported_hfu", "notes"]


def _row(**cells):
    row = dict.fromkeys(HEADER, "")
    row.update({"source": "mosaicml/llm-foundry benchmarking README", "table": "t",
                "model": "MPT-7b", "layers": "32", "hidden": "4096", "heads": "32",
                "seq_len": "2048", "num_gpus": "8", "tp": "1", "pp": "1", "dp": "8",
                "micro_batch": "4", "global_batch": "32", "zero_stage": "FSDP FULL_SHARD",
                "vocab": "50368", "ref_step_time_s": "1.0", "ref_step_time_kind": "derived"})
    row.update({k: str(v) for k, v in cells.items()})
    return row


def _write(tmp_path, rows):
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=HEADER)
        w.writeheader()
        w.writerows(rows)
    return path


def test_gpu_cell_picks_the_cluster():
    assert gpu_cluster({"gpu": "H100 80GB", "source": ""})[0] == "dgx-h100"
    assert gpu_cluster({"gpu": "H200 SXM", "source": ""})[0] == "dgx-h200"
    assert gpu_cluster({"gpu": "A100 40GB", "source": ""})[0] == "dgx-a100-40gb"
    assert gpu_cluster({"gpu": "A100 80GB PCIe", "source": ""})[0] == "pcie-a100"
    assert gpu_cluster({"gpu": "A100 80GB (Jean Zay)", "source": ""})[0] == \
        "jean-zay-a100"
    with pytest.raises(PlanError, match="V100"):
        gpu_cluster({"gpu": "V100 32GB", "source": ""})


def test_hbm2e_h100_cell_picks_the_power_limited_part_whatever_the_source():
    # The cell, not the source, decides: the same torchtitan source on an "H100 80GB" row
    # stays on the DGX H100.
    cell = "H100 SXM 96GB HBM2e, 500W limit (Meta Grand Teton: 8 GPUs/host on NVLink)"
    assert gpu_cluster({"gpu": cell, "source": "any"}) == ("grand-teton-h100", [])
    assert gpu_cluster({"gpu": "H100 80GB", "source": "pytorch/torchtitan"})[0] == "dgx-h100"
    cluster, flags = gpu_cluster({"gpu": "H100 SXM ~95GB HBM2e, lower TDP", "source": ""})
    assert cluster == "grand-teton-h100"
    assert flags == ["gpu=H100 SXM 96GB HBM2e at 500 W (power limit not stated)"]
    with pytest.raises(PlanError, match="600 W"):
        gpu_cluster({"gpu": "H100 SXM 96GB HBM2e, 600W limit", "source": ""})


def test_power_limited_h100_profile_from_its_datasheet_points():
    from simulator.validation.validate import validation_cluster
    d = validation_cluster("grand-teton-h100", 2).device
    # H100 NVL (835 TFLOP/s dense BF16, 400 W) to H100 SXM (989, 700 W) at 500 W, by hand:
    # 835 + 100 / 300 x 154 = 886.3.
    assert d.peak("bf16") == pytest.approx(835e12 + 100 / 300 * 154e12, rel=1e-3)
    assert d.peak("fp8") / d.peak("bf16") == pytest.approx(1979 / 989, rel=1e-3)
    assert d.memory_bandwidth_Bps == pytest.approx(2.41e12)
    assert d.memory_bytes == pytest.approx(96e9)


def test_family_from_source_not_year():
    # A source naming no framework gets the fallback family, flagged, whatever its year.
    fw, flags = pick_framework({"source": "Meta, The Llama 3 Herd of Models (2024)"})
    assert fw.name == "megatron-core" and flags
    assert pick_framework({"source": "microsoft/Megatron-DeepSpeed examples"})[0].name == \
        "megatron-deepspeed"
    assert pick_framework({"source": "Korthikanti et al. 2022"})[0].name == "megatron-lm"


def test_same_run_on_h100_is_faster_than_on_a100(tmp_path):
    # The same MPT-7b step on H100 (989 TFLOP/s bf16, 3.35 TB/s) and on A100 (312, 2.04):
    # compute-bound, so between 2x and the 3.2x peak ratio faster.
    path = _write(tmp_path, [_row(id="a", gpu="A100 80GB"), _row(id="h", gpu="H100 80GB")])
    rows = {r["id"]: r for r in validate_runs(path)["rows"]}
    ratio = rows["a"]["predicted_step_time_s"] / rows["h"]["predicted_step_time_s"]
    assert 2.0 < ratio < 989 / 312


def test_llama_rows_get_swiglu_rmsnorm_and_llama_ffn(tmp_path):
    path = _write(tmp_path, [_row(id="l", model="Llama-2 7B", source="x 2023",
                                  gpu="A100 80GB", vocab="")])
    case = read_runs(path)[0]
    assert case.model.activation == "swiglu" and case.model.norm == "rmsnorm"
    # Llama 2 7B's published ffn: 11008 = 256 * ceil(8 * 4096 / 3 / 256).
    assert case.model.ffn_hidden == 11008 and case.model.vocab_size == 32000
    assert any("swiglu" in f for f in case.flags)


def test_bad_rows_are_skipped_with_their_reason(tmp_path):
    path = _write(tmp_path, [_row(id="ok", gpu="A100 80GB"),
                             _row(id="v100", gpu="V100 32GB"),
                             _row(id="blank", gpu="A100 80GB", hidden="")])
    result = validate_runs(path)
    assert [r["id"] for r in result["rows"]] == ["ok"]
    reasons = {s["id"]: s["reason"] for s in result["skipped"]}
    assert set(reasons) == {"v100", "blank"} and "V100" in reasons["v100"]
    with pytest.raises(PlanError, match="v100"):
        read_runs(path)


def test_degrees_fill_in_and_cp_is_read(tmp_path):
    # 64 GPUs, tp = 8, cp = 2, pp and dp empty: pp = 1 (flagged), dp = 64 / (8*2*1) = 4.
    path = _write(tmp_path, [_row(id="c", gpu="H100 SXM", num_gpus=64, tp=8, cp=2, pp="",
                                  dp="", seq_len=8192, global_batch=16, micro_batch=1,
                                  zero_stage="ZeRO-1")])
    case = read_runs(path)[0]
    assert (case.plan.tp, case.plan.cp, case.plan.pp, case.plan.dp) == (8, 2, 1, 4)
    assert case.plan.zero_stage == 1 and case.plan.world_size == 64
    assert "pp=1 (default)" in case.flags and "dp=4 (num_gpus / (tp*cp*pp))" in case.flags


def test_error_by_groups_bias_mape_and_spread(tmp_path):
    from simulator.validation.validate import error_by
    path = _write(tmp_path, [_row(id="a", gpu="A100 80GB", micro_batch=4),
                             _row(id="b", gpu="A100 80GB", micro_batch=4),
                             _row(id="c", gpu="A100 80GB", micro_batch=2)])
    # Errors chosen by hand: micro-batch 4 has +10% and +30%, micro-batch 2 has -20%.
    result = {"rows": [{"id": i, "num_gpus": 8, "rel_error": e}
                       for i, e in (("a", 0.1), ("b", 0.3), ("c", -0.2))]}
    table = error_by(path, ("micro_batch",), result)
    assert table.loc[4, "rows"] == 2 and table.loc[4, "bias"] == pytest.approx(0.2)
    assert table.loc[4, "mape"] == pytest.approx(0.2)
    assert table.loc[4, "spread"] == pytest.approx(0.1)
    assert table.loc[2, "bias"] == pytest.approx(-0.2)
    # Remove each group's bias: |0.1-0.2|, |0.3-0.2|, |-0.2+0.2| -> mean 0.2/3.
    assert table.attrs["mape_if_unbiased"] == pytest.approx(0.2 / 3)
    with pytest.raises(PlanError, match="group by any of"):
        error_by(path, ("colour",), result)


def test_llama3_rows_get_llama3_defaults(tmp_path):
    # Llama 3 8B (Dubey et al. 2024, Table 3): ffn 14,336 = 3.5 * 4096, 8 KV heads, 128,256
    # tokens, the values of the llama3-8b preset.
    from planner.presets import load_model
    path = _write(tmp_path, [_row(id="l3", model="Llama 3 8B", source="x 2024", gpu="H100",
                                  vocab="", seq_len=8192, global_batch=32)])
    model = read_runs(path)[0].model
    preset = load_model("llama3-8b")
    assert (model.ffn_hidden, model.num_kv_heads, model.vocab_size) == \
        (preset.ffn_hidden, preset.num_kv_heads, preset.vocab_size)


def test_context_parallel_rows_get_their_own_table(tmp_path, capsys):
    # a cp = 2 row and a cp = 1 row: `validate --context-parallel` keeps only the first, and
    # its MAPE is that row's |rel_error| (the definition of the mean over one row)
    import json

    from apps.cli import main
    path = _write(tmp_path, [_row(id="c", gpu="H100 SXM", num_gpus=16, tp=1, cp=2, dp=8,
                                  seq_len=8192, global_batch=16, micro_batch=1),
                             _row(id="d", gpu="H100 SXM")])
    assert main(["validate", "--runs", str(path), "--context-parallel", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in result["rows"]] == ["c"]
    assert (result["rows"][0]["cp"], result["rows"][0]["seq_len"]) == (2, 8192)
    assert result["mape"] == pytest.approx(abs(result["rows"][0]["rel_error"]))
    assert [r["id"] for r in validate_runs(path)["rows"]] == ["c", "d"]


def test_a_blank_required_cell_is_named_as_the_skip_reason(tmp_path):
    path = _write(tmp_path, [_row(id="ok", gpu="A100 80GB"),
                             _row(id="blank", gpu="A100 80GB", ref_step_time_s="")])
    reasons = {s["id"]: s["reason"] for s in validate_runs(path)["skipped"]}
    assert reasons == {"blank": "ref_step_time_s is empty; fill it in (the row cannot be "
                                "simulated without it)"}


@pytest.mark.parametrize("cells, message", [
    ({"ref_step_time_s": "0"}, "runs.csv bad: ref_step_time_s='0' is not a step time > 0; "
                               "give the measured seconds per step"),
    ({"ref_step_time_s": "-2.9"}, "runs.csv bad: ref_step_time_s='-2.9' is not a step time"),
    ({"layers": "forty"}, "runs.csv bad: layers='forty' is not a whole number > 0; give the "
                          "count (e.g. 40)"),
    ({"tp": "2.5"}, "runs.csv bad: tp='2.5' is not a whole number > 0"),
    # 8 GPUs stated, tp*cp*pp*dp = 1*1*1*4 = 4: the row would silently run on 4
    ({"dp": "4"}, "runs.csv bad: num_gpus=8 but tp*cp*pp*dp = 1*1*1*4 = 4 (ep adds no "
                  "ranks); give num_gpus 4, or dp=8 for 8 GPUs"),
    # a misspelt word was read as its prefix (fulll -> full) or as the default (xyz -> none)
    ({"recompute": "fulll"}, "runs.csv bad: recompute='fulll' is not a value it takes; write a "
                             "cell starting with full, selective or none"),
    ({"recompute": "xyz"}, "runs.csv bad: recompute='xyz' is not a value it takes"),
    ({"sequence_parallel": "maybe"}, "runs.csv bad: sequence_parallel='maybe' is not a value "
                                     "it takes; write yes or no"),
    ({"ref_step_time_kind": "guessed"}, "runs.csv bad: ref_step_time_kind='guessed' is not a "
                                        "value it takes; write reported (printed by the source), "
                                        "derived (from its throughput) or measured"),
])
def test_a_malformed_cell_refuses_the_table_before_any_row_runs(tmp_path, cells, message):
    # the good row first: the whole table is refused, not just the bad row skipped
    path = _write(tmp_path, [_row(id="ok", gpu="A100 80GB"),
                             _row(id="bad", gpu="A100 80GB", **cells)])
    with pytest.raises(PlanError) as info:
        validate_runs(path)
    assert str(info.value).startswith(message)


def test_expert_parallelism_adds_no_ranks_to_num_gpus(tmp_path):
    # Megatron-Core folds ep into the data-parallel ranks: 8 GPUs = tp1*pp1*dp8 with ep 8
    path = _write(tmp_path, [_row(id="moe", gpu="H100 SXM", model="Mixtral 8x7B",
                                  layers=32, hidden=4096, heads=32, kv_heads=8,
                                  ffn_hidden=14336, vocab=32000, seq_len=4096,
                                  notes="num_experts=8;top_k=2;ep=8")])
    plan = read_runs(path)[0].plan
    assert (plan.ep, plan.world_size) == (8, 8)


def test_a_table_whose_every_row_is_skipped_is_an_error(tmp_path):
    path = _write(tmp_path, [_row(id="x003", gpu="TPU-v5")])
    with pytest.raises(PlanError, match=r"^runs.csv: no row could be simulated; x003: "
                                        r"gpu='TPU-v5' has no device profile"):
        validate_runs(path)


@pytest.mark.parametrize("header", ["a,b,c\n", "a,b,c\n1,2,3\n"])
def test_the_header_message_shows_the_header_read(tmp_path, header):
    path = tmp_path / "hdr.csv"
    path.write_text(header)
    with pytest.raises(PlanError, match=r"^hdr.csv: header a,b,c is neither the published-runs"):
        read_runs(path)


def test_a_fallback_framework_is_one_settings_line(tmp_path):
    path = _write(tmp_path, [_row(id="x", gpu="H100 SXM", source="my cluster")])
    flags = [f for f in read_runs(path)[0].flags if f.startswith("framework=")]
    assert flags == ["framework=megatron-core (default: the source names no known framework;"
                     " presets/frameworks/megatron-core.yaml)"]


def test_every_shipped_table_cell_is_still_read():
    # the values the shipped tables hold in the checked columns (../shared/data) pass the check
    from simulator.validation.validate import malformed_cell
    data = Path(__file__).resolve().parents[2].parent / "shared" / "data"   # as test_fit
    tables = [data / "published_runs.csv", data / "published_benchmarks.csv"]
    if not all(t.is_file() for t in tables):
        pytest.skip("the shared data folder is not beside this checkout")
    for table in tables:
        with open(table, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                assert malformed_cell(row) is None, (table.name, row["id"])


@pytest.mark.parametrize("cell, recompute", [
    # the forms the shipped tables write: the first word decides, a note may follow
    ("full, block, 5 layers (preset recompute_num_layers)", "full"),
    ("full AC (activation_checkpointing: True)", "full"),
    ("selective ['mla_up_proj', 'mlp']", "selective"),
    ("none set in perf recipe (static read)", "none"),
])
def test_recompute_cells_read_by_their_first_word(tmp_path, cell, recompute):
    (case,) = read_runs(_write(tmp_path, [_row(id="r", gpu="A100 80GB", recompute=cell)]))
    assert case.plan.recompute == recompute

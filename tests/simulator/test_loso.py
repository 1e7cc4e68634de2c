"""Leave-one-source-out: per-source figures in-fit and held out, and the CLI table."""

import dataclasses

import pytest

from simulator.validation.fit import fitted_devices, leave_one_source_out
from simulator.validation.validate import predict, read_runs, source_key
from tests.simulator.test_validate_reader import _row, _write


def _cases(tmp_path):
    rows = [_row(id=f"a{i}", gpu="A100 80GB", micro_batch=m) for i, m in enumerate((1, 2))]
    rows += [_row(id=f"b{i}", gpu="A100 80GB", micro_batch=m, source="Smith et al. 2023",
                  global_batch=64) for i, m in enumerate((4, 2))]
    return read_runs(_write(tmp_path, rows))


def _scaled(cases, factor):
    # Reference step time set to the model's own prediction times `factor`.
    return [dataclasses.replace(c, reference_step_time_s=predict(c, fast=True) * factor)
            for c in cases]


def test_source_key_groups_rows_by_paper_or_repository(tmp_path):
    cases = _cases(tmp_path)
    assert [c.source for c in cases] == ["mosaicml/llm-foundry"] * 2 + ["Smith et al. 2023"] * 2
    assert source_key("NVIDIA/Megatron-LM README (2020-09, commit 5281919420)") == \
        "NVIDIA/Megatron-LM"


def test_no_refit_gives_the_preset_errors_by_hand(tmp_path):
    # References 1.25x the preset's prediction: every rel_error = 1/1.25 - 1 = -0.2 exactly,
    # in-fit and held out alike when nothing is refitted (iters=0).
    cases = _scaled(_cases(tmp_path), 1.25)
    out = leave_one_source_out([cases], "a100-sxm-80gb", iters=0)
    assert [(e["source"], e["rows"]) for e in out] == [("Smith et al. 2023", 2),
                                                      ("mosaicml/llm-foundry", 2)]
    for e in out:
        for which in ("in_fit", "held_out"):
            assert e[which]["mape"] == pytest.approx(0.2)
            assert e[which]["mean_error"] == pytest.approx(-0.2)


def test_held_out_source_is_predicted_with_the_others_parameters(tmp_path):
    # Source A measured at the preset's prediction, source B at twice it. Fitted on B alone,
    # the model slows down, so A held out comes out too slow (positive error) and clearly
    # worse than A in the joint fit, where the error is split between the two sources.
    cases = _cases(tmp_path)
    a = _scaled([c for c in cases if c.source != "Smith et al. 2023"], 1.0)
    b = _scaled([c for c in cases if c.source == "Smith et al. 2023"], 2.0)
    out = {e["source"]: e for e in leave_one_source_out([a + b], "a100-sxm-80gb", iters=25)}
    held, joint = out["mosaicml/llm-foundry"]["held_out"], out["mosaicml/llm-foundry"]["in_fit"]
    assert held["mean_error"] > 0.3 and held["mean_error"] > joint["mean_error"] + 0.2


def test_a100_40gb_counts_under_the_80gb_entry(tmp_path):
    rows = [_row(id="x", gpu="A100 40GB"), _row(id="y", gpu="A100 80GB")]
    assert fitted_devices(read_runs(_write(tmp_path, rows))) == ["a100-sxm-80gb"]


def test_cli_loso_table_and_bad_input(tmp_path, capsys):
    from apps.cli import main
    path = _write(tmp_path, [_row(id="a", gpu="A100 80GB"),
                             _row(id="b", gpu="A100 80GB", source="Smith et al. 2023")])
    assert main(["validate", "--runs", str(path), "--loso", "--loso-iters", "0"]) == 0
    out = capsys.readouterr().out
    assert "leave-one-source-out" in out and "Smith et al. 2023" in out
    assert main(["validate", "--runs", str(path), "--loso", "--loso-iters", "-1"]) == 2
    assert main(["validate", "--runs", str(path), "--loso", "--with", "nope.csv"]) == 2

"""One reader for the files a user names (planner.userfile): every command that reads a model,
plan or cluster YAML file or a runs CSV refuses a bad one with exit 2 and one line naming the
file and what is wrong, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.cli import main

ROOT = Path(__file__).resolve().parents[2]

# a model file as a user saves it from a Latin-1 editor: 'é' is the single byte 0xe9
LATIN1_MODEL = "name: café\nnum_layers: 2\nhidden: 64\nnum_heads: 4\n".encode("latin-1")
DENSE_MODEL = ("name: dense20b\nnum_layers: 44\nhidden: 6144\nnum_heads: 48\n"
               "ffn_hidden: 24576\nvocab_size: 50304\nseq_len: 2048\n")


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "{f}", "--cluster", "dgx-h100"],
    ["sweep", "--model", "{f}", "--tokens", "1T", "--gpus", "64"],
    ["topo", "{f}"],
    ["simulate", "{f}"],
    ["validate", "--runs", "{f}"],
])
def test_a_file_that_is_not_utf8_is_named(capsys, tmp_path, argv):
    path = tmp_path / "café.yaml"
    path.write_bytes(LATIN1_MODEL)
    assert main([a.replace("{f}", str(path)) for a in argv]) == 2
    # byte 9 of the file: 'name: caf' is 9 ASCII bytes, then 0xe9
    assert f"{str(path)!r} is not UTF-8 text (byte 9 is 0xe9); save it as UTF-8" in _err(capsys)


def test_a_yaml_syntax_error_names_the_file_and_line(capsys, tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("num_layers: 2\nhidden: [64\n")   # the list never closes: found at line 3
    assert main(["plan", "--model", str(path), "--cluster", "dgx-h100"]) == 2
    err = _err(capsys)
    assert f"model file {str(path)!r} is not valid YAML at line 3, column 1" in err
    assert "<unicode string>" not in err


@pytest.mark.parametrize("argv, kind", [
    (["topo", "{f}"], "cluster"),
    (["plan", "--model", "tiny-gpt", "--cluster", "{f}"], "cluster"),
    (["simulate", "{f}"], "plan"),
])
def test_a_model_file_given_as_another_kind_is_named(capsys, tmp_path, argv, kind):
    path = tmp_path / "dense20b.yaml"
    path.write_text(DENSE_MODEL)
    assert main([a.replace("{f}", str(path)) for a in argv]) == 2
    assert f"{kind} file {str(path)!r} looks like a model file, not a {kind} file" \
        in _err(capsys)


@pytest.mark.parametrize("argv, what", [
    (["plan", "--model", "{f}", "--cluster", "dgx-h100"], "model file"),
    (["simulate", "{f}"], "plan file"),
    (["topo", "{f}"], "cluster file"),
])
def test_a_folder_is_called_a_folder(capsys, tmp_path, argv, what):
    assert main([a.replace("{f}", str(tmp_path)) for a in argv]) == 2
    assert f"{what} {str(tmp_path)!r} is a folder; give a file" in _err(capsys)


def test_a_plan_file_as_the_model_gives_its_model(tmp_path):
    from planner.presets import load_model
    plan = tmp_path / "p.yaml"
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--top", "1",
                 "--out", str(plan)]) == 0
    assert load_model(str(plan)) == load_model("tiny-gpt")


def test_a_key_given_twice_is_refused_not_overwritten(capsys, tmp_path):
    # PyYAML keeps the last of two equal keys; the first num_layers (48) would be lost
    path = tmp_path / "m.yaml"
    path.write_text(DENSE_MODEL.replace("num_layers: 44\n", "num_layers: 48\n") + "num_layers: 12\n")
    assert main(["plan", "--model", str(path), "--cluster", "dgx-h100"]) == 2
    assert (f"model file {str(path)!r} has the key 'num_layers' twice (lines 2 and 8); keep one"
            in _err(capsys))


def test_a_model_name_that_yaml_reads_as_a_number_is_named(capsys, tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(DENSE_MODEL.replace("name: dense20b", "name: 123")
                    + "num_kv_heads: 8\nactivation: swiglu\n")
    assert main(["plan", "--model", str(path), "--cluster", "dgx-h100"]) == 2
    assert 'name=123 must be a non-empty string; quote it in YAML (e.g. name: "123")' in _err(capsys)


@pytest.mark.skipif(not (ROOT / "../shared/data/published_runs.csv").exists(),
                    reason="../shared/data/published_runs.csv is absent")
def test_a_runs_csv_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    # Excel writes UTF-8 CSVs with a leading BOM (EF BB BF): the header's first name is 'id'
    from simulator.validation.validate import read_runs
    src = (ROOT / "../shared/data/published_runs.csv").resolve()
    lines = src.read_text(encoding="utf-8").splitlines()[:2]
    plain, bom = tmp_path / "plain.csv", tmp_path / "bom.csv"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    bom.write_text("\n".join(lines) + "\n", encoding="utf-8-sig")
    assert bom.read_bytes()[:3] == b"\xef\xbb\xbf"
    assert read_runs(bom) == read_runs(plain)


@pytest.mark.parametrize("argv", [["topo", "dgx-h100", "--png", "{f}"],
                                  ["validate", "--runs", "{runs}", "--plot", "{f}"]])
def test_a_figure_name_without_an_image_suffix_is_refused_first(capsys, tmp_path, argv):
    runs = (ROOT / "../shared/data/published_runs.csv").resolve()
    out = tmp_path / "topo.txt"
    assert main([a.replace("{f}", str(out)).replace("{runs}", str(runs)) for a in argv]) == 2
    assert f"{str(out)!r}: a figure is written as .png, .pdf, .svg, .jpg, .jpeg" in _err(capsys)
    assert not out.exists()

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

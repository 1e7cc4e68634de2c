"""Input that used to be read without a word (an unknown plan-file key, a flag given twice, a
flag with no effect in its mode, an absurd cluster number, a malformed runs table) is refused
before any work: exit 2 and one ``error:`` line naming the field or flag, the value and a
fix."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from apps.cli import main

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO.parent / "shared" / "data" / "published_runs.csv"
#: These cases edit a copy of the shipped runs table; skipped, saying so, where it is absent.
needs_runs = pytest.mark.skipif(not RUNS.exists(), reason=f"{RUNS} is absent")


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "tiny.yaml"
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--top-k", "2",
                 "--out", str(path)]) == 0
    return path


def test_an_unknown_top_level_plan_key_is_named_with_the_known_ones(plan_file, tmp_path,
                                                                      capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(plan_file.read_text() + "predicton: {}\n")
    capsys.readouterr()
    assert main(["simulate", str(bad)]) == 2
    err = _err(capsys)
    assert "unknown top-level field(s) ['predicton'] (did you mean 'prediction'?)" in err
    assert "'schema_version'" in err


@pytest.mark.parametrize("fields, message", [
    # a latency below zero: the YAML float -1.0e-6 (with a dot, so PyYAML reads a number)
    ("nic: {per_node: 8}\nfabric: {switch_radix: 64, switch_latency_s: -1.0e-6}",
     "fabric.switch_latency_s=-1e-06 must be a number >= 0 for cluster 'c'"),
    # 1e300 Gb/s: far beyond the 16000 Gb/s bound (ten times a 1.6 Tb/s NIC)
    ("nic: {per_node: 8, speed_Gbps: 1.0e+300}\nfabric: {switch_radix: 64}",
     "nic.speed_Gbps=1e+300 for cluster 'c' is beyond any real hardware (at most 16000 Gb/s)"),
    ("nic: {per_node: 8, speed_Gbps: .inf}\nfabric: {switch_radix: 64}",
     "nic.speed_Gbps=inf must be a finite number > 0"),
    ("nic: {per_node: 8, speed_Gbps: 0}\nfabric: {switch_radix: 64}",
     "nic.speed_Gbps=0 must be a number > 0"),
])
def test_cluster_numbers_are_range_checked(tmp_path, capsys, fields, message):
    path = tmp_path / "c.yaml"
    path.write_text(f"kind: gpu\nnode_type: dgx-b200\nnodes: 2\n{fields}\n")
    assert main(["topo", str(path)]) == 2
    assert message in _err(capsys)


def _table(tmp_path: Path, edit) -> Path:
    """The first two rows of the shipped runs table, with ``edit(rows)`` applied."""
    with RUNS.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames), [next(reader), next(reader)]
    extra = edit(rows)
    path = tmp_path / "runs.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for i, row in enumerate(rows):
            writer.writerow([row[h] for h in header] + (extra if i == 1 else []))
    return path


def _vpp_without_pp(rows):
    rows[1].update(id="zz1", pp="1", vpp="2")


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows[1].update(id=rows[0]["id"]) or [],
     "runs.csv line 3: id='r000' again (first on line 2); give each row its own id"),
    (lambda rows: rows[1].update(id="") or [], "runs.csv line 3: the id cell is empty"),
    (lambda rows: rows[1].update(id="zz1") or ["extra"],
     "runs.csv line 3: row zz1 has 1 cell(s) more than the header's columns ('extra')"),
    (lambda rows: _vpp_without_pp(rows) or [], "runs.csv line 3: row zz1: vpp=2 with pp=1"),
])
@needs_runs
def test_a_malformed_runs_table_names_the_line_and_the_column(tmp_path, capsys, edit, message):
    assert main(["validate", "--runs", str(_table(tmp_path, edit))]) == 2
    assert message in _err(capsys)


@needs_runs
def test_loso_names_the_row_it_cannot_simulate(tmp_path, capsys):
    # tp=5 does not divide the 32 heads of r001 (Narayanan et al. 2021, Table 1): the row
    # builds, but its plan is illegal; num_gpus = tp*pp*dp = 5*1*dp keeps the row consistent
    def edit(rows):
        rows[1].update(id="zz5", tp="5", num_gpus=str(5 * int(rows[1]["dp"])))
        return []
    path = _table(tmp_path, edit)
    assert main(["validate", "--runs", str(path), "--loso", "--loso-iters", "0"]) == 2
    assert "error: row zz5: tp=5 does not divide num_heads=32" in _err(capsys)


@pytest.mark.parametrize("flags, message", [
    (["--top", "0"], "--top=0 must be >= 1"),
    (["--dense"], "--dense acts only with --loso-carried or --logo"),
    (["--loso", "--logo"], "--loso and --logo: give one of --loso, --loso-carried, --logo"),
    (["--with", str(RUNS)], "more tables are read only by --loso, --loso-carried, --logo"),
    (["--loso-iters", "5"], "--loso-iters=5 acts only with --loso, --loso-carried, --logo"),
])
def test_validate_flags_without_effect_are_refused(capsys, flags, message):
    assert main(["validate", "--runs", str(RUNS), *flags]) == 2
    err = _err(capsys)
    assert err.startswith("error: ") and message in err


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--top", "3", "--top", "4"],
     "error: --top given twice (--top 3 and --top 4); give it once"),
    (["run", "x.yaml", "--steps=2", "--steps", "3"],
     "error: --steps given twice (--steps=2 and --steps 3); give it once"),
    (["demo", "--steps", "0"], "error: --steps=0 must be >= 1"),
    (["topo", "dgx-h100", "--draw-nodes", "0"], "error: --draw-nodes=0 must be >= 1"),
    # 4M is 4,000,000 tokens (SI, as --tokens reads it): not a multiple of 8192
    (["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch-tokens", "4M"],
     "error: --global-batch-tokens=4M (4000000 tokens) must be a multiple of seq_len=8192; "
     "e.g. 3997696 (488 sequences)"),
    (["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "1e30"],
     "error: --global-batch='1e30' is more than 1.22e+05 sequences of 8192 tokens per step"),
    (["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "2.5"],
     "error: --global-batch='2.5' is not a whole number"),
    # the default llama3-8b batch: 4M tokens / 8192 = 512 sequences of 8192 tokens
    (["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--tokens", "1"],
     "error: --tokens=1 is less than one global batch of 4,194,304 tokens (512 x seq_len "
     "8192); give at least --tokens 4194304"),
])
def test_flags_are_checked_before_any_work(capsys, argv, message):
    assert main(argv) == 2
    assert message in _err(capsys)


def test_argparse_errors_are_one_error_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--top", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: meshplan plan: argument --top: invalid int value: 'x'; see "
                          "`meshplan plan --help`") and "usage:" not in err


def test_repeatable_flags_may_repeat(capsys):
    # --fix collects one field per use; only a flag that keeps one value is refused twice
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--top-k", "1",
                 "--fix", "tp=1", "--fix", "pp=1", "--json"]) == 0


def test_a_float_layer_count_names_the_field(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nnum_layers: 32.0\nhidden: 256\nnum_heads: 4\nnum_kv_heads: 4\n"
                    "ffn_hidden: 1024\nactivation: gelu\nseq_len: 128\nvocab_size: 1000\n")
    assert main(["plan", "--model", str(path), "--cluster", "localhost-cpu"]) == 2
    assert ("error: model 'm': num_layers=32.0 must be a positive integer; write 32 (no "
            "decimal point)") in _err(capsys)


def test_send_recv_names_the_pair_that_ranks_chooses(capsys):
    assert main(["collective", "send_recv", "--cluster", "dgx-h100", "--nodes", "2",
                 "--ranks", "9", "--sizes", "1M"]) == 0
    assert "send_recv from device 0 to device 8 of dgx-h100" in " ".join(
        capsys.readouterr().out.split())


def test_run_data_folder_and_missing_resume_leave_nothing_behind(plan_file, tmp_path):
    # subprocess: run imports torch; the cwd is empty so that anything created shows
    def run(*flags):
        return subprocess.run([sys.executable, "-m", "apps.cli", "run", str(plan_file),
                               *flags], cwd=tmp_path, capture_output=True, text=True,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                              timeout=120)
    (tmp_path / "corpus").mkdir()
    proc = run("--data", "corpus")
    assert proc.returncode == 2 and "error: --data 'corpus' is a folder" in proc.stderr
    proc = run("--resume", str(tmp_path / "nothere"), "--steps", "2")
    assert proc.returncode == 2 and "--resume folder" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]

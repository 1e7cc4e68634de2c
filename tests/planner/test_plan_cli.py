"""`meshplan plan` search options: fixed fields, device bounds, CSV, impossible requests."""

import csv
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _meshplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def test_fixed_fields_and_csv(tmp_path):
    proc = _meshplan("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                     "--global-batch-tokens", str(64 * 8192), "--max-devices", "8",
                     "--fix", "tp=2,4", "--fix", "recompute=full", "--top-k", "3",
                     "--json", "--csv", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert "infeasible" not in data
    assert {p["tp"] for p in data["plans"]} == {2, 4}
    assert all(p["tp"] * p["pp"] * p["dp"] <= 8 and p["global_batch"] == 64
               for p in data["plans"])
    with open(tmp_path / "ranked.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["id"] for r in rows] == [p["id"] for p in data["plans"]]
    assert set(rows[0]) >= {"id", "step_time_s", "tier", "zero_stage", "placement"}
    with open(tmp_path / "rejected.csv") as f:
        assert all(r["reason"] for r in csv.DictReader(f))


def test_impossible_request_answers_with_the_closest_plans():
    proc = _meshplan("plan", "--model", "llama3-405b", "--cluster", "dgx-h100",
                     "--global-batch", "16", "--json")
    assert proc.returncode == 2  # the request cannot be satisfied: bad input, as `--out` gives
    data = json.loads(proc.stdout)
    assert data["plans"] == []
    inf = data["infeasible"]
    assert inf["min_devices"] == 128
    assert len(inf["closest"]) == 5
    assert inf["closest"][0]["peak_memory_bytes"] > inf["closest"][0]["usable_bytes"]
    human = _meshplan("plan", "--model", "llama3-405b", "--cluster", "dgx-h100",
                      "--global-batch", "16")
    assert "no plan fits" in human.stdout and "blocked by devices: 8 is too few" in human.stdout


def test_bad_fix_exits_2():
    proc = _meshplan("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--fix", "tp")
    assert proc.returncode == 2
    assert "--fix 'tp' must look like FIELD=VALUE" in proc.stderr


def test_the_plan_file_is_written_before_a_reader_that_stops_early(tmp_path):
    # `meshplan plan ... --out x.yaml | head -1`: the reader leaves after the first line
    out = tmp_path / "x.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "plan", "--model", "tiny-gpt",
                             "--cluster", "localhost-cpu", "--ranks", "2", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert b"Traceback" not in err
    assert "plan:" in out.read_text()


def test_a_long_search_reports_progress_on_stderr(monkeypatch, capsys):
    # every 10 candidates here (2,000 by default); off a terminal a plain line each time the
    # quiet period is over (set to 0 s): the counts only grow
    import planner.search
    from apps.cli import main
    from apps.format import SearchProgress
    monkeypatch.setattr(planner.search, "PROGRESS_EVERY", 10)
    monkeypatch.setattr(SearchProgress, "QUIET_S", 0.0)
    monkeypatch.setattr(SearchProgress, "LINE_EVERY_S", 0.0)
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks", "2",
                 "--top", "1"]) == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("searching (")]
    assert lines and "searching (" not in captured.out
    walked = [int(ln.split(": ")[2].split()[0].replace(",", "")) for ln in lines
              if "candidates walked" in ln]
    assert walked == sorted(walked) and walked[0] == 10

"""`meshplan app` and the resolved configuration `meshplan run` echoes and saves."""

import json

import pytest

import apps.cmd_app as cmd_app
from apps.cli import main
from apps.run_config import RUN_CONFIG_NAME, resolved_run_config


@pytest.fixture
def plan_path(tiny_plan_file):
    return tiny_plan_file(tp=1, pp=1, dp=2)


def test_app_serves_the_explorer_with_streamlit(monkeypatch):
    seen = {}

    def execv(path, cmd):
        seen["cmd"] = cmd
        assert path == cmd[0]

    monkeypatch.setattr(cmd_app.os, "execv", execv)
    assert main(["app", "--port", "8612"]) == 0
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "streamlit", "run"]
    assert cmd[4].endswith("apps/streamlit_app.py")
    assert cmd[cmd.index("--server.port") + 1] == "8612"
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"


def test_resolved_run_config_fills_the_defaults(plan_path):
    config = resolved_run_config(plan_path, steps=3, out_dir=None, data=None)
    assert config["out_dir"] == "runs/tp1-pp1-dp2-mb1-gb8"
    assert config["world_size"] == 2 and config["steps"] == 3
    assert config["plan"]["dp"] == 2 and config["model"]["name"] == "tiny-gpt"
    assert "--nproc-per-node 2" in config["command"]


def test_run_echoes_and_saves_its_configuration(plan_path, tmp_path, monkeypatch, capsys):
    import runtime.launch
    summary = {"plan_id": "tp1-pp1-dp2-mb1-gb8", "steps": 2, "final_loss": 3.5,
               "step_time_s": 0.25, "tokens_per_s": 4096.0}
    monkeypatch.setattr(runtime.launch, "run_plan", lambda *a, **k: summary)
    out = tmp_path / "run"
    assert main(["run", str(plan_path), "--steps", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "run tp1-pp1-dp2-mb1-gb8 (2 ranks, 2 steps)" in printed
    saved = json.loads((out / RUN_CONFIG_NAME).read_text())
    assert saved["steps"] == 2 and saved["out_dir"] == str(out)
    assert saved["plan"]["global_batch"] == 8


def test_run_of_a_missing_plan_exits_2(tmp_path):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2


def test_module_doctests_pass():
    import doctest
    assert doctest.testmod(cmd_app).failed == 0


def test_run_json_keeps_stdout_one_object(plan_path, tmp_path, monkeypatch, capsys):
    import sys

    import runtime.launch

    def fake_run_plan(*args, **kwargs):
        sys.stdout.write("step: 1  loss: 5.6  step_time_s: 0.4\n")  # the run's own step lines
        return {"plan_id": "tp1-pp1-dp2-mb1-gb8", "steps": 1, "step_time_s": 0.4}

    monkeypatch.setattr(runtime.launch, "run_plan", fake_run_plan)
    assert main(["run", str(plan_path), "--steps", "1", "--out", str(tmp_path / "r"),
                 "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step_time_s"] == 0.4
    assert "step: 1" in captured.err and "run tp1-pp1-dp2-mb1-gb8" in captured.err

"""`--cpu-profile FILE|none`: one option on every command that predicts on a localhost
cluster, the profile it chose printed with the prediction, and `simulate` overriding the
profile its plan file records."""

import pytest
import yaml

from apps import app_views as views
from apps.cli import main
from apps.compare import compare
from planner.spec import PlanError

COMMANDS = [["plan"], ["simulate", "p.yaml"], ["compare"], ["topo", "localhost-cpu"],
            ["collective", "all_reduce"]]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")    # rich would wrap long paths mid-word


@pytest.fixture
def profile(tmp_path):
    """A profile file as `meshplan calibrate` writes one, with no calibrated layer shapes."""
    fit = {"latency_s": 2e-4, "bandwidth_Bps": 5e8}
    path = tmp_path / "localhost-cpu-20260101T000000.yaml"
    path.write_text(yaml.safe_dump({
        "threads_per_rank": 1, "machine": {"cores": 2},
        "device": {"test-core": {"peak_flops": {"fp32": 2.0e10}, "memory_bytes": 8.0e9,
                                 "memory_bandwidth_Bps": 5.0e9, "matmul_efficiency": 0.5,
                                 "memory_efficiency": 1.0}},
        "cpu_costs": {"compute": {}, "collectives": {2: {"all_reduce": {"n2": fit},
                                                         "p2p": fit}}}}))
    return path


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_every_localhost_command_takes_the_option(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    assert "--cpu-profile FILE|none" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["collective", "all_reduce", "--cluster", "localhost-cpu",
                                      "--ranks", "2"], ["topo", "localhost-cpu", "--ranks", "2"]],
                         ids=lambda c: c[0])
def test_topo_and_collective_print_the_profile_they_use(command, profile, capsys):
    assert main([*command, "--cpu-profile", str(profile)]) == 0
    assert f"assumes cpu profile {profile}" in capsys.readouterr().out
    assert main([*command, "--cpu-profile", "none"]) == 0
    assert "assumes the generic CPU preset" in capsys.readouterr().out


def test_simulate_overrides_the_profile_the_plan_file_records(tmp_path, profile, capsys):
    plan = tmp_path / "tiny.yaml"
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "localhost-cpu", "--ranks", "1",
                 "--cpu-profile", str(profile), "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan)]) == 0
    assert f"assumes cpu profile {profile}" in capsys.readouterr().out
    assert main(["simulate", str(plan), "--cpu-profile", "none"]) == 0
    assert "assumes the generic CPU preset" in capsys.readouterr().out


def test_simulate_refuses_a_profile_for_a_gpu_plan(tmp_path, capsys):
    plan = tmp_path / "gpu.yaml"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--top-k", "1",
                 "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan), "--cpu-profile", "none"]) == 2
    assert "--cpu-profile applies only to localhost clusters" in capsys.readouterr().err


def test_compare_stops_at_a_missing_profile_before_running(tmp_path, capsys):
    assert main(["compare", "--cpu-profile", str(tmp_path / "nope.yaml"),
                 "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(PlanError, match="does not exist"):
        compare(out_dir=tmp_path, cpu_profile=str(tmp_path / "nope.yaml"))
    assert not list(tmp_path.glob("*/plan.yaml"))


def test_the_explorer_localhost_cluster_takes_the_profile(profile):
    def cluster(value):
        return views.cluster_from_inputs("preset", preset="localhost-cpu", ranks=2,
                                         cpu_profile=value)
    assert cluster(str(profile)).cpu_profile.path == str(profile.resolve())
    assert cluster("none").cpu_profile is None
    assert cluster(None).cpu_profile is None       # the default folder holds no profile

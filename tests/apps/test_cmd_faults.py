"""Failure options of the CLI: `run` fault flags, `plan --objective goodput` (JSON, CSV, spares),
`simulate --straggler`."""

import pytest

from apps.cli import build_parser
from apps.cmd_faults import restart_line, run_fault_kwargs


def test_run_fault_flags_become_run_plan_keywords():
    args = build_parser().parse_args([
        "run", "plan.yaml", "--checkpoint-every", "3", "--keep", "3", "--max-restarts", "2",
        "--timeout-s", "10", "--inject", "kill:rank=1,step=7", "--inject", "nan:step=9",
        "--on-nan", "skip", "--resume", "runs/x/checkpoints",
        "--checkpoint-dir", "s3://bucket/run"])
    assert run_fault_kwargs(args) == {
        "checkpoint_every": 3, "keep": 3, "resume": "runs/x/checkpoints",
        "checkpoint_dir": "s3://bucket/run",
        "inject": ["kill:rank=1,step=7", "nan:step=9"], "collective_timeout_s": 10.0,
        "on_nan": "skip", "max_restarts": 2, "straggler_threshold": 0.7,
        "straggler_window": 5, "on_straggler": "warn", "spares": 0, "ranks_per_node": 1}


def test_plan_objective_flags_parse():
    args = build_parser().parse_args(["plan", "--model", "tiny-gpt", "--cluster", "dgx-h100",
                                      "--objective", "goodput", "--mtbf-hours", "20000"])
    assert (args.objective, args.mtbf_hours, args.node_mtbf_hours) == ("goodput", 20000.0, None)


def test_restart_line_names_the_losses():
    line = restart_line({"restarts": 1, "steps_lost": 1, "wall_time_lost_s": 7.4,
                         "checkpoints": 4, "goodput": 0.5})
    assert line == ("restarts: 1  steps_lost: 1  wall_time_lost_s: 7.4  checkpoints: 4  "
                    "goodput: 0.500")


def _plan_file(tmp_path):
    from planner.planfile import ClusterRef, PlanFile, write_plan_file
    from planner.presets import load_model
    from planner.spec import Plan
    plan = Plan(tp=1, pp=1, dp=2, micro_batch=1, global_batch=8)
    return write_plan_file(tmp_path / "plan.yaml", PlanFile(
        model=load_model("llama3-8b"), plan=plan, cluster=ClusterRef(name="dgx-h100", nodes=1),
        prediction={}))


def test_simulate_straggler_doubles_the_slow_replicas_compute(tmp_path, capsys):
    import json

    from apps.cli import main
    from planner.presets import load_model
    from planner.spec import Plan
    from simulator.network.cluster import load_cluster
    from simulator.step.costs import stage_costs
    path = _plan_file(tmp_path)
    assert main(["simulate", str(path), "--straggler", "rank=1,factor=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # dp=2, m=4 micro-batches per replica: the slow replica computes twice as long and the
    # gradient all-reduce waits for it (tests/simulator/test_stragglers.py works it out)
    c = stage_costs(load_model("llama3-8b"), Plan(tp=1, pp=1, dp=2, micro_batch=1,
                                                  global_batch=8),
                    load_cluster("dgx-h100", nodes=1))[0]
    want = (4 * (2 * (c.fwd_compute_s + c.bwd_compute_s) + c.fwd_comm_s + c.bwd_comm_s)
            + c.dp_comm_s + 2 * c.optimizer_s + c.dp_gather_s)
    assert out["step_time_s"] == pytest.approx(want, rel=1e-12)
    assert out["stragglers"] == {"1": 2.0}
    assert out["healthy_step_time_s"] < out["step_time_s"]
    assert main(["simulate", str(path), "--straggler", "rank=1,factor=2"]) == 0
    assert "rank 1 x2 (healthy step" in capsys.readouterr().out


@pytest.mark.parametrize("spec, message", [
    ("rank=2,factor=2", "straggler rank=2 does not exist: the plan has tp*pp*dp = 1*1*2 = 2 "
                        "ranks; use a rank in 0..1"),
    ("rank=1,factor=0.5", "factor='0.5' must be a number >= 1"),
    ("rank=one,factor=2", "rank='one' must be an integer >= 0"),
    ("rank=1", "missing factor; write --straggler rank=R,factor=F"),
    ("rank=1,speed=2", "field 'speed' is not rank or factor"),
])
def test_bad_straggler_exits_2_naming_the_field_and_the_fix(tmp_path, capsys, spec, message):
    from apps.cli import main
    assert main(["simulate", str(_plan_file(tmp_path)), f"--straggler={spec}"]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_plan_goodput_json_and_csv_carry_the_goodput_columns(tmp_path, capsys):
    import csv
    import json
    import math

    from apps.cli import main
    from planner.presets import load_model
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                 "--global-batch", "64", "--top-k", "3", "--objective", "goodput",
                 "--mtbf-hours", "1000", "--restart-s", "600", "--json", "--fix", "pp=1",
                 "--straggler-rate", "0", "--csv", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["goodput_assumptions"]["restart_s"] == 600.0
    row = data["plans"][0]
    # by hand: 16 devices of 1000 h MTBF fail every 1000/16 h; the checkpoint writes 14 bytes
    # per parameter (bf16 weights + Adam's 12, ZeRO §3.1; pp=1, untied) and takes the longer
    # of all of it over 2 TB/s and one writer's 1/writers share over 2 GB/s; Daly (2006,
    # eq. 37) interval;
    # first-order goodput tau/(tau+C)·(1 − (R + (tau+C)/2)/M) (Young 1974); no stragglers
    # (their term: tests/planner/test_straggler_objective.py)
    m = 1000 * 3600 / 16
    assert row["job_mtbf_s"] == pytest.approx(m)
    writers = row["tp"] * row["pp"] * row["dp"] if "zero" in row["id"] else \
        row["tp"] * row["pp"]
    state = 14 * load_model("llama3-8b").num_params()
    c = max(state / 2e12, state / writers / 2e9)
    assert row["checkpoint_s"] == pytest.approx(c)
    x = c / (2 * m)
    tau = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert row["checkpoint_interval_s"] == pytest.approx(tau)
    good = tau / (tau + c) * (1 - (600 + (tau + c) / 2) / m)
    assert row["goodput"] == pytest.approx(good)
    assert row["effective_tokens_per_s"] == pytest.approx(good * row["tokens_per_s"])
    assert row["restart_s"] == 600.0
    effective = [p["effective_tokens_per_s"] for p in data["plans"]]
    assert effective == sorted(effective, reverse=True)
    with open(tmp_path / "ranked.csv") as f:
        first = next(csv.DictReader(f))
    assert first["id"] == row["id"]
    assert float(first["goodput"]) == pytest.approx(good)


def test_plan_goodput_spare_delay_lengthens_node_failure_restarts(capsys):
    import json

    from apps.cli import main
    # 16 devices (1000 h) and 2 nodes (500 h): node failures are 2/500 of 16/1000 + 2/500,
    # = 1/5 of all; each waits 900 s for a spare: mean restart 300 + 900/5 = 480 s
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                 "--global-batch", "64", "--top-k", "2", "--objective", "goodput",
                 "--mtbf-hours", "1000", "--node-mtbf-hours", "500", "--spare-delay-s", "900",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plans"][0]["restart_s"] == pytest.approx(480.0)
    assert data["plans"][0]["job_mtbf_s"] == pytest.approx(3600 / (16 / 1000 + 2 / 500))
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100",
                 "--objective", "goodput", "--spare-delay-s", "900"]) == 2
    assert "give --node-mtbf-hours" in " ".join(capsys.readouterr().err.split())

"""`meshplan run`'s fault flags reach `run_plan`; `meshplan plan --objective goodput` parses."""

from apps.cli import build_parser
from apps.cmd_faults import restart_line, run_fault_kwargs


def test_run_fault_flags_become_run_plan_keywords():
    args = build_parser().parse_args([
        "run", "plan.yaml", "--checkpoint-every", "3", "--keep", "3", "--max-restarts", "2",
        "--timeout-s", "10", "--inject", "kill:rank=1,step=7", "--inject", "nan:step=9",
        "--on-nan", "skip", "--resume", "runs/x/checkpoints"])
    assert run_fault_kwargs(args) == {
        "checkpoint_every": 3, "keep": 3, "resume": "runs/x/checkpoints",
        "inject": ["kill:rank=1,step=7", "nan:step=9"], "collective_timeout_s": 10.0,
        "on_nan": "skip", "max_restarts": 2}


def test_plan_objective_flags_parse():
    args = build_parser().parse_args(["plan", "--model", "tiny-gpt", "--cluster", "dgx-h100",
                                      "--objective", "goodput", "--mtbf-hours", "20000"])
    assert (args.objective, args.mtbf_hours, args.node_mtbf_hours) == ("goodput", 20000.0, None)


def test_restart_line_names_the_losses():
    line = restart_line({"restarts": 1, "steps_lost": 1, "wall_time_lost_s": 7.4,
                         "checkpoints": 4, "goodput": 0.5})
    assert line == ("restarts: 1  steps_lost: 1  wall_time_lost_s: 7.4  checkpoints: 4  "
                    "goodput: 0.500")

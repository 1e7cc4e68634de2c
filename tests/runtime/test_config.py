"""`runtime.config.TrainConfig`: the runtime's edge, checked on construction, built from the
command line by `runtime.train.parse_args`."""

from __future__ import annotations

import dataclasses

import pytest

from planner.spec import PlanError
from runtime.config import TrainConfig


def test_defaults_are_the_command_line_defaults():
    from runtime.train import parse_args
    config = parse_args(["plan.yaml", "--out", "run", "--attention", "sdpa"])
    assert config == TrainConfig(plan_path="plan.yaml", out_dir="run")


def test_parse_args_gives_a_frozen_config_with_the_faults_as_a_tuple():
    from runtime.train import parse_args
    config = parse_args(["plan.yaml", "--out", "run", "--steps", "8",
                         "--inject", "kill:rank=1,step=7", "--inject", "nan:step=2"])
    assert config.inject == ("kill:rank=1,step=7", "nan:step=2") and config.steps == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 9


def test_steps_must_be_positive():
    with pytest.raises(PlanError, match="--steps=0 must be >= 1"):
        TrainConfig(plan_path="plan.yaml", out_dir="run", steps=0)


def test_a_fault_beyond_the_last_step_says_what_to_use():
    with pytest.raises(PlanError, match="step=50 is beyond --steps 4.*use a step from 1 to 4"):
        TrainConfig(plan_path="plan.yaml", out_dir="run", steps=4,
                    inject=("kill:rank=1,step=50",))


@pytest.mark.parametrize("field, value, message", [
    ("checkpoint_every", -1, "--checkpoint-every=-1 must be >= 0"),
    ("keep", 0, "--keep=0 must be >= 1"),
    ("timeout_s", 0.0, "--timeout-s=0.0 must be > 0"),
    ("on_nan", "ignore", r"--on-nan='ignore' is not one of \['stop', 'skip'\]"),
    ("attention", "flash", r"--attention='flash' is not one of \['sdpa', 'tiled'\]"),
])
def test_a_field_out_of_range_is_named_with_its_value(field, value, message):
    with pytest.raises(PlanError, match=message):
        TrainConfig(plan_path="plan.yaml", out_dir="run", **{field: value})


def test_replace_checks_again():
    config = TrainConfig(plan_path="plan.yaml", out_dir="run")
    with pytest.raises(PlanError, match="--keep=0"):
        dataclasses.replace(config, keep=0)

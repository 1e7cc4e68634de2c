"""Plan files round-trip and reject bad input with a clear message."""

import pytest

from planner.planfile import ClusterRef, PlanFile, read_plan_file, write_plan_file
from planner.presets import load_model
from planner.spec import Plan, PlanError


def test_round_trip(tmp_path):
    pf = PlanFile(model=load_model("tiny-gpt"),
                  plan=Plan(tp=2, pp=1, dp=1, micro_batch=2, global_batch=8, dtype="fp32",
                            stage_layers=None),
                  cluster=ClusterRef(name="localhost-cpu", nodes=1),
                  prediction={"step_time_s": 0.5})
    path = write_plan_file(tmp_path / "plan.yaml", pf)
    assert read_plan_file(path) == pf


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        read_plan_file(tmp_path / "nope.yaml")


def test_unknown_plan_field(tmp_path):
    pf = PlanFile(model=load_model("tiny-gpt"),
                  plan=Plan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1),
                  cluster=ClusterRef(name="localhost-cpu"))
    data = pf.to_dict()
    data["plan"]["tensor_parallel"] = 2
    import yaml
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match=r"unknown plan field\(s\) \['tensor_parallel'\]"):
        read_plan_file(path)

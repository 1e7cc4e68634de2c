"""Shared fixtures of the whole test suite, and the opt-in flag for its slow cases."""

import os

import pytest

#: Set to 1 to run the tests marked ``slow`` (extra multi-rank combinations, long searches)
#: as well.
SLOW_ENV = "MESHPLAN_SLOW_TESTS"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(SLOW_ENV) == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason=f"slow case; set {SLOW_ENV}=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_calibrated_profile(tmp_path_factory, monkeypatch):
    """Point the command line's default profile folder at an empty one, so no command-line
    test depends on (or is changed by) a `meshplan calibrate` profile that happens to exist
    on the machine (the library itself only reads profiles it is given)."""
    monkeypatch.setenv("MESHPLAN_PROFILE_DIR", str(tmp_path_factory.mktemp("profiles")))


@pytest.fixture
def tiny_plan_file(tmp_path):
    """``tiny_plan_file(**plan_fields)``: a localhost-cpu plan file of tiny-gpt (fp32, global
    batch 8, ranks = tp·pp·dp) in ``tmp_path``, returning its path."""
    from planner.planfile import ClusterRef, PlanFile, write_plan_file
    from planner.presets import load_model
    from planner.spec import Plan

    def make(**fields):
        plan = Plan(**{"micro_batch": 1, "global_batch": 8, "dtype": "fp32", **fields})
        return write_plan_file(tmp_path / "plan.yaml", PlanFile(
            model=load_model("tiny-gpt"), plan=plan,
            cluster=ClusterRef(name="localhost-cpu", nodes=1, ranks=plan.world_size)))
    return make

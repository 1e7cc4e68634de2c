"""Shared helpers for the runtime tests: small tiny-gpt plan files in a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.planfile import ClusterRef, PlanFile, write_plan_file
from planner.presets import load_model
from planner.spec import ModelSpec, Plan

#: tiny-gpt at a short sequence so each torchrun test trains 5 steps in about a second.
SEQ_LEN = 64
#: Rough fp32 peak of one core of this CPU (AVX2, 2 FMA units: 32 FLOP/cycle at ~3.3 GHz).
CPU_PEAK_FLOPS = 1.05e11


def make_tiny_model(**changes) -> ModelSpec:
    """tiny-gpt at SEQ_LEN tokens, with optional field changes."""
    return load_model("tiny-gpt").replace(seq_len=SEQ_LEN, **changes)


def make_tiny_plan(**changes) -> Plan:
    """An fp32 plan of 8 sequences per step in micro-batches of 2 (single process by default)."""
    fields = {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 2, "global_batch": 8, "dtype": "fp32"}
    return Plan(**{**fields, **changes})


def write_plan_for(folder: Path, name: str, plan: Plan, model: ModelSpec | None = None) -> Path:
    """Write a plan file for ``plan`` (tiny-gpt unless ``model`` is given) and return its path."""
    cluster = ClusterRef(name="localhost-cpu", nodes=1, peak_flops_per_device=CPU_PEAK_FLOPS)
    plan_file = PlanFile(model=model or make_tiny_model(), plan=plan, cluster=cluster,
                         prediction={"step_time_s": 0.1})
    return write_plan_file(folder / f"{name}.yaml", plan_file)


@pytest.fixture(scope="session")
def plan_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plans")


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: tiny-gpt at SEQ_LEN tokens, ``tiny_model(**changes)``."""
    return make_tiny_model


@pytest.fixture(scope="session")
def tiny_plan():
    """Factory: an fp32 plan with global batch 8, ``tiny_plan(**changes)``."""
    return make_tiny_plan


@pytest.fixture(scope="session")
def write_plan(plan_dir):
    """Factory: ``write_plan(name, plan, model=None) -> path`` of a plan file in plan_dir."""
    return lambda name, plan, model=None: write_plan_for(plan_dir, name, plan, model)

"""Every example in a docstring is a test (NetworkX style): each module of the four packages
that has a ``>>>`` example runs its examples, and none may fail or be skipped unseen."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules_with_examples() -> list[str]:
    names = []
    for pkg in ("planner", "simulator", "runtime", "apps"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if ">>>" in path.read_text(encoding="utf-8"):
                names.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return names


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    # the list is only as good as the search: modules known to carry examples
    assert {"planner.mesh", "simulator.network.cluster", "simulator.step.pipeline",
            "runtime.faults"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_examples_pass(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0

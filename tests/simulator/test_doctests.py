"""The formulas' doctest examples are tests too (NetworkX style)."""

import doctest
import importlib

import pytest

MODULES = ["cluster", "collectives", "costs", "hardware", "memory", "probe", "simulate",
           "trace"]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests_pass(name):
    module = importlib.import_module(f"simulator.{name}")
    result = doctest.testmod(module)
    assert result.failed == 0


@pytest.mark.parametrize("name", ["simulator.stragglers", "simulator.validate",
                                  "simulator.compute", "simulator.cpu_model", "simulator.fit",
                                  "apps.format", "apps.cmd_validate", "apps.cmd_calibrate"])
def test_more_doctests_pass(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0

"""The validation tests report their accuracy figures at the end of every pytest run."""

from __future__ import annotations

import pytest

_FIGURES: list[str] = []


@pytest.fixture(scope="session")
def validation_figures() -> list[str]:
    """A list the validation tests append one line per table to; printed at the end."""
    return _FIGURES


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("validation figures (predicted vs measured step time)")
        for line in _FIGURES:
            terminalreporter.write_line(line)

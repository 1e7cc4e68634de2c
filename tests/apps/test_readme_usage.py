"""The README's usage block (## Commands) names every flag of the commands it lists, and the
--dtype choices it shows are the precisions the code takes (planner.precision.DTYPES)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from apps.cli import build_parser
from planner.precision import DTYPES

README = Path(__file__).resolve().parents[2] / "README.md"
# run and launch: the README shows their common flags; docs/runtime.md, docs/faults.md and
# docs/planner.md describe the others
CHECKED = ("plan", "sweep", "simulate", "topo", "collective", "validate", "calibrate",
           "compare", "app", "demo", "diff", "export")


def _usage_by_command() -> dict[str, str]:
    block = README.read_text(encoding="utf-8").split("## Commands", 1)[1].split("```")[1]
    usage: dict[str, str] = {}
    command = None
    for line in block.splitlines():
        if m := re.match(r"meshplan (\w+)", line):
            command = m.group(1)
        if command:
            usage[command] = usage.get(command, "") + line + "\n"
    return usage


def _subparsers():
    (action,) = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    return action.choices


@pytest.mark.parametrize("command", CHECKED)
def test_the_usage_names_every_flag(command):
    text = _usage_by_command()[command]
    flags = [o for a in _subparsers()[command]._actions for o in a.option_strings
             if o.startswith("--") and o != "--help"]
    assert [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text)] == []


def test_the_dtype_choices_are_the_codes():
    text = _usage_by_command()["plan"]
    assert f"[--dtype {'|'.join((*DTYPES, 'any'))}]" in text

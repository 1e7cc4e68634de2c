"""The `meshplan` command: builds the parser from one module per subcommand and dispatches.

Each ``apps/cmd_*.py`` registers its subcommand with ``add_parser(sub)`` and imports what
the command needs (torch, pandas, the simulator, ...) inside the command function, so every
``--help`` answers without loading them.

Exit codes: 0 success, 2 bad input (a `PlanError`), 1 runtime failure.
"""

from __future__ import annotations

import argparse
import os
import sys

from apps import (
    cmd_app,
    cmd_calibrate,
    cmd_compare,
    cmd_demo,
    cmd_diff,
    cmd_export,
    cmd_launch,
    cmd_plan,
    cmd_run,
    cmd_simulate,
    cmd_sweep,
    cmd_topo,
    cmd_validate,
)
from planner import __version__
from planner.spec import PlanError

#: The subcommand modules, in the order `meshplan --help` lists them.
COMMANDS = (cmd_plan, cmd_simulate, cmd_run, cmd_compare, cmd_validate, cmd_calibrate,
            cmd_demo, cmd_launch, cmd_app, cmd_topo, cmd_diff, cmd_export, cmd_sweep)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="meshplan", description=(
        "Plan, simulate and run distributed LLM training; compare predictions with runs."))
    p.add_argument("--version", action="version", version=f"meshplan {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def _error(text: str) -> None:
    from rich.console import Console
    Console(stderr=True, soft_wrap=True).print(text, highlight=False)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `meshplan` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PlanError as exc:
        _error(f"[red]error:[/] {exc}")
        return 2
    except BrokenPipeError:
        # The reader went away (``meshplan ... | head``): nothing left to say to it.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps Python's exit flush quiet
        return 1
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        # A path the user gave cannot be read or written: bad input.
        _error(f"[red]error:[/] {exc.strerror}: {exc.filename!r}")
        return 2
    except (RuntimeError, OSError) as exc:
        _error(f"[red]failed:[/] {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""The `meshplan` command: builds the parser from one module per subcommand and dispatches.

Each ``apps/cmd_*.py`` registers its subcommand with ``add_parser(sub)`` and imports what
the command needs (torch, pandas, the simulator, ...) inside the command function, so every
``--help`` answers without loading them.

Exit codes: 0 success, 2 bad input (a `PlanError`), 1 runtime failure.
"""

from __future__ import annotations

import argparse
import os
import re
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
from apps.format import print_error
from planner import __version__
from planner.spec import PlanError

#: The subcommand modules, in the order `meshplan --help` lists them.
COMMANDS = (cmd_plan, cmd_simulate, cmd_run, cmd_compare, cmd_validate, cmd_calibrate,
            cmd_demo, cmd_launch, cmd_app, cmd_topo, cmd_diff, cmd_export, cmd_sweep)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = _Parser(prog="meshplan", description=(
        "Plan, simulate and run distributed LLM training; compare predictions with runs."))
    p.add_argument("--version", action="version", version=f"meshplan {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    _no_abbreviations(p)
    return p


_error = print_error


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose own errors (an unknown flag, a missing value, ``--top x``)
    are one ``error: ...`` line naming the command, as every other bad input is, instead of
    the usage block followed by ``meshplan plan: error: ...``; the exit status stays 2."""

    #: The words being parsed (set by `main`), so that an unknown flag is judged against the
    #: subcommand they name.
    words: list[str] = []

    def error(self, message: str):
        prog, hint = self.prog, ""
        if message.startswith("unrecognized arguments: "):
            word = message.split(": ", 1)[1].split()[0].split("=")[0]
            command = _command_of(self, self.words)
            if command is not None and word.startswith("--"):
                prog = command.prog
                hint = _flag_hint(word, command, self)
        print_error("error:", f"{prog}: {message}{hint}; see `{prog} --help`")
        self.exit(2)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in parser._actions
                 if isinstance(a, argparse._SubParsersAction)), {})


def _command_of(parser: argparse.ArgumentParser, words: list[str]):
    # the subcommand parser the first command word names, or None
    subs = _subcommands(parser)
    return next((subs[w] for w in words if w in subs), None)


def _long_flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})


def _flag_hint(word: str, command: argparse.ArgumentParser,
               top: argparse.ArgumentParser) -> str:
    """What to say of an unknown ``word`` in ``command``: that it belongs to other commands,
    or the closest flag of ``command`` itself."""
    from planner.spec import did_you_mean
    elsewhere = [name for name, sub in _subcommands(top).items()
                 if sub is not command and word in _long_flags(sub)]
    if elsewhere:
        return f" ({word} is an option of {', '.join(elsewhere)}, not of this command)"
    return did_you_mean(word, _long_flags(command))


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    # ``--dev 8`` must not run as ``--devices 8``: a flag is its whole name
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _no_abbreviations(sub)


def joined_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with each ``--flag -5T`` written ``--flag=-5T`` where --flag takes one value:
    argparse reads a word that starts with '-' and is not a plain number as an option
    ("expected one argument"), so the command's own check could not say the value must be
    > 0.

    >>> p = argparse.ArgumentParser(); _ = p.add_argument("--tokens"); _ = p.add_argument("-q")
    >>> joined_negative_values(p, ["--tokens", "-5T", "-q", "x"])
    ['--tokens=-5T', '-q', 'x']
    """
    takes_value, parsers = set(), [parser]
    while parsers:   # argparse lists a parser's actions only in _actions
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.nargs is None:
                takes_value.update(o for o in action.option_strings if o.startswith("--"))
    out: list[str] = []
    for word in argv:
        if out and out[-1] in takes_value and re.match(r"-\.?\d", word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


#: Actions whose flag may be given more than once (each adds a value or a count).
_REPEATABLE = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction,
               argparse._ExtendAction)


def repeated_flag(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The error for the first flag of ``argv`` given twice (argparse keeps the last value
    without a word), else None; flags that collect values (``--fix``, ``--inject``) may
    repeat. Looked up in the subcommand's parser, the first word naming one; an unambiguous
    prefix (``--step`` for ``--steps``) counts as the flag, as argparse reads it.

    >>> p = argparse.ArgumentParser(); _ = p.add_argument("--steps"); _ = p.add_argument(
    ...     "--fix", action="append")
    >>> repeated_flag(p, ["--steps", "4", "--fix", "a", "--fix", "b", "--step=8"])
    '--steps given twice (--steps 4 and --step=8); give it once'
    >>> repeated_flag(p, ["--steps", "4"]) is None
    True
    """
    actions = {o: a for a in parser._actions for o in a.option_strings}
    seen: dict[argparse.Action, str] = {}
    words = iter(argv)
    for word in words:
        if word == "--":
            return None
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                    and word in a.choices), None)
        if sub is not None:
            return repeated_flag(sub.choices[word], list(words))
        if not word.startswith("--"):
            continue
        flag, eq, value = word.partition("=")
        names = [o for o in actions if o == flag] or [o for o in actions if o.startswith(flag)]
        action = actions[names[0]] if len(names) == 1 else None
        if action is None or isinstance(action, _REPEATABLE):
            continue
        given = word if eq or action.nargs == 0 else f"{word} {next(words, '')}".strip()
        if action in seen:
            return f"{names[0]} given twice ({seen[action]} and {given}); give it once"
        seen[action] = given
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `meshplan` console script; returns the exit code."""
    parser = build_parser()
    words = joined_negative_values(parser, sys.argv[1:] if argv is None else list(argv))
    if (twice := repeated_flag(parser, words)) is not None:
        _error("error:", twice)
        return 2
    _Parser.words = words
    args = parser.parse_args(words)
    from rich.console import Console
    Console.on_broken_pipe = _on_broken_pipe     # a command's exit status is decided here
    try:
        status = args.func(args)
        sys.stdout.flush()      # here, so that a reader gone at the end is caught below
        return status
    except PlanError as exc:
        _error("error:", str(exc))
        return 2
    except BrokenPipeError:
        return _reader_gone()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        # A path the user gave cannot be read or written: bad input.
        _error("error:", f"{exc.strerror}: {exc.filename!r}")
        return 2
    except (RuntimeError, OSError) as exc:
        _error("failed:", str(exc))
        return 1


def _on_broken_pipe(console) -> None:
    # rich's hook for a closed output raises SystemExit(1) (rich.console.Console
    # .on_broken_pipe, meant to be replaced); raised on as BrokenPipeError, `main` exits 0
    console.quiet = True
    raise BrokenPipeError


def _reader_gone() -> int:
    """The reader of stdout went away (``meshplan ... | head``): what it read is what it
    asked for, so exit 0, quietly. stdout is pointed at os.devnull so that Python's flush at
    exit does not raise BrokenPipeError again (the recipe of Python's `signal` docs, "Note on
    SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())

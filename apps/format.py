"""Human units at the edge: the one place SI values become ms, GiB and percentages."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    from rich.console import Console

GiB = 2**30


def print_error(label: str, message: str) -> None:
    """The one printer of a command's error line on stderr: ``label`` ('error:' for bad
    input, 'failed:' for a runtime failure) in red, then ``message`` as plain text: exception
    text carries paths and tool output (``[/__w/...]``) that rich would read as markup."""
    from rich.console import Console  # here: `--help` never loads rich
    from rich.text import Text
    Console(stderr=True, soft_wrap=True).print(Text.assemble((label, "red"), " ", message),
                                               highlight=False)


def fmt_time_s(seconds: float) -> str:
    """Seconds as ``'412.3 ms'`` below one second, else ``'12.34 s'``.

    >>> fmt_time_s(0.4123), fmt_time_s(8.7821)
    ('412.3 ms', '8.78 s')
    """
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def json_safe(value: object) -> object:
    """``value`` with every float NaN or infinity (an unknown figure: no price, no failure)
    replaced by None, recursively through dicts, lists and tuples, so that it is standard JSON
    (RFC 8259 has no NaN); numpy scalars become Python numbers.

    >>> json_safe({"cost_usd": float("nan"), "rows": [1.5, float("inf")]})
    {'cost_usd': None, 'rows': [1.5, None]}
    """
    import math
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps_json(value: object, **kwargs) -> str:
    """The one JSON writer of every ``--json`` output and JSON file: `json_safe` then
    ``json.dumps(..., allow_nan=False)``, which raises rather than write NaN."""
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


def print_json(value: object) -> None:
    """Print ``value`` as one line of standard JSON on stdout (`dumps_json`)."""
    print(dumps_json(value))


def fmt_duration_s(seconds: float) -> str:
    """A time to train in the largest unit that is at least one: days, hours, minutes or
    seconds (a short budget is not '0.0 days').

    >>> fmt_duration_s(26.64 * 86400), fmt_duration_s(5.3 * 3600), fmt_duration_s(754)
    ('26.6 days', '5.3 h', '12.6 min')
    >>> fmt_duration_s(6.24)
    '6.2 s'
    """
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s"


def fmt_bytes(n: float) -> str:
    """Bytes as GiB with one decimal (``'71.3 GiB'``), or MiB below 1 GiB."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def fmt_pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal; '-' when unknown."""
    from pandas import isna
    return "-" if x is None or isna(x) else f"{100 * x:.1f}%"


def fmt_gib(n: float) -> str:
    """Bytes as a bare GiB figure for a column headed in GiB: one decimal from 1 GiB, two
    significant digits below (a tiny model's rank is not '0.0').

    >>> fmt_gib(47.7 * 2**30), fmt_gib(0.0234 * 2**30)
    ('47.7', '0.023')
    """
    v = n / GiB
    return f"{v:.1f}" if v >= 1 else f"{v:.2g}"


def fmt_krate(x: float) -> str:
    """A rate in thousands for a column headed in k/s (``595843.2`` -> ``'595.8'``)."""
    return f"{x / 1e3:,.1f}"


def fmt_recompute(policy: str) -> str:
    """A recomputation policy in at most four letters: '-', 'sel' or 'full'."""
    return {"none": "-", "selective": "sel"}.get(policy, policy)


def fmt_flag(x: bool) -> str:
    """A boolean as 'yes' / '-' for narrow table columns."""
    return "yes" if x else "-"


def fmt_rate(x: float) -> str:
    """A rate (tokens/s) with thousands separators."""
    return f"{x:,.0f}"


def fmt_params(n: int) -> str:
    """A parameter count as ``'70.55B'`` or ``'3.3M'``.

    >>> fmt_params(70_553_706_496), fmt_params(3_300_000)
    ('70.55B', '3.3M')
    """
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def command_console(args) -> Console:
    """The console a command prints its human output on: stderr under ``--json``, so stdout
    holds one JSON object."""
    from rich.console import Console  # imported here: `--help` never loads rich
    return Console(stderr=bool(getattr(args, "json", False)))


class SearchProgress:
    """A search's ``progress`` callback on a stderr console: the spinner's text on a terminal;
    elsewhere (a log file, CI) a plain line every `LINE_EVERY_S` seconds, the first after
    `QUIET_S`, so a short search prints nothing extra."""

    QUIET_S = 5.0
    LINE_EVERY_S = 15.0

    def __init__(self, console: Console, status=None) -> None:
        import time
        self._clock = time.monotonic
        self.console, self.status = console, status
        self.start = self._clock()
        self.next_line = self.start + self.QUIET_S

    def __call__(self, text: str) -> None:
        now = self._clock()
        line = f"searching ({now - self.start:.0f} s): {text}"
        if self.console.is_terminal and self.status is not None:
            self.status.update(line)
        elif now >= self.next_line:
            self.console.print(line, highlight=False, soft_wrap=True)
            self.next_line = now + self.LINE_EVERY_S


def check_at_least(flag: str, value: int | float | None, least: int = 1,
                   hint: str = "", *, strict: bool = False) -> None:
    """Before any work: raise `PlanError` ``"--steps=0 must be >= 1 (hint)"`` when ``value``
    (None: not given, nothing to check) is below ``least`` (``strict``: not above it, "> 0").
    The one range check of a numeric flag.

    >>> check_at_least("--steps", 3)
    >>> check_at_least("--steps", 0, hint="steps each plan runs")
    Traceback (most recent call last):
    planner.spec.PlanError: --steps=0 must be >= 1 (steps each plan runs)
    >>> check_at_least("--mtbf-hours", 0, 0, strict=True)
    Traceback (most recent call last):
    planner.spec.PlanError: --mtbf-hours=0 must be > 0
    """
    from planner.spec import PlanError
    if isinstance(value, float) and not math.isfinite(value):
        raise PlanError(f"{flag}={value} must be a finite number"
                        + (f" ({hint})" if hint else ""))
    if value is not None and (value < least or (strict and value == least)):
        raise PlanError(f"{flag}={value} must be {'>' if strict else '>='} {least}"
                        + (f" ({hint})" if hint else ""))


#: The cluster presets as `--help` lists them (simulator/presets/clusters.yaml; written here so
#: that `--help` imports no simulator; tests/apps/test_cli.py checks it against the presets).
CLUSTER_PRESETS = ("dgx-a100", "dgx-h100", "dgx-h100-roce", "dgx-h200", "dgx-b200", "dgx-b300",
                   "gb200-nvl72", "gb300-nvl72", "pcie-a100", "localhost-cpu")
CLUSTER_HELP = f"preset ({', '.join(CLUSTER_PRESETS)}) or a cluster YAML file (docs/clusters.md)"


#: Image files matplotlib writes (``savefig`` picks the format from the suffix).
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def check_image_path(flag: str, path: str | Path | None) -> None:
    """`check_output_path` for a flag that writes a figure, whose suffix must name an image
    format (`IMAGE_SUFFIXES`).

    Raises:
        PlanError: another suffix, or as `check_output_path`.
    """
    from planner.spec import PlanError
    if path is not None and Path(path).suffix.lower() not in IMAGE_SUFFIXES:
        raise PlanError(f"{flag} {str(path)!r}: a figure is written as "
                        f"{', '.join(IMAGE_SUFFIXES)}; give a name ending in one (e.g. "
                        f"{Path(path).with_suffix('.png').name})")
    check_output_path(flag, path)


def check_output_path(flag: str, path: str | Path | None, *, folder: bool = False) -> None:
    """Before any work: raise `PlanError` naming ``flag`` when ``path`` cannot be written as a
    file (``folder`` False) or used as a folder (True). The check asks the operating system: it
    creates (and removes) a probe file in the folder ``path`` goes into, or a probe folder in
    the nearest existing parent when folders are still to be made, so the reason it gives (No
    such file or directory, Permission denied, Read-only file system, ...) is the one the
    write itself would meet. None: nothing to check.

    Raises:
        PlanError: ``"--out '/proc/nope/x.yaml': cannot write there (No such file or
            directory); choose a writable folder"``, or the path is the wrong kind of thing
            (a folder given for a file, a file for a folder).
    """
    import os
    import tempfile

    from planner.spec import PlanError
    if path is None:
        return
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise PlanError(f"{flag} {str(path)!r} is a file; {flag} takes a folder (new or "
                        f"existing): give another path or remove the file")
    if not folder and path.is_dir():
        raise PlanError(f"{flag} {str(path)!r} is a folder; {flag} takes a file path")
    into = path if folder else path.parent
    parent = into
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        if not folder and path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, os.strerror(13), str(path))
        if parent == into:
            with tempfile.NamedTemporaryFile(dir=into, prefix=".meshplan-probe-"):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".meshplan-probe-"))
    except OSError as exc:
        raise PlanError(f"{flag} {str(path)!r}: cannot write there ({exc.strerror or exc}); "
                        f"choose a writable folder") from None


def output_file(path: str | Path) -> Path:
    """``path`` as a `Path`, its missing parent folders created: what every writer of a file
    that a flag names (--csv, --png, --plot, --slurm, ...) calls just before writing, after
    `check_output_path` cleared the path before any work."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_csv(rows: list[dict], path: str | Path) -> Path:
    """Write table rows as CSV in SI units (nested values as JSON); parent folders created."""
    import pandas as pd
    path = output_file(path)
    flat = [{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in row.items()}
            for row in rows]
    pd.DataFrame(flat).to_csv(path, index=False)
    return path


def print_table(console: Console, df: pd.DataFrame, title: str,
                columns: dict[str, tuple[str, object]], limit: int | None = None) -> None:
    """Print the ``columns`` of ``df`` as a rich table.

    ``columns`` maps a column name to ``(header, formatter)``; formatter None prints ``str``.
    Cells never wrap or get cut: a table wider than the terminal is printed at its own width
    (the terminal folds the lines; piped output keeps every row on one line).
    """
    from rich import box
    from rich.table import Table
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0))
    for col, (header, _) in columns.items():
        table.add_column(header, justify="left" if df[col].dtype == object else "right",
                         no_wrap=True)
    for _, row in (df.head(limit) if limit else df).iterrows():
        table.add_row(*[fmt(row[c]) if fmt else str(row[c]) for c, (_, fmt) in columns.items()])
    width = console.measure(table, options=console.options.update_width(10_000)).maximum
    terminal = console.width
    console.width = max(terminal, width)
    try:
        console.print(table)
    finally:
        console.width = terminal

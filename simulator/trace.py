"""Chrome / Perfetto trace export of a simulated step's event log."""

from __future__ import annotations

import json
from pathlib import Path


def chrome_trace(events: list[tuple]) -> dict:
    """Trace Event Format dict of ``(stage, stream, name, start_s, end_s)`` events.

    Complete events (``"ph": "X"``) in microseconds; ``pid`` = pipeline stage, ``tid`` = stream.

    >>> chrome_trace([(0, "compute", "F0", 0.0, 1e-3)])["traceEvents"][0]["dur"]
    1000.0
    """
    return {"displayTimeUnit": "ms", "traceEvents": [
        {"name": name, "ph": "X", "pid": stage, "tid": stream, "ts": start * 1e6,
         "dur": (end - start) * 1e6} for stage, stream, name, start, end in events]}


def write_chrome_trace(events: list[tuple], path: str | Path) -> Path:
    """Write `chrome_trace` of ``events`` as JSON to ``path`` (open in ui.perfetto.dev)."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events)), encoding="utf-8")
    return path

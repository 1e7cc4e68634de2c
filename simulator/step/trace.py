"""Chrome / Perfetto trace export of a simulated step's event log."""

from __future__ import annotations

import json
from pathlib import Path

#: Track order inside one stage's process.
STREAMS = ("compute", "comm", "p2p", "dp")


def chrome_trace(events: list[tuple]) -> dict:
    """Trace Event Format dict of ``(stage, stream, name, start_s, end_s)`` events.

    Complete events (``"ph": "X"``) in microseconds; ``pid`` = pipeline stage, ``tid`` = the
    stream's index, both named by metadata events (``"ph": "M"``) so Perfetto shows one track
    per stage and stream ("stage 0" / "compute", ...).

    >>> trace = chrome_trace([(0, "compute", "F0", 0.0, 1e-3)])
    >>> [e["dur"] for e in trace["traceEvents"] if e["ph"] == "X"]
    [1000.0]
    """
    streams = sorted({e[1] for e in events},
                     key=lambda s: (STREAMS.index(s) if s in STREAMS else len(STREAMS), s))
    tid = {s: i for i, s in enumerate(streams)}
    stages = sorted({e[0] for e in events})
    meta = [{"name": "process_name", "ph": "M", "pid": p, "tid": 0,
             "args": {"name": f"stage {p}"}} for p in stages]
    meta += [{"name": "thread_name", "ph": "M", "pid": p, "tid": tid[s], "args": {"name": s}}
             for p in stages for s in streams]
    return {"displayTimeUnit": "ms", "traceEvents": meta + [
        {"name": name, "ph": "X", "pid": stage, "tid": tid[stream], "ts": start * 1e6,
         "dur": (end - start) * 1e6, "cat": stream}
        for stage, stream, name, start, end in events]}


def write_chrome_trace(events: list[tuple], path: str | Path) -> Path:
    """Write `chrome_trace` of ``events`` as JSON to ``path`` (open in ui.perfetto.dev)."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events)), encoding="utf-8")
    return path

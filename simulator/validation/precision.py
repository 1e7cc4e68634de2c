"""The training precision a published row names, as a plan dtype (`planner.precision`).

published_benchmarks.csv names a row's precision in ``notes`` (its README: "``notes`` starts
with ``precision=...`` and names the scaling recipe"): ``precision=bf16 | fp8 | mxfp8 |
nvfp4`` with ``fp8_recipe=...``, or torchtitan's ``precision=bf16+float8 linears (torchao)``
/ ``quantization=float8 ...`` cells. The reader simulates each row in that precision:

* ``nvfp4`` / ``mxfp8``: the block-scaled recipes of the same name;
* ``fp8`` with ``current`` scaling in the recipe or the precision text: ``fp8-current``;
  with ``delayed`` or no recipe named: ``fp8`` (Transformer Engine's and Megatron-Core's
  default ``DelayedScaling``, flagged);
* torchao float8 (``float8`` in the precision, or a float8 linear converter in the notes):
  ``fp8-current`` (torchao's ``tensorwise`` recipe: dynamic per-tensor scaling);
* anything else: the framework's default dtype.
"""

from __future__ import annotations

import re

#: The ``notes`` keys that name a row's GEMM precision: ``precision=`` (the table's own
#: convention), torchtitan's ``quantization=`` / ``optimizations=`` / ``techniques=`` cells.
PRECISION_KEYS = ("precision", "quantization", "optimizations", "techniques")


def row_precision(row: dict) -> str | None:
    """The GEMM precision a row's ``notes`` name (the first of `PRECISION_KEYS` given), or
    None when they name none.

    >>> row_precision({"notes": "x=1; precision=bf16+float8 linears (torchao); y"})
    'bf16+float8 linears (torchao)'
    >>> row_precision({"notes": "quantization=None (bfloat16); GBS = 12 x 8"})
    'None (bfloat16)'
    """
    notes = row.get("notes") or ""
    for key in PRECISION_KEYS:
        m = re.search(rf"(?<![a-z_]){key}\s*=\s*([^;]*)", notes, flags=re.IGNORECASE)
        if m:
            return m.group(1).strip()
    return None


def _note(row: dict, key: str) -> str:
    m = re.search(rf"(?<![a-z_]){key}\s*=\s*([^;]*)", row.get("notes") or "", re.IGNORECASE)
    return m.group(1).strip().lower() if m else ""


def row_dtype(row: dict, default: str) -> tuple[str, list[str]]:
    """(plan dtype, flags) of the precision a row names (module docstring); ``default`` (the
    framework's) when it names no low-precision recipe.

    >>> row_dtype({"notes": "precision=fp8;fp8_recipe=current-scaling (per-tensor)"}, "bf16")
    ('fp8-current', [])
    >>> row_dtype({"notes": "precision=fp8 (table: FP8; scaling recipe not printed)"}, "bf16")
    ('fp8', ['dtype=fp8 delayed scaling (default: no recipe named; TE DelayedScaling)'])
    >>> row_dtype({"notes": "quantization=float8 tensorwise"}, "bf16")
    ('fp8-current', [])
    >>> row_dtype({"notes": "precision=bf16"}, "bf16")
    ('bf16', [])
    """
    text = (row_precision(row) or "").lower()
    low = (row.get("notes") or "").lower()
    if "nvfp4" in text or "fp4" in text:
        return "nvfp4", []
    if "mxfp8" in text or "mx block" in _note(row, "fp8_recipe"):
        return "mxfp8", []
    if "float8" in text or "float8 linear" in low:
        return "fp8-current", []
    if "fp8" in text:
        recipe = f"{_note(row, 'fp8_recipe')} {text}"
        if "current" in recipe or "tensorwise" in recipe:
            return "fp8-current", []
        if "delayed" in recipe:
            return "fp8", []
        return "fp8", ["dtype=fp8 delayed scaling (default: no recipe named; TE DelayedScaling)"]
    return default, []

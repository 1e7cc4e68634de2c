"""Time to train: wall-clock days, GPU-hours and cost of a token budget for each ranked plan.

A plan that trains at ``tokens_per_s`` when healthy keeps only ``goodput`` of its wall time
under failures, checkpoint writes and restarts (`planner.objective.rank_by_goodput`), so a
budget of T tokens takes ``T / (tokens_per_s · goodput)`` seconds of wall time on
``world_size`` devices: GPU-hours = wall hours × world_size, cost = GPU-hours × price.
"""

from __future__ import annotations

import dataclasses
import math
import re

from planner.objective import rank_by_goodput
from planner.spec import ModelSpec, PlanError

#: The two times to train a budget, named wherever one is printed: `meshplan plan --tokens`
#: reports the wall time (its failure model's goodput), `meshplan sweep` the healthy time of
#: each cluster design (a sweep compares designs, and the failure assumptions are a plan's).
WALL_TIME = "wall time = tokens / (tokens/s x goodput): failures, checkpoints, restarts"
HEALTHY_TIME = "healthy time = tokens / tokens/s: no failures, checkpoints or restarts"

#: Columns `rank_by_time_to_train` adds to the ranked table (besides the goodput columns).
TRAIN_COLUMNS = ("train_tokens", "wall_days", "gpu_hours", "cost_usd")
_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_tokens(text: str, flag: str = "--tokens", what: str = "token count") -> float:
    """A token count with an optional K / M / B (or G) / T suffix (powers of ten, SI), e.g.
    ``15T``; the one reader of the count flags (``--tokens``, ``--global-batch-tokens``,
    ``--global-batch``), each named by ``flag`` in its message.

    >>> parse_tokens("15T"), parse_tokens("2.5B"), parse_tokens("1e6")
    (15000000000000.0, 2500000000.0, 1000000.0)

    Raises:
        PlanError: not a positive finite number with one of those suffixes.
    """
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)\s*", str(text))
    value = math.nan
    if m:
        try:
            value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
        except ValueError:
            pass
    if not (math.isfinite(value) and value > 0):
        example = "15T, 300B or 2e9" if what == "token count" else "512, 2K or 1.5e3"
        raise PlanError(f"{flag}={text!r} must be a positive {what} such as {example} "
                        "(suffixes K, M, B, T)")
    return value


def parse_count(text: str, flag: str, most: float, unit: str = "tokens") -> int:
    """A whole count of at most ``most`` ``unit`` written as `parse_tokens` reads it (``4M``,
    ``1e6``, ``512``).

    >>> parse_count("4M", "--global-batch-tokens", 1e12), parse_count("512", "--global-batch", 1e9)
    (4000000, 512)

    Raises:
        PlanError: as `parse_tokens`, or not a whole number, or more than ``most``.
    """
    value = parse_tokens(text, flag, "token count" if unit == "tokens" else
                         f"count of {unit}")
    if not value.is_integer():
        raise PlanError(f"{flag}={text!r} is not a whole number; give e.g. {math.floor(value)}")
    if value > most:
        raise PlanError(f"{flag}={text!r} is more than {most:.3g} {unit} per step, beyond any "
                        f"training run "
                        f"(Llama 3 405B used 16M tokens per step, Dubey et al. 2024 §3.4.1); "
                        f"check the exponent")
    return int(value)


def wall_s(tokens: float, tokens_per_s: float, goodput: float) -> float:
    """Seconds of wall time to train ``tokens`` at ``tokens_per_s`` keeping ``goodput``.

    >>> wall_s(8.64e10, 1e6, 1.0) / 86400
    1.0
    >>> wall_s(8.64e10, 1e6, 0.5) / 86400
    2.0
    """
    if not (tokens_per_s > 0 and goodput > 0):
        return math.inf
    return tokens / (tokens_per_s * goodput)


def rank_by_time_to_train(result, model: ModelSpec, *, tokens: float,
                          gpu_hour_usd: float | None = None, sort: bool = True,
                          **goodput_kwargs):
    """``result`` (a `planner.search.SearchResult`) with the goodput columns
    (`rank_by_goodput` with ``goodput_kwargs``) and `TRAIN_COLUMNS`: ``train_tokens``,
    ``wall_days``, ``gpu_hours`` and ``cost_usd`` (NaN without ``gpu_hour_usd``, US dollars
    per device-hour). ``sort``: order by wall days, then GPU-hours (else keep the order).

    Raises:
        PlanError: a non-positive token count or price, or a bad goodput assumption.
    """
    if not tokens > 0 or (gpu_hour_usd is not None and not gpu_hour_usd > 0):
        raise PlanError(f"tokens={tokens} and gpu_hour_usd={gpu_hour_usd} must be > 0")
    order = list(result.ranked["id"])
    result = rank_by_goodput(result, model, train_tokens=tokens, **goodput_kwargs)
    ranked = result.ranked.copy()
    if ranked.empty:
        return result
    seconds = [wall_s(tokens, r, g) for r, g in zip(ranked["tokens_per_s"], ranked["goodput"],
                                                    strict=True)]
    sizes = [result.plans[i].world_size for i in ranked["id"]]
    ranked["train_tokens"] = tokens
    ranked["wall_days"] = [s / 86400 for s in seconds]
    ranked["gpu_hours"] = [s / 3600 * n for s, n in zip(seconds, sizes, strict=True)]
    ranked["cost_usd"] = [h * gpu_hour_usd if gpu_hour_usd else math.nan
                          for h in ranked["gpu_hours"]]
    if sort:
        ranked = ranked.sort_values(["wall_days", "gpu_hours"], kind="stable")
    else:
        ranked = ranked.set_index("id").loc[order].reset_index()
    return dataclasses.replace(result, ranked=ranked.reset_index(drop=True))

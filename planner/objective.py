"""Rank searched plans by goodput: the tokens per second that survive failures.

For every ranked plan: the job fails at the rate of its ``world_size`` devices (device MTBF,
plus node MTBF per node when given); a checkpoint writes the training state (fp32 weights and
Adam's two moments, 12 bytes per parameter) over the storage bandwidth, or over the plan's
writers' own bandwidth when that is smaller (DCP writes each unique shard once: tp·pp ranks
hold distinct shards, all ranks under ZeRO / FSDP); the checkpoint interval is Daly's optimum
and the goodput the first-order model of `simulator.failures.goodput.expected_goodput`.
``effective_tokens_per_s`` = tokens/s × goodput, and the table is sorted by it.

A failure costs a restart (``restart_s``: detect, reschedule, reload the checkpoint) plus the
lost work; a node failure (rate: nodes / node MTBF) first waits ``spare_delay_s`` for a spare
node to be swapped in (spares assumed available; `simulator.failures.montecarlo.monte_carlo_goodput`
models a finite pool and repairs), so the mean restart is
``restart_s + (node failures / all failures) · spare_delay_s``.
"""

from __future__ import annotations

import dataclasses
import math

from planner.spec import ModelSpec, Plan, PlanError
from simulator.failures.goodput import checkpoint_write_s, job_goodput, training_state_bytes

#: Defaults: a parallel file system share, one writer's storage path, a restart.
STORAGE_BANDWIDTH_BPS = 50e9
WRITER_BANDWIDTH_BPS = 2e9
RESTART_S = 300.0
#: Columns `rank_by_goodput` adds to the ranked table (SI units, fractions).
GOODPUT_COLUMNS = ("goodput", "effective_tokens_per_s", "checkpoint_s", "checkpoint_interval_s",
                   "restart_s", "job_mtbf_s")


def checkpoint_writers(plan: Plan) -> int:
    """Ranks that write distinct shards of the state (see the module docstring)."""
    # CP ranks hold the same weights, like DP ranks; ZeRO shards over both (dp·cp).
    return plan.tp * plan.pp * (plan.dp_cp if plan.zero_stage > 0 else 1)


def rank_by_goodput(result, model: ModelSpec, *, device_mtbf_s: float,
                    devices_per_node: int = 8, node_mtbf_s: float | None = None,
                    storage_bandwidth_Bps: float = STORAGE_BANDWIDTH_BPS,
                    writer_bandwidth_Bps: float = WRITER_BANDWIDTH_BPS,
                    restart_s: float = RESTART_S, spare_delay_s: float = 0.0):
    """``result`` (a `planner.search.SearchResult`) re-ranked by effective tokens/s.

    Args:
        device_mtbf_s / node_mtbf_s: MTBF of one device and (None: no node failures) of
            one node, seconds.
        storage_bandwidth_Bps / writer_bandwidth_Bps: checkpoint bandwidth of the storage
            and of one writing rank, bytes/s.
        restart_s: seconds from a failure to training again, lost work excluded.
        spare_delay_s: seconds to swap a spare node in after a node failure (module
            docstring); needs ``node_mtbf_s`` to have an effect.

    Adds `GOODPUT_COLUMNS` to ``result.ranked``: ``goodput`` (fraction),
    ``effective_tokens_per_s``, ``checkpoint_s`` (write time), ``checkpoint_interval_s``
    (Daly), ``restart_s`` (mean, spare swaps included) and ``job_mtbf_s``.

    Raises:
        PlanError: a non-positive MTBF or bandwidth, or a negative restart or spare delay.
    """
    if restart_s < 0 or spare_delay_s < 0:
        raise PlanError(f"restart_s={restart_s} and spare_delay_s={spare_delay_s} must be >= 0")
    ranked = result.ranked.copy()
    if ranked.empty:
        return result
    state = training_state_bytes(model.num_params())
    rows = []
    for plan_id, tokens_per_s in zip(ranked["id"], ranked["tokens_per_s"], strict=True):
        plan = result.plans[plan_id]
        write = checkpoint_write_s(state, storage_bandwidth_Bps, writers=checkpoint_writers(plan),
                                   writer_bandwidth_Bps=writer_bandwidth_Bps)
        g = job_goodput(tokens_per_s=tokens_per_s, num_devices=plan.world_size,
                        device_mtbf_s=device_mtbf_s, checkpoint_s=write, restart_s=restart_s,
                        devices_per_node=devices_per_node, node_mtbf_s=node_mtbf_s,
                        spare_delay_s=spare_delay_s)
        rows.append((g.goodput, g.effective_tokens_per_s, g.checkpoint_s, g.interval_s,
                     g.restart_s, g.mtbf_s))
    for i, name in enumerate(GOODPUT_COLUMNS):
        ranked[name] = [row[i] for row in rows]
    ranked = ranked.sort_values(["effective_tokens_per_s", "peak_memory_bytes"],
                                ascending=[False, True], kind="stable").reset_index(drop=True)
    return dataclasses.replace(result, ranked=ranked)


def hours_to_s(hours: float) -> float:
    """MTBF hours to seconds (rejects non-positive values)."""
    if not hours > 0 or math.isinf(hours):
        raise ValueError(f"--mtbf-hours={hours} must be a positive number of hours")
    return hours * 3600.0

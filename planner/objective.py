"""Rank searched plans by goodput: the tokens per second that survive failures.

For every ranked plan: the job fails at the rate of its ``world_size`` devices (device MTBF,
plus node MTBF per node when given); a checkpoint writes the plan's training state (`checkpoint_bytes`:
the weights in the plan dtype and the Adam states, as `simulator.step.memory` counts them per
stage) and takes the longer of the whole state over the storage bandwidth and the largest
writer's shard over one writer's bandwidth (DCP writes each unique shard once: tp·pp ranks
hold distinct shards, all ranks under ZeRO / FSDP; the first and last pipeline stages hold the
embedding and the output layer, so their writers are the slowest); the checkpoint interval is
Daly's optimum and the goodput the first-order model of
`simulator.failures.goodput.expected_goodput`.
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

from planner.spec import DTYPE_BYTES, ModelSpec, Plan, PlanError
from simulator.failures.goodput import job_goodput
from simulator.step.memory import optimizer_bytes_per_param, stage_params

#: Defaults. Storage: the sustained throughput of the Tectonic file system Llama 3 405B
#: checkpointed to, 2 TB/s (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.1; peak
#: 7 TB/s). One writer: 2 GB/s, a rank's share of its node's storage path (an assumption;
#: `--writer-gbps`). Restart: 300 s from a failure to training again (an assumption;
#: `--restart-s`).
STORAGE_BANDWIDTH_BPS = 2e12
WRITER_BANDWIDTH_BPS = 2e9
RESTART_S = 300.0
#: Llama 3 405B pre-training: 419 unexpected interruptions in a 54-day snapshot on 16,384
#: H100 GPUs (Dubey et al. 2024, §3.3.4, Table 5), i.e. a job MTBF of 54·24/419 = 3.09 h and
#: a per-GPU MTBF of 16,384 × 3.09 h = 50,675 h when every interruption is charged to a GPU.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
DEVICE_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS
#: Columns `rank_by_goodput` adds to the ranked table (SI units, fractions).
GOODPUT_COLUMNS = ("goodput", "effective_tokens_per_s", "checkpoint_s", "checkpoint_interval_s",
                   "restart_s", "job_mtbf_s")


def checkpoint_writers(plan: Plan) -> int:
    """Ranks that write distinct shards of the state (see the module docstring)."""
    # CP ranks hold the same weights, like DP ranks; ZeRO shards over both (dp·cp).
    return plan.tp * plan.pp * (plan.dp_cp if plan.zero_stage > 0 else 1)


def checkpoint_bytes(model: ModelSpec, plan: Plan) -> tuple[float, float]:
    """(state bytes of the whole job, bytes of the largest writer's shard) of one checkpoint.

    The state is the weights in the plan dtype plus Adam's states (`optimizer_bytes_per_param`:
    fp32 master weights and two moments, 12 bytes, or 8 in fp32 training), per pipeline stage
    from `stage_params` (so a pp > 1 plan also saves its untied output layer copy): a TP rank
    of stage s holds stage_params·(dtype bytes + optimizer bytes); it is the writer unless the
    plan shards over dp·cp (ZeRO / FSDP), which splits it over dp·cp writers.

    >>> from planner.presets import load_model
    >>> m = load_model("tiny-gpt")
    >>> total, largest = checkpoint_bytes(m, Plan(tp=1, pp=1, dp=2, micro_batch=1,
    ...                                           global_batch=8, dtype="fp32"))
    >>> total == largest == m.num_params() * (4 + 8)
    True
    """
    per_param = DTYPE_BYTES[plan.dtype] + optimizer_bytes_per_param(plan.dtype)
    shard = checkpoint_writers(plan) // (plan.tp * plan.pp)
    stages = [stage_params(model, plan, s) * per_param for s in range(plan.pp)]
    return sum(stages) * plan.tp, max(stages) / shard


def plan_checkpoint_s(model: ModelSpec, plan: Plan, *,
                      storage_bandwidth_Bps: float = STORAGE_BANDWIDTH_BPS,
                      writer_bandwidth_Bps: float = WRITER_BANDWIDTH_BPS) -> float:
    """Seconds to write one checkpoint of ``plan``: max(state / storage bandwidth, largest
    shard / writer bandwidth) (`checkpoint_bytes`; writers write in parallel, the slowest one
    and the shared storage bound the write).

    Raises:
        PlanError: a non-positive bandwidth.
    """
    if not (storage_bandwidth_Bps > 0 and writer_bandwidth_Bps > 0):
        raise PlanError(f"storage_bandwidth_Bps={storage_bandwidth_Bps} and "
                        f"writer_bandwidth_Bps={writer_bandwidth_Bps} must be > 0")
    total, largest = checkpoint_bytes(model, plan)
    return max(total / storage_bandwidth_Bps, largest / writer_bandwidth_Bps)


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
    rows = []
    for plan_id, tokens_per_s in zip(ranked["id"], ranked["tokens_per_s"], strict=True):
        plan = result.plans[plan_id]
        write = plan_checkpoint_s(model, plan, storage_bandwidth_Bps=storage_bandwidth_Bps,
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

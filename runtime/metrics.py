"""What a run measures per step: the metrics.jsonl record, the step line and summary.json.

Units are SI and sit in the key names. ``tokens_per_s`` is global (all ranks together);
``tokens_per_s_per_device`` divides it by the world size. MFU counts model FLOPs only
(`planner.flops.mfu`: 6·N per token plus attention, PaLM appendix B)
against ``peak_flops_per_device`` of the plan file's cluster block, which the record names.
Peak memory per rank: ``torch.cuda.max_memory_allocated`` of the step on CUDA; on CPU the
process's peak resident set so far (``ru_maxrss``; ``torch.cpu`` keeps no memory statistics).
Communication time: rank 0's time inside collectives and pipeline send/recv, from the torch
profiler (only with ``--profile``; the union of gloo / nccl / c10d event intervals of the step).
Compute time per rank (``compute_time_s``, every record): each rank's part of the step before
the step's closing all-gather (`runtime.health`); summary.json keeps the per-rank medians.
"""

from __future__ import annotations

import os
import resource
import statistics

import torch

from planner.flops import mfu as model_flops_utilisation
from planner.planfile import PlanFile
from runtime.health import compute_time_medians

#: Profiler event names that are communication (collectives and P2P of gloo, nccl and c10d).
COMM_EVENT_PREFIXES = ("gloo:", "nccl:", "c10d::", "record_param_comms")


def step_record(step: int, loss: float, step_time_s: float, pf: PlanFile, *,
                peak_memory_bytes: list[int] | None = None,
                comm_time_s: float | None = None,
                compute_time_s: list[float] | None = None) -> dict:
    """One metrics.jsonl record (mfu is None without ``peak_flops_per_device`` in the cluster).

    Args:
        peak_memory_bytes: one value per rank, in rank order (see the module docstring).
        comm_time_s: rank 0's time in communication during the step, if measured.
        compute_time_s: one value per rank, in rank order: its part of the step before the
            step's closing all-gather (`runtime.health`).
    """
    tokens = pf.plan.global_batch * pf.model.seq_len
    tokens_per_s = tokens / step_time_s
    peak = pf.cluster.peak_flops_per_device
    mfu = (model_flops_utilisation(pf.model, tokens_per_s, pf.plan.world_size, peak)
           if peak else None)
    record = {"step": step, "loss": loss, "step_time_s": step_time_s,
              "tokens_per_s": tokens_per_s, "mfu": mfu}
    if peak_memory_bytes is not None:
        record |= {"tokens_per_s_per_device": tokens_per_s / pf.plan.world_size,
                   "peak_flops_per_device": peak, "device_profile": pf.cluster.name,
                   "peak_memory_bytes": peak_memory_bytes,
                   "peak_memory_bytes_max": max(peak_memory_bytes),
                   "comm_time_s": comm_time_s}
    if compute_time_s is not None:
        record["compute_time_s"] = compute_time_s
    return record


def format_step(record: dict) -> str:
    """The stable human step line, e.g. ``step: 3  loss: 5.1234  step_time_s: 0.412 ...``.

    The first five keys are always there; per-device throughput, peak memory (max over ranks)
    and communication time follow when they were measured.
    """
    mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.2f}"
    line = (f"step: {record['step']}  loss: {record['loss']:.4f}  "
            f"step_time_s: {record['step_time_s']:.3f}  "
            f"tokens_per_s: {record['tokens_per_s']:.0f}  mfu_pct: {mfu}")
    if "peak_memory_bytes_max" in record:
        line += (f"  tokens_per_s_per_device: {record['tokens_per_s_per_device']:.0f}"
                 f"  peak_memory_MiB: {record['peak_memory_bytes_max'] / 2**20:.1f}")
        if record["comm_time_s"] is not None:
            line += f"  comm_time_s: {record['comm_time_s']:.3f}"
    return line


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory (bytes): the step's CUDA peak, or the process's peak RSS."""
    if device.type == "cuda":
        value = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(value)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


def comm_time_s(events, start_us: float, end_us: float) -> float:
    """Seconds of [start_us, end_us) covered by communication events (union of intervals).

    Args:
        events: profiler events (``prof.events()``) with ``name`` and ``time_range`` (us).
    """
    spans = sorted((max(e.time_range.start, start_us), min(e.time_range.end, end_us))
                   for e in events if e.name.startswith(COMM_EVENT_PREFIXES))
    total, reach = 0.0, start_us
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            total, reach = total + hi - lo, hi
    return total * 1e-6


def summarize(records: list[dict], pf: PlanFile, backend: str, notes: list[str],
              run_dtype: str) -> dict:
    """summary.json: losses, and the median step time over the steps after the first.

    A job that trained no step (``records == []``) has None for every measured figure."""
    if not records:
        return {"plan_id": pf.plan.id, "world_size": pf.plan.world_size, "steps": 0,
                "losses": [], "final_loss": None, "step_time_s": None, "tokens_per_s": None,
                "tokens_per_s_per_device": None, "mfu": None,
                "peak_flops_per_device": pf.cluster.peak_flops_per_device,
                "device_profile": pf.cluster.name, "peak_memory_bytes": None,
                "backend": backend, "ranks": pf.plan.world_size, "cores": os.cpu_count(),
                "threads_per_rank": torch.get_num_threads(), "dtype": run_dtype,
                "notes": notes, "prediction": pf.prediction, "compute_time_s": None}
    timed = records[1:] or records
    step_time = statistics.median(r["step_time_s"] for r in timed)
    rec = step_record(len(records), records[-1]["loss"], step_time, pf,
                      peak_memory_bytes=records[-1].get("peak_memory_bytes", [0]))
    return {"plan_id": pf.plan.id, "world_size": pf.plan.world_size, "steps": len(records),
            "losses": [r["loss"] for r in records], "final_loss": records[-1]["loss"],
            "step_time_s": step_time, "tokens_per_s": rec["tokens_per_s"],
            "tokens_per_s_per_device": rec["tokens_per_s_per_device"], "mfu": rec["mfu"],
            "peak_flops_per_device": rec["peak_flops_per_device"],
            "device_profile": rec["device_profile"],
            "peak_memory_bytes": rec["peak_memory_bytes"],
            "backend": backend, "ranks": pf.plan.world_size, "cores": os.cpu_count(),
            "threads_per_rank": torch.get_num_threads(), "dtype": run_dtype,
            "notes": notes, "prediction": pf.prediction,
            "compute_time_s": compute_time_medians(records)}

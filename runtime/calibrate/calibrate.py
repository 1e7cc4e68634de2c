"""`meshplan calibrate`: microbenchmarks of this machine that mirror what training does.

Two kinds of worker groups, each started fresh with one torch thread per process, run the
microbenchmarks of `runtime.calibrate.bench`:

- compute, k processes computing at once (k = 1, 2, ..., ranks): single-thread fp32 GEMMs at
  the model's layer shapes, SDPA attention, GeLU / LayerNorm / copy throughput, and the
  runtime's own `Transformer` with 1 and 3 layers at several micro-batch sizes (forward,
  backward, both again under full and under selective recomputation, AdamW step timed
  apart; the embedding alone);
- gloo, a process group of ``ranks`` processes: all-reduce, reduce-scatter and all-gather at
  4 KiB - 16 MiB on groups of 2 and of all ranks, send/recv ping-pong, the cost of one 1F1B
  action and of one interleaved-1F1B action of ``torch.distributed.pipelining`` on trivial
  stages, and the same 1- and
  3-layer models under DTensor tensor parallelism (`runtime.parallel.tp.apply_tp`), with
  and without sequence parallelism, each also under selective recomputation, and under
  context parallelism (`runtime.parallel.cp.apply_cp`: what a cp plan runs, the key/value
  ring of `runtime.ring_attention` on the tiled kernel of `runtime.attention`, not SDPA).

Layer time = (3-layer − 1-layer time) / 2; edges (embedding + head + loss) = the rest; each as
``{tokens: seconds}``; the k processes start each timed step together and the slowest one's
step is kept (a synchronous step waits for its last rank). Collectives keep their measured
points (non-decreasing in size) and an alpha-beta fit (least squares on relative error).
The result is one YAML file (`write_profile`): a ``device`` section in the format of
``presets/devices.yaml``, ``collective`` / ``p2p`` in the format of ``presets/clusters.yaml``
(the largest world size's fit), and ``cpu_costs`` for `simulator.step.cpu_model`.

Profiles are written to ``$MESHPLAN_PROFILE_DIR``, else ``runs/profiles`` under the working
directory, as ``localhost-cpu-<UTC timestamp>.yaml``; the simulator reads one when it is given
it (`simulator.network.cpu_profile`; the command line's ``--cpu-profile`` defaults to the
newest).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import yaml

from planner.spec import ModelSpec
from runtime.calibrate import bench
from simulator.network.cpu_profile import PROFILE_PREFIX, SCHEMA, default_profile_dir, shape_key

#: Bytes per rank buffer of the timed collectives: up to 16 MiB, beyond the gradient buckets
#: DDP reduces for the calibrated models (a 13 MB one for tiny-gpt), so none is extrapolated.
COLLECTIVE_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
#: Layer counts of the timed models: layer time = (t(3) − t(1)) / 2, edges = t(1) − layer.
CALIBRATION_LAYERS = (1, 3)
#: Recomputation policies of `runtime.parallel.recompute.apply_recompute` timed for the first
#: model (besides "none"), locally and under TP.
RECOMPUTE_POLICIES = ("full", "selective")
#: Timed steps (after two warm-up steps) of the TP variants: selective recomputation and
#: sequence parallelism, with and without it.
VARIANT_ITERS = 3


# --------------------------------------------------------------------------- compute workers


def _compute_items(specs: list[ModelSpec], micro_batches: tuple[int, ...],
                   recompute_first: bool) -> list[tuple]:
    items = []
    for i in range(len(specs)):
        for mb in micro_batches:
            for layers in CALIBRATION_LAYERS:
                items.append((i, layers, mb, "none"))
                if recompute_first and i == 0:
                    items += [(i, layers, mb, rc) for rc in RECOMPUTE_POLICIES]
    return items


def _compute_worker(rank, k, specs, micro_batches, iters, recompute_first, barrier, queue):
    import torch
    torch.set_num_threads(1)
    out: dict = {"models": {}, "ops": None}
    barrier.wait()
    out["ops"] = bench.op_rates(specs[0], max(3, iters))
    for i, layers, mb, recompute in _compute_items(specs, micro_batches, recompute_first):
        barrier.wait()
        rows = bench.model_step_rows(specs[i], layers, mb, iters, recompute=recompute,
                                     barrier=barrier.wait)
        out["models"][(i, layers, mb, recompute)] = rows
        if rank == 0:
            queue.put(("tick", f"k={k} {specs[i].name} L{layers} mb{mb} {recompute}"))
    for i, spec in enumerate(specs):
        for mb in micro_batches:
            out["models"][(i, "emb", mb)] = bench.embedding_times(spec, mb, iters)
    queue.put(("result", rank, out))


# --------------------------------------------------------------------------- gloo workers


def _fit_alpha_beta(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares of ``t = alpha + s / B`` on relative error over ``(size, seconds)``.

    >>> fit = _fit_alpha_beta([(1e3, 1e-3 + 1e3 / 1e9), (1e6, 1e-3 + 1e6 / 1e9)])
    >>> round(fit["latency_s"], 6), round(fit["bandwidth_Bps"] / 1e9, 3)
    (0.001, 1.0)
    """
    # weights 1/t: minimise sum(((alpha + s·c) - t) / t)^2 with c = 1/B
    a11 = sum(1 / t**2 for _, t in points)
    a12 = sum(s / t**2 for s, t in points)
    a22 = sum(s * s / t**2 for s, t in points)
    b1 = sum(1 / t for _, t in points)
    b2 = sum(s / t for s, t in points)
    det = a11 * a22 - a12 * a12
    alpha = (b1 * a22 - b2 * a12) / det
    c = (a11 * b2 - a12 * b1) / det
    if c <= 0 or alpha < 0:        # degenerate (noise): fall back to the end points
        (s0, t0), (s1, t1) = min(points), max(points)
        c = max((t1 - t0) / (s1 - s0), 1e-12)
        alpha = max(0.0, t0 - c * s0)
    return {"latency_s": float(alpha), "bandwidth_Bps": float(1 / c)}


def _collective_fit(points: list[tuple[float, float]]) -> dict:
    """The alpha-beta fit of ``(size, seconds)`` plus the measured ``points`` themselves
    (``{bytes: seconds}``, made non-decreasing by `_points`), which `simulator.step.cpu_model`
    interpolates (`simulator.step.cpu_model.at_size`).

    >>> _collective_fit([(4096, 0.007), (2**20, 0.003), (16 * 2**20, 0.029)])["points"]
    {4096: 0.005, 1048576: 0.005, 16777216: 0.029}
    """
    return _fit_alpha_beta(points) | {"points": _points({int(s): t for s, t in points})}


def _slowest_rank(per_rank: list[list[tuple[float, ...]]]) -> dict[str, float]:
    """Median ``fwd`` / ``bwd`` / ``opt`` seconds of the slowest process of each step:
    per step the process with the largest total, then the median over steps of its phases.

    >>> _slowest_rank([[(1, 2, 1), (1, 1, 1)], [(2, 2, 1), (1, 1, 0)]])
    {'fwd': 1.5, 'bwd': 1.5, 'opt': 1.0}
    """
    steps = [max(rows, key=sum) for rows in zip(*per_rank, strict=True)]
    return {k: float(statistics.median(s[j] for s in steps))
            for j, k in enumerate(("fwd", "bwd", "opt"))}


def _dist_worker(rank, world, port, specs, tp_micro_batches, iters, queue):
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out: dict = {"collectives": {}, "p2p": [], "tp": {}, "tp_sp": {}, "cp": {}, "fsdp": {},
                 "tp_dp": {}}
    groups = {world: None}
    if world > 2:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        groups[2] = pairs[rank // 2]
    for op in COLLECTIVES:
        for n, group in groups.items():
            pts = [(float(s), bench.time_collective(dist, op, s, group, iters)) for s in
                   COLLECTIVE_SIZES]
            out["collectives"][(op, n)] = pts
        if rank == 0:
            queue.put(("tick", f"ws={world} {op}"))
    out["p2p"] = [(float(s), bench.time_p2p(dist, s, iters)) for s in COLLECTIVE_SIZES]
    out["pipeline_action_s"] = bench.time_pipeline_action(dist, world, 2 * world, iters, 8, 8)
    out["pipeline_action_interleaved_s"] = bench.time_pipeline_action(
        dist, world, 2 * world, iters, 8, 8, virtual_stages=2)
    if rank == 0:
        queue.put(("tick", f"ws={world} send/recv"))
    spec = specs[0]
    variant_iters = min(iters, VARIANT_ITERS)
    for n in sorted(groups):
        mesh = init_device_mesh("cpu", (world // n, n), mesh_dim_names=("dp", "tp"))
        for mb in tp_micro_batches:
            for layers in CALIBRATION_LAYERS:
                for rc in ("none", "selective"):
                    # the variants with fewer timed steps (`VARIANT_ITERS`): calibration
                    # stays under 3 minutes on 2 cores
                    out["tp"][(n, layers, mb, rc)] = bench.model_step_times(
                        spec, layers, mb, iters if rc == "none" else variant_iters,
                        recompute=rc, tp_mesh=mesh["tp"], barrier=dist.barrier)
                    # sequence parallelism (norms on (B, T/tp, h), reduce-scatter +
                    # all-gather instead of all-reduce)
                    out["tp_sp"][(n, layers, mb, rc)] = bench.model_step_times(
                        spec, layers, mb, variant_iters, recompute=rc, tp_mesh=mesh["tp"],
                        sequence_parallel=True, barrier=dist.barrier)
                if rank == 0:
                    queue.put(("tick", f"ws={world} tp{n} L{layers} mb{mb}"))
        # context parallelism over groups of n: the ring on the tiled kernel, not SDPA
        mesh = init_device_mesh("cpu", (world // n, n), mesh_dim_names=("dp", "cp"))
        for mb in tp_micro_batches:
            for layers in CALIBRATION_LAYERS:
                out["cp"][(n, layers, mb, "none")] = bench.model_step_times(
                    spec, layers, mb, iters, cp_mesh=mesh["cp"], barrier=dist.barrier)
            if rank == 0:
                queue.put(("tick", f"ws={world} cp{n} mb{mb}"))
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for mb in tp_micro_batches:                       # ZeRO-3 over all ranks
        for layers in CALIBRATION_LAYERS:
            out["fsdp"][(world, layers, mb)] = bench.model_step_times(
                spec, layers, mb, iters, dp_mesh=dp_mesh, barrier=dist.barrier)
            if rank == 0:
                queue.put(("tick", f"ws={world} zero3 L{layers} mb{mb}"))
    if world > 2:                                     # TP x DP: TP groups of 2 under FSDP2
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for mb in tp_micro_batches:
            for layers in CALIBRATION_LAYERS:
                out["tp_dp"][(world // 2, layers, mb)] = bench.model_step_times(
                    spec, layers, mb, iters, tp_mesh=mesh["tp"], dp_mesh=mesh["dp"],
                    zero_stage=0, barrier=dist.barrier)
                if rank == 0:
                    queue.put(("tick", f"ws={world} tp2 x dp{world // 2} L{layers} mb{mb}"))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(("result", rank, out))


# --------------------------------------------------------------------------- orchestration


def _run_group(target, nproc: int, args: tuple, total_ticks: int, progress) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args(r), queue), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    expected = nproc if target is _compute_worker else 1
    while len(results) < expected:
        msg = queue.get(timeout=600)
        if msg[0] == "tick":
            progress(msg[1], 1.0 / total_ticks)
        else:
            results[msg[1]] = msg[2]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode not in (0, None):
            raise RuntimeError(f"calibration worker exited with status {p.exitcode}")
    return [results[r] for r in sorted(results)]


def _points(rows: dict[int, float]) -> dict[int, float]:
    """``{tokens: seconds}`` made non-decreasing in tokens (a micro-batch with more tokens
    cannot take less time; a dip is measurement noise) by isotonic regression (pool adjacent
    violators: a decreasing run is replaced by its mean).

    >>> _points({1024: 0.03, 128: 0.012, 256: 0.008})
    {128: 0.01, 256: 0.01, 1024: 0.03}
    """
    blocks: list[list[float]] = []                 # [sum, count] per pooled block
    keys = sorted(rows)
    for t in keys:
        blocks.append([float(rows[t]), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return {int(t): round(v, 9) for t, v in zip(keys, values, strict=True)}


def _terms_from_models(spec: ModelSpec, timings: dict, micro_batches, *, emb=None,
                       key=lambda layers, mb, rc: (layers, mb, rc)) -> dict:
    """Layer / edge / optimizer terms ``{tokens: s}`` from 1- and 3-layer model timings.

    ``timings`` maps ``key(layers, micro_batch, recompute)`` to ``{"fwd", "bwd", "opt"}``
    seconds. ``layer_bwd_full`` comes from the "full" timings (else forward + backward);
    ``layer_fwd_selective`` / ``layer_bwd_selective`` only when "selective" ones exist."""
    terms: dict = {n: {} for n in ("layer_fwd", "layer_bwd", "layer_bwd_full", "edge_fwd",
                                   "edge_bwd", "emb_fwd", "emb_bwd")}
    opt_layer, opt_edge = [], []
    for mb in micro_batches:
        tokens = mb * spec.seq_len
        lo, hi = CALIBRATION_LAYERS
        one, many = timings[key(lo, mb, "none")], timings[key(hi, mb, "none")]
        for ph in ("fwd", "bwd"):
            layer = max(0.0, (many[ph] - one[ph]) / (hi - lo))
            terms[f"layer_{ph}"][tokens] = layer
            terms[f"edge_{ph}"][tokens] = max(0.0, one[ph] - lo * layer)
        full = (timings.get(key(lo, mb, "full")), timings.get(key(hi, mb, "full")))
        terms["layer_bwd_full"][tokens] = (max(0.0, (full[1]["bwd"] - full[0]["bwd"]) / (hi - lo))
                                           if full[0] else terms["layer_bwd"][tokens]
                                           + terms["layer_fwd"][tokens])
        sel = (timings.get(key(lo, mb, "selective")), timings.get(key(hi, mb, "selective")))
        if sel[0] and sel[1]:
            # selective recomputation changes the forward too: every op of the block runs
            # under the checkpoint's dispatch mode, which decides what is saved
            for ph in ("fwd", "bwd"):
                terms.setdefault(f"layer_{ph}_selective", {})[tokens] = max(
                    0.0, (sel[1][ph] - sel[0][ph]) / (hi - lo))
        if emb is not None:
            terms["emb_fwd"][tokens] = emb[mb]["fwd"]
            terms["emb_bwd"][tokens] = emb[mb]["bwd"]
        opt_layer.append(max(0.0, (many["opt"] - one["opt"]) / (hi - lo)))
        opt_edge.append(max(0.0, one["opt"] - lo * opt_layer[-1]))
    out = {k: _points(v) for k, v in terms.items() if v}
    out["opt_layer_s"] = float(statistics.median(opt_layer))
    out["opt_edge_s"] = float(statistics.median(opt_edge))
    return out


def calibrate(specs: list[ModelSpec], *, ranks: int = 4, micro_batches: tuple[int, ...] = (1, 2, 8),
              tp_micro_batches: tuple[int, ...] = (2, 8), iters: int = 5,
              progress: Callable[[str, float], None] | None = None) -> dict:
    """Measure this machine for ``specs`` (the first one also under TP and recomputation);
    return the profile mapping `write_profile` saves.

    Args:
        ranks: the most processes to measure at once (compute: 1, 2, 4, ... up to it; gloo:
            world sizes 2, 4, ... up to it).
        micro_batches / tp_micro_batches: sizes the layer times are measured at.
        iters: timed iterations per benchmark (after warm-up).
        progress: called with (what finished, fraction of the whole run).
    """
    progress = progress or (lambda what, frac: None)
    levels = sorted({1, *[2**i for i in range(1, 8) if 2**i <= ranks], ranks})
    worlds = [w for w in levels if w >= 2]
    n_compute = len(_compute_items(specs, micro_batches, True))
    ticks = len(levels) * n_compute + sum(
        len(COLLECTIVES) + 1 + 2 * len(tp_micro_batches) * (2 + 2 * (w > 2))
        + len(tp_micro_batches) * (1 + (w > 2)) for w in worlds)
    compute: dict = {shape_key(s): {"local": {}, "tp": {}} for s in specs}
    ops_by_k = {}
    start = time.perf_counter()
    for k in levels:
        barrier = mp.get_context("spawn").Barrier(k)
        res = _run_group(_compute_worker, k, lambda r, k=k, barrier=barrier: (
            k, specs, micro_batches, iters, True, barrier), ticks, progress)
        # the slowest rank sets the pace of a synchronous step (the embedding alone: the
        # mean of the ranks' medians)
        merged = {key: (_slowest_rank([r["models"][key] for r in res]) if key[1] != "emb"
                        else {ph: statistics.mean(r["models"][key][ph] for r in res)
                              for ph in res[0]["models"][key]})
                  for key in res[0]["models"]}
        ops_by_k[k] = {name: statistics.mean(r["ops"][name] for r in res)
                       for name in res[0]["ops"]}
        for i, spec in enumerate(specs):
            emb = {mb: merged[(i, "emb", mb)] for mb in micro_batches}
            compute[shape_key(spec)]["local"][k] = _terms_from_models(
                spec, merged, micro_batches, emb=emb,
                key=lambda layers, mb, rc, i=i: (i, layers, mb, rc))
    collectives: dict = {}
    from runtime.launch import free_port
    for world in worlds:
        port = free_port()
        res = _run_group(_dist_worker, world, lambda r, world=world, port=port: (
            world, port, specs, tp_micro_batches, iters), ticks, progress)[0]
        fits: dict = {op: {} for op in COLLECTIVES}
        for (op, n), pts in res["collectives"].items():
            fits[op][f"n{n}"] = _collective_fit(pts)
        fits["p2p"] = _collective_fit(res["p2p"])
        fits["pipeline_action_s"] = float(res["pipeline_action_s"])
        fits["pipeline_action_interleaved_s"] = float(res["pipeline_action_interleaved_s"])
        collectives[world] = fits
        spec = specs[0]
        for n in sorted({n for n, *_ in res["tp"]}):
            timings = {(layers, mb, rc): v for (m, layers, mb, rc), v in res["tp"].items()
                       if m == n}
            compute[shape_key(spec)]["tp"].setdefault(f"tp{n}", {})[world] = \
                _terms_from_models(spec, timings, tp_micro_batches)
            timings = {(layers, mb, rc): v for (m, layers, mb, rc), v in res["tp_sp"].items()
                       if m == n}
            compute[shape_key(spec)].setdefault("tp_sp", {}).setdefault(f"tp{n}", {})[
                world] = _terms_from_models(spec, timings, tp_micro_batches)
            timings = {(layers, mb, rc): v for (m, layers, mb, rc), v in res["cp"].items()
                       if m == n}
            compute[shape_key(spec)].setdefault("cp", {}).setdefault(f"cp{n}", {})[
                world] = _terms_from_models(spec, timings, tp_micro_batches)
        timings = {(layers, mb, "none"): v for (_, layers, mb), v in res["fsdp"].items()}
        compute[shape_key(spec)].setdefault("zero3", {}).setdefault(f"dp{world}", {})[world] = \
            _terms_from_models(spec, timings, tp_micro_batches)
        if res["tp_dp"]:
            timings = {(layers, mb, "none"): v for (_, layers, mb), v in res["tp_dp"].items()}
            compute[shape_key(spec)].setdefault("tp_dp", {})[f"tp2-dp{world // 2}"] = {
                world: _terms_from_models(spec, timings, tp_micro_batches)}
    return _profile_mapping(specs, compute, collectives, ops_by_k, ranks, iters,
                            time.perf_counter() - start)


def _profile_mapping(specs, compute, collectives, ops_by_k, ranks, iters, seconds) -> dict:
    import torch

    from runtime.calibrate.probe import _total_memory_bytes
    cores = os.cpu_count() or 1
    one = ops_by_k[1]
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    cpu = platform.processor() or platform.machine()
    device = {"peak_flops": {"fp32": float(one["gemm_best_flops"])},
              "memory_bytes": float(_total_memory_bytes() / cores),
              "memory_bandwidth_Bps": float(one["copy_Bps"]),
              "matmul_efficiency": float(min(1.0, one["gemm_mean_flops"]
                                             / one["gemm_best_flops"])),
              "memory_efficiency": 1.0,
              "source": f"meshplan calibrate on {cpu}, torch {torch.__version__}, 1 thread, "
                        f"{stamp} UTC"}
    top = collectives[max(collectives)] if collectives else None
    return {
        "schema": SCHEMA, "created_utc": stamp, "threads_per_rank": 1,
        "machine": {"cores": cores, "processor": cpu, "torch": torch.__version__,
                    "python": platform.python_version()},
        "calibration": {"ranks": ranks, "iters": iters, "seconds": round(seconds, 1),
                        "models": [s.name for s in specs]},
        "device": {f"localhost-cpu-core-{stamp}": device},
        **({"collective": {"latency_s": top["all_reduce"][f"n{max(collectives)}"]["latency_s"],
                           "bandwidth_Bps": top["all_reduce"][f"n{max(collectives)}"][
                               "bandwidth_Bps"]},
            "p2p": {k: top["p2p"][k] for k in ("latency_s", "bandwidth_Bps")}} if top else {}),
        "ops": {int(k): {n: float(v) for n, v in ops.items()} for k, ops in ops_by_k.items()},
        "cpu_costs": {"compute": compute,
                      "collectives": {int(w): c for w, c in collectives.items()}},
    }


def write_profile(mapping: dict, path: str | os.PathLike | None = None) -> Path:
    """Save a calibration; default path ``default_profile_dir()/localhost-cpu-<created_utc>.yaml``
    (`simulator.network.cpu_profile`)."""
    path = Path(path) if path else (default_profile_dir()
                                    / f"{PROFILE_PREFIX}{mapping['created_utc']}.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_plain(mapping), sort_keys=False), encoding="utf-8")
    return path


def _plain(value):
    # YAML-safe builtins (torch's version string and numpy scalars are subclasses).
    if isinstance(value, dict):
        return {(_plain(k) if isinstance(k, (int, float)) else str(k)): _plain(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value) if isinstance(value, str) else value

"""A calibrated localhost-cpu profile as the simulator reads it: a plain data class and its
reader (no torch). `runtime.calibrate` measures the machine and writes the file; a cluster is
given the profile explicitly (`simulator.network.cluster.load_cluster`'s ``cpu_profile``), never
by looking around the working directory.

A profile is one YAML file: a ``device`` section in the format of ``presets/devices.yaml``,
``collective`` / ``p2p`` in the format of ``presets/clusters.yaml``, and ``cpu_costs`` for
`simulator.step.cpu_model`. By convention `meshplan calibrate` writes them as
``localhost-cpu-<UTC timestamp>.yaml`` into `default_profile_dir` (``$MESHPLAN_PROFILE_DIR``,
else ``runs/profiles``), and the command line's ``--cpu-profile`` defaults to the newest there
(`newest_profile`), saying so in every prediction's assumptions.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from planner.spec import ModelSpec, PlanError
from simulator.network.hardware import DeviceProfile

SCHEMA = "meshplan-cpu-profile/1"
PROFILE_PREFIX = "localhost-cpu-"
#: Environment variable naming the command line's default profile folder.
PROFILE_DIR_ENV = "MESHPLAN_PROFILE_DIR"
DEFAULT_PROFILE_DIR = Path("runs") / "profiles"


def default_profile_dir() -> Path:
    """The command line's profile folder: ``$MESHPLAN_PROFILE_DIR``, else ``runs/profiles``
    (relative to the working directory). Only the command line calls this; the simulator is
    always given its profile."""
    return Path(os.environ.get(PROFILE_DIR_ENV) or DEFAULT_PROFILE_DIR)


def newest_profile(directory: str | os.PathLike) -> Path | None:
    """The newest ``localhost-cpu-*.yaml`` in ``directory`` (by its timestamp name), or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    files = sorted(directory.glob(f"{PROFILE_PREFIX}*.yaml"))
    return files[-1] if files else None


def shape_key(model: ModelSpec) -> str:
    """The calibrated-shape key of a model: every field but the layer count and name.

    >>> from planner.presets import load_model
    >>> shape_key(load_model("tiny-gpt"))
    'h256-a4-kv4-f1024-v256-s128-gelu-layernorm-untied'
    """
    tied = "tied" if model.tied_embeddings else "untied"
    return (f"h{model.hidden}-a{model.num_heads}-kv{model.num_kv_heads}-f{model.ffn_hidden}"
            f"-v{model.vocab_size}-s{model.seq_len}-{model.activation}-{model.norm}-{tied}")


def alpha_beta_s(fit: dict, size_bytes: float) -> float:
    """Alpha-beta time of one call: ``latency_s + size_bytes / bandwidth_Bps``."""
    return fit["latency_s"] + size_bytes / fit["bandwidth_Bps"]


def at_size(points: dict, size_bytes: float) -> float:
    """Seconds of one collective call of ``size_bytes`` from measured ``{bytes: seconds}``
    (non-decreasing in size, as `runtime.calibrate.calibrate` stores them): piecewise linear between
    the points, the smallest point's time below it (latency-bound), linear beyond the largest
    (through the two largest points).

    Measured points, not an alpha-beta fit, because with more ranks than cores a gloo
    collective is not ``alpha + s / B``: a 4 KiB all-reduce over 4 ranks on 2 cores takes about
    7 ms (every ring hop waits for a core), 1 MiB about the same, 16 MiB about 29 ms; a least
    squares alpha-beta line through 4 KiB - 4 MiB predicted 9 ms for a 13 MB gradient
    all-reduce measured at 25 ms.

    >>> at_size({4096: 0.007, 2**20: 0.007, 16 * 2**20: 0.029}, 64)
    0.007
    >>> round(at_size({4096: 0.007, 2**20: 0.007, 16 * 2**20: 0.029}, 8.5 * 2**20), 6)
    0.018
    """
    pts = sorted((float(s), float(v)) for s, v in points.items())
    if size_bytes <= pts[0][0] or len(pts) == 1:
        return pts[0][1] if size_bytes <= pts[0][0] else pts[0][1] * size_bytes / pts[0][0]
    if size_bytes >= pts[-1][0]:
        (s0, v0), (s1, v1) = pts[-2], pts[-1]
    else:
        (s0, v0), (s1, v1) = next((a, b) for a, b in itertools.pairwise(pts)
                                  if size_bytes <= b[0])
    return max(0.0, v0 + (v1 - v0) * (size_bytes - s0) / (s1 - s0))


@dataclass(frozen=True, kw_only=True)
class CpuProfile:
    """A calibrated localhost-cpu profile (one YAML file written by `runtime.calibrate.calibrate`).

    Attributes:
        name: profile name (the file stem, e.g. ``localhost-cpu-20261201T203000``).
        path: the file it was read from ('' when built in memory).
        cores: CPU cores of the machine it was measured on.
        threads_per_rank: torch threads per rank during the measurements.
        device: the one-core `DeviceProfile` (same format as the GPU presets).
        compute: per model shape (`shape_key`): ``{"local": {k: terms}, "tp": {"tp{n}":
            {world: terms}}}``; terms hold ``layer_fwd``, ``layer_bwd``, ``layer_bwd_full``,
            ``edge_fwd``, ``edge_bwd``, ``emb_fwd``, ``emb_bwd`` as ``{tokens: seconds}`` per
            micro-batch, and ``opt_layer_s``, ``opt_edge_s`` (seconds per step).
        collectives: per world size ``{op: {"n{group}": {latency_s, bandwidth_Bps,
            points}}}`` for all_reduce / reduce_scatter / all_gather (``points``: measured
            ``{bytes: seconds}``, non-decreasing), and ``p2p`` (one-way send/recv).
    """

    name: str
    path: str = ""
    cores: int
    threads_per_rank: int = 1
    device: DeviceProfile
    compute: dict = field(hash=False)
    collectives: dict = field(hash=False)

    def covers(self, model: ModelSpec) -> bool:
        """Whether ``model``'s layer shapes were calibrated."""
        return shape_key(model) in self.compute

    def collective(self, op: str, world: int, group: int) -> dict:
        """The alpha-beta fit of ``op`` on ``group`` ranks while ``world`` ranks run: the
        measured world size nearest above (else the largest), the group size nearest."""
        worlds = sorted(int(w) for w in self.collectives)
        w = next((x for x in worlds if x >= world), worlds[-1])
        fits = self.collectives[w][op]
        if op == "p2p":
            return fits
        groups = sorted(int(k[1:]) for k in fits)
        g = min(groups, key=lambda n: (abs(n - group), -n))
        return fits[f"n{g}"]

    def pipeline_action_s(self, world: int, virtual_stages: int = 1) -> float:
        """Seconds of schedule + send/recv cost of one pipeline action (one forward or
        backward of one chunk) with ``world`` ranks running: of ``Schedule1F1B``, or with
        ``virtual_stages`` > 1 of ``ScheduleInterleaved1F1B`` (measured with 2 chunks per
        rank; the 1F1B figure for profiles that lack it); 0 when the profile has neither."""
        worlds = sorted(int(w) for w in self.collectives)
        w = next((x for x in worlds if x >= world), worlds[-1])
        plain = float(self.collectives[w].get("pipeline_action_s", 0.0))
        if virtual_stages > 1:
            return float(self.collectives[w].get("pipeline_action_interleaved_s", plain))
        return plain

    def collective_s(self, op: str, size_bytes: float, world: int, group: int) -> float:
        """Seconds of one ``op`` call of ``size_bytes`` (per rank buffer); 0 for one rank.

        From the measured points (`at_size`) when the profile has them, else from the
        alpha-beta fit (profiles written before the points were kept)."""
        if group <= 1 or size_bytes <= 0:
            return 0.0
        fit = self.collective(op, world, group)
        return at_size(fit["points"], size_bytes) if fit.get("points") else alpha_beta_s(
            fit, size_bytes)


def read_profile(path: str | os.PathLike) -> CpuProfile:
    """The `CpuProfile` in a YAML file written by `runtime.calibrate.calibrate.write_profile`
    (cached per file and modification time).

    Raises:
        PlanError: the file is missing or is not a profile (the message names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"cpu profile {str(path)!r} does not exist; measure this machine with "
                        f"`meshplan calibrate`, or pass another --cpu-profile")
    return _read_cached(str(path.resolve()), path.stat().st_mtime)


@lru_cache(maxsize=8)
def _read_cached(path: str, mtime: float) -> CpuProfile:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        (name, dev), = data["device"].items()
        dev = dict(dev)
        dev["peak_flops"] = {k: float(v) for k, v in dev["peak_flops"].items()}
        costs = data["cpu_costs"]
        return CpuProfile(name=Path(path).stem, path=path, cores=int(data["machine"]["cores"]),
                          threads_per_rank=int(data["threads_per_rank"]),
                          device=DeviceProfile(name=name, **dev),
                          compute=costs["compute"], collectives=costs["collectives"])
    except (yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PlanError(f"cpu profile {path!r} is not a meshplan profile ({exc!r}); write one "
                        f"with `meshplan calibrate`") from None

"""Device hardware profiles: peak FLOP/s per dtype, memory and achieved efficiencies.

Profiles for real devices live in ``simulator/presets/devices.yaml``, every number with its
source; a measured CPU profile comes from `runtime.calibrate.probe.measure_cpu_profile`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

import yaml

from planner.spec import PlanError
from simulator import PRESET_DIR


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One accelerator (or one CPU core) as the simulator sees it.

    Attributes:
        name: device name, e.g. ``"h100-sxm-80gb"``.
        peak_flops: dense FLOP/s per dtype key ('fp32', 'tf32', 'bf16', 'fp16', 'fp8').
        memory_bytes: device memory in bytes (SI, as the vendor states it).
        memory_bandwidth_Bps: peak memory bandwidth in bytes/s.
        matmul_efficiency: achieved fraction of peak FLOP/s for large GEMMs (0, 1].
        memory_efficiency: achieved fraction of memory bandwidth for streaming kernels (0, 1].
        nvlink_bandwidth_Bps: NVLink bandwidth per GPU per direction; None without NVLink.
        sm_count: streaming multiprocessors the GPU enables; a communication kernel that
            holds some of them slows the compute that runs beside it
            (`simulator.step.moe.overlapped_exposed_s`). None: not known (no such slowdown).
        source: where the numbers come from.
    """

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    memory_bytes: float
    memory_bandwidth_Bps: float
    matmul_efficiency: float
    memory_efficiency: float
    nvlink_bandwidth_Bps: float | None = None
    sm_count: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not self.peak_flops or any(not isinstance(v, (int, float)) or v <= 0
                                      for v in self.peak_flops.values()):
            raise PlanError(f"peak_flops={self.peak_flops!r} must map dtypes to positive FLOP/s")
        for name in ("memory_bytes", "memory_bandwidth_Bps", "matmul_efficiency",
                     "memory_efficiency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PlanError(f"{name}={value!r} must be a number (write 1.0e+9, not 1.0e9, "
                                f"in YAML)")
        nvlink = self.nvlink_bandwidth_Bps
        if nvlink is not None and (isinstance(nvlink, bool) or not isinstance(nvlink, (int, float))
                                   or nvlink <= 0):
            raise PlanError(f"nvlink_bandwidth_Bps={nvlink!r} must be a positive number or "
                            f"absent")
        sms = self.sm_count
        if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms <= 0):
            raise PlanError(f"sm_count={sms!r} must be a positive integer or absent")
        for name in ("memory_bytes", "memory_bandwidth_Bps"):
            if getattr(self, name) <= 0:
                raise PlanError(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("matmul_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise PlanError(f"{name}={value!r} must be in (0, 1]")

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``.

        Raises:
            PlanError: the profile has no figure for ``dtype``.
        """
        if dtype not in self.peak_flops:
            raise PlanError(f"device {self.name!r} has no peak FLOP/s for dtype={dtype!r}; "
                            f"it has {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]

    def replace(self, **changes: object) -> DeviceProfile:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@lru_cache(maxsize=1)
def _device_presets() -> dict[str, dict]:
    with open(PRESET_DIR / "devices.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def device_names() -> list[str]:
    """Names of the device presets, e.g. ``['a100-sxm-80gb', 'h100-sxm-80gb', ...]``."""
    return sorted(_device_presets())


def load_device(name: str) -> DeviceProfile:
    """A device preset by name.

    Raises:
        PlanError: ``name`` is not a preset.

    >>> d = load_device("h100-sxm-80gb")
    >>> d.peak("bf16") / 1e12, d.memory_bytes / 1e9  # the datasheet's dense BF16 and 80 GB
    (989.0, 80.0)
    """
    presets = _device_presets()
    if name not in presets:
        raise PlanError(f"device={name!r} is not one of {device_names()}")
    data = dict(presets[name])
    data["peak_flops"] = {k: float(v) for k, v in data["peak_flops"].items()}
    return DeviceProfile(name=name, **data)

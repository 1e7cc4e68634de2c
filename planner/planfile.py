"""Plan files: the versioned YAML that carries a chosen plan from the planner to the runtime.

A plan file holds everything the runtime needs and everything `compare` needs to line the run up
with its prediction::

    schema_version: 1
    meshplan_version: 0.1.0
    model: {name: tiny-gpt, num_layers: 4, ...}      # ModelSpec fields
    plan: {tp: 1, pp: 2, dp: 1, ...}                  # Plan fields
    cluster: {name: localhost-cpu, nodes: 1, ranks: 2, peak_flops_per_device: 3.1e10,
              cpu_profile: runs/profiles/localhost-cpu-20261201T203000.yaml}
    prediction: {step_time_s: 0.41, tokens_per_s: ..., mfu: ..., ...}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from planner import __version__
from planner.presets import model_from_dict
from planner.spec import ModelSpec, Plan, PlanError, check_plan, unknown_fields_message
from planner.userfile import read_yaml

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class ClusterRef:
    """The plan file's ``cluster`` block: which cluster the plan was made for.

    Attributes:
        name: a cluster preset ('dgx-h100', 'localhost-cpu', ...) or a cluster file's stem.
        nodes: servers of a GPU cluster (1 on localhost).
        ranks: processes of a localhost cluster (None on GPU clusters: nodes say it).
        path: the cluster YAML file the plan was made with (None for a preset).
        cpu_profile: the calibrated profile a localhost plan was predicted with (None: the
            preset's generic costs).
        peak_flops_per_device: dense FLOP/s of one device at the plan's dtype; the runtime
            reports MFU against it.
        spec: the cluster file's contents (None for a preset), so the plan simulates and
            launches where that file is not.
    """

    name: str
    nodes: int = 1
    ranks: int | None = None
    path: str | None = None
    cpu_profile: str | None = None
    peak_flops_per_device: float | None = None
    spec: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"cluster name={self.name!r} must be a non-empty string")
        for name in ("nodes", "ranks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise PlanError(f"cluster {name}={value!r} must be a positive integer")
        peak = self.peak_flops_per_device
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float))
                                 or not peak > 0):
            raise PlanError(f"cluster peak_flops_per_device={peak!r} must be a number > 0 "
                            f"(FLOP/s of one device), or absent")
        if self.spec is not None and not isinstance(self.spec, dict):
            raise PlanError(f"cluster spec must be a mapping (a cluster file's contents), got "
                            f"{type(self.spec).__name__}")

    @property
    def is_localhost(self) -> bool:
        """Ranks on this machine (the localhost-cpu preset or a ``kind: localhost`` file)."""
        return self.ranks is not None or self.name == "localhost-cpu"

    def to_dict(self) -> dict:
        """The YAML-ready mapping (unset fields left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: object) -> ClusterRef:
        """The block of a plan file; unknown keys are named with the known ones.

        Raises:
            PlanError: not a mapping, no name, an unknown key or an illegal value.
        """
        if not isinstance(data, dict):
            raise PlanError(f"cluster must be a mapping, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        # plan files of meshplan 0.1 also wrote num_devices, which the plan's world size says
        data = {k: v for k, v in data.items() if k != "num_devices"}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise PlanError(unknown_fields_message("cluster", unknown, known))
        if "name" not in data:
            raise PlanError("cluster needs a 'name' (a preset or a cluster file's stem)")
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class PlanFile:
    """The contents of a plan file.

    Attributes:
        model: the model spec.
        plan: the plan.
        cluster: the cluster the plan was made for (`ClusterRef`).
        prediction: the simulator's prediction the plan was chosen with (SI units).
        meshplan_version: version that wrote the file.
    """

    model: ModelSpec
    plan: Plan
    cluster: ClusterRef
    prediction: dict = field(default_factory=dict)
    meshplan_version: str = __version__

    def to_dict(self) -> dict:
        """The YAML-ready mapping (tuples become lists)."""
        plan = dataclasses.asdict(self.plan)
        plan["placement"] = list(plan["placement"])
        if plan["stage_layers"] is not None:
            plan["stage_layers"] = list(plan["stage_layers"])
        return {
            "schema_version": SCHEMA_VERSION,
            "meshplan_version": self.meshplan_version,
            "model": dataclasses.asdict(self.model),
            "plan": plan,
            "cluster": self.cluster.to_dict(),
            "prediction": dict(self.prediction),
        }


def plan_from_dict(fields: dict) -> Plan:
    """Build a `Plan` from a mapping, naming unknown or missing keys.

    Raises:
        PlanError: unknown or missing keys, or an illegal value.
    """
    if not isinstance(fields, dict):
        raise PlanError(f"plan must be a mapping of Plan fields, got {type(fields).__name__}")
    known = {f.name: f for f in dataclasses.fields(Plan)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise PlanError(unknown_fields_message("plan", unknown, known))
    missing = [n for n, f in known.items() if n not in fields and f.default is dataclasses.MISSING]
    if missing:
        raise PlanError(f"plan is missing field(s) {missing}")
    data = dict(fields)
    if "placement" in data:
        data["placement"] = tuple(data["placement"])
    if data.get("stage_layers") is not None:
        data["stage_layers"] = tuple(data["stage_layers"])
    return Plan(**data)


def check_runnable(plan: Plan) -> None:
    """Raise `PlanError` when the runtime cannot execute ``plan``: every plan `check_plan`
    accepts runs, context parallelism included (ring attention, `runtime.parallel.cp`), except
    the ZB-H2 schedule; `meshplan run`, `meshplan launch` and the app call this one place so
    that such a plan is refused before any worker starts."""
    if plan.schedule == "zb-h2":
        raise PlanError(f"plan {plan.id} has schedule='zb-h2': torch.distributed.pipelining "
                        f"has no ZB-H2 schedule, so the runtime does not execute it; use "
                        f"schedule='zb-v' or 'zb-h1'")


#: The top-level keys of a plan file (`PlanFile.to_dict`); any other is refused on reading.
TOP_LEVEL_KEYS = ("schema_version", "meshplan_version", "model", "plan", "cluster",
                  "prediction")


def write_plan_file(path: str | Path, plan_file: PlanFile) -> Path:
    """Write ``plan_file`` as YAML to ``path`` (parent folders created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(plan_file.to_dict(), sort_keys=False), encoding="utf-8")
    tmp.replace(path)
    return path


def read_plan_file(path: str | Path) -> PlanFile:
    """Read and validate a plan file.

    Raises:
        PlanError: the file is missing, is not YAML, has another schema version, or holds an
            invalid model or plan.
    """
    path = Path(path)
    if not path.exists():
        raise PlanError(f"plan file {str(path)!r} does not exist; write one with "
                        f"`meshplan plan ... --out {path}`")
    data = read_yaml(path, "plan")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanError(f"plan file {path}: schema_version={version!r} is not supported; "
                        f"this meshplan reads schema_version {SCHEMA_VERSION}")
    unknown = sorted(set(data) - set(TOP_LEVEL_KEYS), key=str)
    if unknown:
        raise PlanError(f"plan file {path}: "
                        + unknown_fields_message("top-level", map(str, unknown), TOP_LEVEL_KEYS)
                        + "; remove or rename it")
    for key in ("model", "plan", "cluster"):
        if not isinstance(data.get(key), dict):
            raise PlanError(f"plan file {path} has no '{key}' mapping")
    model_fields = dict(data["model"])
    try:  # each error names the file and the section it is in
        section = "model"
        model = model_from_dict(model_fields, name=model_fields.pop("name", "custom"))
        section = "plan"
        plan = plan_from_dict(data["plan"])
        check_plan(model, plan)
        section = "cluster"
        cluster = ClusterRef.from_dict(data["cluster"])
    except PlanError as exc:
        raise PlanError(f"plan file {path}, {section}: {exc}") from None
    return PlanFile(model=model, plan=plan, cluster=cluster,
                    prediction=dict(data.get("prediction") or {}),
                    meshplan_version=str(data.get("meshplan_version", "unknown")))

"""Model presets (published configurations, stored as YAML beside this module) and YAML loading."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

import yaml

from planner.spec import ModelSpec, PlanError, did_you_mean, unknown_fields_message

PRESET_DIR = Path(__file__).with_name("presets")


@lru_cache(maxsize=1)
def _model_presets() -> dict[str, dict]:
    with open(PRESET_DIR / "models.yaml", encoding="utf-8") as f:
        # libyaml's loader when PyYAML has it: the presets are read for every `--help`
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def model_names() -> list[str]:
    """Names of the model presets, e.g. ``['gpt3-175b', 'llama3-8b', ...]``."""
    return sorted(_model_presets())


def model_from_dict(fields: dict, name: str = "custom") -> ModelSpec:
    """Build a `ModelSpec` from a mapping (YAML), with errors that name unknown or missing keys.

    Raises:
        PlanError: a key is unknown or a required key is missing, or a value is illegal.
    """
    if not isinstance(fields, dict):
        raise PlanError(f"model must be a mapping of ModelSpec fields, got {type(fields).__name__}")
    known = {f.name: f for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise PlanError(unknown_fields_message("model", unknown, known))
    data = {"name": name, **fields}
    missing = [n for n, f in known.items() if n not in data
               and f.default is dataclasses.MISSING]
    if missing:
        raise PlanError(f"model {data['name']!r} is missing field(s) {missing}")
    try:
        return ModelSpec(**data)
    except PlanError as exc:
        raise PlanError(f"model {data['name']!r}: {exc}") from None


def load_model(name_or_path: str) -> ModelSpec:
    """A model preset by name (see `model_names`), or a model YAML file by path; a plan file
    (`planner.planfile`) gives the model it was planned for (its ``model`` block).

    Raises:
        PlanError: the name is neither a preset nor a readable file, or the file is invalid
            (not UTF-8, not YAML, empty, another kind of file: `planner.userfile.read_yaml`).
    """
    from planner.userfile import read_yaml
    presets = _model_presets()
    if name_or_path in presets:
        return model_from_dict(presets[name_or_path], name=name_or_path)
    path = Path(name_or_path)
    if not path.exists():
        raise PlanError(f"model={name_or_path!r} is neither a preset"
                        f"{did_you_mean(name_or_path.lower(), model_names())} "
                        f"({model_names()}) nor an existing YAML file")
    fields = read_yaml(path, "model", also=("plan",))
    if "plan" in fields or "schema_version" in fields:
        fields = fields.get("model")
        if not isinstance(fields, dict):
            raise PlanError(f"plan file {str(path)!r} given as the model has no 'model' "
                            f"mapping; give a model preset or a model YAML file")
    return model_from_dict(dict(fields), name=fields.get("name", path.stem))

"""Framework families as data: the defaults a training framework applies to every setting a
published row does not give (``presets/frameworks/<name>.yaml``, one file per family).

A file holds:

* ``match``: the row cells that identify the family, ``{cell: [lower-case substrings]}``; the
  family applies when every named cell contains one of its substrings. Families are tried
  from the highest ``priority`` down, so a specific family (DeepSpeed ZeRO-3 as a Megatron-LM
  baseline) wins over a general one (Megatron-LM). A row's year plays no part.
* ``defaults``: plan settings (``dtype``, ``recompute``, ``sequence_parallel``,
  ``zero_stage``, ``micro_batch``, ``stage_split``, ``interleave_flag``, and optionally
  ``vocab`` and ``cluster``) and `SimOptions` fields (fused attention, TP-communication
  overlap, gradient-reduction bytes and bucket size, P2P behaviour, ZeRO-3 prefetch and
  reduce-scatter overlap, and optionally the context-parallel attention) plus
  ``overlap_dp``.
* ``recipes``: sources whose launch scripts differ from the family defaults, each with its own
  ``match``, ``why`` and the ``defaults`` it overrides.
* ``from_notes``: settings switched on when a regular expression matches the row's notes
  (torchtitan's async TP).
* ``fitted``: the ``frameworks`` entry of ``efficiency.yaml`` with the fitted parameters.

The validation reader (`simulator.validation.validate`) flags every default it takes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Any

import yaml

from planner.spec import PlanError
from simulator import PRESET_DIR

FRAMEWORK_DIR = PRESET_DIR / "frameworks"
#: The family of a row whose source names no known framework (flagged).
FALLBACK = "megatron-core"
#: Keys every ``defaults`` block must give (the rest are optional: ``vocab``, ``cluster``).
REQUIRED = ("dtype", "attention", "recompute", "sequence_parallel", "zero_stage",
            "micro_batch", "interleave_flag", "stage_split", "tp_comm_overlap", "overlap_dp",
            "dp_bucket_bytes", "grad_reduce_bytes", "blocking_p2p", "p2p_scatter_gather",
            "overlap_param_gather", "zero3_unaggregated", "zero3_prefetch_params",
            "zero3_overlap_reduce", "fp32_main_grads")
#: `SimOptions` fields a family sets.
OPTION_KEYS = ("attention", "tp_comm_overlap", "grad_reduce_bytes", "blocking_p2p",
               "p2p_scatter_gather", "overlap_param_gather", "zero3_unaggregated",
               "zero3_prefetch_params", "zero3_overlap_reduce", "fp32_main_grads")
#: `SimOptions` fields a family may set; without them the `SimOptions` default holds
#: (``cp_attention``: 'ring', for the families that never ran context parallelism).
#: (``zero3_pp_unsharded``: False, ZeRO-3 gathers every micro-batch under pipelining too).
#: (``attention_kernel``: None, the device's default attention rate; a family that names it
#: runs that kernel's published rate, ``presets/attention_kernels.yaml``).
#: (``tp_overlap_kind``: 'block', how ``tp_comm_overlap`` hides the TP collectives).
#: (``eager_pointwise``: False, the pointwise ops run as fused kernels).
#: (``moe_dispatcher``: 'alltoall', ``moe_a2a_overlap``: False, ``recompute_modules``: None,
#: for a recipe that names the MoE token dispatcher, the EP all-to-all overlap or the
#: modules selective recomputation repeats; a row's notes and recompute cell still win,
#: `simulator.validation.moe_rows.moe_options`).
OPTIONAL_OPTION_KEYS = ("cp_attention", "zero3_pp_unsharded", "attention_kernel",
                        "tp_overlap_kind", "eager_pointwise", "moe_dispatcher",
                        "moe_a2a_overlap", "recompute_modules")


def _matches(match: dict[str, list[str]], row: dict) -> bool:
    return all(any(s in (row.get(cell) or "").lower() for s in subs)
               for cell, subs in match.items())


@dataclass(frozen=True)
class Framework:
    """One framework family as read from its YAML file.

    Attributes:
        name: the file's stem, e.g. ``megatron-core``.
        description: one line.
        defaults: the family's settings (see the module docstring), read-only.
        fitted: the ``efficiency.yaml`` ``frameworks`` entry of the fitted parameters.
        priority: order in which families are tried, highest first.
        match: ``{cell: [substrings]}`` identifying the family.
        recipes: ``({"match", "why", "defaults"}, ...)``.
        from_notes: ``{setting: regex}`` switched on by the row's lower-case notes.
    """

    name: str
    description: str
    defaults: MappingProxyType
    fitted: str
    priority: int
    match: MappingProxyType
    recipes: tuple = ()
    from_notes: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    def settings(self, row: dict) -> tuple[dict[str, Any], list[str]]:
        """The family defaults with the recipes that match ``row`` applied, and one
        ``"recipe: <why>"`` note per recipe applied, then the ``from_notes`` switches."""
        values = dict(self.defaults)
        notes: list[str] = []
        for recipe in self.recipes:
            if _matches(recipe["match"], row):
                values.update(recipe["defaults"])
                notes.append(f"recipe: {recipe['why']}")
        low = (row.get("notes") or "").lower()
        for key, pattern in self.from_notes.items():
            if re.search(pattern, low):
                values[key] = True
                notes.append(f"{key}=True (notes)")
        return values, notes


def _load(path) -> Framework:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    name = path.stem
    missing = [k for k in REQUIRED if k not in data.get("defaults", {})]
    if missing or "match" not in data:
        raise PlanError(f"{path}: framework file lacks {', '.join(missing) or 'match'}")
    recipes = tuple({"match": r["match"], "why": r["why"], "defaults": dict(r["defaults"])}
                    for r in data.get("recipes", []))
    return Framework(name=name, description=data.get("description", ""),
                     defaults=MappingProxyType(dict(data["defaults"])),
                     fitted=data.get("fitted", name), priority=int(data.get("priority", 0)),
                     match=MappingProxyType(dict(data["match"])), recipes=recipes,
                     from_notes=MappingProxyType(dict(data.get("from_notes", {}))))


@lru_cache(maxsize=1)
def load_frameworks() -> tuple[Framework, ...]:
    """Every family in ``presets/frameworks``, highest ``priority`` first.

    Raises:
        PlanError: a file lacks ``match`` or a required default.
    """
    return tuple(sorted((_load(p) for p in FRAMEWORK_DIR.glob("*.yaml")),
                        key=lambda fw: -fw.priority))


def framework(name: str) -> Framework:
    """The family named ``name`` (a file stem in ``presets/frameworks``).

    >>> framework("torchtitan").defaults["zero_stage"]
    3

    Raises:
        PlanError: no such family.
    """
    for fw in load_frameworks():
        if fw.name == name:
            return fw
    names = ", ".join(sorted(fw.name for fw in load_frameworks()))
    raise PlanError(f"framework={name!r} is not a family in {FRAMEWORK_DIR}; use one of {names}")


def pick_framework(row: dict) -> tuple[Framework, list[str]]:
    """The family whose ``match`` the row's cells (``source``, ``table``, ``notes``...)
    satisfy, tried from the highest priority; `FALLBACK` when none does, flagged.

    >>> pick_framework({"source": "pytorch/torchtitan benchmarks", "notes": ""})[0].name
    'torchtitan'
    >>> pick_framework({"source": "Narayanan et al. 2021", "table": "Table 2 (PTD-P vs "
    ...                 "ZeRO-3)"})[0].name
    'deepspeed-zero'
    >>> fw, flags = pick_framework({"source": "Meta, Llama 3 Herd (2024)"})
    >>> fw.name, flags[0][:67]
    ('megatron-core', 'framework=megatron-core (default: the source names no known framewo')
    """
    for fw in load_frameworks():
        if _matches(fw.match, row):
            return fw, []
    return framework(FALLBACK), [f"framework={FALLBACK} (default: the source names no known "
                                 f"framework; presets/frameworks/{FALLBACK}.yaml)"]

"""Mixture-of-experts rows of published_benchmarks.csv: the expert, MLA and EP settings a
row's ``notes`` name, read into `ModelSpec` / `Plan` / `SimOptions` fields.

The table's README writes an MoE row's shape into its notes as ``num_experts=256;top_k=8;
moe_ffn_hidden=2048;shared_experts=1 (2048);dense_layers=first 3 (ffn 18432);attention=MLA
(q_lora 1536, kv_lora 512, qk_head 128+rope 64, v_head 128);router=sigmoid, 8 groups top-4
groups`` and its expert parallelism as ``EP=64``. What the run used to move tokens is read
from the same notes, never fitted: DeepEP kernels (``DeepEP``, ``moe_flex_dispatcher_backend=
deepep`` or ``hybridep``) and all-to-all overlap (``moe_a2a_overlap=True``). Every published
MoE row forces balanced routing (Megatron-Bridge page footnote; NeMo Automodel's fake
balanced gate), so the routing imbalance stays at 1.0.
"""

from __future__ import annotations

import dataclasses
import re

from simulator.step.stagecosts import SimOptions


def _int(notes: str, key: str) -> int | None:
    m = re.search(rf"(?<![a-z_]){key}\s*=\s*(\d+)", notes, flags=re.IGNORECASE)
    return int(m.group(1)) if m else None


def row_ep(row: dict) -> int:
    """The expert-parallel degree a row's notes name (``EP=64``); 1 when absent or ``EP=-``.

    >>> row_ep({"notes": "x; EP=64; GA=4"}), row_ep({"notes": "EP=-"}), row_ep({"notes": ""})
    (64, 1, 1)
    """
    return _int(row.get("notes") or "", "ep") or 1


def moe_fields(row: dict) -> tuple[dict, list[str]]:
    """(`ModelSpec` keyword fields, flags) of the experts and MLA a row's notes name; empty
    for a dense row (no ``num_experts``).

    >>> f, _ = moe_fields({"notes": "num_experts=8;top_k=2;moe_ffn_hidden=14336;"
    ...                             "shared_experts=0"})
    >>> f["num_experts"], f["experts_per_token"], f["moe_ffn_hidden"], f["num_shared_experts"]
    (8, 2, 14336, 0)
    """
    notes = row.get("notes") or ""
    experts = _int(notes, "num_experts")
    if not experts:
        return {}, []
    fields = {"num_experts": experts, "experts_per_token": _int(notes, "top_k") or 1,
              "moe_ffn_hidden": _int(notes, "moe_ffn_hidden") or 0,
              "num_shared_experts": _int(notes, "shared_experts") or 0}
    flags = [f"MoE: {experts} experts, top-{fields['experts_per_token']} (notes)"]
    dense = re.search(r"dense_layers\s*=\s*first\s+(\d+)", notes, flags=re.IGNORECASE)
    if dense:
        fields["moe_first_dense_layers"] = int(dense.group(1))
    mla = re.search(r"q_lora\s+(\d+),\s*kv_lora\s+(\d+),\s*qk_head\s+(\d+)\s*\+\s*rope\s+(\d+)"
                    r",\s*v_head\s+(\d+)", notes, flags=re.IGNORECASE)
    if mla:
        q, kv, qk, rope, v = (int(x) for x in mla.groups())
        fields.update(q_lora_rank=q, kv_lora_rank=kv, attention_head_dim=qk,
                      qk_rope_head_dim=rope, v_head_dim=v)
        flags.append("attention=MLA (notes)")
    router = re.search(r"router\s*=\s*(sigmoid|softmax)(?:,\s*(\d+)\s+groups\s+top-(\d+))?",
                       notes, flags=re.IGNORECASE)
    if router:
        fields["router"] = router.group(1).lower()
        if router.group(2):
            fields.update(router_groups=int(router.group(2)),
                          router_group_topk=int(router.group(3)))
    return fields, flags


def recompute_modules(row: dict) -> tuple[str, ...] | None:
    """The Megatron-Core ``recompute_modules`` a selective row's ``recompute`` cell lists
    (``selective ['mla_up_proj', 'mlp']``); None when it lists none (the default,
    ['core_attn']).

    >>> recompute_modules({"recompute": "selective ['mla_up_proj', 'mlp']"})
    ('mla_up_proj', 'mlp')
    >>> recompute_modules({"recompute": "selective (family perf script)"}) is None
    True
    """
    cell = (row.get("recompute") or "").strip()
    listed = re.match(r"selective\s*\[([^\]]*)\]", cell, flags=re.IGNORECASE)
    if not listed:
        return None
    return tuple(re.findall(r"['\"]([a-z_]+)['\"]", listed.group(1))) or None


def moe_options(row: dict, options: SimOptions) -> tuple[SimOptions, list[str]]:
    """``options`` with the token dispatcher, all-to-all overlap and recomputed modules
    (`recompute_modules`) an MoE row's notes and recompute cell name."""
    low = (row.get("notes") or "").lower()
    flags = []
    changes: dict = {}
    modules = recompute_modules(row) if _int(low, "num_experts") else None
    if modules:
        changes["recompute_modules"] = modules
        flags.append(f"recompute_modules={list(modules)} (recompute cell)")
    if "deepep" in low or "hybridep" in low:
        changes["moe_dispatcher"] = "deepep"
        flags.append("moe_dispatcher=deepep (notes)")
    if re.search(r"moe_a2a_overlap\s*=\s*true", low):
        changes["moe_a2a_overlap"] = True
        flags.append("moe_a2a_overlap (notes)")
    return dataclasses.replace(options, **changes) if changes else options, flags

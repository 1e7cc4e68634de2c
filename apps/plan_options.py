"""The `plan` command's search options: constraints, fixed fields, CSV output, infeasibility.

    meshplan plan --model llama3-70b --cluster dgx-h100 --nodes 128 \
        --global-batch-tokens 4194304 --max-devices 1024 --fix tp=8 --fix recompute=none,selective \
        --memory-headroom 0.9 --csv out/
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from apps.format import fmt_bytes, print_table
from planner.precision import DTYPES
from planner.spec import MEMORY_HEADROOM, PlanError

if TYPE_CHECKING:
    from rich.console import Console

    from planner.space import SearchSpace

_INT_FIELDS = ("tp", "pp", "dp", "cp", "micro_batch", "virtual_stages", "zero_stage", "ep",
               "etp")
REJECTED_TABLE = {"id": ("candidate", None), "kind": ("kind", None),
                  "reason": ("reason", None)}
CLOSEST_TABLE = {"id": ("plan", None), "peak_memory_bytes": ("needs/device", fmt_bytes),
                 "usable_bytes": ("usable", fmt_bytes), "over_bytes": ("over", fmt_bytes),
                 "device_memory_needed_bytes": ("device that fits", fmt_bytes)}


def add_plan_options(sp: argparse.ArgumentParser) -> None:
    """Register the search options on the `plan` subparser."""
    sp.add_argument("--global-batch-tokens", help="tokens per step (instead of "
                    "--global-batch), e.g. 4194304 or 4.194304M; a multiple of the sequence "
                    "length")
    sp.add_argument("--devices", type=int, help="use exactly this many devices (default all)")
    sp.add_argument("--max-devices", type=int, help="use at most this many devices")
    sp.add_argument("--memory-headroom", type=float, default=MEMORY_HEADROOM,
                    help=f"fraction of device memory a plan may use (default {MEMORY_HEADROOM})")
    sp.add_argument("--fix", action="append", default=[], metavar="FIELD=V[,V...]",
                    help="restrict a plan field: tp, cp, pp, dp, micro_batch, virtual_stages, "
                    "schedule, recompute, zero_stage, sequence_parallel, placement, ep, etp "
                    "(e.g. --fix tp=8 --fix recompute=none,full); placement is the three axes "
                    "joined by dots, innermost first (--fix placement=tp.pp.dp)")
    sp.add_argument("--dtype", choices=(*DTYPES, "any"), help="training precision: "
                    "bf16 (or fp32, tf32, fp16), or the linear GEMMs in fp8 (delayed scaling), fp8-current "
                    "(current scaling), mxfp8 or nvfp4; any: search every one the device "
                    "runs (default: the cluster's, bf16 on GPUs)")
    sp.add_argument("--csv", help="write ranked.csv and rejected.csv into this folder")
    sp.add_argument("--prune", type=int, metavar="K",
                    help="cost only the plans whose compute-only lower bound can beat the "
                    "K-th best estimate (the top K and their order are unchanged; the ranked "
                    "table then holds only the plans costed); default: cost every plan")
    sp.add_argument("--show-rejected", type=int, default=0, metavar="N",
                    help="print the rejected table: N rows per kind (tp, cp, layers, batch, "
                    "schedule, devices, memory)")


def _value(name: str, text: str) -> object:
    if name in _INT_FIELDS:
        try:
            return int(text)
        except ValueError:
            hint = (f"; {text!r} is another field: give one --fix per field, e.g. "
                    f"--fix {name}=V --fix {text}" if "=" in text else "")
            raise PlanError(f"--fix {name}={text!r}: {name} takes integers, e.g. --fix "
                            f"{name}=2 or --fix {name}=2,4{hint}") from None
    if name == "sequence_parallel":
        if text.lower() not in ("true", "false", "yes", "no", "1", "0"):
            raise PlanError(f"--fix sequence_parallel={text!r}: use true or false")
        return text.lower() in ("true", "yes", "1")
    if name == "placement":
        return tuple(text.split("."))
    return text


def _check_placements(values: str) -> None:
    # each comma-separated placement names tp, dp and pp once, joined by dots
    from planner.spec import MESH_AXES
    if all(sorted(v.strip().split(".")) == sorted(MESH_AXES) for v in values.split(",")):
        return
    raise PlanError(f"--fix placement={values}: a placement is {', '.join(MESH_AXES)} in "
                    f"rank order joined by dots, innermost first, e.g. --fix placement=pp.dp.tp;"
                    f" commas separate placements to search (--fix placement=tp.dp.pp,tp.pp.dp)")


def parse_fixed(items: list[str]) -> SearchSpace:
    """``["tp=8", "recompute=none,full"]`` as a `SearchSpace`.

    Raises:
        PlanError: no ``=``, an unknown field or an illegal value.
    """
    fixed: dict[str, tuple] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not values:
            raise PlanError(f"--fix {item!r} must look like FIELD=VALUE[,VALUE...]")
        if name in fixed:
            given = ",".join(map(str, fixed[name]))
            raise PlanError(f"--fix {name} given twice ({name}={given} and {name}={values}); "
                            f"give it once, e.g. --fix {name}={given},{values} to search both")
        if name == "placement":
            _check_placements(values)
        fixed[name] = tuple(_value(name, v.strip()) for v in values.split(","))
    from planner.space import SearchSpace
    try:
        return SearchSpace.from_fixed(fixed)
    except PlanError as exc:  # the space's message names the field; say which flag set it
        shown = " ".join(f"--fix {item}" for item in items)
        raise PlanError(f"{shown}: {exc}") from None


def check_fixed_for_model(space: SearchSpace, model) -> None:
    """Before the search: raise `PlanError` when every tensor-parallel degree ``--fix tp``
    allows is illegal for ``model`` by a rule of the model alone (tp must divide the heads,
    KV heads and FFN width; `planner.space.tp_reason`), so the answer is one line naming the
    flag and the legal values instead of a report of a search with nothing to search.

    >>> from planner.presets import load_model
    >>> check_fixed_for_model(parse_fixed(["tp=3"]), load_model("llama3-8b"))
    Traceback (most recent call last):
    planner.spec.PlanError: --fix tp=3: tp=3 does not divide num_heads=32; use tp in [1, 2, 4, 8]
    """
    from planner.space import tp_reason
    if space.tp is None:
        return
    reasons = [tp_reason(model, tp) for tp in space.tp]
    if all(reasons):
        # each reason is "tp=V does not divide FIELD=N; use tp in [...]": the legal list once
        causes = ", ".join(dict.fromkeys(r.split("; ")[0] for r in reasons))
        legal = reasons[0].split("; ")[-1]
        raise PlanError(f"--fix tp={','.join(map(str, space.tp))}: {causes}; {legal}")


#: Most tokens in one global batch a flag may ask for: 1e9, 60 times the 16M tokens of
#: Llama 3 405B's final batch (Dubey et al. 2024 §3.4.1) and 16 times DeepSeek-V3's 63M
#: (15,360 sequences of 4,096, DeepSeek-AI 2024 §4.2), so a slip of the exponent is named
#: before the search instead of running it.
MAX_GLOBAL_BATCH_TOKENS = 1e9


def global_batch_of(args: argparse.Namespace, seq_len: int) -> int | None:
    """Sequences per step from --global-batch or --global-batch-tokens (None: neither given),
    each a count as ``--tokens`` takes it (``4M``, ``1e6``; `parse_count`).

    Raises:
        PlanError: both given, not a whole positive count, more than
            `MAX_GLOBAL_BATCH_TOKENS` tokens, or tokens not a multiple of the sequence length.
    """
    from planner.time_to_train import parse_count
    text, batch = getattr(args, "global_batch_tokens", None), getattr(args, "global_batch", None)
    if text is not None and batch is not None:
        raise PlanError("give --global-batch or --global-batch-tokens, not both")
    if batch is not None:
        return parse_count(batch, "--global-batch", MAX_GLOBAL_BATCH_TOKENS // seq_len,
                           f"sequences of {seq_len} tokens")
    if text is None:
        return None
    tokens = parse_count(text, "--global-batch-tokens", MAX_GLOBAL_BATCH_TOKENS)
    if tokens % seq_len:
        near = max(1, round(tokens / seq_len))
        raise PlanError(f"--global-batch-tokens={text} ({tokens} tokens) must be a multiple "
                        f"of seq_len={seq_len}; e.g. {near * seq_len} ({near} sequences)")
    return tokens // seq_len


def check_device_flags(args: argparse.Namespace, cluster_devices: int | None = None) -> None:
    """Raise `PlanError` naming the flag when --devices / --max-devices are both given, not
    positive, or (``cluster_devices`` given) more than the cluster has; before the search,
    whose own check names its keywords."""
    devices, most = getattr(args, "devices", None), getattr(args, "max_devices", None)
    if devices is not None and most is not None:
        raise PlanError(f"--devices {devices} and --max-devices {most}: give one (--devices N "
                        f"uses exactly N devices, --max-devices N at most N)")
    for flag, n in (("--devices", devices), ("--max-devices", most)):
        if n is not None and n < 1:
            raise PlanError(f"{flag}={n} must be >= 1 (e.g. {flag} 8); leave it out to use "
                            f"every device of the cluster")
        if n is not None and cluster_devices is not None and n > cluster_devices:
            raise PlanError(f"{flag}={n} is more than the cluster's {cluster_devices} "
                            f"devices; give at most {cluster_devices}, or a larger cluster (--nodes, or "
                            f"--ranks on localhost-cpu)")


def search_kwargs(args: argparse.Namespace) -> dict:
    """The `planner.search.search` keywords the options set (absent ones keep the defaults),
    checked before any work.

    Raises:
        PlanError: a bad ``--fix`` (`parse_fixed`) or ``--memory-headroom`` outside (0, 1].
    """
    headroom = getattr(args, "memory_headroom", None)
    if headroom is not None and not 0 < headroom <= 1:
        raise PlanError(f"--memory-headroom={headroom:g} must be in (0, 1]: the fraction of "
                        f"device memory a plan may use (default {MEMORY_HEADROOM})")
    return {"space": parse_fixed(getattr(args, "fix", None) or []),
            "num_devices": getattr(args, "devices", None),
            "max_devices": getattr(args, "max_devices", None),
            "memory_headroom": MEMORY_HEADROOM if headroom is None else headroom,
            "dtype": getattr(args, "dtype", None),
            "prune": getattr(args, "prune", None)}


def json_extras(result) -> dict:
    """Extra keys of `plan --json`: ``infeasible`` when nothing fits, else none."""
    return {"infeasible": result.infeasible.to_dict()} if result.infeasible else {}


def write_csv_files(args: argparse.Namespace, result) -> str | None:
    """Write the --csv folder's ranked.csv and rejected.csv (parent folders created) and
    return the line that says so, or None without --csv. Called before anything is printed:
    a reader that stops early (``| head``) does not cost the files."""
    if not getattr(args, "csv", None):
        return None
    folder = Path(args.csv)
    folder.mkdir(parents=True, exist_ok=True)
    result.ranked.to_csv(folder / "ranked.csv", index=False)
    result.rejected.to_csv(folder / "rejected.csv", index=False)
    return f"wrote {folder / 'ranked.csv'} and {folder / 'rejected.csv'}"


def report(console: Console, args: argparse.Namespace, result,
           wrote: str | None = None) -> None:
    """Print ``wrote`` (`write_csv_files`' line) and the infeasibility answer (human output
    only)."""
    if wrote:
        console.print(wrote, highlight=False, markup=False)
    if args.json:
        return
    per_kind = getattr(args, "show_rejected", 0)
    if per_kind and not result.rejected.empty:
        shown = result.rejected.groupby("kind", sort=False).head(per_kind)
        print_table(console, shown, f"rejected ({per_kind} per kind of {len(result.rejected)})",
                    REJECTED_TABLE)
    inf = result.infeasible
    if inf is None:
        return
    console.print(f"[bold red]no plan fits:[/] {inf.summary}", highlight=False)
    if not inf.closest.empty:
        print_table(console, inf.closest, "closest plans", CLOSEST_TABLE)
    for line in inf.blocking:
        console.print(f"  blocked by {line}", highlight=False)

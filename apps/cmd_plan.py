"""`meshplan plan`: search every legal tp x pp x dp split of a model on a cluster and rank them.

    meshplan plan --model llama3-70b --cluster dgx-h100 --nodes 64 --top 8 --out plan.yaml
    meshplan plan --model tiny-gpt --cluster localhost-cpu --ranks 2 --out tiny.yaml
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from apps.clusters import add_cpu_profile_option
from apps.cmd_faults import add_straggler_options, check_straggler_flags
from apps.format import (
    CLUSTER_HELP,
    SearchProgress,
    check_at_least,
    check_output_path,
    command_console,
    fmt_flag,
    fmt_gib,
    fmt_krate,
    fmt_params,
    fmt_pct,
    fmt_recompute,
    fmt_time_s,
    print_json,
    print_table,
)
from apps.plan_options import (
    add_plan_options,
    check_device_flags,
    check_fixed_for_model,
    global_batch_of,
    json_extras,
    report,
    search_kwargs,
    write_csv_files,
)
from apps.train_options import (
    add_train_options,
    train_json,
    train_ranked,
    train_table_columns,
    train_tokens,
)
from planner.presets import load_model, model_names
from planner.spec import PlanError

PLAN_JSON_KEYS = ["id", "tp", "pp", "dp", "micro_batch", "global_batch", "step_time_s",
                  "tokens_per_s", "mfu", "peak_memory_bytes"]
#: Further plan fields the JSON rows carry when the search table has them (as --csv does).
PLAN_JSON_EXTRA = ["cp", "virtual_stages", "schedule", "recompute", "zero_stage",
                   "sequence_parallel", "placement", "hfu", "compute_s", "comm_s", "bubble_s",
                   "ep", "etp", "dtype"]
PLAN_TABLE = {"tp": ("tp", None), "pp": ("pp", None), "dp": ("dp", None),
              "micro_batch": ("mb", None), "virtual_stages": ("v", None),
              "zero_stage": ("zero", None), "recompute": ("ac", fmt_recompute),
              "sequence_parallel": ("sp", fmt_flag), "step_time_s": ("step", fmt_time_s),
              "tokens_per_s": ("ktok/s", fmt_krate), "mfu": ("MFU", fmt_pct),
              "peak_memory_bytes": ("GiB/rank", fmt_gib)}
#: Default tokens per global batch on GPU clusters (Llama 3 pre-training started at 4M tokens,
#: Dubey et al. 2024 §3.4.1); the default global batch is this over the sequence length.
DEFAULT_BATCH_TOKENS = 4 * 2**20


def default_global_batch(cluster, seq_len: int) -> int:
    """8 sequences on a CPU cluster (no NICs: localhost); else ~4M tokens rounded to a power
    of two of sequences."""
    if cluster.nics_per_node == 0:
        return 8
    return gpu_global_batch(seq_len)


def check_out_is_no_input(out: str | None, inputs: dict[str, str]) -> None:
    """Raise `PlanError` when ``--out`` names a file given as an input (``--model``,
    ``--cluster``): writing the plan would replace it."""
    if not out:
        return
    from pathlib import Path
    for flag, given in inputs.items():
        if given and Path(given).is_file() and Path(given).resolve() == Path(out).resolve():
            raise PlanError(f"--out {out} is the {flag} file: the plan would replace it; "
                            f"write the plan to another path")


def check_default_batch_fits(seq_len: int, cluster, label: str = "--seq-len") -> None:
    """Raise `PlanError` when no batch flag is given and ``seq_len`` is longer than the
    default batch of `DEFAULT_BATCH_TOKENS` tokens on a GPU cluster: the default would round
    to a single sequence, a batch nobody asked for, so the user names the batch instead.

    >>> check_default_batch_fits(8192, type("C", (), {"nics_per_node": 8})())
    >>> check_default_batch_fits(10**8, type("C", (), {"nics_per_node": 8})())
    Traceback (most recent call last):
    planner.spec.PlanError: --seq-len 100000000 is longer than the default global batch of 4194304 tokens (it would be one sequence); give the batch: --global-batch B (sequences) or --global-batch-tokens T
    """
    if cluster.nics_per_node and seq_len > DEFAULT_BATCH_TOKENS:
        raise PlanError(f"{label} {seq_len} is longer than the default global batch of "
                        f"{DEFAULT_BATCH_TOKENS} tokens (it would be one sequence); give the "
                        f"batch: --global-batch B (sequences) or --global-batch-tokens T")


def batch_hint(global_batch: int, devices: int, given: int | None) -> str | None:
    """When no plan is legal and the default global batch does not split over the cluster's
    devices (a 72-GPU NVL72 rack against 512 sequences), the two ways out; None otherwise.

    >>> batch_hint(512, 72, None)
    'hint: the default global batch 512 is not a multiple of the 72 devices; give --global-batch 504 (a multiple of 72) or --devices 64 (a power of two)'
    >>> batch_hint(512, 64, None) is None, batch_hint(512, 72, 512) is None
    (True, True)
    """
    if given is not None or global_batch % devices == 0:
        return None
    fits = max(1, round(global_batch / devices)) * devices
    power = 2 ** int(math.log2(devices))
    return (f"hint: the default global batch {global_batch} is not a multiple of the {devices} "
            f"devices; give --global-batch {fits} (a multiple of {devices}) or --devices "
            f"{power} (a power of two)")


def gpu_global_batch(seq_len: int) -> int:
    """~4M tokens (`DEFAULT_BATCH_TOKENS`) in sequences, rounded to a power of two.

    >>> gpu_global_batch(2048), gpu_global_batch(8192)
    (2048, 512)
    """
    return max(1, 2 ** round(math.log2(DEFAULT_BATCH_TOKENS / seq_len)))


def devices_searched(args: argparse.Namespace, cluster) -> str:
    """The header's device count: ``'64 of 256 devices'`` under ``--devices 64``, ``'up to
    128 of 256 devices'`` under ``--max-devices 128``, else ``'256 devices'``."""
    n = cluster.num_devices
    if getattr(args, "devices", None) is not None:
        return f"{args.devices} of {n} devices"
    if getattr(args, "max_devices", None) is not None:
        return f"up to {min(args.max_devices, n)} of {n} devices"
    return f"{n} devices"


def dtype_notes(dtypes) -> list[str]:
    """The lines under a plan table that explain its dtypes' figures: a low-precision
    recipe's MFU is against the bf16 peak (`simulator.step.simulate`, as torchtitan and
    Megatron-Bridge report it); fp16 reduces its gradients in fp16 where bf16 reduces them in
    fp32 (`simulator.step.stagecosts.SimOptions.grad_reduce_bytes`, Megatron's default), so
    an fp16 plan can predict a shorter step than the same bf16 one.

    >>> dtype_notes(["bf16"])
    []
    >>> [n[:48] for n in dtype_notes(["nvfp4", "fp16"])]
    ['MFU of the nvfp4 rows is against the bf16 peak (', 'fp16 rows reduce gradients in fp16 (2 bytes), bf']
    """
    from planner.precision import RECIPES
    notes = []
    if recipes := sorted({d for d in dtypes if d in RECIPES}):
        notes.append(f"MFU of the {' / '.join(recipes)} rows is against the bf16 peak (as "
                     f"torchtitan and Megatron-Bridge report it): their GEMMs run at a higher "
                     f"peak, so it can exceed what bf16 reaches")
    if "fp16" in set(dtypes):
        notes.append("fp16 rows reduce gradients in fp16 (2 bytes), bf16 rows in fp32 (4 "
                     "bytes, as Megatron accumulates them): half the data-parallel traffic, "
                     "so an fp16 plan can be faster than the same bf16 one; it needs loss "
                     "scaling")
    return notes


#: The framework families `--framework` names (the files of presets/frameworks, listed
#: without importing the simulator: `--help` stays light).
FRAMEWORK_DIR = Path(__file__).resolve().parent.parent / "simulator" / "presets" / "frameworks"


def framework_names() -> list[str]:
    """The ``--framework`` choices: the stems of ``simulator/presets/frameworks/*.yaml``."""
    return sorted(p.stem for p in FRAMEWORK_DIR.glob("*.yaml"))


def framework_search_kwargs(name: str) -> dict:
    """`planner.search.search` keywords for framework family ``name``: its `SimOptions`
    (`simulator.validation.validate.framework_options` over the family's defaults and fitted
    parameters) and whether it overlaps the gradient reduction with the backward."""
    from simulator.validation.frameworks import framework
    from simulator.validation.validate import framework_options
    fw = framework(name)
    overlap_dp = bool(fw.defaults["overlap_dp"])
    return {"options": framework_options(fw, dict(fw.defaults), overlap_dp=overlap_dp),
            "overlap_dp": overlap_dp}


#: The header's framework line without ``--framework``.
DEFAULT_FRAMEWORK_LINE = ("simulator defaults (Megatron-LM-like: no TP overlap, reduction "
                          "after the backward)")


def framework_line(name: str | None) -> str:
    """The header line of ``--framework name``: the family, its file and its description
    (`DEFAULT_FRAMEWORK_LINE` for None)."""
    if name is None:
        return DEFAULT_FRAMEWORK_LINE
    from simulator.validation.frameworks import framework
    fw = framework(name)
    return f"{fw.name} (presets/frameworks/{fw.name}.yaml: {fw.description})"


def require_positive(args: argparse.Namespace, *flags: str, allow_zero: bool = False) -> None:
    """Raise `PlanError` naming the flag when one of ``flags`` is given and not positive."""
    for flag in flags:
        check_at_least(flag, getattr(args, flag.lstrip("-").replace("-", "_"), None), 0,
                       strict=not allow_zero)


def cmd_plan(args: argparse.Namespace) -> int:
    from apps.clusters import cluster_from_flags, cluster_ref, profile_line
    from apps.cmd_faults import goodput_json, goodput_ranked, goodput_table_columns
    from planner.objective import GOODPUT_COLUMNS
    from planner.search import search
    from planner.time_to_train import TRAIN_COLUMNS
    console = command_console(args)
    require_positive(args, "--seq-len", "--top", "--nodes", "--ranks",
                     "--mtbf-hours", "--node-mtbf-hours")
    require_positive(args, "--restart-s", "--spare-delay-s", "--show-rejected", allow_zero=True)
    check_straggler_flags(args)
    require_positive(args, "--top-k", "--prune")
    check_device_flags(args)
    check_output_path("--out", args.out)
    check_out_is_no_input(args.out, {"--model": args.model, "--cluster": args.cluster})
    check_output_path("--csv", getattr(args, "csv", None), folder=True)
    kwargs = search_kwargs(args)
    model = load_model(args.model)
    if args.seq_len is not None:
        model = model.replace(seq_len=args.seq_len)
    check_fixed_for_model(kwargs["space"], model)
    cluster = cluster_from_flags(args.cluster, args.nodes, args.ranks,
                                 getattr(args, "cpu_profile", None))
    check_device_flags(args, cluster.num_devices)
    if kwargs["dtype"] is not None:    # the search's own check, before its header
        from planner.precision import search_dtypes
        search_dtypes(kwargs["dtype"], cluster.device.name, cluster.device.peak_flops)
    gb = given = global_batch_of(args, model.seq_len)
    if gb is None:
        check_default_batch_fits(model.seq_len, cluster, "--seq-len" if args.seq_len
                                 else f"model {model.name!r} has seq_len")
        gb = default_global_batch(cluster, model.seq_len)
    tokens = train_tokens(args, gb, model.seq_len)
    # What is searched goes to stderr before the search, the results (and --out) after it:
    # `| head` then costs no plan file.
    from rich.console import Console
    notes = Console(stderr=True)
    from rich.markup import escape  # names and errors are text, not markup
    notes.print(f"[bold]{escape(model.name)}[/] ({fmt_params(model.num_params())} params, seq "
                f"{model.seq_len}) on [bold]{escape(cluster.name)}[/] ({devices_searched(args, cluster)}"
                f", {cluster.device.name}), global batch {gb}")
    if cluster.nics_per_node == 0:
        notes.print(profile_line(cluster), highlight=False)
    framework_kwargs = {}
    if getattr(args, "framework", None):
        framework_kwargs = framework_search_kwargs(args.framework)
    notes.print(f"framework: {framework_line(getattr(args, 'framework', None))}",
                highlight=False, markup=False)
    with notes.status("searching every legal plan ...") as status:
        result = search(model, cluster, global_batch=gb, top_k=args.top_k,
                        progress=SearchProgress(notes, status), **kwargs,
                        **framework_kwargs)
    if getattr(args, "objective", "throughput") == "goodput":
        result = goodput_ranked(console, result, model, cluster, args, tokens)
    if tokens is not None:
        result = train_ranked(console, result, model, cluster, args, tokens)
    ranked, rejected = result.ranked, result.rejected
    if args.out and not ranked.empty:
        # written before anything is printed: a reader that stops early (``| head``) does
        # not cost the plan file
        from planner.planfile import PlanFile, write_plan_file
        best = result.best
        write_plan_file(args.out, PlanFile(
            model=model, plan=best, prediction=result.predictions[best.id].to_dict(),
            cluster=cluster_ref(cluster, best, args.cluster)))
    wrote_csv = write_csv_files(args, result)
    if args.json:
        keys = PLAN_JSON_KEYS + [k for k in PLAN_JSON_EXTRA + list(GOODPUT_COLUMNS)
                                 + list(TRAIN_COLUMNS) if k in ranked]
        print_json({"plans": ranked[keys].to_dict("records"),
                    "rejected": rejected.to_dict("records"), **json_extras(result),
                    **goodput_json(args, cluster), **train_json(args, tokens, cluster)})
    else:
        if not ranked.empty:
            columns = dict(PLAN_TABLE)
            if "cp" in ranked and (ranked["cp"].head(args.top) > 1).any():
                columns = {"tp": columns["tp"], "cp": ("cp", None),
                           **{k: v for k, v in columns.items() if k != "tp"}}
            if model.is_moe:
                columns = _with_expert_columns(columns, ranked.head(args.top))
            columns.update({k: v for k, v in goodput_table_columns().items() if k in ranked})
            columns.update({k: v for k, v in train_table_columns().items() if k in ranked
                            and (k != "cost_usd" or ranked[k].notna().any())})
            shown = ranked.head(args.top)
            if (shown["placement"] != "tp.dp.pp").any():
                # Rows that differ only in rank placement would look identical without it.
                columns["placement"] = ("order", None)
            if "schedule" in shown and \
                    (~shown["schedule"].isin(("1f1b", "interleaved-1f1b"))).any():
                # A zero-bubble row would read as 1F1B / interleaved 1F1B without it.
                columns["schedule"] = ("schedule", None)
            if (shown["dtype"] != shown["dtype"].iloc[0]).any() or \
                    shown["dtype"].iloc[0] not in ("bf16", "fp32"):
                columns["dtype"] = ("dtype", None)
            print_table(console, ranked, "ranked plans (best first)", columns, limit=args.top)
            for note in dtype_notes(shown["dtype"]):
                console.print(note, highlight=False, markup=False)
        refined = int((ranked["tier"] == "simulated").sum())
        oom = rejected["reason"].str.startswith("out of memory")
        console.print(f"{len(ranked)} legal plans ({refined} best refined by SimPy, the rest "
                      f"analytical); {len(rejected)} rejected: {int(oom.sum())} out of memory, "
                      f"{int((~oom).sum())} illegal (`--json` lists every reason)")
        for kind in (oom, ~oom):
            if kind.any():
                row = rejected[kind].iloc[0]
                console.print(f"  e.g. {row['id']}: {row['reason']}", highlight=False, markup=False)
    report(console, args, result, wrote_csv)
    if ranked.empty and not args.json:
        hint = batch_hint(gb, args.devices or cluster.num_devices, given)
        if hint:
            console.print(hint, highlight=False, markup=False)
    if args.out:  # no legal plan: `best` raises, naming the commonest reasons
        console.print(f"wrote {args.out} ({result.best.id})", markup=False)
    # No legal plan: the inputs cannot be satisfied together (the report says which constraint
    # blocks them), so this is bad input, exit 2, also with --json.
    return 0 if not ranked.empty else 2


def _with_expert_columns(columns: dict, shown) -> dict:
    # ep (and etp when some shown plan splits experts) right after dp for an MoE model.
    out = {}
    for key, value in columns.items():
        out[key] = value
        if key == "dp":
            out["ep"] = ("ep", None)
            if (shown["etp"] > 1).any():
                out["etp"] = ("etp", None)
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``plan`` on the subcommand parser ``sub``."""
    sp = sub.add_parser("plan", help="search tp x pp x dp splits and rank them")
    sp.add_argument("--model", required=True, help=f"preset ({', '.join(model_names())}), a model "
                    f"YAML file, or a plan file (the model it was planned for)")
    sp.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    sp.add_argument("--nodes", type=int, help="node count of a GPU cluster (default: preset's)")
    sp.add_argument("--ranks", type=int, help="processes on localhost-cpu (default 4)")
    sp.add_argument("--global-batch", help="sequences per step (default: 4M tokens "
                    "on GPUs, 8 on localhost-cpu)")
    sp.add_argument("--seq-len", type=int, help="override the model's sequence length")
    sp.add_argument("--top-k", type=int, default=20, help="plans refined by SimPy (default 20)")
    sp.add_argument("--top", type=int, default=15, help="rows to print (default 15)")
    sp.add_argument("--out", help="write the best plan to this plan file (YAML)")
    sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    sp.add_argument("--objective", choices=("throughput", "goodput", "time-to-train"),
                    default="throughput", help="rank by predicted tokens/s, by tokens/s x "
                    "goodput under failures, or by wall days to train --tokens / --steps")
    sp.add_argument("--mtbf-hours", type=float,
                    help="per-device MTBF in hours for the failure model (default 50677: "
                    "Llama 3 405B's 419 unexpected interruptions in 54 days on 16,384 GPUs, "
                    "Dubey et al. 2024 §3.3.4)")
    sp.add_argument("--node-mtbf-hours", type=float,
                    help="per-node MTBF in hours (node failures besides device failures)")
    sp.add_argument("--restart-s", type=float, help="seconds from a failure to training "
                    "again, lost work excluded, and the start-up of an eviction's resume "
                    "(--objective goodput; default 300, an assumption; on localhost-cpu 8, "
                    "the runtime's own figure for this machine)")
    sp.add_argument("--spare-delay-s", type=float, help="seconds to swap a spare node in "
                    "after a node failure (--objective goodput, with --node-mtbf-hours; "
                    "default 0)")
    sp.add_argument("--framework", choices=framework_names(), help="cost every plan as "
                    "this framework family runs it (presets/frameworks: TP overlap, gradient "
                    "reduction dtype and overlap, attention kernel, fitted parameters); "
                    "default: the simulator's defaults (Megatron-LM-like, no TP overlap, "
                    "gradient reduction after the backward)")
    add_straggler_options(sp)
    add_train_options(sp)
    add_plan_options(sp)
    add_cpu_profile_option(sp)
    sp.set_defaults(func=cmd_plan)

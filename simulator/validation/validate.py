"""Validation against real training runs: read a runs table, simulate every row on the
matching cluster, report predicted vs reference step time.

Two formats, detected by header: the published-runs table (``ref_step_time_s`` column) and
the vTrain ground-truth tables (``iteration time (ms)``). A setting a row does not give takes
the documented default of its source family below, and the row's ``flags`` say so.

Defaults (never tuned per row):

* every row: ffn = 4h, kv_heads = heads, GeLU MLP, LayerNorm, untied output projection, no
  dropout changes; vocab 51,200 for Megatron GPT rows; layers that do not split evenly over
  the pipeline get the larger stages first (DeepSpeed / Megatron balanced split). A
  Llama-family model (`SWIGLU_FAMILIES` in its name, or SwiGLU in its notes) has a SwiGLU
  MLP, RMSNorm, ffn = 8h/3 rounded up to 256 and vocab 32,000 when not given; a Llama 3 model
  ffn = 3.5h, 8 KV heads and vocab 128,256. The row's ``gpu`` cell picks the cluster
  (`gpu_cluster`); a GPU without a device profile skips the row with the reason.
* the framework family comes from what the row says, never from its year: each family is a
  file in ``presets/frameworks`` (`simulator.validation.frameworks`) that names the source /
  table / notes substrings it matches and holds its defaults (precision, attention kernels,
  recomputation, sequence parallelism, ZeRO stage, TP-communication overlap, gradient
  reduction bytes and bucket, P2P behaviour, ZeRO-3 prefetch and reduce-scatter overlap) and
  the recipes of sources that launched differently. Every row is flagged with its family and
  with each default taken. The bullets below describe what those files hold.
* published_benchmarks.csv: an FP8 / MXFP8 / NVFP4 row is simulated in its precision
  (`simulator.validation.precision.row_dtype`); a GB200 row on ``gb200-nvl72-seg16`` (NVL72
  racks scheduled in 64-GPU segments, one NVLink domain each). A mixture-of-experts row is
  read with the experts, MLA, EP degree, token dispatcher and all-to-all overlap its notes
  name (`simulator.validation.moe_rows`).
* torchtitan (FSDP2): bf16 parameters with fp32 gradient reduction, SDPA flash attention,
  FULL_SHARD over every data-parallel rank with the next block's gather prefetched,
  reduce-scatters overlapped, selective recomputation unless stated, async TP (TP
  communication overlapped) where the notes say so; cluster ``dgx-h100`` / ``dgx-h200``, or
  ``grand-teton-h100`` where the ``gpu`` cell names the HBM2e H100 (Meta's 500 W parts).
* vTrain (Megatron-DeepSpeed): GPT-2 vocab 50,257 (padded as Megatron pads it,
  `megatron_padded_vocab`), fp16, full recomputation, 1F1B, unfused
  attention, blocking P2P (with the fitted Megatron-DeepSpeed send/recv overhead), gradients
  all-reduced after the backward without bucketing; cluster ``vtrain-a100`` (DGX A100
  NVSwitch, which matches the cluster's own nccl-tests; 800 Gb/s per node).
* Megatron-LM 2020-2022 on Selene / DGX A100 (Narayanan et al. 2021; Korthikanti et al.
  2022; the 2020 README): fp16, unfused attention, no DP overlap; micro-batch 1 when not
  given (2020 README rows: the per-GPU batch, no accumulation; Narayanan et al. Table 1 rows:
  micro-batch, interleaving and DDP overlap from the authors' ``examples/sc21/
  run_table_1.sh``, `SC21_TABLE_1`); full recomputation when not
  given; blocking P2P; cluster ``dgx-a100`` (8 x 200 Gb/s HDR per node), or
  ``dgx-a100-40gb`` for the 2020 README rows (A100 40 GB: 1,555 GB/s HBM; the 80 GB DGX A100
  shipped from November 2020, after those runs). The ZeRO-3 rows of
  Narayanan et al. Table 2 ran DeepSpeed ZeRO-3: its weight gathers and gradient
  reduce-scatters push every rank's full share through the rank's NIC (no node-level
  aggregation; the 768- and 1536-GPU rows take the same time, as that predicts), with
  DeepSpeed's documented defaults: 5e7 parameters prefetched ahead (a 175B layer holds
  1.8e9, so its gather mostly stalls compute) and ``overlap_comm`` off (gradient
  reduce-scatters block the backward).
* Megatron-Core 2024 on DGX H100: bf16, flash attention, sequence parallel when tp > 1,
  TP-communication overlap, overlapped bucketed gradient reduction and parameter gather,
  distributed optimizer (ZeRO-1), micro-batch 1, no recomputation, no interleaving; cluster
  ``dgx-h100``.
* BLOOM (Megatron-DeepSpeed with DeepSpeed's pipeline engine on Jean Zay): bf16, unfused
  attention, layers split by DeepSpeed's partitioner with the tied embedding counted as a
  layer on the first and last stage (`deepspeed_split`; the BLOOM README's
  ``--pp-partition-method 'type:transformer|embedding'``; by parameter count the same
  bottlenecks result), blocking P2P of the whole activation from every TP rank (no scatter-gather),
  full recomputation, ZeRO-1 and vocab 250,680 when not given; cluster ``jean-zay-a100``
  (4 x 100 Gb/s per node).
* llm-foundry MPT: bf16, FSDP FULL_SHARD (ZeRO-3), overlapped; FlashAttention in Triton
  (the MPT configs' ``attn_impl: triton``); vocab as given; cluster ``dgx-a100`` (1600 Gb/s
  RoCE per node = 8 x 200 Gb/s).
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from planner.precision import block_scaled_device
from planner.spec import ModelSpec, Plan, PlanError, balanced_split, check_experts
from planner.userfile import read_text
from simulator import PRESET_DIR
from simulator.network.cluster import Cluster, load_cluster
from simulator.step.compute import attention_kernel_rate, load_framework
from simulator.step.simulate import estimate, simulate
from simulator.step.stagecosts import SimOptions
from simulator.validation.frameworks import (
    OPTION_KEYS,
    OPTIONAL_OPTION_KEYS,
    Framework,
    framework,
    pick_framework,
)
from simulator.validation.memory_default import recompute_that_fits
from simulator.validation.moe_rows import moe_fields, moe_options, row_ep
from simulator.validation.precision import (  # noqa: F401 (row_precision: re-export)
    row_dtype,
    row_precision,
    unsupported_precision_reason,
)
from simulator.validation.report import error_summary, rel_error

CLUSTER_DIR = PRESET_DIR / "validation_clusters"
#: Narayanan et al. 2021 Table 1 as launched by the authors' released script
#: (Megatron-LM ``examples/sc21/run_table_1.sh``): (hidden, layers) -> (micro-batch,
#: layers per virtual stage or None, gradient reduction overlapped with the backward: the
#: script's ``DDP=torch``; ``DDP=local`` reduces after the backward).
SC21_TABLE_1 = {
    (2304, 24): (16, None, True), (3072, 30): (16, None, True), (4096, 36): (16, None, True),
    (6144, 40): (8, None, True), (8192, 48): (4, None, False), (10240, 60): (2, 5, False),
    (12288, 80): (2, 5, False), (16384, 96): (1, 3, False), (20480, 105): (1, 1, False),
    (25600, 128): (1, None, False),
}


@dataclass(frozen=True, kw_only=True)
class RunCase:
    """One reference run: what to simulate, where, and what was measured."""

    id: str
    model: ModelSpec
    plan: Plan
    cluster_name: str
    nodes: int
    options: SimOptions
    overlap_dp: bool
    reference_step_time_s: float
    flags: tuple[str, ...] = field(default=())
    #: The paper or repository the run comes from (`source_key`), for per-source reports.
    source: str = ""


#: The vTrain ground-truth tables' source (both tables: one paper, one cluster).
VTRAIN_SOURCE = "vTrain (Bang et al. 2024)"


def source_key(source: str) -> str:
    """The paper or repository a ``source`` cell names: the first ``owner/repository`` in
    it, else the ``Author et al. YEAR`` it starts with, else the text before its first
    parenthesis or quote. Rows of one repository (every release table of it) share a key.

    >>> source_key("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @b5bc")
    'pytorch/torchtitan'
    >>> source_key("Narayanan et al. 2021 (SC21) 'Efficient Large-Scale ...' arXiv:2104.04473")
    'Narayanan et al. 2021'
    >>> source_key("BigScience BLOOM-176B: bigscience-workshop/bigscience train/tr11/README.md")
    'bigscience-workshop/bigscience'
    """
    repo = re.search(r"(?<![\w.:/-])([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)", source)
    if repo and not repo.group(1).lower().startswith(("http", "docs.", "www.")):
        return repo.group(1)
    paper = re.match(r"\s*(.*?et al\.?,? \d{4})", source)
    if paper:
        return paper.group(1)
    return re.split(r"[('\"]|\s+pages?\s+https?://", source, maxsplit=1)[0].strip() or source


@lru_cache(maxsize=64)
def validation_cluster(name: str, nodes: int) -> Cluster:
    """A cluster preset (``dgx-a100``, ``dgx-h100``) or a validation cluster file
    (``vtrain-a100``, ``jean-zay-a100`` in ``presets/validation_clusters``) with ``nodes``."""
    path = CLUSTER_DIR / f"{name}.yaml"
    return load_cluster(str(path) if path.is_file() else name, nodes=nodes)


def gpu_nodes(cluster: str, num_gpus: int) -> int:
    """Nodes of validation cluster ``cluster`` that hold ``num_gpus`` GPUs (8 per DGX node,
    72 per NVL72 rack).

    >>> gpu_nodes("dgx-h100", 1024), gpu_nodes("gb200-nvl72-seg16", 256)
    (128, 4)
    """
    return math.ceil(num_gpus / validation_cluster(cluster, 1).devices_per_node)


def deepspeed_split(layers: int, stages: int, embedding_units: float = 1.0) -> tuple[int, ...]:
    """Transformer layers per stage as DeepSpeed's ``PipelineModule`` partitions a GPT with
    its (tied) embedding on the first and last stage, each weighing ``embedding_units``
    layers (``partition_method='type:transformer|embedding'``: 1; ``'parameters'``: the
    embedding's parameter count over a layer's).

    DeepSpeed (``runtime/utils.py``, ``partition_balanced``) binary-searches the smallest
    bottleneck B, the heaviest stage's weight, for which contiguous stages fit, then fills
    the stages greedily from the first, each up to B; stages left empty at the end get one
    layer each from the stages before them. The middle stages can so carry more layers
    than an even split: 72 layers on 12 stages give 7-layer stages, not 6.

    >>> deepspeed_split(72, 12)
    (6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 2, 1)
    >>> deepspeed_split(70, 12)
    (5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5)
    """
    weights = [embedding_units] + [1.0] * layers + [embedding_units]

    def greedy(bottleneck: float) -> list[list[float]]:
        parts: list[list[float]] = [[]]
        for w in weights:
            if parts[-1] and sum(parts[-1]) + w > bottleneck + 1e-9:
                parts.append([])
            parts[-1].append(w)
        return parts

    lo, hi = sum(weights) / stages, sum(weights)
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if len(greedy(mid)) <= stages else (mid, hi)
    parts = greedy(hi)
    counts = [len(p) for p in parts]
    counts[0] -= 1                                           # the embedding
    counts[-1] -= 1 if len(parts[-1]) and len(parts) > 1 else 0
    if len(parts) == 1:
        counts[0] -= 1
    counts += [0] * (stages - len(counts))
    for i in range(stages - 1, 0, -1):                       # no empty stage
        j = i - 1
        while counts[i] < 1:
            while counts[j] <= 1:
                j -= 1
            counts[j] -= 1
            counts[i] += 1
    return tuple(counts)


def _num(value: str) -> float | None:
    value = (value or "").strip()
    if not value:
        return None
    try:
        return float(value.rstrip("%"))
    except ValueError:
        return None


#: Published-runs columns that hold counts: a row without one of `REQUIRED_COUNTS` is skipped
#: (it does not say the model or the job); a filled cell of either must be a whole number > 0.
REQUIRED_COUNTS = ("layers", "hidden", "heads", "seq_len", "num_gpus", "global_batch")
OPTIONAL_COUNTS = ("kv_heads", "ffn_hidden", "vocab", "tp", "pp", "dp", "cp", "vpp",
                   "micro_batch")


#: The first word of a ``recompute`` cell and the recompute it names ("full AC (...)",
#: "selective ['mlp']", "none set in perf recipe" as the shipped tables write them); None: the
#: framework's default (activation CPU offload moves activations, it recomputes nothing).
RECOMPUTE_WORDS = {"full": "full", "yes": "full", "true": "full", "on": "full",
                   "selective": "selective",
                   "none": "none", "no": "none", "false": "none", "off": "none",
                   "activation": None}
#: The first word of a ``sequence_parallel`` cell ("True (torchtitan TP)") and its value.
SEQUENCE_PARALLEL_WORDS = {"yes": True, "true": True, "on": True,
                           "no": False, "false": False, "off": False}
#: How the reference step time was got: printed by the source, derived from its throughput
#: (../shared/data/README.md), or measured on the user's own run.
STEP_TIME_KINDS = ("reported", "derived", "measured")
_CELL_FORMS = {
    "recompute": "a cell starting with full, selective or none (yes/true/on read as full, "
                 "no/false/off as none, 'activation CPU offload ...' as the framework's "
                 "default), or empty for the framework's default",
    "sequence_parallel": "yes or no (true/false, on/off; a note may follow the word), or "
                         "empty for the framework's default",
    "ref_step_time_kind": "reported (printed by the source), derived (from its throughput) or "
                          "measured (your own run)",
}


def block_recompute_layers(cell: str | None) -> int:
    """The N of a full-recomputation cell that names Megatron-LM's block method ("full, block,
    5 layers": ``--recompute-method block --recompute-num-layers 5``, the first N blocks of
    each pipeline chunk), as `planner.spec.Plan.recompute_num_layers`; 0 for every block
    (uniform, or no method named).

    >>> block_recompute_layers("full, block, 5 layers (preset recompute_num_layers)")
    5
    >>> block_recompute_layers("full AC (interleaved1f1b, 2 layers/stage)"), block_recompute_layers("")
    (0, 0)
    """
    match = re.search(r"\bblock\b\W*(\d+)\s*layers?\b", (cell or "").lower())
    return int(match.group(1)) if match else 0


def first_word(cell: str | None) -> str:
    """The lower-case first word of a table cell, up to a space, comma, semicolon or bracket
    (the shipped tables follow a value with a note).

    >>> first_word("full, block, 5 layers"), first_word("True (torchtitan TP)"), first_word("")
    ('full', 'true', '')
    """
    return re.split(r"[\s,;(\[]+", (cell or "").strip().lower(), maxsplit=1)[0]


def malformed_cell(row: dict) -> str | None:
    """What is wrong with a published-runs row's cells, naming the column, the value and the
    fix; None when they can be read. A count that is not a whole number > 0, a reference step
    time that is not a number of seconds > 0, or a ``num_gpus`` other than the world size
    tp*cp*pp*dp (expert parallelism splits the experts within those ranks and adds none,
    Megatron-Core's MoE parallel folding) is a mistake in the table, not a row to skip.

    >>> malformed_cell({"layers": "forty"})
    "layers='forty' is not a whole number > 0; give the count (e.g. 40)"
    >>> malformed_cell({"ref_step_time_s": "-2.9"})
    "ref_step_time_s='-2.9' is not a step time > 0; give the measured seconds per step"
    >>> malformed_cell({"recompute": "fulll"})[:50]
    "recompute='fulll' is not a value it takes; write a"
    >>> malformed_cell({"num_gpus": "256", "tp": "1", "pp": "1", "dp": "128"})[:60]
    'num_gpus=256 but tp*cp*pp*dp = 1*1*1*128 = 128 (ep adds no r'
    """
    counts: dict[str, int] = {}
    for column in (*REQUIRED_COUNTS, *OPTIONAL_COUNTS):
        cell = (row.get(column) or "").strip()
        if not cell:
            continue
        try:
            value = float(cell)
        except ValueError:
            value = 0.0
        if not (value >= 1 and value.is_integer()):
            return f"{column}={cell!r} is not a whole number > 0; give the count (e.g. 40)"
        counts[column] = int(value)
    cell = (row.get("ref_step_time_s") or "").strip()
    if cell:
        try:
            seconds = float(cell)
        except ValueError:
            seconds = float("nan")
        if not (seconds > 0 and math.isfinite(seconds)):
            return (f"ref_step_time_s={cell!r} is not a step time > 0; give the measured "
                    f"seconds per step")
    for column, words in (("recompute", RECOMPUTE_WORDS),
                          ("sequence_parallel", SEQUENCE_PARALLEL_WORDS),
                          ("ref_step_time_kind", STEP_TIME_KINDS)):
        cell = (row.get(column) or "").strip()
        word = cell.lower() if column == "ref_step_time_kind" else first_word(cell)
        if cell and word not in words:
            return f"{column}={cell!r} is not a value it takes; write {_CELL_FORMS[column]}"
    tp, cp, pp = (counts.get(k, 1) for k in ("tp", "cp", "pp"))
    gpus, dp = counts.get("num_gpus"), counts.get("dp")
    if gpus is not None and dp is not None and tp * cp * pp * dp != gpus:
        fix = (f", or dp={gpus // (tp * cp * pp)} for {gpus} GPUs"
               if gpus % (tp * cp * pp) == 0 else "")
        return (f"num_gpus={gpus} but tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {tp * cp * pp * dp}"
                f" (ep adds no ranks); give num_gpus {tp * cp * pp * dp}{fix}")
    return None


def table_row_problem(row: dict, line: int, seen: dict[str, int]) -> str | None:
    """What is wrong with a published-runs row as a row of its table, naming the column:
    more cells than the header has columns, an empty or repeated ``id`` (``seen``: the ids
    read so far and their lines, updated), or a ``vpp`` > 1 where pp is 1 (virtual stages
    interleave pipeline stages; one stage has none). None when the row is sound.

    >>> table_row_problem({"id": "a", None: ["x"]}, 3, {})
    "row a has 1 cell(s) more than the header's columns ('x'); remove them or add a column"
    >>> table_row_problem({"id": "a"}, 4, {"a": 2})
    "id='a' again (first on line 2); give each row its own id"
    >>> table_row_problem({"id": "b", "pp": "1", "vpp": "2"}, 5, {})
    'row b: vpp=2 with pp=1: virtual stages interleave pipeline stages; set vpp to 1 or empty, or pp > 1'
    """
    row_id = (row.get("id") or "").strip()
    if not row_id:
        return "the id cell is empty; give each row an id (e.g. r100)"
    if row_id in seen:
        return f"id={row_id!r} again (first on line {seen[row_id]}); give each row its own id"
    seen[row_id] = line
    extra = row.get(None)
    if extra:
        return (f"row {row_id} has {len(extra)} cell(s) more than the header's columns "
                f"({', '.join(map(repr, extra[:3]))}); remove them or add a column")
    pp, vpp = _num(row.get("pp") or "") or 1, _num(row.get("vpp") or "") or 1
    if vpp > 1 and pp == 1:
        return (f"row {row_id}: vpp={row['vpp'].strip()} with pp=1: virtual stages "
                f"interleave pipeline stages; set vpp to 1 or empty, or pp > 1")
    return None


def missing_cell(row: dict) -> str | None:
    """The first empty cell a published-runs row needs (`REQUIRED_COUNTS`, the reference
    step time and the GPU), as the reason the row is skipped; None when none is empty."""
    for column in (*REQUIRED_COUNTS, "ref_step_time_s", "gpu"):
        if not (row.get(column) or "").strip():
            return f"{column} is empty; fill it in (the row cannot be simulated without it)"
    return None


def unsupported_reason(row: dict) -> str | None:
    """Why a published row is not simulated, or None when it is: every dense and
    mixture-of-experts row in bf16, FP8, MXFP8 or NVFP4 is simulated; a precision that is
    not a modelled recipe is listed under ``skipped`` with the reason
    (`simulator.validation.precision.unsupported_precision_reason`).

    >>> unsupported_reason({"notes": "precision=bf16; num_experts=8;top_k=2"}) is None
    True
    >>> unsupported_reason({"notes": "quantization=float8 rowwise; GBS"})[:27]
    'quantization=float8 rowwise'
    """
    return unsupported_precision_reason(row)


def _a100_40gb(row: dict) -> bool:
    # The row names the 40 GB part, or names no memory size on a 2020 DGX A100 (the 80 GB
    # DGX A100 shipped from November 2020).
    gpu = row["gpu"].lower().replace(" ", "")
    if "80gb" in gpu:
        return False
    return "40gb" in gpu or ("a100" in gpu and "2020" in row["gpu"] + row["source"])


#: Cluster presets a published row's ``gpu`` cell can name (see `gpu_cluster`).
GPU_CLUSTERS = ("dgx-a100", "dgx-a100-40gb", "pcie-a100", "jean-zay-a100", "dgx-h100",
                "grand-teton-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-seg16")


def gpu_cluster(row: dict, site: str | None = None) -> tuple[str, list[str]]:
    """(cluster preset, flags) for the GPU a published row names in its ``gpu`` cell.

    H100 / H800 -> ``dgx-h100`` (SXM with NVSwitch and 8 x 400 Gb/s, flagged when the form
    factor is not stated); an H100 naming HBM2e (not PCIe) -> ``grand-teton-h100`` (the 96 GB
    HBM2e part at a 500 W limit, device ``h100-sxm-96gb-500w``; flagged when the cell names no
    limit), H200 -> ``dgx-h200``, B200 -> ``dgx-b200``; A100 -> ``dgx-a100``,
    ``dgx-a100-40gb`` (40 GB named, or a 2020 DGX A100 naming no size), ``pcie-a100`` (PCIe
    named) or ``jean-zay-a100`` (Jean Zay, or an A100 row naming no DGX whose framework
    recipe's ``cluster`` is ``jean-zay-a100``: ``site``). GB200 -> ``gb200-nvl72-seg16`` (a
    node is one NVL72 rack scheduled as a 64-GPU segment, one NVLink domain).

    >>> gpu_cluster({"gpu": "H100 80GB SXM", "source": "x"})
    ('dgx-h100', [])
    >>> gpu_cluster({"gpu": "H100", "source": "x"})[1]
    ['gpu=H100 SXM (form factor not stated)']
    >>> gpu_cluster({"gpu": "H100 SXM 96GB HBM2e, 500W limit (Meta Grand Teton)", "source": "x"})
    ('grand-teton-h100', [])

    Raises:
        PlanError: the cell names a GPU without a device profile (e.g. V100, MI250X, TPU).
    """
    gpu = row["gpu"].lower().replace(" ", "").replace("-", "")
    flags: list[str] = []
    if "h100" in gpu or "h800" in gpu:
        if "hbm2e" in gpu and "pcie" not in gpu:
            # The 96 GB HBM2e H100 SXM at a lower power limit (Meta's Grand Teton hosts).
            watts = re.search(r"(\d+)wlimit", gpu)
            if watts is None:
                flags.append("gpu=H100 SXM 96GB HBM2e at 500 W (power limit not stated)")
            elif watts.group(1) != "500":
                raise PlanError(f"gpu={row['gpu']!r}: no device profile for an HBM2e H100 at "
                                f"{watts.group(1)} W; h100-sxm-96gb-500w is the 500 W part")
            return "grand-teton-h100", flags
        if "pcie" in gpu:
            flags.append("gpu=H100 SXM (no PCIe preset)")
        elif "sxm" not in gpu and "dgx" not in gpu:
            flags.append("gpu=H100 SXM (form factor not stated)")
        return "dgx-h100", flags
    if "gb200" in gpu:
        # NVIDIA's DGX-GB200 system is the NVL72 rack: 72 GPUs in one NVLink domain.
        return "gb200-nvl72-seg16", flags + ["gpu=GB200 NVL72, 64 GPUs per rack (Slurm --segment=16)"]
    if "h200" in gpu:
        if "gh200" in gpu:
            flags.append("gpu=H200 SXM node for GH200 (same GPU die and HBM3e)")
        return "dgx-h200", flags
    if "b200" in gpu:
        return "dgx-b200", flags
    if "a800" in gpu:
        flags.append("gpu=A100 for A800 (same chip; NVLink 400 GB/s instead of 600)")
        gpu = gpu.replace("a800", "a100")
    if "a100" in gpu:
        if "jeanzay" in gpu or (site == "jean-zay-a100" and "dgx" not in gpu):
            return "jean-zay-a100", flags
        if "pcie" in gpu:
            return "pcie-a100", flags
        if _a100_40gb(row):
            if "40gb" not in gpu:
                flags.append("gpu=a100-sxm-40gb (default: 2020 DGX A100)")
            return "dgx-a100-40gb", flags
        return "dgx-a100", flags
    raise PlanError(f"gpu={row['gpu']!r} has no device profile; the validation clusters cover "
                    f"A100, H100, H200, B200 and GB200 ({', '.join(GPU_CLUSTERS)})")


#: Model names of families with a SwiGLU MLP and RMSNorm (Touvron et al. 2023 §2.2).
SWIGLU_FAMILIES = ("llama", "mistral", "mixtral", "qwen", "gemma", "deepseek", "yi-")


def _is_swiglu(row: dict) -> bool:
    # A Llama-family model name, or a row whose notes say SwiGLU (the notes may name other
    # models in passing, so family names count only in the model cell).
    name = row["model"].lower()
    return any(f in name for f in SWIGLU_FAMILIES) or "swiglu" in name + \
        row.get("notes", "").lower()


def _zero_stage(cell: str) -> int | None:
    """The ZeRO stage a ``zero_stage`` cell names; None for DDP that does not say whether
    the optimizer is sharded (the framework family's default applies).

    >>> [_zero_stage(c) for c in ("0", "1.0", "ZeRO-2", "FSDP FULL_SHARD", "HSDP",
    ...                           "distributed optimizer", "SHARD_GRAD_OP")]
    [0, 1, 2, 3, 3, 1, 2]
    >>> _zero_stage("DDP (table FSDP=0; optimizer sharding not read)") is None
    True

    Raises:
        PlanError: the cell names no stage.
    """
    low = re.sub(r"fsdp\s*=\s*0", "", cell.lower())   # "DDP (table FSDP=0 ...)" is not FSDP
    if "grad_op" in low:
        return 2                    # FSDP SHARD_GRAD_OP: gradients and optimizer states
    if "fsdp" in low or "full_shard" in low or "hsdp" in low:
        return 3
    if "distributed" in low:
        return 1                    # Megatron's distributed optimizer shards Adam states
    digits = re.findall(r"\d+", low)
    if digits and int(digits[0]) in (0, 1, 2, 3):
        return int(digits[0])
    if low.startswith("ddp"):
        return None                 # DDP, optimizer sharding not stated: the family default
    raise PlanError(f"zero_stage={cell!r} names no ZeRO stage; use 0-3, 'ZeRO-N' or 'FSDP ...'")


def _degrees(row: dict, flags: list[str]) -> tuple[int, int, int, int]:
    # (tp, cp, pp, dp); an empty tp, cp or pp is 1 and an empty dp fills num_gpus, flagged.
    def degree(name: str) -> int | None:
        value = _num(row.get(name, ""))
        return int(value) if value else None

    tp, cp, pp, dp = (degree(k) for k in ("tp", "cp", "pp", "dp"))
    for name, value in (("tp", tp), ("pp", pp)):
        if value is None:
            flags.append(f"{name}=1 (default)")
    tp, cp, pp = tp or 1, cp or 1, pp or 1
    if dp is None:
        gpus = int(row["num_gpus"])
        if gpus % (tp * cp * pp):
            raise PlanError(f"dp is empty and num_gpus={gpus} is not a multiple of tp*cp*pp = "
                            f"{tp * cp * pp}; give dp")
        dp = gpus // (tp * cp * pp)
        flags.append(f"dp={dp} (num_gpus / (tp*cp*pp))")
    return tp, cp, pp, dp


def _published_case(row: dict) -> RunCase:
    reason = missing_cell(row) or unsupported_reason(row)
    if reason:
        raise PlanError(reason)
    fw, flags = pick_framework(row)
    d, recipe_notes = fw.settings(row)
    if flags:  # no known framework: the attention kernel is not known either
        d.pop("attention_kernel", None)
    else:                           # a fallback's flag already names the family and its file
        flags.append(f"framework={fw.name} (presets/frameworks/{fw.name}.yaml)")
    flags += [f"{fw.name} {n}" for n in recipe_notes]
    h, a, layers = int(row["hidden"]), int(row["heads"]), int(row["layers"])
    kv = _num(row["kv_heads"])
    swiglu = _is_swiglu(row)
    llama3 = swiglu and re.search(r"llama[\s_-]*3", row["model"].lower()) is not None
    if kv is None and llama3:
        kv = 8
        flags.append("kv_heads=8 (default: every Llama 3 size)")
    ffn = _num(row["ffn_hidden"])
    if ffn is None and llama3:
        # Llama 3 8B and 70B: 3.5h (14,336 and 28,672; Dubey et al. 2024, Table 3).
        ffn = 7 * h // 2
        flags.append(f"ffn_hidden={int(ffn)} (default: Llama 3 3.5h)")
    elif ffn is None and swiglu:
        # Llama's rule: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023).
        ffn = -(-(8 * h // 3) // 256) * 256
        flags.append(f"ffn_hidden={int(ffn)} (default: Llama 8h/3 rounded to 256)")
    elif ffn is None:
        flags.append("ffn_hidden=4h (default)")
    if swiglu:
        flags.append("activation=swiglu, norm=rmsnorm (Llama-family model)")
    vocab = _num(row["vocab"])
    if vocab is None:
        vocab = d.get("vocab") or (128256 if llama3 else 32000 if swiglu else 51200)
        flags.append(f"vocab={vocab} (default)")
    tp, cp, pp, dp = _degrees(row, flags)
    gb = int(row["global_batch"])
    mb = _num(row["micro_batch"])
    sc21 = SC21_TABLE_1.get((h, layers)) if "Table 1" in row["table"] and \
        "Narayanan" in row["source"] else None
    if mb is None and sc21:
        mb = sc21[0]
        flags.append(f"micro_batch={mb} (examples/sc21/run_table_1.sh)")
    elif mb is None:
        mb = gb // dp if d["micro_batch"] == "per-gpu-batch" else int(d["micro_batch"])
        flags.append(f"micro_batch={int(mb)} (default)")
    # the words `malformed_cell` accepts; an empty cell (or a CPU offload) is the default
    rec = (row["recompute"] or "").strip()
    recompute = RECOMPUTE_WORDS.get(first_word(rec))
    if recompute is None:
        recompute = d["recompute"]
        flags.append(f"recompute={recompute} (default for {fw.name} rows)")
    block_layers = block_recompute_layers(rec) if recompute == "full" else 0
    sp = SEQUENCE_PARALLEL_WORDS.get(first_word(row["sequence_parallel"]))
    if sp is None:
        sp = bool(d["sequence_parallel"]) and tp > 1
        if tp > 1:
            flags.append(f"sequence_parallel={sp} (default)")
    else:
        sp = sp and tp > 1
    z_cell = (row["zero_stage"] or "").strip()
    zero = _zero_stage(z_cell) if z_cell else None
    if zero is None:
        zero = int(d["zero_stage"])
        if zero and dp > 1:
            flags.append(f"zero_stage={zero} (default)")
    vpp = _num(row["vpp"])
    v = int(vpp) if vpp else 1
    if vpp is None and sc21 and pp > 1:
        v = layers // pp // sc21[1] if sc21[1] else 1
        flags.append(f"virtual_stages={v} (examples/sc21/run_table_1.sh)")
    elif vpp is None and pp > 1 and d["interleave_flag"]:
        flags.append("no interleaving (default)")
    experts, moe_flags = moe_fields(row)
    flags += moe_flags
    model = ModelSpec(name=row["model"], num_layers=layers, hidden=h, num_heads=a,
                      num_kv_heads=int(kv) if kv else a,
                      ffn_hidden=int(ffn) if ffn else 4 * h, vocab_size=int(vocab),
                      seq_len=int(row["seq_len"]), activation="swiglu" if swiglu else "gelu",
                      norm="rmsnorm" if swiglu else "layernorm", **experts)
    if d["stage_split"] == "deepspeed" and pp > 1:
        split = deepspeed_split(layers, pp)
        flags.append(f"stage_layers={list(split)} (DeepSpeed partition, embedding = 1 layer)")
    else:
        split = balanced_split(layers, pp * v)
        if split:
            flags.append(f"stage_layers={list(split)}")
    overlap = sc21[2] if sc21 else bool(d["overlap_dp"])
    if sc21:
        flags.append(f"gradient all-reduce {'overlapped' if overlap else 'after backward'}"
                     " (examples/sc21/run_table_1.sh)")
    dtype, dtype_flags = row_dtype(row, d["dtype"])
    flags += dtype_flags
    plan = Plan(tp=tp, pp=pp, dp=dp, cp=cp, micro_batch=int(mb), global_batch=gb,
                schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v,
                recompute=recompute, recompute_num_layers=block_layers, zero_stage=zero,
                sequence_parallel=sp, dtype=dtype, stage_layers=split, ep=row_ep(row))
    check_experts(model, plan)
    options, moe_flags = moe_options(row, framework_options(fw, d, overlap_dp=overlap))
    flags += moe_flags
    cluster, gpu_flags = gpu_cluster(row, d.get("cluster"))
    flags += gpu_flags
    nodes = gpu_nodes(cluster, int(row["num_gpus"]))
    flags += attention_kernel_flags(options, validation_cluster(cluster, nodes).device.name)
    if not rec:
        device = validation_cluster(cluster, nodes).device
        plan, options, fit_flag = recompute_that_fits(
            model, plan, options, device.memory_bytes,
            block_scaled=block_scaled_device(device.peak_flops))
        flags += [fit_flag] if fit_flag else []
    return RunCase(id=row["id"], model=model, plan=plan, cluster_name=cluster,
                   nodes=nodes, options=options,
                   overlap_dp=overlap, reference_step_time_s=float(row["ref_step_time_s"]),
                   flags=tuple(flags), source=source_key(row["source"]))


def attention_kernel_flags(options: SimOptions, device: str) -> list[str]:
    """One flag naming the attention kernel a case runs on ``device`` and its rate (none for
    unfused attention or a framework that names no kernel).

    >>> attention_kernel_flags(SimOptions(attention_kernel="sdpa"), "h100-sxm-80gb")
    ['attention: fa2 on hopper at 32.7% of peak (sdpa; presets/attention_kernels.yaml)']
    >>> attention_kernel_flags(SimOptions(attention_kernel="sdpa"), "a100-sxm-80gb")
    ['attention: sdpa has no published rate on a100-sxm-80gb: efficiency.yaml flash_fraction']
    """
    kernel = options.attention_kernel
    if kernel is None or options.attention == "unfused":
        return []
    rate = attention_kernel_rate(kernel, device)
    if rate is None:
        return [f"attention: {kernel} has no published rate on {device}: efficiency.yaml "
                f"flash_fraction"]
    return [f"attention: {rate.kernel} on {rate.generation} at {rate.fraction:.1%} of peak "
            f"({kernel}; presets/attention_kernels.yaml)"]


def framework_options(fw: Framework, settings: dict, *, overlap_dp: bool) -> SimOptions:
    """The `SimOptions` of framework family ``fw`` with ``settings`` (its defaults with the
    row's recipes applied, `Framework.settings`) and its fitted parameters (``fitted`` in
    ``efficiency.yaml``); the gradient bucket applies only when the reduction overlaps the
    backward (``overlap_dp``), else the stage's gradients go in one reduction.

    >>> from simulator.validation.frameworks import framework
    >>> fw = framework("deepspeed-zero")
    >>> o = framework_options(fw, dict(fw.defaults), overlap_dp=False)
    >>> o.zero3_prefetch_params, o.zero3_overlap_reduce, o.dp_bucket_bytes
    (50000000.0, False, None)
    """
    values = {k: settings[k] for k in OPTION_KEYS}
    values.update({k: settings[k] for k in OPTIONAL_OPTION_KEYS if k in settings})
    if values["zero3_prefetch_params"] is not None:
        values["zero3_prefetch_params"] = float(values["zero3_prefetch_params"])
    if values.get("recompute_modules") is not None:     # a YAML list; options are hashed
        values["recompute_modules"] = tuple(values["recompute_modules"])
    bucket = settings["dp_bucket_bytes"]
    return SimOptions(**load_framework(fw.fitted), **values,
                      dp_bucket_bytes=float(bucket) if overlap_dp and bucket else None)


def megatron_padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """The embedding rows Megatron allocates for ``vocab`` tokens: padded up to a multiple of
    ``divisible_by · tp`` (``--make-vocab-size-divisible-by``, default 128), so each TP rank
    holds an equal, aligned share of the logits GEMM.

    >>> megatron_padded_vocab(50257, 1), megatron_padded_vocab(50257, 8)
    (50304, 51200)
    """
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _vtrain_case(row: dict, index: int, prefix: str) -> RunCase:
    h, a, layers = int(row["hidden size"]), int(row["attention heads"]), int(row["# layers"])
    tp, pp, dp = (int(row[k]) for k in ("tensor parallelism", "pipeline parallelism",
                                        "data parallelism"))
    model = ModelSpec(name=f"GPT h{h} L{layers}", num_layers=layers, hidden=h, num_heads=a,
                      num_kv_heads=a, ffn_hidden=4 * h, vocab_size=megatron_padded_vocab(50257, tp),
                      seq_len=int(row["sequence length"]), activation="gelu")
    split = balanced_split(layers, pp)
    plan = Plan(tp=tp, pp=pp, dp=dp, micro_batch=int(row["micro batch"]),
                global_batch=int(row["global batch"]), recompute="full", dtype="fp16",
                stage_layers=split)
    gpus = int(row["# GPUs"])
    fw = framework("megatron-deepspeed")
    settings, _ = fw.settings({"source": "Megatron-DeepSpeed", "table": "vTrain ground truth"})
    return RunCase(id=f"{prefix}{index:03d}", model=model, plan=plan,
                   cluster_name=settings["cluster"], nodes=math.ceil(gpus / 8),
                   options=framework_options(fw, settings, overlap_dp=False),
                   overlap_dp=False,
                   reference_step_time_s=float(row["iteration time (ms)"]) / 1e3,
                   source=VTRAIN_SOURCE,
                   flags=(f"stage_layers={list(split)}",) if split else ())


def read_runs(path: str | Path, skipped: list[dict] | None = None) -> list[RunCase]:
    """The reference runs of a published-runs or vTrain ground-truth CSV (detected by header).

    Args:
        skipped: when given, a row that cannot be simulated (a GPU without a device profile,
            an empty or malformed required cell, a split that does not fit the model) is
            appended to it as ``{"id", "reason"}`` instead of raising.
    Raises:
        PlanError: the header matches neither format, or (``skipped`` not given) a row is bad.
    """
    path = Path(path)
    if not path.exists():
        raise PlanError(f"--runs {str(path)!r}: no such file; give published_runs.csv or a "
                        f"vTrain ground_truth_*.csv (e.g. ../shared/data/published_runs.csv)")
    reader = csv.DictReader(io.StringIO(read_text(path, "--runs"), newline=""))
    rows, lines = [], []
    for row in reader:
        rows.append(row)
        lines.append(reader.line_num)     # the line the row ends on (a cell may hold newlines)
    columns = list(reader.fieldnames or [])
    header = set(columns)
    if "ref_step_time_s" in header:
        # a mistake in a cell refuses the table before any row is simulated
        seen: dict[str, int] = {}
        for r, line in zip(rows, lines, strict=True):
            if (problem := table_row_problem(r, line, seen)) is not None:
                raise PlanError(f"{path.name} line {line}: {problem}")
            if (problem := malformed_cell(r)) is not None:
                raise PlanError(f"{path.name} {r['id']}: {problem}")
        make = [(r.get("id") or f"row {i + 2}", lambda r=r: _published_case(r))
                for i, r in enumerate(rows)]
    elif "iteration time (ms)" in header:
        prefix = "m" if "Parameters (billion)" in header else "s"
        make = [(f"{prefix}{i:03d}", lambda r=r, i=i: _vtrain_case(r, i, prefix))
                for i, r in enumerate(rows)]
    else:
        shown = columns[:8] + (["..."] if len(columns) > 8 else [])
        raise PlanError(f"{path.name}: header {','.join(shown) or '(empty file)'} is neither "
                        f"the published-runs table (a ref_step_time_s column) nor a vTrain "
                        f"table (an 'iteration time (ms)' column); give one of those tables "
                        f"(e.g. ../shared/data/published_runs.csv)")
    cases = []
    for row_id, build in make:
        try:
            cases.append(build())
        except (PlanError, ValueError, TypeError) as exc:
            if skipped is None:
                raise PlanError(f"{path.name} {row_id}: {exc}") from None
            skipped.append({"id": row_id, "reason": str(exc)})
    return cases


def _predict(case: RunCase, *, fast: bool = False) -> float:
    cluster = validation_cluster(case.cluster_name, case.nodes)
    run = estimate if fast else simulate
    return run(case.model, case.plan, cluster, overlap_dp=case.overlap_dp,
               options=case.options).step_time_s


def predict(case: RunCase, *, fast: bool = False) -> float:
    """Simulated step time of ``case`` on its cluster, in seconds (``fast``: the closed-form
    `estimate` instead of the SimPy run, for fitting).

    Raises:
        PlanError: the row's plan cannot be simulated; the message names the row id (a fit
            over a whole table stops on it).
    """
    try:
        return _predict(case, fast=fast)
    except PlanError as exc:
        raise PlanError(f"row {case.id}: {exc}; fix the row or remove it from the table") \
            from None


def validate_runs(path: str | Path, keep: Callable[[RunCase], bool] | None = None) -> dict:
    """Predicted vs reference step time of every row (or of the rows ``keep`` accepts, e.g.
    the context-parallel ones), with MAPE and the worst row.

    Returns ``{"rows": [{"id", "model", "num_gpus", "tp", "pp", "dp", "cp", "seq_len",
    "predicted_step_time_s", "reference_step_time_s", "rel_error", "flags"}, ...],
    "mape", "mean_error", "max_abs_rel_error", "spearman", "skipped": [{"id", "reason"},
    ...]}`` (the figures of `simulator.validation.report.error_summary`); rel_error =
    predicted / reference − 1. Rows that cannot be simulated are listed in
    ``skipped`` with the reason and left out of the MAPE.

    Raises:
        PlanError: the file is neither format, a cell is malformed (`malformed_cell`), it
            has no rows, or no row could be simulated (the reasons of the first three).
    """
    rows: list[dict] = []
    skipped: list[dict] = []
    for case in read_runs(path, skipped):
        if keep is not None and not keep(case):
            continue
        try:
            pred = _predict(case)
        except PlanError as exc:
            skipped.append({"id": case.id, "reason": str(exc)})
            continue
        ref = case.reference_step_time_s
        p = case.plan
        rows.append({"id": case.id, "model": case.model.name, "num_gpus": p.world_size,
                     "tp": p.tp, "pp": p.pp, "dp": p.dp, "cp": p.cp,
                     "seq_len": case.model.seq_len, "predicted_step_time_s": pred,
                     "reference_step_time_s": ref, "rel_error": rel_error(pred, ref),
                     "flags": list(case.flags)})
    if not rows and not skipped and keep is None:
        raise PlanError(f"{Path(path).name} has a header but no rows; add one row per run "
                        f"under the header (../shared/data/published_runs.csv shows the "
                        f"columns, one measured run a line)")
    if not rows and skipped and keep is None:
        raise PlanError(f"{Path(path).name}: no row could be simulated; "
                        + "; ".join(f"{s['id']}: {s['reason']}" for s in skipped[:3])
                        + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""))
    report = error_summary(rows)
    return {"rows": rows, "mape": report["mape"] or 0.0,
            "mean_error": report["mean_error"] or 0.0,
            "max_abs_rel_error": report["max_abs_rel_error"] or 0.0,
            "spearman": report["spearman"], "skipped": skipped}


#: Fields `error_by` can group rows by: plan fields, model fields, and the GPU count.
GROUP_FIELDS = ("tp", "cp", "pp", "dp", "micro_batch", "virtual_stages", "recompute",
                "zero_stage", "hidden", "num_layers", "num_heads", "seq_len", "num_gpus",
                "cluster", "precision", "gpu")


def error_by(path: str | Path, fields: tuple[str, ...], result: dict | None = None):
    """Mean signed error, MAPE, spread and row count of a runs table grouped by ``fields``.

    A model that is right on average but wrong by configuration shows a bias per group with a
    small spread inside it. Returns a pandas DataFrame indexed by ``fields`` with columns
    ``rows``, ``bias`` (mean rel_error), ``mape`` and ``spread`` (standard deviation of
    rel_error), plus ``mape_if_unbiased``: the table's MAPE once each group's bias is removed
    (in ``DataFrame.attrs``).

    Raises:
        PlanError: a field is not one of `GROUP_FIELDS`.
    """
    import pandas as pd
    bad = [f for f in fields if f not in GROUP_FIELDS]
    if bad or not fields:
        raise PlanError(f"--by {','.join(bad) or '(empty)'}: group by any of "
                        f"{', '.join(GROUP_FIELDS)}")
    result = result or validate_runs(path)
    cases = {c.id: c for c in read_runs(path, [])}
    records = []
    for row in result["rows"]:
        c = cases[row["id"]]
        values = {"num_gpus": row["num_gpus"], "cluster": c.cluster_name,
                  "precision": c.plan.dtype,
                  "gpu": validation_cluster(c.cluster_name, c.nodes).device.name}
        for f in fields:
            if f not in values:
                values[f] = getattr(c.plan, f) if hasattr(c.plan, f) else getattr(c.model, f)
        records.append({**{f: values[f] for f in fields}, "rel_error": row["rel_error"]})
    df = pd.DataFrame(records)
    groups = df.groupby(list(fields))["rel_error"]
    out = pd.DataFrame({"rows": groups.size(), "bias": groups.mean(),
                        "mape": groups.apply(lambda e: e.abs().mean()),
                        "spread": groups.std(ddof=0)})
    out.attrs["mape_if_unbiased"] = float((df["rel_error"] - groups.transform("mean"))
                                          .abs().mean())
    return out

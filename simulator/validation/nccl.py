"""Predicted vs measured collective bandwidth: nccl-tests all-reduce files and published
DGX figures (docs/validation.md, "Collectives").

Run ``python -m simulator.validation.nccl [FOLDER]`` (default ``../shared/data/vtrain/
nccl_allreduce_a100`` relative to the repository root) to print the tables.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd

from simulator.network.cluster import load_cluster
from simulator.network.collectives import collective_cost

DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"
NCCL_DIR = DATA_DIR / "vtrain" / "nccl_allreduce_a100"
#: Sizes at or above this get the ±10% target, below it ±25%.
LARGE_BYTES = 16 * 2**20

#: Published figures: (name, cluster, nodes, op, devices, size, algorithm, busbw B/s, source).
PUBLISHED = [
    ("DGX H100 8 GPUs ring", "dgx-h100", 1, "all_reduce", list(range(8)), 2**30, "ring",
     370e9, "NVIDIA nccl-tests on DGX H100 (NVLS disabled), ~370 GB/s busbw"),
    ("DGX H100 8 GPUs NVLink SHARP", "dgx-h100", 1, "all_reduce", list(range(8)), 2**30,
     "auto", 480e9, "NVIDIA NCCL 2.17+ NVLS all-reduce on DGX H100, ~480 GB/s busbw"),
    ("HDR 200 Gb/s NIC, 1 GPU per node", "dgx-a100", 2, "all_reduce", [0, 8], 2**30, "auto",
     24e9, "nccl-tests over one 200 Gb/s HDR NIC: ~24 GB/s"),
    ("HDR, 2 DGX A100 (16 GPUs, 8 NICs each)", "dgx-a100", 2, "all_reduce", list(range(16)),
     2**30, "auto", 8 * 24e9, "8 HDR NICs per node at ~24 GB/s each"),
    ("NDR 400 Gb/s NIC, 1 GPU per node", "dgx-h100", 2, "all_reduce", [0, 8], 2**30, "auto",
     47.5e9, "nccl-tests over one 400 Gb/s NDR NIC: 46-49 GB/s"),
    ("NDR, 2 DGX H100 (16 GPUs, 8 NICs each)", "dgx-h100", 2, "all_reduce", list(range(16)),
     2**30, "auto", 8 * 47.5e9, "8 NDR NICs per node at 46-49 GB/s each"),
]


def read_nccl_tests_csv(path: str | Path) -> pd.DataFrame:
    """An nccl-tests CSV as ``size_bytes, time_s, busbw_Bps`` (out-of-place columns)."""
    raw = pd.read_csv(path)
    return pd.DataFrame({"size_bytes": raw.iloc[:, 0].astype(float),
                         "time_s": raw.iloc[:, 3].astype(float) * 1e-9,
                         "busbw_Bps": raw.iloc[:, 4].astype(float) * 1e9})


def allreduce_validation(folder: str | Path = NCCL_DIR,
                         cluster_name: str = "dgx-a100") -> pd.DataFrame:
    """Every row of every ``allreduce_<n>gpu.csv`` beside its prediction on one node of
    ``cluster_name`` (``error`` = predicted / measured busbw - 1)."""
    cluster = load_cluster(cluster_name)
    frames = []
    for path in sorted(Path(folder).glob("allreduce_*gpu.csv")):
        n = int(re.search(r"(\d+)gpu", path.name).group(1))
        df = read_nccl_tests_csv(path)
        pred = [collective_cost(cluster, "all_reduce", s, range(n)) for s in df["size_bytes"]]
        df["file"], df["n"] = path.name, n
        df["predicted_busbw_Bps"] = [c.busbw_Bps for c in pred]
        df["predicted_time_s"] = [c.time_s for c in pred]
        df["protocol"] = [c.protocol for c in pred]
        df["error"] = df["predicted_busbw_Bps"] / df["busbw_Bps"] - 1
        frames.append(df)
    if not frames:
        raise FileNotFoundError(f"no allreduce_<n>gpu.csv files in {folder}")
    return pd.concat(frames, ignore_index=True)


def error_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per file: max |error| at >= 16 MiB and below, and the mean |error|."""
    large = table["size_bytes"] >= LARGE_BYTES
    rows = []
    for name, group in table.groupby("n"):
        big = large[group.index]
        rows.append({"file": group["file"].iloc[0], "n": name, "rows": len(group),
                     "max_abs_error_large": group["error"][big].abs().max(),
                     "max_abs_error_small": group["error"][~big].abs().max(),
                     "mean_abs_error": group["error"].abs().mean()})
    return pd.DataFrame(rows)


def published_checks() -> pd.DataFrame:
    """Predicted vs published busbw for the figures in `PUBLISHED`."""
    rows = []
    for name, cluster_name, nodes, op, devices, size, algo, busbw, source in PUBLISHED:
        cost = collective_cost(load_cluster(cluster_name, nodes=nodes), op, size, devices,
                               algorithm=algo)
        rows.append({"case": name, "algorithm": cost.algorithm,
                     "predicted_busbw_Bps": cost.busbw_Bps, "published_busbw_Bps": busbw,
                     "error": cost.busbw_Bps / busbw - 1, "source": source})
    return pd.DataFrame(rows)


def to_markdown(df: pd.DataFrame, fmt: str = ".3f", index: bool = False) -> str:
    """A DataFrame as a markdown table (floats with ``fmt``)."""
    df = df.reset_index() if index else df
    cells = [[format(v, fmt) if isinstance(v, float) else str(v) for v in row]
             for row in df.itertuples(index=False)]
    lines = ["| " + " | ".join(map(str, df.columns)) + " |",
             "|" + "|".join("---" for _ in df.columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def main(argv: list[str] | None = None) -> int:
    """Print the validation tables (markdown)."""
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0]) if argv else NCCL_DIR
    table = allreduce_validation(folder)
    summary = error_summary(table)
    print(to_markdown(summary))
    large = table["size_bytes"] >= LARGE_BYTES
    print(f"\nall files: max |error| >= 16 MiB {table['error'][large].abs().max():.3f}, "
          f"< 16 MiB {table['error'][~large].abs().max():.3f}, "
          f"mean {table['error'].abs().mean():.4f} over {len(table)} rows")
    picks = table[table["size_bytes"].isin([2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20,
                                            256 * 2**20, 2**30])]
    wide = picks.assign(MiB=(picks["size_bytes"] // 2**20).astype(int)).pivot_table(
        index="MiB", columns="n", values="error")
    print("\nerror (predicted / measured busbw - 1) by size and GPU count\n")
    print(to_markdown(wide, "+.3f", index=True))
    pub = published_checks()
    pub = pub.assign(predicted_GBps=pub["predicted_busbw_Bps"] / 1e9,
                     published_GBps=pub["published_busbw_Bps"] / 1e9)
    print()
    print(to_markdown(pub[["case", "algorithm", "predicted_GBps", "published_GBps", "error"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The zero-bubble paper's throughput table beside the simulator's: 1F1B, ZB-1p, ZB-2p.

    python benchmarks/zero_bubble_bench.py [--json]

Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024), Table 3 settings and Table 4
samples per GPU per second (`simulator.validation.zero_bubble_paper`), each simulated with
SimPy (ZB-1p as ZB-H1, ZB-2p as ZB-H2, both with optimizer post-validation). Prints the
published and simulated throughputs, the error of each simulated figure and whether the
simulated 1F1B < ZB-1p < ZB-2p ordering matches the published one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulator.validation.zero_bubble_paper import zero_bubble_rows  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = zero_bubble_rows()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'model':>6} {'m':>4} | {'1F1B pub':>8} {'sim':>6} {'err':>6} | {'ZB-1p pub':>9} "
          f"{'sim':>6} {'err':>6} | {'ZB-2p pub':>9} {'sim':>6} {'err':>6} | order")
    errors = []
    for r in rows:
        cells = []
        for key in ("1f1b", "zb1p", "zb2p"):
            pub, sim = r[f"published_{key}"], r[f"simulated_{key}"]
            errors.append(abs(sim / pub - 1))
            cells.append(f"{pub:{9 if key != '1f1b' else 8}.2f} {sim:6.2f} "
                         f"{100 * (sim / pub - 1):+5.1f}%")
        print(f"{r['model']:>6} {r['microbatches']:>4} | " + " | ".join(cells)
              + f" | {'ok' if r['ordering_matches'] else 'WRONG'}")
    matched = sum(r["ordering_matches"] for r in rows)
    print(f"ordering 1F1B < ZB-1p < ZB-2p matches in {matched}/{len(rows)} settings; "
          f"MAPE {100 * sum(errors) / len(errors):.1f}% over {len(errors)} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())

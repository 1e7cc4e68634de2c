"""The zero-bubble paper's throughput table beside the simulator's: 1F1B and ZB-1p (ZB-H1).

    python benchmarks/zero_bubble_bench.py [--json]

Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024), Table 3 settings and Table 4
samples per GPU per second (`simulator.validation.zero_bubble_paper`), each simulated with
SimPy. Prints the published and simulated throughputs, the ZB-1p / 1F1B speed-ups, the error of
each simulated figure and whether the simulated ordering matches the published one.
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
          f"{'sim':>6} {'err':>6} | {'speed-up pub':>12} {'sim':>6} | order")
    errors = []
    for r in rows:
        e1 = r["simulated_1f1b"] / r["published_1f1b"] - 1
        e2 = r["simulated_zb1p"] / r["published_zb1p"] - 1
        errors += [abs(e1), abs(e2)]
        print(f"{r['model']:>6} {r['microbatches']:>4} | {r['published_1f1b']:8.2f} "
              f"{r['simulated_1f1b']:6.2f} {100 * e1:+5.1f}% | {r['published_zb1p']:9.2f} "
              f"{r['simulated_zb1p']:6.2f} {100 * e2:+5.1f}% | "
              f"{r['published_zb1p'] / r['published_1f1b']:12.3f} "
              f"{r['simulated_zb1p'] / r['simulated_1f1b']:6.3f} | "
              f"{'ok' if r['ordering_matches'] else 'WRONG'}")
    matched = sum(r["ordering_matches"] for r in rows)
    print(f"ordering 1F1B < ZB-1p matches in {matched}/{len(rows)} settings; "
          f"MAPE {100 * sum(errors) / len(errors):.1f}% over {len(errors)} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())

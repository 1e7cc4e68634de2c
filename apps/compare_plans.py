"""The plans `meshplan compare` runs on this machine, in a module of their own so that
`meshplan compare --help` counts them without loading the comparison's libraries."""

from __future__ import annotations

#: The second model shape of the sweep: wider and shallower than tiny-gpt, shorter sequences.
WIDE_CHANGES = {"name": "tiny-gpt-wide", "num_layers": 2, "hidden": 512, "num_heads": 8,
                "num_kv_heads": 8, "ffn_hidden": 2048, "seq_len": 64}
#: The sweep: (model, plan fields) over world sizes 1, 2 and 4: DP, TP, PP, their pairs,
#: micro-batch counts, recomputation on and off, ZeRO-3, a zero-bubble schedule, context
#: parallelism.
SWEEP: list[tuple[str, dict]] = [
    ("tiny-gpt", {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 8}),
    ("tiny-gpt", {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 2}),
    ("tiny-gpt", {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 8, "recompute": "full"}),
    ("tiny-gpt", {"tp": 1, "pp": 1, "dp": 2, "micro_batch": 4}),
    ("tiny-gpt", {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 8}),
    ("tiny-gpt", {"tp": 1, "pp": 2, "dp": 1, "micro_batch": 2}),
    ("tiny-gpt", {"tp": 1, "pp": 2, "dp": 1, "micro_batch": 2, "recompute": "full"}),
    ("tiny-gpt", {"tp": 1, "pp": 1, "dp": 2, "micro_batch": 4, "zero_stage": 3}),
    ("tiny-gpt", {"tp": 1, "pp": 1, "dp": 4, "micro_batch": 2}),
    ("tiny-gpt", {"tp": 2, "pp": 1, "dp": 2, "micro_batch": 4}),
    ("tiny-gpt", {"tp": 1, "pp": 4, "dp": 1, "micro_batch": 1}),
    ("tiny-gpt", {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 2}),
    ("tiny-gpt", {"tp": 1, "pp": 2, "dp": 2, "micro_batch": 2}),
    ("tiny-gpt", {"tp": 4, "pp": 1, "dp": 1, "micro_batch": 8}),
    ("tiny-gpt-wide", {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 4}),
    ("tiny-gpt-wide", {"tp": 1, "pp": 1, "dp": 2, "micro_batch": 2}),
    ("tiny-gpt-wide", {"tp": 1, "pp": 2, "dp": 1, "micro_batch": 2}),
    # zero bubble: ZB-V, 4 one-layer chunks in a V over 2 ranks (Qi et al. 2024 §6)
    ("tiny-gpt", {"tp": 1, "pp": 2, "dp": 1, "micro_batch": 2, "schedule": "zb-v",
                  "virtual_stages": 2}),
    # context parallelism: ring attention over 2 ranks, each holding half of every sequence
    ("tiny-gpt", {"tp": 1, "pp": 1, "dp": 1, "cp": 2, "micro_batch": 4}),
]
#: `meshplan compare` without --sweep: the baseline, one plan per parallelism and a
#: zero-bubble pipeline and a context-parallel plan (6 runs).
DEFAULT_PLANS = (0, 3, 4, 5, 17, 18)
#: The reduced set the tests run: 1 rank, DP and PP on 2 ranks.
REDUCED_PLANS = (0, 3, 5)

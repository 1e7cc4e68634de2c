"""Ring attention over cp gloo ranks against float64 SDPA on the whole sequence.

The reference is ``scaled_dot_product_attention(is_causal=True)`` on the full (B, H, T, d)
tensors in one process; each rank's output rows and q/k/v gradients at its load-balanced
positions (chunks i and 2·cp − 1 − i) must match it within 1e-6 (float64 throughout, so the
only error is the order of the float64 sums).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.launch import free_port
from runtime.ring_attention import load_balanced_indices, shard_sequence

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-6


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_sdpa_in_float64(cp, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "tests" / "runtime" / "ring_worker.py"), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(cp):
        for case in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            assert case.pop("dtype_ok")
            for name, err in case.items():
                assert err <= TOL, f"cp={cp} rank {rank} {name}: max error {err:.3g} > {TOL}"


def test_load_balanced_chunks_cover_the_sequence_once():
    # chunks i and 2cp-1-i (hand-listed for cp=4, T=16: chunk length 2)
    assert load_balanced_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    every = torch.cat([load_balanced_indices(16, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    x = torch.arange(32).view(2, 16)
    assert shard_sequence(x, 4, 3).tolist() == [[6, 7, 8, 9], [22, 23, 24, 25]]
    with pytest.raises(ValueError, match="seq_len=12 is not divisible by 2\\*cp = 8"):
        load_balanced_indices(12, 4, 0)

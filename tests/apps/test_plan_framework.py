"""`meshplan plan --framework`: every plan costed with a framework family's options, and the
family named in the header."""

from __future__ import annotations

import subprocess
import sys

from apps.cmd_plan import DEFAULT_FRAMEWORK_LINE, framework_names, framework_search_kwargs
from simulator.validation.frameworks import load_frameworks


def test_the_choices_are_the_framework_files():
    # one home: the families the validation reader loads
    assert framework_names() == sorted(fw.name for fw in load_frameworks())


def test_torchtitan_costs_async_tp_fp32_reduce_and_overlapped_reduction():
    # presets/frameworks/torchtitan.yaml: tp_overlap_kind async-tp, grad_reduce_bytes 4,
    # overlap_dp true, attention through PyTorch's SDPA
    kw = framework_search_kwargs("torchtitan")
    assert kw["overlap_dp"] is True
    assert kw["options"].tp_overlap_kind == "async-tp"
    assert kw["options"].grad_reduce_bytes == 4
    assert kw["options"].attention_kernel == "sdpa"


def test_the_header_names_the_framework():
    def header(*extra):
        proc = subprocess.run([sys.executable, "-m", "apps.cli", "plan", "--model", "tiny-gpt",
                               "--cluster", "localhost-cpu", "--top", "1", *extra],
                              capture_output=True, text=True, check=True)
        return " ".join(proc.stderr.split())

    assert " ".join(DEFAULT_FRAMEWORK_LINE.split()) in header()
    assert "framework: megatron-core (presets/frameworks/megatron-core.yaml" in \
        header("--framework", "megatron-core")

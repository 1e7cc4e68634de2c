"""`meshplan run` refuses a plan whose precision this machine cannot train, before any worker
starts (an FP8 plan used to run silently as fp32 on a CPU)."""

import pytest

from apps.cli import main
from runtime.precision import float8_linear_filter, runtime_dtype_error


@pytest.fixture
def no_workers(monkeypatch):
    import runtime.launch
    calls = []
    monkeypatch.setattr(runtime.launch, "run_plan", lambda *a, **k: calls.append(k))
    return calls


@pytest.mark.parametrize("dtype", ["fp8", "fp8-current", "mxfp8", "nvfp4"])
def test_low_precision_plan_on_cpu_exits_2_with_one_line(tiny_plan_file, capsys, no_workers,
                                                          dtype):
    path = tiny_plan_file(tp=1, pp=1, dp=2, dtype=dtype)
    assert main(["run", str(path), "--steps", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"dtype={dtype}:" in err and "Traceback" not in err
    assert no_workers == []


def test_reasons_by_machine():
    # torch._scaled_mm runs FP8 from sm_89 (Ada); A100 is sm_80; torchao must be installed.
    assert "sm_80" in runtime_dtype_error("fp8", (8, 0), True)
    assert runtime_dtype_error("fp8-current", (9, 0), True) is None
    assert "pip install 'meshplan[fp8]'" in runtime_dtype_error("fp8", (10, 0), False)
    assert "planned and simulated only" in runtime_dtype_error("nvfp4", (10, 0), True)
    assert runtime_dtype_error("bf16", None, False) is None


def test_output_layer_stays_bf16():
    import torch
    assert not float8_linear_filter(torch.nn.Linear(64, 64), "out")
    assert float8_linear_filter(torch.nn.Linear(64, 128), "layers.3.mlp.w2")

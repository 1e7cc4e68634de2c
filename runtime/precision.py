"""The plan's precision on this machine: whether it can run here, and FP8 training on CUDA.

bf16 / fp16 / fp32 / tf32 plans run as before (`runtime.train.autocast_context`). A
low-precision plan (`planner.precision`) needs the tensor cores of its format: FP8
(``fp8``, ``fp8-current``) a CUDA GPU of compute capability 8.9 or later (Ada, Hopper,
Blackwell: ``torch._scaled_mm``'s requirement) and torchao (``pip install 'meshplan[fp8]'``),
which converts every linear layer of the transformer blocks to float8 training
(``torchao.float8.convert_to_float8_training``; the output layer stays bf16, as the planner
models it). torchao trains with dynamic per-tensor ("tensorwise", current) scaling; a plan
asking for delayed scaling runs with it and says so. MXFP8 and NVFP4 are planned and
simulated, not trained by this runtime. A plan the machine cannot run is refused with the
reason before any worker starts (`runtime_dtype_error`).
"""

from __future__ import annotations

import importlib.util

import torch

from planner.precision import recipe

#: Compute capability from which ``torch._scaled_mm`` runs FP8 GEMMs (Ada Lovelace, sm_89).
FP8_MIN_CAPABILITY = (8, 9)


def runtime_dtype_error(dtype: str, capability: tuple[int, int] | None,
                        torchao_available: bool) -> str | None:
    """Why this machine cannot train a plan of ``dtype`` (one line), or None when it can.

    Args:
        capability: the CUDA device's compute capability, None without CUDA.
        torchao_available: torchao can be imported.

    >>> runtime_dtype_error("bf16", None, False) is None
    True
    >>> runtime_dtype_error("fp8", None, True)[:55]
    'dtype=fp8: FP8 training needs a CUDA GPU of compute cap'
    >>> runtime_dtype_error("fp8", (9, 0), True) is None
    True
    """
    r = recipe(dtype)
    if r is None:
        return None
    if r.peak_key != "fp8":
        return (f"dtype={dtype}: the runtime trains fp8 and fp8-current (torchao float8); "
                f"{dtype} plans are planned and simulated only; write dtype: fp8 or bf16 in "
                f"the plan file to run it")
    where = "this machine has no CUDA device" if capability is None else \
        f"this GPU is sm_{capability[0]}{capability[1]}"
    if capability is None or tuple(capability) < FP8_MIN_CAPABILITY:
        return (f"dtype={dtype}: FP8 training needs a CUDA GPU of compute capability >= 8.9 "
                f"(Ada, Hopper, Blackwell) and {where}; run the plan with dtype: bf16 (or "
                f"plan with --dtype bf16)")
    if not torchao_available:
        return (f"dtype={dtype}: FP8 training needs torchao, which is not installed; "
                f"pip install 'meshplan[fp8]'")
    return None


def machine_dtype_error(dtype: str) -> str | None:
    """`runtime_dtype_error` for this machine's first CUDA device and installed packages."""
    capability = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
    return runtime_dtype_error(dtype, capability,
                               importlib.util.find_spec("torchao") is not None)


def float8_linear_filter(module: torch.nn.Module, fqn: str) -> bool:
    """Whether ``convert_to_float8_training`` converts the linear ``fqn``: a linear of a
    transformer block (not the output layer, which stays bf16) whose dimensions are
    multiples of 16 (``torch._scaled_mm``'s alignment).

    >>> float8_linear_filter(torch.nn.Linear(32, 64), "layers.0.attn.wq")
    True
    >>> float8_linear_filter(torch.nn.Linear(32, 64), "out"), \\
    ...     float8_linear_filter(torch.nn.Linear(30, 64), "layers.0.mlp.w1")
    (False, False)
    """
    if not isinstance(module, torch.nn.Linear) or not fqn.startswith("layers."):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: torch.nn.Module, dtype: str) -> None:
    """Convert ``model``'s block linears to torchao float8 training for an FP8 plan (before
    tensor / data parallelism, as torchtitan converts); nothing for any other dtype. Delayed
    scaling (``fp8``) runs with torchao's dynamic per-tensor scaling
    (`runtime.train.plan_notes` says so).

    Raises:
        RuntimeError: the machine cannot run ``dtype`` (`machine_dtype_error`).
    """
    if recipe(dtype) is None:
        return
    problem = machine_dtype_error(dtype)
    if problem:
        raise RuntimeError(problem)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    convert_to_float8_training(model, config=config, module_filter_fn=float8_linear_filter)

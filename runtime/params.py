"""Full (unsharded) parameters of a parallelised model, gathered to rank 0 (``--save-params``).

Every rank turns its parameters into full tensors (``DTensor.full_tensor()`` all-gathers the
TP and FSDP shards), then rank 0 gathers every rank's dictionary (pipeline stages hold
different layers) with ``gather_object``. Names are the single-process model's: the wrapper
prefixes of DDP (``module.``) and ``checkpoint_wrapper`` are dropped, and pipeline stages keep
their global layer numbers, so the result compares key by key with a `runtime.model.Transformer`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """``module.layers.0._checkpoint_wrapped_module.attn.wq.weight`` -> ``layers.0.attn.wq.weight``."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name.removeprefix("module.")                  # DDP


def full_parameters(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters as full CPU tensors (a collective over each DTensor's mesh)."""
    out = {}
    for module in modules:
        for name, p in module.named_parameters():
            t = p.full_tensor() if isinstance(p, DTensor) else p
            out[clean_name(name)] = t.detach().cpu().clone()
    return out


def save_full_parameters(modules: list[nn.Module], path: str | os.PathLike, *,
                         skip: set[str] = frozenset()) -> None:
    """Gather the full parameters of all ranks and ``torch.save`` them from rank 0 to ``path``.

    Every rank must call it (collectives). The file holds ``{name: tensor}`` without the names
    in ``skip``.
    """
    local = full_parameters(modules)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if dist.get_rank() == 0:
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update((k, v) for k, v in part.items() if k not in skip)
        torch.save(merged, path)

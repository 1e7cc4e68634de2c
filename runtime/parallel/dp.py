"""Data parallelism: DDP for models without DTensor parameters; FSDP2 ``fully_shard`` on the dp
sub-mesh when the model is tensor parallel (DDP on a TP model fails in torch 2.13:
"c10d.broadcast_.default does not have a sharding strategy") or when the plan asks for ZeRO
(zero_stage > 0). `gradient_sync` turns the gradient reduction off for accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_dp(model: nn.Module, dp_mesh: DeviceMesh, *, zero_stage: int = 0) -> nn.Module:
    """Data parallelism over ``dp_mesh``: DDP, or FSDP2 for TP models and ZeRO plans.

    FSDP2 shards each block and then the root (torchtitan's recipe); ZeRO-3 reshards the
    parameters after forward, ZeRO-1/2 and TP x DP keep them gathered until backward.
    Parameters marked for DDP to ignore (the expert-parallel experts, `runtime.parallel.ep`)
    are left out of both (``ignored_params``): they are reduced over their own group.

    Returns:
        The DDP wrapper, or ``model`` itself turned into an ``FSDPModule``.
    """
    # parameters DDP is told to ignore (expert-parallel experts, `runtime.parallel.ep`) are
    # reduced elsewhere and do not make the model a DTensor model
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    has_dtensor = any(isinstance(p, DTensor) for name, p in model.named_parameters()
                      if name not in ignored)
    if not has_dtensor and zero_stage == 0:
        return DDP(model, process_group=dp_mesh.get_group())
    reshard = zero_stage == 3
    kept_out = {p for name, p in model.named_parameters() if name in ignored} or None
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=kept_out)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=kept_out)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Turn the DP gradient reduction of one backward on or off (for gradient accumulation).

    DDP: ``no_sync()``; FSDP2: ``set_requires_gradient_sync``; anything else: no-op.
    """
    if isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield

"""Activation recomputation of a `Transformer`'s blocks: ``checkpoint_wrapper`` per block, full
or selective (``create_selective_checkpoint_contexts`` with the policy below).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from runtime.model import Transformer

#: Ops whose outputs selective recomputation keeps (the GEMMs and attention); the cheap
#: elementwise ops and norms between them are recomputed in backward.
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: Transformer, policy: str, num_layers: int = 0) -> Transformer:
    """Activation recomputation of the blocks of ``model`` (one model chunk, in place).

    "full": keep only each block's input, recompute the block in backward
    (``checkpoint_wrapper``, non-reentrant); with ``num_layers`` N > 0 only the chunk's first
    N blocks (`planner.spec.Plan.recompute_num_layers`, Megatron-LM's block method), the
    others keep their activations; "selective": keep GEMM and attention outputs,
    recompute the rest (``create_selective_checkpoint_contexts``); "none": unchanged.
    Apply after `apply_tp` (the TP plan addresses ``attn.wq`` etc. by path) and before `apply_dp`.
    """
    if policy == "none":
        return model
    context_fn = None
    if policy == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    blocks = list(model.layers.items())
    if policy == "full" and num_layers:
        blocks = blocks[:num_layers]
    for key, block in blocks:
        kwargs = {"context_fn": context_fn} if context_fn is not None else {}
        model.layers[key] = checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
    return model

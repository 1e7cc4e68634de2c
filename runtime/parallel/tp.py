"""Megatron-style tensor parallelism of a `Transformer` with DTensor ``parallelize_module``.

Column-parallel wq/wk/wv/w1/w3, row-parallel wo/w2, vocabulary-parallel embedding and output
projection (and loss, via ``loss_parallel``), sequence parallelism of the norms when the plan
asks for it.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from runtime.model import MLP, Transformer


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> Transformer:
    """Megatron-style tensor parallelism of ``model`` (in place; a whole model or a stage).

    Every block: wq/wk/wv/w1/w3 column-parallel (local heads / local ffn columns), wo/w2
    row-parallel. Vocabulary parallelism: ``tok`` is row-parallel (each rank holds V/tp rows of
    the table and the partial lookups are summed), ``out`` column-parallel (V/tp logits per
    rank). With ``loss_parallel`` the logits stay a DTensor sharded on the vocabulary dim and the
    cross entropy runs under ``torch.distributed.tensor.parallel.loss_parallel`` (no all-gather
    of the (B, T, V) logits); otherwise they are all-gathered (pipeline stages pass plain
    tensors). Sequence parallelism (Korthikanti et al. 2022): the norms run on Shard(1)
    activations (B, T/tp, h), wo/w2 reduce-scatter instead of all-reduce, and the attention /
    MLP inputs are all-gathered back to (B, T, h). Tied embeddings keep ``tok``/``out``
    replicated (one matrix cannot be sharded by both plans). Mixture-of-experts MLPs
    (`runtime.moe.MoE`) are left replicated (no expert tensor parallelism; sequence parallelism
    of MoE models is not executed). Needs tp to divide the heads, the KV heads, ffn_hidden and
    (for vocabulary parallelism) vocab_size.
    """
    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()                     # layout between blocks
    for block in model.layers.values():
        block = getattr(block, "_checkpoint_wrapped_module", block)
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=act)}
        if isinstance(block.mlp, MLP):
            # a mixture-of-experts MLP stays whole on every TP rank (expert TP = 1): it sees
            # the replicated activations and computes the same result on each
            plan |= {"mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=act)}
        if isinstance(block.mlp, MLP) and block.mlp.w3 is not None:
            plan["mlp.w3"] = ColwiseParallel()
        if sp:
            plan |= {"attn_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),)),
                     "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),))}
        parallelize_module(block, tp_mesh, plan)
    vocab_parallel = model.spec.vocab_size % tp_mesh.size() == 0 and not model.spec.tied_embeddings
    root: dict = {}
    if model.tok is not None and vocab_parallel:
        root["tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if model.tok is not None and sp:
        # positions (T,) -> (T/tp, h): each rank adds the rows of its own sequence shard
        root["pos"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        if not vocab_parallel:
            root["tok"] = PrepareModuleOutput(output_layouts=Replicate(),
                                              desired_output_layouts=Shard(1))
    if model.norm is not None and sp:
        root["norm"] = SequenceParallel()
    if model.out is not None and vocab_parallel:
        root["out"] = ColwiseParallel(input_layouts=act,
                                      output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel)
    elif model.out is not None and sp:                       # replicated head: full sequence
        # the head's weight is a plain tensor here (tied to ``tok``, or V not divisible by
        # tp): it takes the all-gathered activations as a plain tensor too (every TP rank
        # then computes the same full logits and the same weight gradient)
        root["out"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),),
                                         use_local_output=True)
    if root:
        parallelize_module(model, tp_mesh, root)
    return model

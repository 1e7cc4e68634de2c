"""Apply a plan's TP, PP, DP and recomputation to a `Transformer` with torch.distributed's own
building blocks.

Composable, in torchtitan's order: `build_mesh` -> `apply_pp` (split into stages; each stage
module goes through `apply_tp`, `apply_recompute` and `apply_dp` before it is wrapped in a
``PipelineStage``). Without pipelining the same three apply to the whole model.

- TP: DTensor ``parallelize_module``; column-parallel wq/wk/wv/w1/w3, row-parallel wo/w2,
  vocabulary-parallel embedding and output projection (and loss, via ``loss_parallel``),
  sequence parallelism of the norms when the plan asks for it.
- PP: ``torch.distributed.pipelining`` ``PipelineStage`` over stage modules made by deleting the
  layers a stage does not own (even or ``plan.stage_layers`` splits); GPipe, 1F1B or
  interleaved 1F1B schedules. Tied embeddings: `sum_tied_embedding_grads` (hand-written).
  DDP stage modules: `DataParallelAwareStage` keeps the stage's shape inference from arming
  DDP's reducer (PP x DDP with as many micro-batches as stages fails without it).
- DP: DDP for models without DTensor parameters; FSDP2 ``fully_shard`` on the dp sub-mesh when
  the model is tensor parallel (DDP on a TP model fails in torch 2.13: "c10d.broadcast_.default
  does not have a sharding strategy") or when the plan asks for ZeRO (zero_stage > 0).
- Recomputation: ``checkpoint_wrapper`` per block, full or selective.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.mesh import mesh_dims, mesh_shape
from planner.spec import Plan, PlanError
from runtime.model import Transformer

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
              "interleaved-1f1b": ScheduleInterleaved1F1B}


def build_mesh(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    """The plan's DeviceMesh: dims and sizes from the one mesh layout (`planner.mesh`), e.g.
    ("pp", "dp", "tp") for the default placement (cp inside dp when cp > 1): TP peers are
    neighbouring ranks (the same node on a GPU cluster). The default process group must exist
    (call ``dist.init_process_group`` first: when the mesh creates it, ``dist.get_backend()``
    reports "undefined" on CPU).

    Raises:
        PlanError: the world size is not tp·cp·pp·dp.
    """
    world = dist.get_world_size()
    if world != plan.world_size:
        raise PlanError(f"{plan.degrees} != world_size({world})")
    return init_device_mesh(device_type, mesh_shape(plan), mesh_dim_names=mesh_dims(plan))


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
    replicated (one matrix cannot be sharded by both plans). Needs tp to divide the heads, the
    KV heads, ffn_hidden and (for vocabulary parallelism) vocab_size.
    """
    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()                     # layout between blocks
    for block in model.layers.values():
        block = getattr(block, "_checkpoint_wrapped_module", block)
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=act),
                "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=act)}
        if block.mlp.w3 is not None:
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
        root["out"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),))
    if root:
        parallelize_module(model, tp_mesh, root)
    return model


#: Ops whose outputs selective recomputation keeps (the GEMMs and attention); the cheap
#: elementwise ops and norms between them are recomputed in backward.
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: Transformer, policy: str) -> Transformer:
    """Activation recomputation of every block on ``model`` (in place).

    "full": keep only each block's input, recompute the block in backward
    (``checkpoint_wrapper``, non-reentrant); "selective": keep GEMM and attention outputs,
    recompute the rest (``create_selective_checkpoint_contexts``); "none": unchanged.
    Apply after `apply_tp` (the TP plan addresses ``attn.wq`` etc. by path) and before `apply_dp`.
    """
    if policy == "none":
        return model
    context_fn = None
    if policy == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    for key, block in list(model.layers.items()):
        kwargs = {"context_fn": context_fn} if context_fn is not None else {}
        model.layers[key] = checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
    return model


def apply_dp(model: nn.Module, dp_mesh: DeviceMesh, *, zero_stage: int = 0) -> nn.Module:
    """Data parallelism over ``dp_mesh``: DDP, or FSDP2 for TP models and ZeRO plans.

    FSDP2 shards each block and then the root (torchtitan's recipe); ZeRO-3 reshards the
    parameters after forward, ZeRO-1/2 and TP x DP keep them gathered until backward.

    Returns:
        The DDP wrapper, or ``model`` itself turned into an ``FSDPModule``.
    """
    has_dtensor = any(isinstance(p, DTensor) for p in model.parameters())
    if not has_dtensor and zero_stage == 0:
        return DDP(model, process_group=dp_mesh.get_group())
    reshard = zero_stage == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    return model


class DataParallelAwareStage(PipelineStage):
    """A ``PipelineStage`` whose shape-inference forward leaves a DDP stage module's reducer
    alone (the rest is ``PipelineStage`` unchanged).

    Without input/output shapes a stage infers them on the first ``step``: it runs the stage
    module once with gradients enabled (``_forward_metadata_inference`` calls the module
    directly, not through ``forward_maybe_with_nosync``). On a DDP module that forward arms the
    reducer (``prepare_for_backward``) for a backward that never comes, so the first
    micro-batch's backward, meant to run under ``no_sync``, fires DDP's gradient hooks: an
    extra all-reduce, and DDP records every parameter's ready order a second time when the
    last micro-batch's backward (which ``PipelineStage`` arms itself) follows without a
    forward in between, as on pipeline stage 0 with as many micro-batches as stages. The next
    step's bucket rebuild then fails (torch 2.13): ``params_.size() ==
    rebuilt_param_indices_.size() INTERNAL ASSERT FAILED ... Original model param size is: 22
    versus rebuilt params size of: 44``. Running the inference forward under ``no_sync``, as
    ``forward_maybe_with_nosync`` runs every real forward, keeps the reducer unarmed.
    """

    def _compute_outputs(self, *args, module: nn.Module, **kwargs):
        if isinstance(module, DDP):
            with module.no_sync():
                return module(*args, **kwargs)
        return module(*args, **kwargs)


def split_for_stage(model: Transformer, plan: Plan, stage_index: int, *,
                    allow_tied: bool = False) -> Transformer:
    """Keep only pipeline chunk ``stage_index``'s layers of ``model`` (in place), torchtitan-style.

    Chunk sizes come from ``plan.layers_per_stage``; the first chunk keeps ``tok``/``pos``, the
    last keeps ``norm``/``out``; the rest are set to None. Layer keys keep their global numbers.

    Raises:
        PlanError: the model ties its embeddings and ``allow_tied`` is False: the tied matrix
            then lives on two stages, whose gradients the caller must sum
            (`sum_tied_embedding_grads`, which `apply_pp` sets up).
    """
    if model.spec.tied_embeddings and not allow_tied:
        raise PlanError("pp > 1 with tied_embeddings=True needs the first and last stages' "
                        "embedding gradients summed; split through apply_pp, or use pp=1 or "
                        "an untied model")
    sizes = plan.layers_per_stage(model.spec)
    first = sum(sizes[:stage_index])
    keep = {str(i) for i in range(first, first + sizes[stage_index])}
    for key in list(model.layers):
        if key not in keep:
            del model.layers[key]
    if stage_index > 0:
        model.tok = model.pos = None
    if stage_index < len(sizes) - 1:
        model.norm = model.out = None
    return model


def apply_pp(model: Transformer, plan: Plan, pp_mesh: DeviceMesh,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
             device: torch.device,
             parallelize_fn: Callable[[Transformer], nn.Module] | None = None,
             ) -> tuple[list[PipelineStage], object, list[nn.Module]]:
    """Split ``model`` into this rank's pipeline stage(s) and build the plan's schedule.

    Pipeline rank r owns chunks r, r + pp, ... (``plan.virtual_stages`` of them; one unless the
    schedule is interleaved 1F1B). Each chunk is a deep copy of ``model`` cut by
    `split_for_stage` and passed through ``parallelize_fn`` (TP / DP) before it is wrapped.

    Args:
        loss_fn: per-micro-batch mean loss (the schedule divides gradients by the micro-batch
            count, ``scale_grads=True``).
        parallelize_fn: applied to each stage module; returns the module to run (maybe a DDP).
    Returns:
        (stages, schedule, stage modules) of this rank.
    """
    pp_rank, num_chunks = pp_mesh.get_local_rank(), plan.pp * plan.virtual_stages
    stages, modules = [], []
    for chunk in range(plan.virtual_stages):
        index = pp_rank + chunk * plan.pp
        module = split_for_stage(copy.deepcopy(model), plan, index, allow_tied=True)
        module = parallelize_fn(module) if parallelize_fn is not None else module
        modules.append(module)
        stages.append(DataParallelAwareStage(module, index, num_chunks, device,
                                             group=pp_mesh.get_group()))
    schedule_cls = _SCHEDULES[plan.schedule]
    if plan.schedule == "interleaved-1f1b":
        schedule = schedule_cls(stages, n_microbatches=plan.num_microbatches, loss_fn=loss_fn)
    else:
        schedule = schedule_cls(stages[0], n_microbatches=plan.num_microbatches, loss_fn=loss_fn)
    return stages, schedule, modules


def tied_embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The {first, last pipeline rank} group of this rank's (dp, tp) coordinate, or None.

    ``new_group`` is collective: every rank creates every pair, in the same order.
    """
    names = list(mesh.mesh_dim_names)
    pp = mesh.mesh.shape[names.index("pp")]
    ranks = mesh.mesh.movedim(names.index("pp"), 0).reshape(pp, -1)      # (pp, dp·tp)
    mine = None
    for column in range(ranks.shape[1]):
        pair = [int(ranks[0, column]), int(ranks[-1, column])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def sum_tied_embedding_grads(modules: list[nn.Module], group: dist.ProcessGroup | None) -> None:
    """Sum the tied matrix's gradients over the first stage (``tok.weight``, the embedding) and
    the last stage (``out.weight``, the output projection), so both copies take the same step,
    exactly as one shared parameter would (Megatron-LM's embedding group does the same).

    torch.distributed.pipelining has no notion of parameters shared across stages, hence this
    one all-reduce per step. Works on plain, DDP-averaged and FSDP-sharded gradients alike (the
    two stages of one (dp, tp) coordinate hold the same shard).
    """
    if group is None:
        return
    for module in modules:
        for name, p in module.named_parameters():
            if p.grad is not None and name.removeprefix("module.") in ("tok.weight",
                                                                      "out.weight"):
                grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=group)


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

"""Apply a plan's TP, PP and DP to a `Transformer` with torch.distributed's own building blocks.

Composable, in torchtitan's order: `build_mesh` -> `apply_pp` (split into stages; each stage
module goes through `apply_tp`, `apply_recompute` and `apply_dp` before it is wrapped in a
``PipelineStage``). Without pipelining the same three apply to the whole model.

- TP: DTensor ``parallelize_module``; column-parallel wq/wk/wv/w1/w3, row-parallel wo/w2. The
  embeddings, norms and the output projection stay replicated in this first version.
- PP: ``torch.distributed.pipelining`` ``PipelineStage`` over stage modules made by deleting the
  layers a stage does not own; GPipe, 1F1B or interleaved 1F1B schedules.
- DP: DDP for models without DTensor parameters; FSDP2 ``fully_shard`` on the dp sub-mesh when
  the model is tensor parallel (DDP on a TP model fails in torch 2.13: "c10d.broadcast_.default
  does not have a sharding strategy") or when the plan asks for ZeRO (zero_stage > 0).
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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.spec import Plan, PlanError
from runtime.model import Transformer

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
              "interleaved-1f1b": ScheduleInterleaved1F1B}


def build_mesh(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    """A 3-D DeviceMesh with axes named "pp", "dp", "tp" and sizes plan.pp, plan.dp, plan.tp.

    The axes are ordered by ``plan.placement`` (innermost = fastest varying over ranks last);
    the default placement gives ("pp", "dp", "tp"): TP peers are neighbouring ranks (the same
    node on a GPU cluster). The default process group must exist (call
    ``dist.init_process_group`` first: when the mesh creates it, ``dist.get_backend()`` reports
    "undefined" on CPU).

    Raises:
        PlanError: the world size is not tp·pp·dp.
    """
    world = dist.get_world_size()
    if world != plan.world_size:
        raise PlanError(f"tp*pp*dp = {plan.tp}*{plan.pp}*{plan.dp} = {plan.world_size} "
                        f"!= world_size({world})")
    names = tuple(reversed(plan.placement))                   # outermost first
    shape = tuple(getattr(plan, name) for name in names)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> Transformer:
    """Megatron-style tensor parallelism of every block present on ``model`` (in place).

    Attention heads and MLP columns are split over ``tp_mesh``: wq/wk/wv/w1/w3 column-parallel
    (output Shard(-1): local heads / local ffn columns), wo/w2 row-parallel (all-reduce to a
    replicated (B, T, h) output). Needs tp to divide num_heads, num_kv_heads and ffn_hidden
    (`planner.spec.check_plan`).
    """
    for block in model.layers.values():
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
        if block.mlp.w3 is not None:
            plan["mlp.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)
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


def split_for_stage(model: Transformer, plan: Plan, stage_index: int) -> Transformer:
    """Keep only pipeline chunk ``stage_index``'s layers of ``model`` (in place), torchtitan-style.

    Chunk sizes come from ``plan.layers_per_stage``; the first chunk keeps ``tok``/``pos``, the
    last keeps ``norm``/``out``; the rest are set to None. Layer keys keep their global numbers.

    Raises:
        PlanError: the model ties its embeddings (the tied matrix would live on two stages, whose
            gradients this version does not sum).
    """
    if model.spec.tied_embeddings:
        raise PlanError("pp > 1 with tied_embeddings=True is not supported yet; "
                        "use pp=1 or an untied model")
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
        module = split_for_stage(copy.deepcopy(model), plan, index)
        module = parallelize_fn(module) if parallelize_fn is not None else module
        modules.append(module)
        stages.append(PipelineStage(module, index, num_chunks, device, group=pp_mesh.get_group()))
    schedule_cls = _SCHEDULES[plan.schedule]
    if plan.schedule == "interleaved-1f1b":
        schedule = schedule_cls(stages, n_microbatches=plan.num_microbatches, loss_fn=loss_fn)
    else:
        schedule = schedule_cls(stages[0], n_microbatches=plan.num_microbatches, loss_fn=loss_fn)
    return stages, schedule, modules


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

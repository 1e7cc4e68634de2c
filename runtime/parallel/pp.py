"""Pipeline parallelism: ``torch.distributed.pipelining`` ``PipelineStage`` over stage modules
made by deleting the layers a stage does not own (even or ``plan.stage_layers`` splits); GPipe,
1F1B, interleaved 1F1B and the zero-bubble schedules (ZB-H1 and interleaved zero bubble,
ZB-V, DualPipe-V: torch's ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, which split each backward into input- and weight-gradient actions).

Written by hand where the building blocks do not do it: tied embeddings
(`sum_tied_embedding_grads`, over the `tied_embedding_group`), and for DDP stage modules
`DataParallelAwareStage`, which keeps the stage's shape inference from arming DDP's reducer
(PP x DDP with as many micro-batches as stages fails without it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.mesh import rank_chunks
from planner.spec import Plan, PlanError
from runtime.model import Transformer

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
              "interleaved-1f1b": ScheduleInterleaved1F1B,
              # ZB-H1 is torch's interleaved zero bubble with one stage per rank.
              "zb-h1": ScheduleInterleavedZeroBubble,
              "interleaved-zb": ScheduleInterleavedZeroBubble,
              "zb-v": ScheduleZBVZeroBubble, "dualpipe-v": ScheduleDualPipeV}
#: Schedules built from the list of this rank's stages (the others take one stage).
_MULTI_STAGE = ("interleaved-1f1b", "zb-h1", "interleaved-zb", "zb-v", "dualpipe-v")


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
    schedule has several chunks per rank), or r and 2·pp − 1 − r under ZB-V and DualPipe-V
    (`planner.mesh.rank_chunks`). Each chunk is a deep copy of ``model`` cut by
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
    for index in rank_chunks(plan, pp_rank):
        module = split_for_stage(copy.deepcopy(model), plan, index, allow_tied=True)
        module = parallelize_fn(module) if parallelize_fn is not None else module
        modules.append(module)
        stages.append(DataParallelAwareStage(module, index, num_chunks, device,
                                             group=pp_mesh.get_group()))
    schedule_cls = _SCHEDULES[plan.schedule]
    if plan.schedule in _MULTI_STAGE:
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
    two stages of one (dp, tp) coordinate hold the same shard). With ``group`` None the two
    copies live on this rank (ZB-V and DualPipe-V put the first and last chunks on pipeline
    rank 0) and are summed in place.
    """
    if group is None:
        _sum_local_tied_grads(modules)
        return
    for module in modules:
        for name, p in module.named_parameters():
            if p.grad is not None and name.removeprefix("module.") in ("tok.weight",
                                                                      "out.weight"):
                grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=group)


def _sum_local_tied_grads(modules: list[nn.Module]) -> None:
    # Both copies of the tied matrix on this rank: each gradient becomes their sum.
    grads = [p.grad for module in modules for name, p in module.named_parameters()
             if p.grad is not None and name.removeprefix("module.") in ("tok.weight",
                                                                         "out.weight")]
    if len(grads) == 2:
        local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
        total = local[0] + local[1]
        for g in local:
            g.copy_(total)

"""Apply a plan's TP, PP, DP and recomputation to a `Transformer` with torch.distributed's own
building blocks, one module per technique under `runtime.parallel`.

Composable, in torchtitan's order: `build_mesh` -> `parallelize_pipeline` (`apply_pp` splits
the model into stages; each stage module goes through `parallelize`, i.e. `apply_tp`,
`apply_recompute` and `apply_dp`, before it is wrapped in a ``PipelineStage``). Without
pipelining `parallelize` applies the same three to the whole model.

- TP (`runtime.parallel.tp`): DTensor ``parallelize_module``, vocabulary-parallel embedding,
  output projection and loss, sequence parallelism.
- PP (`runtime.parallel.pp`): ``PipelineStage`` and the GPipe / 1F1B / interleaved 1F1B
  schedules; tied embeddings and PP x DDP by hand.
- DP (`runtime.parallel.dp`): DDP, or FSDP2 ``fully_shard`` for TP models and ZeRO plans.
- Recomputation (`runtime.parallel.recompute`): ``checkpoint_wrapper`` per block, full or
  selective.
- EP (`runtime.parallel.ep`): the MoE blocks' experts sharded over the ``ep`` axis of the
  expert mesh (`runtime.parallel.ep.build_expert_mesh`, the dp axis unflattened into edp × ep),
  tokens dispatched with all-to-all; applied after recomputation, before DP.
- CP (`runtime.parallel.cp`): ring attention over the cp dim, load-balanced sequence chunks;
  DP then reduces over the flattened dp × cp dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage

from planner.mesh import mesh_dims, mesh_shape
from planner.spec import Plan, PlanError
from runtime.model import Transformer
from runtime.parallel.cp import apply_cp, data_parallel_mesh
from runtime.parallel.dp import apply_dp
from runtime.parallel.ep import apply_ep
from runtime.parallel.pp import apply_pp
from runtime.parallel.recompute import apply_recompute
from runtime.parallel.tp import apply_tp


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


def vocab_parallel_loss(plan: Plan) -> bool:
    """Whether the loss runs vocabulary-parallel on the DTensor logits (``loss_parallel``):
    tp > 1 without pipelining; pipeline stages pass plain tensors instead."""
    return plan.tp > 1 and plan.pp == 1


def parallelize(module: Transformer, plan: Plan, mesh: DeviceMesh,
                expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """The plan's TP, CP, recomputation, EP (when ``expert_mesh`` is given) and DP applied to
    ``module`` (a whole model or a stage); DP runs over dp × cp ranks when cp > 1.

    Returns:
        The module to run: ``module`` itself (maybe an ``FSDPModule`` now), or its DDP wrapper.
    """
    if plan.tp > 1:
        apply_tp(module, mesh["tp"], sequence_parallel=plan.sequence_parallel,
                 loss_parallel=vocab_parallel_loss(plan))
    if plan.cp > 1:
        apply_cp(module, mesh["cp"])
    apply_recompute(module, plan.recompute, plan.recompute_num_layers)
    if expert_mesh is not None:
        apply_ep(module, expert_mesh["ep"])
    if plan.dp_cp > 1 or plan.zero_stage > 0:
        module = apply_dp(module, data_parallel_mesh(mesh), zero_stage=plan.zero_stage)
    return module


def parallelize_pipeline(model: Transformer, plan: Plan, mesh: DeviceMesh,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                         device: torch.device, expert_mesh: DeviceMesh | None = None
                         ) -> tuple[list[PipelineStage], object, list[nn.Module]]:
    """This rank's pipeline stage(s) of ``model``, each through `parallelize` (with
    ``expert_mesh``), and the plan's schedule (`apply_pp`; ``loss_fn`` as there).

    Returns:
        (stages, schedule, stage modules) of this rank.
    """
    return apply_pp(model, plan, mesh["pp"], loss_fn, device=device,
                    parallelize_fn=lambda module: parallelize(module, plan, mesh, expert_mesh))

"""Expert parallelism of a `Transformer`'s MoE blocks: each rank of an ep group holds
num_experts/ep of the routed experts, and token copies travel to their expert's rank and back
with ``all_to_all_single`` (split sizes exchanged first).

Ranks fold as in Megatron-Core's MoE parallel folding (Liu et al. 2025, "MoE Parallel
Folding"): attention and the other dense parts use the plan's dp group, the experts use ep ×
edp over the same ranks, ep the inner (neighbouring) part of dp, so dp = ep · edp. The expert
mesh is the run's DeviceMesh (the one layout, `planner.mesh.mesh_dims`) with its ``dp`` axis
unflattened into ``("edp", "ep")`` (`build_expert_mesh`); every other technique keeps using
the run's mesh.

Gradients: DDP (or FSDP2) reduces the dense parameters over dp and ignores the experts (under
FSDP2 / ZeRO they stay whole on each rank, outside its sharding); `reduce_expert_grads`
sums each expert shard's gradient over edp and divides by dp, as DDP's mean over dp would (an
expert's local gradient already holds the tokens of its whole ep group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.spec import ModelSpec, Plan
from runtime.moe import GroupedExperts, MoE, is_expert_param


def plan_ep(plan: Plan) -> int:
    """The plan's expert-parallel degree (1 for plans without the field)."""
    return getattr(plan, "ep", 1)


def resolve_ep(plan: Plan, requested: int | None) -> int:
    """The ep degree of a run: ``requested`` (``--ep``) or else the plan's.

    Raises:
        ValueError: both are given and disagree.
    """
    if requested is None:
        return plan_ep(plan)
    if plan_ep(plan) not in (1, requested):
        raise ValueError(f"--ep={requested} disagrees with the plan's ep={plan_ep(plan)}; "
                         f"leave --ep out to use the plan's")
    return requested


def expert_parallel_error(model: ModelSpec, plan: Plan, ep: int) -> str | None:
    """Why the runtime cannot run ``plan`` at expert-parallel degree ``ep``, or None.

    Rules: ep ≥ 1; ep > 1 needs an MoE model, ep | num_experts and ep | dp (parallel folding,
    dp = ep · edp).
    """
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        return f"ep={ep!r} must be a positive integer"
    if ep == 1:
        return None
    if not model.is_moe:
        return f"ep={ep} needs a mixture-of-experts model; {model.name} has num_experts=0"
    if model.num_experts % ep:
        return (f"ep={ep} does not divide num_experts={model.num_experts}; use ep in "
                f"{[d for d in range(1, model.num_experts + 1) if model.num_experts % d == 0]}")
    if plan.dp % ep:
        return (f"ep={ep} does not divide dp={plan.dp}: expert parallelism folds into the "
                f"data-parallel ranks (dp = ep·edp); use dp a multiple of {ep}")
    return None


def build_expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The expert mesh of a run: ``mesh`` with its ``dp`` axis unflattened into
    ``("edp", "ep")``, ep innermost (neighbouring dp ranks share their experts). Collective
    (it creates the process groups): every rank calls it once.

    For the mesh ("pp", "dp", "tp") of sizes (2, 4, 1) and ep = 2 the expert mesh is
    ("pp", "edp", "ep", "tp") of sizes (2, 2, 2, 1): ranks {0, 1}, {2, 3}, ... share experts.
    """
    dp = mesh["dp"].size()
    return mesh._unflatten("dp", (dp // ep, ep), ("edp", "ep"))


class AllToAllDispatcher:
    """Sends each expert's token copies to the ep rank that owns the expert, runs the local
    experts, and sends the outputs back (two differentiable ``all_to_all_single``, after one
    of the per-expert counts: the receive split sizes).

    Rank r of the group owns experts r·E/ep .. (r+1)·E/ep − 1. The torch.distributed.nn
    ``all_to_all_single`` (autograd) is deprecated in favour of this functional one, which
    has the same backward (the reverse all-to-all) and runs on gloo and nccl.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.size = group, dist.get_world_size(group)

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        """routed (M, h) sorted by expert, counts (E,) -> expert outputs (M, h), same order."""
        ep, local = self.size, counts.numel() // self.size
        received_counts = torch.empty_like(counts)                       # (ep·E_local,)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        per_source = received_counts.view(ep, local)                     # (source, expert)
        send = counts.view(ep, local).sum(1).tolist()                    # rows to each rank
        recv = per_source.sum(1).tolist()                                # rows from each rank
        received = all_to_all_single_autograd(routed, recv, send, self.group)   # (R, h)
        # received rows are ordered (source, local expert); the experts want (expert, source)
        expert_of_row = torch.arange(local).repeat(ep).repeat_interleave(per_source.flatten())
        by_expert = expert_of_row.argsort(stable=True)                   # (R,)
        out = experts(received[by_expert], per_source.sum(0).tolist())   # (R, h)
        back = out[by_expert.argsort()]                                  # (source, expert)
        return all_to_all_single_autograd(back, send, recv, self.group)  # (M, h)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every MoE block's routed experts over ``ep_mesh`` (in place; after
    `runtime.parallel.recompute.apply_recompute`, before `runtime.parallel.dp.apply_dp`).

    Each rank built the full model from the same seed, so it keeps its own slice of the
    stacked (E, ...) matrices as a ``DTensor(Shard(0))`` without communication
    (``src_data_rank=None``); DCP saves and reshards them like any DTensor, and
    ``full_tensor()`` gathers them (`runtime.params`).
    """
    dispatcher = AllToAllDispatcher(ep_mesh.get_group())
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        for name, p in list(module.experts.named_parameters(recurse=False)):
            shard = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(module.experts, name, nn.Parameter(shard))
        module.dispatcher = dispatcher
    # DDP (applied next, to this module) reduces the dense parameters only; the experts are
    # reduced over edp by reduce_expert_grads (DDP cannot broadcast DTensor parameters)
    names = [n for n, _ in model.named_parameters() if is_expert_param(n)]
    DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    return model


def reduce_expert_grads(modules: list[nn.Module], edp_group: dist.ProcessGroup | None,
                        dp: int) -> None:
    """Sum the expert-parallel gradients over the expert data-parallel group and divide by dp.

    An expert shard's gradient on one rank holds the tokens of its whole ep group (each rank's
    loss a mean over its own B/dp sequences); the global mean loss is the mean over dp ranks,
    hence the sum over the edp replicas divided by dp = ep·edp.
    """
    for module in modules:
        for p in module.parameters():
            if isinstance(p, DTensor) and p.grad is not None and \
                    p.device_mesh.mesh_dim_names == ("ep",):
                grad = p.grad._local_tensor
                if edp_group is not None:
                    dist.all_reduce(grad, group=edp_group)
                grad.div_(dp)

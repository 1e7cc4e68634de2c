"""The mixture-of-experts MLP of an MoE block: a top-k router, routed SwiGLU / GeLU experts,
optional shared experts, dropless token dispatch and a load-balancing auxiliary loss.

Shapes: B sequences, T tokens, h hidden, E routed experts, k experts per token (top-k), f the
inner width of one expert (``ModelSpec.expert_hidden``), N = B·T tokens.

Dispatch is dropless (Gale et al. 2023, MegaBlocks): each expert runs on every token routed to
it, its token copies sorted by expert into one contiguous slice (Megatron-Core's
``SequentialMLP`` token layout; a loop over the experts, as no grouped GEMM exists on CPU).
Under expert parallelism (`runtime.parallel.ep`) the slices travel to the rank that owns their
expert and back with ``all_to_all_single``; without it every expert is local.

Load balancing: the auxiliary loss of the Switch Transformer (Fedus et al. 2021, eq. 4),
``α · E · Σ_i f_i · P_i`` with f_i the fraction of the k·T routing choices that picked expert i
and P_i the mean router probability of expert i, is computed per sequence and averaged over the
sequences (the batch-size-independent scope of DeepSeek-V3's sequence-wise balance loss, Liu et
al. 2024, eqs. 17-20), so micro-batching, data and expert parallelism train exactly what one
process on the whole batch trains. Its gradient enters the backward at the MoE output
(`AttachAuxLoss`, Megatron-Core's ``MoEAuxLossAutoScaler``), so it works on any pipeline stage;
the reported loss stays the language-model cross entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from planner.spec import ModelSpec

#: α of the load-balancing loss (Fedus et al. 2021, section 2.2: 10^-2).
AUX_LOSS_COEFF = 1e-2


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Switch Transformer auxiliary loss (Fedus et al. 2021, eq. 4), per sequence, top-k.

    ``E · Σ_i f_i · P_i`` per sequence, with ``f_i = (1 / (k·T)) Σ_t [i ∈ topk(t)]`` (the k·T
    routing choices counted, GShard's top-k form) and ``P_i = (1 / T) Σ_t p_i(t)``; the mean
    over the B sequences. A perfectly balanced router gives 1 (f_i = P_i = 1/E); one that sends
    every token to one expert with probability 1 gives E (top-1).

    Args:
        probs: (B, T, E) router probabilities (each row sums to 1).
        indices: (B, T, k) int64 chosen experts.
    Returns:
        Scalar tensor (differentiable in ``probs``; f_i is a count and carries no gradient).
    """
    num_experts, k, t = probs.shape[-1], indices.shape[-1], probs.shape[1]
    chosen = F.one_hot(indices, num_experts).sum(dim=(1, 2)).to(probs.dtype)   # (B, E)
    f = chosen / (k * t)                                                       # (B, E)
    p = probs.mean(dim=1)                                                      # (B, E)
    return num_experts * (f * p).sum(dim=-1).mean()


class AttachAuxLoss(torch.autograd.Function):
    """Identity on the MoE output whose backward also starts the auxiliary loss's backward with
    gradient ``scale`` (Megatron-Core's ``MoEAuxLossAutoScaler``): the aux loss needs no path to
    the training loss, so pipeline stages other than the last train it too.

    ``scale`` is α times the factor the step applies to the main loss (1/micro-batches under
    gradient accumulation; 1 in a pipeline schedule, which scales the gradients itself).
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=grad_output.dtype,
                              device=grad_output.device)
        return grad_output, aux_grad, None


class Router(nn.Module):
    """Top-k gate: scores from one (E, h) matrix, softmax or sigmoid, optional grouped top-k.

    - softmax (Mixtral, Qwen3): p = softmax(x Wᵀ); the k largest; gates renormalised over the k
      (Mixtral / Qwen3 ``norm_topk_prob``) when k > 1, the raw p when k = 1 (Switch, eq. 2).
    - sigmoid (DeepSeek-V3, eqs. 12-13): s = sigmoid(x Wᵀ); the k largest; gates s / Σ_topk s;
      the aux loss sees p = s / Σ_E s (eq. 19).
    - grouped (DeepSeek-V3 node-limited routing): experts in ``router_groups`` groups, each scored
      by the sum of its two best scores (its best when a group holds one expert); a token picks
      its k experts among the best ``router_group_topk`` groups.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden))   # (E, h)
        self.k, self.score, self.groups = (spec.experts_per_token, spec.router,
                                           spec.router_groups)
        self.group_topk = spec.router_group_topk

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, h) -> (probs (N, E) for the aux loss, indices (N, k), gates (N, k))."""
        logits = F.linear(x, self.weight).float()                         # (N, E)
        if self.score == "sigmoid":
            scores = torch.sigmoid(logits)                                # (N, E)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        else:
            scores = probs = torch.softmax(logits, dim=-1)                # (N, E)
        gates, indices = self._group_limited(scores).topk(self.k, dim=-1)  # (N, k) each
        if self.score == "sigmoid" or self.k > 1:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return probs, indices, gates.to(x.dtype)

    def _group_limited(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` (N, E) with the experts outside each token's best groups set to -inf."""
        if self.groups == 1:
            return scores
        n, e = scores.shape
        grouped = scores.view(n, self.groups, e // self.groups)           # (N, G, E/G)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)   # (N, G)
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, best.topk(self.group_topk, dim=-1).indices, True)      # (N, G)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, e)


class GroupedExperts(nn.Module):
    """E expert MLPs as stacked matrices: w1, w3 (E, f, h) and w2 (E, h, f); SwiGLU
    (``w2(silu(w1 x) · w3 x)``) or GeLU (``w2(gelu(w1 x))``) like `runtime.model.MLP`.

    Under expert parallelism the three are DTensors sharded on dim 0 over the ep group
    (`runtime.parallel.ep.apply_ep`); `forward` uses the local experts.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        e, h, f = spec.num_experts, spec.hidden, spec.expert_hidden
        self.w1 = nn.Parameter(torch.empty(e, f, h))
        self.w2 = nn.Parameter(torch.empty(e, h, f))
        self.w3 = nn.Parameter(torch.empty(e, f, h)) if spec.activation == "swiglu" else None

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (M, h), rows sorted by local expert, ``counts[e]`` rows for local expert e ->
        (M, h). Experts with no rows still run (an empty GEMM), so every expert parameter gets
        a gradient and DDP never sees an unused parameter."""
        w1, w2 = _local(self.w1), _local(self.w2)                        # (E_local, ...)
        w3 = _local(self.w3) if self.w3 is not None else None
        outs = []
        for e, rows in enumerate(x.split(counts)):                       # rows (n_e, h)
            if w3 is not None:
                inner = F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())    # (n_e, f)
            else:
                inner = F.gelu(rows @ w1[e].t())                         # (n_e, f)
            outs.append(inner @ w2[e].t())                               # (n_e, h)
        return torch.cat(outs)                                           # (M, h)


def _local(p: torch.Tensor) -> torch.Tensor:
    """The local shard of an expert-parallel DTensor parameter (differentiable), else ``p``."""
    return p.to_local() if isinstance(p, DTensor) else p


class MoE(nn.Module):
    """Mixture-of-experts MLP: ``Σ_k gate_k · expert_k(x) + shared(x)`` per token.

    Attributes:
        router, experts: see `Router`, `GroupedExperts`.
        shared: the ``num_shared_experts`` shared experts as one MLP of width
            num_shared_experts·f (DeepSeekMoE's fused form), or None.
        dispatcher: moves token copies to their experts and back (`LocalDispatcher`, or
            `runtime.parallel.ep.AllToAllDispatcher` under expert parallelism).
        aux_grad_scale: the factor the step applies to the main loss (see `AttachAuxLoss`).
        last_aux_loss: the auxiliary loss of the last forward (detached), for logging.
    """

    def __init__(self, spec: ModelSpec, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.num_experts, self.k = spec.num_experts, spec.experts_per_token
        self.router = Router(spec)
        self.experts = GroupedExperts(spec)
        self.shared = shared
        self.dispatcher: LocalDispatcher = LocalDispatcher()
        self.aux_grad_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h)."""
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)                                      # (N, h)
        probs, indices, gates = self.router(tokens)                       # (N, E), (N, k) x2
        flat = indices.flatten()                                          # (N·k,)
        order = flat.argsort(stable=True)                                 # by expert
        counts = torch.bincount(flat, minlength=self.num_experts)         # (E,)
        routed = tokens[order // self.k]                                  # (N·k, h)
        expert_out = self.dispatcher(routed, counts, self.experts)        # (N·k, h)
        copies = expert_out[order.argsort()].view(b * t, self.k, h)       # (N, k, h)
        out = (copies * gates.unsqueeze(-1)).sum(dim=1)                   # (N, h)
        if self.shared is not None:
            out = out + self.shared(tokens)
        aux = load_balancing_loss(probs.view(b, t, -1), indices.view(b, t, -1))
        self.last_aux_loss = aux.detach()
        out = AttachAuxLoss.apply(out, aux, AUX_LOSS_COEFF * self.aux_grad_scale)
        return out.view(b, t, h)


class LocalDispatcher:
    """All experts on this rank: the sorted token copies go straight to them."""

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        """routed (M, h) sorted by expert, counts (E,) -> expert outputs (M, h), same order."""
        return experts(routed, counts.tolist())


def set_aux_grad_scale(module: nn.Module, scale: float) -> None:
    """Set `MoE.aux_grad_scale` of every MoE block in ``module`` (see `AttachAuxLoss`)."""
    for sub in module.modules():
        if isinstance(sub, MoE):
            sub.aux_grad_scale = scale


def is_expert_param(name: str) -> bool:
    """Whether a parameter name (``layers.0.mlp.experts.w1``) is a routed expert's."""
    return ".experts." in name or name.startswith("experts.")


def runtime_moe_error(spec: ModelSpec) -> str | None:
    """What of ``spec`` the runtime cannot train, or None: token dropping (capacity factor) and
    multi-head latent attention (simulated and planned, not executed)."""
    if spec.capacity_factor is not None:
        return (f"capacity_factor={spec.capacity_factor}: the runtime trains dropless MoE only; "
                f"set capacity_factor to null in the plan file's model")
    if spec.is_mla:
        return (f"kv_lora_rank={spec.kv_lora_rank}: the runtime does not execute multi-head "
                f"latent attention (the simulator and planner model it); use kv_lora_rank=0")
    return None

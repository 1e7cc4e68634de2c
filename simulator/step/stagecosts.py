"""The records the step model passes around: `StageCosts` (seconds one rank of a pipeline
stage spends per micro-batch and once per step) and `SimOptions` (framework behaviour a plan
does not name), and PyTorch DDP's gradient buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.spec import PlanError
from simulator.step.compute import (
    CP_ATTENTIONS,
    Attention,
    CpAttention,
    Efficiency,
    attention_kernel_names,
)
from simulator.step.moe import RECOMPUTE_MODULES

#: PyTorch DDP's first gradient bucket (``first_bucket_bytes``, 1 MiB) and the later ones
#: (``bucket_cap_mb=25``): ``torch/nn/parallel/distributed.py``.
DDP_FIRST_BUCKET_BYTES = 2**20
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Seconds one rank of a pipeline stage spends per micro-batch (and once per step).

    fwd/bwd_compute_s and fwd/bwd_comm_s are per micro-batch (bwd includes any recomputed
    forward); p2p_fwd_s sends the activation to the next stage, p2p_bwd_s the gradient to the
    previous one. Once per step: dp_comm_s reduces the gradients (all-reduce, or
    reduce-scatter under ZeRO) in ``dp_buckets`` equal buckets, optimizer_s updates the
    weights, dp_gather_s all-gathers updated weight shards (ZeRO 1 and 2). wgrad_s is the
    part of bwd_compute_s that computes weight gradients (the W of the zero-bubble schedules,
    `simulator.step.zero_bubble`); the rest is the input gradient (B). fwd/bwd_overlap_s
    are the communication per micro-batch that runs beside that pass's compute on its own
    stream (ZeRO-3 prefetch, TP overlap) and is hidden by it: not part of the step time,
    logged on the ``overlap`` track so the timeline shows how much slack is left.
    fwd/bwd_unpaired_s are what a pass adds when it runs without a pass of another
    micro-batch beside it: an MoE all-to-all that overlaps another micro-batch's compute
    (`SimOptions.moe_a2a_overlap`; Megatron-Core's combined 1F1B pairs each steady-state
    forward with a backward) shows in full in the warm-up forwards and cool-down backwards.
    """

    fwd_compute_s: float
    bwd_compute_s: float
    fwd_comm_s: float = 0.0
    bwd_comm_s: float = 0.0
    p2p_fwd_s: float = 0.0
    p2p_bwd_s: float = 0.0
    dp_comm_s: float = 0.0
    dp_buckets: int = 1
    dp_gather_s: float = 0.0
    optimizer_s: float = 0.0
    wgrad_s: float = 0.0
    fwd_overlap_s: float = 0.0
    bwd_overlap_s: float = 0.0
    fwd_unpaired_s: float = 0.0
    bwd_unpaired_s: float = 0.0


#: How overlapped TP collectives hide (`SimOptions.tp_overlap_kind`).
TP_OVERLAP_KINDS = ("block", "async-tp")


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """Framework behaviour a plan does not name (defaults: Megatron-LM-like).

    Attributes:
        attention: 'flash' (fused, causal; FlashAttention-2), 'flash-triton' (the same
            algorithm at `simulator.step.compute.TRITON_FLASH_RATE` of its rate) or 'unfused' (QKᵀ,
            softmax, dropout, AV kernels).
        tp_comm_overlap: TP collectives run beside the GEMMs (Megatron-Core --tp-comm-overlap);
            only the part longer than the layer's compute is exposed.
        tp_overlap_kind: how ``tp_comm_overlap`` overlaps: 'block' (Megatron-Core's
            userbuffers: every TP collective, forward and backward, hides under the block's
            compute) or 'async-tp' (PyTorch's micro-pipelined async TP: each collective hides
            only under the GEMM it feeds or is fed by, and the backward reduce-scatters are
            not fused; `simulator.step.costs.async_tp_exposed_s`).
        eager_pointwise: the model runs eagerly (no torch.compile): its norms, rotary
            embedding and SwiGLU run as unfused PyTorch ops
            (`simulator.step.compute.eager_pointwise_bytes`); False: fused kernels.
        grad_reduce_bytes: bytes per gradient element in the DP reduction; None: 4 for bf16
            (Megatron accumulates and reduces bf16 gradients in fp32), else the dtype's.
        dp_bucket_bytes: gradient bucket size for overlapped reduction; None: one bucket per
            stage (no bucketing).
        blocking_p2p: pipeline sends and receives block the compute stream (Megatron-LM's
            synchronous ``send_forward_recv_backward``), so P2P time adds to the stage.
        zero3_unaggregated: ZeRO-3 gathers and reduce-scatters push each rank's full
            (n − 1)/n share through its own NIC, with no node-level aggregation (DeepSpeed
            ZeRO-3 of 2021, per-parameter collectives over the flat data-parallel group).
        overlap_param_gather: the all-gather of updated weight shards (ZeRO 1/2) runs under the
            next step's first forward (Megatron-Core --overlap-param-gather); only the part
            longer than that forward is exposed.
        p2p_scatter_gather: each TP rank sends 1/tp of the activation and the next stage
            all-gathers it over NVLink (Megatron-LM, Narayanan et al. 2021 §4.1); False: every
            TP rank sends the whole activation (DeepSpeed's pipeline engine).
        p2p_overhead_s: fixed framework time per pipeline send (schedule bookkeeping and
            the synchronisation of a blocking send/recv pair), fitted per framework.
        zero3_prefetch_params: ZeRO-3 parameters gathered ahead of the layer that needs them
            (DeepSpeed ``stage3_prefetch_bucket_size``, default 5e7); only that fraction of a
            layer's weight gather can hide behind the previous layer's compute, the rest
            stalls the compute stream. None: the whole next layer is prefetched (PyTorch FSDP).
        zero3_overlap_reduce: ZeRO-3 gradient reduce-scatters run beside the backward
            (FSDP; DeepSpeed ``overlap_comm: true``); False: they block it (DeepSpeed's
            documented default ``overlap_comm: false``).
        zero3_pp_unsharded: with pipeline parallelism (pp > 1) the ZeRO-3 weights stay
            gathered between micro-batches and the gradients reduce-scatter once, after the
            last backward (FSDP2 under ``torch.distributed.pipelining``, as torchtitan runs
            it; `simulator.step.costs.zero3_once_per_step`). False: gathered and reduced
            every micro-batch.
        efficiency: compute efficiency; None loads the device's entry of efficiency.yaml.
        optimizer_post_validation: no synchronisation of all pipeline stages (global
            gradient norm, inf/nan check) before the optimizer step; it is validated after the
            update and rolled back if needed (Qi et al. 2024 §4; the sail-sg Megatron-LM fork's
            ``--enable-optimizer-post-validation``), so steps overlap and the longest rank
            span sets the step time (zero-bubble schedules only). torch.distributed.pipelining
            has no such mode.
        fp32_main_grads: the framework keeps fp32 main gradients (Megatron, DeepSpeed):
            18 bytes of model state per parameter in bf16 instead of 16
            (`simulator.step.memory.main_grad_bytes_per_param`).
        moe_imbalance: routing imbalance of an MoE model, the busiest EP rank's tokens over
            the mean (1.0: balanced, as forced routing gives; `simulator.step.moe`).
        moe_dispatcher: 'alltoall' (NCCL all-to-all of every token copy, Megatron-Core
            ``moe_token_dispatcher_type='alltoall'``) or 'deepep' (DeepEP's node-deduplicated
            RDMA + NVLink dispatch; `simulator.step.moe.node_dedup_factor`).
        moe_a2a_overlap: MoE all-to-alls run beside another micro-batch's compute
            (Megatron-Core ``--overlap-moe-expert-parallel-comm``, DualPipe); only the part
            longer than the block's compute is exposed.
        recompute_modules: with ``recompute='selective'``, the block parts an MoE / MLA
            model recomputes (Megatron-Core ``recompute_modules``: 'core_attn', 'mla_up_proj',
            'moe_act', 'layernorm', 'mlp', 'moe', 'shared_experts';
            `simulator.step.moe.RECOMPUTE_MODULES`); None: Megatron-Core's default
            ['core_attn'], the attention core.
        cp_attention: how context-parallel attention (cp > 1) exchanges keys and values:
            'ring' (each rank's compact K/V block to the next rank, every hop under one
            block's attention: Megatron-Core / Transformer Engine) or 'pytorch' (PyTorch's
            ``context_parallel`` SDPA as torchtitan runs it: K/V all-gathered with the
            query heads' width, fp32 gradient hops and merges;
            `simulator.step.costs.torch_cp_comm`, `simulator.step.compute.torch_cp_merge_bytes`).
        attention_kernel: the fused-attention kernel the framework's attention call runs, a
            name of ``presets/attention_kernels.yaml`` (a dispatcher such as 'te-fused' or
            'sdpa', resolved per GPU generation, or a kernel: 'fa2', 'fa3', 'cudnn'); its
            published rate replaces the device's ``flash_fraction``
            (`simulator.step.compute.attention_kernel_rate`). None: the device's default.
    """

    attention: Attention = "flash"
    tp_comm_overlap: bool = False
    tp_overlap_kind: str = "block"
    eager_pointwise: bool = False
    grad_reduce_bytes: int | None = None
    dp_bucket_bytes: float | None = DDP_BUCKET_BYTES
    blocking_p2p: bool = False
    zero3_unaggregated: bool = False
    p2p_scatter_gather: bool = True
    overlap_param_gather: bool = False
    p2p_overhead_s: float = 0.0
    zero3_prefetch_params: float | None = None
    zero3_overlap_reduce: bool = True
    zero3_pp_unsharded: bool = False
    efficiency: Efficiency | None = None
    fp32_main_grads: bool = False
    moe_imbalance: float = 1.0
    moe_dispatcher: str = "alltoall"
    moe_a2a_overlap: bool = False
    recompute_modules: tuple[str, ...] | None = None
    optimizer_post_validation: bool = False
    cp_attention: CpAttention = "ring"
    attention_kernel: str | None = None

    def __post_init__(self) -> None:
        bad = sorted(set(self.recompute_modules or ()) - set(RECOMPUTE_MODULES))
        if bad:
            raise PlanError(f"recompute_modules={list(self.recompute_modules)!r}: {bad} not "
                            f"among {list(RECOMPUTE_MODULES)} (Megatron-Core's choices)")
        if self.tp_overlap_kind not in TP_OVERLAP_KINDS:
            raise PlanError(f"tp_overlap_kind={self.tp_overlap_kind!r} is not one of "
                            f"{list(TP_OVERLAP_KINDS)}")
        if self.cp_attention not in CP_ATTENTIONS:
            raise PlanError(f"cp_attention={self.cp_attention!r} is not one of "
                            f"{list(CP_ATTENTIONS)}")
        if self.attention_kernel is not None \
                and self.attention_kernel not in attention_kernel_names():
            raise PlanError(f"attention_kernel={self.attention_kernel!r} is not one of "
                            f"{attention_kernel_names()}; name one or leave it unset")


DEFAULT_OPTIONS = SimOptions()

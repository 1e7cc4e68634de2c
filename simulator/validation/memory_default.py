"""A row that does not say its recomputation ran with one that fits the device: the reader's
rule for an empty ``recompute`` cell whose framework default would not fit in memory."""

from __future__ import annotations

from dataclasses import replace

from planner.spec import ModelSpec, Plan
from simulator.step.memory import memory_per_stage
from simulator.step.stagecosts import SimOptions

#: Policies in the order a framework user reaches for them when memory runs out.
RECOMPUTE_ORDER = ("none", "selective", "full")
#: The selective modules an MoE model reaches for first: Megatron-Core's output-discarding
#: checkpoints of the experts' activation and the norms, which repeat only memory-bound ops
#: (``TransformerConfig.recompute_modules``: "moe_act", "layernorm" use output-discarding
#: checkpointing; `simulator.step.moe.selective_saving_bytes`).
MOE_LIGHT_RECOMPUTE = ("moe_act", "layernorm")


def recompute_that_fits(model: ModelSpec, plan: Plan, options: SimOptions,
                        device_memory_bytes: float, *, block_scaled: bool = False
                        ) -> tuple[Plan, SimOptions, str | None]:
    """``(plan, options)`` unchanged when the plan's peak memory per rank
    (`memory_per_stage`, as the simulator reports it: the framework's gradient buffer, the
    device's weight casts through ``block_scaled``) fits ``device_memory_bytes``; else the
    plan with the first stronger recomputation policy of `RECOMPUTE_ORDER` that fits, and a
    flag saying so. An MoE model without recomputation tries selective recomputation of
    `MOE_LIGHT_RECOMPUTE` first (``options.recompute_modules``). A published run ran, so it
    fitted; when even full recomputation does not fit, the plan is kept as given.

    >>> from planner.presets import load_model
    >>> m = load_model("llama3-8b")
    >>> p = Plan(tp=1, pp=1, dp=8, micro_batch=2, global_batch=16, zero_stage=3)
    >>> recompute_that_fits(m, p, SimOptions(attention="flash"), 80 * 2**30)[0].recompute
    'full'
    >>> recompute_that_fits(m, p.replace(micro_batch=1, global_batch=8),
    ...                     SimOptions(attention="flash"), 80 * 2**30)[2] is None
    True
    """
    def peak(p: Plan, o: SimOptions) -> float:
        return max(s.total_bytes for s in memory_per_stage(
            model, p, attention=o.attention, fp32_main_grads=o.fp32_main_grads,
            recompute_modules=o.recompute_modules, block_scaled=block_scaled,
            main_grad_bytes=o.grad_reduce_bytes))

    if peak(plan, options) <= device_memory_bytes:
        return plan, options, None
    rungs = [(policy, options) for policy in
             RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(plan.recompute) + 1:]]
    if model.is_moe and plan.recompute == "none":
        rungs.insert(0, ("selective", replace(options, recompute_modules=MOE_LIGHT_RECOMPUTE)))
    for policy, opts in rungs:
        stronger = plan.replace(recompute=policy)
        if peak(stronger, opts) <= device_memory_bytes:
            modules = f" {list(opts.recompute_modules)}" if opts.recompute_modules else ""
            return stronger, opts, (
                f"recompute={policy}{modules} (the default {plan.recompute} needs "
                f"{peak(plan, options) / 2**30:.0f} GiB per rank; the device has "
                f"{device_memory_bytes / 2**30:.0f})")
    return plan, options, None

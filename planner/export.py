"""A plan in the words of the frameworks people run: Megatron-LM arguments, a torchtitan TOML
configuration, a DeepSpeed JSON configuration.

Every name emitted is one the framework's own parser or config schema defines; the names and
the commit they were read from are listed in ``planner/presets/export_names.yaml`` and the
tests check each emitted name against that list. A plan field the framework cannot express
is not guessed: the export carries a one-line reason for it instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from planner.spec import ZERO_BUBBLE_SCHEDULES, ModelSpec, Plan

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
#: meshplan placement (innermost axis first) that is Megatron-LM's default rank order
#: ("tp-cp-ep-dp-pp") and the one ``--use-tp-pp-dp-mapping`` selects.
_MEGATRON_ORDERS = {("tp", "dp", "pp"): None, ("tp", "pp", "dp"): "--use-tp-pp-dp-mapping"}
#: torch.distributed.pipelining schedule names (``get_schedule_class``) of meshplan schedules.
_TORCH_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                    "zb-h1": "InterleavedZeroBubble", "interleaved-zb": "InterleavedZeroBubble",
                    "zb-v": "ZBVZeroBubble", "dualpipe-v": "DualPipeV"}
#: Low-precision recipes (`planner.precision`): Megatron-LM (format flag, format, recipe
#: flag, recipe); delayed scaling is its "delayed" recipe, current scaling "tensorwise".
_MEGATRON_RECIPES = {"fp8": ("--fp8-format", "hybrid", "--fp8-recipe", "delayed"),
                     "fp8-current": ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"),
                     "mxfp8": ("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"),
                     "nvfp4": ("--fp4-format", "e2m1", "--fp4-recipe", "nvfp4")}
#: torchtitan model converters and their config sections (torchao float8 / MX linears).
_TITAN_RECIPES = {"fp8-current": ("quantize.linear.float8", {"recipe_name": "tensorwise"}),
                  "mxfp8": ("quantize.linear.mx", {"recipe_name": "mxfp8_cublas"})}


@dataclass
class Export:
    """One framework's rendering of a plan.

    Attributes:
        framework: one of `FRAMEWORKS`.
        names: every framework name used, in order (flags, ``section.key`` or JSON paths).
        text: what to paste: the argument lines, the TOML or the JSON.
        unsupported: one line per plan field the framework cannot express, and why.
    """

    framework: str
    names: list[str] = field(default_factory=list)
    text: str = ""
    unsupported: list[str] = field(default_factory=list)


def _even_edges(plan: Plan, model: ModelSpec) -> tuple[int, int, int] | None:
    # (first, middle, last) layers when every middle chunk holds the same count, else None
    chunks = plan.layers_per_stage(model)
    middle = set(chunks[1:-1]) or {chunks[0]}
    return (chunks[0], middle.pop(), chunks[-1]) if len(middle) == 1 else None


def to_megatron(model: ModelSpec, plan: Plan, *, steps: int | None = None) -> Export:
    """``pretrain_gpt.py`` arguments of Megatron-LM (``megatron/training/arguments.py``)."""
    out, args = Export("megatron"), []

    def add(flag: str, value: object = None) -> None:
        args.append((flag, value))

    add("--tensor-model-parallel-size", plan.tp)
    add("--pipeline-model-parallel-size", plan.pp)
    if plan.cp > 1:
        add("--context-parallel-size", plan.cp)
    if plan.sequence_parallel:
        add("--sequence-parallel")
    _megatron_layers(model, plan, add, out.unsupported)
    add("--micro-batch-size", plan.micro_batch)
    add("--global-batch-size", plan.global_batch)
    if plan.zero_stage == 1:
        add("--use-distributed-optimizer")
    elif plan.zero_stage >= 2:
        add("--use-megatron-fsdp")
        add("--data-parallel-sharding-strategy",
            "optim_grads" if plan.zero_stage == 2 else "optim_grads_params")
    if plan.recompute == "full":
        add("--recompute-granularity", "full")
        add("--recompute-method", "block" if plan.recompute_num_layers else "uniform")
        add("--recompute-num-layers", plan.recompute_num_layers or 1)
    elif plan.recompute == "selective":
        add("--recompute-granularity", "selective")
    _megatron_precision(plan, add)
    if getattr(plan, "ep", 1) > 1:
        add("--expert-model-parallel-size", plan.ep)
    if getattr(plan, "etp", 1) > 1:
        add("--expert-tensor-parallel-size", plan.etp)
    if plan.placement not in _MEGATRON_ORDERS:
        out.unsupported.append(f"placement={'.'.join(plan.placement)}: Megatron-LM orders ranks "
                               "tp-cp-ep-dp-pp or tp-cp-ep-pp-dp only")
    elif _MEGATRON_ORDERS[plan.placement]:
        add(_MEGATRON_ORDERS[plan.placement])
    _megatron_model(model, add)
    _megatron_experts(model, add, out.unsupported)
    if steps is not None:
        add("--train-iters", steps)
    out.names = [flag for flag, _ in args]
    out.text = " \\\n".join(flag if value is None else f"{flag} {value}" for flag, value in args)
    return out


def _megatron_layers(model: ModelSpec, plan: Plan, add, unsupported: list[str]) -> None:
    # Layers per pipeline stage and chunk: uniform virtual stages, or the first and last
    # stage set apart (Llama 3's edge split); the schedule Megatron-LM cannot run.
    edges = _even_edges(plan, model)
    if plan.virtual_stages > 1:
        if edges and edges[0] == edges[1] == edges[2]:
            add("--num-layers-per-virtual-pipeline-stage", edges[1])
        else:
            unsupported.append(f"stage_layers={list(plan.layers_per_stage(model))}: uneven "
                               "chunks with virtual stages need --pipeline-model-parallel-"
                               "layout written by hand")
    elif plan.pp > 1 and edges and (edges[0], edges[2]) != (edges[1], edges[1]):
        add("--decoder-first-pipeline-num-layers", edges[0])
        add("--decoder-last-pipeline-num-layers", edges[2])
    elif plan.pp > 1 and not edges:
        unsupported.append(f"stage_layers={list(plan.stage_layers)}: Megatron-LM sets only "
                           "the first and last stage apart from the rest")
    if plan.schedule == "gpipe" or plan.schedule in ZERO_BUBBLE_SCHEDULES:
        unsupported.append(f"schedule={plan.schedule}: Megatron-LM runs 1F1B or interleaved "
                           "1F1B only")


def _megatron_precision(plan: Plan, add) -> None:
    # 16-bit training flag, and the low-precision GEMM recipe around it.
    if plan.dtype == "fp16":
        add("--fp16")
    elif plan.dtype not in ("fp32", "tf32"):
        add("--bf16")  # bf16, and the bf16 around a low-precision recipe's GEMMs
    if plan.dtype in _MEGATRON_RECIPES:
        fmt_flag, fmt, recipe_flag, recipe = _MEGATRON_RECIPES[plan.dtype]
        add(fmt_flag, fmt)
        add(recipe_flag, recipe)


def _megatron_model(model: ModelSpec, add) -> None:
    # The model shape as Megatron-LM's network-size arguments.
    add("--num-layers", model.num_layers)
    add("--hidden-size", model.hidden)
    add("--num-attention-heads", model.num_heads)
    if model.num_kv_heads != model.num_heads:
        add("--group-query-attention")
        add("--num-query-groups", model.num_kv_heads)
    add("--ffn-hidden-size", model.ffn_hidden)
    add("--seq-length", model.seq_len)
    add("--max-position-embeddings", model.seq_len)
    add("--vocab-size", model.vocab_size)
    if model.activation == "swiglu":
        add("--swiglu")
    add("--normalization", "RMSNorm" if model.norm == "rmsnorm" else "LayerNorm")
    if not model.tied_embeddings:
        add("--untie-embeddings-and-output-weights")


def _megatron_experts(model: ModelSpec, add, unsupported: list[str]) -> None:
    # The mixture of experts as Megatron-Core's MoE arguments (TransformerConfig's moe_*
    # fields and _add_moe_args): experts, top-k, widths, shared experts, which blocks are MoE,
    # the router's score function, group-limited routing and the capacity factor.
    if not model.is_moe:
        return
    add("--num-experts", model.num_experts)
    add("--moe-router-topk", model.experts_per_token)
    add("--moe-ffn-hidden-size", model.expert_hidden)
    if model.num_shared_experts:
        # "num_shared_experts * ffn_size_of_each_shared_expert" (TransformerConfig)
        add("--moe-shared-expert-intermediate-size",
            model.num_shared_experts * model.expert_hidden)
    if model.moe_first_dense_layers:
        # a pattern string, quoted for the shell: 1 = MoE block, 0 = dense
        layers = [int(model.is_moe_layer(i)) for i in range(model.num_layers)]
        dense, moe = model.moe_first_dense_layers, model.num_layers - model.moe_first_dense_layers
        pattern = f"[0]*{dense}+[1]*{moe}" if all(layers[dense:]) else \
            "[" + ",".join(map(str, layers)) + "]"
        add("--moe-layer-freq", f'"{pattern}"')
    elif model.moe_layer_freq > 1:
        add("--moe-layer-freq", model.moe_layer_freq)   # block i is MoE when i % N == 0
    if model.router != "softmax":
        add("--moe-router-score-function", model.router)
    if model.router_groups > 1:
        add("--moe-router-num-groups", model.router_groups)
        add("--moe-router-group-topk", model.router_group_topk)
    if model.capacity_factor is not None:
        add("--moe-expert-capacity-factor", model.capacity_factor)
    if model.is_mla:
        unsupported.append(f"multi-head latent attention (kv_lora_rank={model.kv_lora_rank}, "
                           f"q_lora_rank={model.q_lora_rank}): set --multi-latent-attention "
                           f"and its head dimensions by hand")


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def to_torchtitan(model: ModelSpec, plan: Plan, *, steps: int | None = None) -> Export:
    """A torchtitan job TOML (``torchtitan/config/job_config.py``'s `JobConfig` sections)."""
    out = Export("torchtitan")
    sections: dict[str, dict[str, object]] = {"model": {}, "parallelism": {}, "training": {},
                                              "activation_checkpoint": {}}
    flavor = {"llama3-8b": "8B", "llama3-70b": "70B", "llama3-405b": "405B"}.get(model.name)
    if flavor:
        sections["model"].update(name="llama3", flavor=flavor)
    else:
        out.unsupported.append(f"model={model.name}: torchtitan builds models from registered "
                               "flavors; register one with these ModelSpec fields")
    sections["parallelism"] = _titan_parallelism(model, plan, out.unsupported)
    train = sections["training"]
    train["local_batch_size"] = plan.global_batch // plan.dp
    train["global_batch_size"] = plan.global_batch
    train["seq_len"] = model.seq_len
    if steps is not None:
        train["steps"] = steps
    train["mixed_precision_param"] = "float32" if plan.dtype in ("fp32", "tf32") else "bfloat16"
    _titan_precision(plan, sections, out.unsupported)
    ac = sections["activation_checkpoint"]
    ac["mode"] = plan.recompute
    if plan.recompute_num_layers:
        out.unsupported.append(f"recompute_num_layers={plan.recompute_num_layers}: torchtitan "
                               "checkpoints every block or every k-th one "
                               "(selective_ac_option = \"k\"), not the first N of each stage")
    if plan.recompute == "selective":
        ac["selective_ac_option"] = "op"
    lines = []
    for section, values in sections.items():
        if values:
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
            lines.append("")
            out.names += [f"{section}.{k}" for k in values]
    out.text = "\n".join(lines).rstrip() + "\n"
    return out


def _titan_parallelism(model: ModelSpec, plan: Plan, unsupported: list[str]) -> dict:
    # The [parallelism] section: DDP or FSDP2 degrees, TP / CP / PP / EP, the schedule and
    # the layers per pipeline stage.
    par: dict[str, object] = {}
    sharded = plan.zero_stage >= 2 or (plan.zero_stage == 0 and plan.world_size > plan.dp)
    if plan.zero_stage == 1:
        unsupported.append("zero_stage=1: torchtitan shards with FSDP2 (ZeRO-2/3) or "
                           "replicates (DDP); ZeRO-2 (reshard never) is the closest")
        sharded = True
    if plan.zero_stage == 0 and sharded:
        unsupported.append("zero_stage=0: torchtitan's DDP runs only without TP/PP/CP "
                           "(\"DDP has not supported > 1D parallelism\"); ZeRO-2 shown")
    par["data_parallel_replicate_degree"] = 1 if sharded else plan.dp
    par["data_parallel_shard_degree"] = plan.dp if sharded else 1
    if sharded:
        par["fsdp_reshard_after_forward"] = "always" if plan.zero_stage == 3 else "never"
    par["tensor_parallel_degree"] = plan.tp
    par["context_parallel_degree"] = plan.cp
    par["pipeline_parallel_degree"] = plan.pp
    if plan.pp > 1:
        # interleaving one chunk per rank is plain 1F1B
        schedule = "1f1b" if plan.schedule == "interleaved-1f1b" and plan.virtual_stages == 1 \
            else plan.schedule
        if schedule in _TORCH_SCHEDULES:
            par["pipeline_parallel_schedule"] = _TORCH_SCHEDULES[schedule]
        else:
            unsupported.append(f"schedule={schedule}: torch.distributed.pipelining has "
                               "no such schedule class")
        par["pipeline_parallel_microbatch_size"] = plan.micro_batch
        edges = _even_edges(plan, model)
        if edges and edges[1] - edges[0] in (0, 1) and edges[1] - edges[2] in (0, 1):
            par["pipeline_parallel_layers_per_stage"] = edges[1]
            par["pipeline_parallel_first_stage_less_layers"] = edges[1] - edges[0]
            par["pipeline_parallel_last_stage_less_layers"] = edges[1] - edges[2]
        else:
            unsupported.append(f"stage_layers={list(plan.layers_per_stage(model))}: write "
                               "module_fqns_per_model_part by hand")
    if getattr(plan, "ep", 1) > 1:
        par["expert_parallel_degree"] = plan.ep
    if getattr(plan, "etp", 1) > 1:
        par["expert_tensor_parallel_degree"] = plan.etp
    if plan.tp > 1 and not plan.sequence_parallel:
        unsupported.append("sequence_parallel=false: torchtitan always shards norms and "
                           "dropout over TP (sequence parallelism)")
    if plan.placement != ("tp", "dp", "pp"):
        unsupported.append(f"placement={'.'.join(plan.placement)}: torchtitan's mesh is "
                           "pp, dp_replicate, dp_shard, cp, tp (tp innermost) only")
    return par


def _titan_precision(plan: Plan, sections: dict, unsupported: list[str]) -> None:
    # The low-precision converter (torchao float8 / MX linears) and its section.
    if plan.dtype == "fp16":
        unsupported.append("dtype=fp16: torchtitan trains in bfloat16 or float32")
    recipe = "fp8-current" if plan.dtype == "fp8" else plan.dtype
    if plan.dtype == "fp8":
        unsupported.append("dtype=fp8 (delayed scaling): torchao's float8 linears scale "
                           "from the current tensor; tensorwise shown")
    if recipe in _TITAN_RECIPES:
        converter, values = _TITAN_RECIPES[recipe]
        sections["model"]["converters"] = [converter]
        sections[converter] = dict(values)
    elif plan.dtype == "nvfp4":
        unsupported.append("dtype=nvfp4: torchtitan has no NVFP4 linear converter")


def to_deepspeed(model: ModelSpec, plan: Plan, *, steps: int | None = None) -> Export:
    """A DeepSpeed JSON configuration (``deepspeed/runtime/constants.py`` and the ZeRO,
    precision, tensor-parallel and activation-checkpointing config schemas)."""
    out = Export("deepspeed")
    cfg: dict[str, object] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.global_batch // (plan.dp * plan.micro_batch),
        "zero_optimization": {"stage": plan.zero_stage}}
    if plan.dtype in ("bf16", "fp16"):
        cfg[plan.dtype] = {"enabled": True}
    elif plan.dtype not in ("fp32", "tf32"):
        cfg["bf16"] = {"enabled": True}
        out.unsupported.append(f"dtype={plan.dtype}: DeepSpeed has no low-precision GEMM "
                               "setting; those come from Transformer Engine layers in the "
                               "model code")
    if model.is_moe:
        shared = (f"; {model.num_shared_experts} shared expert(s) have no key either, the "
                  f"nearest in code is MoE(use_residual=True), Residual MoE"
                  if model.num_shared_experts else "")
        out.unsupported.append(
            f"num_experts={model.num_experts}: experts are built in code "
            f"(deepspeed.moe.layer.MoE(num_experts={model.num_experts}, "
            f"ep_size={plan.ep}, k={model.experts_per_token})), not in the JSON{shared}")
    if plan.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
        if plan.zero_stage == 3:
            out.unsupported.append("zero_stage=3 with tp>1: DeepSpeed AutoTP training runs "
                                   "with ZeRO 0-2")
    if plan.pp > 1:
        out.unsupported.append(f"pp={plan.pp}: pipeline stages are built in code "
                               f"(deepspeed.pipe.PipelineModule(num_stages={plan.pp})), not in "
                               "the JSON; its engine runs 1F1B")
    if plan.cp > 1:
        out.unsupported.append(f"cp={plan.cp}: DeepSpeed splits sequences with Ulysses "
                               "all-to-all, not ring attention")
    if plan.sequence_parallel:
        out.unsupported.append("sequence_parallel=true: Megatron-style sequence parallelism "
                               "lives in the model code (Megatron-DeepSpeed)")
    if plan.recompute != "none":
        cfg["activation_checkpointing"] = {"partition_activations": plan.tp > 1,
                                           "contiguous_memory_optimization": False}
        out.unsupported.append(f"recompute={plan.recompute}: the model wraps its blocks in "
                               "deepspeed.checkpointing.checkpoint; the JSON only tunes it")
    if plan.placement != ("tp", "dp", "pp"):
        out.unsupported.append(f"placement={'.'.join(plan.placement)}: DeepSpeed's topology "
                               "orders ranks pipe-data-model only")
    if steps is not None:
        out.unsupported.append(f"steps={steps}: the training loop sets the step count")
    out.names = [k if not isinstance(v, dict) else f"{k}.{sub}"
                 for k, v in cfg.items() for sub in (v if isinstance(v, dict) else [None])]
    out.text = json.dumps(cfg, indent=2) + "\n"
    return out


def export_plan(model: ModelSpec, plan: Plan, framework: str, *,
                steps: int | None = None) -> Export:
    """``plan`` of ``model`` in ``framework`` (one of `FRAMEWORKS`).

    Raises:
        ValueError: an unknown framework.
    """
    render = {"megatron": to_megatron, "torchtitan": to_torchtitan,
              "deepspeed": to_deepspeed}.get(framework)
    if render is None:
        raise ValueError(f"--to={framework!r} is not one of {list(FRAMEWORKS)}")
    return render(model, plan, steps=steps)

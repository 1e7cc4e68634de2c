"""Where a step's time and a rank's memory go, for putting two plans side by side.

`step_breakdown` simulates a plan and returns its step time split three ways: compute of the
busiest pipeline rank by op class (from the same per-op costs `simulator.step.compute` sums,
so the classes add up to its analytical compute), the communication each collective kind
keeps on the critical stage's comm stream (from the SimPy event log), and the bubble; the
memory of the rank at the peak by term (`simulator.step.memory`); and which parallel groups
span more than one node (their collectives leave NVLink).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from planner.mesh import group_ranks
from planner.spec import ModelSpec, Plan
from simulator.step.compute import ATTENTION_CORE, edge_compute, layer_forward_ops, op_time_s
from simulator.step.costs import _device, _efficiency
from simulator.step.simulate import StepPrediction, simulate
from simulator.step.stagecosts import DEFAULT_OPTIONS

#: Parallel axes whose groups `crossing_groups` checks.
AXES = ("tp", "cp", "pp", "dp")


@dataclass(frozen=True, kw_only=True)
class StepBreakdown:
    """Seconds and bytes of one plan: see the module docstring.

    Attributes:
        prediction: the traced `StepPrediction` (step, compute, exposed comm, bubble s).
        compute_by_class_s: {"gemm", "attention", "memory-bound", "recompute",
            "embedding+logits", "optimizer+other"} seconds of one step on the busiest
            pipeline rank; "optimizer+other" is compute_s less the rest.
        comm_by_kind_s: {collective kind: seconds on the critical stage's comm stream}.
        memory_bytes: {"weights", "gradients", "optimizer", "activations", "overhead"} of
            the rank at the peak.
        crossing: {axis: nodes its first group spans} for the axes spanning > 1 node.
    """

    prediction: StepPrediction
    compute_by_class_s: dict[str, float]
    comm_by_kind_s: dict[str, float]
    memory_bytes: dict[str, float]
    crossing: dict[str, int]

    def to_dict(self) -> dict:
        """JSON-ready: the prediction's figures (no memory list, no events) and the parts."""
        pred = {k: v for k, v in self.prediction.to_dict().items() if k != "memory"}
        return {**pred, "compute_by_class_s": self.compute_by_class_s,
                "comm_by_kind_s": self.comm_by_kind_s, "memory_bytes": self.memory_bytes,
                "crossing": self.crossing}


def compute_by_class_s(model: ModelSpec, plan: Plan, cluster,
                       options=DEFAULT_OPTIONS) -> dict[str, float]:
    """Compute seconds of one step on the busiest pipeline rank, by op class.

    Per block and micro-batch: every forward op of `layer_forward_ops` at `op_time_s`, its
    backward at 2x (2.5x for FlashAttention, Dao 2023 §3.1), as `layer_compute` counts them;
    recomputation repeats the forward (full) or the attention core (selective); the first
    and last chunks add the embedding and the logits + loss (`edge_compute`). Times the
    micro-batches per step, gb / (dp·mb).
    """
    eff, dev = _efficiency(cluster, options), _device(cluster)
    ops = layer_forward_ops(model, plan.micro_batch, plan.tp, plan.sequence_parallel,
                            options.attention, plan.dtype, plan.cp, options.cp_attention)
    per_layer: dict[str, float] = defaultdict(float)
    for op in ops:
        t = op_time_s(op, dev, eff, plan.dtype)
        kind = "attention" if op.name in ATTENTION_CORE else "gemm" if op.m else "memory-bound"
        bwd = (op_time_s(op._replace(bytes=op.bwd_bytes), dev, eff, plan.dtype)
               if op.bwd_bytes is not None else t * (2.5 if op.flops else 2.0))
        per_layer[kind] += t + bwd
        if plan.recompute == "full" or (plan.recompute == "selective"
                                        and op.name in ATTENTION_CORE):
            per_layer["recompute"] += t
    chunks = plan.layers_per_stage(model)
    if plan.recompute == "full":   # the block method repeats the first N of each chunk
        per_layer["recompute"] *= plan.model_full_recompute_share(model)
    last = len(chunks) - 1
    stages = []
    for rank in range(plan.pp):
        mine = range(rank, len(chunks), plan.pp)
        edges = sum(sum(edge_compute(model, plan.micro_batch, plan.tp, plan.dtype, dev, eff,
                                     first=g == 0, last=g == last, cp=plan.cp)[:2])
                    for g in mine if g in (0, last))
        stages.append((sum(chunks[g] for g in mine), edges))
    layers, edges = max(stages, key=lambda s: s[0] * sum(per_layer.values()) + s[1])
    m = plan.global_batch // (plan.dp * plan.micro_batch)
    out = {k: v * layers * m for k, v in per_layer.items()}
    out["embedding+logits"] = edges * m
    return dict(out)


IN_LAYER = "in-layer tp/cp/ep/zero3"
# the names of the other comm-stream events (simulator/step/pipeline.py), for a reader
COMM_EVENT_LABELS = {"dp-grad-reduce": "data-parallel gradient reduce",
                     "dp-weight-gather": "ZeRO weight all-gather"}


def comm_kind(name: str, plan: Plan | None = None) -> str:
    """The kind of comm-stream event ``name``.

    The in-layer collectives ("tp-F3", "tp-B3") hold what the simulator merges per
    micro-batch: TP's all-reduces (or SP's all-gathers / reduce-scatters), the CP ring,
    the MoE layers' exposed expert-parallel dispatch / combine all-to-all
    (`simulator.step.moe.chunk_moe_terms`, added to the block's comm in
    `simulator.step.costs`) and ZeRO-3's per-layer gathers and reduce-scatters. Without ``plan`` they are one key,
    `IN_LAYER`, and the other events keep their names ("dp-grad-reduce"), so two plans'
    kinds line up (`meshplan diff`). With ``plan`` every kind is a label for a reader that
    names only the collectives that plan has.
    """
    if plan is None:
        return IN_LAYER if name.startswith("tp-") else name
    if not name.startswith("tp-"):
        return COMM_EVENT_LABELS.get(name, name)
    parts = []
    if plan.tp > 1:
        parts.append("tensor-parallel " + ("all-gather / reduce-scatter"
                                           if plan.sequence_parallel else "all-reduce"))
    if plan.cp > 1:
        parts.append("context-parallel ring")
    if plan.ep > 1:
        parts.append("expert-parallel all-to-all")
    if plan.zero_stage == 3:
        parts.append("ZeRO-3 weight gather / gradient reduce-scatter")
    return " + ".join(parts) or IN_LAYER


def comm_by_kind_s(events: list[tuple]) -> dict[str, float]:
    """{kind: seconds} of the comm-stream events of the stage that finishes last, keyed by
    `comm_kind` without a plan ("in-layer tp/cp/ep/zero3", "dp-grad-reduce")."""
    if not events:
        return {}
    critical = max(events, key=lambda e: e[4])[0]
    out: dict[str, float] = defaultdict(float)
    for stage, stream, name, start, end in events:
        if stage == critical and stream == "comm":
            out[comm_kind(name)] += end - start
    return dict(out)


def crossing_groups(plan: Plan, cluster) -> dict[str, int]:
    """{axis: nodes spanned} of each axis whose first group (`planner.mesh.group_ranks`) spans
    more than one node (``cluster.node_of``)."""
    out = {}
    for axis in AXES:
        if getattr(plan, axis) > 1:
            nodes = {cluster.node_of(r) for r in group_ranks(plan, axis)}
            if len(nodes) > 1:
                out[axis] = len(nodes)
    return out


def step_breakdown(model: ModelSpec, plan: Plan, cluster) -> StepBreakdown:
    """Simulate ``plan`` (traced) and break it down (module docstring).

    Raises:
        PlanError: as `simulate`.
    """
    pred = simulate(model, plan, cluster, trace=True)
    peak = max(pred.memory, key=lambda m: m.total_bytes)
    memory = {k.removesuffix("_bytes"): v for k, v in peak.to_dict().items()
              if k != "total_bytes"}
    by_class = compute_by_class_s(model, plan, cluster)
    by_class["optimizer+other"] = max(0.0, pred.compute_s - sum(by_class.values()))
    return StepBreakdown(
        prediction=pred, compute_by_class_s=by_class,
        comm_by_kind_s=comm_by_kind_s(pred.events), memory_bytes=memory,
        crossing=crossing_groups(plan, cluster))

"""The search space of the planner and the legal candidates in it, each illegal one with a reason.

`SearchSpace` names the values each plan field may take (None: the planner's default range;
one value: a fixed field). `enumerate_candidates` walks tp × pp × dp splits of the devices, then
virtual stages, micro-batch sizes, recomputation, ZeRO stage, sequence parallelism and placement,
checking legality with integer arithmetic before it builds a `Plan`. A rule that fails for a
whole branch (tp does not divide the heads, the layers do not split over pp·v, dp·micro_batch
does not divide the global batch, the interleaved schedule refuses the micro-batch count) gives
one rejected row for that branch, named by the fields it fixes (``tp16-pp1-dp8``), with the
message `Plan` / `check_plan` would raise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

from planner.spec import (
    MESH_AXES,
    MULTI_CHUNK_SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    ModelSpec,
    Plan,
    PlanError,
    Recompute,
    Schedule,
    ZeroStage,
    _choices,
    balanced_split,
    degrees_text,
    divisors,
    require_bool,
    unknown_fields_message,
    zero_bubble_reason,
)

#: Placements searched by default: tp innermost (inside the NVSwitch domain), then dp or pp.
DEFAULT_PLACEMENTS: tuple[tuple[str, ...], ...] = (("tp", "dp", "pp"), ("tp", "pp", "dp"))
#: Largest micro-batch and virtual-stage count searched by default.
MAX_MICRO_BATCH = 8
MAX_VIRTUAL_STAGES = 8
#: Why the planner emits no ZB-H2 plan: the simulator models it, the runtime cannot run it.
ZB_H2_REASON = ("schedule='zb-h2' is simulated only: torch.distributed.pipelining has no ZB-H2 "
                "schedule; use zb-v (the same zero bubble at 1F1B's memory) or zb-h1")
#: Pipeline schedules searched by default: 1F1B and interleaved 1F1B (Narayanan et al. 2021),
#: ZB-H1 and ZB-V (Qi et al. 2024): the zero-bubble pair that keeps 1F1B's activation memory.
DEFAULT_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v")

#: Sequence length from which context parallelism is searched by default. Per token a layer's
#: GEMMs cost 24·h² FLOPs and attention 4·s·h (Narayanan et al. 2021, eq. 3), so attention
#: weighs in from s ≈ 6h / 3 (a third of the layer at h = 8192, more at smaller h); Llama 3's
#: long-context stage trains 131,072 tokens with cp = 16 (Dubey et al. 2024, §3.3).
LONG_SEQUENCE = 16384
#: Context-parallel degrees searched by default for long sequences.
DEFAULT_CP = (1, 2, 4, 8, 16)

_FIELDS = ("tp", "pp", "dp", "cp", "micro_batch", "virtual_stages", "schedule", "recompute",
           "zero_stage", "sequence_parallel", "placement", "ep", "etp")


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Values each plan field may take; None means the planner's default range.

    Attributes:
        tp: default: the divisors of the devices per node (Megatron keeps tensor parallelism
            inside the NVLink domain, Narayanan et al. 2021 §3.3) that divide the device count.
        pp: default: every divisor of devices / tp up to the layer count.
        dp: default: what is left, devices / (tp·cp·pp) (exact device count), or every
            divisor of the global batch (``max_devices``).
        cp: default (1,), or `DEFAULT_CP` from `LONG_SEQUENCE` tokens on; a cp takes its
            factor of what tp·pp leave, and must divide seq_len / 2.
        micro_batch: default: every divisor of global_batch / dp up to `MAX_MICRO_BATCH`.
        virtual_stages: model chunks per pipeline rank for the interleaved schedule; default:
            every v in [2, `MAX_VIRTUAL_STAGES`] that splits the stage's layers evenly.
        schedule: default `DEFAULT_SCHEDULES`; zero-bubble schedules only when pp > 1, ZB-V
            and DualPipe-V with two chunks per rank.
        recompute: default ("none", "selective", "full").
        zero_stage: default (0, 1, 2, 3) when dp > 1 (ZeRO-3 is FSDP).
        sequence_parallel: default (False, True) when tp > 1.
        placement: default `DEFAULT_PLACEMENTS` when both dp and pp exceed 1.
        ep: expert-parallel degrees; default for an MoE model every divisor of num_experts
            that etp·ep fits into tp·cp·dp (`expert_splits`), (1,) for a dense model.
        etp: expert tensor-parallel degrees; default (1,) and tp when tp > 1 (MoE only).
    """

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    virtual_stages: tuple[int, ...] | None = None
    schedule: tuple[Schedule, ...] | None = None
    recompute: tuple[Recompute, ...] | None = None
    zero_stage: tuple[ZeroStage, ...] | None = None
    sequence_parallel: tuple[bool, ...] | None = None
    placement: tuple[tuple[str, ...], ...] | None = None
    ep: tuple[int, ...] | None = None
    etp: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in _FIELDS:
            values = getattr(self, name)
            if values is None:
                continue
            if name == "placement":
                values = tuple(tuple(v) for v in values)
            else:
                values = tuple(values)
            object.__setattr__(self, name, values)
            if not values:
                raise PlanError(f"{name}=() allows nothing; give at least one value or None")
            for value in values:
                _check_value(name, value)
        if self.schedule is not None and self.virtual_stages is not None and not any(
                chunks_fit(s, v) for s in self.schedule for v in self.virtual_stages):
            raise PlanError(
                f"schedule={_show(self.schedule)} and virtual_stages="
                f"{_show(self.virtual_stages)} exclude each other: single-chunk schedules have "
                f"virtual_stages=1, {'/'.join(V_SCHEDULES)} 2, the interleaved ones 2 or more; "
                f"fix only one of them or a matching pair")
        if self.dp is not None and max(self.dp) == 1 and self.zero_stage is not None and \
                0 not in self.zero_stage and (self.cp is None or max(self.cp) == 1):
            raise PlanError(
                f"zero_stage={_show(self.zero_stage)} with dp=1: ZeRO shards over the dp*cp "
                f"ranks and dp=1 leaves one; fix dp > 1 (or cp > 1), or drop the zero_stage fix")

    @classmethod
    def from_fixed(cls, fixed: dict[str, object]) -> SearchSpace:
        """A space from ``{field: value or values}``, e.g. ``{"tp": 8, "recompute": ("full",)}``.

        Raises:
            PlanError: an unknown field or an illegal value.
        """
        unknown = sorted(set(fixed) - set(_FIELDS))
        if unknown:
            raise PlanError(unknown_fields_message("search", unknown, _FIELDS))
        data = {}
        for name, value in fixed.items():
            single = isinstance(value, (int, str, bool)) or (
                name == "placement" and value and isinstance(value[0], str))
            data[name] = (value,) if single else tuple(value)
        return cls(**data)

    def fixed(self) -> dict[str, tuple]:
        """The fields this space restricts, with their allowed values."""
        return {n: getattr(self, n) for n in _FIELDS if getattr(self, n) is not None}

    def replace(self, **changes: object) -> SearchSpace:
        """A copy with some fields changed (None frees a field)."""
        return dataclasses.replace(self, **changes)


def _show(values: tuple) -> str:
    return ",".join(map(str, values))


def chunks_fit(schedule: str, virtual_stages: int) -> bool:
    """Whether ``schedule`` runs ``virtual_stages`` model chunks per pipeline rank: one for the
    single-chunk schedules, two for the V schedules (ZB-V, Qi et al. 2024 §6; DualPipe-V), two
    or more for the interleaved ones (Narayanan et al. 2021 §2.2)."""
    if schedule not in MULTI_CHUNK_SCHEDULES:
        return virtual_stages == 1
    if schedule in V_SCHEDULES:
        return virtual_stages == 2
    return virtual_stages >= 2


def _check_value(name: str, value: object) -> None:
    if name == "placement":
        if tuple(sorted(value)) != tuple(sorted(MESH_AXES)):
            raise PlanError(f"placement={list(value)} must order each of {list(MESH_AXES)} "
                            f"exactly once, innermost first")
        return
    if name == "sequence_parallel":
        require_bool(name, value)
        return
    literal = {"schedule": Schedule, "recompute": Recompute, "zero_stage": ZeroStage}.get(name)
    if literal is not None:
        if value not in _choices(literal):
            raise PlanError(f"{name}={value!r} is not one of {list(_choices(literal))}")
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """One rejected branch of the space: ``id`` names the fields it fixes."""

    id: str
    reason: str
    kind: str


def tp_reason(model: ModelSpec, tp: int) -> str:
    """'' if tp divides the heads, KV heads and ffn width, else `check_plan`'s message."""
    for field, value in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                         ("ffn_hidden", model.ffn_hidden)):
        if value % tp:
            legal = divisors(math.gcd(model.num_heads, model.num_kv_heads, model.ffn_hidden))
            return f"tp={tp} does not divide {field}={value}; use tp in {legal}"
    return ""


def edge_stage_layers(model: ModelSpec, pp: int, v: int) -> tuple[int, ...] | None:
    """Layers per chunk when pp·v chunks do not split the layers evenly but would with two
    more: the first and the last chunk get one layer fewer, as Llama 3 405B's 126 layers on
    16 stages (Dubey et al. 2024, §3.3.2: one layer fewer on the first and last stages, which
    hold the embedding and the output layer; Megatron-LM's
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``).
    None when the layers split evenly or this split does not exist either.

    >>> from planner.presets import load_model
    >>> edge_stage_layers(load_model("llama3-405b"), 16, 1)
    (7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7)
    """
    chunks = pp * v
    if chunks < 3 or model.num_layers % chunks == 0 or (model.num_layers + 2) % chunks:
        return None
    per = (model.num_layers + 2) // chunks
    if per < 2:
        return None
    return (per - 1,) + (per,) * (chunks - 2) + (per - 1,)


def layers_reason(model: ModelSpec, pp: int, v: int) -> str:
    """'' if the layers split evenly over pp·v chunks (or with one fewer on the first and
    last, `edge_stage_layers`), else `Plan.layers_per_stage`'s message."""
    if model.num_layers % (pp * v) == 0 or edge_stage_layers(model, pp, v):
        return ""
    return (f"num_layers={model.num_layers} does not split over pp*virtual_stages = "
            f"{pp}*{v} = {pp * v}; give stage_layers explicitly or use pp*virtual_stages in "
            f"{divisors(model.num_layers)}")


def batch_reason(global_batch: int, dp: int, mb: int) -> str:
    """'' if dp·micro_batch divides the global batch, else `Plan`'s message."""
    per_step = dp * mb
    if global_batch % per_step == 0:
        return ""
    return (f"global_batch={global_batch} is not divisible by dp*micro_batch = {dp}*{mb} = "
            f"{per_step}; use global_batch a multiple of {per_step}")


def interleaved_reason(pp: int, num_microbatches: int) -> str:
    """'' if the interleaved 1F1B schedule accepts m micro-batches on pp stages (Megatron-LM
    needs m % pp == 0), else `Plan`'s message."""
    if pp == 1 or num_microbatches % pp == 0:
        return ""
    return (f"schedule='interleaved-1f1b' needs the micro-batch count ({num_microbatches}) to "
            f"be a multiple of pp={pp}")


def _fill_reason(what: str, product: int, n: int, exact: bool) -> str:
    # '' if ``product`` devices can be part of the job, else why not.
    if exact:
        return f"{what} does not divide num_devices={n}" if n % product else ""
    return f"{what} > max_devices={n}" if product > n else ""


def default_cp(model: ModelSpec, space: SearchSpace) -> tuple[int, ...]:
    """Context-parallel degrees to search: the space's, else `DEFAULT_CP` from
    `LONG_SEQUENCE` tokens on, else (1,)."""
    return space.cp or (DEFAULT_CP if model.seq_len >= LONG_SEQUENCE else (1,))


def splits(model: ModelSpec, space: SearchSpace, *, devices_per_node: int,
           num_devices: int | None, max_devices: int | None, global_batch: int
           ) -> Iterator[tuple[int, int, int, int] | Rejection]:
    """Every (tp, cp, pp, dp) of the space: tp·cp·pp·dp == num_devices, or <= max_devices.

    A fixed tp, cp, pp or dp that cannot fill the devices gives a `Rejection` instead, and
    so does a fixed cp that does not divide seq_len / 2.
    """
    exact = num_devices is not None
    n = num_devices if exact else max_devices
    tps = space.tp or tuple(d for d in divisors(devices_per_node) if d <= n)
    cps = default_cp(model, space)
    for tp in tps:
        if reason := _fill_reason(f"tp={tp}", tp, n, exact):
            yield Rejection(id=f"tp{tp}", kind="devices", reason=reason)
            continue
        for cp in cps:
            c_id = f"tp{tp}-cp{cp}" if cp > 1 else f"tp{tp}"
            if cp > 1 and model.seq_len % (2 * cp):
                if space.cp is not None:
                    yield Rejection(id=c_id, kind="cp", reason=(
                        f"cp={cp} needs seq_len={model.seq_len} divisible by 2*cp = {2 * cp}"))
                continue
            if reason := _fill_reason(f"tp*cp = {tp}*{cp} = {tp * cp}", tp * cp, n, exact):
                if space.cp is not None:
                    yield Rejection(id=c_id, kind="devices", reason=reason)
                continue
            rest = n // (tp * cp)
            pps = space.pp or tuple(d for d in divisors(rest) if d <= model.num_layers
                                    and (exact or not layers_reason(model, d, 1)))
            for pp in pps:
                if reason := _fill_reason(degrees_text(tp, cp, pp), tp * cp * pp, n, exact):
                    yield Rejection(id=f"{c_id}-pp{pp}", kind="devices", reason=reason)
                    continue
                dps = (rest // pp,) if exact else (space.dp or tuple(divisors(global_batch)))
                if exact and space.dp is not None and dps[0] not in space.dp:
                    for dp in space.dp:
                        yield Rejection(id=f"{c_id}-pp{pp}-dp{dp}", kind="devices", reason=(
                            f"{degrees_text(tp, cp, pp, dp)} != num_devices({n})"))
                    continue
                for dp in dps:
                    if tp * cp * pp * dp <= n:
                        yield tp, cp, pp, dp
                    elif space.dp is not None:
                        yield Rejection(id=f"{c_id}-pp{pp}-dp{dp}", kind="devices", reason=(
                            f"{degrees_text(tp, cp, pp, dp)} > max_devices={n}"))


def expert_splits(model: ModelSpec, space: SearchSpace, tp: int, attn: int
                  ) -> Iterator[tuple[int, int] | Rejection]:
    """Every (ep, etp) of the space for ``attn`` = tp·cp·dp ranks per stage, or a `Rejection`
    for a fixed value that breaks a rule (`planner.spec.check_experts`, MoE parallel
    folding). A dense model gets (1, 1) only, so dense searches enumerate nothing more.
    """
    if not model.is_moe:
        for ep in space.ep or (1,):
            for etp in space.etp or (1,):
                if ep > 1 or etp > 1:
                    yield Rejection(id=f"ep{ep}-etp{etp}", kind="ep", reason=(
                        f"ep={ep}, etp={etp}: expert parallelism needs a mixture-of-experts "
                        f"model (num_experts > 0; {model.name!r} is dense)"))
                else:
                    yield 1, 1
        return
    etps = space.etp or ((1, tp) if tp > 1 else (1,))
    eps = space.ep or tuple(divisors(model.num_experts))
    for etp in etps:
        for ep in eps:
            if model.num_experts % ep or model.expert_hidden % etp or attn % (ep * etp):
                if space.ep is not None or space.etp is not None:
                    yield Rejection(id=f"ep{ep}-etp{etp}", kind="ep",
                                    reason=_expert_split_reason(model, ep, etp, attn))
                continue
            yield ep, etp


def _expert_split_reason(model: ModelSpec, ep: int, etp: int, attn: int) -> str:
    """The rules an (ep, etp) pair breaks, each stated whole: ep divides the experts, etp the
    expert width, and etp*ep the attention ranks (Megatron-Core's MoE parallel folding).

    >>> from planner.presets import load_model
    >>> _expert_split_reason(load_model("mixtral-8x7b"), 2, 1, 1)
    'ep=2, etp=1: etp*ep = 2 must divide the attention ranks tp*cp*dp = 1'
    """
    broken = [f"ep must divide num_experts={model.num_experts}"
              if model.num_experts % ep else "",
              f"etp must divide the expert width {model.expert_hidden}"
              if model.expert_hidden % etp else "",
              f"etp*ep = {ep * etp} must divide the attention ranks tp*cp*dp = {attn}"
              if attn % (ep * etp) else ""]
    return f"ep={ep}, etp={etp}: " + "; ".join(b for b in broken if b)


def _virtual(model: ModelSpec, space: SearchSpace, pp: int) -> list[tuple[str, int]]:
    # (schedule, virtual_stages) pairs; explicit v values are kept so their rejection shows.
    # A fixed virtual_stages binds: it drops the schedules that cannot run that many chunks.
    schedules = space.schedule or DEFAULT_SCHEDULES
    fixed_v = space.virtual_stages
    out = []
    for schedule in schedules:
        if schedule in ZERO_BUBBLE_SCHEDULES and pp == 1:
            continue  # nothing to pipeline
        if schedule not in MULTI_CHUNK_SCHEDULES or schedule in V_SCHEDULES:
            v = 1 if schedule not in MULTI_CHUNK_SCHEDULES else 2  # a V: two chunks per rank
            if fixed_v is None or v in fixed_v:
                out.append((schedule, v))
        elif pp > 1:
            vs = tuple(v for v in fixed_v if chunks_fit(schedule, v)) if fixed_v else tuple(
                v for v in range(2, MAX_VIRTUAL_STAGES + 1)
                if model.num_layers % (pp * v) == 0 or edge_stage_layers(model, pp, v))
            out += [(schedule, v) for v in vs]
    return out


def enumerate_candidates(model: ModelSpec, space: SearchSpace, *, devices_per_node: int,
                         global_batch: int, dtype: str, num_devices: int | None = None,
                         max_devices: int | None = None) -> Iterator[Plan | Rejection]:
    """Every plan of ``space`` (a `Plan`) and every rejected branch (a `Rejection`).

    Exactly one of ``num_devices`` (use all of them) and ``max_devices`` (use at most that
    many) is given.
    """
    if (num_devices is None) == (max_devices is None):
        raise PlanError("give exactly one of num_devices and max_devices")
    mbs_fixed = space.micro_batch
    for item in splits(model, space, devices_per_node=devices_per_node,
                             num_devices=num_devices, max_devices=max_devices,
                             global_batch=global_batch):
        if isinstance(item, Rejection):
            yield item
            continue
        tp, cp, pp, dp = item
        split_id = f"tp{tp}-cp{cp}-pp{pp}-dp{dp}" if cp > 1 else f"tp{tp}-pp{pp}-dp{dp}"
        reason = tp_reason(model, tp)
        if reason:
            yield Rejection(id=split_id, reason=reason, kind="tp")
            continue
        reason = layers_reason(model, pp, 1)
        if reason and not model.is_moe:
            yield Rejection(id=split_id, reason=reason, kind="layers")
            continue
        yield from _split_plans(model, space, tp, cp, pp, dp, global_batch, dtype, mbs_fixed)


def _split_plans(model: ModelSpec, space: SearchSpace, tp: int, cp: int, pp: int, dp: int,
                 global_batch: int, dtype: str, mbs_fixed) -> Iterator[Plan | Rejection]:
    # Every plan (or rejection) of one (tp, cp, pp, dp) split.
    split_id = f"tp{tp}-cp{cp}-pp{pp}-dp{dp}" if cp > 1 else f"tp{tp}-pp{pp}-dp{dp}"
    if global_batch % dp:
        yield Rejection(id=f"{split_id}-gb{global_batch}",
                        reason=batch_reason(global_batch, dp, 1), kind="batch")
        return
    per_replica = global_batch // dp
    mbs = mbs_fixed or tuple(d for d in divisors(per_replica) if d <= MAX_MICRO_BATCH)
    sps = space.sequence_parallel or ((False, True) if tp > 1 else (False,))
    sps = tuple(sp for sp in sps if tp > 1 or not sp)
    zeros = space.zero_stage or (0, 1, 2, 3)
    if dp * cp == 1 and 0 in zeros:
        zeros = (0,)  # nothing to shard over: every ZeRO stage is plain data parallel
    elif dp * cp == 1:
        yield Rejection(id=f"{split_id}-zero{zeros[0]}", kind="devices", reason=(
            f"zero_stage={_show(zeros)} shards over dp*cp ranks and {split_id} has one"))
        return
    places = space.placement or (DEFAULT_PLACEMENTS if dp > 1 and pp > 1
                                 else (MESH_AXES,))
    rcs = space.recompute or ("none", "selective", "full")
    experts = []
    for item in expert_splits(model, space, tp, tp * cp * dp):
        if isinstance(item, Rejection):
            yield Rejection(id=f"{split_id}-{item.id}", reason=item.reason, kind=item.kind)
        else:
            experts.append(item)
    if not experts:
        return
    for schedule, v in _virtual(model, space, pp):
        if v > 1:
            reason = layers_reason(model, pp, v)
            if reason:
                yield Rejection(id=f"{split_id}-v{v}", reason=reason, kind="layers")
                continue
        # An MoE model's layers need not split evenly either: its stages take the balanced
        # split (Megatron-Core's first/last-stage layer counts; DeepSeek-V3's 61 blocks).
        layout = edge_stage_layers(model, pp, v) or (
            balanced_split(model.num_layers, pp * v) if model.is_moe else None)
        for mb in mbs:
            mb_id = f"{split_id}-mb{mb}-gb{global_batch}"
            if per_replica % mb:
                yield Rejection(id=mb_id, reason=batch_reason(global_batch, dp, mb),
                                kind="batch")
                continue
            if schedule == "interleaved-1f1b":
                reason = interleaved_reason(pp, per_replica // mb)
            elif schedule == "zb-h2":
                reason = ZB_H2_REASON
            else:
                reason = zero_bubble_reason(schedule, pp, v, per_replica // mb)
            if reason:
                yield Rejection(id=f"{mb_id}-v{v}-{schedule}" if schedule != "interleaved-1f1b"
                                else f"{mb_id}-v{v}", reason=reason, kind="schedule")
                continue
            for rc in rcs:
                for zero in zeros:
                    for sp in sps:
                        for place in places:
                            for ep, etp in experts:
                                yield Plan(tp=tp, pp=pp, dp=dp, cp=cp, micro_batch=mb,
                                           global_batch=global_batch, schedule=schedule,
                                           virtual_stages=v, recompute=rc, zero_stage=zero,
                                           sequence_parallel=sp, dtype=dtype,
                                           placement=place, ep=ep, etp=etp,
                                           stage_layers=layout)

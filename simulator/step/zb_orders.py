"""Operation orders of the zero-bubble pipeline schedules, one list per pipeline rank.

The backward of a chunk splits into B (the input gradient, which the previous stage waits
for) and W (the weight gradient, which nothing downstream waits for), so W can fill the
bubbles (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024, §2). An order is a
list of steps; a step is one op ``(kind, chunk, micro_batch)`` or two ops that run as one
overlapped pair (DualPipe's F&B, DeepSeek-V3 technical report §3.2.1). Kinds: "F" forward,
"B" input gradient, "W" weight gradient, "BW" the whole backward (B then W). ``chunk`` is
the global chunk index in pipeline order (0 .. pp·v − 1).

These are the orders torch.distributed.pipelining runs (torch 2.13 ``schedules.py``:
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``), so the
simulator models the schedule the runtime executes; tests/simulator/test_zero_bubble.py
compares them op for op.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import lru_cache

Op = tuple[str, int, int]
Step = tuple[Op, ...]


class _Counter:
    """Next micro-batch of each (kind, chunk): the schedules run each chunk's micro-batches
    in order."""

    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = defaultdict(int)

    def take(self, kind: str, chunk: int) -> Op:
        key = ("B" if kind == "BW" else kind, chunk)
        k = self.next[key]
        self.next[key] = k + 1
        if kind == "BW":
            self.next[("W", chunk)] += 1
        return (kind, chunk, k)


def interleaved_zb_order(pp: int, m: int, rank: int, v: int = 1) -> list[Step]:
    """ZB-H1 (v = 1; Qi et al. 2024 §2.1, Figure 3 top) and its interleaved form over v chunks
    (the ZB-1p of torch's ``ScheduleInterleavedZeroBubble``).

    Interleaved 1F1B's order with v chunks, rounds of r = m / max(1, m // pp) micro-batches
    and w = min((v − 1)·r + pp − 1 − rank, m·v) warm-up forwards; every backward is B only
    and the W of the oldest B follows each F/B pair and each cool-down B once ``rank`` pairs
    have passed (rank i defers i W's, which fill the cool-down bubble); the rest of the W's
    end the step. Peak activations: pp micro-batches of a stage, as 1F1B (Qi et al. Table 2).

    >>> [s[0] for s in interleaved_zb_order(2, 2, 1)]  # rank 1 of 2 defers one W
    [('F', 1, 0), ('B', 1, 0), ('F', 1, 1), ('B', 1, 1), ('W', 1, 0), ('W', 1, 1)]
    """
    per_round = m // max(1, m // pp)
    total = m * v
    warm = min((v - 1) * per_round + pp - 1 - rank, total)

    def fwd_chunk(k: int) -> int:
        return (k // per_round) % v * pp + rank

    def bwd_chunk(k: int) -> int:
        return (v - 1 - (k - warm) // per_round % v) * pp + rank

    count, order, pending = _Counter(), [], []
    for k in range(total + warm):
        if k < total:
            order.append((count.take("F", fwd_chunk(k)),))
        if k >= warm:
            order.append((count.take("B", bwd_chunk(k)),))
            pending.append(bwd_chunk(k))
            if k - warm >= rank:
                order.append((count.take("W", pending.pop(0)),))
    order += [(count.take("W", g),) for g in pending]
    return order


def zb_h2_order(pp: int, m: int, rank: int) -> list[Step]:
    """ZB-H2 (Qi et al. 2024 §2.2, Figure 3 bottom): 1F1B's order with w = min(2(pp − rank)
    − 1, m) warm-up forwards, then for each micro-batch k: B(k), the W of the oldest B once
    2·rank have waited (rank i defers 2i W's to the tail), then the next forward. With F = B
    = W the ranks form a parallelogram: every rank busy from its first op to its last, at
    (2·pp − 1) micro-batches of activations on rank 0 (their Table 2).

    >>> [f"{s[0][0]}{s[0][2] + 1}" for s in zb_h2_order(4, 8, 3)][:6]  # Figure 3, device 4
    ['F1', 'B1', 'F2', 'B2', 'F3', 'B3']
    """
    warm = min(2 * (pp - rank) - 1, m)
    order: list[Step] = [(("F", rank, k),) for k in range(warm)]
    pending: list[int] = []
    for k in range(m):
        order.append((("B", rank, k),))
        pending.append(k)
        if k >= 2 * rank:
            order.append((("W", rank, pending.pop(0)),))
        if k + warm < m:
            order.append((("F", rank, k + warm),))
    return order + [(("W", rank, k),) for k in pending]


def zbv_order(pp: int, m: int, rank: int) -> list[Step]:
    """ZB-V (Qi et al. 2024 §6; torch's ``ScheduleZBVZeroBubble``): two chunks per rank in a
    V, rank r holding chunks r (c0) and 2·pp − 1 − r (c1).

    Warm-up 2(pp − r) − 1 forwards of c0, then r pairs F(c1) F(c0), then pp − r rounds of
    F B W on c1; steady state F(c0) B(c0) W(c0) F(c1) B(c1) W(c1) until every forward is
    done; cool-down r pairs B(c0) B(c1), pp − r pairs B(c0) W(c0), then the W's left (c1
    first). Micro-batch count M = max(2·pp − 1, m); ops of micro-batches >= m are dropped.
    Zero bubble when F = B = W (Qi et al. §6).
    """
    c0, c1 = rank, 2 * pp - 1 - rank
    n = max(2 * pp - 1, m)
    count, order = _Counter(), []

    def add(*ops: tuple[str, int]) -> None:
        order.extend((count.take(kind, g),) for kind, g in ops)

    add(*[("F", c0)] * (2 * (pp - rank) - 1))
    add(*[("F", c1), ("F", c0)] * rank)
    add(*[("F", c1), ("B", c1), ("W", c1)] * (pp - rank))
    while count.next[("F", c1)] < count.next[("F", c0)] or count.next[("F", c0)] < n:
        if count.next[("F", c0)] < n:
            add(("F", c0))
        add(("B", c0), ("W", c0), ("F", c1), ("B", c1), ("W", c1))
    add(*[("B", c0), ("B", c1)] * rank)
    add(*[("B", c0), ("W", c0)] * (pp - rank))
    add(*[("W", c1)] * (count.next[("B", c1)] - count.next[("W", c1)]))
    add(*[("W", c0)] * (count.next[("B", c0)] - count.next[("W", c0)]))
    return [s for s in order if s[0][2] < m]


def dualpipev_order(pp: int, m: int, rank: int) -> list[Step]:
    """DualPipe-V (DeepSeek-V3 technical report §3.2.1, DualPipe "cut in half" to one
    direction; torch's ``ScheduleDualPipeV``): two chunks per rank in a V, rank r holding
    chunks r (c0) and 2·pp − 1 − r (c1); needs m >= 2·pp.

    1. 2(pp − r − 1) forwards of c0; 2. r + 1 pairs F(c0) F(c1); 3. pp − r − 1 rounds of
    B(c1), the oldest pending W, F(c1); 4. m − 2·pp + r + 1 rounds of the overlapped pairs
    F(c0)&BW(c1), F(c1)&BW(c0) (the last rank runs its first F(c0), BW(c1) apart); 5. pp − r
    − 1 rounds of BW(c1), F(c1)&BW(c0); 6. r + 1 rounds of a c1 then a c0 backward, whole
    until half-way, then B only (W deferred); 7. pp − r − 1 rounds of a pending W and a c0
    backward; 8. the pending W's. Pending W's run oldest first.
    """
    c0, c1 = rank, 2 * pp - 1 - rank
    count, order, pending = _Counter(), [], []

    def one(kind: str, g: int) -> None:
        op = count.take(kind, g)
        order.append((op,))
        if kind == "B":
            pending.append(op)

    def weight() -> None:
        if pending:
            order.append((("W",) + pending.pop(0)[1:],))

    def pair(forward: int, backward: int) -> None:
        order.append((count.take("F", forward), count.take("BW", backward)))

    for _ in range(2 * (pp - rank - 1)):
        one("F", c0)
    for _ in range(rank + 1):
        one("F", c0), one("F", c1)
    for _ in range(pp - rank - 1):
        one("B", c1), weight(), one("F", c1)
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:
            one("F", c0), one("BW", c1)
        else:
            pair(c0, c1)
        pair(c1, c0)
    for _ in range(pp - rank - 1):
        one("BW", c1), pair(c1, c0)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        one("B" if split else "BW", c1)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        one("B" if split else "BW", c0)
    for _ in range(pp - rank - 1):
        weight(), one("B" if split else "BW", c0)
    for _ in range(rank + 1):
        weight()
    return order


#: Order function of each zero-bubble schedule: (pp, m, rank, v) -> steps.
ORDERS: dict[str, Callable[[int, int, int, int], list[Step]]] = {
    "zb-h1": lambda pp, m, rank, v: interleaved_zb_order(pp, m, rank, 1),
    "zb-h2": lambda pp, m, rank, v: zb_h2_order(pp, m, rank),
    "interleaved-zb": interleaved_zb_order,
    "zb-v": lambda pp, m, rank, v: zbv_order(pp, m, rank),
    "dualpipe-v": lambda pp, m, rank, v: dualpipev_order(pp, m, rank),
}


def rank_order(schedule: str, pp: int, m: int, rank: int, v: int = 1) -> list[Step]:
    """The steps of pipeline rank ``rank`` under zero-bubble ``schedule`` (a key of `ORDERS`).

    Raises:
        KeyError: ``schedule`` is not a zero-bubble schedule.
    """
    return ORDERS[schedule](pp, m, rank, v)


@lru_cache(maxsize=65536)
def rank_peak_in_flight(schedule: str, pp: int, m: int, rank: int, v: int = 1) -> int:
    """`peak_in_flight` of `rank_order`, memoised: a search asks it of the same (schedule,
    pp, m, rank, v) for every plan that differs only in tp, dp, recomputation or ZeRO, and
    building the order is O(m·v) steps. The peak is reached in the warm-up, which no
    zero-bubble order makes longer than 2·pp·v chunk passes (ZB-H2's 2·pp − 1 micro-batches
    is the longest), so past `PEAK_SATURATES` · pp micro-batches it is that count's peak
    (tests/simulator/test_zero_bubble.py checks it against the whole order)."""
    return _peak(schedule, pp, min(m, PEAK_SATURATES * pp), rank, v)


#: Micro-batches per pipeline rank past which a zero-bubble order's activation peak no longer
#: grows (`rank_peak_in_flight`).
PEAK_SATURATES = 8


@lru_cache(maxsize=65536)
def _peak(schedule: str, pp: int, m: int, rank: int, v: int) -> int:
    return peak_in_flight(rank_order(schedule, pp, m, rank, v))


def peak_in_flight(order: list[Step]) -> int:
    """Most chunk micro-batches whose activations a rank holds at once under ``order``.

    A forward stores its chunk's activations; they are freed when the weight gradient is done
    (W, or a whole backward BW): B still needs the layer inputs for W (Qi et al. 2024 §2.3).
    In an overlapped F&B pair the forward allocates before the backward frees, which is the
    + 1 of DualPipe's PP + 1 (DeepSeek-V3 report, Table 2).

    >>> peak_in_flight(interleaved_zb_order(4, 8, 0))  # ZB-H1 rank 0: pp, as 1F1B
    4
    """
    held = peak = 0
    for step in order:
        for kind, _, _ in step:
            if kind == "F":
                held += 1
                peak = max(peak, held)
            elif kind in ("W", "BW"):
                held -= 1
    return peak

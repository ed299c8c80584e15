"""Pipeline schedules as data: a table of what every stage does at every tick.

A schedule is built for (schedule, p stages, m microbatches, v virtual stages per device) in two
steps. First each stage gets its *order*: the list of actions it runs, one after the other
(GPipe: all forwards then all backwards; 1F1B: p - s - 1 warm-up forwards, then one forward and
one backward in turn; interleaved: Megatron's order over v chunks in groups of p microbatches;
ZB-H1: the 1F1B order with each backward split into an input-gradient pass B and a
weight-gradient pass W, the W passes filling the ticks where B or F would wait). Then a
lock-step simulation places the actions on ticks: at each tick a stage runs its next action
when what it needs was finished at an earlier tick (a forward needs the previous virtual
stage's forward of the microbatch, a backward the next virtual stage's backward, or, on the last
one, its own forward), else it idles (ZB-H1: runs a pending W). Every tick ends with one
activation sent to the next stage and one gradient to the previous one (`pipeline.py`).

The table (`Table.actions`, int32 [ticks, p, FIELDS]) also names buffer slots: a stage's input
of (microbatch, chunk) lands in an input slot when it arrives (or at the forward on the first
stage) and stays until its backward (ZB: its W) has run; an arriving output gradient takes a
gradient slot the same way. The peak number of input slots in use is the peak in-flight
microbatches of that stage: GPipe m, 1F1B p (first stage).

Virtual stage (chunk) c of the p * v chunks runs on device c % p as its local chunk c // p
(MaxText's circular pipeline).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
IDLE, F, B, W, BW = 0, 1, 2, 3, 4  # BW: input and weight gradients in one pass
# fields of one table entry
ACTION, MB, CHUNK, X_SLOT, G_SLOT, RECV_X, RECV_G = range(7)
FIELDS = 7


@dataclasses.dataclass(frozen=True)
class Table:
    """The schedule of (schedule, stages, microbatches, virtual) as ticks x stages of actions."""

    schedule: str
    stages: int
    microbatches: int
    virtual: int
    actions: np.ndarray  # int32 [ticks, stages, FIELDS]; -1 where a field does not apply
    in_flight: tuple[int, ...]  # peak input slots in use, per stage
    grad_slots: int  # gradient slots every stage keeps

    @property
    def ticks(self) -> int:
        return self.actions.shape[0]

    @property
    def x_slots(self) -> int:
        return max(self.in_flight)

    @property
    def busy(self) -> int:
        """Stage-ticks that run an action."""
        return int(np.sum(self.actions[:, :, ACTION] != IDLE))

    @property
    def bubble(self) -> float:
        """Idle share of all stage-ticks: 1 - busy / (ticks * stages)."""
        return 1.0 - self.busy / (self.ticks * self.stages)

    @property
    def bubble_ratio(self) -> float:
        """Idle stage-ticks per busy one, the quantity of the textbook formulas ((p-1)/m ...)."""
        return (self.ticks * self.stages - self.busy) / self.busy


def formula(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble ratio (idle over useful time): (p-1)/m for GPipe and 1F1B,
    (p-1)/(v m) interleaved; ZB-H1's is (p-1)/(3m) with F, B and W of equal cost."""
    return {
        "gpipe": (p - 1) / m,
        "1f1b": (p - 1) / m,
        "interleaved": (p - 1) / (v * m),
        "zero_bubble": (p - 1) / (3 * m),
    }[schedule]


def _orders(schedule: str, p: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    """Per stage, the ordered (action, microbatch, local chunk) it runs (ZB: without its W)."""
    orders = []
    for s in range(p):
        if schedule == "gpipe":
            order = [(F, i, 0) for i in range(m)] + [(BW, i, 0) for i in range(m)]
        elif schedule in ("1f1b", "zero_bubble"):
            back = B if schedule == "zero_bubble" else BW
            warm = min(p - s - 1, m)
            order = [(F, i, 0) for i in range(warm)]
            for i in range(m - warm):
                order += [(F, warm + i, 0), (back, i, 0)]
            order += [(back, i, 0) for i in range(m - warm, m)]
        else:  # interleaved (Megatron): microbatches in groups of p, chunk by chunk
            fwd = [(g * p + i, j) for g in range(m // p) for j in range(v) for i in range(p)]
            bwd = [
                (g * p + i, v - 1 - j) for g in range(m // p) for j in range(v) for i in range(p)
            ]
            warm = min((p - s - 1) * 2 + (v - 1) * p, m * v)
            order = [(F, *fwd[k]) for k in range(warm)]
            for k in range(m * v - warm):
                order += [(F, *fwd[warm + k]), (BW, *bwd[k])]
            order += [(BW, *bwd[k]) for k in range(m * v - warm, m * v)]
        orders.append(order)
    return orders


@functools.cache
def build(schedule: str, p: int, m: int, v: int = 1) -> Table:
    """The table of `schedule` for p stages, m microbatches and v virtual stages per device."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {SCHEDULES}")
    orders = _orders(schedule, p, m, v)
    n_chunks = p * v
    done: dict[tuple[int, int, int], int] = {}  # (action kind, mb, virtual stage) -> tick
    pos = [0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    rows: list[list[tuple[int, int, int]]] = []
    total = sum(len(o) for o in orders) + (m * v * p if schedule == "zero_bubble" else 0)

    def ready(kind: int, mb: int, c: int, t: int) -> bool:
        if kind == F:
            return c == 0 or done.get((F, mb, c - 1), t) < t
        if c == n_chunks - 1:
            return done.get((F, mb, c), t) < t
        return done.get((B, mb, c + 1), t) < t

    t = executed = 0
    while executed < total:
        row = []
        for s in range(p):
            act = (IDLE, -1, -1)
            nxt = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            can = nxt is not None and ready(nxt[0], nxt[1], nxt[2] * p + s, t)
            # ZB-H1 defers no W past the stage's next action, so it holds no more inputs
            # than 1F1B; a W runs where the next F / B has to wait, or right after it
            if pending_w[s]:
                mb, j = pending_w[s].pop(0)
                act = (W, mb, j)
            elif can:
                act = nxt
                pos[s] += 1
                if act[0] == B:
                    pending_w[s].append((act[1], act[2]))
            row.append(act)
        for s, (kind, mb, j) in enumerate(row):
            if kind != IDLE:  # a BW is a B for the stage before it
                done[(B if kind == BW else kind, mb, j * p + s)] = t
                executed += 1
        rows.append(row)
        t += 1
        if t > 10 * total + 10:
            raise RuntimeError(f"schedule {schedule} p={p} m={m} v={v} does not finish")
    return _with_slots(schedule, p, m, v, rows)


def _with_slots(schedule, p, m, v, rows) -> Table:
    """Adds input / gradient slots and arrivals to the placed actions."""
    n_chunks, n_ticks = p * v, len(rows)
    table = np.full((n_ticks, p, FIELDS), -1, np.int32)
    # (mb, virtual stage) -> tick of its F, its B (BW) and the tick its inputs may be freed
    f_tick, b_tick, free_x = {}, {}, {}
    for t, row in enumerate(rows):
        for s, (kind, mb, j) in enumerate(row):
            table[t, s, :3] = (kind, mb, j)
            c = j * p + s if kind != IDLE else -1
            if kind == F:
                f_tick[mb, c] = t
            if kind in (B, BW):
                b_tick[mb, c] = t
            if kind in (W, BW):
                free_x[mb, c] = t
    # input of (mb, c) on device c % p: from the arrival (end of tick f_tick[mb, c-1]) or, for
    # chunk 0, from its own forward, to its W / BW. Gradient of (mb, c) for c < last: from the
    # arrival (end of b_tick[mb, c+1]) to its B (BW) or, with ZB, its W.
    x_span = {k: (f_tick[k[0], k[1] - 1] if k[1] else f_tick[k], free_x[k]) for k in f_tick}
    g_end = free_x if schedule == "zero_bubble" else b_tick
    g_span = {k: (b_tick[k[0], k[1] + 1], g_end[k]) for k in f_tick if k[1] < n_chunks - 1}
    in_flight = []
    g_slots = 0
    for s in range(p):
        for spans, field, recv in ((x_span, X_SLOT, RECV_X), (g_span, G_SLOT, RECV_G)):
            mine = sorted((a, b, k) for k, (a, b) in spans.items() if k[1] % p == s)
            slot_of, free, used, peak = {}, [], {}, 0
            for a, b, k in mine:  # interval colouring by start tick
                for slot, end in list(used.items()):
                    if end <= a:
                        del used[slot]
                        free.append(slot)
                slot = min(free) if free else len(used) + len(free)
                if slot in free:
                    free.remove(slot)
                used[slot] = b
                slot_of[k] = slot
                peak = max(peak, len(used))
            for t in range(n_ticks):
                kind, mb, j = table[t, s, :3]
                if kind != IDLE and (mb, j * p + s) in slot_of:
                    table[t, s, field] = slot_of[mb, j * p + s]
            for k, slot in slot_of.items():
                a = spans[k][0]
                arrives = (field == X_SLOT and k[1] > 0) or field == G_SLOT
                if arrives:
                    table[a, s, recv] = slot
            if field == X_SLOT:
                in_flight.append(peak)
            else:
                g_slots = max(g_slots, peak)
    return Table(schedule, p, m, v, table, tuple(in_flight), max(g_slots, 1))

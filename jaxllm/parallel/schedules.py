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
(MaxText's circular pipeline). DualPipeV (DeepSeek's DualPipe "cut in half", Sea AI Lab) places
its 2p chunks as a V instead: device d holds chunk d (local chunk 0) and chunk 2p - 1 - d (local
chunk 1), so a microbatch goes down the devices and back up, and the loss is computed on device
0. Its order is DeepSeek's eight steps (warm-up forwards, then forward / backward pairs of the
two local chunks, with the backward split into B and W in the warm-up and the cool-down); an
activation or gradient then moves to the next device, the previous one, or stays (device p - 1
between its two chunks), and the table names the slot of each of these arrivals. DualPipe
(DeepSeek-V3) runs the same steps on each half of the devices, as two pipelines in opposite
directions: microbatches 0 .. m/2 - 1 go down stages 0 .. p-1 on devices 0 .. p-1 (local chunk
0), the others down the same stages on devices p-1 .. 0 (local chunk 1: stage p - 1 - d), so
every device holds two stages' parameters.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "dualpipev", "dualpipe")
IDLE, F, B, W, BW = 0, 1, 2, 3, 4  # BW: input and weight gradients in one pass
# fields of one table entry. Arrivals: RECV_X from stage - 1 and RECV_G from stage + 1 (every
# schedule); with the V placement also RECV_X_UP from stage + 1, RECV_G_DOWN from stage - 1,
# and KEEP_X / KEEP_G for what the stage sent itself (device p - 1, between its two chunks)
ACTION, MB, CHUNK, X_SLOT, G_SLOT, RECV_X, RECV_G, RECV_X_UP, RECV_G_DOWN, KEEP_X, KEEP_G = range(
    11
)
FIELDS = 11


def two_way(schedule: str) -> bool:
    """Whether `schedule` sends activations and gradients both ways: DualPipeV (its chunks
    placed as a V) and DualPipe (two pipelines in opposite directions)."""
    return schedule in ("dualpipev", "dualpipe")


def chunk_of(schedule: str, p: int, s: int, j: int) -> int:
    """The virtual stage that device `s` runs as its local chunk `j` (DualPipe: j is the
    direction, stage s going down, p - 1 - s up)."""
    if schedule == "dualpipev":
        return s if j == 0 else 2 * p - 1 - s
    if schedule == "dualpipe":
        return s if j == 0 else p - 1 - s
    return j * p + s


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
    def chunks(self) -> int:
        """Virtual stages every microbatch passes: p v, DualPipe p (its two chunks per device
        are one stage's parameters twice)."""
        return self.stages if self.schedule == "dualpipe" else self.stages * self.virtual

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
    (p-1)/(v m) interleaved; ZB-H1's is (p-1)/(3m) with F, B and W of equal cost. DualPipeV's
    (DeepSeek-V3's table) is (PP/2 - 1)(F&B + B - 3W) over its PP = 2p stages: 0 when F, B and
    W cost the same and an overlapped F&B costs F + B; DualPipe's, over PP = p stages, too."""
    return {
        "gpipe": (p - 1) / m,
        "1f1b": (p - 1) / m,
        "interleaved": (p - 1) / (v * m),
        "zero_bubble": (p - 1) / (3 * m),
        "dualpipev": 0.0,
        "dualpipe": 0.0,
    }[schedule]


def _dualpipev_order(p: int, m: int, r: int) -> list[tuple[int, int, int]]:
    """Device r's order under DualPipeV (DeepSeek's `dualpipev.py`, steps 1-8), with local chunk
    0 the way down and 1 the way up; a split backward (B) queues its W, run in queue order."""
    order: list[tuple[int, int, int]] = []
    count = {(F, 0): 0, (F, 1): 0, (B, 0): 0, (B, 1): 0}
    queue: list[tuple[int, int, int]] = []

    def fwd(j):
        order.append((F, count[F, j], j))
        count[F, j] += 1

    def bwd(j, split=False):
        mb = count[B, j]
        count[B, j] += 1
        order.append((B if split else BW, mb, j))
        if split:
            queue.append((W, mb, j))

    def weights():
        order.append(queue.pop(0))

    for _ in range(2 * (p - r - 1)):  # 1: forwards down
        fwd(0)
    for _ in range(r + 1):  # 2: down and up
        fwd(0), fwd(1)
    for _ in range(p - r - 1):  # 3: the first backwards, split, their W at once
        bwd(1, split=True), weights(), fwd(1)
    for _ in range(m - 2 * p + r + 1):  # 4: the steady state, F0 B1 F1 B0
        fwd(0), bwd(1), fwd(1), bwd(0)
    for _ in range(p - r - 1):  # 5
        bwd(1), fwd(1), bwd(0)
    for i in range(r + 1):  # 6: the second half of these backwards split
        bwd(1, split=i > (r + 1) // 2 or (i == (r + 1) // 2 and r % 2 == 1))
        bwd(0, split=i >= (r + 1) // 2)
    for _ in range(p - r - 1):  # 7
        weights(), bwd(0, split=True)
    while queue:  # 8
        weights()
    return order


def _orders(schedule: str, p: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    """Per stage, the ordered (action, microbatch, local chunk) it runs (ZB: without its W)."""
    if schedule == "dualpipev":
        return [_dualpipev_order(p, m, r) for r in range(p)]
    if schedule == "dualpipe":  # the same steps over half the devices and microbatches; on the
        # lower half phase 0 is the down direction (j = 0, microbatches 0 .. m/2 - 1), on the
        # upper half the up direction (j = 1, microbatches m/2 .. m - 1)
        orders = []
        for r in range(p):
            flip = int(r >= p // 2)
            half = _dualpipev_order(p // 2, m // 2, min(r, p - 1 - r))
            orders.append([(kind, mb + (m // 2) * (j ^ flip), j ^ flip) for kind, mb, j in half])
        return orders
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
    """The table of `schedule` for p stages, m microbatches and v virtual stages per device
    (DualPipeV: v = 1, its table has 2)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {SCHEDULES}")
    if two_way(schedule):
        dual = schedule == "dualpipe"
        if v != 1 or m < 2 * p or (dual and (p % 2 or m % 2)):
            need = "even p and m, " if dual else ""
            raise ValueError(f"{schedule} needs {need}v = 1 and m >= 2p, not p={p} m={m} v={v}")
        v = 2
    orders = _orders(schedule, p, m, v)
    n_chunks = p if schedule == "dualpipe" else p * v
    done: dict[tuple[int, int, int], int] = {}  # (action kind, mb, virtual stage) -> tick
    pos = [0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    rows: list[list[tuple[int, int, int]]] = []
    total = sum(len(o) for o in orders) + (m * v * p if schedule == "zero_bubble" else 0)

    def ready(kind: int, mb: int, c: int, t: int) -> bool:
        if kind == W:  # its B ran before it on this device
            return True
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
            can = nxt is not None and ready(nxt[0], nxt[1], chunk_of(schedule, p, s, nxt[2]), t)
            # ZB-H1 defers no W past the stage's next action, so it holds no more inputs
            # than 1F1B; a W runs where the next F / B has to wait, or right after it
            if pending_w[s]:
                mb, j = pending_w[s].pop(0)
                act = (W, mb, j)
            elif can:
                act = nxt
                pos[s] += 1
                if act[0] == B and schedule == "zero_bubble":
                    pending_w[s].append((act[1], act[2]))
            row.append(act)
        for s, (kind, mb, j) in enumerate(row):
            if kind != IDLE:  # a BW is a B for the stage before it
                done[(B if kind == BW else kind, mb, chunk_of(schedule, p, s, j))] = t
                executed += 1
        rows.append(row)
        t += 1
        if t > 10 * total + 10:
            raise RuntimeError(f"schedule {schedule} p={p} m={m} v={v} does not finish")
    return _with_slots(schedule, p, m, v, rows)


def _arrival_field(schedule: str, p: int, s: int, src: int, field: int) -> int:
    """The table field naming the slot of an arrival on stage `s` from stage `src`."""
    if src == s:
        return KEEP_X if field == X_SLOT else KEEP_G
    if two_way(schedule) and field == X_SLOT and src == s + 1:
        return RECV_X_UP
    if two_way(schedule) and field == G_SLOT and src == s - 1:
        return RECV_G_DOWN
    return RECV_X if field == X_SLOT else RECV_G


def _with_slots(schedule, p, m, v, rows) -> Table:
    """Adds input / gradient slots and arrivals to the placed actions."""
    n_chunks = p if schedule == "dualpipe" else p * v
    n_ticks = len(rows)
    table = np.full((n_ticks, p, FIELDS), -1, np.int32)
    # (mb, virtual stage) -> tick of its F, its B (BW) and the tick its inputs may be freed,
    # and the device that runs it
    f_tick, b_tick, free_x, where = {}, {}, {}, {}
    for t, row in enumerate(rows):
        for s, (kind, mb, j) in enumerate(row):
            table[t, s, :3] = (kind, mb, j)
            c = chunk_of(schedule, p, s, j) if kind != IDLE else -1
            if kind == F:
                f_tick[mb, c] = t
                where[mb, c] = s
            if kind in (B, BW):
                b_tick[mb, c] = t
            if kind in (W, BW):
                free_x[mb, c] = t
    # input of (mb, c): from the arrival (end of tick f_tick[mb, c-1]) or, for chunk 0, from its
    # own forward, to its W / BW. Gradient of (mb, c) for c < last: from the arrival (end of
    # b_tick[mb, c+1]) to its W / BW (a split backward's W needs it again)
    x_span = {k: (f_tick[k[0], k[1] - 1] if k[1] else f_tick[k], free_x[k]) for k in f_tick}
    g_span = {k: (b_tick[k[0], k[1] + 1], free_x[k]) for k in f_tick if k[1] < n_chunks - 1}
    in_flight = []
    g_slots = 0
    for s in range(p):
        for spans, field in ((x_span, X_SLOT), (g_span, G_SLOT)):
            mine = sorted((a, b, k) for k, (a, b) in spans.items() if where[k] == s)
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
                c = chunk_of(schedule, p, s, int(j))
                if kind != IDLE and (mb, c) in slot_of:
                    table[t, s, field] = slot_of[mb, c]
            for k, slot in slot_of.items():
                if field == X_SLOT and k[1] == 0:
                    continue  # the first chunk embeds its own input
                src = where[k[0], k[1] - 1 if field == X_SLOT else k[1] + 1]
                table[spans[k][0], s, _arrival_field(schedule, p, s, src, field)] = slot
            if field == X_SLOT:
                in_flight.append(peak)
            else:
                g_slots = max(g_slots, peak)
    return Table(schedule, p, m, v, table, tuple(in_flight), max(g_slots, 1))

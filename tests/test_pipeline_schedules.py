"""Pipeline schedule tables (`jaxllm.parallel.schedules`): every table runs each microbatch's
forward and backward once per virtual stage, in dependency order, and its bubble and peak
in-flight microbatches match the textbook formulas."""

import numpy as np
import pytest

from jaxllm.parallel import schedules as S

CASES = [
    ("gpipe", 2, 4, 1),
    ("gpipe", 4, 8, 1),
    ("1f1b", 2, 4, 1),
    ("1f1b", 4, 8, 1),
    ("1f1b", 4, 16, 1),
    ("interleaved", 2, 4, 2),
    ("interleaved", 4, 8, 2),
    ("interleaved", 2, 8, 4),
    ("zero_bubble", 2, 4, 1),
    ("zero_bubble", 4, 8, 1),
    ("zero_bubble", 4, 16, 1),
]


def _events(table):
    """{(action, mb, virtual stage): tick}, asserting each happens once."""
    out = {}
    p = table.stages
    for t in range(table.ticks):
        for s in range(p):
            kind, mb, j = table.actions[t, s, : S.X_SLOT]
            if kind == S.IDLE:
                continue
            key = (int(kind), int(mb), S.chunk_of(table.schedule, p, s, int(j)))
            assert key not in out, key
            out[key] = t
    return out


def check_dependencies(table):
    """Every action once per microbatch and virtual stage, after what it needs: the previous
    stage's forward, the next stage's backward (B or BW), a W after its own B."""
    ev = _events(table)
    m, n = table.microbatches, table.chunks
    last = n - 1
    back = {(mb, c): t for (kind, mb, c), t in ev.items() if kind in (S.B, S.BW)}
    for mb in range(m):
        for c in range(n):
            f, b = ev[S.F, mb, c], back[mb, c]
            assert (S.B, mb, c) not in ev or (S.BW, mb, c) not in ev
            if c:
                assert ev[S.F, mb, c - 1] < f
            assert f < b
            if c < last:
                assert back[mb, c + 1] < b
            if (S.B, mb, c) in ev:
                assert b < ev[S.W, mb, c]
    n_w = sum(kind == S.W for kind, _, _ in ev)
    assert n_w == sum(kind == S.B for kind, _, _ in ev)
    assert len(ev) == 2 * m * n + n_w


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_every_action_once_and_after_what_it_needs(case):
    schedule, p, m, v = case
    table = S.build(schedule, p, m, v)
    check_dependencies(table)
    assert all(kind != S.BW for kind, _, _ in _events(table)) == (schedule == "zero_bubble")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_bubble_and_in_flight_match_the_formulas(case):
    schedule, p, m, v = case
    table = S.build(schedule, p, m, v)
    if schedule == "zero_bubble":
        # F, B and W one tick each: 2 (p - 1) idle ticks per stage of 3 m busy ones, 2/3 of
        # 1F1B's bubble in the same units (its BW counted as the two ticks it costs); the
        # textbook (p - 1) / (3 m) fills the tail with W passes that ZB-H1's memory bound (no
        # more inputs held than 1F1B) leaves no room for in a lock-step table
        assert table.bubble_ratio == pytest.approx(2 * (p - 1) / (3 * m))
        assert table.bubble_ratio > S.formula(schedule, p, m, v)
        assert table.in_flight == S.build("1f1b", p, m).in_flight
    else:
        assert table.bubble_ratio == pytest.approx(S.formula(schedule, p, m, v))
        assert table.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    if schedule == "gpipe":
        assert table.in_flight == (m,) * p
    if schedule == "1f1b":  # later stages also hold the input that arrived for their next F
        assert table.in_flight == (p, *(p - s + 1 for s in range(1, p)))
        assert table.x_slots == p


def check_slots(table):
    """Replaying the table's slot writes and reads: every backward finds its own forward's input
    and its own output gradient in the slots the table names, whichever way they arrived."""
    p, last = table.stages, table.chunks - 1
    where = {}  # (mb, virtual stage) -> the device that runs it
    for t in range(table.ticks):
        for s in range(p):
            kind, mb, j = table.actions[t, s, : S.X_SLOT]
            if kind == S.F:
                where[mb, S.chunk_of(table.schedule, p, s, int(j))] = s
    xs = np.full((p, table.x_slots), -1)
    gs = np.full((p, table.grad_slots, 2), -1)
    for t in range(table.ticks):
        sent_f, sent_b = [None] * p, [None] * p
        for s in range(p):
            kind, mb, j, xslot, gslot = table.actions[t, s, : S.RECV_X]
            c = S.chunk_of(table.schedule, p, s, int(j))
            if kind == S.F:
                if c == 0:
                    xs[s, xslot] = mb
                assert xs[s, xslot] == mb
                if c < last:
                    sent_f[s] = (mb, c + 1, where[mb, c + 1])
            if kind in (S.B, S.W, S.BW):
                assert xs[s, xslot] == mb, (table.schedule, t, s)
                if c < last:
                    assert tuple(gs[s, gslot]) == (mb, c + 1)
            if kind in (S.B, S.BW) and c > 0:
                sent_b[s] = (mb, c, where[mb, c - 1])
        arrivals = (  # (field, buffer, sender, what was sent)
            (S.RECV_X, xs, lambda s: (s - 1) % p, sent_f),
            (S.RECV_G, gs, lambda s: (s + 1) % p, sent_b),
            (S.RECV_X_UP, xs, lambda s: (s + 1) % p, sent_f),
            (S.RECV_G_DOWN, gs, lambda s: (s - 1) % p, sent_b),
            (S.KEEP_X, xs, lambda s: s, sent_f),
            (S.KEEP_G, gs, lambda s: s, sent_b),
        )
        got = {}
        for field, buf, sender, sent in arrivals:
            for s in range(p):
                slot = table.actions[t, s, field]
                if slot < 0:
                    continue
                mb, c, to = sent[sender(s)]
                assert to == s, (table.schedule, t, s, field)
                got[s, field] = True
                buf[s, slot] = mb if buf is xs else (mb, c)
        # everything sent arrives somewhere
        assert sum(x is not None for x in sent_f + sent_b) == len(got), (table.schedule, t)


def test_slots_hold_each_input_until_its_last_use():
    for schedule, p, m, v in CASES:
        check_slots(S.build(schedule, p, m, v))

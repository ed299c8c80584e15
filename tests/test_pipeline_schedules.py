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
            key = (int(kind), int(mb), int(j) * p + s)
            assert key not in out, key
            out[key] = t
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_every_action_once_and_after_what_it_needs(case):
    schedule, p, m, v = case
    table = S.build(schedule, p, m, v)
    ev = _events(table)
    last = p * v - 1
    back = S.B if schedule == "zero_bubble" else S.BW
    for mb in range(m):
        for c in range(p * v):
            f, b = ev[S.F, mb, c], ev[back, mb, c]
            if c:
                assert ev[S.F, mb, c - 1] < f
            assert f < b
            if c < last:
                assert ev[back, mb, c + 1] < b
            if schedule == "zero_bubble":
                assert b < ev[S.W, mb, c]
    per_stage = 2 * m * v + (m * v if schedule == "zero_bubble" else 0)
    assert len(ev) == p * per_stage


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


def test_slots_hold_each_input_until_its_last_use():
    """Replaying the table's slot writes and reads: every backward finds its own forward's input
    and its own output gradient in the slots the table names."""
    for schedule, p, m, v in CASES:
        table = S.build(schedule, p, m, v)
        xs = np.full((p, table.x_slots), -1)
        gs = np.full((p, table.grad_slots, 2), -1)
        for t in range(table.ticks):
            sent_f, sent_b = [None] * p, [None] * p
            for s in range(p):
                kind, mb, j, xslot, gslot, _, _ = table.actions[t, s]
                c = j * p + s
                if kind == S.F:
                    if c == 0:
                        xs[s, xslot] = mb
                    assert xs[s, xslot] == mb * (c > 0) + mb * (c == 0)
                    sent_f[(s + 1) % p] = mb
                if kind in (S.B, S.W, S.BW):
                    assert xs[s, xslot] == mb, (schedule, t, s)
                    if c < p * v - 1:
                        assert tuple(gs[s, gslot]) == (mb, c + 1)
                if kind in (S.B, S.BW):
                    sent_b[(s - 1) % p] = (mb, c)
            for s in range(p):
                rx, rg = table.actions[t, s, S.RECV_X], table.actions[t, s, S.RECV_G]
                if rx >= 0:
                    xs[s, rx] = sent_f[s]
                if rg >= 0:
                    gs[s, rg] = sent_b[s]

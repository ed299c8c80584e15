"""`pair_sums`: per-pair sums of a per-token quantity over the chosen / rejected segments."""

import numpy as np

from jaxllm.objectives.base import pair_sums


def test_pair_sums_read_each_pair_and_mark_incomplete_ones():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 10)).astype(np.float32)
    # row 0: pair 0 = segments 1 (3 slots) and 2 (2 slots), pair 1 = 3 and 4, then padding;
    # row 1: one pair, then a chosen sequence with no rejected one (never written by the
    # packer, but must not count as a pair)
    seg = np.array([[1, 1, 1, 2, 2, 3, 4, 4, 0, 0], [1, 2, 2, 2, 3, 3, 0, 0, 0, 0]], np.int32)
    chosen, rejected, valid = map(np.asarray, pair_sums(x, seg))
    assert chosen.shape == rejected.shape == valid.shape == (2, 5)
    for b in range(2):
        for k in range(5):
            np.testing.assert_allclose(chosen[b, k], x[b][seg[b] == 2 * k + 1].sum(), rtol=1e-6)
            np.testing.assert_allclose(rejected[b, k], x[b][seg[b] == 2 * k + 2].sum(), rtol=1e-6)
    np.testing.assert_array_equal(valid[0], [True, True, False, False, False])
    np.testing.assert_array_equal(valid[1], [True, False, False, False, False])
    assert chosen[1, 1] != 0 and rejected[1, 1] == 0

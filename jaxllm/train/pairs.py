"""Preference pairs in packed rows: the layout every pairwise objective reads.

Pair k of a row occupies two consecutive segments: its chosen sequence is segment 2k + 1, its
rejected sequence segment 2k + 2 (segment id 0 is padding). A pair never spans two rows, so a
row of L positions holds at most P = L // 2 pairs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pair_sums(x_BxL: jax.Array, segment_ids_BxL: jax.Array):
    """(chosen_BxP, rejected_BxP, valid_BxP): the sums of `x` over each pair's chosen and
    rejected segments, and whether both are present in the row; P = L // 2. Padding (segment
    0) is dropped by the segment sum (ids outside [0, 2P) add nowhere)."""
    num_pairs = x_BxL.shape[1] // 2
    ids_BxL = segment_ids_BxL - 1

    def per_row(x_L, ids_L):
        return jax.ops.segment_sum(x_L, ids_L, num_segments=2 * num_pairs)

    sums_Bx2P = jax.vmap(per_row)(x_BxL, ids_BxL)
    present_Bx2P = jax.vmap(per_row)(jnp.ones_like(x_BxL), ids_BxL) > 0
    valid_BxP = present_Bx2P[:, 0::2] & present_Bx2P[:, 1::2]
    return sums_Bx2P[:, 0::2], sums_Bx2P[:, 1::2], valid_BxP

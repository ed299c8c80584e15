"""Preference pairs in packed rows: per-pair sums of a per-token quantity.

A preference row (`jaxllm.data.preference`) holds whole pairs: pair k of the row is two
consecutive segments, its chosen sequence segment 2k + 1 and its rejected sequence segment
2k + 2 (segment id 0 is padding). Every sequence takes at least one slot, so at most
P = L // 2 pairs fit a row of L slots, and the pair axis has that fixed size whatever the row
holds. The losses of the DPO family and of reward models are functions of per-sequence sums
(log-probabilities, token counts, a score at one position), which `pair_sums` reads off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pair_sums(x_BxL: jax.Array, segment_ids_BxL: jax.Array):
    """(chosen_BxP, rejected_BxP, valid_BxP): the sums of `x` over each pair's chosen segment
    (2k + 1) and rejected segment (2k + 2), and whether both segments are present in the row
    (True where the pair exists), with P = L // 2. Sums are in float32; a missing segment sums
    to 0. Segment ids above 2P (never written by the packer) are left out."""
    num_pairs = segment_ids_BxL.shape[-1] // 2
    num_segments = 2 * num_pairs + 1  # 0 (padding), then 1 .. 2P

    def per_row(x_L, seg_L):
        sums_S = jax.ops.segment_sum(x_L, seg_L, num_segments=num_segments)
        present_S = jax.ops.segment_sum(jnp.ones_like(seg_L), seg_L, num_segments=num_segments)
        return sums_S, present_S > 0

    sums_BxS, present_BxS = jax.vmap(per_row)(x_BxL.astype(jnp.float32), segment_ids_BxL)
    chosen_BxP, rejected_BxP = sums_BxS[:, 1::2], sums_BxS[:, 2::2]
    valid_BxP = present_BxS[:, 1::2] & present_BxS[:, 2::2]
    return chosen_BxP, rejected_BxP, valid_BxP

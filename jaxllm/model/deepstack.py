"""DeepStack (Meng et al. 2024, arXiv:2406.04334), as Qwen3-VL uses it: features of S
vision-tower blocks are added to the image tokens' hidden states after the first S decoder
blocks, one each (`Transformer(..., deepstack=(features [S, M, D], index [B, L], mask [B, L]))`).
Image rows of training give the features per row, [S, B, M, D], with each token's unit in its
row's features as the index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def carry(deepstack) -> tuple:
    """The entries of the layer scans' carry for `deepstack` (none without): its arrays and
    the index of the next block."""
    return () if deepstack is None else ((*deepstack, jnp.zeros((), jnp.int32)),)


def add(x_BxLxD, deep: list) -> tuple[jax.Array, list]:
    """(x after a block plus that block's features where the mask is on, the carry entries for
    the next block): x[b, l] += feats[block, index[b, l]], none from block S on."""
    if not deep:
        return x_BxLxD, deep
    feats_SxMxD, index_BxL, mask_BxL, block = deep[0]
    s = feats_SxMxD.shape[0]
    feats = jnp.take(feats_SxMxD, jnp.minimum(block, s - 1), axis=0)
    if feats.ndim == 3:  # per row: [B, M, D]
        add_BxLxD = jnp.take_along_axis(feats, index_BxL[..., None], axis=1)
    else:
        add_BxLxD = jnp.take(feats, index_BxL, axis=0)
    add_BxLxD = add_BxLxD.astype(x_BxLxD.dtype)
    on_BxL = mask_BxL & (block < s)
    x_BxLxD = jnp.where(on_BxL[..., None], x_BxLxD + add_BxLxD, x_BxLxD)
    return x_BxLxD, [(feats_SxMxD, index_BxL, mask_BxL, block + 1)]

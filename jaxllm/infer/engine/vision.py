"""Images in the engine (a vision-language model, `model.vision`).

A request brings its images' pixels (`jaxllm.data.images.Pixels`) with a prompt whose image
pad tokens are expanded (`jaxllm.infer.vision.prompt_example`). `prepare` runs the tower once
per request (its own jitted program, one compile per set of patch grids) and keeps on the host
what the steps need: the merged features (and DeepStack's), which feature each prompt token
takes, the prompt's M-RoPE ids and its rope delta. `chunk_inputs` lays out one step: every
slot's [3, Q] positions (prompt tokens their M-RoPE ids, every later token index + delta, as
`jaxllm.infer.generate` decodes) and, when some chunk holds image tokens, their features, which
replace those tokens' embeddings (`runner.step`). A preempted sequence is recomputed from the
same features.

Prefix pages: the image tokens are all one pad id, so the page holding each image's first token
is keyed with the image's digest (its pixels and grid) as well (`pages.block_hash`'s `salt`);
the chain carries it to every later page. Requests with the same text and different images
share only the pages before the first image token; with the same images, all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import numpy as np
from flax import nnx

from jaxllm import sharding
from jaxllm.model.mrope import mrope_positions


@dataclasses.dataclass(frozen=True, eq=False)
class RequestImages:
    """What the steps of one request with images need (host arrays)."""

    feats_MxD: np.ndarray
    """The tower's merged features of the request's images, in order."""
    deep_KxMxD: np.ndarray | None
    """DeepStack's features (None without)."""
    index_L: np.ndarray
    """Per prompt token: the feature row it takes (-1: a text token)."""
    positions_3xL: np.ndarray
    """The prompt's M-RoPE ids."""
    delta: int
    """Token i past the prompt runs at position i + delta."""
    salts: dict[int, int]
    """Page index -> digest of the image whose first token it holds (prefix keys)."""


@functools.partial(jax.jit, static_argnames=("graphdef", "grids", "parallel"))
def _tower(graphdef, state, pixels_PxI, grids, parallel):
    with sharding.active(parallel):
        return nnx.merge(graphdef, state).visual.features(pixels_PxI, grids)


def digest(pixels, grid) -> int:
    """A 63-bit digest of one image's patches and grid."""
    h = hashlib.sha256(np.ascontiguousarray(pixels, np.float32).tobytes())
    h.update(np.asarray(grid, np.int64).tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def prepare(graphdef, state, cfg, prompt, images, page_size, parallel) -> RequestImages:
    """The tower's features and the M-RoPE inputs of `prompt` with `images` (a `Pixels`).
    ValueError when the model has no tower or the prompt's image tokens and the images'
    merged patches disagree."""
    v = cfg.vision
    if v is None:
        raise ValueError("images need a vision-language model (model.vision); this one has none")
    grids = tuple(
        tuple(int(x) for x in g) for g in np.asarray(images.image_grid_thw).reshape(-1, 3)
    )
    pixels_PxI = np.asarray(images.pixel_values_NxP, np.float32)
    ids_L = np.asarray(prompt)
    is_image = ids_L == v.image_token_id
    unit = v.spatial_merge**2
    counts = [t * h * w // unit for t, h, w in grids]
    if int(is_image.sum()) != sum(counts):
        raise ValueError(
            f"the prompt holds {int(is_image.sum())} image tokens for {len(grids)} image(s) of "
            f"{sum(counts)} merged patches; expand each image's pad token to its patches"
        )
    positions, deltas = mrope_positions(
        ids_L[None], grids, v.image_token_id, v.vision_start_token_id, v.spatial_merge
    )
    feats, deep = _tower(graphdef, state, pixels_PxI, grids, parallel)
    index_L = np.where(is_image, np.cumsum(is_image) - 1, -1).astype(np.int32)
    salts: dict[int, int] = {}
    firsts = np.flatnonzero(is_image & ~np.concatenate([[False], is_image[:-1]]))
    patches = np.cumsum([0] + [t * h * w for t, h, w in grids])
    for j, (at, grid) in enumerate(zip(firsts, grids)):
        d = digest(pixels_PxI[patches[j] : patches[j + 1]], grid)
        block = int(at) // page_size
        salts[block] = d if block not in salts else hash((salts[block], d))
    return RequestImages(
        np.asarray(feats, np.float32),
        None if deep is None else np.asarray(deep, np.float32),
        index_L,
        positions[:, 0].astype(np.int32),
        int(deltas[0, 0]),
        salts,
    )


def chunk_inputs(batch, slots: int, q: int):
    """(positions int32 [S, 3, Q], the image features of the step or None) of `batch`
    ((slot, first token index, tokens fed, prompt length, RequestImages or None) per running
    sequence). The features: (features [S, Q, D], DeepStack's [S, K, Q, D] or None, image mask
    [S, Q]); None when no chunk holds an image token."""
    positions = np.broadcast_to(np.arange(q, dtype=np.int32), (slots, 3, q)).copy()
    rows = []
    for slot, start, take, prompt_len, im in batch:
        i_Q = start + np.arange(q)
        delta = 0 if im is None else im.delta
        pos = np.broadcast_to(i_Q + delta, (3, q)).copy()
        if im is not None:
            inside = i_Q < prompt_len
            pos[:, inside] = im.positions_3xL[:, i_Q[inside]]
            index = np.full(q, -1, np.int32)
            at = np.minimum(i_Q[:take], prompt_len - 1)
            index[:take] = np.where(inside[:take], im.index_L[at], -1)
            if (index >= 0).any():
                rows.append((slot, index, im))
        positions[slot] = pos
    if not rows:
        return positions, None
    d = rows[0][2].feats_MxD.shape[1]
    feats = np.zeros((slots, q, d), np.float32)
    mask = np.zeros((slots, q), bool)
    deep_rows = rows[0][2].deep_KxMxD
    deep = None if deep_rows is None else np.zeros((slots, deep_rows.shape[0], q, d), np.float32)
    for slot, index, im in rows:
        on = index >= 0
        mask[slot] = on
        feats[slot, on] = im.feats_MxD[index[on]]
        if deep is not None:
            deep[slot][:, on] = im.deep_KxMxD[:, index[on]]
    return positions, (feats, deep, mask)

"""The cache-free reference of generation: every step re-runs the full forward pass over a fixed
buffer, exactly what training computes; cached decoding (`jaxllm.infer.generate`) is tested
against it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.infer.vision import vision_inputs


@functools.partial(jax.jit, static_argnames=("graphdef", "num_new", "grids"))
def _greedy(graphdef, state, buf_BxT, start_B, num_new: int, vision=None, grids=None):
    model = nnx.merge(graphdef, state)
    images = {}
    if vision is not None:  # pixels and the buffer's [3, B, T] positions
        images = dict(pixel_values=vision[0], image_grid_thw=grids, positions_BxL=vision[1])

    def body(i, buf_BxT):
        logits_BxTxV = model(buf_BxT, **images).logits
        cur_B = start_B + i
        last_BxV = jnp.take_along_axis(logits_BxTxV, (cur_B - 1)[:, None, None], 1)[:, 0]
        next_B = jnp.argmax(last_BxV, -1).astype(buf_BxT.dtype)
        return jax.vmap(lambda row, pos, tok: row.at[pos].set(tok))(buf_BxT, cur_B, next_B)

    return jax.lax.fori_loop(0, num_new, body, buf_BxT)


def greedy_continue(
    model, prompt_ids, num_new: int, max_len: int | None = None, pixels=None
) -> np.ndarray:
    """Appends `num_new` argmax tokens to one prompt; returns only the new token ids.

    `model` maps tokens [B, T] -> logits [B, T, V]. The buffer is len(prompt) + num_new long
    (at most `max_len`; the prompt is left-truncated to fit). `pixels`
    (`jaxllm.data.images.Pixels`, a vision-language model): the prompt's images, whose expanded
    pad tokens it holds; the tower runs at every step, and the new tokens' positions continue
    from the prompt's M-RoPE ids (position + rope delta).
    """
    prompt = np.asarray(prompt_ids, np.int32)
    if max_len is not None:
        prompt = prompt[-(max_len - num_new) :]
    t = len(prompt) + num_new
    buf = np.zeros((1, t), np.int32)
    buf[0, : len(prompt)] = prompt
    vision, grids = vision_inputs(model.cfg, buf, np.array([len(prompt)]), [pixels])
    if vision is not None:
        px, positions_3x1xT, delta_1 = vision
        positions_3x1xT[:, 0, len(prompt) :] = np.arange(len(prompt), t) + delta_1[0]
        vision = (jnp.asarray(px), jnp.asarray(positions_3x1xT))
    graphdef, state = nnx.split(model)
    out = _greedy(
        graphdef,
        state,
        jnp.asarray(buf),
        jnp.asarray([len(prompt)], jnp.int32),
        num_new,
        vision,
        grids,
    )
    return np.asarray(out[0, len(prompt) :])

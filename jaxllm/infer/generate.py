"""Greedy decoding without a KV cache: each new token re-reads the whole (fixed-size) buffer.

Simple and exactly what the model computes in training, which makes it the reference that
cached decoding is checked against. The whole loop is one jitted `fori_loop`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@functools.partial(jax.jit, static_argnames=("graphdef", "num_new"))
def _greedy(graphdef, state, buf_BxT, start_B, num_new: int):
    model = nnx.merge(graphdef, state)

    def body(i, buf_BxT):
        logits_BxTxV = model(buf_BxT)
        cur_B = start_B + i
        last_BxV = jnp.take_along_axis(logits_BxTxV, (cur_B - 1)[:, None, None], 1)[:, 0]
        next_B = jnp.argmax(last_BxV, -1).astype(buf_BxT.dtype)
        return jax.vmap(lambda row, pos, tok: row.at[pos].set(tok))(buf_BxT, cur_B, next_B)

    return jax.lax.fori_loop(0, num_new, body, buf_BxT)


def greedy_continue(model, prompt_ids, num_new: int, max_len: int | None = None) -> np.ndarray:
    """Appends `num_new` argmax tokens to one prompt; returns only the new token ids.

    `model` maps tokens [B, T] -> logits [B, T, V]. The buffer is len(prompt) + num_new long
    (at most `max_len`; the prompt is left-truncated to fit).
    """
    prompt = np.asarray(prompt_ids, np.int32)
    if max_len is not None:
        prompt = prompt[-(max_len - num_new) :]
    t = len(prompt) + num_new
    buf = np.zeros((1, t), np.int32)
    buf[0, : len(prompt)] = prompt
    graphdef, state = nnx.split(model)
    out = _greedy(graphdef, state, jnp.asarray(buf), jnp.asarray([len(prompt)], jnp.int32), num_new)
    return np.asarray(out[0, len(prompt) :])

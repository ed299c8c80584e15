"""Swapping a preempted sequence's KV pages to host memory and back (`Engine(swap="host")`).

When the pool runs dry the scheduler preempts the newest running sequence. By default its
pages are simply given back and its tokens are prefilled again when it resumes (recompute,
vLLM's default). With host swapping, the contents of every page holding its computed tokens
(every layer's codes and scales) are first copied into host numpy arrays; when it resumes, it
takes the pages the prefix cache still holds for its leading full blocks (shared or cached
ones, identical by their hash chain) and fresh pages for the rest, into which the host copy is
written back, so no token is computed twice. Shared pages are copied too: released, they may
be evicted before the sequence comes back.

Gathers and scatters are padded to a power-of-two page count (the pad reads and writes the
scratch page 0), so there is one compile per bucket, not one per sequence length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.decode_attention.quant import KVCache

PAGED = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")
"""The cache arrays indexed by page ([layers, pages, ...])."""


def _bucket(pages: list[int]) -> np.ndarray:
    n = 1 << max(len(pages) - 1, 0).bit_length()
    idx = np.zeros(n, np.int32)
    idx[: len(pages)] = pages
    return idx


@jax.jit
def _gather(kv: KVCache, idx_P):
    return {n: getattr(kv, n)[:, idx_P] for n in PAGED if getattr(kv, n) is not None}


@functools.partial(jax.jit, donate_argnames=("kv",))
def _scatter(kv: KVCache, idx_P, vals):
    return dataclasses.replace(
        kv, **{n: getattr(kv, n).at[:, idx_P].set(v) for n, v in vals.items()}
    )


def save(kv: KVCache, pages: list[int]) -> dict[str, np.ndarray]:
    """Host copies of `pages` (every layer), {array name: [layers, len(pages), ...]}."""
    host = jax.device_get(_gather(kv, jnp.asarray(_bucket(pages))))
    return {n: np.asarray(v[:, : len(pages)]) for n, v in host.items()}


def restore(kv: KVCache, pages: list[int], saved: dict[str, np.ndarray]) -> KVCache:
    """`kv` with `saved` ([layers, len(pages), ...] per array) written into `pages`."""
    idx = _bucket(pages)
    pad = len(idx) - len(pages)
    vals = {}
    for n, v in saved.items():
        vals[n] = np.concatenate([v, np.repeat(v[:, :1], pad, axis=1)], axis=1) if pad else v
    return _scatter(kv, jnp.asarray(idx), vals)

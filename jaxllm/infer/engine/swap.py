"""Swapping a preempted sequence's KV pages to host memory and back (`Engine(swap="host")`).

When the pool runs dry the scheduler preempts the newest running sequence. By default its
pages are simply given back and its tokens are prefilled again when it resumes (recompute,
vLLM's default). With host swapping, the contents of every page holding its computed tokens
(every layer's codes and scales) are first copied into host numpy arrays, with its slot's
residual window of an int4 / int2 cache (the tokens of its incomplete quantization group);
when it resumes, it takes the pages the prefix cache still holds for its leading full blocks
(shared or cached ones, identical by their hash chain) and fresh pages for the rest, into
which the host copy is written back, as is the residual window into its new slot, so no token
is computed twice. Shared pages are copied too: released, they may be evicted before the
sequence comes back. A hybrid model's linear-attention state goes with them (`linear.py`).

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
RESIDUAL = ("k_res", "v_res")
"""The cache arrays indexed by slot ([layers, slots, ...]): the KIVI residual window."""


@dataclasses.dataclass
class Swapped:
    """A sequence's cache in host memory: its pages' arrays [layers, pages, ...] and, for an
    int4 / int2 cache, its residual window [layers, ...]."""

    pages: dict[str, np.ndarray]
    residual: dict[str, np.ndarray]
    linear: object = None
    """A hybrid model's slot slice of the linear-attention state (`linear.save`)."""


def _bucket(pages: list[int]) -> np.ndarray:
    n = 1 << max(len(pages) - 1, 0).bit_length()
    idx = np.zeros(n, np.int32)
    idx[: len(pages)] = pages
    return idx


def _names(kv: KVCache, names) -> list[str]:
    return [n for n in names if getattr(kv, n) is not None]


@jax.jit
def _gather(kv: KVCache, idx_P, slot):
    pages = {n: getattr(kv, n)[:, idx_P] for n in _names(kv, PAGED)}
    return pages, {n: getattr(kv, n)[:, slot] for n in _names(kv, RESIDUAL)}


@functools.partial(jax.jit, donate_argnames=("kv",))
def _scatter(kv: KVCache, idx_P, pages, slot, residual):
    new = {n: getattr(kv, n).at[:, idx_P].set(v) for n, v in pages.items()}
    new |= {n: getattr(kv, n).at[:, slot].set(v) for n, v in residual.items()}
    return dataclasses.replace(kv, **new)


def save(kv: KVCache, pages: list[int], slot: int) -> Swapped:
    """Host copies of `pages` (every layer) and of `slot`'s residual window."""
    held, res = jax.device_get(_gather(kv, jnp.asarray(_bucket(pages)), slot))
    return Swapped({n: np.asarray(v[:, : len(pages)]) for n, v in held.items()}, res)


def restore(kv: KVCache, saved: Swapped, pages: list[int], skip: int, slot: int) -> KVCache:
    """`kv` with the saved pages from the `skip`-th on written into `pages` (one for each),
    and the saved residual window into `slot`."""
    idx = _bucket(pages)
    vals = {}
    for n, v in saved.pages.items():
        v = v[:, skip:]
        pad = np.repeat(v[:, :1], len(idx) - len(pages), axis=1)
        vals[n] = np.concatenate([v, pad], axis=1)
    return _scatter(kv, jnp.asarray(idx), vals, slot, saved.residual)

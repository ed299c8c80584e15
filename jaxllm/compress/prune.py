"""Unstructured and N:M pruning of a trained model's weights (`jaxllm prune`).

Each chosen weight W [*lead, *in, *out] is viewed as [*lead, K, N] (K input channels, N outputs;
an expert stack's experts each on their own) and a fraction of it is set to exactly zero:

- `magnitude`: the smallest |W| of the whole weight (with a pattern: of each M consecutive
  inputs of an output), no data (Han et al. 2015; Wanda's baseline).
- `wanda` (Sun et al. 2023, arXiv:2306.11695): the score |W_kn| * ||X_k||_2, the norm over the
  calibration tokens of input channel k (from the Gram matrix's diagonal), compared per output
  (each output loses the same number of inputs) or per N:M group.
- `sparsegpt` (Frantar & Alistarh 2023, arXiv:2301.00774): OBS-style removal, as the authors'
  `fasterprune`. With U the upper Cholesky factor of (H + damp mean(diag H) I)^-1, H = X^T X:
  the inputs go in blocks of `block_size`; a block's mask takes the smallest w_k^2 / U_kk^2 of
  the block (with a pattern: of each M inputs, chosen when the first of them is reached), and
  input by input the removed weight's error (w_k - q_k) / U_kk is spread over the inputs not
  yet reached through row k of U, so the kept weights take up what the removed ones did.
  An input no token reached is removed outright.

Unstructured, `magnitude` and each `sparsegpt` block remove floor(fraction * size) values, the
smallest first (ties in index order); `wanda` floor(fraction * K) of each output.
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from tqdm import tqdm

from jaxllm import sharding
from jaxllm.compress import weights as weights_lib
from jaxllm.compress.gptq import _inverse_cholesky
from jaxllm.config import Config
from jaxllm.config.prune import PruneConfig


def _smallest(score, count: int, axis=None):
    """A bool mask of the `count` smallest entries of score (over all of it, or along `axis`),
    ties in index order."""
    if axis is None:
        flat = score.reshape(-1)
        rank = jnp.argsort(jnp.argsort(flat, stable=True), stable=True)
        return (rank < count).reshape(score.shape)
    rank = jnp.argsort(jnp.argsort(score, axis=axis, stable=True), axis=axis, stable=True)
    return rank < count


def _nm_mask(score, n: int, m: int):
    """score [K, N]: the n smallest of each m consecutive inputs of every output."""
    k, cols = score.shape
    return _smallest(score.reshape(k // m, m, cols), n, axis=1).reshape(k, cols)


def magnitude(w, cfg: PruneConfig):
    """The removal mask (True: zero) of w [K, N] by |w|."""
    score = jnp.abs(w.astype(jnp.float32))
    if cfg.nm:
        return _nm_mask(score, *cfg.nm)
    return _smallest(score, int(cfg.sparsity * score.size))


def wanda(w, gram, cfg: PruneConfig):
    """The removal mask of w [K, N] by |w| times its input's norm (gram [K, K])."""
    norm = jnp.sqrt(jnp.maximum(jnp.diagonal(gram).astype(jnp.float32), 0.0))
    score = jnp.abs(w.astype(jnp.float32)) * norm[:, None]
    if cfg.nm:
        return _nm_mask(score, *cfg.nm)
    return _smallest(score, int(cfg.sparsity * w.shape[0]), axis=0)


def sparsegpt(w, gram, cfg: PruneConfig):
    """(pruned w [K, N] float32, removal mask) by SparseGPT (module docstring)."""
    k, n = w.shape
    w = w.astype(jnp.float32)
    h = gram.astype(jnp.float32)
    dead = jnp.diagonal(h) == 0
    h = h + jnp.diag(dead.astype(jnp.float32))
    w = jnp.where(dead[:, None], 0.0, w)
    h = h + jnp.eye(k, dtype=jnp.float32) * (cfg.sparsegpt.dampening * jnp.mean(jnp.diagonal(h)))
    u = _inverse_cholesky(h)
    nm = cfg.nm
    out, masks = [], []
    for i1 in range(0, k, cfg.sparsegpt.block_size):  # the last block may be shorter
        i2 = min(i1 + cfg.sparsegpt.block_size, k)
        size = i2 - i1
        w1, u1 = w[i1:i2], u[i1:i2, i1:i2]
        d = jnp.diagonal(u1)
        if nm is None:
            mask1 = _smallest(w1**2 / (d**2)[:, None], int(cfg.sparsity * size * n))
        else:
            mask1 = jnp.zeros((size, n), bool)

        def column(j, c, d=d, u1=u1, size=size):
            w1, mask1, e1 = c
            if nm is not None:  # at each M-th input: the pattern of the next M, as they are now
                pn, pm = nm
                start = (j // pm) * pm
                rows = jax.lax.dynamic_slice_in_dim(w1, start, pm)
                dd = jax.lax.dynamic_slice_in_dim(d, start, pm)
                picked = _smallest(rows**2 / (dd**2)[:, None], pn, axis=0)
                new = jax.lax.dynamic_update_slice_in_dim(mask1, picked, start, 0)
                mask1 = jnp.where(j % pm == 0, new, mask1)
            row = w1[j]
            q = jnp.where(mask1[j], 0.0, row)
            err = (row - q) / u1[j, j]
            w1 = w1 - u1[j][:, None] * err[None, :]
            return w1, mask1, e1.at[j].set(err)

        w1, mask1, e1 = jax.lax.fori_loop(0, size, column, (w1, mask1, jnp.zeros_like(w1)))
        w1 = jnp.where(mask1, 0.0, w1)  # the removed exactly zero
        out.append(w1)
        masks.append(mask1)
        if i2 < k:
            w = w.at[i2:].add(-(u[i1:i2, i2:].T @ e1))
    mask = jnp.concatenate(masks)
    return jnp.where(dead[:, None] | mask, 0.0, jnp.concatenate(out)), mask | dead[:, None]


def prune_weight(w, stats, cfg: PruneConfig, *, n_in: int, n_out: int):
    """`w` [*lead, *in, *out] with cfg's fraction set to zero by its method (`stats`: its
    inputs' statistics, `jaxllm.model.tap`, for the calibrated methods)."""
    shape = w.shape
    lead = len(shape) - n_in - n_out
    k = math.prod(shape[lead : lead + n_in])
    w2 = w.reshape(*shape[:lead], k, -1)

    def one(w, h):
        if cfg.method == "sparsegpt":
            return sparsegpt(w, h, cfg)[0]
        mask = magnitude(w, cfg) if cfg.method == "magnitude" else wanda(w, h, cfg)
        return jnp.where(mask, 0.0, w.astype(jnp.float32))

    fn = one
    for _ in range(lead):
        fn = jax.vmap(fn)
    gram = stats["gram"] if stats else jnp.zeros((*shape[:lead], 1, 1))
    return fn(w2, gram).astype(w.dtype).reshape(shape)


_prune_weight = jax.jit(prune_weight, static_argnames=("cfg", "n_in", "n_out"))


def prune_unit(params, chosen, stats, cfg: Config, prefix, ctx=None):
    """A unit method of `jaxllm.compress.calibrate`: the block's chosen weights pruned from
    their statistics."""
    out = jax.tree.map(lambda x: x, params)
    for path, (n_in, n_out) in chosen.items():
        *parents, name = path.split("/")
        leaf = out
        for part in parents:
            leaf = leaf[part]
        leaf[name] = _prune_weight(leaf[name], stats[path], cfg=cfg.prune, n_in=n_in, n_out=n_out)
    return out


def prune_params(params: dict, axes: dict, cfg: PruneConfig, mesh: Mesh) -> dict:
    """`params` (on `mesh`, logical `axes`) with the weights `cfg` chooses pruned by magnitude
    (no data), each in its shards; stacked layers and experts each on their own."""
    shardings = sharding.tree_shardings(mesh, axes)
    out = jax.tree.map(lambda x: x, params)
    jobs = weights_lib.chosen(params, axes, cfg)
    for path, (w, n_in, n_out) in tqdm(
        jobs.items(), unit="weight", desc=cfg.method, file=sys.stderr, disable=None
    ):
        *parents, name = path.split("/")
        leaf, sh = out, shardings
        for part in parents:
            leaf, sh = leaf[part], sh[part]
        fn = jax.jit(prune_weight, static_argnames=("cfg", "n_in", "n_out"), out_shardings=sh[name])
        leaf[name] = fn(w, None, cfg=cfg, n_in=n_in, n_out=n_out)
    return out


def sparsity_of(params: dict, axes: dict, cfg: PruneConfig) -> tuple[int, int]:
    """(zeros, values) over the weights `cfg` chooses."""
    ws = [w for w, _, _ in weights_lib.chosen(params, axes, cfg).values()]
    return sum(int(jnp.sum(w == 0)) for w in ws), sum(w.size for w in ws)

"""GPTQ (Frantar et al. 2022, arXiv:2210.17323): weights rounded one input channel at a time,
each rounding error spread over the channels not yet rounded through the inverse Hessian of the
layer's reconstruction error, H = X^T X of its calibration inputs.

With jaxllm's layout W [K in, N out] (the paper's columns are our rows), for channels k in
order:

    q_k = Q(w_k),   e_k = (w_k - q_k) / U_kk,   w_j -= U_kj e_k  for j > k

where U is the upper Cholesky factor of H^-1 after dampening H by `damp` times its mean
diagonal (a channel no input ever reached is set to zero). The updates are applied lazily in
blocks of `block` channels (the paper's 3.4: one matmul per block for the channels after it).
The grid Q of each group comes from the weights as they are when the group's first channel is
reached (the paper's and AutoGPTQ's, whose block-local updates a group starting inside a
block does not see), or with `static_groups` from the original weights, before any update
(llm-compressor's). `act_order` (AutoGPTQ's desc_act) takes the channels in order of
decreasing H_kk; with groups it needs static groups, so each channel keeps the grid of its own
contiguous group and the checkpoint needs no group index. When H is not positive definite
even after dampening, U is the identity: round-to-nearest.

The scales are RTN's (`jaxllm.model.quantized.grid`), so with an identity Hessian GPTQ gives
RTN's codes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.linalg

from jaxllm.config import QuantizeConfig
from jaxllm.model import quantized


def gptq(w: jax.Array, stats: dict, cfg: QuantizeConfig, *, n_in: int, n_out: int):
    """`w` [*lead, *in, *out] quantized by GPTQ with its inputs' `stats` (`jaxllm.model.tap`:
    `gram` [*lead, K, K])."""
    shape = w.shape
    lead = len(shape) - n_in - n_out
    k, n = math.prod(shape[lead : lead + n_in]), math.prod(shape[lead + n_in :])
    w2 = w.reshape(*shape[:lead], k, n)
    fn = lambda w, h: solve(  # noqa: E731
        w,
        h,
        bits=cfg.bits,
        group=cfg.group_size,
        symmetric=cfg.symmetric,
        dtype=w.dtype,
        block=cfg.gptq.block_size,
        damp=cfg.gptq.dampening,
        act_order=cfg.gptq.act_order,
        static_groups=cfg.gptq.static_groups,
    )
    for _ in range(lead):
        fn = jax.vmap(fn)
    q, scale, zero = fn(w2, stats["gram"])
    gshape = quantized.group_shape(shape, n_in, n_out, cfg.group_size)
    return quantized.from_codes(
        q.reshape(shape),
        scale.reshape(gshape),
        None if cfg.symmetric else zero.reshape(gshape),
        bits=cfg.bits,
        group=cfg.group_size,
        n_in=n_in,
        n_out=n_out,
        dtype=w.dtype,
    )


def solve(
    w_KxN,
    h_KxK,
    *,
    bits: int,
    group: int,
    symmetric: bool,
    dtype,
    block: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = False,
):
    """(codes [K, N] float32, scales [G, N], zeros [G, N]) of one weight by GPTQ (module
    docstring); G = K / group (1 per channel)."""
    k, n = w_KxN.shape
    g = group or k
    w = w_KxN.astype(jnp.float32)
    h = h_KxK.astype(jnp.float32)

    def groups_grid(w):
        scale, zero = quantized.grid(
            w[:k].reshape(k // g, g, n), 1, bits=bits, symmetric=symmetric, dtype=dtype
        )
        return scale[:, 0], zero[:, 0]

    scale, zero = groups_grid(w)  # from the original weights (static, and per channel)
    diag = jnp.diagonal(h)
    dead = diag == 0
    h = h + jnp.diag(dead.astype(jnp.float32))
    w = jnp.where(dead[:, None], 0.0, w)
    perm = jnp.argsort(-jnp.diagonal(h), stable=True) if act_order else jnp.arange(k)
    w, h = w[perm], h[perm][:, perm]
    g_idx = perm // g
    h = h + jnp.eye(k, dtype=jnp.float32) * (damp * jnp.mean(jnp.diagonal(h)))
    u = _inverse_cholesky(h)

    kp = -(-k // block) * block  # padded rows: zero weights, identity factor
    w = jnp.pad(w, ((0, kp - k), (0, 0)))
    u = jnp.pad(u, ((0, kp - k), (0, kp - k))) + jnp.diag((jnp.arange(kp) >= k) * 1.0)
    g_idx = jnp.pad(g_idx, (0, kp - k))
    dynamic = bool(group) and not static_groups and not act_order
    starts = jnp.arange(k // g) * g
    rows = jnp.arange(kp)

    def one_block(b, carry):
        w, codes, scale, zero = carry
        i1 = b * block
        if dynamic:  # groups starting in this block take the grid of the weights now
            new_scale, new_zero = groups_grid(w)
            here = ((starts >= i1) & (starts < i1 + block))[:, None]
            scale, zero = jnp.where(here, new_scale, scale), jnp.where(here, new_zero, zero)
        w1 = jax.lax.dynamic_slice_in_dim(w, i1, block)
        u1 = jax.lax.dynamic_slice(u, (i1, i1), (block, block))
        s1 = scale[jax.lax.dynamic_slice_in_dim(g_idx, i1, block)]
        z1 = zero[jax.lax.dynamic_slice_in_dim(g_idx, i1, block)]

        def column(j, c):
            w1, q1, e1 = c
            row = w1[j]
            q = quantized.codes_of(row, s1[j], z1[j], bits)
            err = (row - (q - z1[j]) * s1[j]) / u1[j, j]
            w1 = w1 - u1[j][:, None] * err[None, :]
            return w1, q1.at[j].set(q), e1.at[j].set(err)

        zeros = jnp.zeros_like(w1)
        w1, q1, e1 = jax.lax.fori_loop(0, block, column, (w1, zeros, zeros))
        u_rows = jax.lax.dynamic_slice_in_dim(u, i1, block)  # [block, kp]
        later = (rows >= i1 + block)[:, None]
        w = w - jnp.where(later, u_rows.T @ e1, 0.0)
        w = jax.lax.dynamic_update_slice_in_dim(w, w1, i1, 0)
        codes = jax.lax.dynamic_update_slice_in_dim(codes, q1, i1, 0)
        return w, codes, scale, zero

    init = (w, jnp.zeros((kp, n), jnp.float32), scale, zero)
    _, codes, scale, zero = jax.lax.fori_loop(0, kp // block, one_block, init)
    codes = codes[:k][jnp.argsort(perm)]
    return codes, scale, zero


def _inverse_cholesky(h):
    """The upper Cholesky factor of h^-1 (identity when h is not positive definite)."""
    k = h.shape[0]
    eye = jnp.eye(k, dtype=jnp.float32)
    low = jnp.linalg.cholesky(h)
    hinv = jax.scipy.linalg.cho_solve((low, True), eye)
    u = jnp.linalg.cholesky(hinv).T
    ok = jnp.all(jnp.isfinite(u))
    return jnp.where(ok, u, eye)

"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks",
arXiv:2412.06464), in two forms of one recurrence, and the causal short convolution before it.

Per value head, a state S [K, V] (letters here: K key width, V value width, C chunk length,
N chunks; H is the value heads, Hk the query/key heads) is updated at each token t by

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

with a_t = exp(g_t) the decay (g_t <= 0) and beta_t the write strength: the delta rule writes
only the part of v_t that the decayed state does not already predict for k_t. q and k are
L2-normalised and q scaled by K^-1/2 first (as Qwen3-Next and flash-linear-attention do).

- `recurrent`: a `lax.scan` over tokens; generation's decode steps (a fixed-size state in
  place of a KV cache).
- `chunked`: the WY / UT form of flash-linear-attention's `chunk_gated_delta_rule` (Yang et
  al. 2024, arXiv:2406.06484 section 3): inside a chunk every token's u comes from one unit
  lower-triangular solve, (I + A) U = V_beta - (K_beta * Gamma) S_0 with
  A_ij = beta_i (k_i . k_j) Gamma_i / Gamma_j (j < i), Gamma the cumulative decay; only the
  state crosses chunks (`lax.scan` over N). Training and prefill. The solve multiplies by
  (I + A)^-1, built by forward substitution (`unit_lower_inverse`) as transformers' torch
  chunked form does, not by a LAPACK triangular solve: XLA:CPU's batched one can deadlock
  when two run at once on a small machine.

Packed documents: `reset_BxL` marks tokens that start a new document, before which the state
is zero. In the chunked form that is masks: a token reads the incoming state only while it is
in the document the previous chunk ended in, and pairs (i, j) of a chunk interact only within
one document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _prepare(q_BxLxGxK, k_BxLxGxK, v_BxLxHxV, g_BxLxH, beta_BxLxH):
    """float32 inputs with q/k L2-normalised (eps inside the root, as FLA), q scaled by K^-1/2,
    and q/k repeated to the value heads (q/k head j serves value heads j*R .. j*R + R - 1)."""
    r = v_BxLxHxV.shape[2] // q_BxLxGxK.shape[2]

    def norm(x):
        x = x.astype(jnp.float32)
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    q_BxLxHxK = jnp.repeat(norm(q_BxLxGxK), r, axis=2) * q_BxLxGxK.shape[-1] ** -0.5
    k_BxLxHxK = jnp.repeat(norm(k_BxLxGxK), r, axis=2)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return q_BxLxHxK, k_BxLxHxK, f32(v_BxLxHxV), f32(g_BxLxH), f32(beta_BxLxH)


def _initial(state_BxHxKxV, b, h, kd, vd):
    if state_BxHxKxV is None:
        return jnp.zeros((b, h, kd, vd), jnp.float32)
    return state_BxHxKxV.astype(jnp.float32)


def recurrent(
    q_BxLxGxK, k_BxLxGxK, v_BxLxHxV, g_BxLxH, beta_BxLxH, state_BxHxKxV=None, reset_BxL=None
):
    """(outputs [B, L, H, V] float32, final state [B, H, K, V] float32), token by token."""
    q, k, v, g, beta = _prepare(q_BxLxGxK, k_BxLxGxK, v_BxLxHxV, g_BxLxH, beta_BxLxH)
    b, l, h, kd = k.shape
    s0 = _initial(state_BxHxKxV, b, h, kd, v.shape[-1])
    reset = jnp.zeros((b, l), bool) if reset_BxL is None else reset_BxL

    def step(s_BxHxKxV, xs):
        q_t, k_t, v_t, g_t, beta_t, reset_t = xs
        s_BxHxKxV = jnp.where(reset_t[:, None, None, None], 0.0, s_BxHxKxV)
        s_BxHxKxV = s_BxHxKxV * jnp.exp(g_t)[..., None, None]
        predicted_BxHxV = jnp.einsum("bhkv,bhk->bhv", s_BxHxKxV, k_t)
        u_BxHxV = (v_t - predicted_BxHxV) * beta_t[..., None]
        s_BxHxKxV = s_BxHxKxV + k_t[..., None] * u_BxHxV[..., None, :]
        return s_BxHxKxV, jnp.einsum("bhkv,bhk->bhv", s_BxHxKxV, q_t)

    time_major = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    s, o_LxBxHxV = jax.lax.scan(step, s0, tuple(map(time_major, (q, k, v, g, beta, reset))))
    return jnp.moveaxis(o_LxBxHxV, 0, 1), s


@jax.custom_vjp
def unit_lower_inverse(t_XxCxC):
    """(I + A)^-1 for the unit lower-triangular matrices T = I + A in the last two axes (only
    A's strictly lower part is read), by forward substitution over rows:
    Y_i = -A_i - A_i Y with T^-1 = I + Y. C - 1 small vector-matrix steps; the backward pass is
    two matmuls with the inverse, so nothing per row is kept."""
    c = t_XxCxC.shape[-1]
    y = -jnp.tril(t_XxCxC, -1)

    def row(i, y):  # row i reads only rows < i (its own entries at j >= i are zero)
        r = y[..., i, :]
        return y.at[..., i, :].set(r + jnp.einsum("...j,...jk->...k", r, y))

    eye = jnp.eye(c, dtype=t_XxCxC.dtype).reshape((1,) * (y.ndim - 2) + (c, c))
    return jax.lax.fori_loop(1, c, row, y) + eye


def _inverse_fwd(t):
    inv = unit_lower_inverse(t)
    return inv, inv


def _inverse_bwd(inv, g):  # d(T^-1) = -T^-1 dT T^-1, so dT = -T^-T G T^-T on A's entries
    inv_t = jnp.swapaxes(inv, -1, -2)
    return (jnp.tril(-(inv_t @ g @ inv_t), -1),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def chunked(
    q_BxLxGxK,
    k_BxLxGxK,
    v_BxLxHxV,
    g_BxLxH,
    beta_BxLxH,
    state_BxHxKxV=None,
    reset_BxL=None,
    chunk: int = 64,
    kernel: bool = False,
    interpret: bool = False,
):
    """(outputs [B, L, H, V] float32, final state [B, H, K, V] float32), chunk by chunk; equal
    to `recurrent`. L is padded to whole chunks with g = beta = 0 (no decay, no write).
    `kernel`: the state passes between chunks in the Pallas kernel of
    `jaxllm.kernels.gated_delta` (`interpret`: interpreted, on any backend) instead of a
    `lax.scan`; everything inside a chunk is the same XLA code."""
    q, k, v, g, beta = _prepare(q_BxLxGxK, k_BxLxGxK, v_BxLxHxV, g_BxLxH, beta_BxLxH)
    b, l, h, kd = k.shape
    vd, c = v.shape[-1], chunk
    s0 = _initial(state_BxHxKxV, b, h, kd, vd)
    reset = jnp.zeros((b, l), bool) if reset_BxL is None else reset_BxL
    # document index of each token; the incoming state belongs to document 0
    doc_BxL = jnp.cumsum(reset.astype(jnp.int32), axis=1)
    pad = -l % c
    if pad:
        widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)  # noqa: E731
        q, k, v, g, beta = (jnp.pad(x, widths(x)) for x in (q, k, v, g, beta))
        doc_BxL = jnp.pad(doc_BxL, [(0, 0), (0, pad)], mode="edge")
    n = (l + pad) // c

    def chunks(x):  # [B, N*C, H, ...] -> [N, B, H, C, ...]
        x = x.reshape(b, n, c, h, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g_NxBxHxC, beta_NxBxHxC = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]
    doc_NxBxC = jnp.moveaxis(doc_BxL.reshape(b, n, c), 1, 0)

    cum_NxBxHxC = jnp.cumsum(g_NxBxHxC, axis=-1)
    causal_1x1x1xCxC = jnp.tril(jnp.ones((c, c), bool))[None, None, None]
    same_NxBx1xCxC = (doc_NxBxC[..., :, None] == doc_NxBxC[..., None, :])[:, :, None]
    allowed = causal_1x1x1xCxC & same_NxBx1xCxC
    diff = cum_NxBxHxC[..., :, None] - cum_NxBxHxC[..., None, :]
    decay_NxBxHxCxC = jnp.where(allowed, jnp.exp(jnp.where(allowed, diff, 0.0)), 0.0)
    k_beta = k * beta_NxBxHxC[..., None]
    strict_1x1x1xCxC = jnp.tril(jnp.ones((c, c), bool), -1)[None, None, None]
    a_NxBxHxCxC = jnp.where(strict_1x1x1xCxC, jnp.einsum("...ik,...jk->...ij", k_beta, k), 0.0)
    t_NxBxHxCxC = a_NxBxHxCxC * decay_NxBxHxCxC + jnp.eye(c, dtype=jnp.float32)[None, None, None]
    gamma_NxBxHxC = jnp.exp(cum_NxBxHxC)
    inv_NxBxHxCxC = unit_lower_inverse(t_NxBxHxCxC)
    u0_NxBxHxCxV = inv_NxBxHxCxC @ (v * beta_NxBxHxC[..., None])
    w_NxBxHxCxK = inv_NxBxHxCxC @ (k_beta * gamma_NxBxHxC[..., None])
    attn_NxBxHxCxC = jnp.einsum("...ik,...jk->...ij", q, k) * decay_NxBxHxCxC
    # which tokens read the incoming state: those still in the document the previous chunk
    # ended in; a chunk that starts a new document passes none of the state on
    prev_doc_NxB = jnp.concatenate([jnp.zeros((1, b), jnp.int32), doc_NxBxC[:-1, :, -1]])
    reads_NxBx1xCx1 = (doc_NxBxC == prev_doc_NxB[..., None])[:, :, None, :, None]
    q_reads = jnp.where(reads_NxBx1xCx1, q * gamma_NxBxHxC[..., None], 0.0)
    w_reads = jnp.where(reads_NxBx1xCx1, w_NxBxHxCxK, 0.0)
    to_end_NxBxHxC = jnp.exp(cum_NxBxHxC[..., -1:] - cum_NxBxHxC)
    last_same_NxBxC = doc_NxBxC == doc_NxBxC[..., -1:]
    k_to_end = k * jnp.where(last_same_NxBxC[:, :, None], to_end_NxBxHxC, 0.0)[..., None]
    keeps_NxBx1 = (doc_NxBxC[..., -1] == prev_doc_NxB)[..., None]
    decay_NxBxHxK = jnp.broadcast_to(
        jnp.where(keeps_NxBx1, gamma_NxBxHxC[..., -1], 0.0)[..., None], (n, b, h, kd)
    )
    xs = (u0_NxBxHxCxV, w_reads, attn_NxBxHxCxC, q_reads, k_to_end, decay_NxBxHxK)
    if kernel:  # the same recurrence as one Pallas program per (batch, head)
        from jaxllm.kernels.gated_delta import chunk_scan

        o, s = chunk_scan(*(jnp.moveaxis(x, 0, 2) for x in xs), s0, interpret)
        o_NxBxHxCxV = jnp.moveaxis(o, 2, 0)
    else:

        def step(s_BxHxKxV, xs):
            u0, w, attn, q_dec, k_end, decay_BxHxK = xs
            u_BxHxCxV = u0 - jnp.einsum("bhck,bhkv->bhcv", w, s_BxHxKxV)
            o_BxHxCxV = jnp.einsum("bhck,bhkv->bhcv", q_dec, s_BxHxKxV) + jnp.einsum(
                "bhij,bhjv->bhiv", attn, u_BxHxCxV
            )
            s_BxHxKxV = s_BxHxKxV * decay_BxHxK[..., None] + jnp.einsum(
                "bhck,bhcv->bhkv", k_end, u_BxHxCxV
            )
            return s_BxHxKxV, o_BxHxCxV

        s, o_NxBxHxCxV = jax.lax.scan(step, s0, xs)
    o_BxLxHxV = jnp.moveaxis(o_NxBxHxCxV, 0, 1).transpose(0, 1, 3, 2, 4).reshape(b, n * c, h, vd)
    return o_BxLxHxV[:, :l], s


def causal_conv(x_BxLxC, w_WxC, reset_BxL=None, tail_BxTxC=None):
    """Depthwise causal convolution with SiLU: out_t = silu(sum_i w[W-1-i] x_{t-i}) over the
    taps of the token's own document (`reset_BxL` as in `chunked`), the `tail_BxTxC`
    (T = W - 1 inputs before x, zeros by default) standing before x. Returns (out [B, L, C]
    in x's dtype, the last W - 1 inputs: the next call's tail)."""
    b, l, ch = x_BxLxC.shape
    taps = w_WxC.shape[0]
    if tail_BxTxC is None:
        tail_BxTxC = jnp.zeros((b, taps - 1, ch), x_BxLxC.dtype)
    xx_BxSxC = jnp.concatenate([tail_BxTxC.astype(x_BxLxC.dtype), x_BxLxC], axis=1)
    reset = jnp.zeros((b, l), bool) if reset_BxL is None else reset_BxL
    doc_BxS = jnp.pad(jnp.cumsum(reset.astype(jnp.int32), axis=1), [(0, 0), (taps - 1, 0)])
    doc_BxL = doc_BxS[:, taps - 1 :]
    out_BxLxC = jnp.zeros((b, l, ch), jnp.float32)
    for i in range(taps):  # shift i: the input i tokens back, weighted by tap W - 1 - i
        start = taps - 1 - i
        same_BxLx1 = (doc_BxS[:, start : start + l] == doc_BxL)[..., None]
        x_i = jnp.where(same_BxLx1, xx_BxSxC[:, start : start + l], 0).astype(jnp.float32)
        out_BxLxC = out_BxLxC + x_i * w_WxC[taps - 1 - i].astype(jnp.float32)[None, None]
    return jax.nn.silu(out_BxLxC).astype(x_BxLxC.dtype), xx_BxSxC[:, l:]

"""The inter-chunk recurrence as one Pallas program per (batch, value head): the inputs stay
whole in HBM and each program loads chunk n's blocks inside a `fori_loop`, carrying its [K, V]
float32 state, as the decode-attention Triton kernel loads kv blocks (math in `reference.py`).
Triton needs power-of-two block dims: C, K and V of 16 or more (64 / 128 / 128 in Qwen3-Next).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _kernel(u0_ref, w_ref, attn_ref, q_ref, k_ref, decay_ref, s0_ref, o_ref, s_ref):
    b, h = pl.program_id(0), pl.program_id(1)
    n_chunks = u0_ref.shape[2]

    def body(n, s_KxV):
        u0 = u0_ref[b, h, n]
        w, q, k = w_ref[b, h, n], q_ref[b, h, n], k_ref[b, h, n]
        u = u0 - jnp.dot(w, s_KxV, preferred_element_type=jnp.float32)
        o = jnp.dot(q, s_KxV, preferred_element_type=jnp.float32) + jnp.dot(
            attn_ref[b, h, n], u, preferred_element_type=jnp.float32
        )
        o_ref[b, h, n] = o.astype(o_ref.dtype)
        decay_K = decay_ref[b, h, n]
        return s_KxV * decay_K[:, None] + jnp.dot(k.T, u, preferred_element_type=jnp.float32)

    s_ref[b, h] = jax.lax.fori_loop(0, n_chunks, body, s0_ref[b, h])


def forward(u0, w, attn, q, k, decay, s0, *, interpret: bool = False):
    """(o [B, H, N, C, V], final state [B, H, K, V]); shapes as `chunk_scan_reference`."""
    bsz, h = u0.shape[:2]
    whole = pl.no_block_spec  # whole arrays; each program indexes its (b, h) rows
    return pl.pallas_call(
        _kernel,
        grid=(bsz, h),
        in_specs=[whole] * 7,
        out_specs=[whole, whole],
        out_shape=[
            jax.ShapeDtypeStruct(u0.shape, jnp.float32),
            jax.ShapeDtypeStruct(s0.shape, jnp.float32),
        ],
        interpret=interpret,
        name="gated_delta_chunk_scan",
    )(u0, w, attn, q, k, decay, s0)

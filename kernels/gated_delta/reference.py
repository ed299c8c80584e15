"""The inter-chunk recurrence of the chunked gated delta rule, in pure JAX.

Per (batch, value head) and chunk n (C tokens, K key and V value channels), with everything
that does not depend on the incoming state S [K, V] computed beforehand (`delta_rule.chunked`):

    u_n = u0_n - w_n S          o_n = q_n S + attn_n u_n          S <- decay_n * S + k_n^T u_n

u0 [C, V] the deltas of the chunk alone, w [C, K] the keys that read S (zero rows for tokens
of a later document than S's), attn [C, C] the decayed causal q.k within the chunk, q [C, K]
the decayed queries (zero rows as w), k [C, K] the keys decayed to the chunk's end (zero rows
for tokens before its last document), decay [K] the chunk's total decay (broadcast over K; 0
when the chunk starts a new document).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunk_scan_reference(u0, w, attn, q, k, decay, s0):
    """u0 [B, H, N, C, V], w / q / k [B, H, N, C, K], attn [B, H, N, C, C], decay [B, H, N, K],
    s0 [B, H, K, V] (all float32) -> (o [B, H, N, C, V], final state [B, H, K, V])."""

    def step(s_BxHxKxV, xs):
        u0_n, w_n, attn_n, q_n, k_n, decay_n = xs
        u_n = u0_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s_BxHxKxV)
        o_n = jnp.einsum("bhck,bhkv->bhcv", q_n, s_BxHxKxV) + jnp.einsum(
            "bhij,bhjv->bhiv", attn_n, u_n
        )
        s_BxHxKxV = s_BxHxKxV * decay_n[..., None] + jnp.einsum("bhck,bhcv->bhkv", k_n, u_n)
        return s_BxHxKxV, o_n

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731
    s, o = jax.lax.scan(step, s0, tuple(map(chunk_major, (u0, w, attn, q, k, decay))))
    return jnp.moveaxis(o, 0, 2), s

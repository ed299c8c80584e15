"""Next-token choice from logits: greedy, temperature, top-k (Fan et al. 2018) and nucleus / top-p
(Holtzman et al. 2019, arXiv:1904.09751). All filters compose; the rng is explicit."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits_BxV: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Logits with everything outside the top-k and outside the top-p nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches `top_p`
    (the most likely token is always kept)."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    neg = jnp.finfo(jnp.float32).min
    if top_k and top_k < logits_BxV.shape[-1]:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, neg, logits_BxV)
    if top_p < 1.0:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # mass of more likely tokens
        keep_BxV = before_BxV < top_p
        cutoff_Bx1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
        logits_BxV = jnp.where(logits_BxV < cutoff_Bx1, neg, logits_BxV)
    return logits_BxV


def sample(
    logits_BxV: jax.Array,
    rng: jax.Array | None,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> jax.Array:
    """Token ids [B] (int32). `temperature == 0` is greedy (argmax) and ignores the rng.
    `rng`: one key, or one key per row [B] (each row's draw then depends on its key alone,
    not on the row's place in the batch)."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = filter_logits(logits_BxV / temperature, top_k=top_k, top_p=top_p)
    if rng.ndim:
        return jax.vmap(jax.random.categorical)(rng, logits_BxV).astype(jnp.int32)
    return jax.random.categorical(rng, logits_BxV, axis=-1).astype(jnp.int32)


def split_key(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the next key, a key to draw with) of one key, or of each row's key [B]."""
    if rng.ndim:
        pair_Bx2 = jax.vmap(jax.random.split)(rng)
        return pair_Bx2[:, 0], pair_Bx2[:, 1]
    rng, sub = jax.random.split(rng)
    return rng, sub

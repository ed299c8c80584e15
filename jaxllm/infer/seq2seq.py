"""Generation with an encoder–decoder (`model.kind=encoder_decoder`, T5).

The prompt is the encoder's input: it is encoded once, and each decoder layer's cross-attention
keys and values of the encoder output are computed once into a cache of their own (of the same
dtype as the self-attention cache: bfloat16, float32, int8, int4 or int2), which every decode
step reads; the valid encoder tokens of each prompt are its length, so right-padding stays unseen.
The decoder starts from `DECODER_START` (T5's decoder_start_token_id, the pad id 0) and decodes
one token per step with its own self-attention KV cache, inside one `lax.while_loop`.
`greedy_uncached` is the reference: the full forward pass over a fixed decoder buffer per step.
`jaxllm.infer.generate.generate` dispatches here for an encoder–decoder.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.infer import kv_cache
from jaxllm.infer.sampling import sample, split_key

DECODER_START = 0


def _cache(cfg, batch: int, tokens: int, plan):
    g, k, _ = kv_cache.cache_dims(cfg)
    return kv_cache.init_cache(
        num_layers=cfg.resolved_decoder_layers,
        batch=batch,
        num_kv_heads=g,
        head_dim=k,
        max_len=kv_cache.cache_length(tokens, plan.kind, plan.group),
        kind=plan.kind,
        group=plan.group,
        compute_dtype=jnp.dtype(cfg.dtype),
    )


def _view(kv, lengths_B, plan, prefill=False):
    return kv_cache.CacheView(
        kv, lengths_B, jnp.int32(0), prefill=prefill, impl=plan.impl, interpret=plan.interpret
    )


def cache_tokens(prompt_len: int, plan) -> int:
    """Tokens per sequence the two caches reserve (self-attention and cross-attention)."""
    return kv_cache.cache_length(plan.max_new, plan.kind, plan.group) + kv_cache.cache_length(
        prompt_len, plan.kind, plan.group
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "on_token"))
def generate_core(graphdef, state, prompt_BxS, lengths_B, stop_S, stop_SxM, rng, plan, on_token):
    """(new tokens [B, max_new], done [B]): `jaxllm.infer.generate._generate` for an
    encoder–decoder (contiguous caches; the same stop rules)."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    b, s = prompt_BxS.shape
    seg_BxS = (jnp.arange(s, dtype=jnp.int32)[None, :] < lengths_B[:, None]).astype(jnp.int32)
    encoded_BxSxD = model.encode(prompt_BxS, seg_BxS)
    cross = model.cross_kv(encoded_BxSxD, _view(_cache(cfg, b, s, plan), lengths_B, plan, True))
    cross = _view(cross.kv, lengths_B, plan)  # decode steps: each query sees every valid token
    pick = functools.partial(
        sample, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p
    )
    tail_BxM = jnp.full((b, stop_SxM.shape[1]), -1, jnp.int32)

    def cond(carry):
        i, _, _, done_B, _, _, _, _ = carry
        return (i < plan.max_new) & ~jnp.all(done_B)

    def body(carry):
        i, tok_B, dec_len_B, done_B, out_BxN, tail_BxM, kv, rng = carry
        dec_len_B = dec_len_B + 1
        out = model.decode(tok_B[:, None], None, cache=_view(kv, dec_len_B, plan), cross=cross)
        logits_Bx1xV, view = out.logits, out.cache
        rng, sub = split_key(rng)
        tok_B = pick(logits_Bx1xV[:, 0], sub)
        out_BxN = out_BxN.at[:, i].set(jnp.where(done_B, 0, tok_B))
        if on_token is not None:
            jax.debug.callback(on_token, i, tok_B, done_B, ordered=True)
        tail_BxM = jnp.concatenate([tail_BxM[:, 1:], tok_B[:, None]], axis=1)
        same_BxSxM = (tail_BxM[:, None, :] == stop_SxM[None]) | (stop_SxM[None] < 0)
        done_B = done_B | jnp.isin(tok_B, stop_S) | jnp.any(jnp.all(same_BxSxM, -1), -1)
        return i + 1, tok_B, dec_len_B, done_B, out_BxN, tail_BxM, view.kv, rng

    start_B = jnp.full((b,), DECODER_START, jnp.int32)
    zeros_B = jnp.zeros((b,), jnp.int32)
    out_BxN = jnp.zeros((b, plan.max_new), jnp.int32)
    kv = _cache(cfg, b, plan.max_new, plan)
    carry = (jnp.int32(0), start_B, zeros_B, zeros_B > 0, out_BxN, tail_BxM, kv, rng)
    _, _, _, done_B, out_BxN, _, _, _ = jax.lax.while_loop(cond, body, carry)
    return out_BxN, done_B


@functools.partial(jax.jit, static_argnames=("graphdef", "num_new"))
def _greedy(graphdef, state, prompt_BxS, seg_BxS, num_new: int):
    model = nnx.merge(graphdef, state)
    b = prompt_BxS.shape[0]
    buf_BxT = jnp.full((b, num_new + 1), DECODER_START, jnp.int32)

    def body(i, buf_BxT):
        logits_BxTxV = model(prompt_BxS, buf_BxT, segment_ids_BxS=seg_BxS).logits
        next_B = jnp.argmax(logits_BxTxV[:, i], -1).astype(jnp.int32)
        return buf_BxT.at[:, i + 1].set(next_B)

    return jax.lax.fori_loop(0, num_new, body, buf_BxT)[:, 1:]


def greedy_uncached(model, prompts, num_new: int) -> np.ndarray:
    """[B, num_new] argmax tokens of each prompt, each step a full forward pass (no cache)."""
    s = max(len(p) for p in prompts)
    prompt_BxS = np.zeros((len(prompts), s), np.int32)
    seg_BxS = np.zeros((len(prompts), s), np.int32)
    for row, p in enumerate(prompts):
        prompt_BxS[row, : len(p)], seg_BxS[row, : len(p)] = p, 1
    graphdef, state = nnx.split(model)
    return np.asarray(_greedy(graphdef, state, prompt_BxS, seg_BxS, num_new))

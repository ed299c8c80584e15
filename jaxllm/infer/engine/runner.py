"""The engine's device step: one jitted forward of the existing model over every slot, with the
paged cache, then per-row sampling.

Every slot feeds Q tokens (Q a power-of-two bucket: 1 when all slots decode, up to the chunk
size while some prefill). A slot with fewer real tokens is right-padded: its cache length is
set to start + Q, so the padding is written after its real tokens (into its own last page, or
through block table entries of 0 into the scratch page), where no real query sees it and later
writes overwrite it. Query i sits at position start + i and, by the decode attention's causal
rule, sees the cache up to itself, so a prefill chunk attends over the pages already there
(earlier chunks, shared prefix pages) exactly as one long prefill would.

On a mesh (`sharding.Parallel`), as `generate` runs: parameters lie as their logical axes say
(heads and MLP over `tensor`, experts over `expert`, `embed` over `fsdp`), the page pool's kv
heads over `tensor` (its pages are shared by all slots, so not split further), and the slots'
rows (tokens, starts, block tables, sampling arrays) over the data axes. The step traces under
the settings, so the model's activation constraints and MoE dispatch see the mesh.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm import sharding
from jaxllm.infer import kv_cache
from jaxllm.model.layers import logical_axes


def data_degree(parallel: sharding.Parallel) -> int:
    """How many ways the slots are split: the product of the mesh axes `batch` maps to."""
    mesh = parallel.mesh
    return 1 if mesh is None else int(np.prod([mesh.shape[a] for a in sharding.RULES["batch"]]))


def place_params(state, parallel: sharding.Parallel):
    """The model's state with every array laid out on the mesh by its logical axes (already
    placed arrays stay where they are); unchanged without a mesh."""
    if parallel.mesh is None:
        return state
    axes, arrays = logical_axes(state), nnx.to_pure_dict(state)
    sharding.check_divisible(parallel.mesh, arrays, axes)
    placed = jax.device_put(arrays, sharding.tree_shardings(parallel.mesh, axes))
    nnx.replace_by_pure_dict(state, placed)
    return state


def _cache_shardings(kv, mesh):
    return jax.tree.map(
        lambda ax: None if ax is None else sharding.named(mesh, ax),
        kv_cache.logical_axes(kv),
        is_leaf=lambda x: x is None or isinstance(x, tuple),
    )


def _constrain_cache(kv):
    return jax.tree.map(
        lambda x, ax: x if ax is None else sharding.constrain(x, ax),
        kv,
        kv_cache.logical_axes(kv),
        is_leaf=lambda x: x is None,
    )


def empty_cache(
    cfg,
    *,
    slots: int,
    pages_per_slot: int,
    page_size: int,
    num_pages: int,
    kind,
    parallel: sharding.Parallel = sharding.Parallel(),
):
    """The engine's page pool on the device (all layers), with an all-scratch block table; on
    a mesh made in its shards (kv heads over `tensor`, block table rows over the data axes)."""
    g, k, value_dim = kv_cache.cache_dims(cfg)

    def init():
        return kv_cache.init_cache(
            num_layers=cfg.num_layers,
            batch=slots,
            num_kv_heads=g,
            head_dim=k,
            max_len=page_size,
            kind=kind,
            compute_dtype=jnp.dtype(cfg.dtype),
            block_table=jnp.zeros((slots, pages_per_slot), jnp.int32),
            num_pages=num_pages,
            value_dim=value_dim,
        )

    if parallel.mesh is None:
        return init()
    return jax.jit(init, out_shardings=_cache_shardings(jax.eval_shape(init), parallel.mesh))()


def put_rows(parallel: sharding.Parallel, *arrays):
    """Host arrays whose leading dim is the slot -> device arrays split over the data axes."""
    if parallel.mesh is None:
        return tuple(map(jnp.asarray, arrays))
    return tuple(
        jax.device_put(a, sharding.named(parallel.mesh, ("batch",) + (None,) * (a.ndim - 1)))
        for a in arrays
    )


def sample_rows(logits_SxV, temp_S, top_k_S, top_p_S, min_p_S, seed_S, count_S):
    """(token [S], its log-probability under the model [S]): per-row temperature (0 greedy),
    top-k (0 off), top-p, min-p (keep tokens with probability >= min_p x the largest), drawn
    with the key fold_in(key(seed), count), so a token's draw depends on its request's seed and
    index only (a recomputed or rescheduled sequence draws the same)."""
    logits_SxV = logits_SxV.astype(jnp.float32)
    logp_SxV = jax.nn.log_softmax(logits_SxV, axis=-1)
    greedy_S = jnp.argmax(logits_SxV, axis=-1).astype(jnp.int32)
    v = logits_SxV.shape[-1]
    scaled_SxV = logits_SxV / jnp.where(temp_S > 0, temp_S, 1.0)[:, None]
    sorted_SxV = -jnp.sort(-scaled_SxV, axis=-1)
    k_S = jnp.where((top_k_S > 0) & (top_k_S < v), top_k_S, v)
    kth_Sx1 = jnp.take_along_axis(sorted_SxV, (k_S - 1)[:, None], axis=1)
    probs_SxV = jax.nn.softmax(sorted_SxV, axis=-1)
    before_SxV = jnp.cumsum(probs_SxV, axis=-1) - probs_SxV  # mass of more likely tokens
    keep_SxV = before_SxV < top_p_S[:, None]
    nucleus_Sx1 = jnp.min(jnp.where(keep_SxV, sorted_SxV, jnp.inf), axis=-1, keepdims=True)
    log_min_p_S = jnp.where(min_p_S > 0, jnp.log(jnp.maximum(min_p_S, 1e-30)), -jnp.inf)
    min_p_Sx1 = sorted_SxV[:, :1] + log_min_p_S[:, None]
    cut_Sx1 = jnp.maximum(jnp.maximum(kth_Sx1, nucleus_Sx1), min_p_Sx1)
    filtered_SxV = jnp.where(scaled_SxV < cut_Sx1, jnp.finfo(jnp.float32).min, scaled_SxV)
    keys_S = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed_S, count_S)
    drawn_S = jax.vmap(jax.random.categorical)(keys_S, filtered_SxV).astype(jnp.int32)
    tok_S = jnp.where(temp_S > 0, drawn_S, greedy_S)
    return tok_S, jnp.take_along_axis(logp_SxV, tok_S[:, None], axis=1)[:, 0]


TRACES = [0]
"""How many times `step` has been traced (each trace is one compile): tests bound it."""


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "impl", "interpret", "parallel"),
    donate_argnames=("kv",),
)
def step(
    graphdef,
    state,
    kv,
    tokens_SxQ,
    start_S,
    last_S,
    table_SxJ,
    sampling,
    impl,
    interpret,
    parallel: sharding.Parallel = sharding.Parallel(),
):
    """Writes each slot's Q tokens at start .. start + Q - 1, and samples the token after its
    real token `last` (an index into Q). `sampling`: (temperature, top_k, top_p, min_p, seed,
    count), each [S]. Returns (tokens [S], their log-probabilities [S], the cache). `parallel`:
    the mesh and its settings the step runs under (none: one device)."""
    TRACES[0] += 1
    with sharding.active(parallel):
        return _step(
            graphdef, state, kv, tokens_SxQ, start_S, last_S, table_SxJ, sampling, impl, interpret
        )


def _step(graphdef, state, kv, tokens_SxQ, start_S, last_S, table_SxJ, sampling, impl, interpret):
    model = nnx.merge(graphdef, state)
    s, q = tokens_SxQ.shape
    positions_SxQ = start_S[:, None] + jnp.arange(q, dtype=jnp.int32)[None]
    kv = dataclasses.replace(kv, block_table=table_SxJ)
    view = kv_cache.CacheView(
        kv, start_S + q, jnp.int32(0), prefill=False, impl=impl, interpret=interpret
    )
    logits_Sx1xV, view, *_ = model(
        tokens_SxQ, positions_BxL=positions_SxQ, cache=view, logits_at_BxQ=last_S[:, None]
    )
    tok_S, logp_S = sample_rows(logits_Sx1xV[:, 0], *sampling)
    return tok_S, logp_S, _constrain_cache(view.kv)

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
from jaxllm.infer.engine import linear as linear_slots
from jaxllm.infer.engine.sampling import MAX_TOP_LOGPROBS, sample_rows
from jaxllm.infer.linear_state import num_full_layers
from jaxllm.model import coded, quantized
from jaxllm.model.layers import logical_axes


def data_degree(parallel: sharding.Parallel) -> int:
    """How many ways the slots are split: the product of the mesh axes `batch` maps to."""
    mesh = parallel.mesh
    return (
        1 if mesh is None else int(np.prod([mesh.shape.get(a, 1) for a in sharding.RULES["batch"]]))
    )


def place_params(state, parallel: sharding.Parallel):
    """The model's state with every array laid out on the mesh by its logical axes; an array
    already on this mesh stays as it is (a training state's parameters, in whatever layout its
    ZeRO stage gave them, are not copied). Unchanged without a mesh."""
    if parallel.mesh is None:
        return state
    arrays = nnx.to_pure_dict(state)
    # a quantized weight's codes, scales and zero points each take their own axes
    axes = jax.tree.map(_leaf_axes, logical_axes(state), arrays, is_leaf=_is_axes)

    def on_mesh(x):
        placed = isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
        return placed and x.sharding.mesh == parallel.mesh

    # only the arrays still to place must split evenly (a training state's LoRA factors may not)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    pending = jax.tree.map(lambda x: scalar if on_mesh(x) else x, arrays)
    sharding.check_divisible(parallel.mesh, pending, axes)

    def put(target, x):
        return x if on_mesh(x) else jax.device_put(x, target)

    placed = jax.tree.map(put, sharding.tree_shardings(parallel.mesh, axes), arrays)
    nnx.replace_by_pure_dict(state, placed)
    return state


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def _leaf_axes(ax: tuple, x):
    """The logical axes of the arrays of parameter `x`, whose weight had `ax`."""
    if isinstance(x, quantized.QuantizedTensor):
        return quantized.quantized_axes(x, ax)
    return coded.axes(x, ax) if isinstance(x, coded.CodedTensor) else ax


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
    group: int = 32,
    parallel: sharding.Parallel = sharding.Parallel(),
):
    """The engine's page pool on the device (every full-attention layer: a hybrid model's
    linear layers keep `linear.py`'s state instead), with an all-scratch block table; on a mesh
    made in its shards (kv heads over `tensor`, block table rows over the data axes)."""
    g, k, value_dim = kv_cache.cache_dims(cfg)
    dims = dict(
        num_layers=num_full_layers(cfg),
        slots=slots,
        num_kv_heads=g,
        head_dim=k,
        page_size=page_size,
        kind=kind,
        group=group,
        compute_dtype=jnp.dtype(cfg.dtype),
        pages_per_slot=pages_per_slot,
        num_pages=num_pages,
        value_dim=value_dim,
    )
    if parallel.mesh is None:
        return _init_pool(**dims)
    return _sharded_pool_init(parallel.mesh, **dims)()


def _init_pool(*, slots, page_size, pages_per_slot, **dims):
    block_table = jnp.zeros((slots, pages_per_slot), jnp.int32)
    return kv_cache.init_cache(batch=slots, max_len=page_size, block_table=block_table, **dims)


@functools.lru_cache(maxsize=8)
def _sharded_pool_init(mesh, **dims):
    """The jitted pool maker of one mesh and pool shape, kept: an engine built again for the
    next rollout reuses its compiled program instead of compiling another."""
    init = functools.partial(_init_pool, **dims)
    return jax.jit(init, out_shardings=_cache_shardings(jax.eval_shape(init), mesh))


def put_rows(parallel: sharding.Parallel, *arrays):
    """Host arrays whose leading dim is the slot -> device arrays split over the data axes."""
    if parallel.mesh is None:
        return tuple(map(jnp.asarray, arrays))
    return tuple(
        jax.device_put(a, sharding.named(parallel.mesh, ("batch",) + (None,) * (a.ndim - 1)))
        for a in arrays
    )


TRACES = [0]
"""How many times `step` has been traced (each trace is one compile): tests bound it."""


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "impl", "interpret", "parallel"),
    donate_argnames=("kv", "linear"),
)
def step(
    graphdef,
    state,
    kv,
    linear,
    tokens_SxQ,
    start_S,
    real_S,
    table_SxJ,
    sampling,
    images,
    impl,
    interpret,
    parallel: sharding.Parallel = sharding.Parallel(),
    targets_SxQ=None,
):
    """Writes each slot's Q tokens at start .. start + Q - 1, and samples the token after its
    last real one (`real_S` of its Q are real, 0 in an idle slot); `linear`: the slots' state
    of linear-attention layers (`linear.py`; None without any); `table_SxJ`: the slots' pages, J wide (enough for every
    slot's start + Q tokens, or the pool's full width), in place of `kv`'s. `sampling`: the slots'
    `sampling.Rows`. `images` (a vision-language model, else None): the slots' M-RoPE
    positions [S, 3, Q] and the chunks' image features (`vision.chunk_inputs`). Returns (what `sample_rows` returns: tokens [S], their log-probabilities
    [S], the top 20 token ids [S, 20] and their log-probabilities [S, 20]; the cache; the
    linear state; the prompt log-probabilities, None without `targets_SxQ`).
    `parallel`: the mesh and its settings the step runs under (none: one device).
    `targets_SxQ` (None: off, a program of its own otherwise): the token after each of the
    slots' Q tokens; the step then also returns, per position, the log-probability of that
    token and the top 20 (ids, log-probabilities) (`prompt_logprobs`)."""
    TRACES[0] += 1
    with sharding.active(parallel):
        return _step(
            graphdef,
            state,
            kv,
            linear,
            tokens_SxQ,
            start_S,
            real_S,
            table_SxJ,
            sampling,
            images,
            impl,
            interpret,
            targets_SxQ,
        )


def _step(
    graphdef,
    state,
    kv,
    linear,
    tokens_SxQ,
    start_S,
    real_S,
    table_SxJ,
    sampling,
    images,
    impl,
    interpret,
    targets_SxQ,
):
    model = nnx.merge(graphdef, state)
    s, q = tokens_SxQ.shape
    positions_SxQ = start_S[:, None] + jnp.arange(q, dtype=jnp.int32)[None]
    inputs = {"tokens_BxL": tokens_SxQ}
    if images is not None:  # M-RoPE ids; image tokens take the tower's features
        positions_SxQ, feats = jnp.transpose(images[0], (1, 0, 2)), images[1]
        if feats is not None:
            inputs = _image_inputs(model, tokens_SxQ, *feats)
    # the pool's own table is a fixed placeholder, returned as it came: the donated cache keeps
    # one shape while J (the live table's width, a page bucket) changes between calls
    placeholder = kv.block_table
    kv = dataclasses.replace(kv, block_table=table_SxJ)
    view = kv_cache.CacheView(
        kv,
        start_S + q,
        jnp.int32(0),
        prefill=False,
        impl=impl,
        interpret=interpret,
        linear=linear_slots.begin(linear, start_S, real_S),
        real_B=real_S,
    )
    last_S = jnp.maximum(real_S - 1, 0)
    at_SxQ = last_S[:, None]  # the logits of every position only when the prompt's are asked
    if targets_SxQ is not None:
        at_SxQ = jnp.broadcast_to(jnp.arange(q, dtype=jnp.int32)[None], (s, q))
    logits_SxQxV, view, *_ = model(
        **inputs, positions_BxL=positions_SxQ, cache=view, logits_at_BxQ=at_SxQ
    )
    prompt = None
    if targets_SxQ is not None:
        prompt = prompt_logprobs(logits_SxQxV, targets_SxQ)
        logits_SxQxV = jnp.take_along_axis(logits_SxQxV, last_S[:, None, None], axis=1)
    picked = sample_rows(logits_SxQxV[:, 0], sampling)
    kv = _constrain_cache(dataclasses.replace(view.kv, block_table=placeholder))
    return picked, kv, linear_slots.constrain(view.linear), prompt


def prompt_logprobs(logits_SxQxV, targets_SxQ):
    """(log-probability of each target [S, Q], its rank (1: the most likely) [S, Q], the top
    K = min(MAX_TOP_LOGPROBS, V) ids [S, Q, K] and log-probabilities [S, Q, K]) under the
    model's own log-softmax."""
    logp_SxQxV = jax.nn.log_softmax(logits_SxQxV.astype(jnp.float32), axis=-1)
    k = min(MAX_TOP_LOGPROBS, logp_SxQxV.shape[-1])
    top_SxQxK, ids_SxQxK = jax.lax.top_k(logp_SxQxV, k)
    target_SxQ = jnp.take_along_axis(logp_SxQxV, targets_SxQ[..., None], axis=2)[..., 0]
    rank_SxQ = 1 + jnp.sum(logp_SxQxV > target_SxQ[..., None], axis=-1, dtype=jnp.int32)
    return target_SxQ, rank_SxQ, ids_SxQxK.astype(jnp.int32), top_SxQxK


def _image_inputs(model, tokens_SxQ, feats_SxQxD, deep_SxKxQxD, mask_SxQ) -> dict:
    """The model's inputs with the image tokens' embeddings replaced by their features (and
    DeepStack's features added after the first blocks), as `VisionLanguageModel` places them."""
    x_SxQxD = model._embed(tokens_SxQ)
    x_SxQxD = jnp.where(mask_SxQ[..., None], feats_SxQxD.astype(x_SxQxD.dtype), x_SxQxD)
    inputs = {"embeddings_BxLxD": x_SxQxD}
    if deep_SxKxQxD is not None:
        s, k, q, d = deep_SxKxQxD.shape
        deep_KxMxD = jnp.transpose(deep_SxKxQxD, (1, 0, 2, 3)).reshape(k, s * q, d)
        index_SxQ = jnp.arange(s * q, dtype=jnp.int32).reshape(s, q)
        inputs["deepstack"] = (deep_KxMxD, index_SxQ, mask_SxQ)
    return inputs

"""Text generation: prefill, then decode with a KV cache, all inside one jitted program.

`generate(model, prompts, gen)` right-pads a batch of prompts of different lengths, runs one
prefill pass that fills the cache (`jaxllm.infer.kv_cache`) and gives each prompt's next-token
logits, then a `lax.while_loop` of single-token decode steps until every sequence has produced
`max_new_tokens` or a stop token or stop sequence (several tokens, such as a chat template's
end-of-turn marker written as text, `<|im_end|>` in bytes): no Python runs per token. Tokens can
be streamed to the host as they are made (`on_token`, through an ordered `jax.debug.callback`).

An encoder–decoder (`model.kind=encoder_decoder`) encodes the prompt once and decodes from
its decoder start token (`jaxllm.infer.seq2seq`), with the same sampling, stops and caches.

A vision-language model (`model.vision`) takes each prompt's images (`images=`): the prefill
runs the tower and M-RoPE positions, and decoding continues at position + rope delta
(`jaxllm.infer.vision`).

`greedy_continue` (`jaxllm.infer.reference`) is the cache-free reference: every step re-runs
the full forward pass over a fixed buffer; cached decoding is tested against it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm import sharding
from jaxllm.config import ConfigError, GenerateConfig
from jaxllm.infer import kv_cache, linear_state, seq2seq
from jaxllm.infer.linear_state import num_full_layers
from jaxllm.infer.reference import greedy_continue  # noqa: F401  (its home before)
from jaxllm.infer.sampling import sample, split_key
from jaxllm.infer.vision import vision_inputs
from jaxllm.kernels.decode_attention.ops import on_hopper


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static shape of one generate call (a new one compiles a new program)."""

    kind: str
    group: int
    max_len: int  # tokens per sequence (contiguous) or page size (paged)
    num_pages: int | None
    max_new: int
    temperature: float
    top_k: int
    top_p: float
    impl: str
    interpret: bool


@dataclasses.dataclass
class Generation:
    """Result of `generate`: new token ids per prompt (stop token excluded) and cache facts."""

    tokens: list[list[int]]
    stopped: list[bool]
    """Whether each sequence ended on a stop token (else it reached max_new_tokens)."""
    cache_bytes_per_token: int
    """Bytes one cached token costs over all layers, scales included."""
    cache_bytes: int
    """Bytes of the whole allocated cache (all layers, residual window and scratch included)."""
    ends: list[list[int]] = dataclasses.field(default_factory=list)
    """The stop token, or stop sequence, each sequence ended with ([] where it did not stop)."""


def resolve_decode_impl(impl: str, cfg=None) -> tuple[str, bool]:
    """(`kernel` | `xla`, interpret): `auto` is the Pallas kernel on TPU and on Hopper GPUs
    (Triton, measured on an H100), XLA elsewhere (other GPUs: opt-in with `kernel`). An MLA model (`cfg`) always decodes with XLA: the kernels read separate keys
    and values."""
    latent = cfg is not None and cfg.mla.enabled
    if impl == "kernel" and latent:
        raise ValueError("decode_impl=kernel: MLA's latent cache decodes with xla (or auto)")
    if impl == "auto":
        kernel_here = jax.default_backend() == "tpu" or on_hopper()
        impl = "kernel" if kernel_here and not latent else "xla"
    return impl, impl == "kernel" and jax.default_backend() == "cpu"


def _linear_state(cfg, batch: int):
    """The linear-attention layers' zero state, placed as `linear_state.logical_axes` says
    (None without linear layers)."""
    s = linear_state.init_linear_state(cfg, batch)
    if s is None:
        return None
    return jax.tree.map(sharding.constrain, s, linear_state.logical_axes(s), is_leaf=_is_axes)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _constrain_cache(kv):
    axes = kv_cache.logical_axes(kv)
    return jax.tree.map(
        lambda x, ax: sharding.constrain(x, ax) if ax is not None else x,
        kv,
        axes,
        is_leaf=lambda x: x is None,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "on_token", "grids"))
def _generate(
    graphdef,
    state,
    prompt_BxL,
    lengths_B,
    block_table,
    stop_S,
    stop_SxM,
    rng,
    plan,
    on_token,
    vision=None,
    grids=None,
):
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    b = prompt_BxL.shape[0]
    g, k, value_dim = kv_cache.cache_dims(cfg)
    kv = kv_cache.init_cache(
        num_layers=num_full_layers(cfg),
        batch=b,
        num_kv_heads=g,
        head_dim=k,
        max_len=plan.max_len,
        kind=plan.kind,
        group=plan.group,
        compute_dtype=jnp.dtype(cfg.dtype),
        block_table=block_table,
        num_pages=plan.num_pages,
        value_dim=value_dim,
    )
    kv = _constrain_cache(kv)
    view = kv_cache.CacheView(
        kv,
        lengths_B,
        jnp.int32(0),
        prefill=True,
        impl=plan.impl,
        interpret=plan.interpret,
        linear=_linear_state(cfg, b),
    )
    images, delta_B = {}, jnp.zeros_like(lengths_B)  # vision: pixels, [3,B,L] positions, deltas
    if vision is not None:
        images = dict(pixel_values=vision[0], image_grid_thw=grids, positions_BxL=vision[1])
        delta_B = vision[2]
    at_BxQ = (lengths_B - 1)[:, None]
    logits_Bx1xV, view, *_ = model(prompt_BxL, cache=view, logits_at_BxQ=at_BxQ, **images)
    pick = functools.partial(
        sample, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p
    )
    rng, sub = split_key(rng)
    tok_B = pick(logits_Bx1xV[:, 0], sub)
    out_BxN = jnp.zeros((b, plan.max_new), jnp.int32)
    done_B = jnp.zeros((b,), bool)
    # the last M tokens of each sequence, to compare with the stop sequences (right-aligned in
    # stop_SxM, -1 before a shorter one: no token matches -1, and -1 in a sequence matches all)
    tail_BxM = jnp.full((b, stop_SxM.shape[1]), -1, jnp.int32)

    def cond(carry):
        i, _, _, done_B, _, _, _, _ = carry
        return (i < plan.max_new) & ~jnp.all(done_B)

    def body(carry):
        i, tok_B, lengths_B, done_B, out_BxN, tail_BxM, (kv, linear), rng = carry
        out_BxN = out_BxN.at[:, i].set(jnp.where(done_B, 0, tok_B))
        if on_token is not None:
            jax.debug.callback(on_token, i, tok_B, done_B, ordered=True)
        tail_BxM = jnp.concatenate([tail_BxM[:, 1:], tok_B[:, None]], axis=1)
        same_BxSxM = (tail_BxM[:, None, :] == stop_SxM[None]) | (stop_SxM[None] < 0)
        done_B = done_B | jnp.isin(tok_B, stop_S) | jnp.any(jnp.all(same_BxSxM, -1), -1)
        lengths_B = lengths_B + 1
        view = kv_cache.CacheView(
            kv,
            lengths_B,
            jnp.int32(0),
            prefill=False,
            impl=plan.impl,
            interpret=plan.interpret,
            linear=linear,
        )
        logits_Bx1xV, view, *_ = model(
            tok_B[:, None], positions_BxL=(lengths_B - 1 + delta_B)[:, None], cache=view
        )
        rng, sub = split_key(rng)
        tok_B = pick(logits_Bx1xV[:, 0], sub)
        return i + 1, tok_B, lengths_B, done_B, out_BxN, tail_BxM, (view.kv, view.linear), rng

    caches = (view.kv, view.linear)
    carry = (jnp.int32(0), tok_B, lengths_B, done_B, out_BxN, tail_BxM, caches, rng)
    _, _, _, done_B, out_BxN, _, _, _ = jax.lax.while_loop(cond, body, carry)
    return out_BxN, done_B


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    gen: GenerateConfig = GenerateConfig(),
    *,
    stop_tokens: Sequence[int] = (),
    stop_sequences: Sequence[Sequence[int]] = (),
    mesh=None,
    on_token: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
    seeds: Sequence[int] | None = None,
    images: Sequence | None = None,
) -> Generation:
    """Continues each prompt (a list of token ids) by up to `gen.max_new_tokens` tokens.

    Sampling follows `gen` (temperature 0 is greedy; the rng comes from `gen.seed`); a sequence
    stops at any of `stop_tokens` + `gen.stop_tokens`, or once its last tokens are one of
    `stop_sequences` (each left out of the returned tokens, as a stop token is). With `mesh`, the batch is split over its
    data axes and kv heads over `tensor` (the model's parameters should already live on it, e.g.
    `jaxllm.load_model(path, mesh=mesh)`). `on_token(step, tokens_B, done_B)` is called on the
    host after each step, in order (for streaming). `seeds` (one per prompt, in place of
    `gen.seed`) give each row its own key: its draws are then the same in any batch, at any
    place in it. `images` (one `jaxllm.data.images.Pixels` or None per prompt, for a model with
    `model.vision`): the images of each prompt, whose pad tokens it holds expanded
    (`jaxllm.infer.vision.prompt_example`); they run in the prefill with M-RoPE positions.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    cfg = model.cfg
    if cfg.kind == "encoder":
        raise ConfigError(
            "generate continues text causally; an encoder (model.kind=encoder) fills in "
            "masked tokens instead."
        )
    soft_prompt = getattr(model, "soft_prompt", None)
    if soft_prompt is not None and images is not None:
        raise ValueError("a soft prompt (peft.method=prompt) cannot take images")
    if soft_prompt is not None:  # its virtual tokens go first (peft.method=prompt)
        prompts = [list(range(-1, -soft_prompt.shape[0] - 1, -1)) + list(p) for p in prompts]
    n_real = len(prompts)
    dp = 1
    if mesh is not None:
        dp = int(np.prod([mesh.shape[a] for a in sharding.RULES["batch"]]))
    b = -(-n_real // dp) * dp  # pad the batch with 1-token prompts to split evenly
    prompts = [list(p) for p in prompts] + [[0]] * (b - n_real)
    lengths = np.array([len(p) for p in prompts], np.int32)
    seq2seq_model = cfg.kind == "encoder_decoder"  # the prompt is the encoder's input
    longest = max(int(lengths.max()), gen.max_new_tokens)
    if (longest if seq2seq_model else int(lengths.max()) + gen.max_new_tokens) > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({int(lengths.max())} tokens) + max_new_tokens ({gen.max_new_tokens}) "
            f"exceeds the model's max_seq_len ({cfg.max_seq_len})"
        )
    prompt_len = -(-int(lengths.max()) // 8) * 8  # fewer distinct shapes to compile
    prompt_BxL = np.zeros((b, prompt_len), np.int32)
    for i, p in enumerate(prompts):
        prompt_BxL[i, : len(p)] = p
    need_B = lengths + gen.max_new_tokens
    kind, group = gen.kv_cache_dtype, gen.kv_group
    g, k, _ = kv_cache.cache_dims(cfg)
    nl = linear_state.num_full_layers(cfg)
    if gen.kv_page_size and seq2seq_model:
        raise ValueError("an encoder-decoder decodes with a contiguous cache: kv_page_size=0")
    if gen.kv_page_size:
        table, num_pages = kv_cache.allocate_pages(need_B, gen.kv_page_size)
        max_len, block_table = gen.kv_page_size, jnp.asarray(table)
        cache_tokens = num_pages * gen.kv_page_size
    else:
        max_len = kv_cache.cache_length(max(int(need_B.max()), prompt_len), kind, group)
        num_pages, block_table, cache_tokens = None, None, b * max_len
    impl, interpret = resolve_decode_impl(gen.decode_impl, model.cfg)
    plan = _Plan(
        kind,
        group,
        max_len,
        num_pages,
        gen.max_new_tokens,
        float(gen.temperature),
        gen.top_k,
        float(gen.top_p),
        impl,
        interpret,
    )
    stop_S = jnp.asarray(sorted({*stop_tokens, *gen.stop_tokens}) or [-1], jnp.int32)
    seqs = sorted({tuple(int(t) for t in q) for q in stop_sequences if len(q)})
    stop_SxM = np.full((len(seqs), max(map(len, seqs), default=1)), -1, np.int32)
    for row, q in zip(stop_SxM, seqs):
        row[len(row) - len(q) :] = q
    if seeds is None:
        rng = jax.random.key(gen.seed)
    else:
        if len(seeds) != n_real:
            raise ValueError(f"generate got {len(seeds)} seeds for {n_real} prompts")
        seeds_B = np.zeros(b, np.uint32)
        seeds_B[:n_real] = seeds
        rng = jax.vmap(jax.random.key)(jnp.asarray(seeds_B))
    vision, grids = vision_inputs(cfg, prompt_BxL, lengths, images or ())
    graphdef, state = nnx.split(model)
    if seq2seq_model:
        nl = cfg.resolved_decoder_layers
        cache_tokens = b * seq2seq.cache_tokens(prompt_len, plan)
        with sharding.active(sharding.Parallel(mesh)):
            out_BxN, done_B = seq2seq.generate_core(
                graphdef,
                state,
                jnp.asarray(prompt_BxL),
                jnp.asarray(lengths),
                stop_S,
                jnp.asarray(stop_SxM),
                rng,
                plan,
                on_token,
            )
    else:
        with sharding.active(sharding.Parallel(mesh)):
            out_BxN, done_B = _generate(
                graphdef,
                state,
                jnp.asarray(prompt_BxL),
                jnp.asarray(lengths),
                block_table,
                stop_S,
                jnp.asarray(stop_SxM),
                rng,
                plan,
                on_token,
                None if vision is None else tuple(map(jnp.asarray, vision)),
                grids,
            )
    out_BxN, done_B = np.asarray(out_BxN), np.asarray(done_B)
    stops = set(np.asarray(stop_S).tolist())
    tokens, stopped, ends = [], [], []
    for row in out_BxN[:n_real].tolist():
        cut = _first_stop(row, stops, seqs)
        tokens.append(row[: len(row) if cut is None else cut])
        stopped.append(cut is not None)
        ends.append([] if cut is None else _stop_at(row, cut, stops, seqs))
    per_token = kv_cache.model_bytes_per_token(cfg, kind, group)
    residual = 2 * nl * b * g * group * k * jnp.dtype(cfg.dtype).itemsize
    residual = residual if kind in kv_cache.KIVI_KINDS else 0
    fixed = linear_state.state_bytes(cfg, b) if cfg.layer_pattern else 0
    cache_bytes = per_token * cache_tokens + residual + fixed
    return Generation(tokens, stopped, per_token, cache_bytes, ends)


def _first_stop(row: list[int], stops: set[int], seqs: list[tuple[int, ...]]) -> int | None:
    """Where `row` is cut: before its first stop token or first complete stop sequence."""
    for i, t in enumerate(row):
        if t in stops:
            return i
        for q in seqs:
            if i + 1 >= len(q) and tuple(row[i + 1 - len(q) : i + 1]) == q:
                return i + 1 - len(q)
    return None


def _stop_at(row: list[int], cut: int, stops: set[int], seqs: list[tuple[int, ...]]) -> list[int]:
    """The stop token or sequence `row` is cut at `cut` by (`_first_stop`)."""
    if row[cut] in stops:
        return [row[cut]]
    return next(list(q) for q in seqs if tuple(row[cut : cut + len(q)]) == q)


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "prefix"))
def _score(graphdef, state, tokens_BxT, plan, prefix):
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    b, t = tokens_BxT.shape
    g, k, value_dim = kv_cache.cache_dims(cfg)
    kv = kv_cache.init_cache(
        num_layers=num_full_layers(cfg),
        batch=b,
        num_kv_heads=g,
        head_dim=k,
        max_len=plan.max_len,
        kind=plan.kind,
        group=plan.group,
        compute_dtype=jnp.dtype(cfg.dtype),
        value_dim=value_dim,
    )
    lengths_B = jnp.full((b,), prefix, jnp.int32)
    view = kv_cache.CacheView(
        kv,
        lengths_B,
        jnp.int32(0),
        prefill=True,
        impl=plan.impl,
        interpret=plan.interpret,
        linear=_linear_state(cfg, b),
    )
    logits_Bx1xV, view, *_ = model(
        tokens_BxT[:, :prefix], cache=view, logits_at_BxQ=(lengths_B - 1)[:, None]
    )

    def step(caches, pos):
        view = kv_cache.CacheView(
            caches[0],
            jnp.full((b,), pos + 1, jnp.int32),
            jnp.int32(0),
            prefill=False,
            impl=plan.impl,
            interpret=plan.interpret,
            linear=caches[1],
        )
        logits_Bx1xV, view, *_ = model(
            tokens_BxT[:, pos][:, None], positions_BxL=jnp.full((b, 1), pos, jnp.int32), cache=view
        )
        return (view.kv, view.linear), logits_Bx1xV[:, 0]

    _, logits_NxBxV = jax.lax.scan(step, (view.kv, view.linear), jnp.arange(prefix, t - 1))
    logits_BxNxV = jnp.concatenate([logits_Bx1xV, logits_NxBxV.transpose(1, 0, 2)], axis=1)
    logp_BxNxV = jax.nn.log_softmax(logits_BxNxV.astype(jnp.float32), axis=-1)
    targets_BxN = tokens_BxT[:, prefix:]
    nll_BxN = -jnp.take_along_axis(logp_BxNxV, targets_BxN[..., None], axis=-1)[..., 0]
    return nll_BxN, jnp.argmax(logits_BxNxV, axis=-1)


def score_with_cache(model, tokens_BxT, gen: GenerateConfig = GenerateConfig(), prefix: int = 1):
    """Teacher-forced scoring through the cache: prefill `prefix` tokens, then feed the rest one
    decode step at a time. Returns (nll [B, T - prefix] of each next token, argmax predictions
    [B, T - prefix]), so caches of different dtypes can be compared on perplexity and on greedy
    agreement over the same text."""
    tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
    t = tokens_BxT.shape[1]
    impl, interpret = resolve_decode_impl(gen.decode_impl, model.cfg)
    plan = _Plan(
        gen.kv_cache_dtype,
        gen.kv_group,
        kv_cache.cache_length(t, gen.kv_cache_dtype, gen.kv_group),
        None,
        0,
        0.0,
        0,
        1.0,
        impl,
        interpret,
    )
    graphdef, state = nnx.split(model)
    nll, pred = _score(graphdef, state, tokens_BxT, plan, prefix)
    return np.asarray(nll), np.asarray(pred)

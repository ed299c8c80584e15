"""Decode attention over a KV cache: the Pallas kernels (interpret mode on CPU) vs the pure-JAX
reference, sliding windows and ALiBi, argument checks. Quantizers are in
`test_decode_attention_quant.py`, block schedules and lowering for TPU (Mosaic) and CUDA (Triton)
in `test_decode_attention_lowering.py`.

Every kernel case runs a ragged batch: a length-0 padding row, lengths that are not multiples
of the kv block or the int4 / int2 group, and a full row. Cache contents past each sequence's end
(and pages no sequence owns) are poisoned with NaN, so any read of stale data that reached the
output would show.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.kernels.decode_attention import (
    KVCache,
    decode_attention,
    decode_attention_reference,
    quantize_cache,
)

GROUP = 32
LENGTHS = (0, 37, 100, 128)  # T = 128, block 32, group 32
f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731


# ------------------------------------------------------------------------- cache builders


def _kv(b, g, t, d, seed):
    kk, kv = jax.random.split(jax.random.key(seed))
    k = jax.random.normal(kk, (b, g, t, d), jnp.float32)
    outlier_1x1x1xK = (jnp.arange(d) % 7 == 0)[None, None, None, :]
    k = k * (1.0 + 3.0 * outlier_1x1x1xK)  # a few outlier channels, as real keys have
    return k, jax.random.normal(kv, (b, g, t, d), jnp.float32)


def _poison(cache: KVCache, lengths):
    """NaN into everything at or past each sequence's end that the kernel must not use: float
    rows, int8 scales, int4 / int2 scales of groups not yet full (their codes are left as they
    are)."""
    n = jnp.asarray(lengths)[:, None, None]
    t = cache.k.shape[2]
    pos = jnp.arange(t)[None, None, :]
    if cache.kind in ("float32", "bfloat16"):
        dead = (pos >= n)[..., None]
        return KVCache(
            kind=cache.kind,
            k=jnp.where(dead, jnp.nan, cache.k).astype(cache.k.dtype),
            v=jnp.where(dead, jnp.nan, cache.v).astype(cache.v.dtype),
        )
    nan = lambda x, dead: jnp.where(dead, jnp.nan, x).astype(x.dtype)  # noqa: E731
    if cache.kind == "int8":
        dead = pos >= n
        return KVCache(
            kind="int8",
            k=cache.k,
            v=cache.v,
            k_scale=nan(cache.k_scale, dead),
            v_scale=nan(cache.v_scale, dead),
        )
    full = (n // GROUP) * GROUP
    dead_group = (jnp.arange(t // GROUP)[None, None, :] * GROUP >= full)[..., None]
    dead_row = (pos >= full)[..., None]
    return KVCache(
        kind=cache.kind,
        group=GROUP,
        k=cache.k,
        v=cache.v,
        k_scale=nan(cache.k_scale, dead_group),
        k_zero=nan(cache.k_zero, dead_group),
        v_scale=nan(cache.v_scale, dead_row),
        v_zero=nan(cache.v_zero, dead_row),
        k_res=cache.k_res,
        v_res=cache.v_res,
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 4))  # eager ops would each compile
def _cache(kind, g, d, seed, res_dtype, t=128):
    k, v = _kv(len(LENGTHS), g, t, d, seed)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    cache = quantize_cache(k, v, kind, group=GROUP, lengths_B=lengths, residual_dtype=res_dtype)
    return _poison(cache, lengths)


_reference = jax.jit(decode_attention_reference, static_argnames=("sm_scale", "soft_cap"))


PER_TOKEN = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _paginate(cache: KVCache, page_size: int, num_pages: int, seed: int) -> KVCache:
    """The same tokens in pages scattered by a random permutation; pages no sequence owns and
    block-table entries past each sequence's last page are garbage (NaN / -1)."""
    b, _, t = cache.k.shape[:3]
    per_seq = t // page_size
    perm = np.random.default_rng(seed).permutation(num_pages)[: b * per_seq]
    table = perm.reshape(b, per_seq).copy()
    first_unused = -(-np.asarray(LENGTHS) // page_size)
    table[np.arange(per_seq)[None, :] >= first_unused[:, None]] = -1
    fields = {}
    for name in PER_TOKEN:
        x = getattr(cache, name)
        if x is None:
            continue
        rows = x.shape[2] * page_size // t  # page rows of this array (key scales: / group)
        pages = x.reshape(b, x.shape[1], per_seq, rows, *x.shape[3:]).swapaxes(1, 2)
        pages = pages.reshape(b * per_seq, *pages.shape[2:])
        fill = 0 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.nan
        store = jnp.full((num_pages, *pages.shape[1:]), fill, x.dtype)
        fields[name] = store.at[perm].set(pages)
    table = jnp.asarray(table, jnp.int32)
    return KVCache(
        kind=cache.kind,
        group=cache.group,
        k_res=cache.k_res,
        v_res=cache.v_res,
        block_table=table,
        **fields,
    )


def _stack_layers(caches):
    """Per-layer caches -> one cache with a leading layer axis (the block table is shared)."""
    table = caches[0].block_table
    bare = [KVCache(**{**c.__dict__, "block_table": None}) for c in caches]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *bare)
    return KVCache(**{**stacked.__dict__, "block_table": table})


# ---------------------------------------------------------------------------- kernel cases

# Max abs error vs the float32 reference on the same cache. float32 queries: the kernels
# dequantize with the reference's formula in float32, only summation order differs. bfloat16
# queries: dequantized keys / values, p and the output are rounded to bfloat16.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}

# (id, kind, backend, G, R, Q, layers, paged, q dtype); backend None = Mosaic TPU interpreted.
CASES = [
    ("f32-mha-q1", "float32", None, 4, 1, 1, None, False, jnp.float32),
    ("f32-gqa2-q4-paged-layer", "float32", None, 2, 2, 4, 2, True, jnp.float32),
    ("f32-triton-mqa-q4-paged", "float32", "triton", 1, 4, 4, None, True, jnp.float32),
    ("bf16-gqa4-q1-layer", "bfloat16", None, 2, 4, 1, 2, False, jnp.bfloat16),
    ("bf16-mqa-q4-paged", "bfloat16", None, 1, 4, 4, None, True, jnp.float32),
    ("bf16-triton-gqa2-q1-layer", "bfloat16", "triton", 2, 2, 1, 2, False, jnp.bfloat16),
    ("int8-mha-q4", "int8", None, 2, 1, 4, None, False, jnp.float32),
    ("int8-gqa4-q1-paged-layer", "int8", None, 2, 4, 1, 2, True, jnp.bfloat16),
    ("int8-triton-gqa2-q4-paged-layer", "int8", "triton", 2, 2, 4, 2, True, jnp.float32),
    ("int4-gqa2-q1", "int4", None, 2, 2, 1, None, False, jnp.float32),
    ("int4-mqa-q4-paged-layer", "int4", None, 1, 4, 4, 2, True, jnp.float32),
    ("int4-mha-q4-paged-bf16", "int4", None, 2, 1, 4, None, True, jnp.bfloat16),
    ("int4-triton-gqa4-q4-paged-layer", "int4", "triton", 2, 4, 4, 2, True, jnp.float32),
    ("int4-triton-mha-q1", "int4", "triton", 2, 1, 1, None, False, jnp.bfloat16),
    ("int2-gqa2-q4-paged-layer", "int2", None, 2, 2, 4, 2, True, jnp.float32),
    ("int2-mha-q1-bf16", "int2", None, 2, 1, 1, None, False, jnp.bfloat16),
    ("int2-triton-gqa2-q4-paged-layer", "int2", "triton", 2, 2, 4, 2, True, jnp.float32),
    ("int2-triton-mqa-q1", "int2", "triton", 1, 4, 1, None, False, jnp.bfloat16),
]


def _build(kind, g, layers, paged, dtype, d=64, seed=0):
    """(cache, layer): poisoned, optionally paged (page 64, 11 pages for 8 needed) and stacked
    over `layers` (the op reads the last layer, whose data differ from the others)."""
    caches = []
    for i in range(layers or 1):
        c = _cache(kind, g, d, seed + 17 * i, dtype)
        caches.append(_paginate(c, 64, 11, seed) if paged else c)  # one table for all layers
    if layers is None:
        return caches[0], None
    return _stack_layers(caches), jnp.int32(layers - 1)


@pytest.mark.parametrize(
    "kind,backend,g,r,nq,layers,paged,dtype", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_kernel_matches_reference(kind, backend, g, r, nq, layers, paged, dtype):
    cache, layer = _build(kind, g, layers, paged, dtype)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jax.random.normal(jax.random.key(7), (len(LENGTHS), nq, g * r, 64), jnp.float32)
    q = q.astype(dtype)

    @jax.jit
    def run(q, cache, lengths, layer):  # layer traced: the kernel picks it in its index maps
        return decode_attention(
            q,
            cache,
            lengths,
            layer=layer,
            block_kv=32,
            num_splits=2,
            interpret=True,
            backend=backend,
        )

    out = run(q, cache, lengths, layer)
    ref = _reference(q.astype(jnp.float32), cache, lengths, layer=layer)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(f32(out)))
    np.testing.assert_array_equal(f32(out)[0], 0.0)  # length-0 row
    np.testing.assert_allclose(f32(out), f32(ref), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("backend", [None, "triton"])
def test_paged_and_contiguous_give_identical_outputs(backend):
    """Same tokens, same block size and splits: the kernel must visit the same blocks in the
    same order whichever way the pages are laid out."""
    contiguous = _cache("int4", 2, 64, 3, jnp.float32)
    paged = _paginate(contiguous, 64, 13, seed=5)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jax.random.normal(jax.random.key(8), (len(LENGTHS), 2, 4, 64), jnp.float32)
    kw = dict(block_kv=32, num_splits=2, interpret=True, backend=backend, soft_cap=5.0)
    out_c = decode_attention(q, contiguous, lengths, **kw)
    out_p = decode_attention(q, paged, lengths, **kw)
    np.testing.assert_array_equal(f32(out_p), f32(out_c))


@pytest.mark.parametrize("kind,tol", [("int8", 0.03), ("int4", 0.2)])
def test_quantized_reference_close_to_unquantized(kind, tol):
    """Quantizer sanity: attention over the int8 / int4 cache stays close to attention over
    the exact keys and values (relative L2 error of the outputs; measured 0.016 and 0.13 on
    keys with outlier channels; a swapped nibble or a wrong scale axis gives O(1))."""
    k, v = _kv(4, 2, 128, 64, seed=11)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jax.random.normal(jax.random.key(9), (4, 2, 8, 64), jnp.float32)
    quantize = jax.jit(quantize_cache, static_argnames=("kind", "residual_dtype"))
    exact = _reference(q, quantize(k, v, "float32"), lengths)
    approx = _reference(
        q, quantize(k, v, kind, lengths_B=lengths, residual_dtype=jnp.float32), lengths
    )
    err = np.linalg.norm(f32(approx) - f32(exact)) / np.linalg.norm(f32(exact))
    assert 0 < err < tol


def test_xla_backend_is_the_reference():
    cache = _cache("int8", 2, 64, 4, jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jax.random.normal(jax.random.key(1), (4, 1, 4, 64), jnp.float32)
    out = jax.jit(decode_attention)(q, cache, lengths)  # CPU, no interpret: xla
    np.testing.assert_array_equal(f32(out), f32(_reference(q, cache, lengths)))


@pytest.mark.parametrize("nq", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_sliding_window_and_alibi(nq):
    """Windowed attention sees only the last w positions and ALiBi subtracts slope * distance
    (checked against dense float64 math). A traced window runs the reference when w > 0 and the
    kernel when w = 0 (a Gemma-style global layer), inside one jitted function."""
    b, g, h, d, t, w = 2, 2, 4, 16, 64, 5
    k, v = _kv(b, g, t, d, seed=3)
    lengths = jnp.asarray([9, 40], jnp.int32)
    cache = quantize_cache(k, v, "float32", lengths_B=lengths)
    q = jax.random.normal(jax.random.key(4), (b, nq, h, d), jnp.float32)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)

    def dense(window, alibi):
        out = np.zeros((b, nq, h, d))
        for i in range(b):
            for j in range(nq):
                pos = int(lengths[i]) - nq + j
                keys = np.arange(t)
                seen = (keys <= pos) & ((keys > pos - window) if window else True)
                for hh in range(h):
                    kk, vv = np.asarray(k[i, hh // 2], np.float64), np.asarray(v[i, hh // 2])
                    s = kk @ np.asarray(q[i, j, hh], np.float64) / np.sqrt(d)
                    if alibi:
                        s = s - float(slopes[hh]) * (pos - keys)
                    s = np.where(seen, s, -np.inf)
                    p = np.exp(s - s.max())
                    out[i, j, hh] = (p / p.sum()) @ vv
        return out

    ref = functools.partial(decode_attention_reference, q, cache, lengths)
    np.testing.assert_allclose(ref(sliding_window=w), dense(w, False), atol=1e-5)
    np.testing.assert_allclose(ref(alibi_slopes_H=slopes), dense(0, True), atol=1e-5)
    op = jax.jit(
        lambda window: decode_attention(q, cache, lengths, sliding_window=window, interpret=True)
    )
    np.testing.assert_allclose(op(jnp.int32(w)), dense(w, False), atol=1e-5)
    np.testing.assert_allclose(op(jnp.int32(0)), dense(0, False), atol=1e-5)
    got = decode_attention(q, cache, lengths, alibi_slopes_H=slopes, interpret=True)
    np.testing.assert_allclose(got, dense(0, True), atol=1e-5)


def test_rejects_bad_arguments():
    cache = _cache("int4", 2, 64, 0, jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jnp.zeros((4, 1, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="layer"):
        decode_attention(q, cache, lengths, layer=0, interpret=True)
    with pytest.raises(ValueError, match="multiple of group"):
        decode_attention(q, cache, lengths, block_kv=48, interpret=True)
    with pytest.raises(ValueError, match="backend"):
        decode_attention(q, cache, lengths, backend="cuda")
    with pytest.raises(ValueError, match="does not match"):
        decode_attention(jnp.zeros((4, 1, 3, 64)), cache, lengths, interpret=True)
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention(q, KVCache(**{**cache.__dict__, "k_scale": None}), lengths)

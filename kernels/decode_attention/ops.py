"""`decode_attention`: attention of a few new queries over a (quantized, paged) KV cache.

q [B, Q, H, K] (Q new tokens per sequence: 1 for plain decoding, a few for speculative
decoding), cache a `KVCache` (layouts in `quant.py`), lengths int32 [B] counting the valid
tokens *including* the Q new ones, already written to the cache. Query i of sequence b sits at
position lengths[b] - Q + i and sees tokens 0 .. lengths[b] - Q + i. GQA: query head h reads kv
head h // (H / G). Rows of length 0 (batch padding) return zeros. Inference only (no VJP).

Backends (`backend=`):
- `"mosaic_tpu"`: the Pallas Mosaic TPU kernel (`mosaic_tpu.py`: scalar-prefetched lengths /
  block table / layer, one kv block of all kv heads per grid step); the default on TPU, and with
  `interpret=True` anywhere. Blocks must tile the arrays (`_tpu_block_ok`): int8 a multiple of
  128 rows, int4 / int2 of 16 * group, or the whole page / cache length. A paged block never
  spans pages, so pages smaller than the default block mean more, smaller grid steps.
- `"mosaic_gpu"`: the Mosaic GPU kernel for Hopper (`mosaic_gpu.py`: TMA, two-slot pipeline,
  wgmma), only when asked for: on an H100 it runs at about half of Triton's speed on bf16
  caches and a third to a fifth on int8 / int4 (docs/benchmarks.md). It takes
  (`mosaic_gpu_supported`: bf16 / int8 caches with head dim 64 or 128, int4 with 128, at most 64
  query rows R * Q per kv head, blocks of a multiple of 64 rows dividing the cache length or
  page size; int2 caches run on Triton or Mosaic TPU, not here).
- `"triton"`: the Pallas Triton kernel for CUDA GPUs (`triton.py`); the default on CUDA GPUs,
  the fastest measured on an H100 (JAX deprecates Pallas-on-Triton, so the Mosaic GPU kernel
  stays beside it). Needs a power-of-2 head dim >= 32 and a power-of-2 block (>= 16) dividing
  the cache length or page size, and for int4 / int2 a group >= 16 and K / (codes a byte) >= 16
  (its dots run on the token groups and the channel parts; `triton_supported`).
- `"xla"`: `decode_attention_reference` (dequantizes the whole cache); the default for calls the
  Triton kernel does not take on a GPU, and on CPU without `interpret`. On a GPU, falling back to it without being asked warns once per
  process (`JaxllmWarning`).
A backend's module (and its Pallas lowering) is imported the first time a call uses it; what
the kernels share is in `common.py`.

Sliding windows and ALiBi are not in the kernels: a call with `alibi_slopes_H`, or with a
`sliding_window` that is a Python int, runs the reference whatever the backend; a traced window
(a model whose scanned layers alternate between windowed and global, Gemma style) picks at run
time with `lax.cond`: the reference for windowed layers (w > 0), the kernel for global ones.
Windowed layers attend to at most w tokens, so the reference's cost there is bounded by the
window, not by the context; the kernel keeps the long global layers.

Split-K (flash-decoding): the kernel returns a partial (out, lse) per split of the cache length;
for int4 / int2 the residual tokens (at most `group`, full precision) are attended here in XLA
as one more partial; all partials merge exactly by logsumexp.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxllm.kernels.decode_attention.common import ARRAY_NAMES, BACKENDS, Config
from jaxllm.kernels.decode_attention.quant import KIVI_BITS, KVCache, cache_geometry, codes_per_byte
from jaxllm.kernels.decode_attention.reference import (
    attend_partial,
    decode_attention_reference,
    queries_from_rows,
    rows_from_queries,
    sink_rows,
    visible_BxMxT,
)
from jaxllm.kernels.flash_attention.common import mosaic_gpu_runs_on
from jaxllm.kernels.reference import check_floating

from jaxllm.config.errors import JaxllmWarning

# Default kv rows per kernel block. TPU (all G heads per grid step): ~256-512 KiB of codes per
# step at G = 8, K = 128 amortizes the per-step overhead; int8 needs a multiple of 128 (its
# scales are [G, T], T on lanes) and int4 / int2 of 16 * group (its key scales [T / group, K] must
# make whole bf16 (16, 128) tiles). Triton: 64 keeps the dequantized [64, K] tiles in registers.
TPU_BLOCK = {"float32": 128, "bfloat16": 256, "int8": 256}
TRITON_BLOCK = 64
# Mosaic GPU: kv blocks are wgmma row tiles (64 rows), and the M query rows of a kv head are
# padded to one 64-column tile.
MOSAIC_GPU_BLOCK = 64
MOSAIC_GPU_MAX_ROWS = 64
MOSAIC_GPU_HEAD_DIMS = {"bfloat16": (64, 128), "int8": (64, 128), "int4": (128,)}
# Default split length (tokens) and, for GPUs, enough programs to fill the SMs.
TPU_SPLIT_TOKENS = 8192
TRITON_SPLIT_TOKENS = 8192
TRITON_MIN_PROGRAMS = 256


_warned_gpu_fallback = False  # falling back to the reference on a GPU is reported once


def _warn_gpu_fallback(reason: str):
    global _warned_gpu_fallback
    if _warned_gpu_fallback:
        return
    _warned_gpu_fallback = True
    warnings.warn(
        f"decode_attention: no kernel for {reason} on this GPU; falling back to the XLA "
        "reference, which dequantizes the whole cache to float32 on every call. backend='xla' "
        "chooses it without this warning.",
        JaxllmWarning,
        stacklevel=5,
    )


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), where the decode
    kernel path was measured."""
    return jax.default_backend() == "gpu" and mosaic_gpu_runs_on(jax.devices()[0])


def mosaic_gpu_supported(
    kind: str, head_dim: int, num_rows: int, rows: int | None, group: int, latent: bool = False
) -> str | None:
    """Why the Mosaic GPU kernel cannot run a call (num_rows = R * Q query rows per kv head,
    rows = the cache length or page size, None: not checked here), or None when it can."""
    if latent:
        return "a latent (MLA) cache"
    dims = MOSAIC_GPU_HEAD_DIMS.get(kind)
    if dims is None:
        return f"{kind} caches (supported: {', '.join(MOSAIC_GPU_HEAD_DIMS)})"
    if head_dim not in dims:
        return f"{kind} caches with head dim {head_dim} (supported: {dims})"
    if num_rows > MOSAIC_GPU_MAX_ROWS:
        return f"{num_rows} query rows per kv head (R * Q; at most {MOSAIC_GPU_MAX_ROWS})"
    bk = default_block_kv(kind, "mosaic_gpu", group, rows, paged=False)
    if rows is not None and rows % bk:
        return f"a cache length or page size of {rows} (needs a multiple of {bk})"
    return None


def _triton_kivi_dims(kind: str, head_dim: int, group: int) -> str | None:
    """Why the Triton KIVI block math cannot run (its dots need >= 16 on every side), or None."""
    n = codes_per_byte(kind)
    if kind in KIVI_BITS and (group < 16 or head_dim // n < 16):
        return f"{kind} with group {group} and head dim {head_dim} (needs group >= 16 and K >= {16 * n})"
    return None


def triton_supported(kind: str, head_dim: int, rows: int, group: int, latent: bool = False):
    """Why the Triton kernel cannot run a call (rows = the cache length or page size), or None
    when it can."""
    if latent:
        return "a latent (MLA) cache"
    if head_dim < 32 or head_dim & (head_dim - 1):
        return f"head dim {head_dim} (needs a power of 2 >= 32)"
    if reason := _triton_kivi_dims(kind, head_dim, group):
        return reason
    bk = default_block_kv(kind, "triton", group, rows, paged=False)
    if bk < 16 or (kind in KIVI_BITS and bk % group):
        return f"a cache length or page size of {rows} (no power-of-2 block >= 16 divides it)"
    return None


def _resolve_backend(backend: str | None, interpret: bool, triton_reason: str | None) -> str:
    """`backend`, or the default for this platform; `triton_reason` says why the Triton kernel
    cannot run the call (None when it can). On CUDA GPUs the default is Triton: on an H100 it
    reads a bf16 cache at 87-90% of peak HBM bandwidth at 32k-128k tokens, 1.8x the Mosaic GPU
    kernel's speed, and int8 / int4 caches 3-5x faster (docs/benchmarks.md)."""
    if backend is None:
        platform = jax.default_backend()
        if platform == "tpu" or interpret:
            backend = "mosaic_tpu"
        elif platform == "gpu":
            backend = "xla" if triton_reason else "triton"
            if triton_reason:
                _warn_gpu_fallback(triton_reason)
        else:
            backend = "xla"
    names = (*BACKENDS, "xla")
    if backend not in names:
        raise ValueError(f"unknown backend {backend!r}; expected one of {names}")
    return backend


def _kernel_forward(q_parts, arrays, lengths, block_table, layer, cfg: Config):
    """(outs, lse) of the backend `cfg.backend` (`common.py` has the layouts). The import is
    deferred to here: a backend's module pulls in its Pallas lowering (Mosaic TPU, Mosaic GPU,
    Triton), which a process that never runs that backend does not load. Mosaic GPU returns
    ROWS >= M query rows; the caller slices them to M."""
    if cfg.backend == "mosaic_tpu":
        from jaxllm.kernels.decode_attention import mosaic_tpu as backend
    elif cfg.backend == "mosaic_gpu":
        from jaxllm.kernels.decode_attention import mosaic_gpu as backend
    else:
        from jaxllm.kernels.decode_attention import triton as backend
    *outs, lse = backend.forward(q_parts, arrays, lengths, block_table, layer, cfg)
    return outs, lse


def _tpu_block_ok(bk: int, rows: int, kind: str, group: int) -> bool:
    """Whether bk rows of every array of `kind` make whole Mosaic tiles (or the full dim)."""
    if kind in KIVI_BITS and bk % group:
        return False
    if bk == rows:
        return True
    # Rows of one (8 x 32-bit) tile: f32 8, bf16 16, int8 / uint8 codes 32; int8 scale blocks
    # [G, bk] put bk on lanes (128).
    rows_per_tile = {"float32": 8, "bfloat16": 16, "int8": 128, "int4": 32, "int2": 32}[kind]
    if kind in KIVI_BITS and (bk // group) % 16:  # [bk / group, K] bf16 key scale rows
        return False
    return bk % rows_per_tile == 0


def default_block_kv(kind: str, backend: str, group: int, rows: int, paged: bool) -> int:
    """Block rows for a cache of `rows` tokens per sequence (or per page when paged)."""
    if backend == "mosaic_gpu":
        return max(MOSAIC_GPU_BLOCK, group if kind in KIVI_BITS else 0)
    if backend == "triton":
        want = max(TRITON_BLOCK, group if kind in KIVI_BITS else 0)
        bk = min(want, rows)
        while rows % bk:
            bk //= 2
        return bk
    want = TPU_BLOCK.get(kind, 16 * group)
    if rows <= want:
        return rows
    if not paged:
        return want  # the edge block may be partial
    for bk in range(want, 0, -1):  # the largest block that divides the page and tiles
        if rows % bk == 0 and _tpu_block_ok(bk, rows, kind, group):
            return bk
    raise ValueError(f"no {kind} block_kv <= {want} divides page size {rows} and tiles on TPU")


def _check_block(bk, rows, kind, group, backend, paged, interpret):
    """Divisibility always; Mosaic TPU tiling only when compiling (interpret runs any size);
    Mosaic GPU blocks are wgmma row tiles in the interpreter too."""
    where = f"the page size {rows}" if paged else f"the cache length {rows}"
    if kind in KIVI_BITS and bk % group:
        raise ValueError(f"{kind} block_kv {bk} must be a multiple of group {group}")
    if backend == "triton":
        if rows % bk or bk < 16 or bk & (bk - 1):
            raise ValueError(f"Triton block_kv {bk} must be a power of 2 >= 16 dividing {where}")
    elif backend == "mosaic_gpu":
        if rows % bk or bk % MOSAIC_GPU_BLOCK:
            raise ValueError(
                f"Mosaic GPU block_kv {bk} must be a multiple of {MOSAIC_GPU_BLOCK} dividing {where}"
            )
    elif not interpret and not _tpu_block_ok(bk, rows, kind, group):
        raise ValueError(f"block_kv {bk} does not tile the {kind} cache arrays on TPU ({where})")
    if paged and rows % bk:
        raise ValueError(f"block_kv {bk} must divide {where}")


def default_num_splits(backend: str, seq_len: int, block_kv: int, programs: int) -> int:
    """Splits of the cache length: one per TPU_SPLIT_TOKENS on TPU (a sequential grid, where
    splits only feed the two megacore TensorCores), and on GPUs also enough to give every SM
    about two programs when B * G is small."""
    num_blocks = pl.cdiv(seq_len, block_kv)
    if backend in ("triton", "mosaic_gpu"):
        want = max(pl.cdiv(seq_len, TRITON_SPLIT_TOKENS), pl.cdiv(TRITON_MIN_PROGRAMS, programs))
    else:
        want = pl.cdiv(seq_len, TPU_SPLIT_TOKENS)
    return max(1, min(num_blocks, want))


def merge_partials(out_BxGxSxMxK, lse_BxGxSxMx1):
    """Exact logsumexp merge of per-split softmax results (float32). Empty splits carry
    out 0 and lse MASK_VALUE, so a row with no visible token at all merges to 0."""
    lse_max = jnp.max(lse_BxGxSxMx1, axis=2, keepdims=True)
    w_BxGxSxMx1 = jnp.exp(lse_BxGxSxMx1 - lse_max)
    num = jnp.sum(w_BxGxSxMx1 * out_BxGxSxMxK, axis=2)
    return num / jnp.sum(w_BxGxSxMx1, axis=2)


def _residual_partial(q_BxGxMxK, cache: KVCache, lengths_B, layer, nq, sm_scale, soft_cap):
    """(out, lse) [B, G, 1, M, *] of the KIVI residual: tokens q(n) .. n - 1."""
    k_res, v_res = cache.k_res, cache.v_res
    if layer is not None:
        k_res = lax.dynamic_index_in_dim(k_res, layer, 0, keepdims=False)
        v_res = lax.dynamic_index_in_dim(v_res, layer, 0, keepdims=False)
    start_B = (lengths_B // cache.group) * cache.group
    pos_BxR = start_B[:, None] + jnp.arange(cache.group)[None, :]
    visible = visible_BxMxT(lengths_B, pos_BxR, nq, q_BxGxMxK.shape[2])
    out, lse = attend_partial(
        q_BxGxMxK, k_res, v_res, visible, sm_scale=sm_scale, soft_cap=soft_cap
    )
    return out[:, :, None], lse[:, :, None]


def decode_attention(
    q_BxQxHxK: jax.Array,
    cache: KVCache,
    lengths_B: jax.Array,
    *,
    layer=None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
    backend: str | None = None,
    sliding_window: int | jax.Array | None = None,
    alibi_slopes_H: jax.Array | None = None,
    sinks_H: jax.Array | None = None,
) -> jax.Array:
    """softmax(cap(q k^T * sm_scale) masked causally by position) v over the cache.

    layer: int32 scalar (may be traced) choosing the layer when the cache arrays carry a
    leading L axis; None when they do not. sm_scale defaults to K ** -0.5; soft_cap c maps each
    logit s to c * tanh(s / c). block_kv / num_splits override the per-backend defaults
    (`default_block_kv`, `default_num_splits`). sliding_window w > 0 limits each query to the
    last w positions (itself included; 0 or None: no window); alibi_slopes_H [H] adds
    -slope * distance (see the module docstring for which path runs); sinks_H [H] is a logit
    per query head in the softmax denominator only (gpt-oss; the kernels merge it as one more
    split with value 0). Returns [B, Q, H, K] in q's dtype.
    """
    check_floating(q=q_BxQxHxK)  # the cache holds what its kind says
    reference = functools.partial(
        decode_attention_reference,
        q_BxQxHxK,
        cache,
        lengths_B,
        layer=layer,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        alibi_slopes_H=alibi_slopes_H,
        sinks_H=sinks_H,
    )
    kernel_path = functools.partial(
        _decode_attention,
        q_BxQxHxK,
        cache,
        lengths_B,
        layer=layer,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        block_kv=block_kv,
        num_splits=num_splits,
        interpret=interpret,
        backend=backend,
        sinks_H=sinks_H,
    )
    if alibi_slopes_H is not None or isinstance(sliding_window, int):
        return reference()
    if sliding_window is None:
        return kernel_path()
    return lax.cond(jnp.asarray(sliding_window) > 0, reference, kernel_path)


def _decode_attention(
    q_BxQxHxK,
    cache: KVCache,
    lengths_B,
    *,
    layer,
    sm_scale,
    soft_cap,
    block_kv,
    num_splits,
    interpret,
    backend,
    sinks_H=None,
) -> jax.Array:
    geo = cache_geometry(cache)
    b, nq, h, d = q_BxQxHxK.shape
    g = geo.num_kv_heads
    if (layer is None) != (geo.num_layers is None):
        raise ValueError("pass `layer` exactly when the cache has a leading layer axis")
    if b != geo.batch or d != geo.head_dim or h % g:
        raise ValueError(
            f"q {q_BxQxHxK.shape} does not match the cache (B, G, K) = "
            f"({geo.batch}, {g}, {geo.head_dim})"
        )
    if lengths_B.shape != (b,):
        raise ValueError(f"lengths must be [{b}], got {lengths_B.shape}")
    rows = geo.page_size if cache.paged else geo.seq_len
    m = h // g * nq
    latent = cache.value_dim is not None
    reason = triton_supported(cache.kind, d, rows, cache.group, latent)
    backend = _resolve_backend(backend, interpret, reason)
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    soft_cap = None if soft_cap is None else float(soft_cap)
    lengths_B = lengths_B.astype(jnp.int32)
    if backend == "xla":
        return decode_attention_reference(
            q_BxQxHxK,
            cache,
            lengths_B,
            layer=layer,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sinks_H=sinks_H,
        )
    if cache.value_dim is not None:
        raise ValueError(
            "the decode kernels read separate k and v; a latent (MLA) cache runs on the xla backend"
        )

    if backend == "mosaic_gpu":  # block sizes are checked with the others below
        reason = mosaic_gpu_supported(cache.kind, d, m, None, cache.group)
        if reason is not None:
            raise ValueError(f"mosaic_gpu decode attention does not support {reason}")
    paged = cache.paged
    if block_kv is None:
        block_kv = default_block_kv(cache.kind, backend, cache.group, rows, paged)
    _check_block(block_kv, rows, cache.kind, cache.group, backend, paged, interpret)
    num_blocks = pl.cdiv(geo.seq_len, block_kv)
    if num_splits is None:
        num_splits = default_num_splits(backend, geo.seq_len, block_kv, b * g)
    per_split = pl.cdiv(num_blocks, max(1, min(num_splits, num_blocks)))
    mp = max(16, pl.next_power_of_2(m)) if backend == "triton" else m  # Triton dots: >= 16
    if backend == "triton" and (d & (d - 1) or d < 32):
        raise ValueError(f"Triton needs a power-of-2 head dim >= 32, got {d}")
    if backend == "triton" and (reason := _triton_kivi_dims(cache.kind, d, cache.group)):
        raise ValueError(f"triton decode attention does not support {reason}")
    cfg = Config(
        kind=cache.kind,
        group=cache.group,
        head_dim=d,
        num_kv_heads=g,
        seq_len=geo.seq_len,
        block_kv=block_kv,
        num_splits=pl.cdiv(num_blocks, per_split),
        blocks_per_split=per_split,
        num_queries=nq,
        num_rows=mp,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        page_size=geo.page_size,
        num_pages=geo.num_pages,
        has_layer=layer is not None,
        backend=backend,
        interpret=interpret,
    )

    q_BxGxMxK = rows_from_queries(q_BxQxHxK, g)
    q_rows = jnp.pad(q_BxGxMxK, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
    n = cfg.num_parts  # KIVI: channel j of every n in part j
    q_parts = tuple(q_rows[..., j::n] for j in range(n))
    arrays = [getattr(cache, name) for name in ARRAY_NAMES[cache.kind]]
    block_table = cache.block_table.reshape(-1) if paged else jnp.zeros((1,), jnp.int32)
    layer_1 = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    outs, lse = _kernel_forward(q_parts, arrays, lengths_B, block_table, layer_1, cfg)
    out = jnp.stack(outs, axis=-1).reshape(*outs[0].shape[:-1], d)  # parts -> channel order
    out, lse = out[:, :, :, :m], lse[:, :, :, :m]
    if cache.kind in KIVI_BITS:
        layer_idx = None if layer is None else jnp.asarray(layer, jnp.int32)
        out_r, lse_r = _residual_partial(
            q_BxGxMxK, cache, lengths_B, layer_idx, nq, sm_scale, soft_cap
        )
        out, lse = jnp.concatenate([out, out_r], axis=2), jnp.concatenate([lse, lse_r], axis=2)
    if sinks_H is not None:  # the sink: one more split whose value is 0 and lse the sink
        sinks_1xGx1xMx1 = sink_rows(sinks_H, nq, g)[:, :, None]
        sink_lse = jnp.broadcast_to(sinks_1xGx1xMx1, (*lse.shape[:2], 1, *lse.shape[3:]))
        out = jnp.concatenate([out, jnp.zeros_like(out[:, :, :1])], axis=2)
        lse = jnp.concatenate([lse, sink_lse.astype(lse.dtype)], axis=2)
    out_BxGxMxK = merge_partials(out, lse)
    return queries_from_rows(out_BxGxMxK, nq).astype(q_BxQxHxK.dtype)

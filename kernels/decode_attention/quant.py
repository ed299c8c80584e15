"""KV-cache quantization (int8, KIVI int4 / int2) and `KVCache`, the pytree the decode op reads.

Dimension letters: B batch, T cache length (tokens), G kv heads, K head dim, P pages, N page
size, L layers. Caches are head-major ([.., G, T, K]) so one kv head's tokens are contiguous.

- int8 (symmetric, one scale per (token, kv head)): x ~ code * scale, scale = max|x| / 127.
- int4, KIVI (Liu et al. 2024, arXiv:2402.02750): asymmetric codes 0..15, x ~ code * scale +
  zero with scale = (max - min) / 15 and zero = min. Keys are quantized per channel over groups
  of `group` tokens (key outliers live in a few channels), values per token over groups of
  `group` channels. Two codes share a byte along K: byte i holds channel 2i in its low nibble
  and channel 2i + 1 in its high nibble.
- int2, KIVI-2: the same scheme with codes 0..3 (scale = (max - min) / 3). Four codes share a
  byte: byte i holds channel 4i + j at bits 2j .. 2j + 1 (little-endian, as `model/quantized.py`
  packs int2 weights). The two KIVI kinds differ only in `KIVI_BITS[kind]`.

Scales and zeros are stored in bfloat16 (a float32 scale would cost as much as the int4 codes
of a 16-channel group), and codes are computed against the *rounded* scale, so the stored pair
round-trips to within half a quantization step plus the rounding of `zero`.

Everything here is pure jnp with arbitrary leading dims: the cache writer calls it on new
tokens, the reference on a whole cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

KINDS = ("float32", "bfloat16", "int8", "int4", "int2")
KIVI_BITS = {"int4": 4, "int2": 2}  # the KIVI kinds: bits per code
SCALE_DTYPE = jnp.bfloat16


def codes_per_byte(kind: str) -> int:
    """Codes packed into one uint8 along K: 2 for int4, 4 for int2, 1 for unpacked kinds."""
    return 8 // KIVI_BITS.get(kind, 8)


def _safe_div(x, scale):
    """x / scale, 0 where scale == 0 (an all-zero vector or group quantizes to code 0)."""
    return jnp.where(scale == 0, 0.0, x / jnp.where(scale == 0, 1.0, scale))


# ---------------------------------------------------------------------------------- int8


def quantize_int8(x_XxK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 over the last axis: (codes int8 [..., K], scale bf16 [...])."""
    x = x_XxK.astype(jnp.float32)
    scale_X = (jnp.max(jnp.abs(x), axis=-1) / 127.0).astype(SCALE_DTYPE)
    codes = jnp.round(_safe_div(x, scale_X.astype(jnp.float32)[..., None]))
    return jnp.clip(codes, -127, 127).astype(jnp.int8), scale_X


def dequantize_int8(codes_XxK, scale_X, dtype=jnp.float32) -> jax.Array:
    return (codes_XxK.astype(jnp.float32) * scale_X.astype(jnp.float32)[..., None]).astype(dtype)


# ---------------------------------------------------------------------- KIVI int4 / int2


def pack_codes(codes_XxK: jax.Array, bits: int) -> jax.Array:
    """uint8 codes 0 .. 2^bits - 1 [..., K] -> uint8 [..., K * bits / 8]: channel c at bits
    (c % n) * bits of byte c // n, n = 8 / bits codes a byte (int4: 2i low nibble, 2i+1 high)."""
    n = 8 // bits
    if codes_XxK.shape[-1] % n:
        raise ValueError(
            f"int{bits} packing needs a last dim divisible by {n}, got {codes_XxK.shape}"
        )
    codes = codes_XxK.astype(jnp.uint8)
    packed = codes[..., 0::n]
    for j in range(1, n):
        packed = packed | (codes[..., j::n] << (bits * j))
    return packed


def unpack_codes(packed_XxKn: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_codes`: uint8 [..., K * bits / 8] -> uint8 codes [..., K]."""
    n, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed_XxKn >> (bits * j)) & mask for j in range(n)]
    return jnp.stack(parts, axis=-1).reshape(*packed_XxKn.shape[:-1], -1)


def pack_int4(codes_XxK: jax.Array) -> jax.Array:
    """uint8 codes 0..15 [..., K] -> uint8 [..., K // 2]: channel 2i low nibble, 2i+1 high."""
    return pack_codes(codes_XxK, 4)


def unpack_int4(packed_XxK2: jax.Array) -> jax.Array:
    """Inverse of `pack_int4`: uint8 [..., K // 2] -> uint8 codes [..., K]."""
    return unpack_codes(packed_XxK2, 4)


def _minmax_quantize(x, axis: int, bits: int):
    """Asymmetric `bits`-bit codes of x over `axis`: (codes uint8, scale, zero) with the
    reduced axis kept (size 1) in scale and zero."""
    top = (1 << bits) - 1
    zero = jnp.min(x, axis=axis, keepdims=True).astype(SCALE_DTYPE).astype(jnp.float32)
    scale = (jnp.max(x, axis=axis, keepdims=True) - zero) / float(top)
    scale = scale.astype(SCALE_DTYPE).astype(jnp.float32)
    codes = jnp.clip(jnp.round(_safe_div(x - zero, scale)), 0, top).astype(jnp.uint8)
    return codes, scale, zero


def value_group(group: int, head_dim: int) -> int:
    """Channels per value group: `group`, or the whole head when the head is smaller."""
    return min(group, head_dim)


def quantize_kivi_keys(k_XxTxK: jax.Array, group: int, bits: int = 4):
    """Per-channel `bits`-bit codes over groups of `group` tokens (T a multiple of group).

    Returns (packed uint8 [..., T, K * bits / 8], scale bf16 [..., T // group, K], zero likewise).
    """
    *lead, t, d = k_XxTxK.shape
    if t % group:
        raise ValueError(f"key length {t} is not a multiple of group {group}")
    x = k_XxTxK.astype(jnp.float32).reshape(*lead, t // group, group, d)
    codes, scale, zero = _minmax_quantize(x, -2, bits)
    packed = pack_codes(codes.reshape(*lead, t, d), bits)
    return packed, scale[..., 0, :].astype(SCALE_DTYPE), zero[..., 0, :].astype(SCALE_DTYPE)


def dequantize_kivi_keys(
    packed_XxTxKn, scale_XxTgxK, zero_XxTgxK, group: int, bits: int = 4, dtype=jnp.float32
):
    *lead, t, _ = packed_XxTxKn.shape
    codes = unpack_codes(packed_XxTxKn, bits).astype(jnp.float32)
    codes = codes.reshape(*lead, t // group, group, codes.shape[-1])
    scale = scale_XxTgxK.astype(jnp.float32)[..., None, :]
    zero = zero_XxTgxK.astype(jnp.float32)[..., None, :]
    return (codes * scale + zero).reshape(*lead, t, -1).astype(dtype)


def quantize_kivi_values(v_XxK: jax.Array, group: int, bits: int = 4):
    """Per-token `bits`-bit codes over groups of `group` channels (`value_group` when K < group).

    Returns (packed uint8 [..., K * bits / 8], scale bf16 [..., K // group], zero likewise).
    """
    *lead, d = v_XxK.shape
    gv = value_group(group, d)
    if d % gv:
        raise ValueError(f"head dim {d} is not a multiple of group {gv}")
    x = v_XxK.astype(jnp.float32).reshape(*lead, d // gv, gv)
    codes, scale, zero = _minmax_quantize(x, -1, bits)
    packed = pack_codes(codes.reshape(*lead, d), bits)
    return packed, scale[..., 0].astype(SCALE_DTYPE), zero[..., 0].astype(SCALE_DTYPE)


def dequantize_kivi_values(
    packed_XxKn, scale_XxKg, zero_XxKg, group: int, bits: int = 4, dtype=jnp.float32
):
    *lead, kn = packed_XxKn.shape
    d = kn * 8 // bits
    gv = value_group(group, d)
    codes = unpack_codes(packed_XxKn, bits).astype(jnp.float32).reshape(*lead, d // gv, gv)
    scale = scale_XxKg.astype(jnp.float32)[..., None]
    zero = zero_XxKg.astype(jnp.float32)[..., None]
    return (codes * scale + zero).reshape(*lead, d).astype(dtype)


def quantize_int4_keys(k_XxTxK: jax.Array, group: int):
    """`quantize_kivi_keys` at 4 bits."""
    return quantize_kivi_keys(k_XxTxK, group, 4)


def dequantize_int4_keys(packed_XxTxK2, scale_XxTgxK, zero_XxTgxK, group: int, dtype=jnp.float32):
    return dequantize_kivi_keys(packed_XxTxK2, scale_XxTgxK, zero_XxTgxK, group, 4, dtype)


def quantize_int4_values(v_XxK: jax.Array, group: int):
    """`quantize_kivi_values` at 4 bits."""
    return quantize_kivi_values(v_XxK, group, 4)


def dequantize_int4_values(packed_XxK2, scale_XxKg, zero_XxKg, group: int, dtype=jnp.float32):
    return dequantize_kivi_values(packed_XxK2, scale_XxKg, zero_XxKg, group, 4, dtype)


# ------------------------------------------------------------------------------- KVCache


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "k",
        "v",
        "k_scale",
        "v_scale",
        "k_zero",
        "v_zero",
        "k_res",
        "v_res",
        "block_table",
    ],
    meta_fields=["kind", "group", "value_dim"],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCache:
    """One attention cache slice (optionally all layers stacked on a leading L axis).

    Contiguous (`block_table` None), per layout [L?, B, G, T, ...]:
      float32 / bfloat16: k, v [.., K] in that dtype; no scales.
      int8: k, v int8 codes [.., K]; k_scale, v_scale bf16 [L?, B, G, T].
      int4 / int2: k, v uint8 packed codes [.., K // 2] / [.., K // 4]; k_scale, k_zero bf16
        [L?, B, G, T // group, K]; v_scale, v_zero bf16 [L?, B, G, T, K // group]; k_res, v_res
        [L?, B, G, group, K] in the compute dtype: for a sequence of length n, tokens below
        q(n) = n // group * group are in the codes and tokens q(n) .. n - 1 in residual rows
        0 .. n - 1 - q(n).
    Paged (`block_table` int32 [B, pages_per_seq]): the [B, .., T] axes become [P, .., N]
    (page p, row r), and logical token t of sequence b lives at page block_table[b, t // N],
    row t % N. Residuals stay per sequence ([L?, B, G, group, K]).

    Latent (`value_dim` set; MLA's compressed cache): there are no v arrays. Each cached key
    is also its value: values are the first `value_dim` channels of the (dequantized) keys.
    float32 / bfloat16 / int8 only (KIVI quantizes keys and values along different axes).
    """

    kind: str
    k: jax.Array
    v: jax.Array | None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    k_zero: jax.Array | None = None
    v_zero: jax.Array | None = None
    k_res: jax.Array | None = None
    v_res: jax.Array | None = None
    block_table: jax.Array | None = None
    group: int = 32
    value_dim: int | None = None

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def has_layer_axis(self) -> bool:
        return self.k.ndim == 5

    def bytes_per_token(self) -> int:
        """Cache bytes per token, all kv heads, one layer (codes + scales, no residual)."""
        g = self.k.shape[-3]
        d = self.k.shape[-1] * codes_per_byte(self.kind)
        return cache_bytes_per_token(self.kind, g, d, self.group, latent=self.value_dim is not None)


def cache_bytes_per_token(
    kind: str, num_kv_heads: int, head_dim: int, group: int = 32, latent: bool = False
) -> int:
    """Bytes one cached token costs in one layer (k and v, codes and scales; the KIVI residual
    is a constant `group` tokens per sequence and not counted). A `latent` cache stores keys
    only (they are the values too)."""
    d = head_dim
    if latent:
        if kind in KIVI_BITS:
            raise ValueError(f"a latent (MLA) cache cannot be {kind}")
        return num_kv_heads * {"float32": 4 * d, "bfloat16": 2 * d, "int8": d + 2}[kind]
    per_head = {
        "float32": 8 * d,
        "bfloat16": 4 * d,
        "int8": 2 * d + 2 * 2,
        # codes of k and v, then bf16 scale + zero: keys per group of tokens, values per group
        # of channels
        "int4": d + 4 * d // group + 4 * d // value_group(group, d),
        "int2": d // 2 + 4 * d // group + 4 * d // value_group(group, d),
    }
    if kind not in per_head:
        raise ValueError(f"unknown cache kind {kind!r}; expected one of {KINDS}")
    return num_kv_heads * per_head[kind]


class Geometry(NamedTuple):
    """Static sizes of a `KVCache` (validated by `cache_geometry`)."""

    num_layers: int | None  # None: no layer axis
    batch: int
    num_kv_heads: int
    seq_len: int  # T: tokens per sequence (pages_per_seq * page_size when paged)
    head_dim: int
    page_size: int | None
    num_pages: int | None


def cache_geometry(cache: KVCache) -> Geometry:
    """Checks every array of `cache` against the layouts above and returns its sizes."""
    kind, group = cache.kind, cache.group
    if kind not in KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; expected one of {KINDS}")
    if cache.k.ndim not in (4, 5):
        raise ValueError(f"k must be [L?, B|P, G, T|N, K], got shape {cache.k.shape}")
    lead = cache.k.shape[:1] if cache.k.ndim == 5 else ()
    n0, g, t0, kk = cache.k.shape[-4:]
    d = kk * codes_per_byte(kind)
    if cache.paged:
        bt = cache.block_table
        if bt.ndim != 2 or bt.dtype != jnp.int32:
            raise ValueError(f"block_table must be int32 [B, pages], got {bt.dtype}{bt.shape}")
        batch, seq_len, page_size, num_pages = bt.shape[0], bt.shape[1] * t0, t0, n0
    else:
        batch, seq_len, page_size, num_pages = n0, t0, None, None

    code_dtype = {"int8": jnp.int8, "int4": jnp.uint8, "int2": jnp.uint8}.get(kind, kind)
    expect = {"k": (cache.k.shape, code_dtype), "v": (cache.k.shape, code_dtype)}
    rows = (*lead, n0, g, t0)
    if kind == "int8":
        expect.update(k_scale=(rows, SCALE_DTYPE), v_scale=(rows, SCALE_DTYPE))
    if cache.value_dim is not None:  # latent: values are the keys' first value_dim channels
        if kind in KIVI_BITS or not 0 < cache.value_dim <= d:
            raise ValueError(
                f"a latent cache needs kind float32, bfloat16 or int8 and "
                f"0 < value_dim <= K ({d}); got {kind}, {cache.value_dim}"
            )
        expect.pop("v")
        expect.pop("v_scale", None)
    if kind in KIVI_BITS:
        gv, n = value_group(group, d), codes_per_byte(kind)
        if t0 % group or d % gv or gv % n:
            raise ValueError(
                f"{kind} needs T (or page size) {t0} % group {group} == 0 and K and the value "
                f"group a multiple of {n}"
            )
        kgrid, vgrid = (*lead, n0, g, t0 // group, d), (*lead, n0, g, t0, d // gv)
        res_dtype = None if cache.k_res is None else cache.k_res.dtype
        if res_dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(
                f"{kind} needs float32 or bfloat16 residuals k_res/v_res, got {res_dtype}"
            )
        res = (*lead, batch, g, group, d)
        expect.update(
            k_scale=(kgrid, SCALE_DTYPE),
            k_zero=(kgrid, SCALE_DTYPE),
            v_scale=(vgrid, SCALE_DTYPE),
            v_zero=(vgrid, SCALE_DTYPE),
            k_res=(res, res_dtype),
            v_res=(res, res_dtype),
        )
    for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero", "k_res", "v_res"):
        x = getattr(cache, name)
        if name not in expect:
            if x is not None:
                raise ValueError(f"{kind} cache has no {name}, got an array")
            continue
        shape, dtype = expect[name]
        if x is None or x.shape != tuple(shape) or x.dtype != jnp.dtype(dtype):
            got = None if x is None else f"{x.dtype}{list(x.shape)}"
            raise ValueError(
                f"{kind} cache: {name} must be {jnp.dtype(dtype)}{list(shape)}, got {got}"
            )
    return Geometry(lead[0] if lead else None, batch, g, seq_len, d, page_size, num_pages)


def quantize_cache(
    k_BxGxTxK: jax.Array,
    v_BxGxTxK: jax.Array,
    kind: str,
    *,
    group: int = 32,
    lengths_B: jax.Array | None = None,
    residual_dtype=jnp.bfloat16,
) -> KVCache:
    """A contiguous `KVCache` of `kind` holding these keys/values (e.g. after a prefill).

    For int4 / int2, `lengths_B` says which tokens belong in the residual (default: all T tokens are
    in the codes and the residual is empty); the codes of a partial group are written too, but
    the decode op never reads them.
    """
    if kind in ("float32", "bfloat16"):
        return KVCache(kind=kind, k=k_BxGxTxK.astype(kind), v=v_BxGxTxK.astype(kind), group=group)
    if kind == "int8":
        (kc, ks), (vc, vs) = quantize_int8(k_BxGxTxK), quantize_int8(v_BxGxTxK)
        return KVCache(kind=kind, k=kc, v=vc, k_scale=ks, v_scale=vs, group=group)
    if kind not in KIVI_BITS:
        raise ValueError(f"unknown cache kind {kind!r}; expected one of {KINDS}")
    kc, ks, kz = quantize_kivi_keys(k_BxGxTxK, group, KIVI_BITS[kind])
    vc, vs, vz = quantize_kivi_values(v_BxGxTxK, group, KIVI_BITS[kind])
    b, _, t, _ = k_BxGxTxK.shape
    lengths_B = jnp.full((b,), t, jnp.int32) if lengths_B is None else lengths_B
    start_B = (lengths_B // group) * group  # first residual token
    rows_BxR = jnp.minimum(start_B[:, None] + jnp.arange(group)[None, :], t - 1)
    live_BxR = rows_BxR < lengths_B[:, None]

    def residual(x_BxGxTxK):
        x_BxGxRxK = jnp.take_along_axis(x_BxGxTxK, rows_BxR[:, None, :, None], axis=2)
        return jnp.where(live_BxR[:, None, :, None], x_BxGxRxK, 0).astype(residual_dtype)

    return KVCache(
        kind=kind,
        k=kc,
        v=vc,
        k_scale=ks,
        k_zero=kz,
        v_scale=vs,
        v_zero=vz,
        k_res=residual(k_BxGxTxK),
        v_res=residual(v_BxGxTxK),
        group=group,
    )

"""Split-K decode attention over a (quantized, optionally paged) KV cache: what the Pallas
backends (`mosaic_tpu.py`, `triton.py`, `mosaic_gpu.py`) share.

Flash-decoding (Dao et al. 2023): the cache length T is cut into `num_splits` chunks handled by
independent programs; each runs the online softmax (f32 statistics and accumulators) over the kv
blocks of its chunk and writes a partial (out, lse). `ops.py` merges the chunks by logsumexp.

Layout inside the kernels: query rows q [B, G, M, K] with M = R * Q (the R query heads of kv
head g times the Q new queries, query-minor), so GQA reads each kv block once for all R heads.
Partial outputs [B, G, S, M, K] and lse [B, G, S, M, 1] are float32.

Two program structures share one block math (`update`): Mosaic TPU (`mosaic_tpu.py`: one kv
block of all G kv heads per grid step, scalar-prefetched lengths / block table / layer read by
the index maps, so nothing is gathered or sliced in XLA) and Triton (`triton.py`: each program
loops over the live kv blocks of its split, loading pages through the block table). Mosaic GPU
(`mosaic_gpu.py`, Hopper; bf16 / int8 / int4) keeps the contract, the limits, the page lookup
and the nibble unpacking of this module, and does the block math with wgmma on transposed
scores (its docstring says why).

Each backend's `forward(q_parts, arrays, lengths, block_table, layer, cfg)` takes q_parts
[B, G, M, K] (or its n channel parts, n codes a byte, for int4 / int2 on TPU), the cache arrays of
ARRAY_NAMES[kind], lengths int32 [B], block_table int32 [B * pages_per_seq] (flattened; any [1]
placeholder when contiguous) and layer int32 [1], and returns cfg.num_parts float32 outputs
[B, G, S, M, K / num_parts] (normalized per split) followed by lse [B, G, S, M, 1].

Quantized blocks are dequantized in VMEM/registers:
- int8: codes go to the MXU in the compute dtype (exact: |code| <= 127); the key scale scales the
  logits, the value scale scales p before p @ v.
- int4 / int2 (KIVI): the n = 2 / 4 codes of a byte are unpacked with shifts and masks; code j
  of byte i is channel n * i + j. Mosaic cannot interleave lanes, so the TPU path keeps channels
  split in n parts: part j (channels j, n + j, 2n + j, ...) is a separate [*, K / n] operand,
  q arrives split the same way, and the output leaves split (ops.py re-interleaves them). The
  per-channel key scales are split with 0/1 selection matmuls and the per-group value scales
  widened with a 0/1 expansion matmul (both exact: each output is one bf16 input). Triton joins
  the parts back into channel order, two at a time.

Rows past a sequence's end (stale cache contents, the padded edge block) are masked in the
logits and zeroed in the values, so even NaN garbage never reaches the output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jaxllm.kernels.decode_attention.quant import KIVI_BITS, codes_per_byte
from jaxllm.kernels.reference import MASK_VALUE

# Kernel backends; `ops.py` imports the module of one only when a call uses it.
BACKENDS = ("mosaic_tpu", "mosaic_gpu", "triton")

# The cache arrays each kind passes to the kernel, in order.
ARRAY_NAMES = {
    "float32": ("k", "v"),
    "bfloat16": ("k", "v"),
    "int8": ("k", "v", "k_scale", "v_scale"),
    "int4": ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"),
    "int2": ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Static description of one decode call."""

    kind: str
    group: int  # KIVI key group (tokens); the value group is min(group, head_dim)
    head_dim: int
    num_kv_heads: int
    seq_len: int  # T (pages_per_seq * page_size when paged)
    block_kv: int
    num_splits: int
    blocks_per_split: int
    num_queries: int  # Q
    num_rows: int  # M = R * Q (padded to a power of 2 >= 16 for Triton; Mosaic GPU pads itself)
    sm_scale: float
    soft_cap: float | None
    page_size: int | None  # None: contiguous
    num_pages: int | None
    has_layer: bool
    backend: str
    interpret: bool

    @property
    def kivi(self) -> bool:
        """int4 / int2: packed codes, a per-group scale and zero, a full-precision residual."""
        return self.kind in KIVI_BITS

    @property
    def bits(self) -> int:
        return KIVI_BITS[self.kind]

    @property
    def split_channels(self) -> bool:
        """KIVI on Mosaic TPU: channels as `codes_per_byte` strided parts, not interleaved."""
        return self.kivi and self.backend == "mosaic_tpu"

    @property
    def num_parts(self) -> int:
        return codes_per_byte(self.kind) if self.split_channels else 1

    @property
    def value_group(self) -> int:
        return min(self.group, self.head_dim)


def _dot_nt(a, b):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):  # a @ b
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def kernel_limit(length, cfg: Config):
    """Tokens the kernel covers: all n of them, or for int4 / int2 the q(n) in full groups."""
    if cfg.kivi:
        return lax.div(length, cfg.group) * cfg.group
    return length


# -------------------------------------------------------------------------- block math


def _unpack(packed, bits: int):
    """uint8 [r, K * bits / 8] -> the 8 / bits parts [r, K * bits / 8] of float32 codes: part j
    holds code j of each byte (channels j, n + j, ...)."""
    x, mask = packed.astype(jnp.int32), (1 << bits) - 1
    return [
        jnp.bitwise_and(lax.shift_right_logical(x, bits * j), mask).astype(jnp.float32)
        for j in range(8 // bits)
    ]


def _nibbles(packed):
    """uint8 [n, K / 2] -> (even channels, odd channels) as float32 codes 0..15."""
    return tuple(_unpack(packed, 4))


def _interleave(parts):
    """The n parts [r, K / n] of `_unpack` -> [r, K] in channel order, by 2-way joins (Triton
    joins two tensors at a time): parts 0, 2, .. are the even channels, 1, 3, .. the odd."""
    if len(parts) == 1:
        return parts[0]
    even, odd = _interleave(parts[0::2]), _interleave(parts[1::2])
    r, h = even.shape
    return jnp.stack([even, odd], axis=-1).reshape(r, 2 * h)


def _deinterleave(x, n: int):
    """[r, K] -> [x[:, j::n] for j < n] in float32, by 0/1 selection matmuls (Mosaic)."""
    d = x.shape[1]
    c = lax.broadcasted_iota(jnp.int32, (d, d // n), 0)
    i = lax.broadcasted_iota(jnp.int32, (d, d // n), 1)

    def pick(offset):
        sel = (c == n * i + offset).astype(x.dtype)
        return lax.dot_general(
            x,
            sel,
            (((1,), (0,)), ((), ())),
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )

    return [pick(j) for j in range(n)]


def _repeat_rows(x, rep: int):
    """[n, C] -> [n * rep, C], each row repeated `rep` times (a sublane broadcast)."""
    n, c = x.shape
    return jnp.broadcast_to(x[:, None, :], (n, rep, c)).reshape(n * rep, c)


def _repeat_lanes(x, rep: int, cfg: Config):
    """[n, C] -> [n, C * rep], each column repeated `rep` times: a 0/1 expansion matmul on
    Mosaic (exact), a broadcast + reshape on Triton (whose dots need inner dims >= 16)."""
    n, c = x.shape
    if cfg.backend == "triton":
        return jnp.broadcast_to(x[:, :, None], (n, c, rep)).reshape(n, c * rep)
    src = lax.broadcasted_iota(jnp.int32, (c, c * rep), 0) * rep
    dst = lax.broadcasted_iota(jnp.int32, (c, c * rep), 1)
    expand = ((dst >= src) & (dst < src + rep)).astype(x.dtype)  # no vector integer division
    return lax.dot_general(
        x,
        expand,
        (((1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _scores(q_parts, blk, cfg: Config):
    """Raw logits [M, bk] of one kv block."""
    cd = q_parts[0].dtype
    if cfg.kind in ("float32", "bfloat16"):
        return _dot_nt(q_parts[0], blk["k"].astype(cd))
    if cfg.kind == "int8":
        codes = blk["k"].astype(jnp.float32).astype(cd)
        return _dot_nt(q_parts[0], codes) * blk["k_scale"]  # [1, bk] f32
    codes = _unpack(blk["k"], cfg.bits)
    g = cfg.group
    if cfg.split_channels:
        n = cfg.num_parts
        scales, zeros = _deinterleave(blk["k_scale"], n), _deinterleave(blk["k_zero"], n)
        s = None
        for q_j, c_j, s_j, z_j in zip(q_parts, codes, scales, zeros):
            k_j = c_j * _repeat_rows(s_j, g) + _repeat_rows(z_j, g)
            s_j = _dot_nt(q_j, k_j.astype(cd))
            s = s_j if s is None else s + s_j
        return s
    scale = _repeat_rows(blk["k_scale"].astype(jnp.float32), g)
    zero = _repeat_rows(blk["k_zero"].astype(jnp.float32), g)
    k = _interleave(codes) * scale + zero
    return _dot_nt(q_parts[0], k.astype(cd))


def _values(p, blk, start, limit, cfg: Config, cd):
    """p @ v of one kv block, one [M, K] (or n [M, K / n] parts) float32 array per part.

    Rows at or past `limit` are zeroed (p is 0 there, but 0 * NaN garbage would not be)."""
    bk = cfg.block_kv
    live_Bx1 = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < limit
    if cfg.kind in ("float32", "bfloat16"):
        v = jnp.where(live_Bx1, blk["v"].astype(cd), 0)
        return [_dot_nn(p.astype(cd), v)]
    if cfg.kind == "int8":
        live_1xB = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1) < limit
        p_scaled = p * jnp.where(live_1xB, blk["v_scale"], 0.0)  # v = code * scale per token
        return [_dot_nn(p_scaled.astype(cd), blk["v"].astype(jnp.float32).astype(cd))]
    codes = _unpack(blk["v"], cfg.bits)
    scale, zero = blk["v_scale"].astype(jnp.float32), blk["v_zero"].astype(jnp.float32)
    gv = cfg.value_group
    if cfg.split_channels:  # channels n * i + j (j < n) share value group i // (gv / n)
        n = cfg.num_parts
        scale, zero = _repeat_lanes(scale, gv // n, cfg), _repeat_lanes(zero, gv // n, cfg)
        parts = [c_j * scale + zero for c_j in codes]
        return [_dot_nn(p.astype(cd), jnp.where(live_Bx1, h, 0.0).astype(cd)) for h in parts]
    scale, zero = _repeat_lanes(scale, gv, cfg), _repeat_lanes(zero, gv, cfg)
    v = _interleave(codes) * scale + zero
    return [_dot_nn(p.astype(cd), jnp.where(live_Bx1, v, 0.0).astype(cd))]


def _query_index(shape, num_queries: int):
    """Query i of row m = r * Q + i, as int32 over `shape` (rows on axis 0). Computed with an
    exact float floor (m < 2 ** 20) rather than a vector integer remainder."""
    if num_queries == 1:
        return jnp.zeros(shape, jnp.int32)
    m = lax.broadcasted_iota(jnp.int32, shape, 0)
    r = jnp.floor((m.astype(jnp.float32) + 0.5) * (1.0 / num_queries)).astype(jnp.int32)
    return m - r * num_queries


def update(carry, q_parts, blk, start, length, cfg: Config):
    """One online-softmax step over the kv block of tokens [start, start + bk)."""
    m_prev, l_prev, accs = carry
    limit = kernel_limit(length, cfg)
    s = _scores(q_parts, blk, cfg) * jnp.float32(cfg.sm_scale)
    if cfg.soft_cap is not None:
        s = jnp.float32(cfg.soft_cap) * jnp.tanh(s / jnp.float32(cfg.soft_cap))
    shape = (cfg.num_rows, cfg.block_kv)
    q_pos = length - cfg.num_queries + _query_index(shape, cfg.num_queries)
    t = start + lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = (t <= q_pos) & (t < limit)  # causal among the Q new tokens; KIVI: codes part only
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)  # rows with nothing visible keep m == MASK
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pvs = _values(p, blk, start, limit, cfg, q_parts[0].dtype)
    return m_new, l_new, [alpha * acc + pv for acc, pv in zip(accs, pvs)]


def finalize(m, l, accs, out_refs, lse_ref):
    l_safe = jnp.where(l == 0.0, 1.0, l)  # no visible token: out 0, lse MASK_VALUE
    for out_ref, acc in zip(out_refs, accs):
        out_ref[...] = acc / l_safe
    lse_ref[...] = m + jnp.log(l_safe)


def init_state(cfg: Config):
    m = jnp.full((cfg.num_rows, 1), MASK_VALUE, jnp.float32)
    l = jnp.zeros((cfg.num_rows, 1), jnp.float32)
    width = cfg.head_dim // cfg.num_parts
    return m, l, [jnp.zeros((cfg.num_rows, width), jnp.float32) for _ in range(cfg.num_parts)]


def unpack_refs(refs, cfg: Config):
    names = ARRAY_NAMES[cfg.kind]
    n, a = cfg.num_parts, len(names)
    q_refs, cache_refs, rest = refs[:n], dict(zip(names, refs[n : n + a])), refs[n + a :]
    return q_refs, cache_refs, rest[:n], rest[n], rest[n + 1 :]


def page_of(b, j, bt_ref, cfg: Config):
    """(page, row block inside it) of kv block j of sequence b. The block table arrives
    flattened ([B * pages_per_seq]: 2-D scalar memory pads rows); invalid entries (e.g. -1 past
    a sequence's pages) are clamped into range, and only masked rows are read from them."""
    per_page = cfg.page_size // cfg.block_kv
    pages_per_seq = cfg.seq_len // cfg.page_size
    page = bt_ref[b * pages_per_seq + lax.div(j, per_page)]
    return jnp.clip(page, 0, cfg.num_pages - 1), lax.rem(j, per_page)


def out_shapes(b, g, m, cfg: Config):
    width = cfg.head_dim // cfg.num_parts
    out = jax.ShapeDtypeStruct((b, g, cfg.num_splits, m, width), jnp.float32)
    lse = jax.ShapeDtypeStruct((b, g, cfg.num_splits, m, 1), jnp.float32)
    return [out] * cfg.num_parts + [lse]

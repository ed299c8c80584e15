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

Quantized blocks are read as codes and scaled outside the [block, K] tiles where the layout
allows it:
- int8: codes go to the MXU in the compute dtype (exact: |code| <= 127); the per-token key
  scale scales the logits, the per-token value scale scales p before p @ v. Triton takes the
  same math with float16 operands built from the codes' bits (`triton.py`).
- int4 / int2 (KIVI): the n = 2 / 4 codes of a byte are unpacked with shifts and masks; code j
  of byte i is channel n * i + j. The channels stay split in n parts: part j (channels j,
  n + j, 2n + j, ...) is a separate [*, K / n] operand, q arrives split the same way, and the
  output leaves split (ops.py re-interleaves them), so no kernel moves lanes across a tile.
  Mosaic TPU splits the per-channel key scales with 0/1 selection matmuls and widens the
  per-group value scales with a 0/1 expansion matmul (both exact: each output is one bf16
  input) and dequantizes the tiles. Triton (`triton.py`) dequantizes no key tile: it loads
  each part's key scales with strided loads, folds them into q once per token group
  (q_j * scale_j, then the dot on the raw codes) and adds the zero points as one q . zero
  term per row; the per-token value scale multiplies p per value group, and the value zero
  adds sum_t p * zero.

Rows past a sequence's end (stale cache contents, the padded edge block) are masked in the
logits and zeroed in the values, so even NaN garbage never reaches the output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
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
        """KIVI on Mosaic TPU and Triton: channels as `codes_per_byte` strided parts, never
        interleaved back into channel order inside the kernel."""
        return self.kivi and self.backend in ("mosaic_tpu", "triton")

    @property
    def num_parts(self) -> int:
        return codes_per_byte(self.kind) if self.split_channels else 1

    @property
    def value_group(self) -> int:
        return min(self.group, self.head_dim)

    @property
    def value_chunks(self) -> int:
        """Column chunks of each output part on Triton KIVI: one per value group when a group's
        gv / n channels of a part are wide enough for a dot (>= 16), so the value scale goes on
        p per chunk; else 1 (the codes are dequantized with lane-repeated scales)."""
        if self.backend != "triton" or not self.kivi:
            return 1
        gv = self.value_group
        return self.head_dim // gv if gv // self.num_parts >= 16 else 1


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
    codes = _unpack(blk["k"], cfg.bits)  # KIVI on Mosaic TPU (Triton: `triton.py`)
    g, n = cfg.group, cfg.num_parts
    scales, zeros = _deinterleave(blk["k_scale"], n), _deinterleave(blk["k_zero"], n)
    s = None
    for q_j, c_j, s_j, z_j in zip(q_parts, codes, scales, zeros):
        k_j = c_j * _repeat_rows(s_j, g) + _repeat_rows(z_j, g)
        s_j = _dot_nt(q_j, k_j.astype(cd))
        s = s_j if s is None else s + s_j
    return s


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
    return dequantized_values(p, codes, blk["v_scale"], blk["v_zero"], live_Bx1, cfg, cd)


def dequantized_values(p, codes, v_scale, v_zero, live_Nx1, cfg: Config, cd):
    """KIVI p @ v per channel part (codes: the n float32 parts [N, K / n]), dequantized with
    lane-repeated value scales: channels n * i + j (j < n) share value group i // (gv / n)."""
    scale, zero = v_scale.astype(jnp.float32), v_zero.astype(jnp.float32)
    rep = cfg.value_group // cfg.num_parts
    scale, zero = _repeat_lanes(scale, rep, cfg), _repeat_lanes(zero, rep, cfg)
    parts = [c_j * scale + zero for c_j in codes]
    return [_dot_nn(p.astype(cd), jnp.where(live_Nx1, h, 0.0).astype(cd)) for h in parts]


def _query_index(shape, num_queries: int):
    """Query i of row m = r * Q + i, as int32 over `shape` (rows on axis 0). Computed with an
    exact float floor (m < 2 ** 20) rather than a vector integer remainder."""
    if num_queries == 1:
        return jnp.zeros(shape, jnp.int32)
    m = lax.broadcasted_iota(jnp.int32, shape, 0)
    r = jnp.floor((m.astype(jnp.float32) + 0.5) * (1.0 / num_queries)).astype(jnp.int32)
    return m - r * num_queries


def softmax_step(m_prev, l_prev, scores, starts, length, cfg: Config):
    """The online-softmax statistics of one kv block given as sub-blocks: raw logits
    scores[i] [M, n_i] of the tokens [starts[i], starts[i] + n_i). Returns (m_new, l_new, alpha,
    p per sub-block); the sub-blocks share one running max, so nothing is concatenated."""
    limit = kernel_limit(length, cfg)
    masked = []
    for s, start in zip(scores, starts):
        s = s * jnp.float32(cfg.sm_scale)
        if cfg.soft_cap is not None:
            s = jnp.float32(cfg.soft_cap) * jnp.tanh(s / jnp.float32(cfg.soft_cap))
        q_pos = length - cfg.num_queries + _query_index(s.shape, cfg.num_queries)
        t = start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        mask = (t <= q_pos) & (t < limit)  # causal among the Q new tokens; KIVI: codes part only
        masked.append((jnp.where(mask, s, MASK_VALUE), mask))
    m_new = m_prev
    for s, _ in masked:
        m_new = jnp.maximum(m_new, jnp.max(s, axis=1, keepdims=True))
    # rows with nothing visible keep m == MASK
    ps = [jnp.where(mask, jnp.exp(s - m_new), 0.0) for s, mask in masked]
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev
    for p in ps:
        l_new = l_new + jnp.sum(p, axis=1, keepdims=True)
    return m_new, l_new, alpha, ps


def update(carry, q_parts, blk, start, length, cfg: Config):
    """One online-softmax step over the kv block of tokens [start, start + bk)."""
    m_prev, l_prev, accs = carry
    s = _scores(q_parts, blk, cfg)
    m_new, l_new, alpha, (p,) = softmax_step(m_prev, l_prev, [s], [start], length, cfg)
    pvs = _values(p, blk, start, kernel_limit(length, cfg), cfg, q_parts[0].dtype)
    return m_new, l_new, [alpha * acc + pv for acc, pv in zip(accs, pvs)]


def finalize(m, l, accs, out_refs, lse_ref, chunks: int = 1):
    """Writes out = acc / l and lse; with `chunks` > 1 (Triton KIVI, `Config.value_chunks`),
    accs[j * chunks + c] is column chunk c of output part j."""
    l_safe = jnp.where(l == 0.0, 1.0, l)  # no visible token: out 0, lse MASK_VALUE
    for i, acc in enumerate(accs):
        if chunks == 1:
            out_refs[i][...] = acc / l_safe
        else:
            width = acc.shape[1]
            out_refs[i // chunks][:, pl.ds((i % chunks) * width, width)] = acc / l_safe
    lse_ref[...] = m + jnp.log(l_safe)


def init_state(cfg: Config):
    m = jnp.full((cfg.num_rows, 1), MASK_VALUE, jnp.float32)
    l = jnp.zeros((cfg.num_rows, 1), jnp.float32)
    count = cfg.num_parts * cfg.value_chunks
    width = cfg.head_dim // count
    return m, l, [jnp.zeros((cfg.num_rows, width), jnp.float32) for _ in range(count)]


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

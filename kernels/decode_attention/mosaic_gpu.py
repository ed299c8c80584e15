"""Split-K decode attention as a Mosaic GPU kernel for Hopper (sm_90); the contract (layouts,
splits, masks, empty rows) is in `common.py`, the SMEM / TMA / wgmma helpers are those of the
flash-attention kernel (`flash_attention/mosaic_gpu.py`).

Grid (G, S, B): one warpgroup per (kv head, split, sequence) owns the M = R * Q query rows of
its kv head (GQA reads each kv block once for all R heads) and streams the live kv blocks of its
split through the two-slot TMA pipeline of the flash kernel (`pipeline`); lengths, the block
table and the layer are scalars read from GMEM, and a paged block's page is looked up when its
copy is issued. Rows of length 0 and splits past a sequence's end run no block: out 0, lse
MASK_VALUE.

Decode has few query rows (M is often 1..8) while a wgmma's A operand is a 64-row tile, and the
Mosaic GPU interpreter of jax 0.10 (the CPU tests run every line of this kernel in it) reads
neither a transposed SMEM view in a wgmma nor an operand from registers; the kernel therefore
never transposes anything in SMEM, and keys and values are never transposed in XLA (that would
triple the traffic of a memory-bound kernel; only int4's small value-scale arrays are, below).
Per kv block of bk tokens:
- scores: s^T [bk, Mp] = k_tile [bk, K] @ q^T [K, Mp], one wgmma with the kv block as the A
  operand and q^T (transposed and padded to Mp = 64 columns by XLA: q is tiny) resident in SMEM
  as B. Softmax statistics are per column (reductions over axis 0, across the warps).
- p @ v needs p with the queries on rows. The M real columns of p^T are taken out with masked row
  sums (O(M) register work per block), written as rows of a [Mp, bk] SMEM buffer whose other
  rows stay zero, re-staged as a wgmma tile, and out [Mp, K] += p @ v_tile is a second wgmma
  (v as B, row-major as TMA wrote it). The per-column rescale factors reach the row-indexed
  accumulator as the diagonal of their broadcast (masked row sums).
So M <= 64 costs the same two 64-row wgmmas as M = 1 (the padding is free while the kernel is
bound by HBM), and the extraction is the first thing to revisit for large M.

Quantized blocks are dequantized in registers and staged to SMEM in bfloat16 before their wgmma:
- int8: codes (exact in bf16) are the A operand of the scores, whose rows are then scaled by the
  per-token key scale; values: codes are staged as they are and p^T's rows take the per-token
  value scale (zero past the sequence's end) before the extraction.
- int4: nibbles are unpacked with shifts and masks. Registers cannot interleave lanes, so the
  codes are put back into channel order by two exact wgmmas with 0/1 expansion matrices
  ([bk, K/2] @ [K/2, K], one per nibble; each output is one code). Key scales / zeros (one row
  of K channels per `group` tokens) are 1-D row loads broadcast over their tokens. Value scales /
  zeros ([T, K/group]: rows of 8 bytes at the defaults, below TMA's 16-byte minimum, and not
  readable per column in registers) are the one cache array transposed in XLA, to [K/group, T],
  for the called layer only: a tenth of an int4 cache's bytes at K = 128, group 32, read and
  written once more per call (+20% traffic), the second thing to revisit.
Queries and the matmul operands are bfloat16 (float32 queries are rounded), accumulation and
softmax statistics float32. Value rows past a sequence's end are zeroed before p @ v (stale
cache contents may be NaN): in registers for quantized kinds, on the edge block only for bf16.

Supported: bfloat16 / int8 caches with head dim 64 or 128, int4 with head dim 128 (its
expansion tiles need K/2 >= 64 rows), M <= 64, and block_kv a multiple of 64 dividing the cache
length (or page size); `ops.mosaic_gpu_supported` checks this before the module is imported.
float32 caches are not taken: wgmma reads 32-bit operands only as tf32 from K-major tiles, which
this transpose-free layout does not have, and rounding them to bf16 would lose what float32 is
chosen for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxllm.kernels.decode_attention.common import (
    ARRAY_NAMES,
    Config,
    _nibbles,
    kernel_limit,
    page_of,
)
from jaxllm.kernels.flash_attention.mosaic_gpu import (
    COL,
    NUM_SLOTS,
    ROW,
    TILE,
    barriers,
    col_broadcast,
    compiler_params,
    interpret_params,
    iota,
    layout_hint,
    load,
    matmul,
    pipeline,
    row_broadcast,
    stage,
)
from jaxllm.kernels.reference import MASK_VALUE

ROWS = 64  # query rows of the kernel: one wgmma row tile (M padded up to it)


def tile_smem(shape, dtype):
    """SMEM of a 2-D tile (leading slot dims allowed) as TMA writes it and wgmma reads it:
    swizzled by up to 128 bytes of its minor dim."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, shape[-1] * itemsize)
    transforms = (
        plgpu.TilingTransform((8, swizzle // itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def load_tile(ref, cfg: Config, optimized: bool = True):
    """A 2-D SMEM tile into registers in the wgmma layout (`optimized=False` for an unswizzled
    tile, which no bank-conflict-free transfer reads)."""
    return ref[...] if cfg.interpret else load(ref, TILE, optimized=optimized)


def load_vec(ref, layout, cfg: Config):
    """A 1-D SMEM vector (a bf16 scale row, say) into registers, laid out to broadcast against
    wgmma tiles."""
    return ref[...] if cfg.interpret else load(ref, layout, optimized=False)


def to_rows(x_col, cfg: Config):
    """A per-column vector [ROWS] as a per-row one: the diagonal of its broadcast, by masked row
    sums (registers only)."""
    shape = (ROWS, ROWS)
    diagonal = iota(shape, 0, cfg) == iota(shape, 1, cfg)
    return jnp.where(diagonal, col_broadcast(x_col, shape), 0.0).sum(axis=1)


def expand_codes(lo, hi, s, bk: int, d: int):
    """Nibbles (even / odd channels, [bk, K/2]) -> codes [bk, K] in channel order, by two 0/1
    expansion wgmmas (exact)."""
    stage(lo, s["lo"])
    stage(hi, s["hi"])

    def body(acc_ref):
        plgpu.wgmma(acc_ref, s["lo"], s["e_even"])
        plgpu.wgmma(acc_ref, s["hi"], s["e_odd"])
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC((bk, d), jnp.float32))


def pick_by_bound(parts, bounds, idx):
    """parts[i] where bounds[i] <= idx (the last such i), for ascending bounds."""
    out = parts[0]
    for part, bound in zip(parts[1:], bounds[1:]):
        out = jnp.where(idx >= bound, part, out)
    return out


# ----------------------------------------------------------------------------- kernel


def _key_tile(s, slot, cfg: Config):
    """The bf16 SMEM tile whose rows are the keys of the block (int8: their codes)."""
    if cfg.kind == "bfloat16":
        return s["k"].at[slot]
    bk, d = cfg.block_kv, cfg.head_dim
    if cfg.kind == "int8":
        stage(load_tile(s["k"].at[slot], cfg).astype(jnp.float32), s["kd"])
        return s["kd"]
    codes = expand_codes(*_nibbles(load_tile(s["k"].at[slot], cfg)), s, bk, d)
    shape, g = (bk, d), cfg.group

    def per_group(name):  # one row of K channels per `group` tokens, broadcast over them
        rows = [s[name].at[slot, r] for r in range(bk // g)]
        return [col_broadcast(load_vec(r, COL, cfg).astype(jnp.float32), shape) for r in rows]

    bounds = [r * g for r in range(bk // g)]
    row = iota(shape, 0, cfg)
    k = codes * pick_by_bound(per_group("k_scale"), bounds, row)
    stage(k + pick_by_bound(per_group("k_zero"), bounds, row), s["kd"])
    return s["kd"]


def _value_tile(s, slot, live_fn, start, limit, cfg: Config):
    """The bf16 SMEM tile of the block's values (int8: their codes), rows past `limit` zero."""
    bk, d = cfg.block_kv, cfg.head_dim
    if cfg.kind == "bfloat16":
        v_ref = s["v"].at[slot]

        @pl.when(start + bk > limit)  # the edge block: stale rows may hold NaN
        def _zero_stale_rows():
            v = load_tile(v_ref, cfg)
            stage(jnp.where(live_fn((bk, d)), v, jnp.zeros_like(v)), v_ref)

        return v_ref
    if cfg.kind == "int8":  # codes are finite; the value scale goes into p
        stage(load_tile(s["v"].at[slot], cfg).astype(jnp.float32), s["vd"])
        return s["vd"]
    codes = expand_codes(*_nibbles(load_tile(s["v"].at[slot], cfg)), s, bk, d)
    shape, gv = (bk, d), cfg.value_group

    def per_channel_group(name):  # [K / gv, bk] (transposed by `forward`): one row per group
        rows = [s[name].at[slot, j] for j in range(d // gv)]
        return [row_broadcast(load_vec(r, ROW, cfg).astype(jnp.float32), shape) for r in rows]

    bounds = [j * gv for j in range(d // gv)]
    col = iota(shape, 1, cfg)
    v = codes * pick_by_bound(per_channel_group("v_scale"), bounds, col)
    v = v + pick_by_bound(per_channel_group("v_zero"), bounds, col)
    stage(jnp.where(live_fn(shape), v, 0.0), s["vd"])
    return s["vd"]


def _kernel(lengths_ref, bt_ref, layer_ref, qt_ref, *refs, cfg: Config, s):
    names = ARRAY_NAMES[cfg.kind]
    caches = dict(zip(names, refs[: len(names)]))
    out_ref, lse_ref = refs[len(names) :]
    bk, d, mp = cfg.block_kv, cfg.head_dim, ROWS
    g, split, b = lax.axis_index("heads"), lax.axis_index("splits"), lax.axis_index("batch")
    length = lengths_ref[b]
    layer = layer_ref[0] if cfg.has_layer else None
    limit = kernel_limit(length, cfg)
    first = split * cfg.blocks_per_split
    stop = jnp.minimum(first + cfg.blocks_per_split, pl.cdiv(limit, bk))
    plgpu.copy_gmem_to_smem(qt_ref.at[b, g], s["qt"], s["q_bar"])

    def issue(j, slot):
        if cfg.page_size is None:
            seq, row = b, j * bk
        else:
            seq, row_block = page_of(b, j, bt_ref, cfg)
            row = row_block * bk
        lead = (layer, seq, g) if cfg.has_layer else (seq, g)
        for name, ref in caches.items():
            if name in ("k", "v") or cfg.kind == "int8":  # one row (int8 scales: entry) a token
                src = ref.at[(*lead, pl.ds(row, bk))]
            elif name in ("k_scale", "k_zero"):  # one row per `group` tokens
                src = ref.at[(*lead, pl.ds(lax.div(row, cfg.group), bk // cfg.group))]
            else:  # int4 value scale / zero of this layer, transposed: [B|P, G, K / gv, T]
                src = ref.at[seq, g, :, pl.ds(row, bk)]
            plgpu.copy_gmem_to_smem(src, s[name].at[slot], s[name + "_bar"].at[slot])

    if cfg.kind == "int4":  # 0/1 expansion matrices: nibble i -> channel 2i (+ 1)
        i, c = iota((d // 2, d), 0, cfg), iota((d // 2, d), 1, cfg)
        stage(jnp.where(c == 2 * i, 1.0, 0.0), s["e_even"])
        stage(jnp.where(c == 2 * i + 1, 1.0, 0.0), s["e_odd"])
    s["p_rows"][...] = jnp.zeros((mp, bk), jnp.bfloat16)  # splat: no transfer plan needed
    plgpu.barrier_wait(s["q_bar"])
    shape = (bk, mp)
    col = iota(shape, 1, cfg)
    q_pos = length - cfg.num_queries + (lax.rem(col, cfg.num_queries) if cfg.num_queries > 1 else 0)

    def step(j, slot, carry):
        m_prev, l_prev, acc = carry
        start = j * bk

        def live(tile_shape):  # rows of tokens the kernel covers
            return start + iota(tile_shape, 0, cfg) < limit

        for name in caches:
            if name.startswith("k"):
                plgpu.barrier_wait(s[name + "_bar"].at[slot])
        sc = matmul(_key_tile(s, slot, cfg), s["qt"], bk, mp)  # s^T: tokens x query rows
        if cfg.kind == "int8":
            k_scale = load_vec(s["k_scale"].at[slot], ROW, cfg).astype(jnp.float32)
            sc = sc * row_broadcast(k_scale, shape)
        sc = sc * jnp.float32(cfg.sm_scale)
        if cfg.soft_cap is not None:
            sc = jnp.float32(cfg.soft_cap) * jnp.tanh(sc / jnp.float32(cfg.soft_cap))
        t = start + iota(shape, 0, cfg)
        mask = (t <= q_pos) & (t < limit)  # causal among the Q new tokens; int4: codes only
        sc = jnp.where(mask, sc, MASK_VALUE)
        m_new = jnp.maximum(m_prev, sc.max(axis=0))
        p = jnp.where(mask, jnp.exp(sc - col_broadcast(m_new, shape)), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + p.sum(axis=0)

        for name in caches:
            if name.startswith("v"):
                plgpu.barrier_wait(s[name + "_bar"].at[slot])
        v_ref = _value_tile(s, slot, live, start, limit, cfg)
        if cfg.kind == "int8":  # v = code * scale per token: the scale goes into p's rows
            v_scale = load_vec(s["v_scale"].at[slot], ROW, cfg).astype(jnp.float32)
            p = p * jnp.where(live(shape), row_broadcast(v_scale, shape), 0.0)
        for r in range(cfg.num_rows):  # column r of p^T -> row r of p
            s["p_rows"][r] = jnp.where(col == r, p, 0.0).sum(axis=1).astype(jnp.bfloat16)
        stage(load_tile(s["p_rows"], cfg, optimized=False), s["p"])
        pv = matmul(s["p"], v_ref, mp, d)
        alpha_rows = to_rows(alpha, cfg)
        return m_new, l_new, row_broadcast(alpha_rows, pv.shape) * acc + pv

    m0 = layout_hint(jnp.full((mp,), MASK_VALUE, jnp.float32), COL, cfg)
    l0 = layout_hint(jnp.zeros((mp,), jnp.float32), COL, cfg)
    acc0 = layout_hint(jnp.zeros((mp, d), jnp.float32), TILE, cfg)
    m, l, acc = pipeline(first, stop, issue, step, (m0, l0, acc0))

    l_safe = jnp.where(l == 0.0, 1.0, l)  # no visible token: out 0, lse MASK_VALUE
    s["lse"][...] = to_rows(m + jnp.log(l_safe), cfg)
    l_rows = to_rows(l_safe, cfg)
    stage(acc / row_broadcast(l_rows, acc.shape), s["out"])
    plgpu.copy_smem_to_gmem(s["out"], out_ref.at[b, g, split])
    plgpu.copy_smem_to_gmem(s["lse"], lse_ref.at[b, g, split])
    plgpu.wait_smem_to_gmem(0)


def _block_shape(name: str, cfg: Config) -> tuple[int, ...]:
    """Shape of one kv block of cache array `name` in SMEM (what one TMA copy moves)."""
    bk, d = cfg.block_kv, cfg.head_dim
    if name in ("k", "v"):
        return (bk, d // 2 if cfg.kind == "int4" else d)
    if cfg.kind == "int8":  # scales [.., T]
        return (bk,)
    if name in ("k_scale", "k_zero"):  # one row per `group` tokens
        return (bk // cfg.group, d)
    return (d // cfg.value_group, bk)  # int4 value scale / zero, transposed


def _scratch(arrays, cfg: Config) -> dict:
    bk, d, mp = cfg.block_kv, cfg.head_dim, ROWS
    scratch = dict(
        qt=tile_smem((d, mp), jnp.bfloat16),
        p_rows=plgpu.SMEM((mp, bk), jnp.bfloat16),
        p=tile_smem((mp, bk), jnp.bfloat16),
        lse=plgpu.SMEM((mp,), jnp.float32),
        out=tile_smem((mp, d), jnp.float32),
        q_bar=barriers(streamed=False),
    )
    for name, x in zip(ARRAY_NAMES[cfg.kind], arrays):
        smem = tile_smem if name in ("k", "v") else plgpu.SMEM
        scratch[name] = smem((NUM_SLOTS, *_block_shape(name, cfg)), x.dtype)
        scratch[name + "_bar"] = barriers()
    if cfg.kind != "bfloat16":
        scratch.update(kd=tile_smem((bk, d), jnp.bfloat16), vd=tile_smem((bk, d), jnp.bfloat16))
    if cfg.kind == "int4":
        scratch.update(
            lo=tile_smem((bk, d // 2), jnp.bfloat16),
            hi=tile_smem((bk, d // 2), jnp.bfloat16),
            e_even=tile_smem((d // 2, d), jnp.bfloat16),
            e_odd=tile_smem((d // 2, d), jnp.bfloat16),
        )
    return scratch


def forward(q_parts, arrays, lengths, block_table, layer, cfg: Config):
    """Per-split partial outputs and lse (arguments and results in `common.py`), with ROWS
    query rows: those past q's M are padding, which the caller slices off."""
    (q,) = q_parts
    b, g, m, d = q.shape
    qt = jnp.pad(jnp.swapaxes(q, 2, 3), ((0, 0), (0, 0), (0, 0), (0, ROWS - m)))
    names = ARRAY_NAMES[cfg.kind]
    arrays = list(arrays)
    if cfg.kind == "int4":  # this layer's [B|P, G, T, K / gv] -> [.., K / gv, T]: TMA rows
        for i in (names.index("v_scale"), names.index("v_zero")):  # of >= 16 bytes
            x = arrays[i]
            if cfg.has_layer:
                x = lax.dynamic_index_in_dim(x, layer[0], 0, keepdims=False)
            arrays[i] = jnp.swapaxes(x, -1, -2)

    def body(lengths_ref, bt_ref, layer_ref, qt_ref, *refs, **s):
        _kernel(lengths_ref, bt_ref, layer_ref, qt_ref, *refs, cfg=cfg, s=s)

    out, lse = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((b, g, cfg.num_splits, ROWS, d), jnp.float32),
            jax.ShapeDtypeStruct((b, g, cfg.num_splits, ROWS), jnp.float32),  # TMA: >= 16 B
        ),
        scratch_types=_scratch(arrays, cfg),
        grid=(g, cfg.num_splits, b),
        grid_names=("heads", "splits", "batch"),
        compiler_params=compiler_params(),
        interpret=interpret_params(cfg),
        kernel_name=f"decode_attention_{cfg.kind}_mgpu",
    )(lengths, block_table, layer, qt.astype(jnp.bfloat16), *arrays)
    return out, lse[..., None]

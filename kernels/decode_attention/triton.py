"""Split-K decode attention as a Pallas Triton kernel: grid (B, G, S), the cache arrays whole in
HBM, each program looping over the live kv blocks of its split (Triton has no scalar prefetch and
no state across programs) and loading pages through the block table inside the loop. The block
math and the contract are in `common.py`.

Quantized blocks are read so that the arithmetic per cached byte stays small (the kernel should
stay memory-bound; docs/benchmarks.md says what was measured): for KIVI int4 / int2 no
[block, K] tile is dequantized, reshaped or interleaved. A KIVI block is read as its token
groups (`group` rows, one key scale row each):
- keys: each channel part's key scales and zeros are strided loads ([1, K / n]); the scales
  are folded into q once per group (q_j * scale_j, then the dot on the raw codes of part j, the
  low / high nibbles of the packed bytes for int4), and the zeros add one q . zero per row;
- values: when a value group's gv / n channels of a part fill a dot (>= 16: int4 with
  group >= 32), each value group's byte columns are loaded on their own, its per-token scale
  multiplies p ([M, group]) and its zero adds sum_t p * zero; the accumulators are per (part,
  value group) column chunk (`Config.value_chunks`). Otherwise (int2 at group 32) the value
  codes are dequantized with lane-repeated scales.
The groups of a block share one online-softmax step (`common.softmax_step`), so the logits of
the groups are never concatenated. No code becomes a float by an int-to-float conversion: KIVI
codes are bitcast as 128 + code (`_offset_codes`), int8 codes as 1024 + 128 + code in float16
(2^23 + 128 + code in float32) less the constant (`_int8_codes`); int8's per-token scales stay
on the logits and on p, as in `common.py`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxllm.kernels.decode_attention.common import (
    Config,
    _dot_nn,
    _dot_nt,
    dequantized_values,
    finalize,
    init_state,
    kernel_limit,
    out_shapes,
    page_of,
    softmax_step,
    unpack_refs,
    update,
)


def _locate(b, g, j, layer, bt_ref, cfg: Config):
    """(leading indices, first row) of kv block j of sequence b, kv head g."""
    if cfg.page_size is None:
        seq, row = b, j * cfg.block_kv
    else:
        seq, row_block = page_of(b, j, bt_ref, cfg)
        row = row_block * cfg.block_kv
    return ((layer, seq, g) if cfg.has_layer else (seq, g)), row


def _block(cache_refs, lead, row, cfg: Config):
    """Float / int8 kv block: every array's rows of the block."""
    bk = cfg.block_kv
    blk = {}
    for name, ref in cache_refs.items():
        if name in ("k_scale", "v_scale"):  # int8: [.., T]
            blk[name] = ref[(*lead, pl.ds(row, bk))].astype(jnp.float32).reshape(1, bk)
        else:
            blk[name] = ref[(*lead, pl.ds(row, bk), slice(None))]
    return blk


def _kivi_groups(cache_refs, lead, row, cfg: Config):
    """KIVI kv block as its token groups: per group a dict of packed key codes [group, K / n],
    key scales / zeros per part [1, K / n] (strided), and either the value bytes per value
    group [group, gv / n] with scales / zeros [1, group] per value group (`value_chunks` > 1),
    or the value bytes [group, K / n] with scales / zeros [group, K / gv]."""
    grp, n, chunks = cfg.group, cfg.num_parts, cfg.value_chunks
    width = cfg.head_dim // n
    cw = width // chunks  # packed value bytes of one value group
    groups = []
    for i in range(cfg.block_kv // grp):
        rows = (*lead, pl.ds(row + i * grp, grp))
        key_row = (*lead, pl.ds(lax.div(row, grp) + i, 1))
        sub = {"k": cache_refs["k"][(*rows, slice(None))]}
        for name in ("k_scale", "k_zero"):
            ref = cache_refs[name]
            sub[name] = [ref[(*key_row, pl.ds(j, width, stride=n))] for j in range(n)]
        if chunks == 1:
            for name in ("v", "v_scale", "v_zero"):
                sub[name] = cache_refs[name][(*rows, slice(None))]
        else:
            sub["v"] = [cache_refs["v"][(*rows, pl.ds(c * cw, cw))] for c in range(chunks)]
            for name in ("v_scale", "v_zero"):
                ref = cache_refs[name]
                sub[name] = [ref[(*rows, c)].reshape(1, grp) for c in range(chunks)]
        groups.append(sub)
    return groups


# 128 + code as float bits: the code goes into the low mantissa bits of 128.0 (exact for codes
# below 128), so unpacking takes integer and / shift / or and a bitcast, no int-to-float
# conversion. In 16-bit dtypes the offset leaves each dot as one row-sum correction (float32
# accumulation keeps it well below the operands' rounding); float32 codes subtract it (exact),
# as the correction would cost float32 dots a few bits. (integer type, bits of 128.0, shift of
# the code into the mantissa) per compute dtype.
OFFSET = 128.0
_OFFSET_BITS = {
    jnp.dtype(jnp.bfloat16): (jnp.uint16, 0x4300, 0),
    jnp.dtype(jnp.float16): (jnp.uint16, 0x5800, 3),
    jnp.dtype(jnp.float32): (jnp.uint32, 0x43000000, 16),
}


def _offset_codes(packed, bits: int, cd):
    """uint8 [r, C] -> (the 8 / bits parts [r, C] of offset + code in `cd`, offset): part j
    holds code j of each byte (channels j, n + j, ... of the bytes' channels); offset is
    OFFSET in 16-bit dtypes, 0 in float32."""
    utype, magic, shift = _OFFSET_BITS[jnp.dtype(cd)]
    x, mask = packed.astype(utype), (1 << bits) - 1
    parts = [((x >> (bits * j)) & mask) << shift | magic for j in range(8 // bits)]
    parts = [lax.bitcast_convert_type(part, cd) for part in parts]
    if jnp.dtype(cd) == jnp.float32:
        return [part - OFFSET for part in parts], 0.0
    return parts, OFFSET


def _row_sum(x, cd):
    """sum over axis 1 of x as the dot sees it (rounded to `cd`), float32 [rows, 1]."""
    return jnp.sum(x.astype(cd).astype(jnp.float32), axis=1, keepdims=True)


def _kivi_scores(q_parts, sub, cfg: Config):
    """Raw logits [M, group] of one token group: sum_j (q_j * scale_j) . codes_j + q . zero,
    the dot taken on offset + codes and offset * sum(q_j * scale_j) taken back out."""
    cd = q_parts[0].dtype
    codes, offset = _offset_codes(sub["k"], cfg.bits, cd)
    s = zero = None
    for q_j, c_j, scale_j, zero_j in zip(q_parts, codes, sub["k_scale"], sub["k_zero"]):
        q_f32 = q_j.astype(jnp.float32)
        qs_j = (q_f32 * scale_j.astype(jnp.float32)).astype(cd)
        z_j = jnp.sum(q_f32 * zero_j.astype(jnp.float32), axis=1, keepdims=True)
        z_j = z_j - offset * _row_sum(qs_j, cd) if offset else z_j
        s_j = _dot_nt(qs_j, c_j)
        s, zero = (s_j, z_j) if s is None else (s + s_j, zero + z_j)
    return s + zero


def _kivi_values(p, sub, start, limit, cfg: Config, cd):
    """p @ v of one token group, one float32 array per (part, value chunk). Rows at or past
    `limit` get scale and zero 0 (p is 0 there, but 0 * NaN garbage would not be)."""
    grp = cfg.group
    if cfg.value_chunks == 1:
        live_Nx1 = start + lax.broadcasted_iota(jnp.int32, (grp, 1), 0) < limit
        codes, offset = _offset_codes(sub["v"], cfg.bits, cd)
        codes = [c.astype(jnp.float32) - offset for c in codes]
        return dequantized_values(p, codes, sub["v_scale"], sub["v_zero"], live_Nx1, cfg, cd)
    live_1xN = start + lax.broadcasted_iota(jnp.int32, (1, grp), 1) < limit
    chunks = cfg.value_chunks
    out = [None] * (cfg.num_parts * chunks)
    for c in range(chunks):
        scale = jnp.where(live_1xN, sub["v_scale"][c].astype(jnp.float32), 0.0)
        zero = jnp.where(live_1xN, sub["v_zero"][c].astype(jnp.float32), 0.0)
        p_c = (p * scale).astype(cd)  # v = code * scale + zero per token and value group
        zero_c = jnp.sum(p * zero, axis=1, keepdims=True)
        parts, offset = _offset_codes(sub["v"][c], cfg.bits, cd)
        zero_c = zero_c - offset * _row_sum(p_c, cd) if offset else zero_c
        for j, part in enumerate(parts):
            out[j * chunks + c] = _dot_nn(p_c, part) + zero_c
    return out


def _update_kivi(carry, q_parts, groups, start, length, cfg: Config):
    """One online-softmax step over a KIVI kv block, group by group."""
    m_prev, l_prev, accs = carry
    starts = [start + i * cfg.group for i in range(len(groups))]
    scores = [_kivi_scores(q_parts, sub, cfg) for sub in groups]
    m, l, alpha, ps = softmax_step(m_prev, l_prev, scores, starts, length, cfg)
    limit = kernel_limit(length, cfg)
    accs = [alpha * acc for acc in accs]
    for p, sub, first in zip(ps, groups, starts):
        pvs = _kivi_values(p, sub, first, limit, cfg, q_parts[0].dtype)
        accs = [acc + pv for acc, pv in zip(accs, pvs)]
    return m, l, accs


# int8 codes as floats by bits: u = code + 128 (code ^ 0x80) goes into the low mantissa of
# 1024 (float16) or 2^23 (float32), and subtracting 1024 + 128 / 2^23 + 128 leaves the code
# exactly. bfloat16's 8-bit significand cannot hold 1024 + u, so 16-bit compute dtypes take
# float16 operands, each row scaled by a power of 2 into [1, 2) first (exact; no overflow
# whatever q's or p's range). (integer type, bits of the base, base + 128, operand dtype)
_INT8_BITS = {
    16: (jnp.uint16, 0x6400, 1152.0, jnp.float16),
    32: (jnp.uint32, 0x4B000000, 8388736.0, jnp.float32),
}


def _int8_codes(codes, cd):
    """int8 codes [r, K] -> the same values in the dot's operand dtype, without conversion."""
    utype, magic, base, dt = _INT8_BITS[jnp.dtype(cd).itemsize * 8]
    u = lax.bitcast_convert_type(codes, jnp.uint8).astype(utype) ^ 0x80 | magic
    return lax.bitcast_convert_type(u, dt) - jnp.asarray(base, dt)


def _row_normalized(x, cd):
    """(x / 2^e, 2^e) per row, 2^e <= max |x| of the row < 2^(e + 1) (1 for an all-zero row), the
    first in the dot's operand dtype; float32 x passes through unscaled."""
    if jnp.dtype(cd) == jnp.float32:
        return x, None
    top = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    bits = lax.bitcast_convert_type(top, jnp.uint32) & 0x7F800000
    pow2 = jnp.where(top > 0, lax.bitcast_convert_type(bits, jnp.float32), 1.0)
    return (x * (1.0 / pow2)).astype(jnp.float16), pow2


def _update_int8(carry, q, blk, start, length, cfg: Config, cd):
    """One online-softmax step over an int8 block: q (row-normalized, `_row_normalized`) . codes
    times the per-token key scale, then (p * value scale, row-normalized) @ codes."""
    m_prev, l_prev, (acc,) = carry
    q_n, q_pow = q
    s = _dot_nt(q_n, _int8_codes(blk["k"], cd)) * blk["k_scale"]  # [1, bk] f32
    s = s if q_pow is None else s * q_pow
    m, l, alpha, (p,) = softmax_step(m_prev, l_prev, [s], [start], length, cfg)
    live_1xB = start + lax.broadcasted_iota(jnp.int32, (1, cfg.block_kv), 1)
    live_1xB = live_1xB < kernel_limit(length, cfg)
    p_n, p_pow = _row_normalized(p * jnp.where(live_1xB, blk["v_scale"], 0.0), cd)
    pv = _dot_nn(p_n, _int8_codes(blk["v"], cd))
    return m, l, [alpha * acc + (pv if p_pow is None else pv * p_pow)]


def _kernel(lengths_ref, bt_ref, layer_ref, *refs, cfg: Config):
    q_refs, cache_refs, out_refs, lse_ref, _ = unpack_refs(refs, cfg)
    b, g, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    layer = layer_ref[0] if cfg.has_layer else None
    first = s * cfg.blocks_per_split
    stop = jnp.minimum(
        first + cfg.blocks_per_split, pl.cdiv(kernel_limit(length, cfg), cfg.block_kv)
    )
    q_parts = [q_ref[...] for q_ref in q_refs]
    cd = q_parts[0].dtype
    if cfg.kind == "int8":  # once per program
        q_int8 = _row_normalized(q_parts[0].astype(jnp.float32), cd)

    def body(j, carry):
        lead, row = _locate(b, g, j, layer, bt_ref, cfg)
        start = j * cfg.block_kv
        if cfg.kivi:
            groups = _kivi_groups(cache_refs, lead, row, cfg)
            return _update_kivi(carry, q_parts, groups, start, length, cfg)
        blk = _block(cache_refs, lead, row, cfg)
        if cfg.kind == "int8":
            return _update_int8(carry, q_int8, blk, start, length, cfg, cd)
        return update(carry, q_parts, blk, start, length, cfg)

    m, l, accs = lax.fori_loop(first, stop, body, init_state(cfg))
    finalize(m, l, accs, out_refs, lse_ref, cfg.value_chunks)


def forward(q_parts, arrays, lengths, block_table, layer, cfg: Config):
    """Per-split partial outputs and lse (arguments and results in `common.py`)."""
    b, g, m, d = q_parts[0].shape
    row_spec = pl.BlockSpec((None, None, m, d), lambda b, g, s: (b, g, 0, 0))
    out_spec = pl.BlockSpec((None, None, None, m, d), lambda b, g, s: (b, g, s, 0, 0))
    lse_spec = pl.BlockSpec((None, None, None, m, 1), lambda b, g, s: (b, g, s, 0, 0))
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(_kernel, cfg=cfg),
        grid=(b, g, cfg.num_splits),
        in_specs=[whole, whole, whole] + [row_spec] * len(q_parts) + [whole] * len(arrays),
        out_specs=[out_spec] * len(q_parts) + [lse_spec],
        out_shape=out_shapes(b, g, m, cfg),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=cfg.interpret,
        name=f"decode_attention_{cfg.kind}",
    )(lengths, block_table, layer, *q_parts, *arrays)

"""Split-K decode attention as a Pallas Triton kernel: grid (B, G, S), the cache arrays whole in
HBM, each program looping over the live kv blocks of its split (Triton has no scalar prefetch and
no state across programs) and loading pages through the block table inside the loop. The block
math and the contract are in `common.py`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxllm.kernels.decode_attention.common import (
    Config,
    finalize,
    init_state,
    kernel_limit,
    out_shapes,
    page_of,
    unpack_refs,
    update,
)


def _block(cache_refs, b, g, j, layer, bt_ref, cfg: Config):
    """Loads kv block j of sequence b, kv head g from the whole cache arrays."""
    bk, grp = cfg.block_kv, cfg.group
    if cfg.page_size is None:
        seq, row = b, j * bk
    else:
        seq, row_block = page_of(b, j, bt_ref, cfg)
        row = row_block * bk
    lead = (layer, seq, g) if cfg.has_layer else (seq, g)
    blk = {}
    for name, ref in cache_refs.items():
        if cfg.kind == "int8" and name in ("k_scale", "v_scale"):  # [.., T]
            blk[name] = ref[(*lead, pl.ds(row, bk))].astype(jnp.float32).reshape(1, bk)
        elif name in ("k", "v", "v_scale", "v_zero"):  # one row per token
            blk[name] = ref[(*lead, pl.ds(row, bk), slice(None))]
        else:  # KIVI key scale / zero: one row per `group` tokens
            blk[name] = ref[(*lead, pl.ds(lax.div(row, grp), bk // grp), slice(None))]
    return blk


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

    def body(j, carry):
        blk = _block(cache_refs, b, g, j, layer, bt_ref, cfg)
        return update(carry, q_parts, blk, j * cfg.block_kv, length, cfg)

    m, l, accs = lax.fori_loop(first, stop, body, init_state(cfg))
    finalize(m, l, accs, out_refs, lse_ref)


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
        in_specs=[whole, whole, whole, row_spec] + [whole] * len(arrays),
        out_specs=[out_spec, lse_spec],
        out_shape=out_shapes(b, g, m, cfg),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=cfg.interpret,
        name=f"decode_attention_{cfg.kind}",
    )(lengths, block_table, layer, *q_parts, *arrays)

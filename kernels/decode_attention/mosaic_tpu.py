"""Split-K decode attention as a Pallas Mosaic TPU kernel: grid (B, S, blocks per split), one kv
block of all G kv heads per grid step, the online-softmax state in VMEM scratch across the last
("arbitrary") axis. Lengths, block table and layer are scalar prefetched and read by the index
maps (`cache_index_map`): pages and the layer are chosen there, and steps past a sequence's end
repeat its last live block, so they fetch nothing and `pl.when` skips their compute. The block
math and the contract are in `common.py`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxllm.kernels.decode_attention.common import (
    ARRAY_NAMES,
    Config,
    finalize,
    init_state,
    kernel_limit,
    out_shapes,
    page_of,
    unpack_refs,
    update,
)
from jaxllm.kernels.decode_attention.quant import codes_per_byte


def _live_block(b, s, i, lengths_ref, cfg: Config):
    """kv block of grid step (s, i), clamped to the sequence's last live block: steps past the
    end keep the previous block index, so the pipeline issues no DMA for them."""
    j = s * cfg.blocks_per_split + i
    live = pl.cdiv(kernel_limit(lengths_ref[b], cfg), cfg.block_kv)
    return jnp.minimum(j, jnp.maximum(live - 1, 0))


def cache_index_map(cfg: Config, block_ndim: int):
    """Index map of a cache array [L?, B|P, G, rows, ...]: all kv heads, kv block j (its page
    and the row block inside it when paged)."""

    def index_map(b, s, i, lengths_ref, bt_ref, layer_ref):
        j = _live_block(b, s, i, lengths_ref, cfg)
        seq, row = (b, j) if cfg.page_size is None else page_of(b, j, bt_ref, cfg)
        idx = (seq, 0, row) + (0,) * (block_ndim - 3)
        return (layer_ref[0], *idx) if cfg.has_layer else idx

    return index_map


def _array_spec(name: str, cfg: Config):
    bk, g, d = cfg.block_kv, cfg.num_kv_heads, cfg.head_dim
    if name in ("k", "v"):
        block = (None, g, bk, d // codes_per_byte(cfg.kind))
    elif cfg.kind == "int8":  # scales [.., G, T]
        block = (None, g, bk)
    elif name in ("k_scale", "k_zero"):  # one row per `group` tokens
        block = (None, g, bk // cfg.group, d)
    else:
        block = (None, g, bk, d // cfg.value_group)
    lead = (None,) if cfg.has_layer else ()
    return pl.BlockSpec((*lead, *block), cache_index_map(cfg, len(block)))


def _kernel(lengths_ref, bt_ref, layer_ref, *refs, cfg: Config):
    """Grid (B, S, blocks per split): one kv block of all G kv heads per step, so each step
    moves G times more bytes than a per-head grid and per-step overhead is amortized; the heads
    are a static loop of 2-D math inside."""
    del bt_ref, layer_ref  # used by the index maps only
    q_refs, cache_refs, out_refs, lse_ref, (m_ref, l_ref, *acc_refs) = unpack_refs(refs, cfg)
    b, s, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = (s * cfg.blocks_per_split + i) * cfg.block_kv
    length = lengths_ref[b]

    @pl.when(i == 0)
    def _init():
        m0, l0, accs0 = init_state(cfg)
        for g in range(cfg.num_kv_heads):
            m_ref[g], l_ref[g] = m0, l0
            for acc_ref, acc0 in zip(acc_refs, accs0):
                acc_ref[g] = acc0

    @pl.when(start < kernel_limit(length, cfg))
    def _step():
        scales = {}
        if cfg.kind == "int8":  # [G, bk] blocks: one f32 row per head
            scales = {n: cache_refs[n][...].astype(jnp.float32) for n in ("k_scale", "v_scale")}
        for g in range(cfg.num_kv_heads):
            blk = {name: ref[g] for name, ref in cache_refs.items() if name not in scales}
            blk.update({name: x[g : g + 1, :] for name, x in scales.items()})
            carry = (m_ref[g], l_ref[g], [acc_ref[g] for acc_ref in acc_refs])
            m, l, accs = update(carry, [q_ref[g] for q_ref in q_refs], blk, start, length, cfg)
            m_ref[g], l_ref[g] = m, l
            for acc_ref, acc in zip(acc_refs, accs):
                acc_ref[g] = acc

    @pl.when(i == cfg.blocks_per_split - 1)
    def _write():
        for g in range(cfg.num_kv_heads):
            accs = [acc_ref[g] for acc_ref in acc_refs]
            finalize(m_ref[g], l_ref[g], accs, [o.at[g] for o in out_refs], lse_ref.at[g])


def forward(q_parts, arrays, lengths, block_table, layer, cfg: Config):
    """Per-split partial outputs and lse (arguments and results in `common.py`)."""
    b, g, m, width = q_parts[0].shape
    q_spec = pl.BlockSpec((None, g, m, width), lambda b, s, i, *_: (b, 0, 0, 0))
    out_spec = pl.BlockSpec((None, g, None, m, width), lambda b, s, i, *_: (b, 0, s, 0, 0))
    lse_spec = pl.BlockSpec((None, g, None, m, 1), lambda b, s, i, *_: (b, 0, s, 0, 0))
    names = ARRAY_NAMES[cfg.kind]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, cfg.num_splits, cfg.blocks_per_split),
        in_specs=[q_spec] * cfg.num_parts + [_array_spec(n, cfg) for n in names],
        out_specs=[out_spec] * cfg.num_parts + [lse_spec],
        scratch_shapes=[pltpu.VMEM((g, m, 1), jnp.float32), pltpu.VMEM((g, m, 1), jnp.float32)]
        + [pltpu.VMEM((g, m, width), jnp.float32) for _ in range(cfg.num_parts)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, cfg=cfg),
        grid_spec=grid_spec,
        out_shape=out_shapes(b, g, m, cfg),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=cfg.interpret,
        name=f"decode_attention_{cfg.kind}",
    )(lengths, block_table, layer, *q_parts, *arrays)

"""Decode-attention kernels without running them: the Mosaic TPU block schedule (index maps),
default block sizes, lowering for TPU (Mosaic) and CUDA from the CPU jaxlib (`lowering.py`),
and the benchmark script."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jaxllm.kernels.decode_attention import KVCache, decode_attention, quantize_cache
from jaxllm.kernels.decode_attention import common as dk_common
from jaxllm.kernels.decode_attention import mosaic_tpu as dk_mosaic_tpu
from lowering import lower
from test_decode_attention import PER_TOKEN


def test_short_sequences_skip_blocks():
    """TPU index maps clamp past-the-end steps to the last live block (no new DMA), through
    the block table when paged; the kernel body is skipped for them."""
    cfg = dk_common.Config(
        kind="int4",
        group=32,
        head_dim=64,
        num_kv_heads=2,
        seq_len=512,
        block_kv=32,
        num_splits=2,
        blocks_per_split=8,
        num_queries=1,
        num_rows=2,
        sm_scale=1.0,
        soft_cap=None,
        page_size=64,
        num_pages=20,
        has_layer=True,
        backend="mosaic_tpu",
        interpret=True,
    )
    index_map = dk_mosaic_tpu.cache_index_map(cfg, 4)
    lengths = jnp.array([0, 70], jnp.int32)  # int4: 64 tokens in codes -> live blocks 0, 1
    table = jnp.array([[-1] * 8, [9, 4, 7, 1, 2, 3, 5, 6]], jnp.int32).reshape(-1)
    layer = jnp.array([1], jnp.int32)
    got = [
        tuple(int(x) for x in index_map(1, s, i, lengths, table, layer))
        for s in range(2)
        for i in range(8)
    ]
    assert got[:2] == [(1, 9, 0, 0, 0), (1, 9, 0, 1, 0)]
    assert set(got[2:]) == {(1, 9, 0, 1, 0)}
    empty = {tuple(int(x) for x in index_map(0, 1, i, lengths, table, layer)) for i in range(8)}
    assert empty == {(1, 0, 0, 0, 0)}  # a length-0 row reads one (clamped) block


def test_default_blocks_tile_and_divide_pages():
    from jaxllm.kernels.decode_attention.ops import _check_block, default_block_kv

    assert default_block_kv("int8", "mosaic_tpu", 32, 384, paged=True) == 128  # lanes: 128
    assert default_block_kv("int4", "mosaic_tpu", 32, 1536, paged=True) == 512  # 16 * group
    assert default_block_kv("int4", "mosaic_tpu", 32, 96, paged=True) == 96  # the whole page
    assert default_block_kv("bfloat16", "mosaic_tpu", 32, 1000, paged=False) == 256  # edge
    assert default_block_kv("int8", "triton", 32, 6400, paged=False) == 64
    with pytest.raises(ValueError, match="tile"):  # int8 scales [G, T]: 64 lanes do not tile
        _check_block(64, 1024, "int8", 32, "mosaic_tpu", paged=False, interpret=False)
    _check_block(64, 1024, "int8", 32, "mosaic_tpu", paged=False, interpret=True)


# ------------------------------------------------------------------ lowering (CPU jaxlib)


def _abstract_cache(kind, *, b=2, g=2, t=1024, d=128, layers=3, page=None, num_pages=40):
    """ShapeDtypeStructs of a cache (paged with `page`-token pages when given)."""
    zeros = jnp.zeros((b, g, t, d))
    lengths = jnp.zeros((b,), jnp.int32)
    c = jax.eval_shape(lambda: quantize_cache(zeros, zeros, kind, lengths_B=lengths))

    def spec(name, x):
        shape = x.shape
        if page and name in PER_TOKEN:
            shape = (num_pages, shape[1], shape[2] * page // t, *shape[3:])
        return jax.ShapeDtypeStruct((layers, *shape), x.dtype)

    fields = {
        n: spec(n, getattr(c, n))
        for n in (*PER_TOKEN, "k_res", "v_res")
        if getattr(c, n) is not None
    }
    table = jax.ShapeDtypeStruct((b, t // page), jnp.int32) if page else None
    return KVCache(kind=kind, group=c.group, block_table=table, **fields)


LOWERINGS = [  # (platform, backend, custom call the kernel must lower to)
    ("tpu", "mosaic_tpu", "tpu_custom_call"),
    ("cuda", "triton", "__gpu$xla.gpu.triton"),
]


@pytest.mark.parametrize("platform,backend,target", LOWERINGS, ids=[p for p, *_ in LOWERINGS])
@pytest.mark.parametrize("kind", ["int8", "int4", "int2", "bfloat16"])
@pytest.mark.parametrize("page", [None, 256], ids=["contiguous", "paged"])
def test_lowers(platform, backend, target, kind, page):
    cache = _abstract_cache(kind, page=page)
    q = jax.ShapeDtypeStruct((2, 2, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)

    def fwd(q, cache, lengths, layer):
        return decode_attention(q, cache, lengths, layer=layer, soft_cap=30.0, backend=backend)

    lowered = lower(fwd, q, cache, lengths, layer, platform=platform)
    text = lowered.as_text()
    assert text.count(target) == 1


def _bench():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_decode_script_runs_interpreted():
    bench = _bench()
    rows = bench.main(
        "--kinds bfloat16,int4 --contexts 64 --batch 2 --heads 4 --kv-heads 2 --head-dim 64 "
        "--page-size 32 --block-kv 32 --interpret --warmup 1 --iters 1".split()
    )
    assert [r["kind"] for r in rows] == ["bfloat16", "int4"]
    assert rows[1]["bytes"] < rows[0]["bytes"] and rows[1]["speedup"] > 0
    assert all(r["gb_per_s"] == pytest.approx(r["bytes"] / r["ms"] / 1e6) for r in rows)


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4", "int2"])
def test_bench_decode_counts_the_bytes_the_cache_holds(kind):
    """GB/s per kind divides the bytes of the arrays a full cache holds (codes, scales and
    zeros at their stored dtypes, the KIVI residual), not a nominal size."""
    bench, sizes = _bench(), dict(batch=2, kv_heads=2, context=128, head_dim=64, group=32)
    cache = jax.eval_shape(
        lambda: bench.random_cache(jax.random.key(0), kind, page_size=0, **sizes)
    )
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert bench.bytes_per_step(kind, **sizes) == held

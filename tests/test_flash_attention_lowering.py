"""Lowering of the FlashAttention kernels for TPU (Mosaic) and CUDA (Triton) from the CPU
jaxlib (`lowering.py`); for the Mosaic TPU kernels also their block
schedule (masked blocks skipped without a new DMA) and that their per-step VMEM blocks do not
grow with the sequence length (32k tokens). The Mosaic GPU kernels have their own file.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.kernels import flash_attention, flash_attention_backward
from jaxllm.kernels.flash_attention import common, mosaic_tpu
from jaxllm.kernels.flash_attention.reference import reference_mask
from lowering import lower

LOWERINGS = [  # (platform, backend, custom call the kernels must lower to)
    ("tpu", "mosaic_tpu", "tpu_custom_call"),
    ("cuda", "triton", "__gpu$xla.gpu.triton"),
]


@pytest.mark.parametrize("platform,backend,target", LOWERINGS, ids=[p for p, *_ in LOWERINGS])
@pytest.mark.parametrize(
    "dtype,l,g,k,kw",
    [
        (
            jnp.bfloat16,
            256,
            2,
            128,
            dict(causal=True, segment_ids=True, sliding_window=100, soft_cap=30.0),
        ),
        (jnp.float32, 200, 8, 64, dict(causal=True)),
    ],
    ids=["bf16-all_masks", "f32-odd_len"],
)
def test_lowers(platform, backend, target, dtype, l, g, k, kw):
    q = jax.ShapeDtypeStruct((2, l, 8, k), dtype)
    kv = jax.ShapeDtypeStruct((2, l, g, k), dtype)
    ids = jax.ShapeDtypeStruct((2, l), jnp.int32)
    kw = dict(kw, backend=backend)
    use_ids = kw.pop("segment_ids", False)

    def fwd(q, k, v, ids):
        return flash_attention(q, k, v, segment_ids=ids if use_ids else None, **kw)

    def loss(q, k, v, ids):
        return fwd(q, k, v, ids).astype(jnp.float32).sum()

    def block_grads(q, k, v, ids):  # the ring's backward: statistics from outside the block
        lse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
        return flash_attention_backward(
            q, k, v, q, lse, q, segment_ids=ids if use_ids else None, **kw
        )

    grads = jax.value_and_grad(loss, argnums=(0, 1, 2))
    for fn, calls in ((fwd, 1), (grads, 3), (block_grads, 2)):
        lowered = lower(fn, q, kv, kv, ids, platform=platform)
        assert lowered.as_text().count(target) >= calls


# ---------------------------------------------------- Mosaic TPU grid schedule and VMEM use

# (L, S, block_q, block_kv, causal, sliding_window)
SCHEDULES = [
    (88, 88, 16, 32, True, None),
    (88, 88, 32, 8, True, 20),
    (88, 88, 16, 8, False, 20),
    (100, 100, 32, 32, False, None),
    (56, 88, 16, 32, True, None),
    (88, 40, 8, 16, False, 16),
    (40, 88, 8, 16, False, 3),
]


@pytest.mark.parametrize("l,s,bq,bk,causal,window", SCHEDULES)
def test_mosaic_tpu_schedule_visits_each_visible_block_once(l, s, bq, bk, causal, window):
    """Each row block's inner steps visit exactly the blocks of the other sequence that hold a
    visible entry, each once, then repeat the last one (no compute, no new DMA); a visited block
    skips the per-element mask exactly when every entry of it is visible."""
    cfg = common.Config(
        block_q=bq,
        block_kv=bk,
        q_len=l,
        kv_len=s,
        causal=causal,
        sliding_window=window,
        soft_cap=None,
        sm_scale=1.0,
        has_segments=False,
        backend="mosaic_tpu",
        interpret=True,
    )
    lp, sp = -(-l // bq) * bq, -(-s // bk) * bk
    nq, nk = lp // bq, sp // bk
    band_LpxSp = np.asarray(reference_mask(lp, sp, causal=causal, sliding_window=window)[0])
    real_q, real_k = np.arange(lp)[:, None] < l, np.arange(sp)[None, :] < s

    def per_block(mask_LpxSp, reduce):
        return reduce(mask_LpxSp.reshape(nq, bq, nk, bk), axis=(1, 3))  # [nq, nk]

    q_start, k_start = jnp.arange(nq)[:, None] * bq, jnp.arange(nk)[None, :] * bk
    # forward / dq: q blocks are the rows; dk/dv: kv blocks are, and padded queries are masked.
    for block_range, rows, cols, visible, full, needs_mask in (
        (
            common.kv_block_range,
            nq,
            nk,
            per_block(band_LpxSp, np.any),
            per_block(band_LpxSp & real_k, np.all),
            mosaic_tpu._needs_mask(q_start, k_start, cfg, pad_q=False),
        ),
        (
            common.q_block_range,
            nk,
            nq,
            per_block(band_LpxSp, np.any).T,
            per_block(band_LpxSp & real_k & real_q, np.all).T,
            mosaic_tpu._needs_mask(q_start, k_start, cfg, pad_q=True).T,
        ),
    ):
        steps, num_visited = mosaic_tpu._schedule(block_range, rows, cols, cfg)
        index, vis = mosaic_tpu._visited(
            block_range, jnp.arange(rows)[:, None], jnp.arange(steps)[None, :], cfg, cols
        )
        index, vis = np.broadcast_to(index, (rows, steps)), np.broadcast_to(vis, (rows, steps))
        assert num_visited == visible.sum() and steps == max(1, visible.sum(axis=1).max())
        for i in range(rows):
            count = int(vis[i].sum())
            assert np.all(vis[i, :count]) and list(index[i, :count]) == list(
                np.flatnonzero(visible[i])
            )
            assert np.all(index[i, count:] == index[i, max(count - 1, 0)])  # no new block fetched
            assert 0 <= index[i].min() and index[i].max() < cols
        np.testing.assert_array_equal(np.broadcast_to(needs_mask, full.shape), ~full)


def _pallas_calls(jaxpr):
    """The pallas_call equations of a jaxpr, in its sub-jaxprs too (custom_vjp, pjit, cond)."""

    def subjaxprs(value):
        if hasattr(value, "eqns"):
            yield value
        elif hasattr(getattr(value, "jaxpr", None), "eqns"):
            yield value.jaxpr
        elif isinstance(value, (tuple, list)):
            for item in value:
                yield from subjaxprs(item)

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for value in eqn.params.values():
            for sub in subjaxprs(value):
                yield from _pallas_calls(sub)


def _step_bytes(eqn) -> int:
    """VMEM bytes of one grid step of a pallas_call: its input / output blocks and scratch."""
    grid_mapping = eqn.params["grid_mapping"]
    avals = [bm.transformed_block_aval for bm in grid_mapping.block_mappings]
    avals += list(grid_mapping.scratch_avals)
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in avals)


@pytest.mark.parametrize("window", [None, 4096], ids=["causal", "causal_window"])
def test_long_sequence_lowers_for_tpu_with_vmem_independent_of_length(window):
    """32k tokens, head dim 128, bf16, GQA 4, packed segments: forward, dq and dk/dv lower for TPU
    with the same per-step blocks and scratch as at 1k tokens (only the grid grows), and a
    sliding window keeps the inner grid axis at about window / block_kv steps."""

    def kernels_at(length):
        q = jax.ShapeDtypeStruct((1, length, 16, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, length, 4, 128), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((1, length), jnp.int32)

        def loss(q, k, v, ids):
            out = flash_attention(
                q, k, v, causal=True, segment_ids=ids, sliding_window=window, backend="mosaic_tpu"
            )
            return out.astype(jnp.float32).sum()

        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, ids)
        assert traced.lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") >= 3
        calls = list(_pallas_calls(traced.jaxpr.jaxpr))
        assert len(calls) == 3  # forward, dq, dk/dv
        return [(eqn.params["grid_mapping"].grid, _step_bytes(eqn)) for eqn in calls]

    short, long = kernels_at(1024), kernels_at(32768)
    assert [b for _, b in long] == [b for _, b in short]
    assert all(b < 512 * 1024 for _, b in long)  # a few [128, 128] tiles, double-buffered or not
    fwd_grid, dq_grid, dkdv_grid = (grid for grid, _ in long)
    assert fwd_grid == dq_grid and fwd_grid[:3] == (1, 16, 256) and dkdv_grid[:4] == (1, 4, 256, 4)
    inner = 256 if window is None else window // 128 + 1
    assert fwd_grid[3] == inner and dkdv_grid[4] == inner


def test_bench_attention_script_runs_interpreted():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(
        "--impls flash,xla,cudnn --seqs 64 --tokens 64 --hidden 128 --head-dim 64 --kv-heads 1 "
        "--block-q 32 --block-kv 32 --dtype float32 --interpret --warmup 1 --iters 1".split()
    )
    ok = {r["impl"]: r for r in rows if "error" not in r}
    assert set(ok) >= {"flash", "xla"}
    assert all(ok[i]["fwd_tflops"] > 0 and ok[i]["fwd_bwd_tflops"] > 0 for i in ok)
    assert [r["impl"] for r in rows] == ["flash", "xla", "cudnn"]  # cudnn reported, not dropped

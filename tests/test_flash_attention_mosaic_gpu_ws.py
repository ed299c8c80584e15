"""The warp-specialised Mosaic GPU forward (`mosaic_gpu_ws.py`, `BlockSizes(warp_specialized=
True)`) vs the float32 reference, on CPU.

The Mosaic GPU interpreter runs its three warpgroups (two consumers, one TMA producer) as
threads: the consumed barriers back to the producer, the ping-pong schedule barrier and the
slots' TMA barriers all execute, and one test runs the race detector over the slots. Gradients
go through the backward kernels (`mosaic_gpu_backward.py`) at their default blocks. Lowering
for CUDA from the CPU jaxlib checks the compiled form (p from registers, the carried
accumulator, register budgets) up to the kernel module, shared-memory budget included; its
numerics on a GPU are in `test_gpu.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_inputs import inputs as _inputs
from attention_inputs import packed_ids as _packed_ids
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax._src.pallas.mosaic_gpu.interpret.params import (
    InterpretGPUParams,
    force_gpu_interpret_mode,
)
from jaxllm.kernels import (
    MASK_VALUE,
    BlockSizes,
    flash_attention,
    flash_attention_reference,
    flash_attention_reference_with_lse,
    flash_attention_with_lse,
)
from lowering import lower

TOL = {jnp.bfloat16: dict(out=2e-2, grad=5e-2), jnp.float16: dict(out=5e-3, grad=1e-2)}
WS_NAME = "flash_attention_fwd_ws_mgpu"


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _ws(block_q=128, block_kv=64):
    return BlockSizes(block_q, block_kv, warp_specialized=True)


def _check(dtype, b, l, h, g, k, *, s=None, blocks=(128, 64), grads=True, **kw):
    s = l if s is None else s
    q, k_, v, do = _inputs(b, l, s, h, g, k, dtype)
    opts = dict(backend="mosaic_gpu", interpret=True, block_sizes=_ws(*blocks))

    def kern(q, k_, v):
        return flash_attention(q, k_, v, **opts, **kw)

    def ref(q, k_, v):
        return flash_attention_reference(q, k_, v, **kw)

    # the warp-specialised kernel is the one that runs
    assert WS_NAME in str(jax.make_jaxpr(kern)(q, k_, v))

    @jax.jit
    def outputs_and_grads(q, k_, v, do):
        out, vjp = jax.vjp(kern, q, k_, v)
        out_ref, vjp_ref = jax.vjp(ref, q, k_, v)
        return out, out_ref, (vjp(do), vjp_ref(do)) if grads else None

    out, out_ref, both = outputs_and_grads(q, k_, v, do)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOL[dtype]
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(out_ref), atol=tol["out"], rtol=tol["out"])
    for name, got, want in zip(("dq", "dk", "dv"), *(both or ((), ()))):
        assert np.all(np.isfinite(f32(got))), name
        np.testing.assert_allclose(
            f32(got), f32(want), atol=tol["grad"], rtol=tol["grad"], err_msg=name
        )
    return out


# (id, dtype, B, L, H, G, K, kwargs): two program tiles or more, and more kv blocks per tile
# than slots, so the producer waits on the consumed barriers and refills every slot.
CASES = [
    ("causal_gqa2_odd", jnp.bfloat16, 1, 200, 4, 2, 64, dict(causal=True)),
    (
        "all_masks_odd",
        jnp.bfloat16,
        1,
        230,
        2,
        1,
        64,
        dict(causal=True, segment_ids="packed", sliding_window=70, soft_cap=3.0),
    ),
    ("full_mha_no_mask", jnp.bfloat16, 1, 256, 2, 2, 64, {}),  # every block unmasked
    # windows: blocks at the window's edges masked, those inside not
    ("causal_window", jnp.bfloat16, 1, 256, 2, 1, 64, dict(causal=True, sliding_window=100)),
    ("window_two_sided_odd", jnp.bfloat16, 1, 250, 2, 1, 64, dict(sliding_window=90)),
    (  # padded rows / keys beyond the backward's 64-row blocks: 192 -> 256
        "f16_full_k128_kv128",
        jnp.float16,
        1,
        192,
        2,
        2,
        128,
        dict(blocks=(128, 128)),
    ),
]


@pytest.mark.parametrize("dtype,b,l,h,g,k,kw", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_matches_reference(dtype, b, l, h, g, k, kw):
    kw = dict(kw)
    if kw.get("segment_ids") == "packed":
        kw["segment_ids"] = _packed_ids(b, l, [17, 90, 91, 180])
    _check(dtype, b, l, h, g, k, **kw)


def test_cross_attention_empty_rows_and_window_without_causality():
    """L != S, a (q_ids, kv_ids) pair, a padded kv tail and a two-sided window: the queries of
    segment 9 see no key and give 0, not NaN; the 256-row tile has 128 rows per consumer."""
    b, l, s = 1, 256, 150
    q_ids = jnp.concatenate([jnp.zeros((b, 200), jnp.int32), jnp.full((b, 56), 9, jnp.int32)], 1)
    kv_ids = _packed_ids(b, s, [60])
    out = _check(
        jnp.float16,
        b,
        l,
        2,
        1,
        64,
        s=s,
        blocks=(256, 64),
        grads=False,
        segment_ids=(q_ids, kv_ids),
        sliding_window=100,
    )
    np.testing.assert_array_equal(np.asarray(out[:, 200:], np.float32), 0.0)


def test_lse_matches_reference_and_carries_sinks():
    """The kernel's logsumexp (rows with no visible key: MASK_VALUE) against the reference's,
    and gpt-oss sinks, which re-normalize (out, lse) outside the kernel."""
    b, l, h = 1, 200, 2
    q, k, v, _ = _inputs(b, l, l, h, 1, 64, jnp.bfloat16)
    ids = jnp.concatenate([jnp.full((b, 150), 1, jnp.int32), jnp.full((b, 50), 2, jnp.int32)], 1)
    masks = dict(causal=True, sliding_window=120, segment_ids=(ids, jnp.ones_like(ids)))
    opts = dict(backend="mosaic_gpu", interpret=True, block_sizes=_ws())
    _, lse = jax.jit(lambda *a: flash_attention_with_lse(*a, **opts, **masks))(q, k, v)
    _, lse_ref = flash_attention_reference_with_lse(q, k, v, **masks)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-4, rtol=1e-4)
    assert np.all(np.asarray(lse[:, :, 150:]) == MASK_VALUE)
    sinks = jnp.array([0.5, -1.0], jnp.float32)
    masks = dict(causal=True, sinks=sinks)
    got = jax.jit(lambda *a: flash_attention(*a, **opts, **masks))(q, k, v)
    want = flash_attention_reference(q, k, v, **masks)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


def test_warpgroups_have_no_races():
    """The race detector sees the consumers' SMEM reads against the producer's TMA refills."""
    with force_gpu_interpret_mode(InterpretGPUParams(detect_races=True)):
        ids = _packed_ids(1, 256, [70])
        _check(jnp.bfloat16, 1, 256, 2, 1, 64, grads=False, causal=True, segment_ids=ids)
    assert not interpret_pallas_call.get_races().races_found


def test_rejects_bad_blocks_and_backends():
    q, k, v, _ = _inputs(1, 256, 256, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128"):
        flash_attention(q, k, v, backend="mosaic_gpu", interpret=True, block_sizes=_ws(192))
    with pytest.raises(ValueError, match="needs backend 'mosaic_gpu'"):
        flash_attention(q, k, v, backend="triton", interpret=True, block_sizes=_ws())


@pytest.mark.parametrize(
    "dtype,l,g,k,blocks,kw",
    [
        (
            jnp.bfloat16,
            256,
            2,
            128,
            (128, 128),
            dict(causal=True, segment_ids=True, sliding_window=100, soft_cap=30.0),
        ),
        (jnp.float16, 200, 8, 64, (256, 64), dict(causal=True)),
        (jnp.bfloat16, 512, 1, 128, (256, 64), dict(segment_ids=True)),
    ],
    ids=["bf16-all_masks-k128-kv128", "f16-odd_len-q256", "bf16-mqa-k128-q256-packed"],
)
def test_lowers_for_cuda(dtype, l, g, k, blocks, kw):
    """Forward (the warp-specialised kernel) and backward (its 2 kernels) lower within Hopper's
    shared memory, with p fed from registers."""
    q = jax.ShapeDtypeStruct((2, l, 8, k), dtype)
    kv = jax.ShapeDtypeStruct((2, l, g, k), dtype)
    ids = jax.ShapeDtypeStruct((2, l), jnp.int32)
    use_ids = kw.pop("segment_ids", False) if (kw := dict(kw)) else False

    def fwd(q, k, v, ids):
        segment_ids = ids if use_ids else None
        return flash_attention(
            q, k, v, segment_ids=segment_ids, backend="mosaic_gpu", block_sizes=_ws(*blocks), **kw
        )

    def loss(q, k, v, ids):
        return fwd(q, k, v, ids).astype(jnp.float32).sum()

    text = lower(fwd, q, kv, kv, ids, platform="cuda").as_text()
    assert text.count("mosaic_gpu_v2") == 1 and WS_NAME in text
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    assert lower(grad, q, kv, kv, ids, platform="cuda").as_text().count("mosaic_gpu_v2") == 3


def test_bench_attention_times_the_warp_specialised_forward():
    """`scripts/bench_attention.py --impls flash_ws` runs this forward (interpreted here)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fn = bench.attention_fn(
        "flash_ws", causal=True, flash_backend=None, block_sizes=_ws(), interpret=True
    )
    x = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    assert WS_NAME in str(jax.make_jaxpr(fn)(x, x, x))
    rows = bench.main(
        "--impls flash_ws --seqs 128 --tokens 128 --hidden 64 --head-dim 64 --block-q 128 "
        "--block-kv 64 --interpret --warmup 0 --iters 1".split()
    )
    assert [r["impl"] for r in rows] == ["flash_ws"] and rows[0]["fwd_bwd_tflops"] > 0

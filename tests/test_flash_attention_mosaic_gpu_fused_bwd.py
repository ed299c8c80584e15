"""The fused Mosaic GPU backward (`mosaic_gpu_fused_backward.py`, `BlockSizes(fused_backward=
True)`) vs the float32 reference, on CPU.

The Mosaic GPU interpreter runs every line of the kernel: the q-block pipeline, the five wgmmas
per block and the dq^T accumulation into the zero-initialised float32 GMEM buffer (there as a
read-modify-write: the interpreter has no TMA reductions and runs programs one at a time). One
test runs the race detector. Lowering for CUDA from the CPU jaxlib checks the compiled form (the
TMA reduce-add store, shared memory within Hopper's budget); its numerics on a GPU are in
`test_gpu.py`.
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
    BlockSizes,
    flash_attention,
    flash_attention_backward,
    flash_attention_reference,
    flash_attention_reference_with_lse,
    flash_attention_with_lse,
)
from lowering import lower

TOL = {jnp.bfloat16: 5e-2, jnp.float16: 1e-2}
FUSED_NAME = "flash_attention_bwd_fused_mgpu"
FA2_NAMES = ("flash_attention_dq_mgpu", "flash_attention_dkdv_mgpu")


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _f32(x):
    return np.asarray(x, np.float32)


def _grads(kern, ref, q, k, v, do):
    @jax.jit
    def both(q, k, v, do):
        return jax.vjp(kern, q, k, v)[1](do), jax.vjp(ref, q, k, v)[1](do)

    return both(q, k, v, do)


def _check(dtype, b, l, h, g, k, *, s=None, sizes=BlockSizes(64, 64, fused_backward=True), **kw):
    s = l if s is None else s
    q, k_, v, do = _inputs(b, l, s, h, g, k, dtype)
    opts = dict(backend="mosaic_gpu", interpret=True, block_sizes=sizes)

    def kern(q, k_, v):
        return flash_attention(q, k_, v, **opts, **kw)

    def ref(q, k_, v):
        return flash_attention_reference(q, k_, v, **kw)

    # the fused kernel runs, and the two FlashAttention-2 kernels do not
    jaxpr = str(jax.make_jaxpr(lambda *a: jax.vjp(kern, *a)[1](do))(q, k_, v))
    assert FUSED_NAME in jaxpr and not any(name in jaxpr for name in FA2_NAMES)
    got, want = _grads(kern, ref, q, k_, v, do)
    for name, a, w, x in zip(("dq", "dk", "dv"), got, want, (q, k_, v)):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        assert np.all(np.isfinite(_f32(a))), name
        np.testing.assert_allclose(_f32(a), _f32(w), atol=TOL[dtype], rtol=TOL[dtype], err_msg=name)
    return got


# (id, dtype, B, L, H, G, K, kwargs): several q blocks per kv block (the pipeline refills its
# slots) and several kv blocks adding into each q block's dq.
CASES = [
    ("causal_gqa2_odd", jnp.bfloat16, 1, 200, 4, 2, 64, dict(causal=True)),
    ("full_mqa_b2", jnp.bfloat16, 2, 128, 2, 1, 64, {}),
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
]
SLOW_CASES = [
    ("window_two_sided_f16", jnp.float16, 1, 250, 2, 1, 64, dict(sliding_window=90)),
    ("f16_k128_causal", jnp.float16, 1, 192, 2, 2, 128, dict(causal=True)),
]


def _params(cases, *marks):
    return [pytest.param(*c[1:], id=c[0], marks=marks) for c in cases]


@pytest.mark.parametrize(
    "dtype,b,l,h,g,k,kw", _params(CASES) + _params(SLOW_CASES, pytest.mark.slow)
)
def test_gradients_match_reference(dtype, b, l, h, g, k, kw):
    kw = dict(kw)
    if kw.get("segment_ids") == "packed":
        kw["segment_ids"] = _packed_ids(b, l, [17, 90, 91, 180])
    _check(dtype, b, l, h, g, k, **kw)


def test_with_warp_specialised_forward_lse_cotangent_and_empty_rows():
    """Under the warp-specialised forward (128-row tiles; the backward at 64 / 64), through
    `flash_attention_with_lse` (the lse's cotangent enters delta), with cross-attention segment
    ids that leave the last queries without a key: their dq is exactly 0, never NaN."""
    b, l, s, h = 1, 256, 150, 2
    q, k, v, do = _inputs(b, l, s, h, 1, 64, jnp.float16)
    q_ids = jnp.concatenate([jnp.zeros((b, 200), jnp.int32), jnp.full((b, 56), 9, jnp.int32)], 1)
    masks = dict(segment_ids=(q_ids, _packed_ids(b, s, [60])), sliding_window=100)
    sizes = BlockSizes(128, 128, warp_specialized=True, fused_backward=True)
    opts = dict(backend="mosaic_gpu", interpret=True, block_sizes=sizes)
    dlse = jax.random.normal(jax.random.key(5), (b, h, l), jnp.float32)

    def loss(fn, **o):
        def f(q, k, v):
            out, lse = fn(q, k, v, **masks, **o)
            return jnp.sum(out.astype(jnp.float32) * do) + jnp.sum(lse * dlse)

        return f

    got = jax.jit(jax.grad(loss(flash_attention_with_lse, **opts), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(flash_attention_reference_with_lse), argnums=(0, 1, 2))(q, k, v)
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(_f32(a), _f32(w), atol=2e-2, rtol=2e-2, err_msg=name)
    np.testing.assert_array_equal(_f32(got[0][:, 200:]), 0.0)


@pytest.mark.slow  # 9 s; the lse cotangent path is also in the warp-specialised test
def test_backward_from_statistics_matches_fa2_kernels():
    """`flash_attention_backward` (out / lse given, as a ring backward calls it) agrees with the
    FlashAttention-2 kernels to float32 accumulation order."""
    q, k, v, do = _inputs(1, 192, 192, 4, 2, 64, jnp.bfloat16)
    masks = dict(causal=True, soft_cap=5.0)
    out, lse = flash_attention_reference_with_lse(q, k, v, **masks)
    out = out.astype(q.dtype)

    def run(**flags):
        opts = dict(backend="mosaic_gpu", interpret=True, block_sizes=BlockSizes(64, 64, **flags))
        return jax.jit(lambda *a: flash_attention_backward(*a, **masks, **opts))(
            q, k, v, out, lse, do
        )

    for name, a, w in zip(("dq", "dk", "dv"), run(fused_backward=True), run()):
        np.testing.assert_allclose(_f32(a), _f32(w), atol=1e-2, rtol=1e-2, err_msg=name)


def test_has_no_races():
    """The race detector over the q-block slots and the dq^T read-modify-writes."""
    with force_gpu_interpret_mode(InterpretGPUParams(detect_races=True)):
        _check(jnp.bfloat16, 1, 192, 2, 1, 64, causal=True, segment_ids=_packed_ids(1, 192, [70]))
    assert not interpret_pallas_call.get_races().races_found


def test_rejects_other_backends():
    q, k, v, _ = _inputs(1, 128, 128, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="fused_backward needs backend 'mosaic_gpu'"):
        sizes = BlockSizes(64, 64, fused_backward=True)
        flash_attention(q, k, v, backend="triton", interpret=True, block_sizes=sizes)


@pytest.mark.parametrize(
    "dtype,l,g,k,sizes,kw",
    [
        (
            jnp.bfloat16,
            256,
            2,
            128,
            BlockSizes(64, 64, fused_backward=True),
            dict(causal=True, segment_ids=True, sliding_window=100, soft_cap=30.0),
        ),
        (jnp.float16, 200, 8, 64, BlockSizes(128, 128, True, fused_backward=True), {}),
    ],
    ids=["bf16-all_masks-k128", "f16-odd_len-ws_forward"],
)
def test_lowers_for_cuda(dtype, l, g, k, sizes, kw):
    """The backward is one kernel with TMA reduce-add stores, within Hopper's shared memory."""
    q = jax.ShapeDtypeStruct((2, l, 8, k), dtype)
    kv = jax.ShapeDtypeStruct((2, l, g, k), dtype)
    ids = jax.ShapeDtypeStruct((2, l), jnp.int32)
    use_ids = kw.pop("segment_ids", False) if (kw := dict(kw)) else False

    def loss(q, k, v, ids):
        segment_ids = ids if use_ids else None
        out = flash_attention(
            q, k, v, segment_ids=segment_ids, backend="mosaic_gpu", block_sizes=sizes, **kw
        )
        return out.astype(jnp.float32).sum()

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    text = lower(grad, q, kv, kv, ids, platform="cuda").as_text()
    assert text.count("mosaic_gpu_v2") == 2  # the forward and one backward kernel, not two


@pytest.mark.slow  # 23 s: the bench times the interpreted kernels
def test_bench_attention_times_the_fused_backward():
    """`scripts/bench_attention.py --impls flash_ws_fused` runs it (interpreted here)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(
        "--impls flash_ws_fused --seqs 128 --tokens 128 --hidden 64 --head-dim 64 --interpret "
        "--warmup 0 --iters 1".split()
    )
    assert [r["impl"] for r in rows] == ["flash_ws_fused"] and rows[0]["fwd_bwd_tflops"] > 0
    sizes = BlockSizes(128, 128, True, fused_backward=True)
    fn = bench.attention_fn(
        "flash_ws_fused", causal=True, flash_backend=None, block_sizes=sizes, interpret=True
    )
    x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    assert FUSED_NAME in str(jax.make_jaxpr(lambda x: jax.vjp(fn, x, x, x)[1](x))(x))

"""On a CUDA GPU: the kernels against their references, and train steps per attention_impl.

Marked `gpu` (never in CPU CI). Run on a GPU machine with the CUDA platform selected:

    JAX_PLATFORMS=cuda python -m pytest -m gpu -n 0 tests/test_gpu.py

The CPU suite runs the same kernels in the Pallas interpreters; here they are compiled for the
device (PTX, wgmma, TMA) and must agree with the float32 references on the same rounded inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_inputs import inputs as _inputs
from attention_inputs import packed_ids as _packed_ids
from conftest import tiny_model
from jaxllm.kernels import BlockSizes, flash_attention, flash_attention_reference
from jaxllm.kernels.decode_attention import decode_attention
from test_decode_attention import LENGTHS, _build, _reference, f32

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.train import loss_scale
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout

pytestmark = pytest.mark.gpu

TOL = {jnp.bfloat16: dict(out=2e-2, grad=5e-2), jnp.float16: dict(out=5e-3, grad=1e-2)}


@pytest.fixture(scope="module", autouse=True)
def _on_a_gpu():
    assert jax.default_backend() == "gpu", (
        "the gpu tests need a CUDA device: JAX_PLATFORMS=cuda python -m pytest -m gpu ..."
    )


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


FLASH_CASES = [
    # id, backend, dtype, (b, l, h, g, k), kwargs
    ("mgpu-bf16-causal-gqa-k128", "mosaic_gpu", jnp.bfloat16, (2, 1024, 8, 2, 128), {}),
    ("mgpu-bf16-causal-k64-packed", "mosaic_gpu", jnp.bfloat16, (2, 512, 4, 4, 64), {"seg": 1}),
    (
        "mgpu-f16-window-cap",
        "mosaic_gpu",
        jnp.float16,
        (1, 768, 4, 1, 128),
        {"sliding_window": 200, "soft_cap": 30.0},
    ),
    ("mgpu-bf16-full", "mosaic_gpu", jnp.bfloat16, (2, 384, 4, 2, 128), {"causal": False}),
    (  # the warp-specialised forward (mosaic_gpu_ws.py), 128-row tiles
        "mgpu-ws-bf16-causal-gqa-k128",
        "mosaic_gpu",
        jnp.bfloat16,
        (2, 1024, 8, 2, 128),
        {"blocks": BlockSizes(128, 128, warp_specialized=True)},
    ),
    (
        "mgpu-ws-f16-packed-window-cap-odd",
        "mosaic_gpu",
        jnp.float16,
        (1, 700, 4, 1, 128),
        {"seg": 1, "sliding_window": 200, "soft_cap": 30.0, "blocks": BlockSizes(256, 64, True)},
    ),
    (  # the fused backward (mosaic_gpu_fused_backward.py): TMA reduce-add of dq
        "mgpu-fused-bwd-bf16-causal-gqa-k128",
        "mosaic_gpu",
        jnp.bfloat16,
        (2, 1024, 8, 2, 128),
        {"blocks": BlockSizes(64, 64, fused_backward=True)},
    ),
    (
        "mgpu-ws-fused-bwd-f16-packed-window-cap-odd",
        "mosaic_gpu",
        jnp.float16,
        (1, 700, 4, 1, 64),
        {
            "seg": 1,
            "sliding_window": 200,
            "soft_cap": 30.0,
            "blocks": BlockSizes(128, 128, True, fused_backward=True),
        },
    ),
    ("triton-bf16-causal-gqa", "triton", jnp.bfloat16, (2, 1024, 8, 2, 128), {}),
    (
        "triton-bf16-packed-window",
        "triton",
        jnp.bfloat16,
        (2, 512, 4, 2, 64),
        {"seg": 1, "sliding_window": 128},
    ),
]


@pytest.mark.parametrize(
    "backend,dtype,shape,kw", [c[1:] for c in FLASH_CASES], ids=[c[0] for c in FLASH_CASES]
)
def test_flash_forward_backward_match_reference(backend, dtype, shape, kw):
    b, l, h, g, k = shape
    kw = dict(kw)
    kw.setdefault("causal", True)
    if kw.pop("seg", None):
        kw["segment_ids"] = _packed_ids(b, l, [l // 5, l // 2, l - 70])
    q, k_, v, do = _inputs(b, l, l, h, g, k, dtype, seed=l + k)
    blocks = kw.pop("blocks", BlockSizes(64, 64) if backend == "triton" else None)

    @jax.jit
    def both(q, k_, v, do):
        out, vjp = jax.vjp(
            lambda *a: flash_attention(*a, backend=backend, block_sizes=blocks, **kw), q, k_, v
        )
        up = [x.astype(jnp.float32) for x in (q, k_, v)]
        out_ref, vjp_ref = jax.vjp(lambda *a: flash_attention_reference(*a, **kw), *up)
        return out, out_ref, vjp(do), vjp_ref(do.astype(jnp.float32))

    out, out_ref, grads, grads_ref = both(q, k_, v, do)
    assert out.dtype == dtype and out.shape == q.shape
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    tol = TOL[dtype]
    assert _rel(out, out_ref) < tol["out"], _rel(out, out_ref)
    for name, gk, gr in zip("qkv", grads, grads_ref, strict=True):
        assert np.all(np.isfinite(np.asarray(gk, np.float32))), name
        assert _rel(gk, gr) < tol["grad"], (name, _rel(gk, gr))


DECODE_CASES = [
    # id, kind, backend, G, R, Q, layers, paged, dtype, head dim
    ("mgpu-bf16-gqa4", "bfloat16", "mosaic_gpu", 2, 4, 1, None, False, jnp.bfloat16, 128),
    ("mgpu-int8-paged-layer", "int8", "mosaic_gpu", 2, 2, 2, 2, True, jnp.bfloat16, 128),
    ("mgpu-int4-mqa", "int4", "mosaic_gpu", 1, 4, 1, None, False, jnp.bfloat16, 128),
    ("triton-bf16", "bfloat16", "triton", 2, 4, 1, None, False, jnp.bfloat16, 64),
    ("triton-int8-paged", "int8", "triton", 2, 2, 1, None, True, jnp.float32, 64),
    ("triton-int8-bf16-layer", "int8", "triton", 2, 4, 2, 2, False, jnp.bfloat16, 128),
    ("triton-int4-layer", "int4", "triton", 2, 2, 1, 2, False, jnp.bfloat16, 128),
    ("triton-int2-paged-layer", "int2", "triton", 2, 2, 2, 2, True, jnp.bfloat16, 128),
]


@pytest.mark.parametrize(
    "kind,backend,g,r,nq,layers,paged,dtype,d",
    [c[1:] for c in DECODE_CASES],
    ids=[c[0] for c in DECODE_CASES],
)
def test_decode_kernel_matches_reference(kind, backend, g, r, nq, layers, paged, dtype, d):
    cache, layer = _build(kind, g, layers, paged, dtype, d=d)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jax.random.normal(jax.random.key(3), (len(LENGTHS), nq, g * r, d), jnp.float32)
    q = q.astype(dtype)
    run = jax.jit(lambda q, c, n, i: decode_attention(q, c, n, layer=i, backend=backend))
    out = run(q, cache, lengths, layer)
    ref = _reference(q.astype(jnp.float32), cache, lengths, layer=layer)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(f32(out)))
    np.testing.assert_array_equal(f32(out)[0], 0.0)  # the length-0 row
    np.testing.assert_allclose(f32(out), f32(ref), atol=3e-2, rtol=0)


def _train_losses(impl: str, packed: bool, steps: int = 4) -> list[float]:
    """Losses of `steps` train steps of a small bf16 model (head dim 128) on one fixed batch."""
    cfg = config.Config(
        model=tiny_model(
            vocab_size=512,
            d_model=256,
            num_heads=4,
            num_kv_heads=2,
            head_dim=128,
            mlp_dim=512,
            num_layers=2,
            max_seq_len=512,
            dtype="bfloat16",
            param_dtype="float32",
            attention_impl=impl,
        ),
        mesh=config.MeshConfig(data=1),
        data=config.DataConfig(seq_len=512),
        train=config.TrainConfig(global_batch_size=4, steps=steps),
        optim=config.OptimConfig(lr=1e-3, warmup_steps=0),
    )
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    jit_train, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    scaling = loss_scale.from_config(cfg.optim, cfg.model)
    state = init_state(cfg.model, tx, mesh, 0, scaling, **layout(cfg))
    host = synthetic_batch(cfg, seed=1)
    if packed:  # three documents per row; positions restart in each
        ids = np.asarray(_packed_ids(4, 512, [100, 260, 400]))
        host["segment_ids"] = ids
        starts = np.maximum.accumulate(
            np.where(np.diff(ids, prepend=-1, axis=1) != 0, np.arange(512), 0), axis=1
        )
        host["positions"] = (np.arange(512) - starts).astype(np.int32)
    batch = to_global(host, batch_sh)
    losses = []
    for _ in range(steps):
        state, metrics = jit_train(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize("packed", [False, True], ids=["one-doc-rows", "packed"])
def test_train_steps_agree_across_attention_impls(packed):
    base = _train_losses("xla", packed)
    assert base[-1] < base[0]
    for impl in ("flash", "cudnn"):
        losses = _train_losses(impl, packed)
        np.testing.assert_allclose(losses, base, rtol=1e-2, err_msg=impl)

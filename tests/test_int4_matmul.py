"""The int4 weight-only matmul kernel: the Pallas Triton kernel in interpret mode against the
reference (and against `jaxllm.model.quantized`'s dequantization of the same codes), symmetric
and asymmetric, per channel and per group, a decode row and a padded batch; and its lowering
for CUDA from this CPU jaxlib."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.kernels.int4_matmul import (
    dequantize_int4,
    int4_matmul,
    int4_matmul_reference,
    triton_supported,
)
from lowering import lower

from jaxllm.model import quantized


def _weight(k, n, group, symmetric, seed=0):
    w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * 0.05
    t = quantized.quantize(w, bits=4, group=group, symmetric=symmetric, n_in=1, n_out=1)
    return t


@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.parametrize("group", [0, 32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_interpreted_kernel_matches_the_reference(m, group, symmetric):
    k, n = 256, 96
    t = _weight(k, n, group, symmetric)
    np.testing.assert_array_equal(  # the kernel's layout is the quantized run's
        np.asarray(dequantize_int4(t.codes, t.scales, t.zeros)),
        np.asarray(quantized.dequantize(t, jnp.float32)),
    )
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32)
    want = int4_matmul_reference(x, t.codes, t.scales, t.zeros)
    got = int4_matmul(x, t.codes, t.scales, t.zeros, backend="triton", interpret=True)
    assert got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    xla = int4_matmul(x, t.codes, t.scales, t.zeros, backend="xla")
    np.testing.assert_allclose(np.asarray(xla), np.asarray(want), rtol=0, atol=0)


def test_supported_shapes_and_refusal():
    assert triton_supported((1, 256), (128, 96), (8, 96))  # groups of 32
    assert not triton_supported((1, 256), (128, 90), (8, 96))  # N not a multiple of 16
    assert not triton_supported((1, 48), (24, 64), (3, 64))  # groups of 16 < the 32-row block
    t = _weight(48, 64, 16, True)
    x = jnp.ones((1, 48), jnp.float32)
    with pytest.raises(ValueError, match="does not take"):
        int4_matmul(x, t.codes, t.scales, None, backend="triton", interpret=True)
    got = int4_matmul(x, t.codes, t.scales, None, backend="auto", interpret=True)  # -> xla
    np.testing.assert_allclose(got, int4_matmul_reference(x, t.codes, t.scales), rtol=1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
def test_lowers_for_cuda(symmetric):
    k, n, group = 2048, 512, 128
    t = jax.eval_shape(lambda: _weight(k, n, group, symmetric))
    x = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
    fn = lambda x, c, s, z: int4_matmul(x, c, s, z, backend="triton")  # noqa: E731
    text = lower(fn, x, t.codes, t.scales, t.zeros, platform="cuda").as_text()
    assert "int4_matmul" in text and "triton" in text.lower()


def test_bench_script_runs_interpreted():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_int4_matmul.py"
    spec = importlib.util.spec_from_file_location("bench_int4_matmul", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--shapes", "256x64", "--batch", "1", "--group", "32", "--interpret", "--iters", "1"]
    rows = bench.main(args)
    assert [r["kind"] for r in rows] == ["bf16", "int4-triton", "int4-xla"]
    assert rows[1]["weight_bytes"] * 3 < rows[0]["weight_bytes"]

"""Ulysses context parallelism: outputs and gradients equal to plain attention across meshes,
masks, GQA ratios (kv heads repeated when the sequence degree does not divide them) and
packing, with jnp attention and the Pallas kernel (interpreted) per head group; the config's
checks of the degrees."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_env
from jax.sharding import Mesh

from jaxllm import config
from jaxllm.config import ConfigError
from jaxllm.model import attention_kernels
from jaxllm.model.attention import dot_product_attention
from jaxllm.parallel.ring import inverse_permutation, zigzag_permutation
from jaxllm.parallel.ulysses import kv_repeats, ulysses_attention_on_mesh, usp_attention_on_mesh

REPO = Path(__file__).resolve().parent.parent
B, L, K = 2, 32, 16
TOL = dict(atol=1e-5, rtol=1e-5)  # float32: the same math, only the summation order differs

# name -> (mesh shape, mesh axis names, batch_axes, head_axis); Ulysses runs over "sequence".
LAYOUTS = {
    "data2_seq4": ((2, 4), ("data", "sequence"), ("data",), None),
    "seq8": ((1, 8), ("data", "sequence"), ("data",), None),
    "seq4_tensor2": ((4, 2), ("sequence", "tensor"), None, "tensor"),
}


def _mesh(layout):
    shape, names, _, _ = LAYOUTS[layout]
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def _packed_segments(docs_per_row, seed=0):
    """Segment ids with `docs_per_row` documents per row at random, per-row boundaries."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        starts = np.sort(rng.choice(np.arange(1, L), docs_per_row - 1, replace=False))
        row = np.zeros(L, np.int32)
        row[starts] = 1
        rows.append(np.cumsum(row) + 1)
    return jnp.asarray(np.stack(rows))


def _inputs(h, g, seed=0):
    kq, kk, kv, kc, ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(kq, (B, L, h, K))
    k = jax.random.normal(kk, (B, L, g, K))
    v = jax.random.normal(kv, (B, L, g, K))
    ct = jax.random.normal(kc, (B, L, h, K))
    sinks = jax.random.normal(ks, (h,))
    return q, k, v, ct, sinks


def _out_and_grads(attn, args, ct):
    """attn(*args) and the gradients of sum(attn * ct) w.r.t. every arg, in one compile."""

    def f(*args):
        out, vjp = jax.vjp(attn, *args)
        return out, vjp(ct)

    return jax.jit(f)(*args)


def _attention(impl, causal, window):
    """Attention of one device (or one head group): segments, sinks and a window as given."""

    def attend(q, k, v, seg, sinks):
        return dot_product_attention(
            q,
            k,
            v,
            q_segment_ids_BxL=seg,
            causal=causal,
            impl=impl,
            sliding_window=window,
            sinks_H=sinks,
        )

    return attend


def _ulysses(layout, segment_ids, attend, impl):
    mesh = _mesh(layout)
    _, _, batch_axes, head_axis = LAYOUTS[layout]

    def fn(q, k, v, tokens, heads, shared):
        return attend(q, k, v, tokens, heads)

    def attn(q, k, v, sinks):
        return ulysses_attention_on_mesh(
            fn,
            q,
            k,
            v,
            segment_ids,
            sinks,
            mesh=mesh,
            axis_name="sequence",
            batch_axes=batch_axes,
            head_axis=head_axis,
            check_vma=impl == "xla",
        )

    return attn


@pytest.mark.parametrize(
    "layout, causal, h, g, docs, window",
    [
        ("data2_seq4", True, 8, 4, 1, None),  # kv heads split as they are
        ("data2_seq4", True, 8, 2, 3, None),  # GQA: 2 kv heads repeated to 4, packed rows
        ("seq8", True, 8, 1, 2, 5),  # MQA over 8 devices, packed, sliding window
        ("seq8", False, 8, 8, 3, None),  # an encoder: bidirectional within each document
        ("seq4_tensor2", True, 8, 2, 2, 7),  # heads over tensor too: 1 kv head per shard x4
    ],
)
def test_matches_one_device_forward_and_grad(layout, causal, h, g, docs, window):
    q, k, v, ct, sinks = _inputs(h, g)
    seg = None if docs == 1 else _packed_segments(docs)
    attend = _attention("xla", causal, window)
    args = (q, k, v, sinks)
    got, got_grads = _out_and_grads(_ulysses(layout, seg, attend, "xla"), args, ct)
    want, want_grads = _out_and_grads(lambda q, k, v, s: attend(q, k, v, seg, s), args, ct)
    np.testing.assert_allclose(got, want, **TOL)
    for name, a, b in zip(("q", "k", "v", "sinks"), got_grads, want_grads):
        np.testing.assert_allclose(a, b, err_msg=name, **TOL)
    assert np.abs(np.asarray(got_grads[3])).max() > 0  # the sinks' slices carry gradients


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the flash kernel calls traced, so a test sees the kernel path was taken."""
    calls = []
    flash_attention = attention_kernels.flash_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return flash_attention(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, "flash_attention", counted)
    return calls


def test_flash_kernel_per_head_group_matches_one_device(kernel_calls):
    """The Pallas kernel (interpreted) runs whole sequences of each device's heads."""
    q, k, v, ct, _ = _inputs(8, 2)
    seg = _packed_segments(2)

    def attend(q, k, v, seg, _):
        return _attention("flash", True, None)(q, k, v, seg, None)

    args = (q, k, v, None)
    got, got_grads = _out_and_grads(_ulysses("data2_seq4", seg, attend, "flash"), args, ct)
    assert kernel_calls == [(B // 2, L, 2, K)], "not one kernel call per whole-sequence group"
    ref = _attention("xla", True, None)
    want, want_grads = _out_and_grads(lambda q, k, v, s: ref(q, k, v, seg, None), args, ct)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    for a, b in zip(got_grads[:3], want_grads[:3]):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "heads, kv_heads, degree, want",
    [(8, 4, 4, 1), (8, 2, 4, 2), (8, 1, 8, 8), (12, 4, 6, 3), (8, 8, 2, 1)],
)
def test_kv_repeats_give_whole_groups(heads, kv_heads, degree, want):
    r = kv_repeats(heads, kv_heads, degree)
    assert r == want
    assert (kv_heads * r) % degree == 0 and heads % (kv_heads * r) == 0


def test_kv_repeats_refuse_heads_the_degree_does_not_divide():
    with pytest.raises(ValueError, match="4 devices"):
        kv_repeats(6, 2, 4)


# -- config ----------------------------------------------------------------------------------


def _config(num_heads, num_kv_heads, mode="ulysses", **mesh):
    return config.load(
        None,
        [
            f"model.num_heads={num_heads}",
            f"model.num_kv_heads={num_kv_heads}",
            "model.d_model=96",
            f"mesh.sequence_attention={mode}",
            *(f"mesh.{k}={v}" for k, v in mesh.items()),
        ],
    )


def test_config_accepts_kv_heads_it_repeats():
    _config(8, 2, sequence=4, data=2).validate(8)  # 2 kv heads over 4 devices: repeated


@pytest.mark.parametrize(
    "heads, kv_heads, mesh, needle",
    [
        (6, 2, dict(sequence=4, data=2), "mesh.tensor * mesh.sequence (1 * 4 = 4)"),
        (4, 4, dict(sequence=4, tensor=2), "mesh.tensor * mesh.sequence (2 * 4 = 8)"),
    ],
)
def test_config_refuses_degrees_that_do_not_divide_heads(heads, kv_heads, mesh, needle):
    cfg = _config(heads, kv_heads, **mesh)
    with pytest.raises(ConfigError) as e:
        cfg.validate(8)
    assert needle in str(e.value) and f"model.num_heads ({heads})" in str(e.value)


def test_cli_refuses_the_degrees_in_one_line_exit_2():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxllm",
            "plan",
            "mesh.sequence=8",
            "mesh.sequence_attention=ulysses",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            "--devices",
            "8",
        ],
        cwd=REPO,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxllm: "), proc.stderr
    assert "mesh.sequence_attention=ulysses" in lines[0] and "(1 * 8 = 8)" in lines[0]


@pytest.mark.parametrize(
    "heads, mode, mesh, needle",
    [
        (8, "ulysses", dict(sequence=4, sequence_ulysses=2), "mesh.sequence_ulysses (2) is"),
        (8, "usp", dict(sequence=4, sequence_ulysses=0), "mesh.sequence_ulysses (0) is"),
        (8, "usp", dict(sequence=8, sequence_ulysses=3), "must divide mesh.sequence (8)"),
        (6, "usp", dict(sequence=8, sequence_ulysses=4), "(1 * 4 = 4), which does not divide"),
    ],
)
def test_config_refuses_usp_degrees(heads, mode, mesh, needle):
    with pytest.raises(ConfigError) as e:
        _config(heads, 2, mode, **mesh).validate(8)
    assert needle in str(e.value)


def test_config_accepts_usp_and_refuses_a_window_for_its_ring():
    _config(8, 2, "usp", sequence=8, sequence_ulysses=4).validate(8)
    with pytest.raises(ConfigError, match="sequence_attention=usp supports neither"):
        config.load(None, ["mesh.sequence_attention=usp", "model.sliding_window=8"])


# -- USP: Ulysses inside groups, the ring across them ---------------------------------------


@pytest.mark.parametrize(
    "layout, group, causal, h, g, docs, impl",
    [
        ("data2_seq4", 2, True, 8, 2, 3, "xla"),  # 2 rings of 2 groups of 2, packed
        ("seq8", 2, True, 8, 1, 2, "xla"),  # MQA: the kv head repeated to 2
        ("seq8", 4, False, 8, 8, 3, "xla"),  # an encoder, 2 groups of 4
        ("seq4_tensor2", 2, True, 8, 4, 2, "xla"),  # heads over tensor too
        ("data2_seq4", 2, True, 8, 2, 2, "flash"),  # the kernel per ring block pair
    ],
)
def test_usp_matches_one_device_forward_and_grad(layout, group, causal, h, g, docs, impl):
    q, k, v, ct, _ = _inputs(h, g)
    seg = None if docs == 1 else _packed_segments(docs)
    mesh = _mesh(layout)
    _, _, batch_axes, head_axis = LAYOUTS[layout]
    perm = zigzag_permutation(L, mesh.shape["sequence"] // group)
    inv = inverse_permutation(perm)

    def usp(q, k, v):
        out = usp_attention_on_mesh(
            q[:, perm],
            k[:, perm],
            v[:, perm],
            segment_ids_BxL=None if seg is None else seg[:, perm],
            mesh=mesh,
            axis_name="sequence",
            group=group,
            batch_axes=batch_axes,
            head_axis=head_axis,
            causal=causal,
            impl=impl,
        )
        return out[:, inv]

    ref = _attention("xla", causal, None)
    got, got_grads = _out_and_grads(usp, (q, k, v), ct)
    want, want_grads = _out_and_grads(lambda q, k, v: ref(q, k, v, seg, None), (q, k, v), ct)
    tol = TOL if impl == "xla" else dict(atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got, want, **tol)
    for name, a, b in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(a, b, err_msg=name, **tol)

"""Ring attention: zigzag layout, balanced causal work, and outputs/gradients equal to plain
attention on the un-permuted sequence across meshes, masks, GQA ratios, packing and dtypes, with
jnp blocks (`impl="xla"`) and with the Pallas kernel per block (`impl="flash"`, interpreted)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec
from jaxllm.kernels import BlockSizes, flash_attention_reference
from test_attention_impl import _losses_and_params

from jaxllm.model.attention import dot_product_attention
from jaxllm.parallel import ring_flash
from jaxllm.parallel.ring import (
    inverse_permutation,
    ring_attention_local,
    ring_attention_on_mesh,
    zigzag_permutation,
)

B, K = 2, 16
# float32: the same math as the reference up to summation order (errors seen: ~1e-6).
# bfloat16: inputs, outputs, gradients and the P @ V matmul in bf16 (8 mantissa bits), against a
# float32 reference on the same bf16-rounded inputs; errors seen: outputs ~6e-3, gradients ~3e-2
# (one bf16 ulp for |g| in [4, 8)), the same as the reference's own bf16 path.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}

# name -> (mesh shape, mesh axis names, batch_axes, head_axis); the ring runs over "sequence".
LAYOUTS = {
    "data2_seq4": ((2, 4), ("data", "sequence"), ("data",), None),
    "data1_seq8": ((1, 8), ("data", "sequence"), ("data",), None),
    "seq4_tensor2": ((4, 2), ("sequence", "tensor"), None, "tensor"),
}


def _mesh(layout):
    shape, names, _, _ = LAYOUTS[layout]
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def _packed_segments(l, docs_per_row, seed):
    """Segment ids with `docs_per_row` documents per row at random, per-row boundaries."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        starts = np.sort(rng.choice(np.arange(1, l), docs_per_row - 1, replace=False))
        row = np.zeros(l, np.int32)
        row[starts] = 1
        rows.append(np.cumsum(row) + 1)
    return jnp.asarray(np.stack(rows))


def _qkv(l, h, g, dtype, seed=0):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, l, h, K)).astype(dtype)
    k = jax.random.normal(kk, (B, l, g, K)).astype(dtype)
    v = jax.random.normal(kv, (B, l, g, K)).astype(dtype)
    ct = jax.random.normal(kc, (B, l, h, K))
    return q, k, v, ct


def _out_and_grads(attn, q, k, v, ct):
    """attn(q, k, v) and the gradients of sum(attn * ct) w.r.t. q, k, v, in one compile."""

    def f(q, k, v):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(ct.astype(out.dtype))

    return jax.jit(f)(q, k, v)


def _ring(q, k, v, segment_ids, layout, causal, **impl_kwargs):
    """Ring attention on natural-order inputs: permute to zigzag, run, permute back."""
    mesh = _mesh(layout)
    _, _, batch_axes, head_axis = LAYOUTS[layout]
    perm = zigzag_permutation(q.shape[1], mesh.shape["sequence"])
    inv = inverse_permutation(perm)

    def attn(q, k, v):
        out = ring_attention_on_mesh(
            q[:, perm],
            k[:, perm],
            v[:, perm],
            segment_ids_BxL=None if segment_ids is None else segment_ids[:, perm],
            mesh=mesh,
            axis_name="sequence",
            batch_axes=batch_axes,
            head_axis=head_axis,
            causal=causal,
            **impl_kwargs,
        )
        return out[:, inv]

    return attn


def _reference(segment_ids, causal):
    def attn(q, k, v):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return dot_product_attention(*f32, q_segment_ids_BxL=segment_ids, causal=causal)

    return attn


def _assert_close(got, want, dtype):
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got)), "non-finite values"
    np.testing.assert_allclose(got, np.asarray(want, np.float32), **TOL[dtype])


@pytest.mark.parametrize(
    "layout, causal, h, g, docs, dtype",
    [
        ("data2_seq4", True, 4, 4, 3, jnp.float32),
        # one document: data1_seq8 with docs=1 covers it
        pytest.param("data2_seq4", True, 4, 2, 1, jnp.float32, marks=pytest.mark.slow),
        ("data2_seq4", False, 4, 2, 3, jnp.float32),
        ("data1_seq8", True, 4, 2, 5, jnp.float32),
        ("data1_seq8", False, 8, 2, 1, jnp.float32),
        ("seq4_tensor2", True, 8, 2, 4, jnp.float32),
        # the same case in bfloat16 below covers it
        pytest.param("seq4_tensor2", False, 4, 4, 2, jnp.float32, marks=pytest.mark.slow),
        ("data2_seq4", True, 4, 2, 3, jnp.bfloat16),
        ("seq4_tensor2", False, 4, 4, 2, jnp.bfloat16),
    ],
)
def test_matches_reference_forward_and_grad(layout, causal, h, g, docs, dtype):
    l = 64
    q, k, v, ct = _qkv(l, h, g, dtype)
    seg = _packed_segments(l, docs, seed=h * 10 + g + docs) if docs > 1 else None
    out, grads = _out_and_grads(_ring(q, k, v, seg, layout, causal), q, k, v, ct)
    want_out, want_grads = _out_and_grads(_reference(seg, causal), q, k, v, ct)
    assert out.dtype == dtype
    _assert_close(out, want_out, dtype)
    for name, got, want in zip("qkv", grads, want_grads):
        assert got.dtype == dtype, name
        _assert_close(got, want, dtype)


def test_documents_starting_mid_shard_give_no_nans():
    """A document starts in the middle of every zigzag chunk, so on the middle device the second
    half of its late chunk sees nothing in the first half-block folded into its accumulator."""
    l, n = 64, 4
    chunk = l // (2 * n)
    seg = jnp.asarray(np.broadcast_to((np.arange(l) + chunk // 2) // chunk, (B, l)))
    q, k, v, ct = _qkv(l, 4, 2, jnp.float32, seed=1)
    out, grads = _out_and_grads(_ring(q, k, v, seg, "data2_seq4", True), q, k, v, ct)
    want_out, want_grads = _out_and_grads(_reference(seg, True), q, k, v, ct)
    _assert_close(out, want_out, jnp.float32)
    for got, want in zip(grads, want_grads):
        _assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("check_vma", [False, True])
def test_rows_with_no_visible_key_are_zero_not_nan(check_vma):
    """Queries whose segment no key has (only possible with distinct q/kv segment ids) get zero
    output and finite, zero gradients; the rest still match the reference. Also runs the local
    function under a user's own shard_map, with and without the varying-axes type check."""
    l, n = 32, 4
    mesh = _mesh("data2_seq4")
    q, k, v, ct = _qkv(l, 4, 2, jnp.float32, seed=2)
    q_seg = jnp.asarray(np.broadcast_to(np.where(np.arange(l) % 3 == 0, 99, 1), (B, l)))
    kv_seg = jnp.ones((B, l), jnp.int32)
    idx = jnp.asarray(np.broadcast_to(zigzag_permutation(l, n), (B, l)), jnp.int32)
    tok, act = PartitionSpec(None, "sequence"), PartitionSpec(None, "sequence", None, None)

    def attn(q, k, v):  # inputs and outputs stay in zigzag order; the check is row-wise
        local = lambda *a: ring_attention_local(*a, axis_name="sequence")  # noqa: E731
        return jax.shard_map(
            local, mesh=mesh, in_specs=(act,) * 3 + (tok,) * 4, out_specs=act, check_vma=check_vma
        )(q, k, v, q_seg, kv_seg, idx, idx)

    out, grads = _out_and_grads(attn, q, k, v, ct)
    dead = np.asarray(q_seg) == 99
    assert np.all(np.asarray(out)[dead] == 0)
    assert all(np.all(np.isfinite(np.asarray(gr))) for gr in grads)
    assert np.all(np.asarray(grads[0])[dead] == 0)

    inv = inverse_permutation(zigzag_permutation(l, n))
    natural = [np.asarray(x)[:, inv] for x in (q, k, v, q_seg)]
    want = jax.jit(
        lambda q, k, v, s: dot_product_attention(
            q, k, v, q_segment_ids_BxL=s, kv_segment_ids_BxS=kv_seg
        )
    )(*natural)
    live = ~dead[:, inv]
    _assert_close(np.asarray(out)[:, inv][live], np.asarray(want)[live], jnp.float32)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zigzag_permutation_gives_device_i_chunks_i_and_mirror(n):
    c = 3
    perm = zigzag_permutation(2 * n * c, n)
    shards_nx2xC = perm.reshape(n, 2, c)
    for i in range(n):
        np.testing.assert_array_equal(shards_nx2xC[i, 0], np.arange(i * c, (i + 1) * c))
        mirror = 2 * n - 1 - i
        np.testing.assert_array_equal(shards_nx2xC[i, 1], np.arange(mirror * c, (mirror + 1) * c))
    x = np.arange(2 * n * c) * 10
    np.testing.assert_array_equal(x[perm][inverse_permutation(perm)], x)
    with pytest.raises(ValueError):
        zigzag_permutation(2 * n * c + 1, n)


def _visible_pairs_and_half_blocks(idx_nxS):
    """Per device: causal (q, k) pairs it computes over the ring, and half-blocks not skipped."""
    n = idx_nxS.shape[0]
    pairs, blocks = np.zeros(n, int), np.zeros(n, int)
    for i in range(n):
        for step in range(n):
            src = (i - step) % n
            for q_half in np.split(idx_nxS[i], 2):
                for kv_half in np.split(idx_nxS[src], 2):
                    visible = q_half[:, None] >= kv_half[None, :]
                    pairs[i] += visible.sum()
                    blocks[i] += visible.any()
    return pairs, blocks


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work(n):
    l = 2 * n * 4
    pairs, blocks = _visible_pairs_and_half_blocks(zigzag_permutation(l, n).reshape(n, -1))
    assert pairs.sum() == l * (l + 1) // 2
    assert np.all(pairs == pairs[0]), pairs
    # own shard: 3 of 4 half-blocks; every visiting shard: 2 of 4 (no block is skipped outright).
    assert np.all(blocks == 3 + 2 * (n - 1)), blocks
    # The contiguous layout, for contrast, loads the last device far more than the first.
    pairs_contig, blocks_contig = _visible_pairs_and_half_blocks(np.arange(l).reshape(n, -1))
    assert pairs_contig[-1] > pairs_contig[0] and blocks_contig[-1] > blocks_contig[0]


# ------------------------------------------------------------- impl="flash": kernel per block

FLASH = dict(impl="flash", block_sizes=BlockSizes(8, 8), interpret=True)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernel calls the ring traces, so a test sees the kernel path was taken."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["causal"])
        return flash_attention_with_lse(*args, **kwargs)

    flash_attention_with_lse = ring_flash.flash_attention_with_lse
    monkeypatch.setattr(ring_flash, "flash_attention_with_lse", counted)
    return calls


@pytest.mark.parametrize(
    "layout, causal, h, g, docs, dtype",
    [
        ("data2_seq4", True, 4, 2, 3, jnp.float32),
        ("data2_seq4", False, 4, 2, 3, jnp.float32),
        ("seq4_tensor2", True, 8, 2, 4, jnp.bfloat16),
    ],
)
def test_flash_matches_reference_forward_and_grad(layout, causal, h, g, docs, dtype, kernel_calls):
    """The kernel on every (query half, key half) pair, merged by logsumexp, with the custom ring
    backward: the same outputs and gradients as single-device attention, packed and causal.
    Half-blocks of 8 rows are one kernel block each."""
    l = 64
    q, k, v, ct = _qkv(l, h, g, dtype)
    seg = _packed_segments(l, docs, seed=h * 10 + g + docs)
    out, grads = _out_and_grads(_ring(q, k, v, seg, layout, causal, **FLASH), q, k, v, ct)
    want_out, want_grads = _out_and_grads(_reference(seg, causal), q, k, v, ct)
    # causal: one traced kernel call for fully visible pairs, one for the diagonal
    assert sorted(kernel_calls) == ([False, True] if causal else [False])
    assert out.dtype == dtype
    _assert_close(out, want_out, dtype)
    for name, got, want in zip("qkv", grads, want_grads):
        assert got.dtype == dtype, name
        _assert_close(got, want, dtype)


def test_flash_is_exact_for_any_layout_and_empty_rows():
    """A random token layout (half-blocks are no chunks, so pairs straddle the diagonal and take
    the exact jnp block) and queries whose segment has no key (zero output and gradients): the
    flash ring still equals plain attention, under a user's own shard_map."""
    l = 32
    mesh = _mesh("data2_seq4")
    q, k, v, ct = _qkv(l, 4, 2, jnp.float32, seed=4)
    perm = np.random.default_rng(0).permutation(l)
    q_seg = np.broadcast_to(np.where(np.arange(l) % 5 == 0, 99, 1 + np.arange(l) // 12), (B, l))
    kv_seg = np.broadcast_to(1 + np.arange(l) // 12, (B, l))
    idx = jnp.asarray(np.broadcast_to(perm, (B, l)), jnp.int32)
    tok, act = PartitionSpec(None, "sequence"), PartitionSpec(None, "sequence", None, None)

    def attn(q, k, v):  # natural order in and out; the ring sees the permuted layout
        local = lambda *a: ring_attention_local(*a, axis_name="sequence", **FLASH)  # noqa: E731
        out = jax.shard_map(
            local, mesh=mesh, in_specs=(act,) * 3 + (tok,) * 4, out_specs=act, check_vma=False
        )(
            q[:, perm],
            k[:, perm],
            v[:, perm],
            jnp.asarray(q_seg[:, perm]),
            jnp.asarray(kv_seg[:, perm]),
            idx,
            idx,
        )
        return out[:, inverse_permutation(perm)]

    out, grads = _out_and_grads(attn, q, k, v, ct)
    # The kernel's jnp reference: like the ring, it gives rows with no visible key zero output
    # and no gradient (dot_product_attention's XLA path spreads them uniformly instead).
    seg = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
    want_out, want_grads = _out_and_grads(
        lambda q, k, v: flash_attention_reference(q, k, v, causal=True, segment_ids=seg),
        q,
        k,
        v,
        ct,
    )
    dead = q_seg == 99
    assert np.all(np.asarray(out)[dead] == 0) and np.all(np.asarray(grads[0])[dead] == 0)
    _assert_close(out, want_out, jnp.float32)
    for got, want in zip(grads, want_grads):
        _assert_close(got, want, jnp.float32)


# the flash ring's forward and gradients match the reference in the tests above; ~40 s
@pytest.mark.slow
def test_flash_ring_trains_like_xla_on_one_device(kernel_calls):
    """model.attention_impl=flash with mesh.sequence_attention=ring on a data x sequence mesh:
    three train steps (two documents per row) equal attention_impl=xla on one device."""
    devices = jax.devices()
    ref_losses, ref_params = _losses_and_params("xla", {}, devices[:1])
    mesh_cfg = {"data": 2, "sequence": 4, "sequence_attention": "ring"}
    losses, params = _losses_and_params("flash", mesh_cfg, devices)
    assert kernel_calls, "the ring did not call the kernel"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)

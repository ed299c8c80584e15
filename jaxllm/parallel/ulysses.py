"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509).

The length axis is sharded over a mesh axis of s devices. Attention needs the whole sequence, but
each head only its own: an all-to-all over the axis turns every device's [B, L/s, H, K] shard of
q, k and v into [B, L, H/s, K] (the whole sequence of one group of heads), ordinary attention runs
on it (any implementation, every mask: causal, packed segments, sliding windows, ALiBi, sinks,
a prefix), and a second all-to-all turns the output back into [B, L/s, H, K]. Tokens stay in
their natural, contiguous order; per-token inputs (segment ids, a prefix) are all-gathered to
full length and per-head ones (ALiBi slopes, sinks) sliced to the device's heads.

Grouped-query attention: each device must receive whole kv groups. With G kv heads and s not
dividing G, every kv head is repeated s / gcd(G, s) times first (query head h reads repeated
head h // (H / (G r)), a copy of its own kv head h // (H / G)), so any G works as long as s
divides H; `kv_repeats` says how many copies.

USP (unified sequence parallelism, Fang & Zhao 2024, arXiv:2405.07719): the s devices form
s / u consecutive groups of u; Ulysses' all-to-alls run inside each group (each device then
holds the group's whole block of length for H/u heads) and ring attention runs across the groups
(`ring_xla.ring_steps`: rank a of every group forms one ring), in the zigzag layout over s / u
groups. u = s is Ulysses, u = 1 the ring.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxllm import sharding
from jaxllm.parallel.ring import ring_attention_local, zigzag_permutation


def kv_repeats(heads: int, kv_heads: int, degree: int) -> int:
    """Copies of each kv head that let `degree` devices take whole groups of `heads` query heads
    over `kv_heads` kv heads (1: the kv heads split as they are). ValueError naming the degrees
    when `degree` does not divide `heads`."""
    if heads % degree or heads % kv_heads:
        raise ValueError(
            f"Ulysses over {degree} devices needs heads ({heads}) divisible by the degree and "
            f"by kv heads ({kv_heads})"
        )
    return degree // math.gcd(kv_heads, degree)


def ulysses_local(fn, q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, tokens, heads, shared, *, axis_name, degree):
    """Inside `jax.shard_map`: this device's length shard of q/k/v -> whole-sequence head groups,
    `fn(q, k, v, tokens, heads, shared)` on them, and the output back to the length shard.

    `tokens`: a pytree of [B, L/s] arrays, all-gathered to [B, L]; `heads`: a pytree of [H_local]
    arrays, sliced to the device's H_local / s heads; `shared` is passed on as it is.
    """
    q, k, v = _to_head_groups(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, axis_name, degree, degree)
    tokens = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True), tokens)
    i = jax.lax.axis_index(axis_name)

    def my_heads(x_H):
        n = x_H.shape[0] // degree
        return jax.lax.dynamic_slice_in_dim(x_H, i * n, n, axis=0)

    # every device now holds whole sequences of its heads: `fn` runs as on one device (a kernel
    # called plainly, no sharding constraints)
    with sharding.active(sharding.Parallel()):
        out_BxLxHxK = fn(q, k, v, tokens, jax.tree.map(my_heads, heads), shared)
    return jax.lax.all_to_all(out_BxLxHxK, axis_name, split_axis=1, concat_axis=2, tiled=True)


def _groups(degree: int, group: int) -> list[list[int]] | None:
    """`axis_index_groups` of consecutive `group` devices of `degree` (None: all in one)."""
    if group == degree:
        return None
    return [list(range(g * group, (g + 1) * group)) for g in range(degree // group)]


def _to_head_groups(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, axis_name, degree, group):
    """q/k/v length shards -> the whole length of their group of `group` devices for 1/group of
    the heads, kv heads repeated first where `group` does not divide them."""
    reps = kv_repeats(q_BxLxHxK.shape[2], k_BxLxGxK.shape[2], group)
    if reps > 1:
        k_BxLxGxK = jnp.repeat(k_BxLxGxK, reps, axis=2)
        v_BxLxGxV = jnp.repeat(v_BxLxGxV, reps, axis=2)
    to_heads = functools.partial(
        jax.lax.all_to_all,
        axis_name=axis_name,
        split_axis=2,
        concat_axis=1,
        tiled=True,
        axis_index_groups=_groups(degree, group),
    )
    return to_heads(q_BxLxHxK), to_heads(k_BxLxGxK), to_heads(v_BxLxGxV)


def usp_local(
    q_BxLxHxK,
    k_BxLxGxK,
    v_BxLxGxV,
    seg_BxL,
    idx_BxL,
    *,
    axis_name,
    degree,
    group,
    causal=True,
    scale=None,
    impl="xla",
):
    """Inside `jax.shard_map`: USP of this device's length shard (zigzag over degree / group
    groups; `idx_BxL` the global token indices, `seg_BxL` segment ids): Ulysses inside the
    device's group of `group`, ring attention across the groups, and back."""
    q, k, v = _to_head_groups(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, axis_name, degree, group)
    length = q.shape[1]  # the group's block of the sequence
    first = (jax.lax.axis_index(axis_name) // group) * length

    def group_block(x_BxL):
        full_BxL = jax.lax.all_gather(x_BxL, axis_name, axis=1, tiled=True)
        return jax.lax.dynamic_slice_in_dim(full_BxL, first, length, axis=1)

    seg, idx = group_block(seg_BxL), group_block(idx_BxL)
    out_BxLxHxK = ring_attention_local(
        q,
        k,
        v,
        seg,
        seg,
        idx,
        idx,
        axis_name=axis_name,
        causal=causal,
        scale=scale,
        impl=impl,
        group=group,
    )
    return jax.lax.all_to_all(
        out_BxLxHxK, axis_name, 1, 2, tiled=True, axis_index_groups=_groups(degree, group)
    )


def usp_attention_on_mesh(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    *,
    segment_ids_BxL: jax.Array | None,
    mesh: Mesh,
    axis_name: str,
    group: int,
    batch_axes: tuple[str, ...] | None,
    head_axis: str | None,
    causal: bool = True,
    scale: float | None = None,
    impl: str = "xla",
) -> jax.Array:
    """USP self-attention on GLOBAL arrays in zigzag order over mesh.shape[axis_name] / `group`
    (`zigzag_permutation`); the output in the same order. Sharding as in
    `ulysses_attention_on_mesh`; `impl` as in `ring_attention_local`."""
    b, l = q_BxLxHxK.shape[:2]
    degree = mesh.shape[axis_name]
    perm = zigzag_permutation(l, degree // group)
    idx_BxL = jnp.broadcast_to(jnp.asarray(perm, jnp.int32)[None], (b, l))
    if segment_ids_BxL is None:
        segment_ids_BxL = jnp.zeros((b, l), jnp.int32)
    qkv = PartitionSpec(batch_axes, axis_name, head_axis, None)
    tokens = PartitionSpec(batch_axes, axis_name)
    local = functools.partial(
        usp_local,
        axis_name=axis_name,
        degree=degree,
        group=group,
        causal=causal,
        scale=scale,
        impl=impl,
    )
    return jax.shard_map(
        local,
        mesh=sharding.shard_map_mesh(mesh),
        in_specs=(qkv, qkv, qkv, tokens, tokens),
        out_specs=qkv,
        check_vma=impl != "flash",
    )(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, idx_BxL)


def ulysses_attention_on_mesh(
    fn,
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxV: jax.Array,
    tokens=(),
    heads=(),
    shared=(),
    *,
    mesh: Mesh,
    axis_name: str,
    batch_axes: tuple[str, ...] | None,
    head_axis: str | None,
    check_vma: bool = True,
) -> jax.Array:
    """`fn(q, k, v, tokens, heads, shared)` (attention over whole sequences of a group of heads)
    on GLOBAL arrays whose length is sharded over `axis_name`, batch over `batch_axes` and heads
    over `head_axis`; see `ulysses_local`. `shared` arrays are replicated. `check_vma=False` when
    `fn` calls a Pallas kernel (its outputs declare no varying axes)."""
    qkv = PartitionSpec(batch_axes, axis_name, head_axis, None)
    local = functools.partial(ulysses_local, fn, axis_name=axis_name, degree=mesh.shape[axis_name])
    return jax.shard_map(
        local,
        mesh=sharding.shard_map_mesh(mesh),
        in_specs=(
            qkv,
            qkv,
            qkv,
            PartitionSpec(batch_axes, axis_name),
            PartitionSpec(head_axis),
            PartitionSpec(),
        ),
        out_specs=qkv,
        check_vma=check_vma,
    )(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, tokens, heads, shared)


# Under the active `sharding.Parallel` settings: the model's attention asks whether to run
# Ulysses and runs its own attention function through it.


def _mesh(mode: str) -> Mesh | None:
    settings = sharding.current()
    mesh = settings.mesh
    if mesh is None or settings.sequence_attention != mode or mesh.shape["sequence"] == 1:
        return None
    return mesh


def ulysses_active() -> bool:
    """Whether attention should run as Ulysses over the `sequence` axis."""
    return _mesh("ulysses") is not None


def usp_active() -> bool:
    """Whether attention should run as USP over the `sequence` axis."""
    return _mesh("usp") is not None


def usp_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, impl="xla", causal=True):
    """USP over the `sequence` axis of the active mesh, in groups of its `sequence_ulysses`, on
    batches in `sequence_layout` order; `impl` and `causal` as in `ring_attention`."""
    return usp_attention_on_mesh(
        q_BxLxHxK,
        k_BxLxGxK,
        v_BxLxGxK,
        segment_ids_BxL=segment_ids_BxL,
        mesh=_mesh("usp"),
        axis_name="sequence",
        group=sharding.current().sequence_ulysses,
        batch_axes=sharding.RULES["batch"],
        head_axis=sharding.RULES["act_heads"][0],
        causal=causal,
        impl=impl,
    )


def ulysses_attention(fn, q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, tokens, heads, shared, impl="xla"):
    """Ulysses over the `sequence` axis of the active mesh (batches in natural order): `fn` as in
    `ulysses_attention_on_mesh`; `impl` (the resolved `attention_impl`) says whether `fn` runs a
    kernel."""
    return ulysses_attention_on_mesh(
        fn,
        q_BxLxHxK,
        k_BxLxGxK,
        v_BxLxGxV,
        tokens,
        heads,
        shared,
        mesh=_mesh("ulysses"),
        axis_name="sequence",
        batch_axes=sharding.RULES["batch"],
        head_axis=sharding.RULES["act_heads"][0],
        check_vma=impl == "xla",
    )

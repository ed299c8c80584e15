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
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxllm import sharding


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
    reps = kv_repeats(q_BxLxHxK.shape[2], k_BxLxGxK.shape[2], degree)
    if reps > 1:
        k_BxLxGxK = jnp.repeat(k_BxLxGxK, reps, axis=2)
        v_BxLxGxV = jnp.repeat(v_BxLxGxV, reps, axis=2)
    to_heads = functools.partial(
        jax.lax.all_to_all, axis_name=axis_name, split_axis=2, concat_axis=1, tiled=True
    )
    q, k, v = to_heads(q_BxLxHxK), to_heads(k_BxLxGxK), to_heads(v_BxLxGxV)
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


def _ulysses_mesh() -> Mesh | None:
    settings = sharding.current()
    mesh, mode = settings.mesh, settings.sequence_attention
    if mesh is None or mode != "ulysses" or mesh.shape["sequence"] == 1:
        return None
    return mesh


def ulysses_active() -> bool:
    """Whether attention should run as Ulysses over the `sequence` axis."""
    return _ulysses_mesh() is not None


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
        mesh=_ulysses_mesh(),
        axis_name="sequence",
        batch_axes=sharding.RULES["batch"],
        head_axis=sharding.RULES["act_heads"][0],
        check_vma=impl == "xla",
    )

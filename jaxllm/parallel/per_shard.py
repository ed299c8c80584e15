"""Per-device calls under the active mesh: a kernel (a custom call the SPMD partitioner cannot
split) runs on each device's shard with `jax.shard_map`; without a mesh it is a plain call."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from jaxllm import sharding


def per_shard_attention(fn, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS):
    """Runs `fn(q, k, v, q_seg, kv_seg)` on each device's batch and head shard under the active
    mesh (whole sequences: a sequence-sharded input is gathered first); plain call without one."""
    mesh = sharding.current().mesh
    if mesh is None or mesh.size == 1:
        return fn(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS)
    batch, heads = sharding.RULES["batch"], sharding.RULES["act_heads"][0]
    qkv = PartitionSpec(batch, None, heads, None)
    seg = None if q_seg_BxL is None else PartitionSpec(batch, None)
    return jax.shard_map(
        fn,
        mesh=sharding.shard_map_mesh(mesh),
        in_specs=(qkv, qkv, qkv, seg, seg),
        out_specs=qkv,
        check_vma=False,
    )(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS)


def per_shard(fn, args: tuple, in_axes: tuple, out_axes):
    """Runs `fn(*args)` per device under the active mesh with `shard_map`, the inputs and outputs
    split as their logical axes say (trees of axes tuples; None: replicated). For kernels, which
    the SPMD partitioner cannot split. A plain call without a mesh."""
    mesh = sharding.current().mesh
    if mesh is None or mesh.size == 1:
        return fn(*args)

    def to_spec(tree):
        return jax.tree.map(
            lambda ax: PartitionSpec() if ax is None else sharding.spec(ax),
            tree,
            is_leaf=lambda x: x is None or isinstance(x, tuple),
        )

    return jax.shard_map(
        fn,
        mesh=sharding.shard_map_mesh(mesh),
        in_specs=tuple(to_spec(a) for a in in_axes),
        out_specs=to_spec(out_axes),
        check_vma=False,
    )(*args)

"""Context-parallel ring attention (Liu et al. 2023, arXiv:2310.01889) with zigzag load balancing.

The length axis is sharded over a mesh axis of n devices. Each device keeps its queries and passes
its keys/values around the ring (`jax.lax.ppermute`), n steps in all, folding every visiting block
into its running result, so no device ever holds the full S x S scores or all of K/V.

Causal load balancing ("zigzag", as in Llama 3 context parallelism, arXiv:2407.21783, and
zhuzilin/ring-flash-attention): the sequence is cut into 2n chunks and device i holds chunks i and
2n-1-i. Each local shard is processed as two half-blocks, and a (query half, key half) pair with no
visible (q, k) pair is skipped. Under zigzag every device then computes the same number of
half-blocks: 3 on its own shard and 2 on each of the n-1 visiting shards, where a contiguous
layout leaves device 0 idle and device n-1 doing all n steps.

Masks are by *global* token index (`q_idx >= kv_idx`) and segment id (`q_seg == kv_seg`, packed
documents), so the functions are correct for any layout; zigzag only makes them balanced. Callers
lay tokens out with `x[:, zigzag_permutation(L, n)]` (`sequence_layout` does it for a batch) and
must give RoPE the permuted positions.

Two block implementations (`impl`, the model's resolved `attention_impl`): `xla` and `cudnn`
fold jnp blocks, the backward by autodiff (`jaxllm.parallel.ring_xla`); `flash` calls the Pallas
kernel per block pair, with a custom ring backward (`jaxllm.parallel.ring_flash`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxllm import sharding
from jaxllm.kernels.flash_attention.ops import BlockSizes
from jaxllm.parallel.ring_flash import ring_flash_local
from jaxllm.parallel.ring_xla import ring_xla_local


def zigzag_permutation(length: int, n: int) -> np.ndarray:
    """Indices `perm` such that contiguous n-way sharding of `x[:, perm]` gives device i the
    original chunks i and 2n-1-i (of 2n equal chunks); `perm[j]` is the original index of the
    token now at position j, i.e. its global index for the causal mask (and its RoPE position).
    """
    if length % (2 * n):
        raise ValueError(f"length {length} must be divisible by 2 * n = {2 * n} for zigzag")
    chunk_2nxC = np.arange(length).reshape(2 * n, length // (2 * n))
    order = [c for i in range(n) for c in (i, 2 * n - 1 - i)]
    return chunk_2nxC[order].reshape(-1)


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """`inv` with `x[:, perm][:, inv] == x`: undoes the zigzag layout (e.g. of attention outputs)."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def ring_attention_local(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    q_seg_BxL: jax.Array,
    kv_seg_BxS: jax.Array,
    q_idx_BxL: jax.Array,
    kv_idx_BxS: jax.Array,
    *,
    axis_name: str,
    causal: bool = True,
    scale: float | None = None,
    impl: str = "xla",
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    group: int = 1,
) -> jax.Array:
    """Attention of the local query shard over the keys/values of every shard of `axis_name`
    (with `group` > 1, of every `group`-th shard: the ring of USP, `ring_xla.ring_steps`).

    Call inside `jax.shard_map` with local shards. `*_seg` are segment ids (keys of other segments
    are masked), `*_idx` the global token indices (causal: query i sees keys j <= i). Rows with no
    visible key get zeros. Returns the local output in q's dtype.

    impl: `xla` / `cudnn` fold blocks in jnp; `flash` calls the Pallas kernel per block pair, with
    `block_sizes` and `interpret` (default: interpret on CPU) passed on to it, and needs
    `check_vma=False` on the enclosing shard_map (Pallas outputs carry no varying axes).
    """
    kd = q_BxLxHxK.shape[3]
    scale = kd**-0.5 if scale is None else float(scale)
    args = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS)
    if impl == "flash":
        return ring_flash_local(
            *args,
            axis_name=axis_name,
            causal=causal,
            scale=scale,
            block_sizes=block_sizes,
            interpret=interpret,
            group=group,
        )
    if impl not in ("xla", "cudnn"):
        raise ValueError(f"unknown attention implementation {impl!r} for ring attention")
    return ring_xla_local(*args, axis_name=axis_name, causal=causal, scale=scale, group=group)


def ring_attention_on_mesh(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    *,
    segment_ids_BxL: jax.Array | None,
    mesh: Mesh,
    axis_name: str,
    batch_axes: tuple[str, ...] | None,
    head_axis: str | None,
    causal: bool = True,
    scale: float | None = None,
    impl: str = "xla",
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Self-attention on GLOBAL arrays already in zigzag order along length (`zigzag_permutation`
    with n = mesh.shape[axis_name]); the output is in the same zigzag order.

    Length is sharded over `axis_name`, batch over `batch_axes`, query and kv heads over
    `head_axis` (G must divide by its size; contiguous head sharding keeps GQA groups together).
    `segment_ids_BxL=None` means one document per row. `impl` (`xla`, `cudnn` or `flash`),
    `block_sizes` and `interpret` as in `ring_attention_local`. Call it under `jax.jit`: run
    eagerly, shard_map dispatches the unrolled ring op by op (about 10 s on 8 CPU devices).
    """
    b, l = q_BxLxHxK.shape[:2]
    n = mesh.shape[axis_name]
    idx_BxL = jnp.broadcast_to(jnp.asarray(zigzag_permutation(l, n), jnp.int32)[None], (b, l))
    if segment_ids_BxL is None:
        segment_ids_BxL = jnp.zeros((b, l), jnp.int32)
    heads_spec = PartitionSpec(batch_axes, axis_name, head_axis, None)
    tokens_spec = PartitionSpec(batch_axes, axis_name)

    def local(q, k, v, seg, idx):
        return ring_attention_local(
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
            block_sizes=block_sizes,
            interpret=interpret,
        )

    # The jnp ring keeps shard_map's default check_vma=True (it casts its accumulators to the
    # varying axes lax.cond requires); Pallas kernels declare no varying axes on their outputs,
    # so the kernel ring runs unchecked, as `per_shard_attention` does.
    return jax.shard_map(
        local,
        mesh=sharding.shard_map_mesh(mesh),
        in_specs=(heads_spec, heads_spec, heads_spec, tokens_spec, tokens_spec),
        out_specs=heads_spec,
        check_vma=impl != "flash",
    )(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, idx_BxL)


# Under the active `sharding.Parallel` settings: the train step lays batches out, the model's
# attention asks whether to run the ring and runs it.


def _ring_mesh() -> Mesh | None:
    settings = sharding.current()
    mesh, mode = settings.mesh, settings.sequence_attention
    if mesh is None or mode != "ring" or mesh.shape["sequence"] == 1:
        return None
    return mesh


def ring_active() -> bool:
    """Whether attention should run as ring attention over the `sequence` axis."""
    return _ring_mesh() is not None


def sequence_layout(batch: dict) -> dict:
    """Lays each row out in zigzag order along length when ring attention (or USP, whose ring
    runs over mesh.sequence / mesh.sequence_ulysses groups) is active, so the causal work of the
    sequence shards is balanced. Losses are sums over tokens, so nothing has to be put back;
    RoPE reads the permuted `positions`."""
    settings = sharding.current()
    mesh, mode = settings.mesh, settings.sequence_attention
    if mesh is None or mode not in ("ring", "usp") or mesh.shape["sequence"] == 1:
        return batch
    n = mesh.shape["sequence"] // (settings.sequence_ulysses if mode == "usp" else 1)
    perm = zigzag_permutation(batch["inputs"].shape[1], n)
    return {k: v[:, perm] for k, v in batch.items()}


def ring_attention(
    q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, impl: str = "xla", causal: bool = True
) -> jax.Array:
    """Ring attention over the `sequence` axis of the active mesh on batches in `sequence_layout`
    order; `impl` (the resolved `attention_impl`) picks the per-block computation (`flash`: the
    kernel); `causal=False` for an encoder."""
    return ring_attention_on_mesh(
        q_BxLxHxK,
        k_BxLxGxK,
        v_BxLxGxK,
        segment_ids_BxL=segment_ids_BxL,
        mesh=_ring_mesh(),
        axis_name="sequence",
        batch_axes=sharding.RULES["batch"],
        head_axis=sharding.RULES["act_heads"][0],
        impl=impl,
        causal=causal,
    )

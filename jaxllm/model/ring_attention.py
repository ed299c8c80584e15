"""Context-parallel ring attention (Liu et al. 2023, arXiv:2310.01889) with zigzag load balancing.

The length axis is sharded over a mesh axis of n devices. Each device keeps its queries and passes
its keys/values around the ring (`jax.lax.ppermute`), n steps in all, folding every visiting block
into an online-softmax accumulator (running max m, sum l, output o in float32; Milakov &
Gimelshein 2018, arXiv:1805.02867), so no device ever holds the full S x S scores or all of K/V.

Causal load balancing ("zigzag", as in Llama 3 context parallelism, arXiv:2407.21783, and
zhuzilin/ring-flash-attention): the sequence is cut into 2n chunks and device i holds chunks i and
2n-1-i. Each local shard is processed as two half-blocks, and a (query half, key half) pair with no
visible (q, k) pair is skipped with `lax.cond`. Under zigzag every device then computes the same
number of half-blocks: 3 on its own shard and 2 on each of the n-1 visiting shards, where a
contiguous layout leaves device 0 idle and device n-1 doing all n steps.

Masks are by *global* token index (`q_idx >= kv_idx`) and segment id (`q_seg == kv_seg`, packed
documents), so the functions are correct for any layout; zigzag only makes them balanced. Callers
lay tokens out with `x[:, zigzag_permutation(L, n)]` and must give RoPE the permuted positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

# Finite stand-in for -inf: a fully masked row then gives exp(NEG - NEG) = 1, not NaN, and the
# explicit zeroing of masked probabilities below keeps that 1 out of l and o.
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


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


def _halves(x, axis=1):
    """Two half-blocks along `axis` (one when odd), the granularity at which work is skipped."""
    return jnp.split(x, 2, axis=axis) if x.shape[axis] % 2 == 0 else [x]


def _varying_axes(x) -> frozenset:
    """Mesh axes over which `x` varies inside shard_map: `aval.vma` up to jax 0.9, then
    `aval.manual_axis_type.varying` (jax 0.10). Empty outside shard_map or with check_vma=False.
    """
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    return frozenset(getattr(getattr(aval, "manual_axis_type", None), "varying", ()))


def _fold_block(acc, q_BxLxGxRxK, k_BxSxGxK, v_BxSxGxK, mask_BxLxS, scale):
    """One online-softmax step: merge softmax(q k^T) v over this key block into (m, l, o)."""
    m_BxGxRxL, l_BxGxRxL, o_BxGxRxLxK = acc
    scores_BxGxRxLxS = jnp.einsum(
        "blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32
    )
    visible_Bx1x1xLxS = mask_BxLxS[:, None, None]
    scores_BxGxRxLxS = jnp.where(visible_Bx1x1xLxS, scores_BxGxRxLxS * scale, _NEG)
    # The output o / l is exactly independent of m (both carry the same exp(-m) factor), so m
    # needs no gradient; stopping it saves the backward pass through the running max.
    m_new_BxGxRxL = jax.lax.stop_gradient(jnp.maximum(m_BxGxRxL, scores_BxGxRxLxS.max(-1)))
    # Zeroed where masked: a row with no visible key yet has m == _NEG and exp(0) == 1 otherwise.
    p_BxGxRxLxS = jnp.where(
        visible_Bx1x1xLxS, jnp.exp(scores_BxGxRxLxS - m_new_BxGxRxL[..., None]), 0.0
    )
    correction_BxGxRxL = jnp.exp(m_BxGxRxL - m_new_BxGxRxL)
    l_BxGxRxL = l_BxGxRxL * correction_BxGxRxL + p_BxGxRxLxS.sum(-1)
    # Probabilities in v's dtype for the matmul (as the reference `_xla_attention`), float32 sum.
    pv_BxGxRxLxK = jnp.einsum(
        "bgrls,bsgk->bgrlk",
        p_BxGxRxLxS.astype(v_BxSxGxK.dtype),
        v_BxSxGxK,
        preferred_element_type=jnp.float32,
    )
    o_BxGxRxLxK = o_BxGxRxLxK * correction_BxGxRxL[..., None] + pv_BxGxRxLxK
    return m_new_BxGxRxL, l_BxGxRxL, o_BxGxRxLxK


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
) -> jax.Array:
    """Attention of the local query shard over the keys/values of every shard of `axis_name`.

    Call inside `jax.shard_map` with local shards. `*_seg` are segment ids (keys of other segments
    are masked), `*_idx` the global token indices (causal: query i sees keys j <= i). Rows with no
    visible key get zeros. Returns the local output in q's dtype.
    """
    b, l, h, kd = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    scale = kd**-0.5 if scale is None else scale
    n = jax.lax.axis_size(axis_name)
    # Device j sends to j+1, so at step t device i holds the shard that started on i - t.
    ring = [(j, (j + 1) % n) for j in range(n)]

    q_BxLxGxRxK = q_BxLxHxK.reshape(b, l, g, h // g, kd)
    q_parts = list(zip(_halves(q_BxLxGxRxK), _halves(q_seg_BxL), _halves(q_idx_BxL)))
    # Under shard_map's varying-manual-axes check (check_vma=True, its default) both lax.cond
    # branches must agree on which mesh axes a value varies over; the fold varies like its inputs,
    # so the skip branch's accumulator must start out that way. (Empty, a no-op, when unchecked.)
    inputs = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS)
    varying = tuple(set().union(*(_varying_axes(x) for x in inputs)))
    accs = []
    for q_part_BxLxGxRxK, _, _ in q_parts:
        lq = q_part_BxLxGxRxK.shape[1]
        acc = (
            jnp.full((b, g, h // g, lq), _NEG, jnp.float32),
            jnp.zeros((b, g, h // g, lq), jnp.float32),
            jnp.zeros((b, g, h // g, lq, kd), jnp.float32),
        )
        accs.append(jax.lax.pcast(acc, varying, to="varying"))

    kv = (k_BxSxGxK, v_BxSxGxK, kv_seg_BxS, kv_idx_BxS)
    for step in range(n):  # n is static: unrolled, so every ppermute is visible to the scheduler
        # Send this shard on before computing with it: the transfer does not depend on the
        # compute, so it can overlap it. The last visiting shard need not move on.
        if step < n - 1:
            next_kv = tuple(jax.lax.ppermute(x, axis_name, ring) for x in kv)
        kv_parts = list(zip(*(_halves(x) for x in kv)))
        for a, (q_part_BxLxGxRxK, q_seg_part_BxL, q_idx_part_BxL) in enumerate(q_parts):
            for k_part_BxSxGxK, v_part_BxSxGxK, kv_seg_part_BxS, kv_idx_part_BxS in kv_parts:
                mask_BxLxS = q_seg_part_BxL[:, :, None] == kv_seg_part_BxS[:, None, :]
                if causal:
                    mask_BxLxS &= q_idx_part_BxL[:, :, None] >= kv_idx_part_BxS[:, None, :]
                # Skipping fully masked half-blocks is what turns the zigzag layout into equal
                # work per device; the predicate is per device, which shard_map allows.
                accs[a] = jax.lax.cond(
                    jnp.any(mask_BxLxS),
                    lambda acc, *blk: _fold_block(acc, *blk, scale),
                    lambda acc, *blk: acc,
                    accs[a],
                    q_part_BxLxGxRxK,
                    k_part_BxSxGxK,
                    v_part_BxSxGxK,
                    mask_BxLxS,
                )
        if step < n - 1:
            kv = next_kv

    outs = []
    for _, l_BxGxRxL, o_BxGxRxLxK in accs:
        # l == 0 only for rows that saw no key at all; their o is 0 too, so they come out as 0.
        l_safe_BxGxRxL = jnp.where(l_BxGxRxL == 0.0, 1.0, l_BxGxRxL)
        outs.append(o_BxGxRxLxK / l_safe_BxGxRxL[..., None])
    out_BxGxRxLxK = jnp.concatenate(outs, axis=3)
    out_BxLxGxRxK = jnp.transpose(out_BxGxRxLxK, (0, 3, 1, 2, 4))
    return out_BxLxGxRxK.reshape(b, l, h, kd).astype(q_BxLxHxK.dtype)


def ring_attention(
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
) -> jax.Array:
    """Self-attention on GLOBAL arrays already in zigzag order along length (`zigzag_permutation`
    with n = mesh.shape[axis_name]); the output is in the same zigzag order.

    Length is sharded over `axis_name`, batch over `batch_axes`, query and kv heads over
    `head_axis` (G must divide by its size; contiguous head sharding keeps GQA groups together).
    `segment_ids_BxL=None` means one document per row. Call it under `jax.jit`: run eagerly,
    shard_map dispatches the unrolled ring op by op (about 10 s on 8 CPU devices).
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
            q, k, v, seg, seg, idx, idx, axis_name=axis_name, causal=causal, scale=scale
        )

    # shard_map's default check_vma=True holds: the local function casts its accumulators to
    # the varying axes that lax.cond requires.
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads_spec, heads_spec, heads_spec, tokens_spec, tokens_spec),
        out_specs=heads_spec,
    )(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, idx_BxL)

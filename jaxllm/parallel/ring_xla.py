"""Ring attention with jnp blocks (`impl` `xla`, and `cudnn`, whose fused call returns no
logsumexp): each visiting half-block is folded into an online-softmax accumulator (running max
m, sum l, output o in float32; Milakov & Gimelshein 2018, arXiv:1805.02867), and the backward is
autodiff through the unrolled ring (ppermute transposes to the reverse ppermute).

Each local shard is processed as two half-blocks, and a (query half, key half) pair with no
visible (q, k) pair is skipped with `lax.cond`; under the zigzag layout (`jaxllm.parallel.ring`)
that gives every device the same number of half-blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels.flash_attention.reference import MASK_VALUE

# Finite stand-in for -inf: a fully masked row then gives exp(NEG - NEG) = 1, not NaN, and the
# explicit zeroing of masked probabilities below keeps that 1 out of l and o. The same value as
# the kernel's MASK_VALUE, the logsumexp of its empty rows.
_NEG = MASK_VALUE


def halves(x, axis=1):
    """Two half-blocks along `axis` (one when odd), the granularity at which work is skipped."""
    return jnp.split(x, 2, axis=axis) if x.shape[axis] % 2 == 0 else [x]


def _in_pipeline_stage() -> bool:
    """Whether this code runs on a mesh split into pipeline stages (`stage` > 1)."""
    shape = dict(jax.sharding.get_abstract_mesh().shape)
    return shape.get("stage", 1) > 1


def rotate(x, axis_name: str, perm):
    """`lax.ppermute(x, axis_name, perm)`, also correct inside pipeline stages.

    There the stages run different actions in the same tick (`jaxllm.parallel.pipeline`), and
    every ppermute of a shard_map is lowered with the same channel id and with the pairs of every
    stage, so a runtime that matches collective-permutes by channel and participants (XLA's CPU
    runtime does) pairs one stage's ring step with another stage's different ppermute and moves
    the wrong data. An `all_to_all` over the axis is grouped by stage, so inside stages the
    shift is one: each device puts x in the slot of its destination (zeros elsewhere) and takes
    the slot of its source; n times ppermute's traffic, the price of matching the stage's
    collectives to the stage alone."""
    if not _in_pipeline_stage():
        return jax.lax.ppermute(x, axis_name, perm)
    n = jax.lax.axis_size(axis_name)
    dest, src = [-1] * n, [-1] * n
    for a, b in perm:
        dest[a], src[b] = b, a
    i = jax.lax.axis_index(axis_name)
    to, frm = jnp.asarray(dest)[i], jnp.asarray(src)[i]
    slots = jnp.zeros((n, *x.shape), x.dtype)
    slots = jnp.where((to >= 0) & (jnp.arange(n) == to).reshape(-1, *[1] * x.ndim), x, slots)
    got = jax.lax.all_to_all(slots, axis_name, 0, 0, tiled=True)
    return jnp.where(frm >= 0, got[jnp.maximum(frm, 0)], jnp.zeros_like(x))


def ring_steps(axis_name: str, group: int = 1) -> tuple[int, list[tuple[int, int]]]:
    """(steps, ppermute pairs) of the ring over `axis_name` when its devices form consecutive
    groups of `group` (USP: Ulysses inside a group, `jaxllm.parallel.ulysses`): device j sends
    to j + group, so each rank of a group has its own ring through every group, of
    size / group steps. `group=1`: the plain ring over every device."""
    size = jax.lax.axis_size(axis_name)
    return size // group, [(j, (j + group) % size) for j in range(size)]


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


def ring_xla_local(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    q_seg_BxL: jax.Array,
    kv_seg_BxS: jax.Array,
    q_idx_BxL: jax.Array,
    kv_idx_BxS: jax.Array,
    *,
    axis_name: str,
    causal: bool,
    scale: float,
    group: int = 1,
) -> jax.Array:
    """`jaxllm.parallel.ring.ring_attention_local` with jnp blocks: call inside `jax.shard_map`
    with local shards. Rows with no visible key get zeros; the output is in q's dtype."""
    b, l, h, kd = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    # Device j sends to j+group, so at step t device i holds the shard that started on
    # i - t * group.
    n, ring = ring_steps(axis_name, group)

    q_BxLxGxRxK = q_BxLxHxK.reshape(b, l, g, h // g, kd)
    q_parts = list(zip(halves(q_BxLxGxRxK), halves(q_seg_BxL), halves(q_idx_BxL)))
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
            next_kv = tuple(rotate(x, axis_name, ring) for x in kv)
        kv_parts = list(zip(*(halves(x) for x in kv)))
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

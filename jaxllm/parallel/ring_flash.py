"""Ring attention with the Pallas kernel per block (`impl` `flash`).

Each (query half, key half) pair is one call of the kernel (`flash_attention_with_lse`), and the
partial results are merged in float32 by their logsumexp: lse = logaddexp(lse_acc, lse_i), out =
exp(lse_acc - lse) out_acc + exp(lse_i - lse) out_i. The kernel's causal mask compares positions
within the block, so each pair is classified from its global indices (O(L) reductions, no [L, S]
mask): fully masked (skipped), fully visible (causal=False: two different zigzag chunks), or on
the diagonal (causal=True; identical, increasing q and kv indices: a chunk against itself). Any
other pair (layouts whose half-blocks are not whole chunks) takes a jnp block with the exact
mask, so this path is correct for any layout too. Segment ids go to the kernel as a (q_ids,
kv_ids) pair. Steps and pairs are `fori_loop`s whose body dispatches the kinds with `lax.switch`,
so each kernel is compiled once rather than once per (step, pair); the price of a uniform step
body is one redundant K/V hop (after the last step), and in the backward one redundant dK/dV hop
(zeros, before the first).

Its backward is a custom ring pass, not autodiff. Autodiff would keep, per device, every visiting
K/V shard and every pair's partial output and logsumexp, O(n) times the local activations, i.e.
the full sequence, which is what sequence parallelism exists to avoid. The custom backward keeps
only the local q, k, v, the merged output and its logsumexp (O(L / n)), and sends K/V around the
ring once more; each pair runs the FlashAttention-2 backward with the *merged* statistics
(`flash_attention_backward`: p = exp(s - lse) is then the probability under the whole attention,
delta = rowsum(dout * out) its correction), so no per-pair forward is kept or recomputed. dK/dV
accumulate in float32 and travel with their shard (sent one step behind it, so the send overlaps
the next step's compute); one final ppermute brings them home.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxllm.kernels.flash_attention.ops import (
    BlockSizes,
    flash_attention_backward,
    flash_attention_with_lse,
)
from jaxllm.kernels.flash_attention.reference import (
    MASK_VALUE,
    masked_attention,
    masked_attention_backward,
)
from jaxllm.kernels.reference import attention_mask
from jaxllm.parallel.ring_xla import halves, ring_steps, rotate


def ring_flash_local(
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
    block_sizes: BlockSizes | None,
    interpret: bool | None,
    group: int = 1,
) -> jax.Array:
    """`jaxllm.parallel.ring.ring_attention_local` with the kernel per block pair: call inside
    `jax.shard_map` with `check_vma=False` (Pallas outputs carry no varying axes). `interpret`
    None: interpret on CPU; `group`: see `ring_xla.ring_steps`."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    opts = _RingOptions(axis_name, causal, scale, block_sizes, interpret, group)
    return _ring_flash(
        q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS, opts
    )


@dataclasses.dataclass(frozen=True)
class _RingOptions:
    """Static arguments of the kernel ring (hashable: a custom_vjp nondiff argument)."""

    axis_name: str
    causal: bool
    scale: float
    block_sizes: BlockSizes | None
    interpret: bool
    group: int = 1


def _pair_branches(opts: _RingOptions) -> tuple[str, ...]:
    """The kinds of (query half, key half) pair, in `lax.switch` order."""
    if not opts.causal:  # segments only: the kernel applies them, whatever the layout
        return ("skip", "full")
    return ("skip", "full", "diagonal", "general")


def _pair_kind(branches, ids, causal: bool):
    """Index into `branches` of the kind of the pair whose (q_seg, kv_seg, q_idx, kv_idx) are
    `ids`, from O(L) reductions (no [L, S] mask outside the `general` branch).

    Skipped when, in every row, causality or disjoint segment-id ranges hide all keys: exact for
    segment ids that never decrease along the sequence, as packing makes them; otherwise a pair
    may run to no effect, never the other way round.
    """
    q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS = ids
    hidden_B = (q_seg_BxL.max(1) < kv_seg_BxS.min(1)) | (q_seg_BxL.min(1) > kv_seg_BxS.max(1))
    if not causal:
        return jnp.where(jnp.all(hidden_B), branches.index("skip"), branches.index("full"))
    hidden_B |= q_idx_BxL.max(1) < kv_idx_BxS.min(1)
    all_before = jnp.all(q_idx_BxL.min(1) >= kv_idx_BxS.max(1))
    kind = jnp.where(all_before, branches.index("full"), branches.index("general"))
    if q_idx_BxL.shape == kv_idx_BxS.shape:  # the kernel's mask compares in-block positions
        aligned = jnp.all(q_idx_BxL == kv_idx_BxS) & jnp.all(q_idx_BxL[:, 1:] > q_idx_BxL[:, :-1])
        kind = jnp.where(aligned, branches.index("diagonal"), kind)
    return jnp.where(jnp.all(hidden_B), branches.index("skip"), kind)


def _exact_mask(ids):
    """[B, L, S] visibility by segment and global index (the `general` pairs)."""
    q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS = ids
    return attention_mask(q_idx_BxL, kv_idx_BxS, causal=True, segment_ids=(q_seg_BxL, kv_seg_BxS))


def _kernel_kwargs(opts: _RingOptions, kind: str, ids) -> dict:
    return dict(
        causal=kind == "diagonal",
        segment_ids=ids[:2],
        sm_scale=opts.scale,
        block_sizes=opts.block_sizes,
        interpret=opts.interpret,
    )


def _merge(acc, block_out_BxLxHxK, block_lse_BxHxL):
    """Adds one block's normalised (out, lse) to the running (out, lse), in float32. Empty rows
    carry lse MASK_VALUE (finite), so their weight is exactly 0 next to any non-empty row."""
    out_BxLxHxK, lse_BxHxL = acc
    new_lse_BxHxL = jnp.logaddexp(lse_BxHxL, block_lse_BxHxL)

    def weight_BxLxHx1(part_lse_BxHxL):
        return jnp.exp(part_lse_BxHxL - new_lse_BxHxL).transpose(0, 2, 1)[..., None]

    out_BxLxHxK = out_BxLxHxK * weight_BxLxHx1(lse_BxHxL)
    out_BxLxHxK += block_out_BxLxHxK.astype(jnp.float32) * weight_BxLxHx1(block_lse_BxHxL)
    return out_BxLxHxK, new_lse_BxHxL


def _pair_forward(kind: str, opts: _RingOptions):
    """The lax.switch branch folding one pair of this kind into its query half's (out, lse)."""

    def fold(acc, q, k, v, ids):
        if kind == "skip":
            return acc
        if kind == "general":
            block = masked_attention(q, k, v, _exact_mask(ids), scale=opts.scale)
        else:
            block = flash_attention_with_lse(q, k, v, **_kernel_kwargs(opts, kind, ids))
        return _merge(acc, *block)

    return fold


def _pair_backward(kind: str, opts: _RingOptions):
    """The lax.switch branch giving one pair's (dq, dk, dv), float32, from the merged (out, lse)
    of its query half."""

    def grads(q, k, v, out, lse, dout, ids):
        if kind == "skip":
            return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
        if kind == "general":
            dq, dk, dv = masked_attention_backward(
                q, k, v, out, lse, dout, _exact_mask(ids), scale=opts.scale
            )
        else:
            dq, dk, dv = flash_attention_backward(
                q, k, v, out, lse, dout, **_kernel_kwargs(opts, kind, ids)
            )
        return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

    return grads


def _stack_halves(x, axis=1):
    """[P, ...] with P = 2 half-blocks along `axis` (1 when odd), for dynamic indexing."""
    return jnp.stack(halves(x, axis=axis))


def _unstack_halves(x_PxN, axis=1):
    """Inverse of `_stack_halves`."""
    return jnp.concatenate(tuple(x_PxN), axis=axis)


def _at(x_PxN, i):
    return jax.lax.dynamic_index_in_dim(x_PxN, i, axis=0, keepdims=False)


def _ring_flash_forward(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    q_seg_BxL,
    kv_seg_BxS,
    q_idx_BxL,
    kv_idx_BxS,
    opts: _RingOptions,
):
    """The kernel ring's forward: (out in q's dtype, merged lse [B, H, L] float32)."""
    b, _, h, kd = q_BxLxHxK.shape
    n, ring = ring_steps(opts.axis_name, opts.group)
    q_PxBxLxHxK = _stack_halves(q_BxLxHxK)
    q_seg_PxBxL, q_idx_PxBxL = _stack_halves(q_seg_BxL), _stack_halves(q_idx_BxL)
    p, lh = q_PxBxLxHxK.shape[0], q_PxBxLxHxK.shape[2]
    branches = _pair_branches(opts)

    def pair(i, acc, kv_halves):  # folds pair (query half a, key half c) into query half a
        a, c = jax.lax.div(i, p), jax.lax.rem(i, p)
        out_PxBxLxHxK, lse_PxBxHxL = acc
        k_part, v_part, kv_seg_part, kv_idx_part = (_at(x, c) for x in kv_halves)
        ids = (_at(q_seg_PxBxL, a), kv_seg_part, _at(q_idx_PxBxL, a), kv_idx_part)
        new_acc = jax.lax.switch(
            _pair_kind(branches, ids, opts.causal),
            [_pair_forward(name, opts) for name in branches],
            (_at(out_PxBxLxHxK, a), _at(lse_PxBxHxL, a)),
            _at(q_PxBxLxHxK, a),
            k_part,
            v_part,
            ids,
        )
        return (
            jax.lax.dynamic_update_index_in_dim(out_PxBxLxHxK, new_acc[0], a, axis=0),
            jax.lax.dynamic_update_index_in_dim(lse_PxBxHxL, new_acc[1], a, axis=0),
        )

    def step(_, carry):
        kv, acc = carry
        next_kv = tuple(rotate(x, opts.axis_name, ring) for x in kv)  # overlaps pairs
        kv_halves = tuple(_stack_halves(x) for x in kv)
        acc = jax.lax.fori_loop(0, p * p, lambda i, acc: pair(i, acc, kv_halves), acc)
        return next_kv, acc

    acc = (
        jnp.zeros((p, b, lh, h, kd), jnp.float32),
        jnp.full((p, b, h, lh), MASK_VALUE, jnp.float32),
    )
    kv = (k_BxSxGxK, v_BxSxGxK, kv_seg_BxS, kv_idx_BxS)
    _, (out_PxBxLxHxK, lse_PxBxHxL) = jax.lax.fori_loop(0, n, step, (kv, acc))
    out_BxLxHxK = _unstack_halves(out_PxBxLxHxK).astype(q_BxLxHxK.dtype)
    return out_BxLxHxK, _unstack_halves(lse_PxBxHxL, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ring_flash(
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS, opts
):
    return _ring_flash_forward(
        q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS, opts
    )[0]


def _ring_flash_fwd(q, k, v, q_seg, kv_seg, q_idx, kv_idx, opts):
    out, lse = _ring_flash_forward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, opts)
    return out, (q, k, v, q_seg, kv_seg, q_idx, kv_idx, out, lse)  # O(L / n): local only


def _ring_flash_bwd(opts: _RingOptions, residuals, dout_BxLxHxK):
    """K/V go round the ring again; each pair adds its share to dq (local) and to the float32
    dK/dV of the visiting shard, which follow that shard one step behind and finally go home."""
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS = residuals[:7]
    out_BxLxHxK, lse_BxHxL = residuals[7:]
    n, ring = ring_steps(opts.axis_name, opts.group)
    q_halves = (
        _stack_halves(q_BxLxHxK),
        _stack_halves(out_BxLxHxK),
        _stack_halves(lse_BxHxL, axis=2),
        _stack_halves(dout_BxLxHxK),
        _stack_halves(q_seg_BxL),
        _stack_halves(q_idx_BxL),
    )
    p = q_halves[0].shape[0]
    branches = _pair_branches(opts)

    def send(xs):
        return tuple(rotate(x, opts.axis_name, ring) for x in xs)

    def pair(i, grads, kv_halves):  # adds pair (query half a, key half c) to dq[a], dk/dv[c]
        a, c = jax.lax.div(i, p), jax.lax.rem(i, p)
        dq_PxBxLxHxK, dk_PxBxSxGxK, dv_PxBxSxGxK = grads
        q_part, out_part, lse_part, dout_part, q_seg_part, q_idx_part = (
            _at(x, a) for x in q_halves
        )
        k_part, v_part, kv_seg_part, kv_idx_part = (_at(x, c) for x in kv_halves)
        ids = (q_seg_part, kv_seg_part, q_idx_part, kv_idx_part)
        dq, dk, dv = jax.lax.switch(
            _pair_kind(branches, ids, opts.causal),  # as in the forward: the same kind per pair
            [_pair_backward(name, opts) for name in branches],
            q_part,
            k_part,
            v_part,
            out_part,
            lse_part,
            dout_part,
            ids,
        )

        def add(x_PxN, i, y):
            return jax.lax.dynamic_update_index_in_dim(x_PxN, _at(x_PxN, i) + y, i, axis=0)

        return add(dq_PxBxLxHxK, a, dq), add(dk_PxBxSxGxK, c, dk), add(dv_PxBxSxGxK, c, dv)

    def step(_, carry):
        # dkv: this device's float32 (dk, dv) sums for the shard it held at the previous step,
        # which the next device holds now. Both sends overlap this step's pairs.
        kv, dkv, dq_PxBxLxHxK = carry
        next_kv, arrived = send(kv), send(dkv)
        kv_halves = tuple(_stack_halves(x) for x in kv)
        zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in kv_halves[:2])
        dq_PxBxLxHxK, dk_PxBxSxGxK, dv_PxBxSxGxK = jax.lax.fori_loop(
            0, p * p, lambda i, g: pair(i, g, kv_halves), (dq_PxBxLxHxK, *zeros)
        )
        mine = (_unstack_halves(dk_PxBxSxGxK), _unstack_halves(dv_PxBxSxGxK))
        return next_kv, tuple(x + y for x, y in zip(arrived, mine)), dq_PxBxLxHxK

    kv = (k_BxSxGxK, v_BxSxGxK, kv_seg_BxS, kv_idx_BxS)
    dkv = (jnp.zeros(k_BxSxGxK.shape, jnp.float32), jnp.zeros(v_BxSxGxK.shape, jnp.float32))
    dq_PxBxLxHxK = jnp.zeros(q_halves[0].shape, jnp.float32)
    _, dkv, dq_PxBxLxHxK = jax.lax.fori_loop(0, n, step, (kv, dkv, dq_PxBxLxHxK))
    dk_BxSxGxK, dv_BxSxGxK = send(dkv)  # device i holds the sums of shard i + 1: one hop home
    return (
        _unstack_halves(dq_PxBxLxHxK).astype(q_BxLxHxK.dtype),
        dk_BxSxGxK.astype(k_BxSxGxK.dtype),
        dv_BxSxGxK.astype(v_BxSxGxK.dtype),
        None,
        None,
        None,
        None,
    )


_ring_flash.defvjp(_ring_flash_fwd, _ring_flash_bwd)

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

Two block implementations (`impl`, the model's resolved `attention_impl`):

- `xla` (and `cudnn`, whose fused call returns no logsumexp): each visiting half-block is folded
  in jnp (`_fold_block`), and the backward is autodiff through the unrolled ring (ppermute
  transposes to the reverse ppermute).
- `flash`: each (query half, key half) pair is one call of the Pallas kernel
  (`flash_attention_with_lse`), and the partial results are merged in float32 by their
  logsumexp: lse = logaddexp(lse_acc, lse_i), out = exp(lse_acc - lse) out_acc +
  exp(lse_i - lse) out_i. The kernel's causal mask compares positions within the block, so each
  pair is classified from its global indices (O(L) reductions, no [L, S] mask): fully masked
  (skipped), fully visible (causal=False: two different zigzag chunks), or on the diagonal
  (causal=True; identical, increasing q and kv indices: a chunk against itself). Any other pair
  (layouts whose half-blocks are not whole chunks) takes a jnp block with the exact mask, so this
  path is correct for any layout too. Segment ids go to the kernel as a (q_ids, kv_ids) pair.
  Steps and pairs are `fori_loop`s whose body dispatches the kinds with `lax.switch`, so each
  kernel is compiled once rather than once per (step, pair); the price of a uniform step body is
  one redundant K/V hop (after the last step), and in the backward one redundant dK/dV hop
  (zeros, before the first).

  Its backward is a custom ring pass, not autodiff. Autodiff would keep, per device, every
  visiting K/V shard and every pair's partial output and logsumexp, O(n) times the local
  activations, i.e. the full sequence, which is what sequence parallelism exists to avoid. The
  custom backward keeps only the local q, k, v, the merged output and its logsumexp (O(L / n)),
  and sends K/V around the ring once more; each pair runs the FlashAttention-2 backward with the
  *merged* statistics (`flash_attention_backward`: p = exp(s - lse) is then the probability under
  the whole attention, delta = rowsum(dout * out) its correction), so no per-pair forward is kept
  or recomputed. dK/dV accumulate in float32 and travel with their shard (sent one step behind it,
  so the send overlaps the next step's compute); one final ppermute brings them home.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

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

# Finite stand-in for -inf: a fully masked row then gives exp(NEG - NEG) = 1, not NaN, and the
# explicit zeroing of masked probabilities below keeps that 1 out of l and o. The same value as
# the kernel's MASK_VALUE, the logsumexp of its empty rows.
_NEG = MASK_VALUE


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
    impl: str = "xla",
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of the local query shard over the keys/values of every shard of `axis_name`.

    Call inside `jax.shard_map` with local shards. `*_seg` are segment ids (keys of other segments
    are masked), `*_idx` the global token indices (causal: query i sees keys j <= i). Rows with no
    visible key get zeros. Returns the local output in q's dtype.

    impl: `xla` / `cudnn` fold blocks in jnp; `flash` calls the Pallas kernel per block pair, with
    `block_sizes` and `interpret` (default: interpret on CPU) passed on to it, and needs
    `check_vma=False` on the enclosing shard_map (Pallas outputs carry no varying axes).
    """
    b, l, h, kd = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    scale = kd**-0.5 if scale is None else float(scale)
    if impl == "flash":
        if interpret is None:
            interpret = jax.default_backend() == "cpu"
        opts = _RingOptions(axis_name, causal, scale, block_sizes, interpret)
        return _ring_flash(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS, opts
        )
    if impl not in ("xla", "cudnn"):
        raise ValueError(f"unknown attention implementation {impl!r} for ring attention")
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


# ------------------------------------------------------------------ flash: kernel per block


@dataclasses.dataclass(frozen=True)
class _RingOptions:
    """Static arguments of the kernel ring (hashable: a custom_vjp nondiff argument)."""

    axis_name: str
    causal: bool
    scale: float
    block_sizes: BlockSizes | None
    interpret: bool


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
    same_segment_BxLxS = q_seg_BxL[:, :, None] == kv_seg_BxS[:, None, :]
    return same_segment_BxLxS & (q_idx_BxL[:, :, None] >= kv_idx_BxS[:, None, :])


def _kernel_kwargs(opts: _RingOptions, kind: str, ids) -> dict:
    return dict(
        causal=kind == "diagonal", segment_ids=ids[:2], sm_scale=opts.scale,
        block_sizes=opts.block_sizes, interpret=opts.interpret,
    )  # fmt: skip


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
    return jnp.stack(_halves(x, axis=axis))


def _unstack_halves(x_PxN, axis=1):
    """Inverse of `_stack_halves`."""
    return jnp.concatenate(tuple(x_PxN), axis=axis)


def _at(x_PxN, i):
    return jax.lax.dynamic_index_in_dim(x_PxN, i, axis=0, keepdims=False)


def _ring_flash_forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, q_idx_BxL,
                        kv_idx_BxS, opts: _RingOptions):  # fmt: skip
    """The kernel ring's forward: (out in q's dtype, merged lse [B, H, L] float32)."""
    b, _, h, kd = q_BxLxHxK.shape
    n = jax.lax.axis_size(opts.axis_name)
    ring = [(j, (j + 1) % n) for j in range(n)]
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
            (_at(out_PxBxLxHxK, a), _at(lse_PxBxHxL, a)), _at(q_PxBxLxHxK, a), k_part, v_part, ids,
        )  # fmt: skip
        return (
            jax.lax.dynamic_update_index_in_dim(out_PxBxLxHxK, new_acc[0], a, axis=0),
            jax.lax.dynamic_update_index_in_dim(lse_PxBxHxL, new_acc[1], a, axis=0),
        )

    def step(_, carry):
        kv, acc = carry
        next_kv = tuple(jax.lax.ppermute(x, opts.axis_name, ring) for x in kv)  # overlaps pairs
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
def _ring_flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, q_idx_BxL, kv_idx_BxS,
                opts):  # fmt: skip
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
    n = jax.lax.axis_size(opts.axis_name)
    ring = [(j, (j + 1) % n) for j in range(n)]
    q_halves = (
        _stack_halves(q_BxLxHxK), _stack_halves(out_BxLxHxK), _stack_halves(lse_BxHxL, axis=2),
        _stack_halves(dout_BxLxHxK), _stack_halves(q_seg_BxL), _stack_halves(q_idx_BxL),
    )  # fmt: skip
    p = q_halves[0].shape[0]
    branches = _pair_branches(opts)

    def send(xs):
        return tuple(jax.lax.ppermute(x, opts.axis_name, ring) for x in xs)

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
            q_part, k_part, v_part, out_part, lse_part, dout_part, ids,
        )  # fmt: skip

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
        None, None, None, None,
    )  # fmt: skip


_ring_flash.defvjp(_ring_flash_fwd, _ring_flash_bwd)


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
            q, k, v, seg, seg, idx, idx, axis_name=axis_name, causal=causal, scale=scale,
            impl=impl, block_sizes=block_sizes, interpret=interpret,
        )  # fmt: skip

    # The jnp ring keeps shard_map's default check_vma=True (it casts its accumulators to the
    # varying axes lax.cond requires); Pallas kernels declare no varying axes on their outputs,
    # so the kernel ring runs unchecked, as `sharding.per_shard_attention` does.
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads_spec, heads_spec, heads_spec, tokens_spec, tokens_spec),
        out_specs=heads_spec,
        check_vma=impl != "flash",
    )(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, idx_BxL)

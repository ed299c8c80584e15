"""Compressed gradient exchange over the `data` mesh axis (`train.grad_compression`).

Each data replica holds the whole model and computes its share of the gradient (its rows'
sum over the global token count, so the shares add up to the mean gradient). Instead of the
all-reduce of those shares, every replica compresses its share, the compressed pieces are
all-gathered, and every replica decompresses and adds them all, in the same order, so the
result is the same on every replica. The functions below run per replica, inside a
`jax.shard_map` manual over the data axis (`jaxllm.train.step`).

- `topk`: Top-K sparsification with error feedback (Stich et al., "Sparsified SGD with
  memory", 2018; Lin et al., DGC, 2018): the replica adds its residual (what it has not sent
  yet) to its share, sends the k = ceil(ratio * size) entries of largest magnitude of each
  tensor as (value, int32 index) pairs, and keeps the rest as the next residual. The
  residuals, one per replica, live in the train state (`TrainState.grad_comp`) sharded over
  the data axis, so checkpoints hold them and a resume continues bit for bit.
- `dgc`: Deep Gradient Compression (Lin et al., ICLR 2018), the parts that act on the
  exchange: local gradient clipping (each replica clips its share to clip_norm / sqrt(replicas)
  before accumulating), momentum correction (u <- m u + g, v <- v + u; the top-k of v are
  sent), momentum factor masking (u and v zeroed where sent), and the exponential sparsity
  warm-up (densities 25%, 6.25%, 1.5625%, 0.390625%, those above `ratio`, in equal parts of
  `warmup` steps, then `ratio`). The momentum lives in the replicas, so the optimizer steps
  plain SGD on what is exchanged (`train.grad_compression=dgc` takes `optim.momentum` and
  `optim.clip_norm` for this and builds the optimizer without them).
- `tagc`: TAGC (Polyakov et al., "TAGC: Optimizing Gradient Communication in Distributed
  Transformer Training", 2025), read as: layer-selective (only the feed-forward weights, every
  parameter under an `mlp` key, are compressed; attention, embeddings and norms are summed
  uncompressed, as the paper keeps attention layers whole), dynamic sparsification with error
  feedback (the threshold is the largest step of a fixed ladder of magnitudes, `TAGC_STEPS`,
  that zeroes less than 1 - ratio of the tensor; what it zeroes is the residual), and lossless
  homomorphic compression: the replicas' nonzero bitmaps (1 bit an entry) are gathered into
  one shared index, each replica packs its values in that index's order into a vector of
  r = ceil(2 * ratio * size) slots, and those vectors are summed (a psum: the compression is
  linear, so the sum of the packed vectors is the packed sum). Where the shared index holds
  more than r entries, those past the r-th stay in the residuals. The paper's count sketch
  with peeling decoder is another way to the same packed sum; this reading uses the shared
  index for the order directly, which is exact whenever the sketch would decode.
- `qsgd`: QSGD (Alistarh et al., 2017) with one bucket per tensor: each entry v_i becomes
  sign(v_i) * ||v|| * xi_i / s, where xi_i is |v_i| / ||v|| * s rounded up or down at random
  with the probability that makes it unbiased, s = 2^(bits-1) - 1 levels. The replica sends
  the signed levels as int8 (bits <= 8) or int16 codes and one float32 norm per tensor. No
  state: the randomness is a function of the run's seed, the step and the replica.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

METHODS = ("topk", "dgc", "qsgd", "tagc")
# TAGC's ladder of sparsification thresholds (its SPARSIFY_STEPS).
TAGC_STEPS = (
    *(1e-20, 1e-15, 1e-10, 1e-8),
    *(m * 10.0**e for e in range(-7, 0) for m in (1, 2, 5)),
)
# DGC's warm-up densities (sparsity 75%, 93.75%, 98.4375%, 99.6%: x4 each stage).
DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.00390625)


@dataclasses.dataclass(frozen=True)
class Compression:
    """How each replica's gradient is compressed: `method` (topk | qsgd), topk's `ratio`
    (share of entries sent), qsgd's `bits` (per entry, sign included)."""

    method: str
    ratio: float = 0.01
    bits: int = 8
    momentum: float = 0.0  # dgc: m of the momentum correction
    clip_norm: float | None = None  # dgc: the global clip norm (None: no local clipping)
    warmup: int = 0  # dgc: steps of the sparsity warm-up

    @classmethod
    def of(cls, cfg) -> Compression | None:
        """A config's compression (`train.grad_compression*`, and for dgc `optim.momentum` /
        `optim.clip_norm`); None for `grad_compression: none`."""
        t = cfg.train
        if t.grad_compression == "none":
            return None
        dgc = t.grad_compression == "dgc"
        return cls(
            t.grad_compression,
            t.grad_compression_ratio,
            t.grad_compression_bits,
            momentum=cfg.optim.momentum if dgc else 0.0,
            clip_norm=cfg.optim.clip_norm if dgc else None,
            warmup=t.grad_compression_warmup,
        )

    @property
    def stateful(self) -> bool:
        """Whether each replica keeps state between steps (residuals, DGC's momentum)."""
        return self.method in ("topk", "dgc", "tagc")

    def densities(self) -> tuple[float, ...]:
        """The shares sent per warm-up stage then after it (one entry without a warm-up)."""
        if self.method != "dgc" or not self.warmup:
            return (self.ratio,)
        return (*(d for d in DGC_WARMUP if d > self.ratio), self.ratio)

    @property
    def levels(self) -> int:
        """qsgd: the levels s of |v_i| / ||v|| on each side of zero."""
        return 2 ** (self.bits - 1) - 1

    def slots(self, size: int) -> int:
        """tagc: the packed vector's length for a tensor of `size` entries."""
        return max(1, min(size, math.ceil(2 * self.ratio * size)))

    def k(self, size: int, density: float | None = None) -> int:
        """topk / dgc: entries of a tensor of `size` entries one replica sends."""
        density = self.ratio if density is None else density
        return max(1, min(size, math.ceil(density * size)))

    def init(self, params, replicas: int):
        """The state of `replicas` replicas over `params`: {'residual': float32 zeros of
        [replicas, *shape] per parameter} for topk; None when the method keeps none."""
        if not self.stateful:
            return None
        zeros = lambda p: jnp.zeros((replicas, *p.shape), jnp.float32)  # noqa: E731
        if self.method == "dgc":
            return {
                "momentum": jax.tree.map(zeros, params),
                "residual": jax.tree.map(zeros, params),
            }
        return {"residual": jax.tree.map(zeros, params)}

    def exchange(self, share, state, key, axis: str, step=0):
        """(the sum over replicas of their decompressed shares, this replica's new state):
        per replica, inside a shard_map manual over `axis`. `share`: this replica's float32
        gradient share; `state`: its slice of `init`'s state (leading dim 1), or None; `key`:
        a PRNG key that differs per replica and step (qsgd); `step`: the optimizer step (the
        dgc warm-up)."""
        leaves, treedef = jax.tree.flatten(share)
        if self.method == "dgc":
            return self._dgc(share, state, axis, step)
        if self.method == "tagc":
            paths = [_is_mlp(path) for path, _ in jax.tree_util.tree_flatten_with_path(share)[0]]
            residual = jax.tree.leaves(state["residual"])
            out = [
                _tagc(self, g, r[0], axis) if mlp else (jax.lax.psum(g, axis), r[0])
                for g, r, mlp in zip(leaves, residual, paths)
            ]
            total = treedef.unflatten([t for t, _ in out])
            return total, {"residual": treedef.unflatten([r[None] for _, r in out])}
        if self.method == "topk":
            residual = jax.tree.leaves(state["residual"])
            out = [_topk(self, g, r[0], axis) for g, r in zip(leaves, residual)]
            total = treedef.unflatten([t for t, _ in out])
            kept = treedef.unflatten([r[None] for _, r in out])
            return total, {"residual": kept}
        keys = jax.random.split(key, len(leaves))
        total = [_qsgd(self, g, k, axis) for g, k in zip(leaves, keys)]
        return treedef.unflatten(total), state

    def _dgc(self, share, state, axis: str, step):
        if self.clip_norm is not None:  # local clipping, the threshold scaled by N^-1/2
            limit = self.clip_norm / math.sqrt(jax.lax.axis_size(axis))
            norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(share)))
            share = jax.tree.map(lambda g: g * jnp.minimum(1.0, limit / (norm + 1e-12)), share)
        u = jax.tree.map(lambda m, g: self.momentum * m[0] + g, state["momentum"], share)
        v = jax.tree.map(lambda r, u: r[0] + u, state["residual"], u)
        densities = self.densities()
        stage_steps = -(-self.warmup // max(len(densities) - 1, 1))
        stage = jnp.minimum(step // max(stage_steps, 1), len(densities) - 1)

        def send(density):
            def run(u, v):
                out = [_dgc_leaf(self, a, b, density, axis) for a, b in zip(u, v)]
                return tuple(zip(*out))

            return run

        u_leaves, treedef = jax.tree.flatten(u)
        branches = [send(d) for d in densities]
        total, u_new, v_new = jax.lax.switch(stage, branches, u_leaves, jax.tree.leaves(v))
        kept = {
            "momentum": treedef.unflatten([x[None] for x in u_new]),
            "residual": treedef.unflatten([x[None] for x in v_new]),
        }
        return treedef.unflatten(list(total)), kept

    def wire_bytes(self, params) -> int:
        """Bytes one replica sends per step for `params` (what the all-gather carries; dgc:
        after its warm-up)."""
        sizes = [p.size for p in jax.tree.leaves(params)]
        if self.method in ("topk", "dgc"):
            return sum(self.k(n) * 8 for n in sizes)  # float32 value + int32 index
        if self.method == "tagc":
            flat = jax.tree_util.tree_flatten_with_path(params)[0]
            return sum(
                -(-p.size // 8) + 4 * self.slots(p.size) if _is_mlp(path) else 4 * p.size
                for path, p in flat
            )
        code = 1 if self.bits <= 8 else 2
        return sum(n * code + 4 for n in sizes)


def top_k_sparsify(acc_N, k: int):
    """(values, int32 indices, rest): the k entries of largest magnitude of a flat vector and
    the vector with them zeroed (the residual error feedback keeps)."""
    _, idx = jax.lax.top_k(jnp.abs(acc_N), k)
    vals = acc_N[idx]
    rest = acc_N.at[idx].set(0.0)
    return vals, idx.astype(jnp.int32), rest


def _topk(comp: Compression, g, residual, axis: str):
    acc = (g.astype(jnp.float32) + residual).reshape(-1)
    vals, idx, rest = top_k_sparsify(acc, comp.k(acc.size))
    all_vals = jax.lax.all_gather(vals, axis)  # [replicas, k]
    all_idx = jax.lax.all_gather(idx, axis)
    total = jnp.zeros_like(acc).at[all_idx.reshape(-1)].add(all_vals.reshape(-1))
    return total.reshape(g.shape), rest.reshape(g.shape)


def _dgc_leaf(comp: Compression, u, v, density: float, axis: str):
    """(sum of the replicas' sent entries, masked momentum, masked accumulation) of one
    tensor: the top-k of v are sent and zeroed in u and v (momentum factor masking)."""
    flat_v, flat_u = v.reshape(-1), u.reshape(-1)
    vals, idx, rest = top_k_sparsify(flat_v, comp.k(flat_v.size, density))
    all_vals = jax.lax.all_gather(vals, axis)
    all_idx = jax.lax.all_gather(idx, axis)
    total = jnp.zeros_like(flat_v).at[all_idx.reshape(-1)].add(all_vals.reshape(-1))
    u_kept = flat_u.at[idx].set(0.0)
    return total.reshape(v.shape), u_kept.reshape(u.shape), rest.reshape(v.shape)


def _is_mlp(path) -> bool:
    return any(getattr(k, "key", None) == "mlp" for k in path)


def tagc_threshold(acc_N, ratio: float):
    """The largest step of `TAGC_STEPS` that zeroes less than 1 - ratio of |acc| (0 when even
    the smallest zeroes more): TAGC's dynamic sparsification."""
    steps = jnp.asarray(TAGC_STEPS, jnp.float32)
    zeroed = jnp.mean(jnp.abs(acc_N)[None, :] < steps[:, None], axis=1)
    below = zeroed < 1.0 - ratio  # monotone: True then False along the ladder
    return jnp.where(jnp.any(below), jnp.max(jnp.where(below, steps, 0.0)), 0.0)


def _tagc(comp: Compression, g, residual, axis: str):
    acc = (g.astype(jnp.float32) + residual).reshape(-1)
    sparse = jnp.where(jnp.abs(acc) < tagc_threshold(acc, comp.ratio), 0.0, acc)
    bits = jnp.packbits(sparse != 0)  # the replica's index, 1 bit an entry
    shared = jnp.unpackbits(jax.lax.all_gather(bits, axis), axis=1)[:, : acc.size]
    union = jnp.any(shared, axis=0)
    slots = comp.slots(acc.size)
    (idx,) = jnp.nonzero(union, size=slots, fill_value=acc.size)  # the shared order
    packed = jnp.where(idx < acc.size, sparse.at[idx].get(mode="fill", fill_value=0.0), 0.0)
    summed = jax.lax.psum(packed, axis)
    total = jnp.zeros_like(acc).at[idx].add(summed, mode="drop")
    sent = jnp.zeros_like(acc).at[idx].set(packed, mode="drop")
    return total.reshape(g.shape), (acc - sent).reshape(g.shape)


def qsgd_encode(v_N, key, levels: int, bits: int):
    """(signed level codes, float32 norm) of a flat vector: QSGD's stochastic quantisation,
    `qsgd_decode(codes, norm, levels)` is an unbiased estimate of v."""
    v = v_N.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(v * v))
    scaled = jnp.abs(v) / jnp.where(norm > 0, norm, 1.0) * levels
    low = jnp.floor(scaled)
    up = jax.random.uniform(key, v.shape) < scaled - low
    level = jnp.minimum(low + up.astype(jnp.float32), levels)
    codes = (jnp.sign(v) * level).astype(jnp.int8 if bits <= 8 else jnp.int16)
    return codes, norm


def qsgd_decode(codes, norm, levels: int):
    return codes.astype(jnp.float32) * (norm / levels)


def _qsgd(comp: Compression, g, key, axis: str):
    codes, norm = qsgd_encode(g.reshape(-1), key, comp.levels, comp.bits)
    all_codes = jax.lax.all_gather(codes, axis)  # [replicas, size]
    all_norms = jax.lax.all_gather(norm, axis)  # [replicas]
    total = jnp.sum(qsgd_decode(all_codes, all_norms[:, None], comp.levels), axis=0)
    return total.reshape(g.shape)

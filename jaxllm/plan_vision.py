"""`jaxllm plan`'s bill of a vision-language model's tower (`model.vision`): its parameters
and optimizer state as the train state holds them, and the activations of its forward and
backward pass for an image budget, compiled on their own on one device.

The tower's compute depends on the images, which a text batch does not have: the budget is
`images` images at `model.vision.max_pixels` (the largest the processor makes), each
(1, h, h) patches with h the largest multiple of spatial_merge whose square of pixels fits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.model.vision import VisionTower
from jaxllm.model.vlm import VISION_IMPLS


def largest_grid(v) -> tuple[int, int, int]:
    """The patch grid of a square image at `max_pixels`."""
    factor = v.patch_size * v.spatial_merge
    side = max(1, math.isqrt(v.max_pixels) // factor) * v.spatial_merge
    return (1, side, side)


def _bytes(leaf, sharding) -> int:
    return int(np.prod(sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize


def _visual_bytes(tree, shardings) -> int:
    """Per-device bytes of the leaves of `tree` under a `visual` dict key."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return sum(
        _bytes(leaf, sh)
        for (path, leaf), sh in zip(leaves, jax.tree.leaves(shardings))
        if any(getattr(k, "key", None) == "visual" for k in path)
    )


def vision_bill(cfg, state, shardings, images: int, trains: bool) -> dict | None:
    """The tower's share (None without one): `params` (count), per-device bytes of its
    `parameters` (trained and frozen) and `optimizer_state`, and `activations`: XLA's
    temporaries for `images` images of `largest_grid`, forward and (when the tower `trains`)
    backward."""
    m = cfg.model
    v = m.vision
    if v is None:
        return None
    grid = largest_grid(v)
    impl = m.attention_impl if m.attention_impl in VISION_IMPLS else "xla"
    tower = nnx.eval_shape(
        lambda: VisionTower(
            v,
            dtype=m.dtype,
            param_dtype=m.param_dtype,
            remat=m.remat,
            attention_impl=impl,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, abstract = nnx.split(tower)
    patches = images * math.prod(grid)
    pixels = jax.ShapeDtypeStruct((patches, tower.patch_embed.shape[0]), jnp.dtype(m.dtype))

    def loss(weights, px):
        return jnp.sum(nnx.merge(graphdef, weights)(px, [grid] * images).astype(jnp.float32))

    fn = jax.grad(loss) if trains else loss
    compiled = jax.jit(fn).lower(abstract, pixels).compile()
    frozen = 0 if state.frozen is None else _visual_bytes(state.frozen, shardings.frozen)
    return {
        "params": sum(x.size for x in jax.tree.leaves(abstract)),
        "parameters": _visual_bytes(state.params, shardings.params) + frozen,
        "optimizer_state": _visual_bytes(state.opt_state, shardings.opt_state),
        "images": images,
        "grid": grid,
        "patches": patches,
        "trains": trains,
        "activations": compiled.memory_analysis().temp_size_in_bytes,
    }


def vision_lines(vb: dict | None, fmt_bytes) -> list[str]:
    if vb is None:
        return []
    t, h, w = vb["grid"]
    how = "forward and backward" if vb["trains"] else "forward (frozen)"
    return [
        f"  vision tower: {vb['params']:,} parameters, {fmt_bytes(vb['parameters'])} "
        f"(optimizer state {fmt_bytes(vb['optimizer_state'])}) of the bill above",
        f"    + activations of {vb['images']} image(s) of {h}x{w} patches ({vb['patches']:,} "
        f"patches), {how} on one device: {fmt_bytes(vb['activations'])}",
    ]

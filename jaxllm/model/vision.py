"""The vision tower of Qwen2.5-VL (Bai et al. 2025, arXiv:2502.13923) in Flax NNX: a ViT over
the patches of images of any size, packed into one sequence, and a merger into LM tokens.

- Patch embedding: a Conv3d whose kernel equals its stride is a linear map of each flattened
  patch of `in_channels x temporal_patch_size x patch_size^2` pixels (the processor's rows).
- 2D RoPE: head_dim / 4 frequencies rotate by a patch's row, as many by its column; the
  angles are laid out [h, w, h, w] over the head dim and rotate halves, as in transformers.
- Attention is bidirectional within an image (frame, for video), given as segment ids; the
  blocks not in `fullatt_block_indexes` attend within square windows of
  `window_size / patch_size` patches only. The tokens are reordered window by window (in units
  of spatial_merge^2 patches, so each window is contiguous, as transformers' window index) and
  back after the merger.
- Blocks: pre-RMSNorm attention (qkv and output projections with biases) and a SwiGLU MLP
  with biases. The merger: RMSNorm, then spatial_merge^2 neighbouring patches (contiguous in
  the processor's order) joined and mapped by Linear -> GELU -> Linear to the LM's width.

Qwen3-VL's tower (Bai et al. 2025, arXiv:2511.21631) is the same with other options: no
windows (`window_size=0`), LayerNorms, a tanh-GELU MLP, a patch bias, a learned table of
absolute positions resampled bilinearly to each grid (`position_embeddings`), and DeepStack
mergers (`deepstack_indexes`, norm after the merge) whose features `features` returns too.

Shapes: P patches (of all images), M merged tokens (P / spatial_merge^2), I pixels per patch,
D width, H heads, K head dim, O the LM's width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config.vision import VisionConfig
from jaxllm.model import lora
from jaxllm.model.dot_product import dot_product_attention
from jaxllm.model.layers import LayerNorm, RMSNorm, matmul, param
from jaxllm.model.mlp import MLP
from jaxllm.model.remat import REMAT_POLICIES

Grids = Sequence[tuple[int, int, int]]
"""(frames, rows, columns) of patches per image, as the processor's `image_grid_thw`."""


def patch_positions(grids: Grids, merge: int) -> np.ndarray:
    """int32 [P, 2]: the (row, column) of every patch, in the processor's order (each image's
    patches in spatial_merge x spatial_merge blocks, block rows first; frames repeat)."""
    out = []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int32)


def window_layout(grids: Grids, merge: int, window: int) -> tuple[np.ndarray, ...]:
    """The window reordering of merged units (`window` units a side) for `grids`, as numpy:
    the unit order int [M] (unit i of the windowed sequence is unit order[i] of the processor's),
    the window id of each windowed unit [M] and the image (frame) id of each windowed unit [M]."""
    order, windows, frames = [], [], []
    units = n_windows = n_frames = 0
    for t, h, w in grids:
        hh, ww = h // merge, w // merge
        f, i, j = (a.reshape(-1) for a in np.meshgrid(*map(np.arange, (t, hh, ww)), indexing="ij"))
        wh, wc = -(-hh // window), -(-ww // window)
        win = (f * wh + i // window) * wc + j // window
        local = np.lexsort(((i % window) * window + j % window, win))  # window, then row-major
        order.append(local + units)
        windows.append(win[local] + n_windows)
        frames.append(f[local] + n_frames)
        units, n_windows, n_frames = units + t * hh * ww, n_windows + t * wh * wc, n_frames + t
    return tuple(np.concatenate(a).astype(np.int32) for a in (order, windows, frames))


def rope_angles(positions_Px2: np.ndarray, head_dim: int, theta: float) -> np.ndarray:
    """float32 [P, K]: the rotary angles of each patch, [row freqs, col freqs] twice."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim // 2, 2, dtype=np.float32) / (head_dim // 2))
    freqs_Px2xF = positions_Px2[:, :, None].astype(np.float32) * inv_freq
    half_PxK2 = freqs_Px2xF.reshape(len(positions_Px2), -1)
    return np.concatenate([half_PxK2, half_PxK2], axis=-1).astype(np.float32)


def position_taps(positions_Px2: np.ndarray, grids: Grids, side: int) -> tuple[np.ndarray, ...]:
    """(rows int32 [P, 4], weights float32 [P, 4]): each patch's bilinear taps into a learned
    side x side position table resampled to its image's grid with corners aligned (as torch's
    `interpolate(mode="bilinear", align_corners=True)`)."""
    sizes_Px2 = np.concatenate([np.tile([[h, w]], (t * h * w, 1)) for t, h, w in grids])
    src = positions_Px2 * (side - 1) / np.maximum(sizes_Px2 - 1, 1)
    lo = np.floor(src)
    taps, weights = [], []
    for dr, dc in ((0, 0), (0, 1), (1, 0), (1, 1)):
        rc = np.clip(lo + (dr, dc), 0, side - 1)
        wt = np.clip(1 - np.abs(src - lo - (dr, dc)), 0, None)
        taps.append(rc[:, 0] * side + rc[:, 1])
        weights.append(wt[:, 0] * wt[:, 1])
    return np.stack(taps, 1).astype(np.int32), np.stack(weights, 1).astype(np.float32)


def _norm(cfg: VisionConfig, dim: int, dtype, param_dtype) -> RMSNorm:
    cls = LayerNorm if cfg.norm == "layer" else RMSNorm
    return cls(dim, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)


def _rotate(x_1xPxHxK: jax.Array, cos_1xPx1xK: jax.Array, sin_1xPx1xK: jax.Array) -> jax.Array:
    x = x_1xPxHxK.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = x * cos_1xPx1xK + jnp.concatenate([-x2, x1], axis=-1) * sin_1xPx1xK
    return out.astype(x_1xPxHxK.dtype)


class VisionAttention(nnx.Module):
    """Bidirectional multi-head attention with biases and 2D RoPE, masked by segment ids."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, impl: str, rngs: nnx.Rngs):
        d, h, k = cfg.width, cfg.heads, cfg.head_dim
        normal, zeros = jax.nn.initializers.normal(0.02), jax.nn.initializers.zeros
        self.dtype, self.impl = dtype, impl
        w_axes, b_axes = ("embed", "heads", "head_dim"), ("heads", "head_dim")
        self.q_proj = param(rngs, normal, (d, h, k), w_axes, param_dtype)
        self.k_proj = param(rngs, normal, (d, h, k), w_axes, param_dtype)
        self.v_proj = param(rngs, normal, (d, h, k), w_axes, param_dtype)
        self.q_bias = param(rngs, zeros, (h, k), b_axes, param_dtype)
        self.k_bias = param(rngs, zeros, (h, k), b_axes, param_dtype)
        self.v_bias = param(rngs, zeros, (h, k), b_axes, param_dtype)
        self.o_proj = param(rngs, normal, (h, k, d), ("heads", "head_dim", "embed"), param_dtype)
        self.o_bias = param(rngs, zeros, (d,), ("embed",), param_dtype)

    def _project(self, x_1xPxD, name: str) -> jax.Array:
        y = matmul("bld,dhk->blhk", x_1xPxD, lora.kernel(self, f"{name}_proj"), self.dtype)
        return y + getattr(self, f"{name}_bias")[...].astype(self.dtype)[None, None]

    def __call__(self, x_1xPxD, cos_1xPx1xK, sin_1xPx1xK, segments_1xP) -> jax.Array:
        q, k, v = (self._project(x_1xPxD, n) for n in ("q", "k", "v"))
        q, k = _rotate(q, cos_1xPx1xK, sin_1xPx1xK), _rotate(k, cos_1xPx1xK, sin_1xPx1xK)
        out_1xPxHxK = dot_product_attention(
            q,
            k,
            v,
            q_segment_ids_BxL=segments_1xP,
            kv_segment_ids_BxS=segments_1xP,
            causal=False,
            impl=self.impl,
        )
        y = matmul("blhk,hkd->bld", out_1xPxHxK, lora.kernel(self, "o_proj"), self.dtype)
        return y + self.o_bias[...].astype(self.dtype)[None, None]


class VisionBlock(nnx.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)) with an MLP with biases (SwiGLU, or
    Linear -> tanh GELU -> Linear)."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, impl: str, rngs: nnx.Rngs):
        self.norm1 = _norm(cfg, cfg.width, dtype, param_dtype)
        self.norm2 = _norm(cfg, cfg.width, dtype, param_dtype)
        self.attn = VisionAttention(cfg, dtype=dtype, param_dtype=param_dtype, impl=impl, rngs=rngs)
        self.mlp = MLP(
            cfg.width,
            cfg.mlp_dim,
            "swiglu" if cfg.mlp_activation == "swiglu" else "gelu",
            gelu_approximate=True,
            bias=True,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x_1xPxD, cos_1xPx1xK, sin_1xPx1xK, segments_1xP) -> jax.Array:
        x_1xPxD = x_1xPxD + self.attn(self.norm1(x_1xPxD), cos_1xPx1xK, sin_1xPx1xK, segments_1xP)
        return x_1xPxD + self.mlp(self.norm2(x_1xPxD))


class PatchMerger(nnx.Module):
    """The norm, then each spatial_merge^2 consecutive patches concatenated [M, D m^2] and
    mapped Linear -> GELU (exact) -> Linear to the LM's width O; `after_merge`: the norm
    over the concatenation instead (DeepStack's mergers)."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, after_merge=False):
        wide = cfg.width * cfg.spatial_merge**2
        normal, zeros = jax.nn.initializers.normal(0.02), jax.nn.initializers.zeros
        self.dtype, self.after_merge = dtype, after_merge
        self.norm = _norm(cfg, wide if after_merge else cfg.width, dtype, param_dtype)
        self.fc1 = param(rngs, normal, (wide, wide), ("embed", "mlp"), param_dtype)
        self.fc1_bias = param(rngs, zeros, (wide,), ("mlp",), param_dtype)
        self.fc2 = param(rngs, normal, (wide, cfg.out_dim), ("mlp", "embed"), param_dtype)
        self.fc2_bias = param(rngs, zeros, (cfg.out_dim,), ("embed",), param_dtype)

    def __call__(self, x_PxD: jax.Array) -> jax.Array:
        wide = self.fc1.shape[0]
        if self.after_merge:
            x_MxW = self.norm(x_PxD.reshape(-1, wide))
        else:
            x_MxW = self.norm(x_PxD).reshape(-1, wide)
        h_MxW = matmul("mw,wv->mv", x_MxW, lora.kernel(self, "fc1"), self.dtype)
        h_MxW = jax.nn.gelu(h_MxW + self.fc1_bias[...].astype(self.dtype)[None], approximate=False)
        y_MxO = matmul("mv,vo->mo", h_MxW, lora.kernel(self, "fc2"), self.dtype)
        return y_MxO + self.fc2_bias[...].astype(self.dtype)[None]


class VisionTower(nnx.Module):
    """pixels [P, I] (the processor's `pixel_values` of all images) and their patch grids ->
    LM tokens [M, O], image after image, each image's in the processor's order. `grids` are
    Python ints (static under `jax.jit`). `remat`: a policy of `ModelConfig.remat` per block
    ("none": keep every activation); `attention_impl`: as `dot_product_attention`'s `impl`."""

    def __init__(
        self,
        cfg: VisionConfig,
        *,
        dtype="float32",
        param_dtype="float32",
        remat: str = "none",
        attention_impl: str = "xla",
        rngs: nnx.Rngs,
    ):
        cfg.validate()
        remat = "none" if remat == "auto" else remat  # resolved before training
        if remat != "none" and remat not in REMAT_POLICIES:
            raise ValueError(f"remat {remat!r} is not 'none' or one of {sorted(REMAT_POLICIES)}")
        self.cfg, self.remat = cfg, remat
        dtype, param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
        self.dtype = dtype
        pixels = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        normal = jax.nn.initializers.normal(0.02)
        self.patch_embed = param(
            rngs, normal, (pixels, cfg.width), ("vision_patch", "embed"), param_dtype
        )
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.blocks = nnx.List(
            VisionBlock(cfg, impl=attention_impl, **kw) for _ in range(cfg.depth)
        )
        self.merger = PatchMerger(cfg, **kw)
        if cfg.patch_bias:
            self.patch_bias = param(
                rngs, jax.nn.initializers.zeros, (cfg.width,), ("embed",), param_dtype
            )
        if cfg.position_embeddings:
            shape, axes = (cfg.position_embeddings, cfg.width), ("vision_patch", "embed")
            self.pos_embed = param(rngs, normal, shape, axes, param_dtype)
        self.deepstack = nnx.List(
            PatchMerger(cfg, after_merge=True, **kw) for _ in cfg.deepstack_indexes
        )

    def layout(self, grids: Grids) -> dict[str, np.ndarray]:
        """`tower_layout` of this tower's config."""
        return tower_layout(self.cfg, grids)

    def __call__(self, pixels_PxI: jax.Array, grids: Grids) -> jax.Array:
        """The merged tokens [M, O] of the images (see the class)."""
        return self.features(pixels_PxI, grids)[0]

    def features(self, pixels_PxI: jax.Array, grids: Grids):
        """(merged tokens [M, O], DeepStack features [S, M, O] or None without
        `deepstack_indexes`), both in the processor's order."""
        grids = [tuple(int(v) for v in g) for g in grids]
        n = sum(t * h * w for t, h, w in grids)
        if pixels_PxI.shape != (n, self.patch_embed.shape[0]):
            raise ValueError(
                f"pixels of shape {pixels_PxI.shape} do not match grids {grids}: "
                f"expected {(n, self.patch_embed.shape[0])}"
            )
        lay = self.layout(grids)
        pos = None
        if self.cfg.position_embeddings:
            pos = (jnp.asarray(lay["pos_taps"])[None], jnp.asarray(lay["pos_weights"])[None])
        merged_1xMxO, deep_Sx1xMxO = self._encode(
            pixels_PxI[lay["patch_order"]][None],
            jnp.asarray(lay["angles"])[None, :, None, :],
            jnp.asarray(lay["frame_ids"])[None],
            jnp.asarray(lay["window_ids"])[None],
            pos,
        )
        back = np.argsort(lay["unit_order"])
        deep = None if deep_Sx1xMxO is None else deep_Sx1xMxO[:, 0][:, back]
        return merged_1xMxO[0][back], deep

    def encode_rows(self, pixels_BxNxI, positions_BxNx2, frames_BxN, windows_BxN, **pos):
        """Merged tokens [B, N / spatial_merge^2, O] of `row_features` (without DeepStack's)."""
        return self.row_features(pixels_BxNxI, positions_BxNx2, frames_BxN, windows_BxN, **pos)[0]

    def row_features(
        self,
        pixels_BxNxI,
        positions_BxNx2,
        frames_BxN,
        windows_BxN,
        taps_BxNxT=None,
        tap_weights_BxNxT=None,
    ):
        """(merged tokens [B, N / spatial_merge^2, O], DeepStack features [S, B, N /
        spatial_merge^2, O] or None), in window order, of per-row patches already in window
        order (`tower_layout`'s `patch_order`) with their (row, column) positions, segment ids
        and, with `position_embeddings`, their taps into the table and weights (`pos_taps`,
        `pos_weights`); shapes are fixed, so one compile serves any images. Padding patches
        carry a segment id of their own (they attend only to each other) and their merged
        tokens are never read."""
        cfg = self.cfg
        pos = None
        if cfg.position_embeddings:
            if taps_BxNxT is None or tap_weights_BxNxT is None:
                raise ValueError("a tower with position_embeddings needs the patches' taps")
            pos = (taps_BxNxT, tap_weights_BxNxT)
        k2 = cfg.head_dim // 2
        inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, k2, 2, dtype=np.float32) / k2)
        freqs_BxNx2xF = positions_BxNx2[..., None].astype(jnp.float32) * inv_freq[None, None, None]
        half_BxNxK2 = freqs_BxNx2xF.reshape(*positions_BxNx2.shape[:2], -1)
        angles_BxNxK = jnp.concatenate([half_BxNxK2, half_BxNxK2], axis=-1)
        return self._encode(pixels_BxNxI, angles_BxNxK[:, :, None], frames_BxN, windows_BxN, pos)

    def _encode(self, pixels_BxPxI, angles_BxPx1xK, frames_BxP, windows_BxP, pos=None):
        """Patches in window order -> (merged tokens [B, P / spatial_merge^2, O], DeepStack
        features [S, B, P / spatial_merge^2, O] or None), window order. `pos`: the learned
        position embeddings' (taps [B, P, T], weights [B, P, T]) of each patch."""
        cfg = self.cfg
        x_BxPxD = matmul("bpi,id->bpd", pixels_BxPxI, lora.kernel(self, "patch_embed"), self.dtype)
        if cfg.patch_bias:
            x_BxPxD = x_BxPxD + self.patch_bias[...].astype(self.dtype)[None, None]
        if pos is not None:
            taps_BxPxT = pos[0]  # in range by construction: gathered flat, as one table read
            rows = jnp.take(self.pos_embed[...], taps_BxPxT.reshape(-1), axis=0, mode="clip")
            rows_BxPxTxD = rows.reshape(*taps_BxPxT.shape, -1)
            x_BxPxD = x_BxPxD + (rows_BxPxTxD * pos[1][..., None]).sum(2).astype(self.dtype)
        cos, sin = jnp.cos(angles_BxPx1xK), jnp.sin(angles_BxPx1xK)

        def run(block, x, cos, sin, segments):
            return block(x, cos, sin, segments)

        if self.remat != "none":
            run = nnx.remat(run, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        b, p, d = x_BxPxD.shape
        unit, deep = cfg.spatial_merge**2, []
        for i, block in enumerate(self.blocks):
            full = i in cfg.fullatt_block_indexes or not cfg.window_size
            x_BxPxD = run(block, x_BxPxD, cos, sin, frames_BxP if full else windows_BxP)
            if i in cfg.deepstack_indexes:
                merger = self.deepstack[cfg.deepstack_indexes.index(i)]
                deep.append(merger(x_BxPxD.reshape(b * p, d)).reshape(b, p // unit, -1))
        merged = self.merger(x_BxPxD.reshape(b * p, d)).reshape(b, p // unit, -1)
        return merged, (jnp.stack(deep) if deep else None)


def tower_layout(cfg: VisionConfig, grids: Grids) -> dict[str, np.ndarray]:
    """The static index arrays of `grids` (numpy): `patch_order` [P] (windowed patch i is
    the processor's patch patch_order[i]), `unit_order` [M], the segment ids of the windowed
    patches for full (`frame_ids`) and window attention (`window_ids`), their (row, column)
    `positions` [P, 2] and RoPE `angles` [P, K]; with `position_embeddings` the taps and
    weights of each patch's bilinear sample of the table (`pos_taps`, `pos_weights`)."""
    unit = cfg.spatial_merge**2
    for t, h, w in grids:
        if min(t, h, w) < 1 or h % cfg.spatial_merge or w % cfg.spatial_merge:
            raise ValueError(
                f"image grid {(t, h, w)}: rows and columns must be positive multiples of "
                f"spatial_merge={cfg.spatial_merge}"
            )
    window = cfg.window_size // cfg.spatial_merge // cfg.patch_size
    if not window:  # no windows: one per frame, in the processor's order
        window = max(max(h, w) for _, h, w in grids) // cfg.spatial_merge
    order_M, windows_M, frames_M = window_layout(grids, cfg.spatial_merge, window)
    patch_order = (order_M[:, None] * unit + np.arange(unit)[None]).reshape(-1)
    positions = patch_positions(grids, cfg.spatial_merge)
    out = {
        "patch_order": patch_order,
        "unit_order": order_M,
        "frame_ids": np.repeat(frames_M, unit),
        "window_ids": np.repeat(windows_M, unit),
        "positions": positions[patch_order],
        "angles": rope_angles(positions, cfg.head_dim, cfg.rope_theta)[patch_order],
    }
    if cfg.position_embeddings:
        side = math.isqrt(cfg.position_embeddings)
        taps, weights = position_taps(positions, grids, side)
        out["pos_taps"], out["pos_weights"] = taps[patch_order], weights[patch_order]
    return out

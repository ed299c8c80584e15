"""A Qwen2.5-VL style vision-language model (Bai et al. 2025, arXiv:2502.13923): the decoder
(`Transformer`, with multimodal RoPE) and a vision tower (`VisionTower`) whose merged patch
features replace the embeddings of the image tokens, in order, as transformers'
`Qwen2_5_VLModel` does (`masked_scatter`): the m-th `image_token_id` of the batch (row-major)
gets the m-th merged patch of the images, image after image. Text-only calls are the decoder's.
Positions are [3, B, L] with images (`jaxllm.model.mrope.mrope_positions`). With DeepStack
(`vision.deepstack_indexes`, Qwen3-VL), the tower's features of those blocks are added to the
image tokens' hidden states after the first decoder layers, one each.

Training batches give the images per row instead (`image_rows`, laid out on the host by
`HostLayout` for `jaxllm.data.vision_rows`): each row's patches, already in window order and
padded to a fixed budget, and per token the merged unit it takes, so one compiled step serves
images of any size; learned position embeddings come as each patch's taps into the table, and
DeepStack's features are gathered per row at the image tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model.mrope import mrope_positions
from jaxllm.model.outputs import ModelOutput
from jaxllm.model.transformer import MODEL_KINDS, Transformer
from jaxllm.model.vision import Grids, VisionTower, tower_layout
from jaxllm.sharding import constrain

VISION_IMPLS = ("xla", "flash")  # the tower's attention: these, else xla


class VisionLanguageModel(Transformer):
    """tokens [B, L] (+ pixels [P, I] and their patch grids) -> logits [B, L, V]; the tower is
    `visual` (`ModelConfig.vision`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        impl = cfg.attention_impl if cfg.attention_impl in VISION_IMPLS else "xla"
        self.visual = VisionTower(
            cfg.vision,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            remat=cfg.remat,
            attention_impl=impl,
            rngs=rngs,
        )

    def __call__(
        self, tokens_BxL=None, *, pixel_values=None, image_grid_thw=None, image_rows=None, **kwargs
    ) -> ModelOutput:
        """As `Transformer.__call__`, with `pixel_values` [P, I] (the processor's rows of all
        images) and `image_grid_thw` (their (t, h, w) patch grids, Python ints): the images'
        features go where `tokens_BxL` holds `cfg.vision.image_token_id`. The number of those
        tokens must be the images' merged patches (sum t h w / spatial_merge^2)."""
        if image_rows is not None:
            x_BxLxD, deepstack = self.image_row_inputs(tokens_BxL, **image_rows)
            return super().__call__(embeddings_BxLxD=x_BxLxD, deepstack=deepstack, **kwargs)
        if pixel_values is None:
            return super().__call__(tokens_BxL, **kwargs)
        if tokens_BxL is None or image_grid_thw is None:
            raise ValueError("pixel_values need tokens_BxL and image_grid_thw")
        x_BxLxD, deepstack = self.image_inputs(tokens_BxL, pixel_values, image_grid_thw)
        return super().__call__(embeddings_BxLxD=x_BxLxD, deepstack=deepstack, **kwargs)

    def embed_images(self, tokens_BxL, pixels_PxI, grids: Grids) -> jax.Array:
        """The token embeddings [B, L, D] with the image tokens' replaced by the tower's
        features of `pixels_PxI`, in order (without DeepStack's: see `image_inputs`)."""
        return self.image_inputs(tokens_BxL, pixels_PxI, grids)[0]

    def image_inputs(self, tokens_BxL, pixels_PxI, grids: Grids):
        """(the token embeddings [B, L, D] with the image tokens' replaced by the tower's
        features of `pixels_PxI`, in order; `Transformer`'s `deepstack` input, or None)."""
        x_BxLxD = self._embed(tokens_BxL)
        feats_MxD, deep_SxMxD = self.visual.features(pixels_PxI, grids)
        feats_MxD = feats_MxD.astype(x_BxLxD.dtype)
        is_image_BxL = tokens_BxL == self.cfg.vision.image_token_id
        if not isinstance(tokens_BxL, jax.core.Tracer):
            count = int(is_image_BxL.sum())
            if count != feats_MxD.shape[0]:
                raise ValueError(
                    f"{count} image tokens for {feats_MxD.shape[0]} image features "
                    f"(grids {list(grids)})"
                )
        index_BxL = jnp.cumsum(is_image_BxL.reshape(-1)).reshape(is_image_BxL.shape) - 1
        index_BxL = jnp.clip(index_BxL, 0, feats_MxD.shape[0] - 1)
        image_BxLxD = jnp.take(feats_MxD, index_BxL, axis=0)
        x_BxLxD = jnp.where(is_image_BxL[..., None], image_BxLxD, x_BxLxD)
        return x_BxLxD, (None if deep_SxMxD is None else (deep_SxMxD, index_BxL, is_image_BxL))

    def embed_image_rows(self, tokens_BxL, *args, **kwargs) -> jax.Array:
        """The token embeddings [B, L, D] of `image_row_inputs` (without DeepStack's)."""
        return self.image_row_inputs(tokens_BxL, *args, **kwargs)[0]

    def image_row_inputs(
        self,
        tokens_BxL,
        pixels_BxNxI,
        positions_BxNx2,
        frames_BxN,
        windows_BxN,
        units_BxL,
        **pos,
    ):
        """(the token embeddings [B, L, D], a token whose `units_BxL` is u >= 0 replaced by the
        merged unit u (window order) of its row's patches (`VisionTower.row_features`, `pos`
        its taps); `Transformer`'s `deepstack` input, per row, or None)."""
        x_BxLxD = constrain(self._embed(tokens_BxL), ("batch", "length", "act_embed"))
        feats_BxMxO, deep_SxBxMxO = self.visual.row_features(
            pixels_BxNxI, positions_BxNx2, frames_BxN, windows_BxN, **pos
        )
        # laid out as the embeddings, so the per-row gather stays on each device's rows
        feats_BxMxO = constrain(feats_BxMxO, ("batch", None, "act_embed"))
        index_BxLx1 = jnp.maximum(units_BxL, 0)[..., None]
        image_BxLxD = jnp.take_along_axis(feats_BxMxO.astype(x_BxLxD.dtype), index_BxLx1, axis=1)
        is_image_BxL = units_BxL >= 0
        x_BxLxD = jnp.where(is_image_BxL[..., None], image_BxLxD, x_BxLxD)
        if deep_SxBxMxO is None:
            return x_BxLxD, None
        deep_SxBxMxO = constrain(deep_SxBxMxO, (None, "batch", None, "act_embed"))
        return x_BxLxD, (deep_SxBxMxO, index_BxLx1[..., 0], is_image_BxL)


class HostLayout:
    """What the data pipeline needs of the model to lay out image rows on the host (numpy):
    the M-RoPE positions of one example and its images' patch layout. The data floor receives
    it as an argument (`jaxllm.data.vision_rows`), so it never imports the model."""

    def __init__(self, cfg):  # a VisionConfig
        self.cfg = cfg
        self.unit = cfg.spatial_merge**2

    def positions(self, ids_L: np.ndarray, grids_Kx3: np.ndarray) -> np.ndarray:
        """int32 [3, L]: the M-RoPE ids of one example from 0; ValueError when its image
        tokens and grids disagree."""
        cfg = self.cfg
        pos_3x1xL, _ = mrope_positions(
            ids_L[None],
            grids_Kx3,
            cfg.image_token_id,
            cfg.vision_start_token_id,
            cfg.spatial_merge,
        )
        return pos_3x1xL[:, 0]

    def patches(self, grids_Kx3: np.ndarray) -> dict[str, np.ndarray]:
        """`tower_layout` of the images of one row (their grids in order)."""
        return tower_layout(self.cfg, [tuple(int(v) for v in g) for g in grids_Kx3])


MODEL_KINDS["vision"] = VisionLanguageModel

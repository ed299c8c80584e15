"""A Qwen2.5-VL style vision-language model (Bai et al. 2025, arXiv:2502.13923): the decoder
(`Transformer`, with multimodal RoPE) and a vision tower (`VisionTower`) whose merged patch
features replace the embeddings of the image tokens, in order, as transformers'
`Qwen2_5_VLModel` does (`masked_scatter`): the m-th `image_token_id` of the batch (row-major)
gets the m-th merged patch of the images, image after image. Text-only calls are the decoder's.
Positions are [3, B, L] with images (`jaxllm.model.mrope.mrope_positions`). With DeepStack
(`vision.deepstack_indexes`, Qwen3-VL), the tower's features of those blocks are added to the
image tokens' hidden states after the first decoder layers, one each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model.outputs import ModelOutput
from jaxllm.model.transformer import MODEL_KINDS, Transformer
from jaxllm.model.vision import Grids, VisionTower

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
        self, tokens_BxL=None, *, pixel_values=None, image_grid_thw=None, **kwargs
    ) -> ModelOutput:
        """As `Transformer.__call__`, with `pixel_values` [P, I] (the processor's rows of all
        images) and `image_grid_thw` (their (t, h, w) patch grids, Python ints): the images'
        features go where `tokens_BxL` holds `cfg.vision.image_token_id`. The number of those
        tokens must be the images' merged patches (sum t h w / spatial_merge^2)."""
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


MODEL_KINDS["vision"] = VisionLanguageModel

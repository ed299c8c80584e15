"""The vision tower of a Qwen2.5-VL style vision-language model (`jaxllm.model.vision`): its
shape, attention windows and the pixel budget of its images, and their checks. Defaults are
Qwen2.5-VL-7B's."""

from __future__ import annotations

import dataclasses
import math

from jaxllm.config.errors import fail as _fail


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A ViT over patches of `temporal_patch_size` frames x `patch_size`^2 pixels, with 2D RoPE,
    window attention but in `fullatt_block_indexes`, and a merger of `spatial_merge`^2
    neighbouring patches into one token of width `out_dim` (the LM's d_model)."""

    patch_size: int = 14
    """Side of a square patch in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    in_channels: int = 3
    """Colour channels of a pixel."""
    depth: int = 32
    """Transformer blocks."""
    width: int = 1280
    """Hidden width of a patch."""
    heads: int = 16
    """Attention heads; the head dim width / heads must be divisible by 4 (2D RoPE)."""
    mlp_dim: int = 3420
    """Hidden width of the gated SiLU MLP (with biases)."""
    spatial_merge: int = 2
    """The merger joins spatial_merge x spatial_merge patches into one LM token."""
    window_size: int = 112
    """Side in pixels of a square attention window (a multiple of patch_size * spatial_merge)."""
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    """Blocks that attend over the whole image; the others attend within windows."""
    out_dim: int = 3584
    """Width of a merged token: the LM's model width."""
    norm_eps: float = 1e-6
    """Epsilon of the RMSNorms."""
    rope_theta: float = 10000.0
    """Base of the 2D rotary frequencies."""
    min_pixels: int = 56 * 56
    """Images with fewer pixels are scaled up to at least this many."""
    max_pixels: int = 28 * 28 * 16384
    """Images with more pixels are scaled down to at most this many."""
    image_token_id: int = 151655
    """The LM token whose embeddings the image features replace, one per merged patch."""
    vision_start_token_id: int = 151652
    """The LM token before each image's run of image tokens (M-RoPE positions start there)."""
    # Qwen3-VL's tower (window_size=0, norm=layer, mlp_activation=gelu_tanh, patch_bias,
    # position_embeddings, deepstack_indexes); the defaults keep Qwen2.5-VL's.
    norm: str = "rms"
    """The blocks' and mergers' norm: `rms` (RMSNorm) or `layer` (LayerNorm with a bias)."""
    mlp_activation: str = "swiglu"
    """The blocks' MLP (with biases): `swiglu` (gated) or `gelu_tanh` (fc1 -> tanh GELU -> fc2)."""
    patch_bias: bool = False
    """Whether the patch embedding has a bias."""
    position_embeddings: int = 0
    """Rows of a learned square table of absolute patch positions (a square number),
    bilinearly resampled (corners aligned) to each image's grid and added to the patches;
    0: none."""
    deepstack_indexes: tuple[int, ...] = ()
    """DeepStack (Meng et al. 2024, arXiv:2406.04334): the blocks whose output, merged by an
    own merger (norm after the merge), is added to the image tokens' hidden states after
    decoder layer k for the k-th of them."""

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def validate(self) -> None:
        """Shape checks (raises ConfigError naming the key)."""
        for name in ("patch_size", "temporal_patch_size", "in_channels", "depth", "width"):
            if getattr(self, name) < 1:
                _fail(f"model.vision.{name} must be >= 1, not {getattr(self, name)}.")
        for name in ("image_token_id", "vision_start_token_id"):
            if getattr(self, name) < 0:
                _fail(f"model.vision.{name} must be >= 0, not {getattr(self, name)}.")
        for name in ("heads", "mlp_dim", "spatial_merge", "out_dim", "min_pixels"):
            if getattr(self, name) < 1:
                _fail(f"model.vision.{name} must be >= 1, not {getattr(self, name)}.")
        if self.width % self.heads or (self.width // self.heads) % 4:
            _fail(
                f"model.vision.width={self.width} must split into model.vision.heads="
                f"{self.heads} heads of a width divisible by 4 (2D RoPE over height and width)."
            )
        unit = self.patch_size * self.spatial_merge
        if self.window_size and (self.window_size < unit or self.window_size % unit):
            _fail(
                f"model.vision.window_size={self.window_size} must be 0 (no windows) or a "
                f"positive multiple of model.vision.patch_size * model.vision.spatial_merge = "
                f"{unit}."
            )
        if not self.window_size and self.fullatt_block_indexes:
            _fail(
                "model.vision.fullatt_block_indexes needs windows (model.vision.window_size > 0); "
                "with window_size=0 every block attends over the whole image: set it to []."
            )
        for key in ("fullatt_block_indexes", "deepstack_indexes"):
            bad = [i for i in getattr(self, key) if not 0 <= i < self.depth]
            if bad:
                _fail(
                    f"model.vision.{key} has {bad[0]}, outside the "
                    f"model.vision.depth={self.depth} blocks (0 .. {self.depth - 1})."
                )
        if len(set(self.deepstack_indexes)) != len(self.deepstack_indexes):
            _fail(f"model.vision.deepstack_indexes={list(self.deepstack_indexes)} repeats a block.")
        for key, allowed in (
            ("norm", ("rms", "layer")),
            ("mlp_activation", ("swiglu", "gelu_tanh")),
        ):
            if getattr(self, key) not in allowed:
                _fail(f"model.vision.{key}={getattr(self, key)!r} is not one of {allowed}.")
        side = math.isqrt(self.position_embeddings) if self.position_embeddings > 0 else 0
        if self.position_embeddings < 0 or side * side != self.position_embeddings or side == 1:
            _fail(
                f"model.vision.position_embeddings={self.position_embeddings} must be 0 (none) or "
                "a square number >= 4 (the side of the learned position grid, squared)."
            )
        if self.max_pixels < self.min_pixels:
            _fail(
                f"model.vision.max_pixels={self.max_pixels} is below "
                f"model.vision.min_pixels={self.min_pixels}."
            )


def validate_vision(model) -> None:
    """Refuses a `model.vision` the model (a `ModelConfig`) cannot run, in one sentence."""
    v = model.vision
    if v is None:
        return
    v.validate()
    if (
        model.kind != "decoder"
        or model.layer_pattern
        or model.position != "rope"
        or (model.rope.mrope_section is None)
    ):
        _fail(
            "model.vision needs a decoder (model.kind=decoder, no model.layer_pattern) with "
            "multimodal RoPE (model.position=rope, model.rope.mrope_section)."
        )
    if len(v.deepstack_indexes) > model.num_layers:
        _fail(
            f"model.vision.deepstack_indexes has {len(v.deepstack_indexes)} blocks for "
            f"model.num_layers={model.num_layers} decoder layers (one layer each)."
        )
    if v.out_dim != model.d_model:
        _fail(f"model.vision.out_dim={v.out_dim} must equal model.d_model={model.d_model}.")
    for name in ("image_token_id", "vision_start_token_id"):
        if getattr(v, name) >= model.vocab_size:
            _fail(
                f"model.vision.{name}={getattr(v, name)} is outside the vocabulary "
                f"(model.vocab_size={model.vocab_size})."
            )

"""Prompts with images for generation: a conversation's ids with each image's pad tokens
expanded, its pixels, and the M-RoPE inputs of a padded batch.

`prompt_example(messages, tok, spec)` renders a conversation whose contents may hold image parts
(`jaxllm.data.vision_chat`: each image written as the model's vision markers around one pad
token, then expanded to the image's token count) with the generation prompt, as the Qwen-VL
processor prepares a prompt. `vision_inputs` turns a right-padded batch of such prompts into
what the prefill needs: the images' pixels one after another, their patch grids (static), the
[3, B, L] positions and the rope deltas (`jaxllm.model.mrope.mrope_positions`); a decode step at
cache length n then runs at position n + delta on all three rows, as transformers' Qwen2.5-VL
`generate` does. Rows without images get plain positions and delta 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxllm.config import ConfigError
from jaxllm.data import chat as templates
from jaxllm.data import images, vision_chat
from jaxllm.model.mrope import mrope_positions


def image_spec(vision) -> images.ImageSpec:
    """How a model with `model.vision` = `vision` cuts images (the processor's defaults else)."""
    return images.ImageSpec(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge,
        min_pixels=vision.min_pixels,
        max_pixels=vision.max_pixels,
    )


def has_images(messages: Sequence[dict]) -> bool:
    """Whether any message's content is a list holding an image part."""
    return any(
        isinstance(m.get("content"), list) and any(map(templates.is_image_part, m["content"]))
        for m in messages
    )


def prompt_example(
    messages: Sequence[dict],
    tok,
    spec: images.ImageSpec,
    tokens: vision_chat.VisionTokens = vision_chat.VisionTokens(),
    base_dir: str | Path | None = None,
) -> tuple[list[int], images.Pixels | None]:
    """(prompt ids with each image's pad expanded, the images' pixels or None without any).
    ConfigError when the conversation cannot be rendered or its images cannot be used."""
    pad_id = tokens.pad_id(tok)
    try:
        flat, sources = vision_chat.flatten(messages, tokens)
        text = templates.render(flat, tok, add_generation_prompt=True)
    except templates.ChatError as e:
        raise ConfigError(f"the conversation cannot be rendered ({e}); check it.") from None
    ids = tok.encode_offsets(text, specials=True)[0]
    at = np.flatnonzero(ids == pad_id)
    if len(at) != len(sources):
        raise ConfigError(
            f"the rendered conversation holds {len(at)} image placeholder(s) {tokens.pad!r} for "
            f"{len(sources)} image(s); do not write the pad token in the text."
        )
    if not sources:
        return ids.tolist(), None
    try:
        pixels = images.load_pixels(sources, spec, base_dir)
    except images.ImageError as e:
        raise ConfigError(f"{e}; give a PNG, JPEG or other image Pillow reads.") from None
    repeats = np.ones(len(ids), np.int64)
    repeats[at] = images.tokens_of_grid(pixels.image_grid_thw, spec.merge_size)
    return np.repeat(ids, repeats).tolist(), pixels


def vision_inputs(cfg, prompt_BxL: np.ndarray, lengths_B: np.ndarray, pixels):
    """((pixels [P, I] float32, positions int32 [3, B, L], rope deltas int32 [B]), grids as a
    tuple of (t, h, w) ints) of a right-padded batch whose row i holds `pixels[i]`'s images
    (None: no image; rows past `len(pixels)` are padding). ValueError when a model without a
    vision tower gets images, or placeholders and images do not pair up."""
    present = [p for p in pixels if p is not None and len(p.image_grid_thw)]
    if not present:
        return None, None
    v = cfg.vision
    if v is None:
        raise ValueError("images need a vision-language model (model.vision); this one has none")
    mask_BxL = np.arange(prompt_BxL.shape[1])[None] < np.asarray(lengths_B)[:, None]
    grids = np.concatenate([p.image_grid_thw for p in present]).reshape(-1, 3)
    positions_3xBxL, deltas_Bx1 = mrope_positions(
        prompt_BxL,
        grids,
        v.image_token_id,
        v.vision_start_token_id,
        v.spatial_merge,
        attention_mask=mask_BxL,
    )
    pixels_PxI = np.concatenate([p.pixel_values_NxP for p in present]).astype(np.float32)
    static = tuple(tuple(int(x) for x in g) for g in grids)
    return (pixels_PxI, positions_3xBxL, deltas_Bx1[:, 0]), static

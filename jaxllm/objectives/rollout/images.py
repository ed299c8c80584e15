"""Rollouts on image prompts: what a vision-language model's GRPO needs beyond text.

A `format: rollout` prompt may hold images (`jaxllm.data.rollout`, with `model.vision`). The
policy samples its completions with them on the inference engine (`jaxllm.infer.engine.batch`
with `images=`: the tower runs once per group, its features (and DeepStack's, Qwen3-VL) replace
the image tokens' embeddings in the prefill, each decode step runs at position n + the prompt's
rope delta, as transformers' Qwen2.5-VL `generate` does), and each row of prompt + completion carries the
image fields of `jaxllm.data.vision_rows` (M-RoPE ids of the whole sequence, the unit each
image token takes, the prompt's patches in window order, padded to one patch budget, and a
learned position table's taps), so pi_old,
the reference and the loss's log-probabilities are the VLM's with the images
(`jaxllm.objectives.base.token_logps`). The M-RoPE ids of the completion continue after the
prompt's (`mrope_positions` of the whole sequence), the positions its tokens were sampled at.

The budget is one per run: the most merged units of any prompt (train and eval), rounded up to a
power of two, so the step and pi_old's pass compile once. The engine's tower compiles once per
set of image grids of a prompt; its steps compile as a text run's, twice per bucket at most
(chunks with and without image tokens).
"""

from __future__ import annotations

import numpy as np

from jaxllm.config import Config, ConfigError
from jaxllm.config.grpo import CRITIC_FREE
from jaxllm.data.vision_rows import ImageInputs, lay_out_patches
from jaxllm.model.vlm import HostLayout


def inputs(cfg: Config) -> ImageInputs | None:
    """How rollout prompts read images for this run's model; None without `model.vision`."""
    v = cfg.model.vision
    return None if v is None else ImageInputs(v, HostLayout(v), cfg.data.image_resize)


def check(cfg: Config, reward_model: bool) -> None:
    """ConfigError for what image prompts do not train under."""
    t = cfg.train
    if t.objective not in CRITIC_FREE:
        raise ConfigError(
            f"train.objective={t.objective} does not sample with images yet, but the rollout "
            f"prompts hold images; use one of {', '.join(CRITIC_FREE)}."
        )
    for axis in ("sequence", "stage"):
        if getattr(cfg.mesh, axis) > 1:
            raise ConfigError(
                f"mesh.{axis}={getattr(cfg.mesh, axis)}: image rollouts run on data, fsdp and "
                f"tensor meshes only; set mesh.{axis}=1."
            )
    if reward_model:
        raise ConfigError(
            "a reward model (train.reward_model, a model term of train.rewards) reads text "
            "only, but the rollout prompts hold images; score them with reward functions."
        )


def budget(prompts, vision) -> int:
    """The run's patch budget in merged units: the most of any prompt, rounded up to a power
    of two (at least 1)."""
    unit = vision.spatial_merge**2
    need = max(
        [int(np.prod(p.pixels.image_grid_thw, axis=1).sum()) // unit for p in prompts if p.pixels]
        + [1]
    )
    return 1 << (need - 1).bit_length()


def image_fields(prompts, seqs, seq_len: int, inp: ImageInputs, units: int) -> dict:
    """The image fields (`jaxllm.data.vision_rows.KEYS`) of the rows of `seqs` (prompt +
    completion + stop, `generation.rows`), [N, ...] each; a prompt without images gets plain
    positions and no patches. A prompt is never cut (`Rollouts` checks its length)."""
    v, n = inp.vision, len(seqs)
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    patches = units * v.spatial_merge**2
    out = {
        "mrope_positions": np.tile(np.arange(seq_len, dtype=np.int32)[:, None], (n, 1, 3)),
        "image_units": np.full((n, seq_len), -1, np.int32),
        "pixel_values": np.zeros((n, patches, width), np.float32),
        "pixel_positions": np.zeros((n, patches, 2), np.int32),
        "pixel_frames": np.full((n, patches), -1, np.int32),
        "pixel_windows": np.full((n, patches), -1, np.int32),
        "pixel_taps": np.zeros((n, patches, 4), np.int32),
        "pixel_tap_weights": np.zeros((n, patches, 4), np.float32),
    }
    for i, (p, seq) in enumerate(zip(prompts, seqs)):
        if p.pixels is None:
            continue
        m = min(len(seq), seq_len + 1) - 1  # the row's inputs
        grids = np.asarray(p.pixels.image_grid_thw).reshape(-1, 3)
        prompt_3xP = inp.layout.positions(np.asarray(p.ids), grids)
        # the completion continues after the prompt's last id (the decode's n + rope delta);
        # an image token it samples is text to the model
        after = prompt_3xP.max() + 1 + np.arange(max(m - prompt_3xP.shape[1], 0))
        whole_3xM = np.concatenate([prompt_3xP, np.tile(after, (3, 1))], axis=1)[:, :m]
        out["mrope_positions"][i, :m] = whole_3xM.T
        out["mrope_positions"][i, m:] = 0  # padding, as the SFT rows'
        lay = inp.layout.patches(grids)
        lay_out_patches({k: v[i] for k, v in out.items()}, p.pixels.pixel_values_NxP, lay)
        tokens = np.flatnonzero(np.asarray(p.ids)[:m] == v.image_token_id)
        out["image_units"][i, tokens] = np.argsort(lay["unit_order"])
    return out

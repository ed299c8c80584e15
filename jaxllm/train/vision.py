"""Image-text training: the run's rows read with their images when the model has a vision
tower (`jaxllm.data.vision_rows`), and the settings such rows train under."""

from __future__ import annotations

import dataclasses

from jaxllm import config
from jaxllm.config import ConfigError
from jaxllm.config.train import PAIR_OBJECTIVES
from jaxllm.data import detect
from jaxllm.data.pipeline import load_splits
from jaxllm.data.vision_rows import ImageInputs, holds_images
from jaxllm.model.vlm import HostLayout
from jaxllm.train.console import _log

IMAGE_OBJECTIVES = ("sft", "next_token")  # the objectives that feed a row's images to the model


def vision_inputs(cfg: config.Config) -> ImageInputs | None:
    """How the data pipeline reads and lays out images for this run's model; None without
    `model.vision`."""
    v = cfg.model.vision
    return None if v is None else ImageInputs(v, HostLayout(v), cfg.data.image_resize)


def run_splits(cfg: config.Config):
    """`load_splits` of the run: a reward model's sequences get their closing slot, images are
    read when the model has a vision tower; ConfigError when image rows meet an objective or
    a layout that would not feed them to the tower. Sources of `format: auto` whose records are
    plainly chats or pairs take that format first (`jaxllm.data.detect`, said in one line), and
    the config is checked again with it."""
    data = detect.resolve(cfg.data, _log)
    if data is not cfg.data:
        cfg = dataclasses.replace(cfg, data=data).validate()
    auto = [s.path for s in (*data.sources, *data.eval_sources) if s.format == "auto"]
    if auto and cfg.train.objective in PAIR_OBJECTIVES:
        raise ConfigError(
            f"train.objective={cfg.train.objective} trains on preference pairs, but the records of "
            f"data source {auto[0]!r} are not plainly pairs (prompt, chosen and rejected fields); "
            "give format: preference sources."
        )
    whole_inputs = cfg.train.objective == "reward"  # its score is read at a closing slot
    train, evals = load_splits(cfg.data, cfg.peft.virtual_tokens, whole_inputs, vision_inputs(cfg))
    if not holds_images(train):
        return train, evals
    if cfg.train.objective not in IMAGE_OBJECTIVES:
        raise ConfigError(
            f"train.objective={cfg.train.objective} does not read images, but the data holds "
            f"image-text chats; use train.objective=sft (or next_token)."
        )
    for axis in ("sequence", "stage"):
        if getattr(cfg.mesh, axis) > 1:
            raise ConfigError(
                f"mesh.{axis}={getattr(cfg.mesh, axis)}: image-text batches train on data, fsdp "
                f"and tensor meshes only; set mesh.{axis}=1."
            )
    return train, evals

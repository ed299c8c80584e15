"""Image-text SFT rows: chat examples with their images, packed whole, laid out for a VLM's step.

A model with a vision tower (`model.vision`) reads `chat` sources with
`jaxllm.data.vision_chat` (image parts become pixels and expanded image tokens). Examples are
packed first-fit and whole, as text SFT examples are (`sft.pack_examples`): an example longer
than a row is cut (`data.truncation=truncate`) before the first image that would not fit whole
in the row's inputs, its later images dropped, or left out (`drop`). A row's images are those of
its examples, in order; a row holds every token of each of its images.

Beside the five arrays of `jaxllm.data`, a row carries (N = the run's patch budget, I pixels
per patch, L the row length):

  mrope_positions  int32 [L, 3]  M-RoPE ids (temporal, height, width), from 0 in each example
  image_units      int32 [L]     the merged unit (window order) an image token takes, else -1
  pixel_values     f32   [N, I]  the row's patches in the tower's window order, zero padding
  pixel_positions  int32 [N, 2]  each patch's (row, column) in its image (the tower's 2D RoPE)
  pixel_frames     int32 [N]     segment ids of full attention (image / frame), -1 padding
  pixel_windows    int32 [N]     segment ids of window attention, -1 padding
  pixel_taps       int32 [N, 4]  each patch's bilinear taps into a learned position table
  pixel_tap_weights f32  [N, 4]  and their weights (zeros without `position_embeddings`)

All shapes are fixed for a run, so the train step compiles once whatever the images' sizes:
the budget N is the most patches any row of the run holds (train and eval), rounded up to a
power of two of merged units. How patches are ordered is the model's business: a `layout`
(`jaxllm.model.vlm.HostLayout`) is given, never imported. Text sources of the same run get the
same keys, with no images (`NoImages`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from jaxllm.config import ConfigError, DataConfig, JaxllmWarning
from jaxllm.config.vision import VisionConfig
from jaxllm.data import images
from jaxllm.data.packing import FirstFitRows, PackedRows
from jaxllm.data.vision_chat import VisionExample, VisionTokens

KEYS = (
    "mrope_positions",
    "image_units",
    "pixel_values",
    "pixel_positions",
    "pixel_frames",
    "pixel_windows",
    "pixel_taps",
    "pixel_tap_weights",
)


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """What reading and laying out images needs: the tower's config, whether images are
    resized (`data.image_resize`), and the model's host `layout` (`positions(ids, grids)`,
    `patches(grids)`)."""

    vision: VisionConfig
    layout: Any
    resize: bool = True
    tokens: VisionTokens = VisionTokens()

    @property
    def spec(self) -> images.ImageSpec:
        v = self.vision
        return images.ImageSpec(
            patch_size=v.patch_size,
            temporal_patch_size=v.temporal_patch_size,
            merge_size=v.spatial_merge,
            min_pixels=v.min_pixels,
            max_pixels=v.max_pixels,
            resize=self.resize,
        )

    def check(self, tok) -> None:
        """ConfigError when the tokenizer's image tokens are not the model's."""
        if self.vision.in_channels != 3:
            raise ConfigError(
                f"model.vision.in_channels={self.vision.in_channels}, but images are read as "
                "RGB; set it to 3."
            )
        t = self.tokens
        for text, key in ((t.pad, "image_token_id"), (t.start, "vision_start_token_id")):
            got = VisionTokens(pad=text).pad_id(tok)
            if got != getattr(self.vision, key):
                raise ConfigError(
                    f"model.vision.{key}={getattr(self.vision, key)}, but the tokenizer reads "
                    f"{text!r} as id {got}; set model.vision.{key}={got}."
                )


def _whole_images(ids: np.ndarray, grids: np.ndarray, image_id: int, unit: int, cut: int):
    """(tokens kept, images kept) so that every kept image lies in ids[:cut - 1] (the inputs
    of a row made of ids[:cut]); a cut inside an image moves before its vision start."""
    starts = np.flatnonzero((ids == image_id) & (np.roll(ids, 1) != image_id))
    sizes = np.prod(grids, axis=1) // unit
    for k, (start, size) in enumerate(zip(starts.tolist(), sizes.tolist())):
        if start + size > cut - 1:
            return min(max(start - 1, 0), cut), k
    return cut, len(grids)


class VisionRows:
    """First-fit rows of whole image-text examples (see the module docstring)."""

    def __init__(self, examples: list[VisionExample], cfg: DataConfig, tok, what: str, inp):
        v, lay = inp.vision, inp.layout
        unit, image_id = v.spatial_merge**2, v.image_token_id
        limit = cfg.seq_len + 1
        kept, long, empty = [], 0, 0
        for ex in examples:
            ids, mask, grids = ex.tokens, ex.mask.copy(), np.asarray(ex.image_grid_thw)
            if cfg.train_on_prompt:
                mask = (ids != image_id).astype(np.uint8)
            if len(ids) > limit:
                long += 1
                if cfg.truncation == "drop":
                    continue
            n, k = _whole_images(ids, grids, image_id, unit, min(len(ids), limit))
            patches = int(np.prod(grids[:k], axis=1).sum()) if k else 0
            ids, mask, grids = ids[:n], mask[:n], grids[:k]
            if len(ids) < 2 or not mask[1:].any():
                empty += 1
                continue
            pixels = ex.pixel_values_NxP[:patches]
            kept.append((ids, mask, pixels, grids, lay.positions(ids, grids)))
        if long or empty:
            done = "cut to that length" if cfg.truncation == "truncate" else "left out"
            parts = [
                f"{long} of {len(examples)} examples are longer than data.seq_len + 1 = {limit} "
                f"tokens and were {done} (data.truncation={cfg.truncation}; a cut keeps whole "
                "images)"
            ] * bool(long)
            parts += [f"{empty} had no trained token within a row and were left out"] * bool(empty)
            warnings.warn(f"{what}: {'; '.join(parts)}.", JaxllmWarning, stacklevel=3)
        if not kept:
            raise ConfigError(
                f"{what}: none of its {len(examples)} examples has a trained token within a "
                f"row of data.seq_len={cfg.seq_len}; raise data.seq_len or set "
                "data.truncation=truncate."
            )
        self.rows = FirstFitRows(
            [k[0] for k in kept],
            cfg.seq_len,
            bos_id=None,
            eos_id=None,
            pad_id=tok.pad_id,
            masks=[k[1] for k in kept],
        )
        self.examples, self.layout, self.vision = kept, lay, v
        self.num_docs, self.num_tokens = self.rows.num_docs, self.rows.num_tokens
        self.width = v.in_channels * v.temporal_patch_size * v.patch_size**2
        # examples never exceed a row, so each is one piece: the pieces of row r, in order
        doc = np.searchsorted(self.rows.doc_starts, self.rows._piece_start, "right") - 1
        self._docs = doc
        units = np.asarray([int(np.prod(k[3], axis=1).sum()) // unit for k in kept])
        per_row = np.add.reduceat(units[doc], self.rows._row_ptr[:-1])
        self.need = int(per_row.max())  # most merged units of any row
        self.budget = self.need  # set to the run's shared budget by `share_budget`

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = self.rows[index]
        docs = self._docs[self.rows._row_ptr[index] : self.rows._row_ptr[index + 1]]
        l, unit = len(row["inputs"]), self.vision.spatial_merge**2
        out = _empty(l, self.budget * unit, self.width)
        at, grids, pixels = 0, [], []
        for d in docs.tolist():
            ids, _, px, g, pos_3xn = self.examples[d]
            out["mrope_positions"][at : at + len(ids) - 1] = pos_3xn[:, :-1].T
            at += len(ids) - 1
            grids.append(g)
            pixels.append(px)
        grids = np.concatenate(grids)
        if len(grids):
            lay = self.layout.patches(grids)
            lay_out_patches(out, np.concatenate(pixels), lay)
            tokens = np.flatnonzero((row["inputs"] == self.vision.image_token_id)[:at])
            out["image_units"][tokens] = np.argsort(lay["unit_order"])
        return {**row, **out}


def lay_out_patches(out: dict, pixels_NxP: np.ndarray, lay: dict) -> None:
    """Writes one row's patches into its image fields `out` (`KEYS`, padded to the budget):
    the pixels in the tower's order (`HostLayout.patches` gives `lay`), their positions, frames
    and windows, and a learned position table's taps where the tower has one."""
    p = len(lay["patch_order"])
    out["pixel_values"][:p] = pixels_NxP[lay["patch_order"]]
    out["pixel_positions"][:p] = lay["positions"]
    out["pixel_frames"][:p] = lay["frame_ids"]
    out["pixel_windows"][:p] = lay["window_ids"]
    if "pos_taps" in lay:
        out["pixel_taps"][:p] = lay["pos_taps"]
        out["pixel_tap_weights"][:p] = lay["pos_weights"]


def _empty(l: int, n: int, width: int) -> dict[str, np.ndarray]:
    return {
        "mrope_positions": np.zeros((l, 3), np.int32),
        "image_units": np.full(l, -1, np.int32),
        "pixel_values": np.zeros((n, width), np.float32),
        "pixel_positions": np.zeros((n, 2), np.int32),
        "pixel_frames": np.full(n, -1, np.int32),
        "pixel_windows": np.full(n, -1, np.int32),
        "pixel_taps": np.zeros((n, 4), np.int32),
        "pixel_tap_weights": np.zeros((n, 4), np.float32),
    }


class NoImages:
    """Text rows in a run with image rows: the same keys, no images (M-RoPE ids = positions)."""

    def __init__(self, rows, vision: VisionConfig):
        self.rows, self.vision, self.budget = rows, vision, 1
        self.width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        self.num_docs, self.num_tokens = rows.num_docs, rows.num_tokens

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = self.rows[index]
        out = _empty(len(row["inputs"]), self.budget * self.vision.spatial_merge**2, self.width)
        out["mrope_positions"][:] = row["positions"][:, None]
        return {**row, **out}


def holds_images(rows) -> bool:
    """Whether `rows` (one source's, or a mixture's) hold an image."""
    return any(getattr(p, "need", 0) > 0 for p in getattr(rows, "parts", [rows]))


def share_budget(parts: list, vision: VisionConfig) -> list:
    """`parts` (rows of every source, train and eval) with one patch budget: the most merged
    units of any row, rounded up to a power of two; text parts wrapped in `NoImages`. Without
    image rows the parts stay as they are (a VLM trained on text)."""
    if not any(isinstance(p, VisionRows) for p in parts):
        return parts
    for p in parts:
        if not isinstance(p, (VisionRows, FirstFitRows, PackedRows)):
            raise ConfigError(
                "image-text chat sources mix only with text, chat and prompt_completion "
                "sources, not preference pairs; train them in separate runs."
            )
    parts = [p if isinstance(p, VisionRows) else NoImages(p, vision) for p in parts]
    need = max([p.need for p in parts if isinstance(p, VisionRows)] + [1])
    budget = 1 << (need - 1).bit_length()
    for p in parts:
        p.budget = budget
    return parts

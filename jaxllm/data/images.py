"""Images for vision-language models, prepared as the Qwen2-VL / Qwen2.5-VL processor does.

`load_image` decodes a file path (absolute, or relative to a base directory; `file://` allowed),
a `data:` URL or a bare base64 string with Pillow, applies the EXIF orientation and converts to
RGB, compositing any transparency onto white (transformers' `convert_to_rgb`). A source that is
missing, not an image, or corrupt raises `ImageError`, naming the source and the reason, which a
data pipeline turns into its `data.on_bad_record` handling.

`preprocess` follows transformers' `Qwen2VLImageProcessorPil` step by step, so the numbers are
the reference's: `smart_resize` picks a height and width that are multiples of
patch_size * merge_size with an area within [min_pixels, max_pixels] and the aspect ratio kept;
Pillow resizes the 8-bit RGB image to it (bicubic); pixels are rescaled by 1/255 (in float64,
then float32) and normalized per channel with the mean / std (OpenAI CLIP's by default; Qwen3-VL
uses 0.5 / 0.5). `patchify` cuts the [T, C, H, W] frames into flattened patches of
C * temporal_patch * patch * patch values in the processor's order: by temporal block, then
merge window (row-major), then the merge_size x merge_size patches inside it, so each run of
merge_size² consecutive rows is one token of the patch merger. A single image is its own frame
repeated temporal_patch times. The vision tower sees grid_t * grid_h * grid_w patches and the
language model grid_t * grid_h * grid_w / merge_size² placeholder tokens (`image_tokens`).

Dimension letters: T frames, C channels, H height, W width, N patches, P values per patch.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # the processor refuses anything longer than this to one side


class ImageError(ValueError):
    """An image that cannot be used: missing, not an image, corrupt, or refused by its size. A
    bad record, not a bad configuration: `source` names the file (or the inline data) and
    `reason` says what is wrong with it."""

    def __init__(self, source: str, reason: str):
        self.source, self.reason = source, reason
        super().__init__(f"image {source}: {reason}")


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """How images are cut for a vision tower. Defaults: Qwen2-VL / Qwen2.5-VL's processor.

    resize: False keeps each image's size, which must then be a multiple of
    patch_size * merge_size on both sides and at most max_pixels in area (else `ImageError`).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(
                    f"ImageSpec.{name} must be a positive integer, got {getattr(self, name)!r}"
                )
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"ImageSpec.min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(
                "ImageSpec.image_mean / image_std must hold 3 values each, std positive"
            )

    @property
    def factor(self) -> int:
        """What the height and width are multiples of: one merge window of patches."""
        return self.patch_size * self.merge_size


class Pixels(NamedTuple):
    """Flattened patches of one or more images, and each image's (grid_t, grid_h, grid_w)."""

    pixel_values_NxP: np.ndarray  # float32
    image_grid_thw: np.ndarray  # int64 [images, 3]


# ---- decoding -------------------------------------------------------------------------------------


def load_image(source: str | bytes | Path, base_dir: str | Path | None = None) -> Image.Image:
    """An RGB Pillow image from a path (relative ones under `base_dir`), a `data:` URL, base64
    text or the encoded bytes themselves. Raises `ImageError` when it cannot."""
    if isinstance(source, bytes):
        return _decode(source, "<bytes>")
    text = str(source)
    if text.startswith("data:"):
        head, sep, payload = text.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError(
                _short(text), "a data: URL must be base64, as data:image/png;base64,..."
            )
        return _decode(_b64(payload, _short(text)), _short(text))
    if text.startswith(("http://", "https://")):
        raise ImageError(_short(text), "URLs are not fetched; download the image and give its path")
    path = Path(text.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if _is_file(path):
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ImageError(str(path), f"cannot be read ({e.strerror or e})") from None
        return _decode(data, str(path))
    if isinstance(source, Path) or len(text) < 64 or not _looks_base64(text):
        raise ImageError(str(path), "no such file")
    try:  # not a file: base64 image data, as transformers' `load_image` reads it
        return _decode(_b64(text, _short(text)), _short(text))
    except ImageError:
        raise ImageError(_short(text), "is neither a file nor base64 image data") from None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system (base64 text)
        return False


def _short(text: str) -> str:
    return text if len(text) <= 48 else f"{text[:40]}... ({len(text)} characters)"


def _looks_base64(text: str) -> bool:
    return set(text.strip()) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\n\r"
    )


def _b64(payload: str, source: str) -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(source, f"is not valid base64 ({e})") from None


def _decode(data: bytes, source: str) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            image = ImageOps.exif_transpose(image)
    except UnidentifiedImageError:
        raise ImageError(source, "is not an image Pillow can read") from None
    except Image.DecompressionBombError as e:
        raise ImageError(source, f"is too large to decode safely ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt data
        raise ImageError(source, f"is corrupt ({e})") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (as transformers' `convert_to_rgb`)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


# ---- sizes ----------------------------------------------------------------------------------------


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """(height, width) as multiples of `factor` with an area within [min_pixels, max_pixels],
    the aspect ratio kept as closely as possible: transformers' qwen2_vl `smart_resize`. As
    there, a side is never below one `factor`, which can take a long thin image past max_pixels."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def target_size(
    height: int, width: int, spec: ImageSpec, source: str = "<image>"
) -> tuple[int, int]:
    """The (height, width) an image of this size is processed at under `spec`; `ImageError`
    when it is refused (aspect ratio, or with resizing off a size that does not fit)."""
    if spec.resize:
        try:
            return smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
        except ValueError as e:
            raise ImageError(source, f"{height}x{width} pixels: {e}") from None
    if height * width > spec.max_pixels:
        raise ImageError(
            source,
            f"{height}x{width} = {height * width} pixels exceeds max_pixels={spec.max_pixels} "
            "and resizing is off; shrink it or turn resizing on",
        )
    if height % spec.factor or width % spec.factor:
        raise ImageError(
            source,
            f"{height}x{width} pixels is not a multiple of {spec.factor} (patch_size * merge_size) "
            "on both sides and resizing is off; crop it or turn resizing on",
        )
    return height, width


def image_tokens(height: int, width: int, spec: ImageSpec = ImageSpec()) -> int:
    """How many placeholder tokens the language model reads for an image of this size."""
    h, w = target_size(height, width, spec)
    return (h // spec.patch_size) * (w // spec.patch_size) // spec.merge_size**2


def tokens_of_grid(image_grid_thw: np.ndarray, merge_size: int = 2) -> np.ndarray:
    """Placeholder tokens per image of an [images, 3] grid: t * h * w / merge_size²."""
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    return grid.prod(axis=1) // merge_size**2


# ---- pixels ---------------------------------------------------------------------------------------


def normalized(
    image: Image.Image, spec: ImageSpec = ImageSpec(), source: str = "<image>"
) -> np.ndarray:
    """[C, H, W] float32: the RGB image resized to `target_size`, rescaled and normalized."""
    image = to_rgb(image)
    height, width = target_size(image.height, image.width, spec, source)
    if spec.resize:  # the processor resizes even to the same size (Pillow then copies)
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    x_HxWxC = (np.asarray(image).astype(np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.asarray(spec.image_mean, np.float32), np.asarray(spec.image_std, np.float32)
    return np.ascontiguousarray(((x_HxWxC - mean) / std).transpose(2, 0, 1))


def patchify(
    frames_TxCxHxW: np.ndarray, spec: ImageSpec = ImageSpec()
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Flattened patches [grid_t * grid_h * grid_w, C * temporal_patch * patch * patch] and
    (grid_t, grid_h, grid_w). Frames are padded to a multiple of temporal_patch_size by repeating
    the last one (one image: itself, temporal_patch_size times)."""
    frames_TxCxHxW = np.asarray(frames_TxCxHxW, dtype=np.float32)
    t, c, h, w = frames_TxCxHxW.shape
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    if h % (p * m) or w % (p * m):
        raise ValueError(
            f"frames of {h}x{w} are not a multiple of patch_size * merge_size = {p * m}"
        )
    if t % tp:
        last = np.repeat(frames_TxCxHxW[-1:], tp - t % tp, axis=0)
        frames_TxCxHxW = np.concatenate([frames_TxCxHxW, last])
    gt, gh, gw = frames_TxCxHxW.shape[0] // tp, h // p, w // p
    x = frames_TxCxHxW.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    # (gt, gh/m, gw/m, m, m, C, tp, p, p): merge window, patch within it, then its values
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p)), (gt, gh, gw)


def preprocess(
    images: Sequence[Image.Image] | Image.Image,
    spec: ImageSpec = ImageSpec(),
    names: Sequence[str] | None = None,
) -> Pixels:
    """Pixel values of the images one after another and their grids, as the processor returns
    `pixel_values` and `image_grid_thw`; `names` name the images in errors."""
    images = [images] if isinstance(images, Image.Image) else list(images)
    if not images:
        raise ValueError("preprocess needs at least one image")
    names = list(names) if names is not None else [f"<image {i}>" for i in range(len(images))]
    patches, grids = [], []
    for image, name in zip(images, names, strict=True):
        x_NxP, grid = patchify(normalized(image, spec, name)[None], spec)
        patches.append(x_NxP)
        grids.append(grid)
    return Pixels(np.concatenate(patches), np.asarray(grids, dtype=np.int64))


def load_pixels(
    sources: Sequence[str | bytes | Path],
    spec: ImageSpec = ImageSpec(),
    base_dir: str | Path | None = None,
) -> Pixels:
    """`load_image` then `preprocess`: what a record's image parts become."""
    names = ["<bytes>" if isinstance(s, bytes) else _short(str(s)) for s in sources]
    return preprocess([load_image(s, base_dir) for s in sources], spec, names)

"""Image preprocessing for vision-language models against transformers' Qwen2-VL processor (its
Pillow backend, `Qwen2VLImageProcessorPil`), and the decoding of files, base64 and bad input."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from jaxllm.data import images
from jaxllm.data.images import ImageError, ImageSpec

QWEN3_VL = dict(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


def _gradient(h: int, w: int, seed: int = 0) -> Image.Image:
    """An RGB image of smooth gradients, a disc and noise: every channel different."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 255 * x / max(w - 1, 1)
    g = 255 * y / max(h - 1, 1)
    b = np.where((y - h / 2) ** 2 + (x - w / 3) ** 2 < (min(h, w) / 3) ** 2, 220.0, 30.0)
    noise = np.random.default_rng(seed).normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(np.stack([r, g, b], -1) + noise, 0, 255).astype(np.uint8))


def _reference(spec: ImageSpec, **kw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.merge_size,
        image_mean=list(spec.image_mean),
        image_std=list(spec.image_std),
        do_resize=spec.resize,
        **kw,
    )


def _assert_same(ours, ref):
    np.testing.assert_array_equal(ours.image_grid_thw, ref["image_grid_thw"])
    assert ours.pixel_values_NxP.dtype == np.float32
    np.testing.assert_allclose(ours.pixel_values_NxP, ref["pixel_values"], rtol=0, atol=1e-6)


SIZES = [(37, 53), (101, 29), (333, 500), (15, 400), (1, 57), (28, 28), (719, 1283)]


@pytest.mark.torch
@pytest.mark.parametrize(
    "spec", [ImageSpec(), ImageSpec(**QWEN3_VL), ImageSpec(patch_size=7, merge_size=3)]
)
def test_pixels_and_grids_equal_transformers(spec):
    pictures = [_gradient(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    _assert_same(images.preprocess(pictures, spec), _reference(spec)(images=pictures))


@pytest.mark.torch
@pytest.mark.parametrize(
    "min_pixels,max_pixels,size",
    [
        (56 * 56, 56 * 56, (300, 200)),  # both bounds one window: floored to 4x2 patches
        (28 * 28 * 64, 28 * 28 * 1280, (20, 30)),  # far below min_pixels: grown
        (3136, 28 * 28 * 4, (1000, 1000)),  # far above max_pixels: shrunk to the bound
        (3136, 28 * 28 * 16, (28 * 4, 28 * 4)),  # exactly max_pixels: kept
        (3136, 28 * 28 * 16 - 1, (28 * 4, 28 * 4)),  # one pixel over: shrunk
        (1, 28 * 28 * 1280, (10, 10)),  # rounds to nothing: one window
        (3136, 28 * 28 * 10, (14, 2790)),  # long and thin: one window high, over max_pixels
    ],
)
def test_min_max_pixels_edges_equal_transformers(min_pixels, max_pixels, size):
    spec = ImageSpec(min_pixels=min_pixels, max_pixels=max_pixels)
    picture = _gradient(*size)
    ours = images.preprocess(picture, spec)
    _assert_same(ours, _reference(spec)(images=[picture]))
    t, h, w = ours.image_grid_thw[0]
    assert h % 2 == 0 and w % 2 == 0 and t == 1
    # max_pixels holds unless a side is floored to one window (the reference's behaviour too)
    assert (h * 14) * (w * 14) <= max_pixels or min(h, w) == 2
    if size[0] * size[1] < min_pixels:  # grown to min_pixels (shrinking may floor below it)
        assert (h * 14) * (w * 14) >= min_pixels


@pytest.mark.torch
def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = np.random.default_rng(1)
    for _ in range(2000):
        h, w = (int(v) for v in rng.integers(1, 5000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        factor = int(rng.choice([28, 32, 21]))
        lo = int(rng.integers(1, 200_000))
        hi = lo + int(rng.integers(0, 5_000_000))
        assert images.smart_resize(h, w, factor, lo, hi) == smart_resize(h, w, factor, lo, hi), (
            h,
            w,
        )


@pytest.mark.torch
def test_modes_alpha_and_palette_equal_transformers():
    """Grayscale, palette, RGBA (composited onto white) and LA become RGB as the processor's do."""
    rgb = _gradient(45, 61)
    alpha = Image.fromarray(np.tile(np.linspace(0, 255, 61, dtype=np.uint8), (45, 1)))
    rgba = rgb.copy()
    rgba.putalpha(alpha)
    pictures = [
        rgb.convert("L"),
        rgb.convert("P"),
        rgba,
        rgb.convert("L").convert("LA"),
        rgba.convert("P"),
    ]
    spec = ImageSpec()
    _assert_same(images.preprocess(pictures, spec), _reference(spec)(images=pictures))
    # transparency changes the pixels: a transparent column is white
    white = images.normalized(Image.new("RGBA", (28, 28), (0, 0, 0, 0)), spec)
    np.testing.assert_allclose(white, images.normalized(Image.new("RGB", (28, 28), "white"), spec))


@pytest.mark.torch
def test_no_resize_equals_transformers_and_refuses_what_does_not_fit():
    spec = ImageSpec(resize=False, max_pixels=28 * 28 * 12)
    pictures = [_gradient(56, 84), _gradient(28 * 4, 28 * 3)]
    _assert_same(images.preprocess(pictures, spec), _reference(spec)(images=pictures))
    with pytest.raises(
        ImageError, match=r"big\.png: 140x84 = 11760 pixels exceeds max_pixels=9408"
    ):
        images.preprocess([_gradient(140, 84)], spec, names=["big.png"])
    with pytest.raises(ImageError, match="not a multiple of 28"):
        images.preprocess([_gradient(56, 80)], spec)
    # resizing on, the same images are shrunk instead
    assert (
        images.preprocess(
            [_gradient(140, 84)], ImageSpec(max_pixels=28 * 28 * 12)
        ).image_grid_thw.prod()
        <= 48
    )


def test_patch_order_is_merge_window_major():
    """Each run of merge_size² rows is one merge window, row-major inside it, and a patch's values
    are (channel, time, row, column): read back, the patches rebuild the image."""
    spec = ImageSpec(patch_size=2, merge_size=2, temporal_patch_size=2)
    frame_CxHxW = np.arange(3 * 8 * 12, dtype=np.float32).reshape(3, 8, 12)
    x_NxP, grid = images.patchify(frame_CxHxW[None], spec)
    assert grid == (1, 4, 6) and x_NxP.shape == (24, 3 * 2 * 2 * 2)
    patches = x_NxP.reshape(2, 3, 2, 2, 3, 2, 2, 2)  # (gh/m, gw/m, m, m, C, tp, p, p)
    np.testing.assert_array_equal(
        patches[:, :, :, :, :, 0], patches[:, :, :, :, :, 1]
    )  # one frame, twice
    rebuilt = patches[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, 8, 12)
    np.testing.assert_array_equal(rebuilt, frame_CxHxW)
    # three frames: padded to four by the last, two temporal blocks
    x3, grid3 = images.patchify(np.stack([frame_CxHxW, frame_CxHxW + 1, frame_CxHxW + 2]), spec)
    assert grid3 == (2, 4, 6)
    np.testing.assert_array_equal(
        x3[24:].reshape(24, 3, 2, 4)[:, :, 1], x3[24:].reshape(24, 3, 2, 4)[:, :, 0]
    )


@pytest.mark.torch
def test_token_counts_equal_transformers():
    spec = ImageSpec()
    ref = _reference(spec)
    pictures = [_gradient(h, w) for h, w in SIZES]
    pixels = images.preprocess(pictures, spec)
    tokens = images.tokens_of_grid(pixels.image_grid_thw, spec.merge_size)
    for (h, w), n in zip(SIZES, tokens, strict=True):
        assert images.image_tokens(h, w, spec) == n == ref.get_number_of_image_patches(h, w) // 4
    assert tokens.sum() * 4 == pixels.pixel_values_NxP.shape[0]
    assert images.image_tokens(224, 224) == 64 and images.image_tokens(448, 448) == 256


def _png(picture: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    picture.save(buf, format=fmt)
    return buf.getvalue()


def test_sources_path_relative_base64_and_data_url(tmp_path):
    picture = _gradient(33, 47)
    data = _png(picture)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(data)
    expected = np.asarray(picture)
    b64 = base64.b64encode(data).decode()
    for source, base in [
        (str(tmp_path / "sub" / "a.png"), None),
        (tmp_path / "sub" / "a.png", None),
        (f"file://{tmp_path / 'sub' / 'a.png'}", None),
        ("sub/a.png", tmp_path),
        ("a.png", tmp_path / "sub"),
        (b64, None),
        (f"data:image/png;base64,{b64}", None),
        ("\n".join(b64[i : i + 76] for i in range(0, len(b64), 76)), None),  # MIME line breaks
        (data, None),
    ]:
        loaded = images.load_image(source, base)
        assert loaded.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(loaded), expected)
    spec = ImageSpec()
    pixels = images.load_pixels(
        ["sub/a.png", f"data:image/png;base64,{b64}"], spec, base_dir=tmp_path
    )
    direct = images.preprocess([picture, picture], spec)
    np.testing.assert_array_equal(pixels.pixel_values_NxP, direct.pixel_values_NxP)
    np.testing.assert_array_equal(pixels.image_grid_thw, direct.image_grid_thw)


def test_exif_orientation_is_applied(tmp_path):
    picture = _gradient(20, 50)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = tmp_path / "rotated.png"
    picture.save(path, exif=exif)
    loaded = images.load_image(path)
    assert loaded.size == (20, 50)
    np.testing.assert_array_equal(
        np.asarray(loaded), np.asarray(picture.transpose(Image.Transpose.ROTATE_270))
    )


def test_bad_images_raise_image_error_naming_the_source(tmp_path):
    (tmp_path / "notes.txt").write_text("not an image at all\n")
    good = _png(_gradient(30, 30))
    (tmp_path / "truncated.png").write_bytes(good[: len(good) // 2])
    corrupt = bytearray(_png(_gradient(30, 30), "JPEG"))
    corrupt[200:] = bytes(len(corrupt) - 200)
    (tmp_path / "corrupt.jpg").write_bytes(bytes(corrupt))
    cases = [
        ("notes.txt", "notes.txt", "is not an image"),
        ("truncated.png", "truncated.png", "is corrupt"),
        ("missing.png", "missing.png", "no such file"),
        ("https://example.com/a.png", "https://example.com", "URLs are not fetched"),
        ("data:image/png;base64,!!!not-base64!!!", "data:image/png", "not valid base64"),
        ("data:image/png," + "A" * 10, "data:image/png", "must be base64"),
        (
            base64.b64encode(b"plain text, not pixels " * 4).decode(),
            "",
            "neither a file nor base64 image",
        ),
        (b"\x89PNG\r\n\x1a\n garbage", "<bytes>", "is corrupt"),  # a PNG signature, then junk
    ]
    for source, where, reason in cases:
        with pytest.raises(ImageError, match=reason) as err:
            images.load_image(source, tmp_path)
        assert (
            where in err.value.source
            and reason in err.value.reason
            and str(err.value).startswith("image ")
        )
        assert isinstance(err.value, ValueError)
    # a JPEG whose scan data was zeroed still decodes to something, or fails as corrupt: never another error
    try:
        assert images.load_image("corrupt.jpg", tmp_path).size == (30, 30)
    except ImageError as e:
        assert "corrupt.jpg" in e.source
    with pytest.raises(ImageError, match="missing.png: no such file"):
        images.load_pixels(["missing.png"], base_dir=tmp_path)


def test_aspect_ratio_and_spec_refusals():
    with pytest.raises(
        ImageError, match=r"thin\.png: 1x300 pixels: absolute aspect ratio must be smaller than 200"
    ):
        images.preprocess([Image.new("RGB", (300, 1))], names=["thin.png"])
    with pytest.raises(ValueError, match="min_pixels"):
        ImageSpec(min_pixels=10_000, max_pixels=5_000)
    with pytest.raises(ValueError, match="patch_size must be a positive integer"):
        ImageSpec(patch_size=0)
    with pytest.raises(ValueError, match="image_mean"):
        ImageSpec(image_mean=(0.5, 0.5))

"""Chat rows with image parts: ids with each image's pad tokens expanded where the image stands,
masks over assistant text only, pixels as `images.preprocess` gives them, placeholders and images
paired or refused, bad images under data.on_bad_record, and text-only runs refusing images."""

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from jaxllm import JaxllmWarning
from jaxllm.cli import main
from jaxllm.config import ConfigError, SourceConfig
from jaxllm.data import chat, images, vision_chat
from jaxllm.data import tokenizer as tokenizer_lib
from jaxllm.data.sources import DataFile
from tests.conftest import SMALL_RUN

VT = vision_chat.VisionTokens()
SPECIALS = ["<|im_start|>", "<|im_end|>", VT.start, VT.pad, VT.end]
SPEC = images.ImageSpec()  # Qwen2-VL's: 14-pixel patches, 2x2 merge, at least 56x56 pixels
# Qwen2-VL's chat template for image parts (its tokenizer_config.json's, less video and
# vision ids): a list content writes each image as its markers and each text part's text.
QWEN2_VL = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer(tmp_path, template=None, specials=SPECIALS):
    texts = ["what is in the picture? a red cat and a blue dog. yes, two images. " * 4]
    path = tokenizer_lib.train_bpe(texts, 300, tmp_path / "tok")
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(specials)
    tok.save(str(path))
    config = {"eos_token": "<|im_end|>", "chat_template": template}
    (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer_lib.load_tokenizer(str(path))


def png(path, size, color):
    Image.new("RGB", size, color).save(path)
    return path.name


def b64(size, color) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def text(t):
    return {"type": "text", "text": t}


def image(src):
    return {"type": "image", "image": src}


def chats(d):
    """Conversations with 0, 1 and 2 images in user turns, and one in a later user turn."""
    red = png(d / "red.png", (61, 45), "red")  # relative to the data: read under base_dir
    png(d / "blue.png", (90, 33), "blue")  # given by its absolute path below
    url = {
        "type": "image_url",
        "image_url": {"url": f"data:image/png;base64,{b64((40, 70), 'green')}"},
    }
    return [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello."}],
        [
            {"role": "user", "content": [image(red), text("what is it?")]},
            {"role": "assistant", "content": "a red cat."},
        ],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [text("compare "), image(red), text(" and "), url]},
            {"role": "assistant", "content": [text("two images.")]},
        ],
        [
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": "yes?"},
            {"role": "user", "content": [text("this: "), image(str(d / "blue.png"))]},
            {"role": "assistant", "content": "a blue dog."},
        ],
    ], [[], [d / red], [d / red, url["image_url"]["url"]], [d / "blue.png"]]


def expected(messages, tok, sources, template=None):
    """The ids as the text with each image's pad written out its token-count times, and the
    pixels, computed apart from `vision_chat.encode`."""
    flat, _ = vision_chat.flatten(messages)
    rendered = chat.render(flat, tok, template=template)
    if not sources:
        return tok.encode_offsets(rendered, specials=True)[0], None
    loaded = [images.load_image(s) for s in sources]
    pixels = images.preprocess(loaded, SPEC)
    parts = rendered.split(VT.pad)
    counts = images.tokens_of_grid(pixels.image_grid_thw, SPEC.merge_size)
    text_ = parts[0] + "".join(VT.pad * int(n) + p for n, p in zip(counts, parts[1:], strict=True))
    return tok.encode_offsets(text_, specials=True)[0], pixels


def runs(tok, ids, mask):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [
        tok._tok.decode(ids[a:b].tolist(), skip_special_tokens=False)
        for a, b in zip(edges[::2], edges[1::2])
    ]


@pytest.mark.parametrize("template", [None, QWEN2_VL], ids=["chatml", "qwen2_vl"])
def test_ids_masks_and_pixels_line_up(tmp_path, template):
    tok = tokenizer(tmp_path, template)
    pad = VT.pad_id(tok)
    for messages, sources in zip(*chats(tmp_path), strict=True):
        ex = vision_chat.encode(messages, tok, SPEC, base_dir=tmp_path)
        ids, pixels = expected(messages, tok, sources, template)
        np.testing.assert_array_equal(ex.tokens, ids)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        replies = [r if isinstance(r, str) else r[0]["text"] for r in replies]
        assert runs(tok, ex.tokens, ex.mask) == [r + "<|im_end|>" for r in replies]
        assert not ex.mask[ex.tokens == pad].any()
        if pixels is None:
            assert ex.pixel_values_NxP.shape == (
                0,
                3 * 2 * 14 * 14,
            ) and ex.image_grid_thw.shape == (0, 3)
            assert pad not in ex.tokens
            continue
        np.testing.assert_array_equal(ex.pixel_values_NxP, pixels.pixel_values_NxP)
        np.testing.assert_array_equal(ex.image_grid_thw, pixels.image_grid_thw)
        counts = images.tokens_of_grid(ex.image_grid_thw, SPEC.merge_size)
        assert (ex.tokens == pad).sum() == counts.sum() and len(ex.tokens) == len(ex.mask)
        # each image's run of pads sits between its markers, in order
        start, end = (tok.encode_offsets(s, specials=True)[0][0] for s in (VT.start, VT.end))
        opens = np.flatnonzero(ex.tokens == start)
        assert len(opens) == len(counts)
        for o, n in zip(opens, counts):
            assert (ex.tokens[o + 1 : o + 1 + n] == pad).all() and ex.tokens[o + 1 + n] == end


def test_flattened_parts_render_as_the_qwen2_vl_template_renders_lists(tmp_path):
    tok = tokenizer(tmp_path, QWEN2_VL)
    for messages, _ in zip(*chats(tmp_path), strict=True):
        flat, _ = vision_chat.flatten(messages)
        assert chat.render(flat, tok) == chat.render(messages, tok)


def test_an_image_in_a_reply_is_input_never_target(tmp_path):
    tok = tokenizer(tmp_path, QWEN2_VL)
    blue = png(tmp_path / "blue.png", (90, 33), "blue")
    messages = [
        {"role": "user", "content": "draw"},
        {"role": "assistant", "content": [text("here: "), image(blue), text(" done.")]},
    ]
    ex = vision_chat.encode(messages, tok, base_dir=tmp_path)
    ids, _ = expected(messages, tok, [tmp_path / blue], QWEN2_VL)
    np.testing.assert_array_equal(ex.tokens, ids)
    pads = ex.tokens == VT.pad_id(tok)
    assert pads.sum() == images.tokens_of_grid(ex.image_grid_thw).sum() > 0
    assert not ex.mask[pads].any()
    # the reply's text around the image is trained, its pads are the only gap
    assert runs(tok, ex.tokens, ex.mask) == [f"here: {VT.start}", f"{VT.end} done.<|im_end|>"]


def test_placeholders_and_images_must_pair_up(tmp_path):
    tok = tokenizer(tmp_path)
    red = png(tmp_path / "red.png", (56, 56), "red")
    more_pads = [
        {"role": "user", "content": [image(red), text(f"and {VT.pad}")]},
        {"role": "assistant", "content": "ok"},
    ]
    with pytest.raises(chat.ChatError, match="holds 2 image placeholder.*for 1 image part"):
        vision_chat.encode(more_pads, tok, base_dir=tmp_path)
    drops_system = "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    fewer = [
        {"role": "system", "content": [image(red)]},
        {"role": "user", "content": [image(red), text("?")]},
        {"role": "assistant", "content": "ok"},
    ]
    with pytest.raises(chat.ChatError, match="holds 1 image placeholder.*for 2 image part"):
        vision_chat.encode(fewer, tok, base_dir=tmp_path, template=drops_system)


def test_parquet_rows_of_parts_read_as_jsonl_ones(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = tokenizer(tmp_path)
    red = png(tmp_path / "red.png", (61, 45), "red")
    messages = [
        {"role": "user", "content": [text("see "), image(red)]},  # Parquet adds image / text None
        {"role": "assistant", "content": [text("red.")]},
    ]
    want = vision_chat.encode(messages, tok, base_dir=tmp_path)
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": messages}] * 2), path)
    f, src = DataFile(path, "parquet", path.name), SourceConfig(path=str(path), format="chat")
    got = list(vision_chat.read_vision_examples(f, src, tok, on_bad_record="fail"))
    assert len(got) == 2
    for a, b in zip(got[0], want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_tokenizer_without_the_pad_token_is_refused(tmp_path):
    tok = tokenizer(tmp_path, specials=["<|im_start|>", "<|im_end|>"])
    with pytest.raises(ConfigError, match="does not read the image pad token '<\\|image_pad\\|>'"):
        vision_chat.encode([{"role": "assistant", "content": "x"}], tok)


def test_bad_images_and_parts_are_skipped_and_counted_or_stop_at_file_and_line(tmp_path):
    tok = tokenizer(tmp_path)
    (tmp_path / "data").mkdir()
    png(tmp_path / "data" / "ok.png", (56, 56), "red")
    whole = (tmp_path / "data" / "ok.png").read_bytes()
    (tmp_path / "data" / "corrupt.png").write_bytes(whole[: len(whole) // 2])  # cut short
    (tmp_path / "data" / "notes.txt").write_text("not an image")

    def row(part):
        return {
            "messages": [{"role": "user", "content": [part]}, {"role": "assistant", "content": "a"}]
        }

    rows = [row(image("ok.png")), row(image("missing.png")), row(image("corrupt.png"))]
    rows += [
        row(image("notes.txt")),
        row({"type": "video", "video": "v.mp4"}),
        row(image("ok.png")),
    ]
    path = tmp_path / "data" / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    f, src = DataFile(path, "jsonl", "chat.jsonl"), SourceConfig(path=str(path), format="chat")
    bad = vision_chat.sft.bad_records("data.sources[0]", src)
    got = list(vision_chat.read_vision_examples(f, src, tok, bad=bad))
    assert len(got) == 2 and bad.records == 4
    assert bad.first_record.startswith(f"{path} line 2 holds an unusable image ")
    assert "missing.png: no such file" in bad.first_record
    with pytest.warns(JaxllmWarning, match="skipped 4 record"):
        bad.warn()
    for n, why in [
        (2, "no such file"),
        (3, "is corrupt"),
        (4, "not an image"),
        (5, "type 'video'"),
    ]:
        with pytest.raises(ConfigError, match=f"{path} line {n} .*{why}.*on_bad_record=skip"):
            # the bad row on line n, after n - 1 good ones
            path.write_text("\n".join([json.dumps(rows[0])] * (n - 1) + [json.dumps(rows[n - 1])]))
            list(vision_chat.read_vision_examples(f, src, tok, on_bad_record="fail"))


@pytest.mark.parametrize("command", ["train", "prepare"])
def test_text_only_runs_refuse_image_parts_in_one_line(tmp_path, capsys, command):
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    with_image = {"messages": [{"role": "user", "content": [image("x.png")]}, good["messages"][1]]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(with_image) + "\n")
    if command == "train":
        source = f"[{{path: '{path}', format: chat}}]"
        argv = ["train", *SMALL_RUN, "train.steps=1", f"run.dir={tmp_path / 'run'}"]
        argv += [f"data.sources={source}", f"data.eval_sources={source}"]
        says = "model of this run has no vision tower"
    else:
        argv = ["data", "prepare", str(path), "--format", "chat", "--out", str(tmp_path / "out")]
        says = "prepared shards hold token ids only"
    assert main(argv) == 2
    out = "".join(capsys.readouterr())
    lines = [ln for ln in out.splitlines() if ln.startswith("jaxllm:")]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert f"data {path} line 2 holds an image part, but " in lines[0] and says in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.torch
def test_ids_and_pixels_equal_transformers_qwen2_vl_processing(tmp_path):
    """transformers' Qwen2-VL path: `apply_chat_template` on the list contents, each
    `<|image_pad|>` replaced by grid.prod() // merge² of them (as `Qwen2VLProcessor.__call__`),
    tokenized; pixels by `Qwen2VLImageProcessorPil`."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = tokenizer(tmp_path, QWEN2_VL)
    hf = PreTrainedTokenizerFast(tokenizer_file=tok.name, chat_template=QWEN2_VL)
    processor = Qwen2VLImageProcessorPil()
    for messages, sources in zip(*chats(tmp_path), strict=True):
        ex = vision_chat.encode(messages, tok, SPEC, base_dir=tmp_path)
        text_ = hf.apply_chat_template(messages, tokenize=False)
        if sources:
            ref = processor([images.load_image(s) for s in sources], return_tensors="np")
            np.testing.assert_allclose(ex.pixel_values_NxP, ref["pixel_values"], rtol=0, atol=1e-6)
            np.testing.assert_array_equal(ex.image_grid_thw, ref["image_grid_thw"])
            parts = text_.split(VT.pad)
            counts = ref["image_grid_thw"].prod(-1) // processor.merge_size**2
            text_ = parts[0] + "".join(VT.pad * int(n) + p for n, p in zip(counts, parts[1:]))
        assert ex.tokens.tolist() == hf(text_, add_special_tokens=False)["input_ids"]

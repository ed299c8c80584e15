"""Image-text chats in the shapes text chats are read in: LLaVA's ShareGPT records with an
`image` beside the turns and `<image>` in the human turn, Alpaca with `images`, the marks and
images paired or refused, and text-only reading refusing such records in one line."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxllm.cli import main
from jaxllm.config import ConfigError, SourceConfig
from jaxllm.data import vision_chat
from jaxllm.data.sources import DataFile
from tests.test_vision_chat import image, png, text, tokenizer

LLAVA = {  # LLaVA-Instruct's own shape
    "id": "000000033471",
    "image": "red.png",
    "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"},
        {"from": "gpt", "value": "A red cat."},
        {"from": "human", "value": "And its color?"},
        {"from": "gpt", "value": "Red."},
    ],
}
LLAVA_MESSAGES = [
    {"role": "user", "content": [image("red.png"), text("\nWhat is it?")]},
    {"role": "assistant", "content": "A red cat."},
    {"role": "user", "content": "And its color?"},
    {"role": "assistant", "content": "Red."},
]
ALPACA = {"instruction": "What is it?", "output": "A red cat.", "images": ["red.png"]}
ALPACA_MESSAGES = [
    {"role": "user", "content": [image("red.png"), text("What is it?")]},
    {"role": "assistant", "content": "A red cat."},
]


def read(path, tok, **kw):
    f = DataFile(path, "parquet" if path.suffix == ".parquet" else "jsonl", path.name)
    return list(
        vision_chat.read_vision_examples(f, SourceConfig(path=str(path), format="chat"), tok, **kw)
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize(
    "record,messages", [(LLAVA, LLAVA_MESSAGES), (ALPACA, ALPACA_MESSAGES)], ids=["llava", "alpaca"]
)
def test_llava_and_alpaca_records_read_as_their_messages(tmp_path, suffix, record, messages):
    tok = tokenizer(tmp_path)
    png(tmp_path / "red.png", (61, 45), "red")
    path = tmp_path / f"chat{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist([record] * 2), path)
    else:
        path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    got = read(path, tok, on_bad_record="fail")
    want = vision_chat.encode(messages, tok, base_dir=tmp_path)
    assert len(got) == 2 and len(want.image_grid_thw) == 1
    for a, b in zip(got[1], want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_marks_and_images_must_pair_up(tmp_path):
    tok = tokenizer(tmp_path)
    png(tmp_path / "red.png", (61, 45), "red")
    two_marks = {**LLAVA, "conversations": [{"from": "human", "value": "<image> <image>"}]}
    two_marks["conversations"].append({"from": "gpt", "value": "two."})
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(two_marks) + "\n")
    with pytest.raises(ConfigError, match="line 1 has 2 <image> mark\\(s\\) for 1 image\\(s\\)"):
        read(path, tok, on_bad_record="fail")
    path.write_text(json.dumps({**LLAVA, "image": 3}) + "\n")
    with pytest.raises(ConfigError, match="neither a path nor a list of paths"):
        read(path, tok, on_bad_record="fail")


def test_text_only_reading_refuses_a_llava_record_in_one_line(tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(LLAVA) + "\n")
    argv = ["data", "prepare", str(path), "--format", "chat", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    out = "".join(capsys.readouterr())
    lines = [ln for ln in out.splitlines() if ln.startswith("jaxllm:")]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert f"data {path} line 1 holds an image part, but " in lines[0]

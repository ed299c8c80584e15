"""shapes-vqa: answers recomputed from the scene (and seen in the drawn pixels), unambiguous
questions, determinism in the seed, the chat rows and their images, the held-out split, and
`jaxllm data shapes` with its one-line errors."""

import collections
import json
import re

import pytest

from jaxllm.cli import main
from jaxllm.config import ConfigError
from jaxllm.data import shapes_vqa
from jaxllm.data.images import load_image, preprocess

WHITE = (255, 255, 255)
STEPS = {"left of": (0, -1), "right of": (0, 1), "above": (-1, 0), "below": (1, 0)}


def _rows(out, name):
    return [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]


def _at(objects, row, col):
    return [o for o in objects if (o["row"], o["col"]) == (row, col)]


def _solve(question: str, objects: list[dict]) -> tuple[str, str]:
    """(kind, answer) of a question, worked out here from the scene alone; asserts that the
    question has exactly one answer."""
    if m := re.fullmatch(r"How many (\w+) (\w+)s( are there)?\?", question):
        n = sum((o["colour"], o["shape"]) == m.group(1, 2) for o in objects)
        return "count", str(n)
    if m := re.fullmatch(
        r"What is directly (left of|right of|above|below) the (\w+) (\w+)\?", question
    ):
        (o,) = [o for o in objects if (o["colour"], o["shape"]) == m.group(2, 3)]  # unique
        dr, dc = STEPS[m.group(1)]
        (other,) = _at(objects, o["row"] + dr, o["col"] + dc)  # occupied
        return "relation", f"{other['colour']} {other['shape']}"
    if m := re.fullmatch(r"Is there a (\w+) (\w+)( in the image)?\?", question):
        there = any((o["colour"], o["shape"]) == m.group(1, 2) for o in objects)
        return "exists", "yes" if there else "no"
    m = re.search(r"in row (\d+), column (\d+)\?$", question)
    assert m, question
    (o,) = _at(objects, int(m.group(1)) - 1, int(m.group(2)) - 1)  # an occupied cell
    kind = "colour" if "colour" in question else "shape"
    return kind, o[kind]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes") / "a"
    info = shapes_vqa.write_shapes_vqa(out, samples=240, seed=0, test_fraction=0.25)
    return out, info


def test_answers_are_true_for_the_scene_and_unambiguous(made):
    out, _ = made
    rows = _rows(out, "train") + _rows(out, "test")
    answers = {}
    for r in rows:
        user, assistant = r["messages"]
        question = user["content"][1]["text"]
        kind, answer = _solve(question, r["scene"]["objects"])
        assert (kind, answer) == (r["kind"], assistant["content"]), question
        answers.setdefault(kind, set()).add(answer)
    assert set(answers) == set(shapes_vqa.KINDS)
    kinds = collections.Counter(r["kind"] for r in rows)  # drawn evenly, relations included
    assert min(kinds.values()) >= len(rows) / len(kinds) / 2, kinds
    assert answers["exists"] == {"yes", "no"}
    assert {"0", "1", "2"} <= answers["count"]  # absent kinds and repeats are asked about
    assert answers["colour"] == set(shapes_vqa.COLOURS)
    assert answers["shape"] == set(shapes_vqa.SHAPES)
    assert all(" " in a for a in answers["relation"])  # "red circle"
    assert all(len(a.split()) <= 2 for kind in answers.values() for a in kind)


def test_the_png_shows_the_scene(made):
    out, _ = made
    palette = set(shapes_vqa.COLOURS.values())
    assert len(palette) == len(shapes_vqa.COLOURS) and WHITE not in palette
    for r in _rows(out, "test")[:30]:
        scene = r["scene"]
        image = load_image(r["messages"][0]["content"][0]["image"], base_dir=out)
        assert image.size == (scene["size"], scene["size"])
        px = image.load()
        size, grid = scene["size"], scene["grid"]

        def edges(i):  # of row or column i: the grid lines are drawn at i * size // grid
            return i * size // grid, (i + 1) * size // grid

        for o in scene["objects"]:
            x0, y0, x1, y1 = o["box"]
            assert edges(o["col"])[0] < x0 < x1 < edges(o["col"])[1]
            assert edges(o["row"])[0] < y0 < y1 < edges(o["row"])[1]
            colour = shapes_vqa.COLOURS[o["colour"]]
            assert px[(x0 + x1) // 2, (y0 + y1) // 2] == colour
            # a square fills its box's corner; a circle or triangle leaves it white
            corner = px[x0 + 1, y0 + 1]
            assert corner == (colour if o["shape"] == "square" else WHITE), o
            if o["shape"] == "triangle":  # pointing up: the base's ends are filled
                assert px[x0 + 1, y1 - 1] == px[x1 - 1, y1 - 1] == colour
        occupied = {(o["row"], o["col"]) for o in scene["objects"]}
        for row in range(grid):
            for col in range(grid):
                if (row, col) not in occupied:
                    assert px[sum(edges(col)) // 2, sum(edges(row)) // 2] == WHITE
    # 112 pixels a side: 8 x 8 patches of 14 for the Qwen2-VL processor, kept at its size
    assert preprocess(image).image_grid_thw.tolist() == [[1, 8, 8]]


def test_rows_are_chat_with_images_and_the_split_is_disjoint(made):
    out, info = made
    train, test = _rows(out, "train"), _rows(out, "test")
    assert (len(train), len(test)) == (180, 60)
    assert {k: sum(v.values()) for k, v in info["questions"].items()} == {"train": 180, "test": 60}
    images = []
    for r in train + test:
        user, assistant = r["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        (image, text) = user["content"]
        assert image["type"] == "image" and text["type"] == "text"
        assert re.fullmatch(r"images/\d{6}\.png", image["image"])
        assert (out / image["image"]).is_file()
        assert isinstance(assistant["content"], str) and assistant["content"]
        images.append(image["image"])
    assert len(set(images)) == 240 == len(list((out / "images").iterdir()))

    def scenes(rows):
        return {json.dumps(r["scene"]["objects"], sort_keys=True) for r in rows}

    assert len(scenes(train)) == 180 and len(scenes(test)) == 60  # no scene twice
    assert not scenes(train) & scenes(test)
    drawn = {
        name: {(out / r["messages"][0]["content"][0]["image"]).read_bytes() for r in rows}
        for name, rows in (("train", train), ("test", test))
    }
    assert not drawn["train"] & drawn["test"]


def test_deterministic_in_the_seed(tmp_path):
    def files(out):
        return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        shapes_vqa.write_shapes_vqa(tmp_path / name, samples=12, seed=seed, grid=4, size=96)
    a, b, c = (files(tmp_path / n) for n in "abc")
    assert a == b and len(a) == 12 + 3 + 2  # images, JSONLs, info; tokenizer.json and config
    assert a != c
    assert a.keys() == c.keys()
    scene = json.loads((tmp_path / "a/train.jsonl").read_text().splitlines()[0])["scene"]
    assert (scene["grid"], scene["size"]) == (4, 96)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"grid": 1}, "--grid must be between 2 and 16"),
        ({"grid": 3, "size": 30}, "leaves cells of 10 pixels"),
        ({"test_fraction": 1.0}, "--test-fraction must be in"),
        ({"samples": 2}, "leaves a train or a test split empty"),
        ({"samples": 1000, "grid": 2}, "could draw only 8[0-6][0-9] of the 1000 different scenes"),
    ],
)
def test_arguments_that_cannot_make_a_set_are_config_errors(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        shapes_vqa.write_shapes_vqa(tmp_path / "x", **{"samples": 100, **kwargs})


def test_jaxllm_data_shapes(tmp_path, capsys):
    out = tmp_path / "shapes"
    assert main(["data", "shapes", "--out", str(out), "--samples", "10", "--seed", "2"]) == 0
    said = capsys.readouterr().out
    assert "wrote 8 train and 2 test questions about drawn 112x112 images" in said
    assert json.loads((out / "info.json").read_text())["seed"] == 2
    for bad in (
        ["--samples", "1"],
        ["--grid", "1"],
        ["--size", "20"],
        ["--test-fraction", "0"],
    ):
        assert main(["data", "shapes", "--out", str(tmp_path / "bad"), *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("jaxllm: ") and err.count("\n") == 1, err
        assert not (tmp_path / "bad").exists()
    # a made set is not overwritten unless asked
    assert main(["data", "shapes", "--out", str(out), "--samples", "10"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    args = ["data", "shapes", "--out", str(out), "--samples", "12", "--overwrite"]
    assert main(args) == 0
    assert len(list((out / "images").iterdir())) == 12


def test_the_tokenizer_reads_the_rows_with_the_vision_tokens(tmp_path):
    """tokenizer/ holds a BPE whose specials are ChatML's and Qwen-VL's image tokens, at the ids
    info.json names; the vision rows of the data read with it (image tokens where the images are)
    and its EOS is the end of turn."""
    from jaxllm.data import images, vision_chat
    from jaxllm.data.tokenizer import load_tokenizer

    info = shapes_vqa.write_shapes_vqa(tmp_path, samples=20, seed=1, grid=2, size=56)
    t = info["tokenizer"]
    assert (t["vision_start_token_id"], t["image_token_id"]) == (5, 6)
    assert t["vocab_size"] <= shapes_vqa.TOKENIZER_VOCAB
    tok = load_tokenizer(str(tmp_path / t["path"]))
    assert tok.vocab_size == t["vocab_size"] and tok.eos_id == 4
    ids = [tok.encode_offsets(s, specials=True)[0].tolist() for s in shapes_vqa.TOKENIZER_SPECIALS]
    assert ids == [[3], [4], [5], [6], [7]]
    row = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    ex = vision_chat.encode(row["messages"], tok, images.ImageSpec(), base_dir=tmp_path)
    ids = ex.tokens
    assert (ids == 6).sum() == 4 and (ids == 5).sum() == 1  # 56 px: 4 x 4 patches, 2 x 2 merged
    answer = row["messages"][1]["content"]
    target = ids[ex.mask > 0]  # the reply and its end of turn
    assert tok.decode(target[:-1].tolist()) == answer and target[-1] == tok.eos_id

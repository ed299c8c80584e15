"""shapes-vqa: questions about drawn images, for fine-tuning a tiny vision-language model.

`write_shapes_vqa(out_dir, samples)` (`jaxllm data shapes --out DIR --samples N`) draws N scenes
with Pillow, no download: a G x G grid (light grey lines on white) with a circle, square or
triangle in some of its cells, each red, green, blue or yellow. Each scene is one PNG under
`images/` and one question about it, written as a `chat` row whose user turn holds the image
(its path relative to the JSONL file) and the question, and whose assistant turn is the short
answer, so exact match is meaningful:

    count     "How many red circles?"                             -> "2"     (0 included)
    colour    "What colour is the shape in row 2, column 3?"      -> "blue"
    shape     "Which shape is in row 1, column 1?"                -> "square"
    relation  "What is directly left of the yellow triangle?"     -> "red circle"
    exists    "Is there a green square?"                          -> "yes" / "no"

Rows and columns are counted from 1, from the top left. A position question asks only of an
occupied cell; a relation question only of a shape that is the one of its colour and kind in the
scene, and only when the neighbouring cell in that direction is occupied, so every question has
exactly one answer. Some shapes repeat an earlier one's colour and kind, so counts above one
occur. Each row also carries its `kind` and the `scene`: the grid, the image size and the shapes
(row, col from 0, shape, colour, and the drawn `box` [x0, y0, x1, y1] in pixels), from which the
answer can be recomputed.

Each sample's kind is drawn first, evenly, then a scene that can be asked it. Scenes are drawn by
`seed` and never repeat; the last `test_fraction` of them are held out in
test.jsonl, so test images are scenes the fine-tuned model never saw. `info.json` holds the
arguments and the counts of questions by split and kind.

`tokenizer/` holds a small byte-level BPE (`TOKENIZER_VOCAB` ids, trained on the train split's
text) whose specials are the built-in ChatML template's `<|im_start|>` `<|im_end|>` (its end of
turn, the EOS) and Qwen-VL's `<|vision_start|>` `<|image_pad|>` `<|vision_end|>`, as ids 3 to 7
after `<pad>` `<bos>` `<eos>`; `info.json` names the ids that `model.vision` takes. A text run
and a vision-language run on this data can share it (configs/runs/vlm_shapes.yaml).

This module does not import jax.
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

from jaxllm.config import ConfigError
from jaxllm.data.tokenizer import train_bpe

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 150, 40),
    "blue": (30, 70, 220),
    "yellow": (240, 200, 0),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)
GRID_LINE = (200, 200, 200)
TOKENIZER_SPECIALS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
)
TOKENIZER_VOCAB = 384
MIN_CELL = 12  # pixels a cell needs at least for a shape to be recognisable
REPEAT = 0.3  # chance that a shape takes an earlier one's colour and kind (counts above one)
DIRECTIONS = {  # name in the question: (row step, column step)
    "left of": (0, -1),
    "right of": (0, 1),
    "above": (-1, 0),
    "below": (1, 0),
}
_PHRASINGS = {
    "count": ("How many {colour} {shape}s?", "How many {colour} {shape}s are there?"),
    "colour": (
        "What colour is the shape in row {row}, column {col}?",
        "What is the colour of the shape in row {row}, column {col}?",
    ),
    "shape": (
        "Which shape is in row {row}, column {col}?",
        "What shape is in row {row}, column {col}?",
    ),
    "relation": ("What is directly {direction} the {colour} {shape}?",),
    "exists": ("Is there a {colour} {shape}?", "Is there a {colour} {shape} in the image?"),
}
KINDS = tuple(_PHRASINGS)


def _object(row: int, col: int, shape: str, colour: str, size: int, grid: int) -> dict:
    x0, x1 = col * size // grid, (col + 1) * size // grid
    y0, y1 = row * size // grid, (row + 1) * size // grid
    margin = max(2, min(x1 - x0, y1 - y0) // 6)  # clear of the grid lines
    box = [x0 + margin, y0 + margin, x1 - margin - 1, y1 - margin - 1]
    return {"row": row, "col": col, "shape": shape, "colour": colour, "box": box}


def random_scene(rng: random.Random, grid: int = 3, size: int = 112) -> dict:
    """A scene: 2 to about two thirds of the grid's cells hold a shape, each a random colour and
    kind or (REPEAT) a copy of an earlier one's."""
    cells = [(r, c) for r in range(grid) for c in range(grid)]
    n = rng.randint(2, max(2, 2 * grid * grid // 3))
    objects = []
    for row, col in sorted(rng.sample(cells, n)):
        if objects and rng.random() < REPEAT:
            like = rng.choice(objects)
            shape, colour = like["shape"], like["colour"]
        else:
            shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        objects.append(_object(row, col, shape, colour, size, grid))
    return {"grid": grid, "size": size, "objects": objects}


def draw(scene: dict) -> Image.Image:
    """The scene as an RGB image: grid lines, then each shape filled in its box (no
    anti-aliasing, so every drawn pixel has exactly its colour)."""
    size, grid = scene["size"], scene["grid"]
    image = Image.new("RGB", (size, size), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for i in range(1, grid):
        at = i * size // grid
        pen.line([(at, 0), (at, size - 1)], fill=GRID_LINE)
        pen.line([(0, at), (size - 1, at)], fill=GRID_LINE)
    for o in scene["objects"]:
        x0, y0, x1, y1 = o["box"]
        fill = COLOURS[o["colour"]]
        if o["shape"] == "circle":
            pen.ellipse([x0, y0, x1, y1], fill=fill)
        elif o["shape"] == "square":
            pen.rectangle([x0, y0, x1, y1], fill=fill)
        else:  # pointing up: the box's centre is inside it
            pen.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    return image


def _key(scene: dict) -> tuple:
    return tuple((o["row"], o["col"], o["shape"], o["colour"]) for o in scene["objects"])


def _kinds(objects: list[dict]) -> collections.Counter:
    return collections.Counter((o["colour"], o["shape"]) for o in objects)


def _relations(scene: dict) -> list[tuple[dict, str, dict]]:
    """(shape, direction, neighbour) for every shape unique in its colour and kind whose
    neighbouring cell in the direction is occupied."""
    at = {(o["row"], o["col"]): o for o in scene["objects"]}
    counts = _kinds(scene["objects"])
    out = []
    for o in scene["objects"]:
        if counts[o["colour"], o["shape"]] != 1:
            continue
        for direction, (dr, dc) in DIRECTIONS.items():
            other = at.get((o["row"] + dr, o["col"] + dc))
            if other is not None:
                out.append((o, direction, other))
    return out


def ask(scene: dict, rng: random.Random, kind: str | None = None) -> tuple[str, str, str]:
    """(kind, question, answer) about the scene: of `kind`, or of a kind drawn among those the
    scene can be asked unambiguously (a relation needs a neighbour), then what it asks of."""
    relations = _relations(scene)
    kinds = [k for k in KINDS if k != "relation" or relations]
    if kind is None:
        kind = rng.choice(kinds)
    elif kind not in kinds:
        raise ValueError(f"a scene cannot be asked a {kind!r} question unambiguously")
    phrasing = rng.choice(_PHRASINGS[kind])
    counts = _kinds(scene["objects"])
    if kind in ("colour", "shape"):
        o = rng.choice(scene["objects"])
        return kind, phrasing.format(row=o["row"] + 1, col=o["col"] + 1), o[kind]
    if kind == "relation":
        o, direction, other = rng.choice(relations)
        question = phrasing.format(direction=direction, colour=o["colour"], shape=o["shape"])
        return kind, question, f"{other['colour']} {other['shape']}"
    every = [(c, s) for c in COLOURS for s in SHAPES]
    absent = [k for k in every if k not in counts]
    if kind == "exists":  # half yes, half no (where something is absent)
        present = rng.random() < 0.5 or not absent
        colour, shape = rng.choice(sorted(counts) if present else absent)
        return kind, phrasing.format(colour=colour, shape=shape), "yes" if present else "no"
    # count: mostly of what is there, sometimes of what is not (zero)
    colour, shape = rng.choice(sorted(counts) if rng.random() < 0.75 or not absent else absent)
    return kind, phrasing.format(colour=colour, shape=shape), str(counts[colour, shape])


def _check(samples: int, grid: int, size: int, test_fraction: float) -> int:
    """The number of test samples; ConfigError for arguments that cannot make a split."""
    if not 2 <= grid <= 16:
        raise ConfigError(f"--grid must be between 2 and 16 cells a side, not {grid}.")
    if size // grid < MIN_CELL:
        raise ConfigError(
            f"--size {size} leaves cells of {size // grid} pixels in a {grid}x{grid} grid; "
            f"give at least {MIN_CELL * grid} (or a smaller --grid)."
        )
    if size > 4096:
        raise ConfigError(f"--size must be at most 4096 pixels, not {size}.")
    if not 0 < test_fraction < 1:
        raise ConfigError(f"--test-fraction must be in (0, 1), not {test_fraction}.")
    test = round(samples * test_fraction)
    if samples < 2 or not 1 <= test < samples:
        raise ConfigError(
            f"--samples {samples} with --test-fraction {test_fraction} leaves a train or a "
            "test split empty; give more samples."
        )
    return test


def write_shapes_vqa(
    out_dir: str | Path,
    samples: int = 1000,
    seed: int = 0,
    grid: int = 3,
    size: int = 112,
    test_fraction: float = 0.2,
) -> dict:
    """Writes OUT_DIR/images/NNNNNN.png, train.jsonl, test.jsonl, tokenizer/ and info.json (see
    the module docstring); returns the info."""
    n_test = _check(samples, grid, size, test_fraction)
    rng = random.Random(seed)
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    width = max(6, len(str(samples)))
    rows, seen, budget = [], set(), 50 * samples + 1000  # scenes drawn at most
    for i in range(1, samples + 1):
        kind = rng.choice(KINDS)  # first, so that the kinds are even
        while budget:
            budget -= 1
            scene = random_scene(rng, grid, size)
            if _key(scene) not in seen and (kind != "relation" or _relations(scene)):
                break
        else:
            raise ConfigError(
                f"could draw only {len(rows)} of the {samples} different scenes asked in a "
                f"{grid}x{grid} grid; give fewer --samples or a larger --grid."
            )
        seen.add(_key(scene))
        image = f"images/{i:0{width}d}.png"
        draw(scene).save(out / image)
        kind, question, answer = ask(scene, rng, kind)
        user = [{"type": "image", "image": image}, {"type": "text", "text": question}]
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": answer},
        ]
        rows.append({"messages": messages, "kind": kind, "scene": scene})
    split = {"train": rows[: samples - n_test], "test": rows[samples - n_test :]}
    for name, part in split.items():
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    info = {
        "samples": samples,
        "seed": seed,
        "grid": grid,
        "size": size,
        "test_fraction": test_fraction,
        "questions": {
            name: dict(sorted(collections.Counter(r["kind"] for r in part).items()))
            for name, part in split.items()
        },
    }
    info["tokenizer"] = _write_tokenizer(out / "tokenizer", split["train"])
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _write_tokenizer(out: Path, rows: list[dict]) -> dict:
    """The BPE of the module docstring in `out`, trained on the rows' questions and answers;
    its path (relative to the data), vocabulary size and image token ids."""
    from tokenizers import Tokenizer

    texts = [f"user\n{r['messages'][0]['content'][1]['text']}" for r in rows]
    texts += [f"assistant\n{r['messages'][1]['content']}" for r in rows]
    path = train_bpe(texts, TOKENIZER_VOCAB, out, TOKENIZER_SPECIALS)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}) + "\n")
    tok = Tokenizer.from_file(str(path))
    return {
        "path": "tokenizer/tokenizer.json",
        "vocab_size": tok.get_vocab_size(),
        "image_token_id": tok.token_to_id("<|image_pad|>"),
        "vision_start_token_id": tok.token_to_id("<|vision_start|>"),
    }

"""A vision-language model started from a text run (`checkpoint.init_from` without
`model.vision` there): the language model's weights are the text run's, the vision tower and
merger start as a fresh run of the seed starts them (full fine-tuning, and under LoRA in the
frozen base, the same again when a LoRA run's base is reloaded); other shapes are refused in one
line. The demo's pieces (scripts/vlm_shapes.py) on a small shapes-vqa set."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxllm import config as config_lib
from jaxllm import load, optim, sharding
from jaxllm.cli import main
from jaxllm.config import ConfigError
from jaxllm.train.loop import train
from jaxllm.train.state import init_state, init_state_from

ROOT = Path(__file__).resolve().parents[1]
SMALL = [  # the preset's tower on a smaller language model (head width 16: M-RoPE 2 + 3 + 3)
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=96",
    "model.rope.mrope_section=[2, 3, 3]",
    "model.vision.width=32",
    "model.vision.mlp_dim=48",
    "model.vision.out_dim=64",
    "train.global_batch_size=8",
    "train.log_every=1",
    "optim.warmup_steps=0",
]


def _script():
    spec = importlib.util.spec_from_file_location("vlm_shapes", ROOT / "scripts" / "vlm_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """(OUT, the script's module): shapes-vqa of 40 scenes and a 2-step text run OUT/text of
    the preset's language model (smaller) on the questions without images."""
    out = tmp_path_factory.mktemp("vlm_init")
    script = _script()
    test_rows = script.write_data(out, 40)
    assert len(test_rows) == 8 and '"type"' not in (out / "text_data" / "test.jsonl").read_text()
    args = [*script.overrides(out, "text", "text_data", 2), *SMALL]
    train(
        config_lib.load(
            str(script.PRESET), [*args, "model.vision=null", "checkpoint.init_from=null"]
        )
    )
    return out, script


def vlm_cfg(out, script, *extra):
    args = [
        *script.overrides(out, "vlm", "data", 1),
        *SMALL,
        f"checkpoint.init_from={out / 'text'}",
    ]
    return config_lib.load(str(script.PRESET), [*args, *extra])


def test_the_language_model_loads_and_the_tower_starts_fresh(text_run):
    out, script = text_run
    cfg = vlm_cfg(out, script)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    text = load.restore(out / "text", mesh=mesh).params
    params, model_state = load.load_weights(cfg.checkpoint.init_from, cfg.model, mesh)
    assert set(params) == set(text) and "visual" not in params
    tx = optim.build(cfg.optim, cfg.train.steps)
    state = init_state_from(params, cfg.model, tx, mesh, cfg.run.seed, model_state)
    fresh = init_state(cfg.model, tx, mesh, cfg.run.seed).params
    assert set(state.params) == set(text) | {"visual"}
    same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)  # noqa: E731
    same({k: state.params[k] for k in text}, text)
    same(state.params["visual"], fresh["visual"])
    assert not np.array_equal(state.params["embed"]["embedding"], fresh["embed"]["embedding"])

    # LoRA on both towers: the fresh tower is in the frozen base, and reloading the base of the
    # run's record (resume, eval, generate) gives the same base again
    lora = vlm_cfg(out, script, *script.LORA)
    tx = optim.build(lora.optim, lora.train.steps)
    state = init_state_from(params, lora.model, tx, mesh, lora.run.seed, peft=lora.peft)
    assert "visual" in state.frozen and "embed" not in state.params
    fresh_frozen = init_state(lora.model, tx, mesh, lora.run.seed, peft=lora.peft).frozen
    same(state.frozen["visual"], fresh_frozen["visual"])
    np.testing.assert_array_equal(state.frozen["embed"]["embedding"], text["embed"]["embedding"])
    same(load.load_frozen(lora, mesh, load.base_record(lora)), state.frozen)


def test_other_shapes_are_refused_in_one_line(text_run, capsys):
    out, script = text_run
    cfg = vlm_cfg(out, script, "model.mlp_dim=80")
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"has other parameters than this model \(first: layers"):
        load.load_weights(cfg.checkpoint.init_from, cfg.model, mesh)
    # a text model from a vision-language run: the tower is no part of it
    theirs = vlm_cfg(out, script).model
    ours = dataclasses.replace(theirs, vision=None)
    with pytest.raises(ConfigError, match=r"\(first: visual/"):
        load.check_shapes("a VLM run", ours, theirs)


@pytest.mark.slow  # ~40 s: an image step from the text run, an exact-match pass
def test_an_image_run_starts_from_the_text_run(text_run, capsys):
    """`jaxllm train` of the preset from the text run logs the fresh tower; the script's exact
    match, per kind, reads the run's greedy replies to the image rows."""
    out, script = text_run
    args = [*script.overrides(out, "before", "data", 1), *SMALL, "optim.lr=0"]
    assert main(["train", str(script.PRESET), *args, f"checkpoint.init_from={out / 'text'}"]) == 0
    err = capsys.readouterr().err
    assert f"initialized parameters from {out / 'text'}; visual fresh from run.seed=0" in err
    rows = [json.loads(x) for x in (out / "data" / "test.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    score = script.exact_match(out / "before", out / "data" / "test.jsonl", kinds)
    assert set(score) == {"all", *kinds} and 0 <= score["all"] <= 1
    row = lambda kind, answer: {"kind": kind, "messages": [{}, {"content": answer}]}  # noqa: E731
    seen = [row("count", "1"), row("count", "1"), row("count", "0"), row("exists", "no")]
    asked = [row("count", "1"), row("count", "2"), row("exists", "no"), row("exists", "yes")]
    assert script.majority(seen, asked) == {"all": 0.5, "count": 0.5, "exists": 0.5}

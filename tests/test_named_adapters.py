"""`jaxllm generate RUN --adapter NAME[=RUN] ...`: fine-tuning runs of one base switched at
generation time, the base loaded once and shared; each adapter's text is what generating from
its own run gives; a run's adapters/NAME; refusals in one line (docs/finetuning.md)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_RUN
from flax import nnx
from trained_runs import OnFirstUse

from jaxllm.cli import main
from jaxllm.infer.cli import adapter_models

GEN = ["--prompt", "def ", "--prompt", "import ", "--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def runs(small_run, small_lora, tmp_path_factory):
    """Fine-tuning runs, each trained when a test first asks for it: two LoRA runs of the small
    run (`a`, the session's; `b`, rank 4 on o_proj alone), a bottleneck-adapter run of it (`p`),
    and a LoRA run of another base (`x`: seed 7's random initialisation)."""
    root = tmp_path_factory.mktemp("adapters")
    base = ["train", *SMALL_RUN, "train.steps=2", "optim.lr=3e-2", "optim.warmup_steps=0"]
    of_small = f"checkpoint.init_from={small_run}"
    recipes = {
        "b": [of_small, "peft.method=lora", "peft.rank=4", "peft.targets=[o_proj]", "run.seed=2"],
        "p": [of_small, "peft.method=adapter", "peft.adapter_size=8"],
        "x": ["peft.method=lora", "run.seed=7"],
    }

    def train(name):
        assert main([*base, *recipes[name], f"run.dir={root / name}"]) == 0
        return root / name

    return OnFirstUse(train, a=small_lora)


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_adapter_generates_as_its_own_run(small_run, runs, tmp_path):
    both = tmp_path / "both.jsonl"
    argv = ["generate", str(small_run), *GEN, "--out", str(both)]
    specs = [f"{n}={runs[n]}" for n in ("a", "b", "p")]
    assert main([*argv, *(x for s in specs for x in ("--adapter", s))]) == 0
    got = _jsonl(both)
    assert [r["adapter"] for r in got] == ["a", "a", "b", "b", "p", "p"]
    for name in ("a", "b", "p"):
        alone = tmp_path / f"{name}.jsonl"
        assert main(["generate", str(runs[name]), *GEN, "--out", str(alone)]) == 0
        want = _jsonl(alone)
        mine = [{k: v for k, v in r.items() if k != "adapter"} for r in got if r["adapter"] == name]
        assert mine == want, name


def test_the_base_is_loaded_once_and_shared(small_run, runs, tmp_path):
    held = tmp_path / "base"  # a run holding its adapters by name: RUN/adapters/NAME
    shutil.copytree(small_run, held)
    (held / "adapters").mkdir()
    for name in ("a", "b"):
        (held / "adapters" / name).symlink_to(runs[name])
    models, _ = adapter_models(held, ["a", "b"], [], "last")
    base = [
        {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(
            nnx.to_pure_dict(nnx.state(m, nnx.Not(nnx.Any(*_trainable()))))
        )[0]}
        for _, _, _, m in models
    ]  # fmt: skip
    shared = [k for k in base[0] if k in base[1] and base[0][k] is base[1][k]]
    assert "['embed']['embedding']" in shared and len(shared) == len(base[0])
    ids = jnp.asarray([[5, 9, 33, 70]])
    a, b = (np.asarray(m(ids).logits) for _, _, _, m in models)
    assert np.abs(a - b).max() > 1e-4  # the same base, two adapters: two models
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "replies.jsonl"
    argv = ["generate", str(held), "--chat-file", str(chats), "--max-new-tokens", "4"]
    assert main([*argv, "--adapter", "a", "--adapter", "b", "--out", str(out)]) == 0
    assert [r["adapter"] for r in _jsonl(out)] == ["a", "b"]


def _trainable():
    from jaxllm.model.lora import AdapterParam, LoRAParam

    return LoRAParam, AdapterParam


@pytest.mark.parametrize(
    "specs,says",
    [
        (lambda r: ["a", "nope"], "--adapter nope:"),
        (lambda r: [f"a={r['a']}", f"a={r['b']}"], "--adapter a is given twice"),
        (lambda r: [f"a={r['a']}", f"x={r['x']}"], "--adapter x: "),
        (lambda r: ["=x"], "give NAME or NAME=RUN_DIR"),
    ],
)
def test_adapters_refused_in_one_line(small_run, runs, specs, says, capsys, tmp_path):
    held = tmp_path / "held"
    shutil.copytree(small_run, held)
    (held / "adapters").mkdir()
    (held / "adapters" / "a").symlink_to(runs["a"])
    argv = ["generate", str(held), "--prompt", "x", "--max-new-tokens", "2"]
    for s in specs(runs):
        argv += ["--adapter", s]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("jaxllm:")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err


def test_an_adapter_given_by_its_path_is_named_by_its_directory(small_run, runs, capsys):
    argv = ["generate", str(small_run), "--prompt", "x", "--max-new-tokens", "2"]
    for where in (os.path.relpath(runs["b"]), str(runs["b"])):  # relative or absolute
        assert main([*argv, "--adapter", where]) == 0
        assert "[b] step 2:" in capsys.readouterr().err

"""`jaxllm lineage A B` (SeedPrints): a fine-tune of a run (full or LoRA) is recognised as
descending from the run's initialisation, an independently initialised run of the same shape is
not, a Hugging Face model and its fine-tune likewise, the two statistics hold their null on
unrelated fingerprints, and models of different shapes are refused in one `jaxllm:` line,
exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import TINY_RUN
from test_faults import Case, assert_one_line, fault_output

from jaxllm import lineage
from jaxllm.cli import main

# Gentle training (lr 1e-3): the regime docs/experiments.md measures the test in.
GENTLE = [*TINY_RUN, "optim.lr=1e-3", "train.log_every=10"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{name: run}: `a` (seed 1, 30 steps), `b` (a fine-tuned 15 steps on another data order),
    `c` (seed 2, 30 steps: same shape, independent)."""
    root = tmp_path_factory.mktemp("lineage")
    out = {name: root / name for name in "abc"}
    common = ["train.steps=30", "checkpoint.every=30"]
    assert main(["train", *GENTLE, *common, "run.seed=1", f"run.dir={out['a']}"]) == 0
    assert main(["train", *GENTLE, *common, "run.seed=2", f"run.dir={out['c']}"]) == 0
    tune = ["train.steps=15", "checkpoint.every=15", "data.seed=5"]
    argv = ["train", *GENTLE, *tune, f"checkpoint.init_from={out['a']}", f"run.dir={out['b']}"]
    assert main(argv) == 0
    return out


def _verdict(a, b, tmp_path, capsys, *extra) -> dict:
    out = tmp_path / "lineage.json"
    assert main(["lineage", str(a), str(b), "--json", str(out), *extra]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    word = "descends from" if r["descends"] else "does not descend from"
    assert printed.splitlines()[0].startswith(f"{b} {word} {a}")
    return r


def test_a_fine_tune_descends_from_the_runs_init(runs, tmp_path, capsys):
    r = _verdict(runs["a"], runs["b"], tmp_path, capsys)
    assert r["descends"], r
    assert r["reference"] == "init (seed 1)"
    assert r["p_value"] < 1e-6 and r["copreference_r"] > 0.1
    assert _verdict(runs["a"], runs["a"], tmp_path, capsys)["descends"]  # A itself, trained


def test_a_lora_fine_tune_descends(runs, tmp_path, capsys):
    lora = tmp_path / "lora"
    argv = ["train", *GENTLE, "train.steps=10", "checkpoint.every=10", "peft.method=lora"]
    assert (
        main([*argv, "optim.lr=1e-2", f"checkpoint.init_from={runs['a']}", f"run.dir={lora}"]) == 0
    )
    capsys.readouterr()
    assert _verdict(runs["a"], lora, tmp_path, capsys)["descends"]
    assert not _verdict(runs["c"], lora, tmp_path, capsys)["descends"]
    r = _verdict(lora, runs["a"], tmp_path, capsys)  # a LoRA run has no seed of its own
    assert r["reference"] == "weights" and r["descends"]


def test_an_independent_run_does_not(runs, tmp_path, capsys):
    r = _verdict(runs["a"], runs["c"], tmp_path, capsys)
    assert not r["descends"], r
    assert r["p_value"] > 1e-2 and abs(r["copreference_r"]) < 0.05
    assert not _verdict(runs["c"], runs["b"], tmp_path, capsys)["descends"]


def test_weights_reference_of_trained_runs_reads_the_shared_data(runs, tmp_path, capsys):
    """The documented limit: two independent runs on one corpus share its token geometry, so
    A's trained weights as the reference call C kin; A's rebuilt init (the default) does not."""
    r = _verdict(runs["a"], runs["c"], tmp_path, capsys, "--reference", "weights")
    assert r["reference"] == "weights" and r["descends"]
    assert r["copreference_r"] > 0.3


def test_statistics_hold_their_null_on_unrelated_fingerprints():
    """Independent random fingerprints: p-values spread over (0, 1), rarely below 5%."""
    rng = np.random.default_rng(0)
    ps_bias, ps_matrix = [], []
    for _ in range(40):
        x, y = rng.normal(size=(2, 200))
        ps_bias.append(lineage.kendall(x, y)[1])
        ma, mb = (np.corrcoef(rng.normal(size=(300, 40)).T) for _ in range(2))
        ps_matrix.append(lineage.mantel(ma, mb, permutations=100)[1])
    for ps in (ps_bias, ps_matrix):
        assert 0.25 < np.mean(ps) < 0.75 and np.mean(np.array(ps) < 0.05) <= 0.15
    # and a matrix shared under noise is found
    base = np.corrcoef(rng.normal(size=(300, 40)).T)
    noisy = base + 0.5 * np.corrcoef(rng.normal(size=(300, 40)).T)
    r, p = lineage.mantel(base, noisy)
    assert r > 0.5 and p < 1e-6


def _hf_fine_tune(model, steps=10):
    """`model` trained `steps` AdamW steps (lr 1e-3) on random sequences, in place."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (4, 16), generator=gen)
        loss = model(tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.torch
def test_hugging_face_models(tmp_path, capsys):
    from hf_models import hf_model, save_hf

    a = save_hf(hf_model("llama2", seed=0), tmp_path / "a")
    b = save_hf(_hf_fine_tune(hf_model("llama2", seed=0)), tmp_path / "b")
    c = save_hf(hf_model("llama2", seed=1), tmp_path / "c")
    r = _verdict(a, b, tmp_path, capsys)
    assert r["descends"] and r["reference"] == "weights", r
    assert not _verdict(a, c, tmp_path, capsys)["descends"]
    code, out, err = fault_output(["lineage", str(a), str(b), "--reference", "init"], capsys)
    assert_one_line(Case("hf-init", [], 2, "did not start from a seed"), code, out, err)


@pytest.mark.torch
def test_different_shapes_are_one_line(runs, tmp_path, capsys):
    from hf_models import hf_model, save_hf

    hf = save_hf(hf_model("llama2", seed=0), tmp_path / "hf")  # d_model 64, the runs' 32
    code, out, err = fault_output(["lineage", str(runs["a"]), str(hf)], capsys)
    assert_one_line(Case("shapes", [], 2, "compares models of one shape"), code, out, err)


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    wide = tmp_path / "wide"
    argv = ["train", *GENTLE, "model.d_model=48", "train.steps=1", f"run.dir={wide}"]
    assert main(argv) == 0
    capsys.readouterr()
    for argv, says in [
        ([str(runs["a"]), str(wide)], "compares models of one shape"),
        ([str(runs["a"]), str(tmp_path / "nope")], "does not exist"),
        ([str(runs["a"]), str(runs["b"]), "--alpha", "2"], "--alpha must lie between"),
        ([str(runs["a"]), str(runs["b"]), "--probes", "0"], "--probes must be at least 1"),
    ]:
        code, out, err = fault_output(["lineage", *argv], capsys)
        assert_one_line(Case(says, [], 2, says), code, out, err)

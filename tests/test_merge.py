"""`jaxllm merge`: each method's math against Hugging Face PEFT's merge utilities on the same
tensors (DARE with the same random masks), and end to end on two short fine-tunes of the shared
small run (full and LoRA): every method writes a run that loads and evaluates, a linear merge of
a run with itself is that run, task arithmetic is base + the summed task vectors, and bad input
is one `jaxllm:` line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_RUN
from flax import nnx
from test_faults import Case, assert_one_line, fault_output, tree_hash
from trained_runs import OnFirstUse

from jaxllm import merge
from jaxllm.cli import main
from jaxllm.evaluate import evaluate_checkpoint
from jaxllm.load import load_model

SHAPE = (3, 16, 24)  # three task tensors of a [16, 24] weight


def _tasks(seed=0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=SHAPE).astype(np.float32)


@pytest.mark.torch
@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare_linear", "dare_ties"])
@pytest.mark.parametrize("density,sign", [(0.4, "total"), (0.7, "frequency"), (1.0, "total")])
def test_methods_match_peft(method, density, sign, monkeypatch):
    import torch
    from peft.utils import merge_utils

    tasks, weights = _tasks(), np.array([0.5, 1.0, -0.3], np.float32)
    keep = np.asarray(merge.dare_masks(jax.random.key(3), SHAPE, density))
    masks = [torch.tensor(m) for m in keep]  # PEFT draws one mask per task tensor, in order
    monkeypatch.setattr(torch, "bernoulli", lambda _: masks.pop(0))
    tt, tw = [torch.from_numpy(t) for t in tasks], torch.from_numpy(weights)
    if method == "task_arithmetic":
        want = merge_utils.task_arithmetic(tt, tw)
    elif method == "dare_linear":
        want = merge_utils.dare_linear(tt, tw, density)
    else:
        want = getattr(merge_utils, method)(tt, tw, density, majority_sign_method=sign)
    got = merge.merge_stacked(method, jnp.asarray(tasks), jnp.asarray(weights), density, sign,
                              jnp.asarray(keep))  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.torch
def test_trim_and_sign_election_match_peft():
    import torch
    from peft.utils import merge_utils

    t = _tasks(1)
    want = merge_utils.magnitude_based_pruning(torch.from_numpy(t[0]), 0.3).numpy()
    np.testing.assert_array_equal(t[0] * np.asarray(merge.magnitude_mask(jnp.asarray(t[0]), 0.3)),
                                  want)  # fmt: skip
    assert (want != 0).sum() == int(0.3 * t[0].size)
    for how in ("total", "frequency"):
        want = merge_utils.calculate_majority_sign_mask(torch.from_numpy(t), how).numpy()
        np.testing.assert_array_equal(np.asarray(merge.majority_sign_mask(jnp.asarray(t), how)),
                                      want)  # fmt: skip


def test_dare_masks_keep_density_and_linear_averages():
    keep = np.asarray(merge.dare_masks(jax.random.key(0), (4, 256, 256), 0.3))
    assert set(np.unique(keep)) == {0.0, 1.0}
    assert abs(keep.mean() - 0.3) < 0.01
    assert not np.array_equal(keep[0], keep[1])
    t = _tasks()
    got = merge.merge_stacked("linear", jnp.asarray(t), jnp.full((3,), 1 / 3))
    np.testing.assert_allclose(np.asarray(got), t.mean(0), rtol=1e-5, atol=1e-6)


# ---- end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tuned(small_run, small_lora, tmp_path_factory):
    """{name: run}: the base (the shared small run), two full and two LoRA fine-tunes of it
    (3 steps each on other data orders; `la`, the session's small_lora, at a higher lr), each
    trained when a test first asks for it."""
    root = tmp_path_factory.mktemp("merge")
    common = [*SMALL_RUN, "train.steps=3", "checkpoint.every=3", "optim.lr=3e-3"]
    extra = {"a": ["data.seed=1"], "b": ["data.seed=2"], "lb": ["data.seed=2", "peft.method=lora"]}

    def train(name: str):
        argv = ["train", *common, *extra[name], f"checkpoint.init_from={small_run}"]
        assert main([*argv, f"run.dir={root / name}"]) == 0
        return root / name

    return OnFirstUse(train, base=small_run, la=small_lora)


def _params(run) -> dict:
    return jax.device_get(nnx.to_pure_dict(nnx.state(load_model(run), nnx.Param)))


def _close(a, b, atol=1e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=atol), a, b)


def test_linear_of_a_run_with_itself_is_the_run(tuned, tmp_path):
    out = tmp_path / "soup"
    assert main(["merge", str(out), "--method", "linear", str(tuned["a"]), str(tuned["a"])]) == 0
    _close(_params(out), _params(tuned["a"]))
    assert json.loads((out / "merge.json").read_text())["weights"] == [0.5, 0.5]


def test_full_runs_task_arithmetic_and_dare(tuned, tmp_path):
    base, a, b = (_params(tuned[k]) for k in ("base", "a", "b"))
    out = tmp_path / "ta"
    argv = ["merge", str(out), "--method", "task_arithmetic", str(tuned["a"]), str(tuned["b"])]
    assert main([*argv, "--base", str(tuned["base"]), "--weights", "0.7,0.4"]) == 0
    want = jax.tree.map(lambda t0, x, y: t0 + 0.7 * (x - t0) + 0.4 * (y - t0), base, a, b)
    _close(_params(out), want)
    loss = evaluate_checkpoint(out)["eval_loss"]
    assert np.isfinite(loss)

    dare = tmp_path / "dare"
    argv = ["merge", str(dare), "--method", "dare_linear", str(tuned["a"]), str(tuned["b"])]
    assert main([*argv, "--base", str(tuned["base"]), "--density", "0.5", "--seed", "7"]) == 0
    record = json.loads((dare / "merge.json").read_text())
    assert record["seed"] == 7 and record["density"] == 0.5
    assert record["base"] == str(tuned["base"].resolve())
    got = _params(dare)["layers"]["mlp"]["up_proj"]
    t0 = base["layers"]["mlp"]["up_proj"]
    kept = np.abs(got - t0) > 0  # about density of the entries carry a task vector
    assert 0.5 < kept.mean() < 0.9  # 1 - 0.5^2 of them carry one of the two
    assert np.isfinite(evaluate_checkpoint(dare)["eval_loss"])


@pytest.mark.parametrize("method", ["ties"])  # dare_ties: the same path, its math above
def test_lora_runs_merge_on_their_base(tuned, tmp_path, method, capsys):
    out = tmp_path / method
    argv = ["merge", str(out), "--method", method, str(tuned["la"]), str(tuned["lb"])]
    assert main([*argv, "--density", "0.6"]) == 0
    assert np.isfinite(evaluate_checkpoint(out)["eval_loss"])
    assert main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    record = json.loads((out / "merge.json").read_text())
    assert record["base"] is None and record["majority_sign"] == "total"
    # Their task vectors are s A B: where neither adapter reaches (k_proj), the base stays.
    base, merged = _params(tuned["base"]), _params(out)
    _close(merged["layers"]["attn"]["k_proj"], base["layers"]["attn"]["k_proj"], atol=0)
    q0, q1 = (
        base["layers"]["attn"]["q_proj"],
        merged["layers"]["attn"]["q_proj"],
    )
    assert not np.allclose(q0, q1)


def _other_shape(run, tmp) -> None:
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("d_model: 64", "d_model: 96"))


def _other_base(run, tmp) -> None:
    """`run` becomes a copy of the LoRA run `la` whose base record names a random init."""
    shutil.rmtree(run)
    shutil.copytree(_TUNED["runs"]["la"], run)
    (run / "checkpoints" / "3" / "base" / "metadata").write_text(json.dumps({"seed": 5}))


def _existing_out(run, tmp) -> None:
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine\n")


def _merge(*argv, runs=("run", "base")):
    def command(run, tmp):
        paths = [str(run) if r == "run" else str(_TUNED["runs"][r]) for r in runs]
        return ["merge", str(tmp / "out"), *argv, *paths]

    return command


_TUNED: dict = {}  # {"runs": the module's `tuned`}, for the cases' commands

CASES = [
    Case("unknown-method", _merge("--method", "soup"), 2, "--method soup is not a merge method"),
    Case(
        "other-shapes",
        _merge("--method", "linear"),
        2,
        "has other parameters than",
        setup=_other_shape,
    ),  # fmt: skip
    Case(
        "other-bases",
        _merge("--method", "ties", runs=("run", "lb")),
        2,
        "was fine-tuned on another base than",
        setup=_other_base,
    ),
    Case("no-base", _merge("--method", "ties"), 2, "name the base the runs were fine-tuned from"),
    Case(
        "density-for-linear",
        _merge("--method", "linear", "--density", "0.5"),
        2,
        "--density is for --method ties or dare_linear or dare_ties, not linear",
    ),  # fmt: skip
    Case(
        "weights-count",
        _merge("--method", "linear", "--weights", "1,2,3"),
        2,
        "--weights gives 3 weights for 2 runs",
    ),  # fmt: skip
    Case("existing-out", _merge("--method", "linear"), 2, "OUT", setup=_existing_out),
    Case("one-run", _merge("--method", "linear", runs=("run",)), 2, "at least two runs"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, tuned, tmp_path, capsys):
    _TUNED["runs"] = tuned
    run = tmp_path / "run"
    shutil.copytree(tuned["base"], run)  # a full run; the cases merge it with the base itself
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    if case.setup:
        case.setup(run, scratch)
    before, before_scratch = tree_hash(run), tree_hash(scratch)
    code, out, err = fault_output(case.argv(run, scratch), capsys)
    assert_one_line(case, code, out, err)
    assert tree_hash(run) == before, "the command changed a run directory"
    assert tree_hash(scratch) == before_scratch, "the command wrote or changed OUT"

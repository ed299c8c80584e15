"""Process reward models (`train.objective=prm` on `format: stepwise` rows): the rows lay out
tokens and step labels as TRL's PRMTrainer.tokenize_row does, the loss equals a two-logit token
classifier's cross-entropy (TRL's) on the same tensors, a PRM trains through `jaxllm train`,
resumes bit-identically and equals one device on data 2 x fsdp 2 x tensor 2; a stepwise set
without step labels is one line and exit 2."""

import json
import shutil
from itertools import chain
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train_preference import _steps
from trained_runs import shared

import jaxllm
from jaxllm import cli, config
from jaxllm.config import DataConfig, SourceConfig
from jaxllm.data.pipeline import load_splits
from jaxllm.data.tokenizer import make_tokenizer, train_bpe
from jaxllm.evaluate import evaluate_checkpoint
from jaxllm.objectives.reward import step_loss

PRM = ["model.head=score", "train.objective=prm"]
RUN = [
    "data.seq_len=64",
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.vocab_size=320",
    "model.dtype=float32",
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "optim.lr=3e-3",
    "optim.warmup_steps=0",
    "checkpoint.save_final=false",
    "mesh.data=1",
    "mesh.fsdp=-1",
]
TIMINGS = ("step_time_s", "tokens_per_s")


def solutions_file(path, n, seed=0):
    """n solutions of 1 to 3 steps; a step is correct when it ends in "ok", wrong in "no"."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        labels = [bool(x) for x in rng.integers(0, 2, rng.integers(1, 4))]
        steps = [f"s{rng.integers(10)} {'ok' if y else 'no'}" for y in labels]
        records.append({"prompt": f"q{i % 5}:", "completions": steps, "labels": labels})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def trl_tokenize_row(features, tokenizer, step_separator="\n"):
    """TRL's PRMTrainer.tokenize_row (no truncation, every step labelled), transcribed: TRL
    1.16 no longer ships the trainer."""
    prompt_ids = tokenizer(features["prompt"], add_special_tokens=False)["input_ids"]
    completions_ids = [
        tokenizer(c, add_special_tokens=False)["input_ids"] for c in features["completions"]
    ]
    labels = [int(label) for label in features["labels"]]
    separator_ids = tokenizer.encode(step_separator, add_special_tokens=False)
    completions_ids = [c + separator_ids for c in completions_ids]
    labels = [[-100] * (len(c) - 1) + [y] for c, y in zip(completions_ids, labels)]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    input_ids = prompt_ids + list(chain(*completions_ids))
    return {"input_ids": input_ids, "labels": [-100] * len(prompt_ids) + list(chain(*labels))}


@pytest.mark.torch
def test_rows_lay_out_tokens_and_labels_as_trl(tmp_path):
    from transformers import PreTrainedTokenizerFast

    corpus = [f"q{i}: step {i} is ok\nstep {i + 1} is no\n" for i in range(200)]
    tok_path = train_bpe(iter(corpus), 320, tmp_path / "bpe")
    records = [
        {"prompt": "q1: what?", "completions": ["step 1 is ok", "step 2 is no"], "labels": [1, 0]},
        {"prompt": "q2:", "completions": ["a longer step 3 is ok"], "labels": [True]},
    ]
    records[0]["labels"] = [True, False]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = DataConfig(
        sources=(SourceConfig(path=str(path), format="stepwise"),),
        eval_fraction=0,
        seq_len=64,
        tokenizer=str(tok_path),
    )
    ours = make_tokenizer(data)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
    hf.bos_token = hf.convert_ids_to_tokens(ours.bos_id)
    rows = load_splits(data)[0]
    assert len(rows) == 1 and rows.num_docs == 2
    row = rows[0]
    for k, record in enumerate(records):
        want = trl_tokenize_row(record, hf)
        at = row["segment_ids"] == k + 1
        np.testing.assert_array_equal(row["inputs"][at], want["input_ids"])
        labels = np.where(row["loss_mask"][at] == 1, row["targets"][at], -100)
        np.testing.assert_array_equal(labels, want["labels"])
        np.testing.assert_array_equal(row["positions"][at], np.arange(at.sum()))
    assert row["loss_mask"].sum() == 3


@pytest.mark.torch
def test_loss_equals_a_two_logit_token_classifiers_cross_entropy():
    """TRL trains an AutoModelForTokenClassification with two labels: its loss is the mean
    cross-entropy over the tokens whose label is not -100. On the same logits, the score
    s = l1 - l0 gives the same loss from `step_loss` (sum / count)."""
    import torch

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (3, 10, 2)).astype(np.float32)
    labels = rng.integers(0, 2, (3, 10))
    labels[rng.random((3, 10)) < 0.6] = -100
    theirs = torch.nn.functional.cross_entropy(
        torch.tensor(logits).view(-1, 2), torch.tensor(labels).view(-1), ignore_index=-100
    )
    mask = labels >= 0
    loss_sum, count, metrics = step_loss(
        jnp.asarray(logits[..., 1] - logits[..., 0]),
        jnp.asarray(np.maximum(labels, 0)),
        jnp.asarray(mask),
    )
    assert float(count) == mask.sum()
    np.testing.assert_allclose(float(loss_sum / count), float(theirs), rtol=1e-6)
    predicted = logits.argmax(-1)
    np.testing.assert_allclose(float(metrics["accuracy"]), (predicted == labels)[mask].sum())


def run_metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def prm_args(tmp_path, run, *overrides):
    src = f"[{{path: {solutions_file(tmp_path / 'train.jsonl', 128)}, format: stepwise}}]"
    evals = f"[{{path: {solutions_file(tmp_path / 'eval.jsonl', 32, 1)}, format: stepwise}}]"
    return [*RUN, *PRM, f"data.sources={src}", f"data.eval_sources={evals}", f"run.dir={run}"]


def trained_prm() -> Path:
    """prm_args's PRM trained 3 steps at lr 1e-2 with a final checkpoint, in `run/` beside its
    data: made once per session (test_prm_import's run, test_prm_export's llama case). Read it,
    never change it."""
    more = ["train.steps=3", "checkpoint.save_final=true", "optim.lr=1e-2"]

    def make(out: Path) -> None:
        out.mkdir(parents=True)
        assert cli.main(["train", *prm_args(out, out / "run"), *more]) == 0

    return shared("prm", ["train", "prm_args", *more], make) / "run"


@pytest.mark.slow
def test_a_prm_trains_through_jaxllm_train_and_resumes_bit_identically(tmp_path):
    """`jaxllm train` with train.objective=prm: the step counts scored steps, held-out step
    accuracy rises; 4 steps straight equal 2 + 2 resumed, parameters and metrics."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    args = ["train.steps=4", "checkpoint.every=2", "checkpoint.save_final=true"]
    args += ["train.eval_every=2"]
    assert cli.main(["train", *prm_args(tmp_path, straight), *args]) == 0
    want = run_metrics(straight)
    assert [r["step"] for r in want] == [1, 2, 3, 4]
    assert all(r["tokens"] >= 8 for r in want)  # steps, at least one per solution
    assert {"loss", "accuracy", "rewards/step"} <= set(want[0])
    shutil.copytree(straight, split)
    shutil.rmtree(split / "checkpoints/4")
    assert cli.main(["train", *prm_args(tmp_path, split), *args]) == 0
    got = run_metrics(split)
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if k not in TIMINGS} == {
            k: v for k, v in w.items() if k not in TIMINGS
        }
    a, b = jaxllm.load_model(straight), jaxllm.load_model(split)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(a), nnx.state(b))

    # a longer run learns the labels of held-out steps
    longer = tmp_path / "longer"
    more = ["train.steps=40", "train.eval_every=40", "optim.lr=1e-2", "checkpoint.save_final=true"]
    assert cli.main(["train", *prm_args(tmp_path, longer), *more]) == 0
    last = run_metrics(longer)[-1]
    assert last["eval_accuracy"] > 0.9 and last["eval_loss"] < run_metrics(longer)[0]["loss"]
    # `jaxllm eval` of the run reads the held-out steps as training did
    again = evaluate_checkpoint(longer, num_batches=1)
    assert again["eval_accuracy"] == pytest.approx(last["eval_accuracy"])
    assert again["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-4)


def test_one_device_equals_data_fsdp_tensor_parallel(tmp_path):
    data = DataConfig(
        sources=(
            SourceConfig(path=str(solutions_file(tmp_path / "s.jsonl", 64)), format="stepwise"),
        ),
        eval_fraction=0,
        seq_len=32,
    )
    rows = load_splits(data)[0]
    batches = [
        {k: np.stack([rows[(8 * b + i) % len(rows)][k] for i in range(8)]) for k in rows[0]}
        for b in range(3)
    ]

    def cfg(**mesh):
        return config.Config(
            model=config.ModelConfig(
                vocab_size=320,
                d_model=64,
                num_layers=2,
                num_heads=8,
                num_kv_heads=4,
                mlp_dim=128,
                max_seq_len=64,
                dtype="float32",
                param_dtype="float32",
                head="score",
            ),
            mesh=config.MeshConfig(**{"data": 1, **mesh}),
            data=data,
            train=config.TrainConfig(global_batch_size=8, steps=3, objective="prm"),
            optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
        )

    want, one = _steps(cfg(), jax.devices()[:1], batches)
    got, many = _steps(cfg(data=2, fsdp=2, tensor=2), jax.devices(), batches)
    for w, g in zip(want, got):
        for name in ("loss", "accuracy", "rewards/step", "tokens"):
            np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert want[-1]["loss"] < want[0]["loss"]
    for a, b in zip(jax.tree.leaves(many.params), jax.tree.leaves(jax.device_get(one.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "q", "completions": ["a"]}, "has no step labels (field 'labels')"),
        ({"prompt": "q", "completions": ["a"], "labels": ["yes"]}, "must be a list of booleans"),
    ],
)
def test_a_stepwise_set_without_boolean_labels_is_one_line_and_exit_2(
    tmp_path, capsys, record, message
):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    src = f"data.sources=[{{path: {path}, format: stepwise}}]"
    assert cli.main(["train", *RUN, *PRM, src, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxllm: ") and message in err[-1]
    assert "Traceback" not in "\n".join(err)


def test_stepwise_sources_and_the_prm_objective_go_together(tmp_path, capsys):
    steps = f"[{{path: {solutions_file(tmp_path / 's.jsonl', 4)}, format: stepwise}}]"
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n")
    cases = {
        (f"data.sources={steps}",): "which train.objective=next_token does not read",
        (
            *PRM,
            f"data.sources=[{{path: {pairs}, format: preference}}]",
        ): "which train.objective=prm",
        ("train.objective=prm", f"data.sources={steps}"): "set model.head=score",
    }
    for overrides, message in cases.items():
        assert cli.main(["train", *RUN, *overrides, f"run.dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("jaxllm: ") and message in err[-1], err

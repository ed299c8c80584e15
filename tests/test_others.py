"""Frozen models beside the trained one (`jaxllm.train.companions`): an objective that names a
reference gets it, loaded from the run's starting point or, under LoRA, as the policy's own base
with the adapters off; it stays fixed while the policy trains, and a resumed run refuses other
reference weights in one line."""

import json

import jax.numpy as jnp
import pytest
from conftest import SMALL_RUN

from jaxllm.cli import main
from jaxllm.config import RunError
from jaxllm.objectives import ObjectiveOutput, next_token, token_nll
from jaxllm.train import companions


def reference_gap(model, batch, rng, others):
    """next_token on the policy, and as the metric `ref_loss` the reference's cross-entropy on
    the same targets."""
    out = next_token()(model, batch, rng)
    ref = others["reference"](
        batch["inputs"], positions_BxL=batch["positions"], segment_ids_BxL=batch["segment_ids"]
    )
    nll_BxL, _ = token_nll(ref.logits, batch["targets"])
    ref_sum = jnp.sum(nll_BxL * batch["loss_mask"])
    return ObjectiveOutput(out.loss_sum, out.tokens, {**out.metrics, "ref_loss": ref_sum})


reference_gap.others = ("reference",)

LORA = ["peft.method=lora", "peft.rank=4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Eight documents of 63 bytes: with BOS and EOS one full row each, so a batch of 8 rows is
    the whole set and every step sees the same tokens."""
    path = tmp_path_factory.mktemp("others") / "docs.jsonl"
    lines = [json.dumps({"text": (f"doc {i}: " + "abcdefgh" * 8)[:63]}) for i in range(8)]
    path.write_text("\n".join(lines) + "\n")
    source = f"[{{path: {path}}}]"
    return [f"data.sources={source}", f"data.eval_sources={source}", "data.packing=first_fit"]


def _train(run, data, *overrides):
    args = [*SMALL_RUN, *data, f"run.dir={run}"]
    return main(["train", *args, *overrides])


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# the full model's held reference also loads in test_distill's teacher and the DPO runs
@pytest.mark.parametrize(
    "peft", [pytest.param([], marks=pytest.mark.slow), LORA], ids=["full", "lora"]
)
def test_the_reference_is_the_start_and_stays_fixed_while_the_policy_learns(
    small_run, data, tmp_path, peft
):
    run = tmp_path / "run"
    objective = f"train.objective={__file__}:reference_gap"
    overrides = [objective, f"checkpoint.init_from={small_run}", "train.steps=4", "optim.lr=1e-2"]
    assert _train(run, data, *overrides, *peft) == 0
    rows = _rows(run)
    # step 1 evaluates the starting point: the policy is the reference (LoRA's B is zero)
    assert rows[0]["ref_loss"] == pytest.approx(rows[0]["loss"], abs=1e-6)
    assert all(r["ref_loss"] == pytest.approx(rows[0]["ref_loss"], abs=1e-5) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1e-3  # the policy moved, the reference did not


def test_records_must_match_at_a_resume():
    was = {"reference": {"source": "/runs/ref/checkpoints/1", "sha256": "a" * 64}}
    companions.check(was, was)
    moved = {"reference": {"source": "/elsewhere/checkpoints/1", "sha256": "a" * 64}}
    companions.check(was, moved)  # the same weights at another path
    for now in ({"reference": {"source": "/runs/ref/checkpoints/2", "sha256": "b" * 64}}, None):
        with pytest.raises(RunError, match="this run trained with the reference /runs/ref"):
            companions.check(was, now)
    companions.check(None, was)  # a run that held no frozen model records none


@pytest.mark.slow  # the same check, through a resumed jaxllm train (records: test above)
def test_a_resumed_run_refuses_another_reference(small_run, data, tmp_path, capsys):
    reference = tmp_path / "reference"
    assert _train(reference, data, "train.steps=1") == 0
    run = tmp_path / "run"
    objective = f"train.objective={__file__}:reference_gap"
    overrides = [objective, f"checkpoint.init_from={small_run}", f"train.reference={reference}"]
    assert _train(run, data, *overrides, "train.steps=2") == 0
    assert _train(reference, data, "train.steps=2") == 0  # new weights at the reference's path
    capsys.readouterr()
    assert _train(run, data, *overrides, "train.steps=3") == 1  # a RunError: one line
    err = capsys.readouterr().err
    assert "this run trained with the reference" in err and "start a new run.dir" in err


def test_a_reference_with_another_vocabulary_is_refused(small_run, data, tmp_path, capsys):
    objective = f"train.objective={__file__}:reference_gap"
    overrides = [objective, f"train.reference={small_run}", "model.vocab_size=384", "train.steps=1"]
    assert _train(tmp_path / "run", data, *overrides) == 2
    assert "must share the trained model's vocabulary" in capsys.readouterr().err

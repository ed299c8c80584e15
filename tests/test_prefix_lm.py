"""Prefix LM (`train.objective=prefix_lm`): the prefix attends bidirectionally, what follows it
causally (gradient tests); the prefixes and loss masks the pipeline draws; refusals; a run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_RUN, tiny_model

from jaxllm import config
from jaxllm.cli import main
from jaxllm.config import ConfigError
from jaxllm.data.objective_rows import PrefixLM
from jaxllm.model import build

# row 0: one segment with a prefix of 4; row 1: two segments (prefixes 2 and 3), then padding
SEG_BxL = jnp.asarray([[1] * 10, [1, 1, 1, 1, 2, 2, 2, 2, 2, 0]], jnp.int32)
PREFIX_BxL = jnp.asarray([[1, 1, 1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 1, 1, 1, 0, 0, 0]])


@pytest.fixture(scope="module")
def grads_at():
    """position -> |d logits[:, position] / d embeddings| summed over D: [B, L]."""
    model = build(tiny_model(num_layers=1), seed=0)
    tokens = jax.random.randint(jax.random.key(0), SEG_BxL.shape, 1, 64)
    emb = model.embed(tokens)

    @jax.jit
    def grads(e, position):
        def out(e):
            logits = model(embeddings_BxLxD=e, segment_ids_BxL=SEG_BxL, prefix_BxL=PREFIX_BxL)
            return jnp.take(logits.logits, position, axis=1).sum()

        return jnp.abs(jax.grad(out)(e)).sum(-1)

    return lambda position: np.asarray(grads(emb, position)) > 0


def test_a_prefix_position_sees_later_prefix_tokens_of_its_segment(grads_at):
    seen = grads_at(1)
    np.testing.assert_array_equal(seen[0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0])  # 2, 3: later
    np.testing.assert_array_equal(seen[1], [1, 1, 0, 0, 0, 0, 0, 0, 0, 0])
    seen = grads_at(4)  # row 1: the second segment's prefix, not the first segment
    np.testing.assert_array_equal(seen[1], [0, 0, 0, 0, 1, 1, 1, 0, 0, 0])


def test_positions_after_the_prefix_do_not_see_the_future(grads_at):
    seen = grads_at(6)
    np.testing.assert_array_equal(seen[0], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(seen[1], [0, 0, 0, 0, 1, 1, 1, 0, 0, 0])
    seen = grads_at(7)
    np.testing.assert_array_equal(seen[1], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0])


def _row(seg, loss):
    seg, loss = np.asarray(seg, np.int32), np.asarray(loss, np.int32)
    return {"inputs": seg * 0, "targets": seg * 0, "segment_ids": seg, "loss_mask": loss}


def test_prefix_of_a_prompt_and_drawn_prefixes_of_text():
    t = PrefixLM(seed=0)
    # prompt / completion: the loss starts at input 3 (the prompt's last token)
    out = t(0, _row([1] * 6 + [0] * 2, [0, 0, 0, 1, 1, 0, 0, 0]))
    np.testing.assert_array_equal(out["prefix"], [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(out["loss_mask"], [0, 0, 0, 1, 1, 0, 0, 0])
    # text: two documents trained from their first token; many draws
    seg, loss = [1] * 5 + [2] * 7, [1] * 4 + [0] + [1] * 7
    lengths = {1: set(), 2: set()}
    for i in range(400):
        out = t(i, _row(seg, loss))
        pre, lm = out["prefix"], out["loss_mask"]
        for s, at in ((1, np.arange(0, 5)), (2, np.arange(5, 12))):
            p = int(pre[at].sum())
            lengths[s].add(p)
            np.testing.assert_array_equal(pre[at], np.arange(len(at)) < p)  # a leading run
            want = np.asarray(loss)[at] * (np.arange(len(at)) >= p - 1)
            np.testing.assert_array_equal(lm[at], want)
        # no trained target is an input the prefix lets its predictor see
        trained = np.flatnonzero(lm)
        after = np.append(pre[1:], 0)  # whether input j + 1 (target j) is in the prefix
        assert not (pre[trained] & after[trained]).any()
    assert lengths == {1: {1, 2, 3, 4}, 2: {1, 2, 3, 4, 5, 6}}
    a, b = t(7, _row(seg, loss)), t(7, _row(seg, loss))
    np.testing.assert_array_equal(a["prefix"], b["prefix"])
    assert any(
        not np.array_equal(
            PrefixLM(seed=1)(i, _row(seg, loss))["prefix"], t(i, _row(seg, loss))["prefix"]
        )
        for i in range(5)
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.kind=encoder"], "prefix_lm trains a decoder"),
        (["model.attention_impl=flash"], "xla attention"),
        (["mesh.sequence_attention=ring"], "xla attention"),
    ],
)
def test_refusals(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config.load(None, ["train.objective=prefix_lm", *overrides])


# ~20 s; the objective's masks are checked above
@pytest.mark.slow
def test_jaxllm_train_runs_prefix_lm(tmp_path):
    run = tmp_path / "run"
    args = ["train", *SMALL_RUN, "train.objective=prefix_lm", "train.steps=3"]
    assert main([*args, f"run.dir={run}"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 3

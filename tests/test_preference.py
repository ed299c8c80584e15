"""The preference objectives (`dpo`, `ipo`, `simpo`, `orpo`) on packed preference rows: each pair
is scored as if its sequences were alone, the reference comes from the batch or a frozen model
(never differentiated), padding pairs weigh nothing, and the objectives are the registered ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm import config, objectives
from jaxllm.model import build
from jaxllm.objectives import base, preference

L = 24


@nnx.jit
def _logits(model, inputs_1xN):
    n = inputs_1xN.shape[1]
    out = model(
        inputs_1xN, positions_BxL=jnp.arange(n)[None], segment_ids_BxL=jnp.ones_like(inputs_1xN)
    )
    return out.logits[0].astype(jnp.float32)


def _sequence_logps(model, seq: np.ndarray, mask: np.ndarray) -> float:
    """log p(answer | prompt) of one sequence run alone: the sum over its trained targets."""
    logp = jax.nn.log_softmax(_logits(model, jnp.asarray(seq[None, :-1])))
    return float(jnp.sum(logp[jnp.arange(len(seq) - 1), seq[1:]] * mask[1:]))


def _rows(seed: int = 0):
    """Two rows: [pair, pair, padding] and [pair, padding]; each sequence is 2 prompt tokens and
    an answer of 2-4 tokens (its mask 1 on the answer). Returns (batch, sequences, masks)."""
    rng = np.random.default_rng(seed)
    seqs, masks = [], []
    for n in (3, 4, 2, 4, 4, 3):  # answers of pairs (0: c, r), (1: c, r), (2: c, r)
        prompt = rng.integers(1, 60, 2)
        seqs.append(np.concatenate([prompt, rng.integers(1, 60, n)]).astype(np.int32))
        masks.append(np.r_[0, 0, np.ones(n)].astype(np.int32))
    batch = {
        k: np.zeros((2, L), np.int32)
        for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")
    }
    layout = [[0, 1, 2, 3], [4, 5]]
    for b, row in enumerate(layout):
        at = 0
        for s, i in enumerate(row, 1):
            n = len(seqs[i]) - 1
            batch["inputs"][b, at : at + n] = seqs[i][:-1]
            batch["targets"][b, at : at + n] = seqs[i][1:]
            batch["loss_mask"][b, at : at + n] = masks[i][1:]
            batch["segment_ids"][b, at : at + n] = s
            batch["positions"][b, at : at + n] = np.arange(n)
            at += n
    return batch, seqs, masks


@pytest.mark.parametrize("kind", preference.KINDS)
def test_packed_pairs_score_as_sequences_alone(kind):
    model, reference = build(tiny_model(), 0), build(tiny_model(), 1)
    batch, seqs, masks = _rows()
    pi = np.array([_sequence_logps(model, s, m) for s, m in zip(seqs, masks)])
    ref = np.array([_sequence_logps(reference, s, m) for s, m in zip(seqs, masks)])
    n = np.array([m.sum() for m in masks], np.float64)
    c, r = slice(0, None, 2), slice(1, None, 2)
    beta = 0.3
    want = {
        "dpo": lambda: preference.dpo_loss(pi[c], pi[r], ref[c], ref[r], beta, 0.1),
        "ipo": lambda: preference.ipo_loss(pi[c], pi[r], ref[c], ref[r], n[c], n[r], beta),
        "simpo": lambda: preference.simpo_loss(pi[c], pi[r], n[c], n[r], beta, 0.5),
        "orpo": lambda: preference.orpo_loss(pi[c], pi[r], n[c], n[r], beta),
    }[kind]()
    fn = preference.objective(kind, beta, label_smoothing=0.1 if kind == "dpo" else 0.0)
    assert fn.others == (("reference",) if kind in ("dpo", "ipo") else ())
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    out = nnx.jit(fn)(model, batch, None, {"reference": reference})
    assert float(out.tokens) == 3  # three pairs; the padding pairs of both rows count nothing
    np.testing.assert_allclose(float(out.loss_sum), np.sum(want.loss), rtol=2e-5)
    np.testing.assert_allclose(out.metrics["loss"], out.loss_sum, rtol=1e-6)
    np.testing.assert_allclose(
        out.metrics["rewards/margins"], np.sum(want.chosen_reward - want.rejected_reward), atol=1e-4
    )
    np.testing.assert_allclose(out.metrics["logps/chosen"], np.sum(want.chosen_logps), rtol=2e-5)
    accuracy = np.sum(np.asarray(want.chosen_reward) > np.asarray(want.rejected_reward))
    assert float(out.metrics["rewards/accuracies"]) == accuracy


def test_reference_from_the_batch_equals_the_live_reference_and_takes_no_gradient():
    model, reference = build(tiny_model(), 0), build(tiny_model(), 1)
    batch, _, _ = _rows(1)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    live = preference.objective("dpo", 0.1)
    pre = preference.objective("dpo", 0.1, precompute_reference=True)
    assert pre.others == ()
    ref_logps = nnx.jit(base.reference_logps)(reference, batch)
    assert float(jnp.abs(ref_logps * (1 - batch["loss_mask"])).max()) == 0.0
    a = nnx.jit(live)(model, batch, None, {"reference": reference})
    b = nnx.jit(pre)(model, {**batch, "ref_logps": ref_logps}, None)
    np.testing.assert_allclose(a.loss_sum, b.loss_sum, rtol=1e-6)

    def loss(policy, ref):
        return live(policy, batch, None, {"reference": ref}).loss_sum

    g_policy, g_ref = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(model, reference)
    norm = lambda g: float(optax_norm(g))  # noqa: E731
    assert norm(g_policy) > 0 and norm(g_ref) == 0.0


def optax_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def test_registered_objectives_read_the_train_section():
    pairs = "data.sources=[{path: pairs.jsonl, format: preference}]"
    for kind in preference.KINDS:
        cfg = config.load(None, [pairs, f"train.objective={kind}", "train.beta=0.25"])
        fn = objectives.from_config(cfg)
        assert fn.others == (("reference",) if kind in ("dpo", "ipo") else ())
    cfg = config.load(None, [pairs, "train.objective=dpo", "train.precompute_reference=true"])
    assert objectives.from_config(cfg).others == ()

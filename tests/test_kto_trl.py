"""KTO against TRL's own loss code: for the same per-example log-probability sums of the
completions and of the mismatched (KL) completions, `jaxllm.objectives.kto`'s loss, `kl` and
reward / log-probability metrics equal TRL 1.16's `KTOTrainer._compute_loss` (called on a
stand-in holding the attributes it reads and a stand-in model that hands back per-token
log-probabilities), and the objective reads the same values off packed rows."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from trl import KTOTrainer

from jaxllm.objectives import kto

pytestmark = pytest.mark.torch

N, WIDTH = 6, 5


def _examples(seed: int, labels=None):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, N).astype(bool) if labels is None else np.asarray(labels)
    token_logps = -rng.exponential(1.5, (2 * N, WIDTH - 1))  # examples, then their KL rows
    sums = token_logps.sum(1)
    ref = sums + rng.normal(0, 1.0 if seed % 2 else 3.0, 2 * N)  # seed 0: a KL above 0
    return dict(
        labels=labels,
        token_logps=token_logps,
        pi=sums[:N],
        pi_kl=sums[N:],
        ref=ref[:N],
        ref_kl=ref[N:],
    )


class _Model:
    """Hands back the per-token log-probabilities of row i of the batch it is asked about: the
    ids' last column says which row (examples 0..N-1, KL rows N..2N-1)."""

    def __init__(self, token_logps):
        self.token_logps = torch.tensor(token_logps)

    def __call__(self, input_ids, **_):
        logps = self.token_logps[input_ids[:, -1]]
        zeros = torch.zeros_like(logps)
        return types.SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros)


def _trl_kto(e: dict, beta: float, wd: float, wu: float):
    """(loss, metrics) of TRL 1.16's `KTOTrainer._compute_loss` with precomputed reference
    log-probabilities."""
    ones = torch.ones((N, WIDTH), dtype=torch.long)
    rows = torch.arange(N)
    ids = torch.zeros((N, WIDTH), dtype=torch.long)
    ids[:, -1] = rows
    kl_ids = ids.clone()
    kl_ids[:, -1] = rows + N
    batch = {
        "input_ids": ids,
        "attention_mask": ones,
        "completion_mask": ones,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": ones,
        "KL_completion_mask": ones,
        "label": torch.tensor(e["labels"]),
        "ref_logps": torch.tensor(e["ref"]),
        "ref_KL_logps": torch.tensor(e["ref_kl"]),
    }
    stub = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(
            device=torch.device("cpu"), gather_for_metrics=lambda x: x
        ),
        calculate_KL=True,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    stub._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, stub)
    loss = KTOTrainer._compute_loss(stub, _Model(e["token_logps"]), batch, False)
    return float(loss), {k: v[-1] for k, v in stub._metrics["train"].items()}


@pytest.mark.parametrize(
    "seed,beta,wd,wu,labels",
    [
        (0, 0.1, 1.0, 1.0, None),
        (1, 0.5, 1.33, 1.0, None),
        (2, 2.0, 1.0, 0.7, [True] * 3 + [False] * 3),
        (3, 0.3, 1.0, 1.0, [True] * N),  # only desirable examples
    ],
)
def test_kto_loss_equals_trl(seed, beta, wd, wu, labels):
    e = _examples(seed, labels)
    want_loss, want = _trl_kto(e, beta, wd, wu)
    valid = jnp.ones(N, bool)
    terms = kto.kto_loss(
        *(jnp.asarray(e[k], jnp.float32) for k in ("pi", "ref", "pi_kl", "ref_kl")),
        jnp.asarray(e["labels"]),
        valid,
        beta,
        wd,
        wu,
    )
    np.testing.assert_allclose(float(jnp.mean(terms.loss)), want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(terms.kl), want["kl"], rtol=1e-5, atol=1e-6)
    if seed == 0:
        assert want["kl"] > 0  # the clamp at 0 is not all this test sees
    d = e["labels"]
    np.testing.assert_allclose(np.mean(terms.reward[d]), want["rewards/chosen"], rtol=1e-5)
    if not d.all():
        np.testing.assert_allclose(np.mean(terms.reward[~d]), want["rewards/rejected"], rtol=1e-5)
    # padding entries count nowhere, in the loss or in z
    padded = kto.kto_loss(
        *(jnp.r_[jnp.asarray(e[k], jnp.float32), 9.0] for k in ("pi", "ref", "pi_kl", "ref_kl")),
        jnp.r_[jnp.asarray(e["labels"]), True],
        jnp.r_[valid, False],
        beta,
        wd,
        wu,
    )
    np.testing.assert_allclose(padded.loss[:N], terms.loss, rtol=1e-6)
    assert float(padded.kl) == pytest.approx(float(terms.kl), rel=1e-6)


class _Fixed:
    """A stand-in policy / reference whose per-token log-probabilities of the targets are given:
    the logits put `logp` on the target and spread the rest over the other ids."""

    def __init__(self, logp_BxL, vocab=8):
        self.logp_BxL, self.vocab = logp_BxL, vocab

    def __call__(self, inputs, **_):
        p = jnp.exp(self.logp_BxL)[..., None]
        rest = jnp.log((1 - p) / (self.vocab - 1))
        hit = jax.nn.one_hot(self._targets, self.vocab, dtype=bool)
        logits = jnp.where(hit, self.logp_BxL[..., None], rest)
        return types.SimpleNamespace(logits=logits, aux={})


def test_the_objective_reads_examples_and_mismatched_sequences_off_packed_rows():
    """Two rows of packed (example, mismatched) pairs: the objective's loss and metrics are
    TRL's on the per-segment sums, with padding and the prompt's tokens left out."""
    rng = np.random.default_rng(5)
    seg = np.array([[1, 1, 1, 2, 2, 3, 3, 4, 4, 4, 0, 0], [1, 1, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0]])
    mask = (seg > 0) & (rng.random(seg.shape) < 0.8)
    mask[:, 0] = False  # a prompt token
    label = np.array([[1] * 5 + [0] * 7, [0] * 12])
    logp = -rng.exponential(1.0, seg.shape).astype(np.float32)
    ref = logp + rng.normal(0, 0.5, seg.shape).astype(np.float32)
    targets = rng.integers(0, 8, seg.shape)
    batch = {
        "inputs": targets,
        "targets": targets,
        "segment_ids": seg,
        "positions": np.zeros_like(seg),
        "loss_mask": mask.astype(np.int32),
        "label": label,
        "ref_logps": ref,
    }
    policy = _Fixed(jnp.asarray(logp))
    policy._targets = jnp.asarray(targets)
    policy.cfg = None
    out = kto.objective(0.7, 1.2, 0.8, precompute_reference=True)(policy, batch, None)

    ex = [(0, 1), (0, 3), (1, 1)]  # (row, example segment)
    pi = np.array([(logp * mask)[r][seg[r] == s].sum() for r, s in ex])
    pi_kl = np.array([(logp * mask)[r][seg[r] == s + 1].sum() for r, s in ex])
    rf = np.array([(ref * mask)[r][seg[r] == s].sum() for r, s in ex])
    rf_kl = np.array([(ref * mask)[r][seg[r] == s + 1].sum() for r, s in ex])
    z = max(0.0, float(np.mean(pi_kl - rf_kl)))
    d = np.array([True, False, False])
    sig = 1 / (1 + np.exp(-0.7 * np.where(d, (pi - rf) - z, z - (pi - rf))))
    want = np.where(d, 1.2, 0.8) * (1 - sig)
    assert float(out.tokens) == 3
    np.testing.assert_allclose(float(out.loss_sum), want.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(out.metrics["kl"]) / 3, z, rtol=1e-5, atol=1e-6)
    reward = 0.7 * (pi - rf)
    np.testing.assert_allclose(float(out.metrics["rewards/chosen"]) / 3, reward[0], rtol=1e-5)
    np.testing.assert_allclose(
        float(out.metrics["rewards/rejected"]) / 3, reward[1:].mean(), rtol=1e-5
    )
    np.testing.assert_allclose(float(out.metrics["logps/rejected"]) / 3, pi[1:].mean(), rtol=1e-5)

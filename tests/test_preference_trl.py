"""The DPO family against TRL's own loss code: for the same per-sequence log-probability sums
(and answer lengths), `jaxllm.objectives.preference`'s losses and reward metrics equal TRL's within
1e-6. TRL's code is called directly: `DPOTrainer._compute_loss` on a stand-in model that hands
back the per-token log-probabilities, `CPOTrainer.cpo_loss` (SimPO) and
`ORPOTrainer.odds_ratio_loss`, each bound to a stand-in holding the attributes they read."""

import collections
import types

import jax
import numpy as np
import pytest
import torch
from trl import DPOTrainer
from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer

from jaxllm.objectives import preference

pytestmark = pytest.mark.torch

PAIRS, PROMPT, MAX_ANSWER = 5, 3, 7


def _pairs(seed: int):
    """Per-token log-probabilities of chosen / rejected answers of random lengths, laid out as
    TRL's DPO collator lays them out: [chosen rows; rejected rows], prompt then completion."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, MAX_ANSWER + 1, size=2 * PAIRS)
    width = PROMPT + MAX_ANSWER
    completion_mask = np.zeros((2 * PAIRS, width), np.int64)
    token_logps = np.zeros((2 * PAIRS, width - 1))  # of each next token, as the model gives
    for i, n in enumerate(lengths):
        completion_mask[i, PROMPT : PROMPT + n] = 1
        token_logps[i, PROMPT - 1 : PROMPT - 1 + n] = -rng.exponential(1.5, n)
    sums = token_logps.sum(1)
    ref = sums + rng.normal(0, 1.0, 2 * PAIRS)  # a reference near the policy
    return dict(
        pi_c=sums[:PAIRS],
        pi_r=sums[PAIRS:],
        ref_c=ref[:PAIRS],
        ref_r=ref[PAIRS:],
        n_c=lengths[:PAIRS].astype(np.float64),
        n_r=lengths[PAIRS:].astype(np.float64),
        completion_mask=completion_mask,
        token_logps=token_logps,
    )


def _accelerator():
    return types.SimpleNamespace(
        device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x
    )


def _trl_dpo(p: dict, loss_type: str, beta: float, label_smoothing: float = 0.0, rows=None):
    """(loss, metrics) of TRL 1.16's `DPOTrainer._compute_loss` with precomputed reference
    log-probabilities, on the pairs `rows`."""
    rows = np.arange(PAIRS) if rows is None else np.asarray(rows)
    both = np.concatenate([rows, rows + PAIRS])
    mask = torch.tensor(p["completion_mask"][both])
    logps = torch.tensor(p["token_logps"][both])
    outputs = types.SimpleNamespace(
        log_probs=logps,
        entropy=torch.zeros_like(logps),
        mean_logits=torch.zeros_like(logps),
        is_top1=torch.zeros_like(logps, dtype=torch.bool),
    )
    stub = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=_accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones_like(mask),
        "attention_mask": torch.ones_like(mask),
        "completion_mask": mask,
        "ref_chosen_logps": torch.tensor(p["ref_c"][rows]),
        "ref_rejected_logps": torch.tensor(p["ref_r"][rows]),
    }
    loss = DPOTrainer._compute_loss(stub, lambda **kw: outputs, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in stub._metrics["train"].items()}


def _ours(terms: preference.PairTerms) -> tuple[float, dict]:
    terms = preference.PairTerms(*map(np.asarray, terms))  # float64, as computed
    c, r = terms.chosen_reward, terms.rejected_reward
    return float(np.mean(terms.loss)), {
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "rewards/margins": (c - r).mean(),
        "rewards/accuracies": (c > r).mean(),
        "logps/chosen": np.mean(terms.chosen_logps),
        "logps/rejected": np.mean(terms.rejected_logps),
    }


def _close(ours: tuple[float, dict], theirs: tuple[float, dict]):
    np.testing.assert_allclose(ours[0], theirs[0], rtol=0, atol=1e-6)
    for name, value in ours[1].items():
        np.testing.assert_allclose(value, theirs[1][name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_and_ipo_equal_trl(seed, beta):
    p = _pairs(seed)
    with jax.enable_x64(True):
        dpo = preference.dpo_loss(p["pi_c"], p["pi_r"], p["ref_c"], p["ref_r"], beta)
        ipo = preference.ipo_loss(
            p["pi_c"], p["pi_r"], p["ref_c"], p["ref_r"], p["n_c"], p["n_r"], beta
        )
    _close(_ours(dpo), _trl_dpo(p, "sigmoid", beta))
    _close(_ours(ipo), _trl_dpo(p, "ipo", beta))
    assert 0 < _ours(dpo)[1]["rewards/accuracies"] < 1  # both outcomes occur: a real check


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_conservative_dpo_equals_trl(eps):
    """TRL 1.16's `sigmoid` no longer smooths labels; its `aot` loss is conservative DPO of the
    sorted batch margins, which for one pair is exactly cDPO, so it is compared pair by pair."""
    p = _pairs(2)
    with jax.enable_x64(True):
        ours = preference.dpo_loss(p["pi_c"], p["pi_r"], p["ref_c"], p["ref_r"], 0.3, eps)
    for k in range(PAIRS):
        one = preference.PairTerms(*(x[k : k + 1] for x in ours))
        _close(_ours(one), _trl_dpo(p, "aot", 0.3, eps, rows=[k]))


@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (10.0, 1.6)])
def test_simpo_equals_trl_cpo(beta, gamma):
    p = _pairs(3)
    avg_c, avg_r = p["pi_c"] / p["n_c"], p["pi_r"] / p["n_r"]
    stub = types.SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=0.0,
        accelerator=_accelerator(),
    )
    losses, chosen, rejected = CPOTrainer.cpo_loss(stub, torch.tensor(avg_c), torch.tensor(avg_r))
    theirs = _trl_metrics(losses.mean(), chosen, rejected, avg_c, avg_r)
    with jax.enable_x64(True):
        ours = preference.simpo_loss(p["pi_c"], p["pi_r"], p["n_c"], p["n_r"], beta, gamma)
    _close(_ours(ours), theirs)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_equals_trl(beta):
    """ORPO's full loss as `ORPOTrainer.get_batch_loss_metrics` composes it, NLL minus the mean
    odds-ratio term, with the NLL of the chosen answers per token."""
    p = _pairs(4)
    avg_c, avg_r = p["pi_c"] / p["n_c"], p["pi_r"] / p["n_r"]
    stub = types.SimpleNamespace(beta=beta, accelerator=_accelerator())
    losses, chosen, rejected, _, _ = ORPOTrainer.odds_ratio_loss(
        stub, torch.tensor(avg_c), torch.tensor(avg_r)
    )
    nll = torch.tensor(-avg_c).mean()
    theirs = _trl_metrics(nll - losses.mean(), chosen, rejected, avg_c, avg_r)
    with jax.enable_x64(True):
        ours = preference.orpo_loss(p["pi_c"], p["pi_r"], p["n_c"], p["n_r"], beta)
    _close(_ours(ours), theirs)


def _trl_metrics(loss, chosen, rejected, logps_c, logps_r) -> tuple[float, dict]:
    """The metrics the CPO / ORPO trainers log from their loss functions' rewards."""
    return float(loss), {
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
        "rewards/accuracies": (chosen > rejected).float().mean().item(),
        "logps/chosen": logps_c.mean(),
        "logps/rejected": logps_r.mean(),
    }

"""The DPO family: preference losses over (chosen, rejected) pairs, as objectives of the train step.

Every loss is a small pure function of per-pair quantities, [B, P] arrays read off a packed
preference row by `base.pair_sums`: the policy's log-probability sums of the chosen and
rejected answers pi_c, pi_r (log pi(y | x) summed over the answer's tokens, the `loss_mask`
ones), the reference's ref_c, ref_r, and the answers' token counts n_c, n_r. With
sigma the logistic function and beta = `train.beta`:

    dpo    -log sigma(beta * m),  m = (pi_c - ref_c) - (pi_r - ref_r)
           (Rafailov et al. 2023, arXiv:2305.18290, eq. 7); with label smoothing eps
           (conservative DPO, Mitchell 2023, "A note on DPO with noisy preferences"):
           -(1 - eps) log sigma(beta m) - eps log sigma(-beta m)
    ipo    (m' - 1 / (2 beta))^2 with m' = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r
           (Azar et al. 2023, arXiv:2310.12036, eq. 17; beta is the paper's tau; the per-token
           average is TRL's, agreed with the IPO authors)
    simpo  -log sigma(beta * (pi_c / n_c - pi_r / n_r) - gamma), gamma = `train.simpo_gamma`
           (Meng et al. 2024, arXiv:2405.14734, eq. 6); no reference
    orpo   -pi_c / n_c - beta * log sigma(log odds_c - log odds_r), with
           log odds = a - log(1 - exp(a)) of the average log-probability a = pi / n
           (Hong et al. 2024, arXiv:2403.07691, eqs. 4-7; beta is the paper's lambda); the NLL
           term is the chosen answer's, per token; no reference

Metrics take TRL's names and definitions (per pair, averaged over the pairs of the batch):
`rewards/chosen` = beta (pi_c - ref_c) (SimPO, ORPO: beta times the average log-probability),
`rewards/rejected`, `rewards/margins` (chosen - rejected), `rewards/accuracies` (chosen >
rejected), `logps/chosen`, `logps/rejected` (sums; SimPO, ORPO: per-token averages, as their
losses read them), and `loss`, the preference loss (what evaluation reports). The objective's
`tokens` is the number of pairs, so the step's sums divided by it are means over pairs.

The reference of `dpo` / `ipo` is `batch["ref_logps"]` when the batch carries it (per-token
log-probabilities of the targets, `base.reference_logps`, computed once before training by
`jaxllm.train.precompute`), else the frozen model `others["reference"]`, run on the same rows
with no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.objectives.base import ObjectiveOutput, output, pair_sums, reference_logps, token_logps


class PairTerms(NamedTuple):
    """A preference loss's per-pair values, [B, P] each."""

    loss: jax.Array
    chosen_reward: jax.Array
    rejected_reward: jax.Array
    chosen_logps: jax.Array  # as logged: sums (DPO, IPO) or per-token averages (SimPO, ORPO)
    rejected_logps: jax.Array


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta: float, label_smoothing: float = 0.0) -> PairTerms:
    """DPO's sigmoid loss, conservative with `label_smoothing` > 0 (see the module docstring)."""
    chosen, rejected = pi_c - ref_c, pi_r - ref_r
    logits = beta * (chosen - rejected)
    loss = -(1 - label_smoothing) * jax.nn.log_sigmoid(logits)
    if label_smoothing:
        loss -= label_smoothing * jax.nn.log_sigmoid(-logits)
    return PairTerms(loss, beta * chosen, beta * rejected, pi_c, pi_r)


def ipo_loss(pi_c, pi_r, ref_c, ref_r, n_c, n_r, beta: float) -> PairTerms:
    """IPO's squared loss on the per-token log-ratio margin (see the module docstring)."""
    chosen, rejected = pi_c - ref_c, pi_r - ref_r
    margin = chosen / jnp.maximum(n_c, 1.0) - rejected / jnp.maximum(n_r, 1.0)
    loss = jnp.square(margin - 1 / (2 * beta))
    return PairTerms(loss, beta * chosen, beta * rejected, pi_c, pi_r)


def simpo_loss(pi_c, pi_r, n_c, n_r, beta: float, gamma: float) -> PairTerms:
    """SimPO: the length-normalised, reference-free margin (see the module docstring)."""
    avg_c, avg_r = pi_c / jnp.maximum(n_c, 1.0), pi_r / jnp.maximum(n_r, 1.0)
    loss = -jax.nn.log_sigmoid(beta * (avg_c - avg_r) - gamma)
    return PairTerms(loss, beta * avg_c, beta * avg_r, avg_c, avg_r)


def _log1mexp(a):
    """log(1 - exp(a)) for a < 0, accurate at both ends (Maechler 2012, "Accurately computing
    log(1 - exp(-|a|))"): log(-expm1(a)) near 0, log1p(-exp(a)) below -log 2."""
    return jnp.where(a > -jnp.log(2.0), jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(a)))


def orpo_loss(pi_c, pi_r, n_c, n_r, beta: float) -> PairTerms:
    """ORPO: the chosen answer's per-token NLL plus beta times the odds-ratio loss (see the
    module docstring)."""
    avg_c, avg_r = pi_c / jnp.maximum(n_c, 1.0), pi_r / jnp.maximum(n_r, 1.0)
    log_odds = (avg_c - avg_r) - (_log1mexp(avg_c) - _log1mexp(avg_r))
    loss = -avg_c - beta * jax.nn.log_sigmoid(log_odds)
    return PairTerms(loss, beta * avg_c, beta * avg_r, avg_c, avg_r)


KINDS = ("dpo", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("dpo", "ipo")


def objective(
    kind: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    precompute_reference: bool = False,
):
    """The `kind` preference objective on packed preference rows. `dpo` / `ipo` declare
    `others = ("reference",)` unless the reference's log-probabilities come with the batch
    (`precompute_reference`); `simpo` / `orpo` need none."""
    if kind not in KINDS:
        raise ValueError(f"unknown preference loss {kind!r}; one of {', '.join(KINDS)}")

    def preference_objective(model, batch: dict, rng, others=None) -> ObjectiveOutput:
        seg_BxL = batch["segment_ids"]
        logp_BxL, out = token_logps(model, batch, rng)
        pi_c, pi_r, valid = pair_sums(logp_BxL, seg_BxL)
        n_c, n_r, _ = pair_sums(batch["loss_mask"], seg_BxL)
        if kind in NEEDS_REFERENCE:
            if "ref_logps" in batch:
                ref_BxL = batch["ref_logps"] * batch["loss_mask"].astype(jnp.float32)
            elif others and "reference" in others:
                ref_BxL = reference_logps(others["reference"], batch)
            else:
                raise ValueError(
                    f"the {kind} objective needs batch['ref_logps'] or others['reference']"
                )
            ref_c, ref_r, _ = pair_sums(jax.lax.stop_gradient(ref_BxL), seg_BxL)
        if kind == "dpo":
            terms = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing)
        elif kind == "ipo":
            terms = ipo_loss(pi_c, pi_r, ref_c, ref_r, n_c, n_r, beta)
        elif kind == "simpo":
            terms = simpo_loss(pi_c, pi_r, n_c, n_r, beta, simpo_gamma)
        else:
            terms = orpo_loss(pi_c, pi_r, n_c, n_r, beta)
        w = valid.astype(jnp.float32)
        count = jnp.sum(w)

        def total(x):  # padding pairs (valid 0) may hold anything finite; they weigh nothing
            return jnp.sum(jnp.where(valid, jax.lax.stop_gradient(x), 0.0))

        loss_sum = jnp.sum(jnp.where(valid, terms.loss, 0.0))
        metrics = {
            "loss": jax.lax.stop_gradient(loss_sum),
            "rewards/chosen": total(terms.chosen_reward),
            "rewards/rejected": total(terms.rejected_reward),
            "rewards/margins": total(terms.chosen_reward - terms.rejected_reward),
            "rewards/accuracies": total((terms.chosen_reward > terms.rejected_reward) * 1.0),
            "logps/chosen": total(terms.chosen_logps),
            "logps/rejected": total(terms.rejected_logps),
        }
        return output(model, out, loss_sum, count, metrics)

    preference_objective.others = (
        ("reference",) if kind in NEEDS_REFERENCE and not precompute_reference else ()
    )
    return preference_objective


def from_train_config(kind: str, t) -> object:
    """The `kind` objective with the coefficients of the `train` section `t`."""
    return objective(kind, t.beta, t.label_smoothing, t.simpo_gamma, t.precompute_reference)

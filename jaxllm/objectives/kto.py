"""KTO: Kahneman-Tversky Optimization on unpaired desirable / undesirable examples.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
arXiv:2402.01306, eq. 8, in TRL's form (`KTOTrainer`, `loss_type="kto"`). Each example x, y
has a label (desirable or not) and an implicit reward r = log pi(y | x) - log ref(y | x),
summed over the completion's tokens. The reference point z is KL(pi || ref) estimated on the
batch's mismatched pairs (x, y'), y' another example's completion (`jaxllm.data.unpaired`):

    z = max(0, mean over the batch of (log pi(y' | x) - log ref(y' | x))), no gradient
    desirable:    lambda_D * (1 - sigma(beta * (r - z)))
    undesirable:  lambda_U * (1 - sigma(beta * (z - r)))

and the loss is the mean over examples. beta is `train.beta`; lambda_D and lambda_U are
`train.desirable_weight` and `train.undesirable_weight`. Rows are packed preference rows: pair k
of a row is the example (segment 2k + 1) and its mismatched sequence (2k + 2), and `label` is 1
on desirable examples' tokens (`base.pair_sums` reads all three off).

z is a statistic of the batch the objective sees: the global batch, or each microbatch under
`train.grad_accum_steps`, as TRL takes it per device batch. Metrics take TRL's names, as the
mean over the batch's desirable (`rewards/chosen` = beta r, `logps/chosen` = log pi(y | x)) or
undesirable (`rewards/rejected`, `logps/rejected`) examples, `rewards/margins` their
difference, and `kl` = z; the step divides every metric sum by the number of examples, so these
sums are the class means times that number (exact for one microbatch; with accumulation, the
microbatches' means weighted by their sizes). `loss` is the KTO loss.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.objectives.base import ObjectiveOutput, output, pair_sums, reference_logps, token_logps


class KTOTerms(NamedTuple):
    """KTO's per-example loss [N] and reward [N], and the reference point z (a scalar)."""

    loss: jax.Array
    reward: jax.Array
    kl: jax.Array


def kto_loss(
    pi,
    ref,
    pi_kl,
    ref_kl,
    desirable,
    valid,
    beta: float,
    desirable_weight=1.0,
    undesirable_weight=1.0,
) -> KTOTerms:
    """KTO's loss (see the module docstring) for examples with log-probability sums `pi`, `ref`
    of their completions and `pi_kl`, `ref_kl` of their mismatched ones, boolean `desirable`;
    entries where `valid` is False (padding) count nowhere (any shape; z is over all)."""
    w = valid.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w), 1.0)
    kl = jnp.sum(jnp.where(valid, pi_kl - ref_kl, 0.0)) / n
    kl = jax.lax.stop_gradient(jnp.maximum(kl, 0.0))
    logratio = pi - ref
    loss = jnp.where(
        desirable,
        desirable_weight * (1 - jax.nn.sigmoid(beta * (logratio - kl))),
        undesirable_weight * (1 - jax.nn.sigmoid(beta * (kl - logratio))),
    )
    return KTOTerms(loss, beta * jax.lax.stop_gradient(logratio), kl)


def objective(
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    precompute_reference: bool = False,
):
    """The KTO objective on packed unpaired rows; `others = ("reference",)` unless the
    reference's log-probabilities come with the batch (`precompute_reference`)."""

    def kto_objective(model, batch: dict, rng, others=None) -> ObjectiveOutput:
        seg_BxL = batch["segment_ids"]
        logp_BxL, out = token_logps(model, batch, rng)
        pi, pi_kl, valid = pair_sums(logp_BxL, seg_BxL)
        if "ref_logps" in batch:
            ref_BxL = batch["ref_logps"] * batch["loss_mask"].astype(jnp.float32)
        elif others and "reference" in others:
            ref_BxL = reference_logps(others["reference"], batch)
        else:
            raise ValueError("the kto objective needs batch['ref_logps'] or others['reference']")
        ref, ref_kl, _ = pair_sums(jax.lax.stop_gradient(ref_BxL), seg_BxL)
        desirable = pair_sums(batch["label"], seg_BxL)[0] > 0
        terms = kto_loss(
            pi,
            ref,
            jax.lax.stop_gradient(pi_kl),
            ref_kl,
            desirable,
            valid,
            beta,
            desirable_weight,
            undesirable_weight,
        )
        count = jnp.sum(valid.astype(jnp.float32))
        loss_sum = jnp.sum(jnp.where(valid, terms.loss, 0.0))

        def class_mean(x, which):  # times `count`: the step divides by it
            hit = valid & which
            total = jnp.sum(jnp.where(hit, jax.lax.stop_gradient(x), 0.0))
            return count * total / jnp.maximum(jnp.sum(hit.astype(jnp.float32)), 1.0)

        chosen = class_mean(terms.reward, desirable)
        rejected = class_mean(terms.reward, ~desirable)
        metrics = {
            "loss": jax.lax.stop_gradient(loss_sum),
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "logps/chosen": class_mean(pi, desirable),
            "logps/rejected": class_mean(pi, ~desirable),
            "kl": count * terms.kl,
        }
        return output(model, out, loss_sum, count, metrics)

    kto_objective.others = () if precompute_reference else ("reference",)
    return kto_objective


def from_train_config(t) -> object:
    """The KTO objective with the coefficients of the `train` section `t`."""
    return objective(t.beta, t.desirable_weight, t.undesirable_weight, t.precompute_reference)

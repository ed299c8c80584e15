"""Knowledge distillation: the student learns a frozen teacher's next-token distributions.

`train.objective=distill` trains the run's model (the student) to match `train.teacher`, held
frozen on the same mesh, token by token over the tokens whose `loss_mask` is 1. Both
distributions are softened by the temperature T (`train.distill_temperature`),

    p_t = softmax(z_t / T),  p_s = softmax(z_s / T)          (teacher / student logits z),

and compared by one of three divergences (`train.distill_loss`), summed over the vocabulary:

    forward_kl  KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)
                (Hinton et al. 2015, arXiv:1503.02531): mode covering, the classic choice.
    reverse_kl  KL(p_s || p_t)
                (MiniLLM, Gu et al. 2024, arXiv:2306.08543): mode seeking, so a small student
                puts its mass on the teacher's main modes instead of spreading it thin.
    jsd         the generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024,
                arXiv:2306.13649, eq. 1), with beta = `train.distill_jsd_beta`:
                m = beta p_t + (1 - beta) p_s,
                JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m).
                As beta -> 0, JSD_beta / beta -> KL(p_t || p_s) (forward); as beta -> 1,
                JSD_beta / (1 - beta) -> KL(p_s || p_t) (reverse).

`divergence_BxL` is exactly TRL's `GKDTrainer.generalized_jsd_loss` per token (its
`reduction="none"` summed over the vocabulary): the same side of the mixture weighted by beta,
logits divided by T before the log-softmax and nothing more; forward_kl and reverse_kl are its
beta = 0 and beta = 1 cases (tests/test_distill.py checks all three against it). The
objective then multiplies the divergence by T^2, as Hinton et al. do: the gradient of the
softened divergence with respect to the logits scales as 1 / T^2, so the factor keeps the
distillation term's weight against the cross-entropy the same for any T (TRL's GKD leaves it
out). The loss, as sums over the masked tokens, is

    loss = w T^2 D + (1 - w) CE,   w = `train.distill_weight`,

CE the student's next-token cross-entropy on the data's targets. Metrics: `loss` (that
combination, the eval loss), `distill` (T^2 D), `nll` (CE), each per token. The teacher may be
shallower, deeper, narrower or wider than the student, but it must speak the same vocabulary:
`check_teacher` refuses a mismatch before anything is compiled.

On-policy distillation (GKD, `train.distill_lambda` > 0) is this objective on batches of which
some hold the student's own completions (`jaxllm.objectives.rollout.onpolicy`); their rows
carry `sampled` (1 on a sampled row), and the objective then also logs `on_policy`, the share
of the tokens that were sampled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import Config, ConfigError, ModelConfig
from jaxllm.objectives.base import Objective, ObjectiveOutput, output, token_nll

LOSSES = ("forward_kl", "reverse_kl", "jsd")


def _kl_BxL(log_p_BxLxV: jax.Array, log_q_BxLxV: jax.Array) -> jax.Array:
    """KL(p || q) per token from log-probabilities: sum_v p (log p - log q) (what
    `torch.nn.functional.kl_div(log_q, log_p, log_target=True)` sums to)."""
    return jnp.sum(jnp.exp(log_p_BxLxV) * (log_p_BxLxV - log_q_BxLxV), axis=-1)


def divergence_BxL(
    student_logits_BxLxV: jax.Array,
    teacher_logits_BxLxV: jax.Array,
    loss: str = "forward_kl",
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> jax.Array:
    """The divergence `loss` between the teacher's and the student's softened next-token
    distributions at every position, [B, L] in float32 (without the T^2 factor; see the module
    docstring). `beta` is the mixture weight of `jsd`, in (0, 1)."""
    if loss not in LOSSES:
        raise ValueError(f"distillation loss {loss!r} is not one of {', '.join(LOSSES)}")
    if student_logits_BxLxV.shape != teacher_logits_BxLxV.shape:
        raise ValueError(
            f"student logits {student_logits_BxLxV.shape} and teacher logits "
            f"{teacher_logits_BxLxV.shape} differ; a teacher must share the student's vocabulary"
        )
    log_s = jax.nn.log_softmax(student_logits_BxLxV.astype(jnp.float32) / temperature, axis=-1)
    log_t = jax.nn.log_softmax(teacher_logits_BxLxV.astype(jnp.float32) / temperature, axis=-1)
    if loss == "forward_kl":
        return _kl_BxL(log_t, log_s)
    if loss == "reverse_kl":
        return _kl_BxL(log_s, log_t)
    if not 0 < beta < 1:
        raise ValueError(f"the jsd mixture weight beta must be in (0, 1), not {beta}")
    # log m = log((1 - beta) p_s + beta p_t), in log space as TRL computes it
    log_m = jnp.logaddexp(log_s + jnp.log1p(-beta), log_t + jnp.log(beta))
    return beta * _kl_BxL(log_t, log_m) + (1 - beta) * _kl_BxL(log_s, log_m)


def distill(
    loss: str = "forward_kl",
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
    weight: float = 1.0,
) -> Objective:
    """The distillation objective: `weight` x T^2 x `loss` between the frozen `teacher` and
    the student, plus (1 - `weight`) x the student's next-token cross-entropy, summed over the
    `loss_mask` tokens, plus the student's MoE balancing losses. It declares
    `others = ("teacher",)`, so the step calls it as `objective(model, batch, rng, others)`
    with the teacher module in `others["teacher"]`."""
    if loss not in LOSSES:
        raise ValueError(f"distillation loss {loss!r} is not one of {', '.join(LOSSES)}")

    def objective(model, batch: dict, rng, others: dict) -> ObjectiveOutput:
        where = dict(positions_BxL=batch["positions"], segment_ids_BxL=batch["segment_ids"])
        out = model(batch["inputs"], dropout_key=rng, **where)
        # The teacher is frozen and runs without dropout; no gradient reaches its weights.
        teacher_logits_BxLxV = jax.lax.stop_gradient(
            others["teacher"](batch["inputs"], **where).logits
        )
        mask_BxL = batch["loss_mask"].astype(jnp.float32)
        div_BxL = divergence_BxL(
            out.logits, teacher_logits_BxLxV, loss, temperature=temperature, beta=beta
        )
        nll_BxL, _ = token_nll(out.logits, batch["targets"])
        div_sum = temperature**2 * jnp.sum(div_BxL * mask_BxL)
        nll_sum = jnp.sum(nll_BxL * mask_BxL)
        count = jnp.sum(mask_BxL)
        loss_sum = weight * div_sum + (1 - weight) * nll_sum
        metrics = {"loss": loss_sum, "distill": div_sum, "nll": nll_sum}
        if "sampled" in batch:  # on-policy distillation: 1 on the rows the student sampled
            metrics["on_policy"] = jnp.sum(batch["sampled"].astype(jnp.float32) * mask_BxL)
        # the student's balancing losses join; the teacher's routing is not trained
        return output(model, out, loss_sum, count, metrics)

    objective.others = ("teacher",)
    return objective


def from_config(cfg: Config) -> Objective:
    """`distill` with the `train.distill_*` settings."""
    t = cfg.train
    return distill(
        t.distill_loss,
        temperature=t.distill_temperature,
        beta=t.distill_jsd_beta,
        weight=t.distill_weight,
    )


def check_teacher(
    student: ModelConfig, teacher: ModelConfig, where: str, seq_len: int | None = None
) -> None:
    """ConfigError, before anything is compiled, when the teacher described at `where` cannot
    teach this student: distillation compares the two next-token distributions id by id, so
    their vocabularies must be the same size (depth, width, heads and the rest may differ); and
    with `seq_len` (the data's row length) the teacher must take rows that long."""
    if teacher.vocab_size != student.vocab_size:
        raise ConfigError(
            f"train.teacher={where} has model.vocab_size={teacher.vocab_size} but the student "
            f"has {student.vocab_size}; distillation compares their next-token distributions id "
            "by id, so give the student the teacher's vocabulary (model.vocab_size and "
            "tokenizer) or pick a teacher that shares it."
        )
    if seq_len is not None and teacher.max_seq_len < seq_len:
        raise ConfigError(
            f"train.teacher={where} takes at most {teacher.max_seq_len} positions "
            f"(model.max_seq_len) but data.seq_len is {seq_len}; lower data.seq_len to "
            f"{teacher.max_seq_len} or less."
        )

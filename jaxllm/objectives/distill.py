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

Feature distillation (`train.distill_hidden_weight` = w_h > 0) also matches hidden states, as
TinyBERT (Jiao et al. 2020, arXiv:1909.10351) and TED (Liang et al. 2023, arXiv:2210.01351)
do: for M pairs (s_m, t_m) of `train.distill_layers`, the student's residual stream after its
block s_m, h_s [B, L, D_s], is mapped into the teacher's width by a learned projection W_m
[D_s, D_t] (`model.distill_proj`, trained with the student) and compared with the teacher's
after its block t_m by the mean squared error per token,

    H = (1 / M) sum_m (1 / D_t) || h_s^(s_m) W_m - h_t^(t_m) ||^2,

    loss = w T^2 D + (1 - w) CE + w_h H,

logged as `hidden` (H per token). The default map (`default_layers`) is TinyBERT's uniform one.
MSE on the raw residual stream, as TinyBERT's hidden-state loss, rather than TED's
task-aware filters: the projections are the filters, trained by this loss alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import Config, ConfigError, ModelConfig
from jaxllm.objectives.base import Objective, ObjectiveOutput, output, token_nll

LOSSES = ("forward_kl", "reverse_kl", "jsd")
Pairs = tuple[tuple[int, int], ...]  # (student block, teacher block), 0-based


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


def hidden_mse_BxL(
    student_NxBxLxD: jax.Array, teacher_NxBxLxE: jax.Array, proj_MxDxE: jax.Array, layers: Pairs
) -> jax.Array:
    """H per token [B, L] in float32 (see the module docstring): the mean over the M pairs
    `layers` and the teacher's width of the squared error between the student's block outputs
    projected by `proj_MxDxE` and the teacher's."""
    if proj_MxDxE.shape[0] != len(layers):
        raise ConfigError(
            f"the student has {proj_MxDxE.shape[0]} projections (model.distill_proj) but "
            f"train.distill_layers has {len(layers)} pairs; set model.distill_proj=[] and "
            "let jaxllm train fill it from the teacher."
        )
    s_MxBxLxD = student_NxBxLxD[np.array([s for s, _ in layers])].astype(jnp.float32)
    t_MxBxLxE = teacher_NxBxLxE[np.array([t for _, t in layers])].astype(jnp.float32)
    mapped_MxBxLxE = jnp.einsum("mbld,mde->mble", s_MxBxLxD, proj_MxDxE.astype(jnp.float32))
    return jnp.mean(jnp.square(mapped_MxBxLxE - t_MxBxLxE), axis=(0, 3))


def default_layers(student_layers: int, teacher_layers: int) -> Pairs:
    """TinyBERT's uniform map: n = min(S, T) pairs, pair k the student's block
    (k + 1) S / n - 1 and the teacher's (k + 1) T / n - 1 (rounded down), so both stacks are
    sampled evenly and their last blocks are paired (S = 4, T = 12: (0, 2), (1, 5), (2, 8),
    (3, 11))."""
    n = min(student_layers, teacher_layers)
    return tuple(
        ((k + 1) * student_layers // n - 1, (k + 1) * teacher_layers // n - 1) for k in range(n)
    )


def feature_layers(student: ModelConfig, teacher: ModelConfig, layers: tuple, where: str) -> Pairs:
    """The layer pairs of feature distillation: `layers` (`train.distill_layers`) or the
    default map, checked against both stacks (ConfigError naming the teacher at `where`)."""
    if teacher.kind == "encoder_decoder":
        raise ConfigError(
            f"train.teacher={where} is an encoder-decoder; train.distill_hidden_weight matches "
            "the blocks of one stack: set it to 0."
        )
    pairs = tuple(tuple(p) for p in layers) or default_layers(
        student.num_layers, teacher.num_layers
    )
    for s, t in pairs:
        if not (0 <= s < student.num_layers and 0 <= t < teacher.num_layers):
            raise ConfigError(
                f"train.distill_layers pair [{s}, {t}] is outside the stacks: the student's "
                f"blocks are 0..{student.num_layers - 1}, the teacher's ({where}) "
                f"0..{teacher.num_layers - 1}."
            )
    return pairs


def distill(
    loss: str = "forward_kl",
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
    weight: float = 1.0,
    hidden_weight: float = 0.0,
    layers: Pairs = (),
) -> Objective:
    """The distillation objective: `weight` x T^2 x `loss` between the frozen `teacher` and
    the student, plus (1 - `weight`) x the student's next-token cross-entropy, plus
    `hidden_weight` x the hidden-state error H over the pairs `layers` (a student with
    `model.distill_proj`), summed over the `loss_mask` tokens, plus the student's MoE
    balancing losses. It declares `others = ("teacher",)`, so the step calls it as
    `objective(model, batch, rng, others)` with the teacher module in `others["teacher"]`."""
    if loss not in LOSSES:
        raise ValueError(f"distillation loss {loss!r} is not one of {', '.join(LOSSES)}")
    features = hidden_weight > 0

    def objective(model, batch: dict, rng, others: dict) -> ObjectiveOutput:
        where = dict(positions_BxL=batch["positions"], segment_ids_BxL=batch["segment_ids"])
        if features:  # every block's output too (`ModelOutput.hidden_states`)
            where["hidden_states"] = True
        out = model(batch["inputs"], dropout_key=rng, **where)
        # The teacher is frozen and runs without dropout; no gradient reaches its weights.
        taught = jax.lax.stop_gradient(others["teacher"](batch["inputs"], **where))
        teacher_logits_BxLxV = taught.logits
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
        if features:
            if not hasattr(model, "distill_proj"):
                raise ConfigError(
                    "train.distill_hidden_weight > 0 needs the student's projections "
                    "(model.distill_proj), which jaxllm train fills from the teacher; set "
                    "model.distill_proj=[M, D_teacher]."
                )
            proj = model.distill_proj[...]
            mse_BxL = hidden_mse_BxL(out.hidden_states, taught.hidden_states, proj, layers)
            metrics["hidden"] = jnp.sum(mse_BxL * mask_BxL)
            loss_sum = loss_sum + hidden_weight * metrics["hidden"]
            metrics["loss"] = loss_sum
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
        hidden_weight=t.distill_hidden_weight,
        layers=t.distill_layers,
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

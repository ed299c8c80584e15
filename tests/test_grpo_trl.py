"""GRPO and its kin against TRL 1.16's own code: for the same per-token log-probabilities of
the policy, the old policy and the reference, and the same advantages,
`jaxllm.objectives.rollout.grpo`'s loss and clip metrics equal `GRPOTrainer._compute_loss`
(every loss_type, token and sequence importance sampling, clip-higher, a KL term) and
`RLOOTrainer._compute_loss` within 1e-6, each called on a stand-in holding the attributes it
reads; the advantages equal TRL's (`scale_rewards` group / batch / none, RLOO's leave-one-out
baseline with the KL in the reward) as its code computes them."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from trl import GRPOTrainer, RLOOTrainer
from trl.trainer.utils import nanstd

from jaxllm.objectives.rollout import advantages, critic_free, grpo

pytestmark = pytest.mark.torch

B, PROMPT, T, V = 6, 3, 7, 11


def _stand_in(beta, eps, eps_high, loss_type, level):
    return types.SimpleNamespace(
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        loss_type=loss_type,
        beta=beta,
        epsilon_low=eps,
        epsilon_high=eps_high,
        args=types.SimpleNamespace(
            delta=None, use_bias_correction_kl=False, steps_per_generation=1
        ),
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        _entropy_bonus_enabled=False,
        accelerator=types.SimpleNamespace(
            gather=lambda x: x,
            reduce=lambda x, reduction: x,
            gather_for_metrics=lambda x: x,
            num_processes=1,
        ),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
    )


def _trl_loss(logps, old, ref, adv, mask, *, beta, eps, loss_type, eps_high=None, level="token",
              trainer=GRPOTrainer):  # fmt: skip
    """(TRL's loss, its logged metrics) of these tensors."""

    def per_token(model, input_ids, attention_mask, logits_to_keep, **_):
        assert logits_to_keep == T
        return torch.tensor(logps, dtype=torch.float64), torch.zeros(B, T), None

    stand_in = _stand_in(beta, eps, eps if eps_high is None else eps_high, loss_type, level)
    stand_in._get_per_token_logps_and_entropies = per_token
    inputs = {
        "prompt_ids": torch.zeros(B, PROMPT, dtype=torch.long),
        "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": torch.tensor(mask, dtype=torch.long),
        "advantages": torch.tensor(adv, dtype=torch.float64),
        "old_per_token_logps": torch.tensor(old, dtype=torch.float64),
        "ref_per_token_logps": torch.tensor(ref, dtype=torch.float64),
        "num_items_in_batch": torch.tensor(float(np.sum(mask))),
        "old_logps": torch.tensor((old * mask).sum(1), dtype=torch.float64),  # RLOO's
    }
    loss = float(trainer._compute_loss(stand_in, None, inputs))
    return loss, {k: v[0] for k, v in stand_in._metrics["train"].items()}


class _Model:
    def __init__(self, logits):
        self.logits = logits

    def __call__(self, inputs, **_):
        return types.SimpleNamespace(logits=self.logits, aux=None)


def _case(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), np.int32)
    for i, n in enumerate(rng.integers(1, T + 1, B)):
        mask[i, :n] = 1
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    logits = jnp.asarray(rng.normal(0, 2, (B, T, V)), jnp.float32)
    ref_logits = logits + jnp.asarray(rng.normal(0, 0.5, (B, T, V)), jnp.float32)

    def logps(x):
        return jnp.take_along_axis(jax.nn.log_softmax(x, -1), targets[..., None], -1)[..., 0]

    pi, ref = np.asarray(logps(logits)), np.asarray(logps(ref_logits))
    old = pi + rng.normal(0, 0.3, pi.shape).astype(np.float32)  # some ratios clipped
    adv = rng.normal(0, 1, B).astype(np.float32)
    batch = dict(
        inputs=jnp.zeros((B, T), jnp.int32),
        targets=targets,
        positions=jnp.tile(jnp.arange(T), (B, 1)),
        segment_ids=jnp.ones((B, T), jnp.int32),
        loss_mask=jnp.asarray(mask),
        advantages=jnp.asarray(np.repeat(adv[:, None], T, 1)),
        rewards=jnp.zeros((B, T), jnp.float32),
        old_logps=jnp.asarray(old),
    )
    return batch, logits, ref_logits, pi, old, ref, adv, mask


CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_and_clip_metrics_equal_trl(loss_type, level):
    batch, logits, ref_logits, pi, old, ref, adv, mask = _case()
    for beta, eps_high in ((0.0, 0.2), (0.2, 0.28)):  # symmetric; clip-higher with a KL
        obj = grpo.objective(beta, 0.2, loss_type, T, epsilon_high=eps_high, level=level)
        out = obj(_Model(logits), batch, None, {"reference": _Model(ref_logits)})
        ours = float(out.loss_sum / out.tokens)
        theirs, logged = _trl_loss(pi * mask, old * mask, ref * mask, adv, mask, beta=beta,
                                   eps=0.2, eps_high=eps_high, loss_type=loss_type, level=level)  # fmt: skip
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
        for name in CLIPS + (("kl",) if beta else ()):
            np.testing.assert_allclose(float(out.metrics[name] / out.tokens), logged[name],
                                       rtol=1e-5, atol=1e-7, err_msg=name)  # fmt: skip
        assert logged["clip_ratio/region_mean"] > 0  # the case clips something


def test_rloo_loss_equals_trl():
    """RLOO's ratio of whole-sequence probabilities, clipped, averaged over the completions."""
    batch, logits, _, pi, old, ref, adv, mask = _case(seed=2)
    batch["old_logps"] = jnp.asarray(pi + np.random.default_rng(3).normal(0, 0.05, pi.shape))
    old = np.asarray(batch["old_logps"])
    obj = grpo.objective(0.0, 0.2, "grpo", T, epsilon_high=0.28, level="sum")
    out = obj(_Model(logits), batch, None)
    theirs, logged = _trl_loss(pi * mask, old * mask, ref * mask, adv, mask, beta=0.0, eps=0.2,
                               eps_high=0.28, loss_type="grpo", trainer=RLOOTrainer)  # fmt: skip
    np.testing.assert_allclose(float(out.loss_sum / out.tokens), theirs, rtol=1e-6, atol=1e-7)
    for name in CLIPS:
        np.testing.assert_allclose(float(out.metrics[name] / out.tokens), logged[name], 1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, its advantage lines."""
    rewards = np.random.default_rng(1).uniform(0, 1, 12).astype(np.float32)
    r = torch.tensor(rewards, dtype=torch.float64)
    mean = r.view(-1, 4).mean(1).repeat_interleave(4)
    if scale == "batch":
        std = nanstd(r).expand_as(r)
    else:
        std = nanstd(r.view(-1, 4), dim=1).repeat_interleave(4)
    want = r - mean
    if scale != "none":
        want = want / (std + 1e-4)
    np.testing.assert_allclose(advantages.group_advantages(rewards, 4, scale), want.numpy(), 1e-6)


def test_rloo_advantages_equal_trl():
    """TRL 1.16's RLOOTrainer._generate_and_score_completions: the sequence's summed k1 KL
    (old - ref) weighted by beta leaves its reward, then the leave-one-out baseline."""
    rng = np.random.default_rng(4)
    scores = rng.uniform(0, 1, 8)
    old, ref = -rng.exponential(1, (8, 5)), -rng.exponential(1, (8, 5))
    mask = (rng.uniform(size=(8, 5)) < 0.8).astype(np.int32)
    beta, g = 0.05, 4
    rewards = torch.tensor(scores) - beta * (
        (torch.tensor(old) - torch.tensor(ref)) * torch.tensor(mask)
    ).sum(-1)
    grouped = rewards.view(-1, g)
    baselines = ((grouped.sum(1, keepdim=True) - grouped) / (g - 1)).view(-1)
    want = (rewards - baselines).numpy()
    s = types.SimpleNamespace(mask_truncated=False, overlong_buffer=0, overlong_penalty=1.0)
    batch = {"inputs": np.zeros((8, 5), np.int32), "loss_mask": mask, "old_logps": old}
    got = critic_free.fields("rloo", s, beta, g, 5, batch, scores, np.ones(8), np.zeros(8),
                             lambda: ref)  # fmt: skip
    np.testing.assert_allclose(got["advantages"][:, 0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["kl"], (old - ref) * mask, rtol=1e-6)

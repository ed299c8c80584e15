"""GRPO against TRL's own code: for the same per-token log-probabilities of the policy, the old
policy and the reference, and the same advantages, `jaxllm.objectives.rollout.grpo`'s loss equals
`GRPOTrainer._compute_loss` (loss_type grpo and dr_grpo, token-level ratios, a KL term) within
1e-6, called on a stand-in holding the attributes it reads; the group advantages equal TRL's
(centred by the group mean, scaled by its `nanstd` + 1e-4)."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from jaxllm.objectives.rollout import grpo

pytestmark = pytest.mark.torch

B, PROMPT, T, V = 6, 3, 7, 11


def _trl_loss(logps, old, ref, adv, mask, *, beta, eps, loss_type):
    def per_token(model, input_ids, attention_mask, logits_to_keep, **_):
        assert logits_to_keep == T
        return torch.tensor(logps, dtype=torch.float64), torch.zeros(B, T), None

    stand_in = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token,
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        loss_type=loss_type,
        beta=beta,
        epsilon_low=eps,
        epsilon_high=eps,
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False),
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        _entropy_bonus_enabled=False,
        accelerator=types.SimpleNamespace(
            gather=lambda x: x, reduce=lambda x, reduction: x, gather_for_metrics=lambda x: x
        ),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, PROMPT, dtype=torch.long),
        "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": torch.tensor(mask, dtype=torch.long),
        "advantages": torch.tensor(adv, dtype=torch.float64),
        "old_per_token_logps": torch.tensor(old, dtype=torch.float64),
        "ref_per_token_logps": torch.tensor(ref, dtype=torch.float64),
    }
    return float(GRPOTrainer._compute_loss(stand_in, None, inputs))


class _Model:
    def __init__(self, logits):
        self.logits = logits

    def __call__(self, inputs, **_):
        return types.SimpleNamespace(logits=self.logits, aux=None)


@pytest.mark.parametrize("normalization,loss_type", [("sequence", "grpo"), ("dr_grpo", "dr_grpo")])
def test_loss_equals_trl(normalization, loss_type):
    rng = np.random.default_rng(0)
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
    for beta in (0.0, 0.2):
        obj = grpo.objective(beta, 0.2, normalization, max_completion_tokens=T)
        out = obj(_Model(logits), batch, None, {"reference": _Model(ref_logits)})
        ours = float(out.loss_sum / out.tokens)
        theirs = _trl_loss(pi * mask, old * mask, ref * mask, adv, mask, beta=beta, eps=0.2,
                           loss_type=loss_type)  # fmt: skip
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_group_advantages_equal_trl():
    rewards = np.random.default_rng(1).uniform(0, 1, 12).astype(np.float32)
    r = torch.tensor(rewards, dtype=torch.float64)
    mean = r.view(-1, 4).mean(1).repeat_interleave(4)
    std = nanstd(r.view(-1, 4), dim=1).repeat_interleave(4)
    np.testing.assert_allclose(
        grpo.group_advantages(rewards, 4, "sequence"), ((r - mean) / (std + 1e-4)).numpy(), 1e-6
    )
    np.testing.assert_allclose(
        grpo.group_advantages(rewards, 4, "dr_grpo"), (r - mean).numpy(), 1e-6
    )

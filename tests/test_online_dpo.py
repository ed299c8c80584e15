"""Online DPO: the ranking of each prompt's two completions, the loss and metrics against a
NumPy transcription of TRL 1.16's `OnlineDPOTrainer.training_step`, the config checks, and runs
of `jaxllm.train.loop.train` that sample their own pairs: at the reference at step 1, resumed
bit-identically, and equal on one device and on data 2 x fsdp 2 x tensor 2."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from test_rollouts import (  # noqa: F401 (the fixture and the reward the runs name)
    MESH,
    ONE_DEVICE,
    _metrics,
    _prompts,
    lowercase_share,
    one_device,
)

from jaxllm import config
from jaxllm.config import ConfigError
from jaxllm.objectives.rollout import online_dpo
from jaxllm.train.loop import train

RUN = [
    "data.seq_len=24",
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.vocab_size=264",
    "model.max_seq_len=32",
    "model.dtype=float32",
    "generate.kv_cache_dtype=float32",
    "train.objective=online_dpo",
    "train.beta=0.1",
    "train.global_batch_size=16",
    "train.num_generations=2",
    "train.max_completion_tokens=6",
    "train.reward=test_rollouts:lowercase_share",
    "train.sample_tokens=0",
    "checkpoint.save_final=false",
    "train.log_every=1",
    "train.eval_every=0",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
    "peft.method=lora",
    "peft.targets=[q_proj, v_proj, o_proj]",
]


def test_the_higher_reward_is_chosen_and_the_first_on_a_tie():
    got = online_dpo.rollout_fields(np.array([0.1, 0.5, 0.7, 0.2, 0.3, 0.3]), (6, 4))
    np.testing.assert_array_equal(got["chosen"][:, 0], [0, 1, 1, 0, 1, 0])
    assert got["chosen"].shape == got["rewards"].shape == (6, 4)
    np.testing.assert_allclose(got["rewards"][:, 3], [0.1, 0.5, 0.7, 0.2, 0.3, 0.3])


def _trl_online_dpo(logprobs, ref_logprobs, completion_mask, rewards, beta):
    """TRL 1.16's `OnlineDPOTrainer.training_step` from the rewards on, transcribed in NumPy:
    completions [first of each prompt; second of each prompt], `loss_type="sigmoid"`."""
    batch_size = len(rewards) // 2
    first_half, second_half = rewards[:batch_size], rewards[batch_size:]
    mask = first_half >= second_half
    batch_range = np.arange(batch_size)
    chosen_indices = batch_range + (~mask * batch_size)
    rejected_indices = batch_range + (mask * batch_size)
    cr_indices = np.concatenate((chosen_indices, rejected_indices))
    cr_mask = completion_mask[cr_indices]
    cr_logprobs_sum = (logprobs[cr_indices] * cr_mask).sum(1)
    cr_ref_logprobs_sum = (ref_logprobs[cr_indices] * cr_mask).sum(1)
    chosen, rejected = np.split(cr_logprobs_sum, 2)
    chosen_ref, rejected_ref = np.split(cr_ref_logprobs_sum, 2)
    logits = (chosen - rejected) - (chosen_ref - rejected_ref)
    losses = -np.log(1 / (1 + np.exp(-beta * logits)))
    kl = ((logprobs - ref_logprobs) * completion_mask).sum(1)  # padding holds 0 in TRL
    chosen_rewards, rejected_rewards = (
        beta * (chosen - chosen_ref),
        beta * (rejected - rejected_ref),
    )
    return losses.mean(), {
        "objective/scores_margin": (rewards[chosen_indices] - rewards[rejected_indices]).mean(),
        "objective/scores": rewards.mean(),
        "logps/chosen": chosen.mean(),
        "logps/rejected": rejected.mean(),
        "objective/kl": kl.mean(),
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).mean(),
    }


class _Model:
    def __init__(self, logits):
        self.logits = logits

    def __call__(self, inputs, **_):
        return SimpleNamespace(logits=self.logits, aux=None)


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_metrics_equal_trls(seed):
    n, length, vocab, beta = 4, 7, 12, 0.3
    rng = np.random.default_rng(seed)
    mask = np.zeros((2 * n, length), np.int32)
    for i, m in enumerate(rng.integers(1, length - 2, 2 * n)):
        mask[i, 2 : 2 + m] = 1  # after a prompt of 2
    targets = rng.integers(0, vocab, (2 * n, length))
    logits = rng.normal(0, 2, (2 * n, length, vocab)).astype(np.float32)
    ref_logits = logits + rng.normal(0, 0.7, logits.shape).astype(np.float32)
    scores = rng.integers(0, 3, 2 * n) / 2  # ties too
    if seed == 0:
        scores[:2] = 0.5
    batch = {
        "inputs": targets,
        "targets": targets,
        "positions": np.tile(np.arange(length), (2 * n, 1)),
        "segment_ids": np.ones((2 * n, length), np.int32),
        "loss_mask": mask,
        **online_dpo.rollout_fields(scores, (2 * n, length)),
    }
    obj = online_dpo.objective(beta)
    assert obj.others == ("reference",)
    out = obj(_Model(jnp.asarray(logits)), batch, None, {"reference": _Model(ref_logits)})

    def logps(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        x = x - np.log(np.exp(x).sum(-1, keepdims=True))
        return np.take_along_axis(x, targets[..., None], -1)[..., 0]

    # ours: a prompt's two completions in rows 2k, 2k + 1; TRL's: rows k and n + k
    trl_order = np.r_[np.arange(0, 2 * n, 2), np.arange(1, 2 * n, 2)]
    want_loss, want = _trl_online_dpo(
        logps(logits)[trl_order],
        logps(ref_logits)[trl_order],
        mask[trl_order],
        scores[trl_order],
        beta,
    )
    assert float(out.tokens) == n
    np.testing.assert_allclose(float(out.loss_sum) / n, want_loss, rtol=1e-5)
    for name, value in want.items():
        got = float(out.metrics[name]) / n
        np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.num_generations=4"], "set train.num_generations=2"),
        (["train.grad_accum_steps=2"], "train.grad_accum_steps=1"),
        (["train.beta=0"], "must be positive"),
        (["train.clip_epsilon=0.3"], "clip_epsilon has no effect"),
        (["train.grpo.loss_type=dapo"], "has no effect"),
    ],
)
def test_config_refusals(tmp_path, overrides, match):
    source = _prompts(tmp_path)
    with pytest.raises(ConfigError, match=match):
        config.load(
            None, [*RUN, f"data.sources={source}", f"data.eval_sources={source}", *overrides]
        )


def _run(run, source, *overrides):
    args = [*RUN, f"data.sources={source}", f"data.eval_sources={source}", *overrides]
    train(config.load(None, [*args, f"run.dir={run}"]))
    return _metrics(run)


@pytest.mark.slow
def test_online_dpo_starts_at_the_reference_and_resumes_bit_identically(tmp_path):
    """Under LoRA the reference is the base: at step 1 the policy is the reference, so the loss
    is log 2 and every DPO reward and the KL are 0; the chosen completion is never the
    lower-scored one. A run stopped after step 2 and resumed makes the same steps 3 and 4."""
    source = _prompts(tmp_path)
    straight = _run(tmp_path / "straight", source, "train.steps=4")
    first = straight[0]
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert first["rewards/chosen"] == 0 and first["rewards/margins"] == 0
    assert first["objective/kl"] == pytest.approx(0, abs=1e-7)
    assert all(r["tokens"] == 8 and r["objective/scores_margin"] >= 0 for r in straight)
    assert straight[-1]["objective/kl"] != 0 and straight[-1]["loss"] != first["loss"]
    split = tmp_path / "split"
    _run(split, source, "train.steps=2", "checkpoint.save_final=true")
    resumed = _run(split, source, "train.steps=4")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for got, want in zip(resumed[2:], straight[2:]):
        for key in ("loss", "grad_norm", "reward_mean", "objective/kl", "rewards/margins"):
            assert got[key] == want[key], (got["step"], key)


def test_the_same_losses_on_one_device_and_on_a_mesh(tmp_path, request):
    source = _prompts(tmp_path)
    losses = {}
    for name, layout in (("mesh", MESH), ("one", ONE_DEVICE)):
        if name == "one":
            request.getfixturevalue("one_device")
        rows = _run(tmp_path / name, source, "train.steps=3", "optim.lr=3e-2", *layout)
        keys = ("loss", "grad_norm", "reward_mean", "objective/kl", "rewards/margins")
        losses[name] = [[r[k] for k in keys] for r in rows]
    # objective/kl differences sums of ~30 in float32: an absolute tolerance for it
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=2e-5, atol=2e-6)
    assert losses["one"][-1][3] != 0


def test_each_reward_terms_mean_is_logged_over_the_completions():
    """`rewards/<name>/mean`: the mean over the completions of each term's reward, padding pairs
    (no completion token) left out, as objective/scores counts them."""
    n, length = 3, 5
    rng = np.random.default_rng(0)
    mask = np.zeros((2 * n, length), np.int32)
    mask[:4, 2:4] = 1  # the third pair is padding
    targets = rng.integers(0, 8, (2 * n, length))
    terms = {"a": rng.normal(size=2 * n), "b": rng.uniform(size=2 * n)}
    batch = {
        "inputs": targets,
        "targets": targets,
        "positions": np.tile(np.arange(length), (2 * n, 1)),
        "segment_ids": np.ones((2 * n, length), np.int32),
        "loss_mask": mask,
        **online_dpo.rollout_fields(terms["a"] + terms["b"], (2 * n, length)),
        **{
            f"rewards/{k}": np.repeat(v[:, None], length, 1).astype(np.float32)
            for k, v in terms.items()
        },
    }
    logits = jnp.asarray(rng.normal(size=(2 * n, length, 8)), jnp.float32)
    out = online_dpo.objective(0.1, ("a", "b"))(
        _Model(logits), batch, None, {"reference": _Model(logits)}
    )
    assert float(out.tokens) == 2
    for k, v in terms.items():
        assert float(out.metrics[f"rewards/{k}/mean"]) / 2 == pytest.approx(v[:4].mean(), rel=1e-6)
    assert (
        "rewards/a/mean"
        not in online_dpo.objective(0.1)(
            _Model(logits), batch, None, {"reference": _Model(logits)}
        ).metrics
    )


def test_weighted_rewards_are_logged_by_name_in_a_run(tmp_path):
    """`train.rewards` on online DPO: each term's mean is logged as rewards/<name>/mean, and
    the completions' mean score is their weighted sum."""
    terms = "train.rewards=[{fn: test_rollouts:lowercase_share}, {fn: exact_match, weight: -0.5}]"
    args = [a for a in RUN if not a.startswith("train.reward=")]
    args += [
        f"data.sources={_prompts(tmp_path)}",
        terms,
        "train.steps=2",
        f"run.dir={tmp_path / 'r'}",
    ]
    train(config.load(None, args))
    rows = _metrics(tmp_path / "r")
    assert len(rows) == 2
    for r in rows:
        share, exact = r["rewards/lowercase_share/mean"], r["rewards/exact_match/mean"]
        assert 0 < share <= 1
        assert r["objective/scores"] == pytest.approx(share - 0.5 * exact, rel=1e-5, abs=1e-6)

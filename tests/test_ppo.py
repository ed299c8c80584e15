"""PPO: GAE against the recursion, the rollout's fields, the clipped losses against TRL's
formula, the value head, the config keys, and runs of `jaxllm.train.loop.train` (the reward
rises; a resumed run makes the same steps)."""

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxllm import config, objectives, sharding
from jaxllm.adapters import export_peft
from jaxllm.config import ConfigError, ModelConfig
from jaxllm.convert.export import export_hf
from jaxllm.load import load_weights, restore
from jaxllm.model import build
from jaxllm.model.transformer import init_keys
from jaxllm.objectives.rollout import ppo
from jaxllm.train.loop import train


def _mask(seed=0, b=4, length=7):
    """Rows whose completion is a contiguous run of random length after a random prompt."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, length), np.int32)
    for i in range(b):
        start = int(rng.integers(0, 3))
        mask[i, start : start + int(rng.integers(1, length - start))] = 1
    return mask


def test_gae_matches_the_recursion_per_episode():
    rng = np.random.default_rng(0)
    mask = _mask()
    r, v = rng.normal(0, 1, mask.shape), rng.normal(0, 1, mask.shape)
    gamma, lam = 0.9, 0.8
    adv, ret = ppo.gae(r, v, mask, gamma, lam)
    for i in range(len(mask)):
        idx = np.flatnonzero(mask[i])
        want, next_adv, next_v = np.zeros(len(idx)), 0.0, 0.0  # V(s_T) = 0: the episode ends
        for j in reversed(range(len(idx))):
            delta = r[i, idx[j]] + gamma * next_v - v[i, idx[j]]
            want[j] = next_adv = delta + gamma * lam * next_adv
            next_v = v[i, idx[j]]
        np.testing.assert_allclose(adv[i, idx], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret[i, idx], want + v[i, idx], rtol=1e-5, atol=1e-6)
    assert not adv[mask == 0].any() and not ret[mask == 0].any()
    # lambda = gamma = 1: the Monte-Carlo return minus V; lambda = 0: the one-step TD error.
    mc, _ = ppo.gae(r * mask, v, mask, 1.0, 1.0)
    tail = np.cumsum((r * mask)[:, ::-1], 1)[:, ::-1]
    np.testing.assert_allclose(mc[mask == 1], (tail - v)[mask == 1], rtol=1e-5, atol=1e-5)


def test_rollout_fields_put_the_score_on_the_last_token():
    mask = _mask(1)
    scores = [1.0, 0.0, 0.5, 2.0]
    t = SimpleNamespace(gae_gamma=1.0, gae_lambda=0.95)
    values = np.random.default_rng(2).normal(0, 1, mask.shape)
    f = ppo.rollout_fields(scores, values, mask, t)
    for i, s in enumerate(scores):
        last = np.flatnonzero(mask[i])[-1]
        assert f["rewards"][i, last] == s and f["rewards"][i].sum() == s
    a = f["advantages"][mask == 1]
    np.testing.assert_allclose([a.mean(), a.std(ddof=1)], [0.0, 1.0], atol=1e-4)
    np.testing.assert_allclose(f["token_weights"].sum(), len(scores), rtol=1e-6)  # S / T each


def _logps(logits, targets):
    logp = jax.nn.log_softmax(logits, -1)
    return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


def _trl_loss(logp, old, adv, vpred, old_v, ret, mask, eps, eps_v, vf_coef):
    """TRL's PPOTrainer (0.x, before its removal) loss of one minibatch, transcribed in numpy:
    masked means of the clipped policy loss and of 0.5 x the clipped value loss."""
    logp, old, adv, vpred, old_v, ret, mask = (
        np.asarray(x, np.float64) for x in (logp, old, adv, vpred, old_v, ret, mask)
    )

    def masked_mean(x):
        return (x * mask).sum() / mask.sum()

    vpredclipped = np.clip(vpred, old_v - eps_v, old_v + eps_v)
    vf_loss = 0.5 * masked_mean(np.maximum((vpred - ret) ** 2, (vpredclipped - ret) ** 2))
    ratio = np.exp(logp - old)
    pg_losses, pg_losses2 = -adv * ratio, -adv * np.clip(ratio, 1.0 - eps, 1.0 + eps)
    pg_loss = masked_mean(np.maximum(pg_losses, pg_losses2))
    return pg_loss + vf_coef * vf_loss, masked_mean(pg_losses2 > pg_losses)


class _Model:
    """A stand-in policy whose logits and values are fixed."""

    def __init__(self, logits, values=None):
        self.logits, self.values = logits, values

    def __call__(self, inputs, **_):
        return SimpleNamespace(logits=self.logits, values=self.values, aux=None)


def _batch(seed=3, b=4, length=7, v=16):
    rng = np.random.default_rng(seed)
    mask = _mask(seed, b, length)
    logits = jnp.asarray(rng.normal(0, 2, (b, length, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, length)), jnp.int32)
    logp = _logps(logits, targets) * mask
    values = jnp.asarray(rng.normal(0, 1, (b, length)), jnp.float32)
    t = SimpleNamespace(gae_gamma=1.0, gae_lambda=0.95)
    old_values = np.asarray(values + rng.normal(0, 0.4, values.shape), np.float32)
    batch = dict(
        inputs=targets,
        targets=targets,
        positions=jnp.tile(jnp.arange(length), (b, 1)),
        segment_ids=jnp.ones((b, length), jnp.int32),
        loss_mask=jnp.asarray(mask),
        old_logps=jnp.asarray(logp + rng.normal(0, 0.4, logp.shape) * mask, jnp.float32),
        old_values=jnp.asarray(old_values),
        **ppo.rollout_fields(rng.uniform(0, 1, b), old_values, mask, t),
    )
    return batch, logits, values, logp


def test_loss_matches_trls_formula_and_adds_the_reference_kl():
    batch, logits, values, logp = _batch()
    obj = ppo.objective(0.0, clip_epsilon=0.2, value_coef=0.1, value_clip=0.2)
    assert obj.others == ()
    out = obj(_Model(logits, values), batch, None)
    want, clipfrac = _trl_loss(
        logp,
        batch["old_logps"],
        batch["advantages"],
        values,
        batch["old_values"],
        batch["returns"],
        batch["loss_mask"],
        0.2,
        0.2,
        0.1,
    )
    assert float(out.tokens) == 4
    np.testing.assert_allclose(float(out.loss_sum / out.tokens), want, rtol=1e-5)
    np.testing.assert_allclose(float(out.metrics["clip_ratio"] / 4), clipfrac, rtol=1e-5)
    assert 0 < clipfrac < 1 and float(out.metrics["value_clip_ratio"]) > 0
    scores = np.asarray(batch["rewards"]).sum(1)
    np.testing.assert_allclose(float(out.metrics["reward_mean"]) / 4, scores.mean(), rtol=1e-6)
    # beta > 0: the loss gains beta x the token mean of k3 against the reference
    ref_logits = logits + jnp.asarray(np.random.default_rng(5).normal(0, 0.5, logits.shape))
    kl_obj = ppo.objective(0.3, clip_epsilon=0.2, value_coef=0.1, value_clip=0.2)
    assert kl_obj.others == ("reference",)
    kl_out = kl_obj(_Model(logits, values), batch, None, {"reference": _Model(ref_logits)})
    ref = _logps(ref_logits, batch["targets"]) * batch["loss_mask"]
    d = np.asarray(ref - logp, np.float64)
    mask = np.asarray(batch["loss_mask"])
    kl = ((np.exp(d) - d - 1) * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(kl_out.metrics["kl"] / 4), kl, rtol=1e-5)
    np.testing.assert_allclose(float(kl_out.loss_sum / 4), want + 0.3 * kl, rtol=1e-5)


def test_the_value_loss_moves_the_values_toward_the_returns():
    batch, logits, values, _ = _batch(seed=4)
    batch["old_values"] = values  # inside the clip range: the plain squared error's gradient
    obj = ppo.objective(0.0, value_coef=0.5)
    grad = jax.grad(lambda v: obj(_Model(logits, v), batch, None).loss_sum)(values)
    mask = np.asarray(batch["loss_mask"], bool)
    want = 0.5 * (values - batch["returns"]) * batch["token_weights"]
    np.testing.assert_allclose(np.asarray(grad)[mask], np.asarray(want)[mask], rtol=1e-5)
    assert not np.asarray(grad)[~mask].any()


def test_the_value_head_leaves_the_lm_untouched():
    kw = dict(num_layers=1, d_model=16, num_heads=2, num_kv_heads=2, mlp_dim=32)
    kw.update(vocab_size=32, max_seq_len=8, dtype="float32")
    tokens = jnp.arange(8)[None] % 32
    plain = build(ModelConfig(**kw), 0)(tokens)
    out = build(ModelConfig(**kw, value_head=True), 0)(tokens)
    assert plain.values is None and out.values.shape == (1, 8)
    np.testing.assert_array_equal(out.logits, plain.logits)
    with pytest.raises(ConfigError, match="model.value_head"):
        ModelConfig(**kw, value_head=True, head="score").validate()


ROLLOUT = "[{path: prompts.jsonl, format: rollout}]"


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.objective=grpo", "train.gae_lambda=0.9"], "belongs to ppo"),
        (["train.objective=ppo", "train.grpo.loss_type=dr_grpo"], "belongs to grpo"),
        (["train.objective=grpo", "train.grpo_normalization=dr_grpo"], "now train.grpo.loss"),
        (["train.objective=ppo", "train.gae_gamma=1.5"], r"gae_gamma must be in \[0, 1\]"),
        (["train.objective=ppo", "train.value_clip=0"], "value_clip must be positive"),
        (["train.objective=ppo", "train.num_generations=0"], "at least 1 for ppo"),
    ],
)
def test_config_refusals(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config.load(None, [f"data.sources={ROLLOUT}", *overrides]).validate(1)


def test_ppo_needs_a_value_head():
    base = [f"data.sources={ROLLOUT}", "train.objective=ppo", "train.num_generations=1"]
    config.load(None, base).validate(1)  # one completion per prompt is enough for PPO
    with pytest.raises(ConfigError, match="model.value_head=true"):
        objectives.from_config(config.load(None, base))


def lowercase_share(prompts, completions, answers):
    """A dense, learnable reward for a random model: the share of lowercase letters."""
    return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


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
    "model.value_head=true",
    "generate.kv_cache_dtype=float32",
    "train.objective=ppo",
    "train.beta=0",
    "train.global_batch_size=16",
    "train.num_generations=4",
    "train.max_completion_tokens=6",
    f"train.reward={__name__}:lowercase_share",
    "train.sample_tokens=0",
    "checkpoint.save_final=false",
    "train.log_every=1",
    "train.eval_every=0",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


def _prompts(tmp_path):
    records = [{"prompt": f"q{i}:", "answer": ""} for i in range(10)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return f"[{{path: {path}, format: rollout}}]"


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_ppo_raises_a_reward_and_its_lm_loads_without_the_value_head(tmp_path):
    run = tmp_path / "run"
    base = [*RUN, f"data.sources={_prompts(tmp_path)}", "train.steps=16", f"run.dir={run}"]
    train(config.load(None, [*base, "checkpoint.save_final=true"]))
    m = _metrics(run)
    assert [r["step"] for r in m] == list(range(1, 17))
    assert all(r["tokens"] == 16 for r in m)  # the step counts sequences
    assert {"policy_loss", "value_loss", "clip_ratio"} <= set(m[0]) and "kl" not in m[0]
    first = np.mean([r["reward_mean"] for r in m[:4]])
    last = np.mean([r["reward_mean"] for r in m[-4:]])
    assert last > first + 0.05, (first, last)
    # what the run trained, read by a model with and without the value head (SFT on from PPO)
    cfg = config.load(None, base)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    with_value = load_weights(run, cfg.model, mesh)[0]
    plain = load_weights(run, dataclasses.replace(cfg.model, value_head=False), mesh)[0]
    assert "value" in with_value and set(plain) == set(with_value) - {"value"}
    lm = {k: with_value[k] for k in plain}
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(lm), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_resumed_ppo_run_makes_the_same_steps(tmp_path):
    base = [*RUN, f"data.sources={_prompts(tmp_path)}", "train.steps=5"]
    base.append("optim.schedule=constant")  # the same learning rates whatever train.steps
    straight = tmp_path / "straight"
    train(config.load(None, [*base, f"run.dir={straight}"]))
    split = tmp_path / "split"  # stopped after step 3 (its checkpoint), resumed to step 5
    cut = [*base, f"run.dir={split}"]
    train(config.load(None, [*cut, "train.steps=3", "checkpoint.save_final=true"]))
    train(config.load(None, cut))
    resumed = {r["step"]: r for r in _metrics(split)}
    for r in _metrics(straight)[3:]:
        for key in ("loss", "value_loss", "reward_mean", "grad_norm", "completion_length"):
            assert resumed[r["step"]][key] == r[key], (r["step"], key)


def test_export_leaves_the_value_head_behind(tmp_path):
    kw = dict(num_layers=1, d_model=16, num_heads=2, num_kv_heads=2, mlp_dim=32)
    kw.update(vocab_size=264, max_seq_len=8, dtype="float32")
    data = {"seq_len": 8}
    with_value = config.from_dict({"model": {**kw, "value_head": True}, "data": data}).validate(1)
    params = nnx.to_pure_dict(nnx.state(build(with_value.model, 0), nnx.Param))
    assert "value" in params
    export_hf(params, with_value, tmp_path / "ppo")
    lm = {k: v for k, v in params.items() if k != "value"}
    export_hf(lm, config.from_dict({"model": kw, "data": data}).validate(1), tmp_path / "lm")
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("ppo", "lm"))
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k])


@pytest.mark.slow
def test_ppo_under_lora_trains_the_value_head_beside_the_adapters(tmp_path):
    """The reference is the base with the adapters off: the KL is 0 at step 1, then grows; the
    value head trains (it is no part of the frozen base) and stays out of the PEFT export."""
    run = tmp_path / "run"
    overrides = [*RUN, f"data.sources={_prompts(tmp_path)}", "peft.method=lora", "train.beta=0.1"]
    overrides += ["peft.targets=[q_proj, v_proj]", "train.steps=4", "checkpoint.save_final=true"]
    train(config.load(None, [*overrides, f"run.dir={run}"]))
    m = _metrics(run)
    assert m[0]["kl"] == pytest.approx(0.0, abs=1e-7) and m[-1]["kl"] > 1e-6
    r = restore(run)
    assert "value" in r.params and "value" not in r.frozen
    start = build(r.cfg.model, init_keys(r.cfg.run.seed)[0], r.cfg.peft).value[...]
    assert np.abs(np.asarray(r.params["value"]) - np.asarray(start)).max() > 1e-4
    export_peft(r.params, r.cfg, tmp_path / "adapters")
    names = load_file(tmp_path / "adapters" / "adapter_model.safetensors").keys()
    assert names and all("lora_" in n for n in names)

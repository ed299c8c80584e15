"""The rollouts of GRPO and PPO (`jaxllm.objectives.rollout.sampling`): the stop a completion
ends with, a reward model as the reward, several updates per rollout (and a resume between
them), and the same losses on one device and on a data x fsdp x tensor mesh."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import checkpoint, config, objectives, sharding
from jaxllm.config import ConfigError
from jaxllm.infer.generate import _first_stop, _stop_at
from jaxllm.infer.reward import score
from jaxllm.model import build, split_peft
from jaxllm.objectives.rollout.generation import rows, sequences
from jaxllm.objectives.rollout.sampling import Rollouts
from jaxllm.train import companions
from jaxllm.train.loop import train
from jaxllm.train.step import BATCH_AXES

TINY = [
    "data.seq_len=24",
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.vocab_size=264",
    "model.max_seq_len=32",
    "model.dtype=float32",
]
RUN = [
    *TINY,
    "generate.kv_cache_dtype=float32",
    "train.objective=grpo",
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
    "optim.schedule=constant",  # the same learning rates whatever train.steps
]
ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1"]  # with `one_device`
MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


@pytest.fixture
def one_device(monkeypatch):
    """`train` on the first device alone: it lays its mesh over `jax.devices()`."""
    first = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *a: first)


def lowercase_share(prompts, completions, answers):
    """A dense, learnable reward for a random model: the share of lowercase letters."""
    return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


def _prompts(tmp_path, chat=False):
    path = tmp_path / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(10):
            prompt = [{"role": "user", "content": f"q{i}?"}] if chat else f"q{i}:"
            f.write(json.dumps({"prompt": prompt, "answer": ""}) + "\n")
    return f"[{{path: {path}, format: rollout}}]"


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_completion_keeps_the_stop_it_ended_with():
    stops, seqs = {257}, [(60, 124, 62)]  # EOS; "<|>" as three bytes
    for row, cut, end in [
        ([5, 6, 257, 9], 2, [257]),
        ([5, 60, 124, 62, 257], 1, [60, 124, 62]),
        ([5, 6, 7], None, None),
    ]:
        assert _first_stop(row, stops, seqs) == cut
        if cut is not None:
            assert _stop_at(row, cut, stops, seqs) == end
    prompts = [np.array([256, 5, 6], np.int32), np.array([256, 7], np.int32)]
    seq = sequences(prompts, [[9, 8], [4, 4, 4]], [[60, 124, 62], []])
    out = rows(prompts, seq, seq_len=8)
    np.testing.assert_array_equal(out["targets"][0], [5, 6, 9, 8, 60, 124, 62, 0])
    np.testing.assert_array_equal(out["loss_mask"][0], [0, 0, 1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(out["loss_mask"][1], [0, 1, 1, 1, 0, 0, 0, 0])  # cut off


def test_chat_prompts_stop_at_the_templates_end_of_turn(tmp_path):
    chat = f"data.sources={_prompts(tmp_path, chat=True)}"
    cfg = config.load(None, [*RUN, *ONE_DEVICE, chat, "data.seq_len=64", "model.max_seq_len=64"])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    roll = Rollouts(cfg, mesh, sharding.named(mesh, BATCH_AXES), slice(None))
    marker = tuple("<|im_end|>".encode())  # the built-in template with the byte tokenizer
    assert roll.stop_sequences == (marker,)
    plain = config.load(None, [*RUN, *ONE_DEVICE, f"data.sources={_prompts(tmp_path)}"])
    assert Rollouts(plain, mesh, sharding.named(mesh, BATCH_AXES), slice(None)).stops == [257]


def _reward_run(path, overrides=()):
    """A run directory holding a randomly initialised reward model (model.head=score)."""
    cfg = config.load(None, [*TINY, "model.head=score", *overrides])
    params = split_peft(build(cfg.model, 3), None)[1]
    path.mkdir(parents=True)
    config.dump(cfg, path / "config.yaml")
    checkpoint.save_params(
        checkpoint.checkpoint_dir(path, cfg.checkpoint.dir),
        params,
        step=0,
        config=config.to_dict(cfg),
        tokenizer=checkpoint.tokenizer_record(cfg.data.tokenizer),
    )
    return path


@pytest.mark.parametrize("layout", [ONE_DEVICE, MESH], ids=["1dev", "dp2_fsdp2_tp2"])
def test_a_reward_model_scores_each_sequence_at_its_last_token(tmp_path, layout):
    judge = _reward_run(tmp_path / "judge")
    cfg = config.load(
        None, [*RUN, *layout, f"data.sources={_prompts(tmp_path)}", f"train.reward={judge}"]
    )
    devices = jax.devices()[: 1 if layout is ONE_DEVICE else 8]
    mesh = sharding.make_mesh(cfg.mesh, devices)
    held = companions.resolve_others(cfg, objectives.from_config(cfg))
    assert list(held) == ["reward_model"]
    state = SimpleNamespace(others=companions.load(held, mesh))
    roll = Rollouts(cfg, mesh, sharding.named(mesh, BATCH_AXES), slice(None))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 256, n).astype(np.int32) for n in rng.integers(3, 24, 16)]
    got = roll._rewards(state, None, None, seqs)

    model = build(config.load(judge / "config.yaml").model, 3)  # the same weights
    tokens = np.zeros((16, 24), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    want = score(model, jnp.asarray(tokens), jnp.asarray([len(s) for s in seqs]))
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)


def test_grpo_takes_a_reward_model_and_refuses_a_language_model(tmp_path, one_device):
    judge = _reward_run(tmp_path / "judge")
    run = tmp_path / "run"
    base = [*RUN, *ONE_DEVICE, f"data.sources={_prompts(tmp_path)}", f"train.reward={judge}"]
    base.append("generate.kv_cache_dtype=int8")  # rollouts decode from a quantized cache too
    train(
        config.load(None, [*base, "train.steps=2", "checkpoint.save_final=true", f"run.dir={run}"])
    )
    m = _metrics(run)
    assert len(m) == 2 and all(np.isfinite(r["reward"]) for r in m)
    assert len({r["reward"] for r in m}) == 2  # a score of the samples, not a constant
    ckpt_dir = checkpoint.checkpoint_dir(run)
    recorded = checkpoint.read_json_item(ckpt_dir, 2, companions.OTHERS_ITEM)
    assert set(recorded) == {"reward_model"}

    bad = config.load(None, [*base, f"train.reward={_lm_run(tmp_path / 'lm')}"])
    with pytest.raises(ConfigError, match="not a reward model"):
        companions.resolve_others(bad, objectives.from_config(bad))


def test_updates_per_rollout_reuse_the_batch_and_resume_between_them(tmp_path, one_device):
    """mu = 2: steps 1-2 train on one rollout, 3-4 on the next; the second update of a rollout
    is off-policy (the ratio moves off 1). A run stopped after step 3, mid-rollout, resumes
    with that rollout's batch from its checkpoint."""
    base = [*RUN, *ONE_DEVICE, f"data.sources={_prompts(tmp_path)}"]
    base += ["train.updates_per_rollout=2", "train.steps=4"]
    straight = tmp_path / "straight"
    train(config.load(None, [*base, f"run.dir={straight}"]))
    m = _metrics(straight)
    assert m[0]["reward"] == m[1]["reward"]
    assert m[2]["reward"] == m[3]["reward"]
    assert m[1]["reward"] != m[2]["reward"]
    assert (
        m[0]["clip_ratio/region_mean"] == 0.0 and m[1]["clip_ratio/region_mean"] > 0.0
    )  # lr 1e-2 moves pi far

    split = tmp_path / "split"
    cut = [*base, f"run.dir={split}"]
    train(config.load(None, [*cut, "train.steps=3", "checkpoint.save_final=true"]))
    train(config.load(None, cut))
    resumed = {r["step"]: r for r in _metrics(split)}
    for r in m[3:]:
        for key in ("loss", "reward", "grad_norm", "clip_ratio/region_mean"):
            assert resumed[r["step"]][key] == r[key], (r["step"], key)


@pytest.mark.parametrize("objective", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_the_same_losses_on_one_device_and_on_a_mesh(tmp_path, request, objective):
    base = [*RUN, f"data.sources={_prompts(tmp_path)}", "train.steps=3", "optim.lr=3e-3"]
    base += ["train.beta=0.05", f"checkpoint.init_from={_lm_run(tmp_path / 'start')}"]
    base += ["train.updates_per_rollout=2"]  # step 2 is off-policy: a loss far from 0
    if objective == "ppo":
        base += ["train.objective=ppo", "model.value_head=true"]
    losses = {}
    for name, layout in (("mesh", MESH), ("one", ONE_DEVICE)):
        if name == "one":
            request.getfixturevalue("one_device")
        run = tmp_path / name
        train(config.load(None, [*base, *layout, f"run.dir={run}"]))
        losses[name] = [
            (r["loss"], r["grad_norm"], r.get("reward", r.get("reward_mean")), r["kl"])
            for r in _metrics(run)
        ]
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=2e-5, atol=1e-7)
    assert min(kl for *_, kl in losses["one"][1:]) > 0


def _lm_run(path):
    return _reward_run(path, ["model.head=lm"])

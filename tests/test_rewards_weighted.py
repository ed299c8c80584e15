"""GRPO / PPO rewards beyond one function: a process reward model scoring each step of a
completion (min, mean or last of the steps' probabilities), and `train.rewards`, a weighted
list of functions and models whose every term's mean is logged by name."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rollouts import ONE_DEVICE, RUN, _metrics, _prompts, _reward_run, one_device  # noqa: F401

from jaxllm import cli, config, objectives, sharding
from jaxllm.data.stepwise import encode_solution
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.model import build
from jaxllm.objectives.rollout.sampling import Rollouts
from jaxllm.train import companions
from jaxllm.train.step import BATCH_AXES

BASE = [a for a in RUN if not a.startswith("train.reward=")]  # train.rewards replaces it
PRM = ["train.objective=prm", "data.sources=[{path: steps.jsonl, format: stepwise}]"]


def _rollouts(cfg):
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    held = companions.resolve_others(cfg, objectives.from_config(cfg))
    state = SimpleNamespace(others=companions.load(held, mesh))
    return Rollouts(cfg, mesh, sharding.named(mesh, BATCH_AXES), slice(None)), state, held


@pytest.mark.parametrize("aggregate", ["min", "mean", "last"])
def test_a_process_reward_model_scores_each_step(tmp_path, aggregate):
    """The reward of a PRM run equals its step probabilities, read at each step's separator
    of the solution laid out as training lays it out, aggregated."""
    judge = _reward_run(tmp_path / "judge", PRM)
    terms = f"train.rewards=[{{model: {judge}, aggregate: {aggregate}}}]"
    cfg = config.load(None, [*BASE, *ONE_DEVICE, f"data.sources={_prompts(tmp_path)}", terms])
    roll, state, held = _rollouts(cfg)
    assert list(held) == ["reward_model_0"]
    tok = make_tokenizer(cfg.data)
    texts = ["ab\ncd", "x", "\n\nyz\n", "", "p\nq\nr"] + ["s"] * 11
    prompts = [SimpleNamespace(prompt=f"q{i}:", answer="") for i in range(16)]
    out = SimpleNamespace(tokens=[tok.encode(t) for t in texts])
    got = roll._rewards(state, prompts, out, [np.zeros(3, np.int32)] * 16)

    model = build(config.load(judge / "config.yaml").model, 3)  # the same weights
    for i, (p, text) in enumerate(zip(prompts, texts)):
        steps = [s for s in text.split("\n") if s.strip()]
        ids, labels = encode_solution(tok, p.prompt, steps, None, cfg.data.add_bos)
        probs = jax.nn.sigmoid(model(jnp.asarray(ids)[None]).logits[0, :, 0])
        at = np.asarray(probs)[labels >= 0]
        assert len(at) == len(steps)
        want = {"min": at.min, "mean": at.mean, "last": lambda: at[-1]}[aggregate]() if steps else 0
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)
    assert got[3] == 0.0 and len({round(g, 6) for g in got[:5]}) > 2


def lowercase_share(prompts, completions, answers):
    return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


def test_weighted_rewards_train_grpo_and_log_each_mean(tmp_path, one_device):  # noqa: F811
    """`jaxllm train` with a function, a built-in and a PRM, weighted: each term's mean is
    logged as rewards/<name>/mean and reward_mean is their weighted sum."""
    judge = _reward_run(tmp_path / "judge", PRM)
    terms = (
        f"train.rewards=[{{fn: {__name__}:lowercase_share, weight: 1.0}}, "
        f"{{fn: exact_match, weight: -0.5}}, {{model: {judge}, weight: 0.25}}]"
    )
    run = tmp_path / "run"
    args = [*BASE, *ONE_DEVICE, f"data.sources={_prompts(tmp_path)}", terms, "train.steps=2"]
    assert cli.main(["train", *args, f"run.dir={run}"]) == 0
    rows = _metrics(run)
    assert len(rows) == 2
    for r in rows:
        parts = [r[f"rewards/{n}/mean"] for n in ("lowercase_share", "exact_match", "judge")]
        assert 0 < parts[2] < 1 and parts[0] > 0
        want = parts[0] - 0.5 * parts[1] + 0.25 * parts[2]
        assert r["reward_mean"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert rows[0]["rewards/judge/mean"] != rows[1]["rewards/judge/mean"]


def test_a_prm_as_the_one_reward_takes_the_lowest_step(tmp_path):
    judge = _reward_run(tmp_path / "judge", PRM)
    base = [*BASE, *ONE_DEVICE, f"data.sources={_prompts(tmp_path)}"]
    one = _rollouts(config.load(None, [*base, f"train.reward={judge}"]))
    listed = _rollouts(config.load(None, [*base, f"train.rewards=[{{model: {judge}}}]"]))
    tok = make_tokenizer(config.load(None, base).data)
    prompts = [SimpleNamespace(prompt=f"q{i}:", answer="") for i in range(16)]
    out = SimpleNamespace(tokens=[tok.encode(f"a{i}\nb\nc{i}") for i in range(16)])
    seqs = [np.zeros(3, np.int32)] * 16
    assert list(one[2]) == ["reward_model"]
    np.testing.assert_array_equal(
        one[0]._rewards(one[1], prompts, out, seqs),
        listed[0]._rewards(listed[1], prompts, out, seqs),
    )


@pytest.mark.parametrize(
    "rewards, message",
    [
        ("[{fn: exact_match, weight: 1.0}, {fn: m:f, weight: -1.0}]", "sum to 0"),
        ("[{fn: exact_match, model: d}]", "either fn (a function) or model"),
        ("[{fn: exact_match, aggregate: mean}]", "aggregate belongs to a process reward"),
        ("[{fn: exact_match}, {fn: regex:a, weight: 2}, {fn: m:exact_match}]", "exact_match"),
    ],
)
def test_bad_reward_lists_are_one_line_and_exit_2(tmp_path, capsys, rewards, message):
    args = [*BASE, *ONE_DEVICE, f"data.sources={_prompts(tmp_path)}", f"train.rewards={rewards}"]
    assert cli.main(["train", *args, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxllm: ") and message in err[-1], err


def test_reward_and_rewards_together_and_misplaced_aggregates_are_refused(tmp_path, capsys):
    both = ["train.reward=regex:a", "train.rewards=[{fn: exact_match}]"]
    args = [*BASE, *ONE_DEVICE, f"data.sources={_prompts(tmp_path)}"]
    assert cli.main(["train", *args, *both, f"run.dir={tmp_path / 'run'}"]) == 2
    assert "train.reward and train.rewards both" in capsys.readouterr().err
    outcome = _reward_run(tmp_path / "rm")
    cfg = config.load(None, [*args, f"train.rewards=[{{model: {outcome}, aggregate: last}}]"])
    with pytest.raises(config.ConfigError, match="outcome reward model"):
        _rollouts(cfg)
    chat = f"data.sources={_prompts(tmp_path, chat=True)}"
    prm = _reward_run(tmp_path / "prm", PRM)
    cfg = config.load(None, [*BASE, *ONE_DEVICE, chat, f"train.reward={prm}"])
    with pytest.raises(config.ConfigError, match="scores string prompts"):
        _rollouts(cfg)
    assert json.loads(json.dumps(list(cfg.train.rewards))) == []

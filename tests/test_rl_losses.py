"""The critic-free family beyond GRPO: REINFORCE++'s advantages against a transcription of the
paper's formula, DAPO's overlong punishment against TRL's, dynamic sampling, the presets of
`train.grpo`, the refusals, and each objective training a few steps through `train`."""

import numpy as np
import pytest
from test_rollouts import (
    MESH,
    ONE_DEVICE,
    RUN,
    _lm_run,
    _metrics,
    _prompts,
    one_device,  # noqa: F401  (a fixture the mesh test asks for)
)
from trl.rewards import get_soft_overlong_punishment

from jaxllm import config
from jaxllm.cli import main
from jaxllm.config import ConfigError
from jaxllm.config.grpo import settings
from jaxllm.objectives.rollout import advantages, critic_free
from jaxllm.train.loop import train

pytestmark = pytest.mark.torch


def test_reinforce_pp_advantages_follow_the_paper():
    """Hu 2025, eqs. 4-6, one loop per token: r_t = -beta KL_t (+ the score at the last token),
    the return G_t = sum_{s >= t} r_s, then (G - mean) / std over the batch's tokens."""
    rng = np.random.default_rng(0)
    mask = np.zeros((5, 7), np.int32)
    for i, (a, n) in enumerate(zip(rng.integers(0, 3, 5), rng.integers(1, 5, 5))):
        mask[i, a : a + n] = 1
    kl, scores, beta = rng.normal(0, 0.3, (5, 7)), rng.uniform(0, 1, 5), 0.1
    returns, values = np.zeros((5, 7)), []
    for i in range(5):
        where = list(np.nonzero(mask[i])[0])
        for t in where:
            returns[i, t] = sum(-beta * kl[i, s] for s in where if s >= t) + scores[i]
            values.append(returns[i, t])
    mean, std = np.mean(values), np.std(values)
    want = np.where(mask, (returns - mean) / (std + 1e-8), 0.0)
    got = advantages.reinforce_pp_advantages(scores, kl, mask, beta)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_overlong_punishment_equals_trl():
    lengths = np.arange(0, 21)
    theirs = get_soft_overlong_punishment(20, 6)([[1] * n for n in lengths])
    np.testing.assert_allclose(advantages.overlong_penalties(lengths, 20, 6, 1.0), theirs)
    np.testing.assert_array_equal(advantages.overlong_penalties(lengths, 20, 0, 1.0), 0.0)


def test_dynamic_sampling_keeps_varied_groups_and_fills_the_batch():
    def rows(rewards):  # (id, reward) per row
        return [(f"{r}-{i}", r) for i, r in enumerate(rewards)]

    first = rows([1, 1, 0, 1, 0, 0])  # groups of 2: [1, 1] and [0, 0] are dropped
    rounds = {1: rows([2, 2, 3, 4, 5, 5]), 2: rows([7, 8, 9, 9, 6, 1])}
    asked = []

    def more(j):
        asked.append(j)
        return rounds[j]

    def score(rows_):
        return [r for _, r in rows_]

    got = critic_free.refill(first, more, 2, 4, score)
    assert [r for _, r in got] == [0, 1, 3, 4, 7, 8] and asked == [1, 2]
    # out of rounds: the rest are dropped groups, in their order
    got = critic_free.refill(first, lambda j: rows([5, 5] * 3), 2, 1, score)
    assert [r for _, r in got] == [0, 1, 1, 1, 0, 0]


def _train_section(*overrides):
    return config.load(None, [f"data.sources={ROLLOUT}", *overrides]).train


ROLLOUT = "[{path: prompts.jsonl, format: rollout}]"
LAYOUT = ["mesh.data=1", "mesh.fsdp=-1"]


def test_presets_and_explicit_keys():
    s = settings(_train_section("train.objective=dapo", "train.max_completion_tokens=40"))
    assert (s.loss_type, s.epsilon_low, s.epsilon_high) == ("dapo", 0.2, 0.28)
    assert s.dynamic_sampling and s.overlong_buffer == 10
    s = settings(_train_section("train.objective=gspo"))
    assert (s.level, s.epsilon_low, s.epsilon_high) == ("sequence", 3e-4, 4e-4)
    s = settings(_train_section("train.objective=gspo", "train.clip_epsilon=0.1"))
    assert (s.epsilon_low, s.epsilon_high) == (0.1, 0.1)
    s = settings(_train_section("train.objective=dr_grpo"))
    assert (s.loss_type, s.scale_rewards) == ("dr_grpo", "none")
    s = settings(_train_section("train.objective=dr_grpo", "train.grpo.scale_rewards=batch"))
    assert s.scale_rewards == "batch"  # an explicit key wins over the preset
    s = settings(_train_section("train.objective=rloo", "train.grpo.epsilon_high=0.3"))
    assert (s.level, s.epsilon_high) == ("sum", 0.3)
    s = settings(_train_section("train.objective=grpo"))
    assert (s.loss_type, s.scale_rewards, s.level, s.dynamic_sampling) == (
        "grpo",
        "group",
        "token",
        False,
    )


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.objective=rloo", "train.num_generations=1"], "at least 2 for rloo"),
        (["train.objective=dapo", "train.num_generations=1"], "at least 2 for dapo"),
        (["train.objective=grpo", "train.grpo.epsilon_high=0.1"], "below the lower clip 0.2"),
        (["train.objective=dapo", "train.clip_epsilon=0.3"], "below the lower clip 0.3"),
        (["train.objective=grpo", "train.grpo_normalization=dr_grpo"], "now train.grpo"),
        (["train.objective=ppo", "train.grpo.epsilon_high=0.3"], "has no effect"),
        (["train.objective=rloo", "train.grpo.scale_rewards=batch"], "belongs to grpo"),
        (["train.objective=reinforce_pp", "train.grpo.dynamic_sampling=true"], "has no effect"),
        (["train.objective=grpo", "train.grpo.overlong_buffer=100"], "overlong_buffer must"),
        (["train.objective=grpo", "train.grpo.loss_type=ppo"], "loss_type"),
    ],
)
def test_refusals(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config.load(None, [f"data.sources={ROLLOUT}", *overrides]).validate(1)


@pytest.mark.parametrize(
    "bad", [["train.num_generations=1"], ["train.grpo.epsilon_high=0.1"]], ids=["g1", "eps"]
)
def test_refusals_are_one_line_and_exit_2(capsys, bad):
    code = main(["train", f"data.sources={ROLLOUT}", "train.objective=rloo", *bad])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("jaxllm: ") and "\n" not in err, err


@pytest.mark.parametrize(
    "objective,extra",
    [
        ("rloo", []),
        ("reinforce_pp", ["train.num_generations=2"]),
        ("gspo", []),
        ("dapo", ["train.grpo.mask_truncated_completions=true"]),
        ("dr_grpo", []),
    ],
)
def test_each_objective_trains(tmp_path, objective, extra):
    run = tmp_path / "run"
    base = [*RUN, *LAYOUT, f"data.sources={_prompts(tmp_path)}", "train.steps=3"]
    base += [f"train.objective={objective}", "train.updates_per_rollout=2", *extra]
    train(config.load(None, [*base, f"run.dir={run}"]))
    m = _metrics(run)
    assert [r["step"] for r in m] == [1, 2, 3]
    for key in ("loss", "reward", "reward_std", "clip_ratio/region_mean", "grad_norm"):
        assert all(np.isfinite(r[key]) for r in m), key
    assert all(0 < r["completions/mean_length"] <= 7 for r in m)
    assert m[0]["clip_ratio/region_mean"] == 0.0  # on-policy: the ratio is 1
    assert all(0 <= r["completions/clipped_ratio"] <= 1 for r in m)


def test_kl_in_the_reward_under_lora(tmp_path):
    """RLOO and REINFORCE++ read the reference (the base with the adapters off) when their
    batches are made: at step 1 the policy is the reference, so the rollout's KL is 0."""
    for objective in ("reinforce_pp", "rloo"):
        run = tmp_path / objective
        overrides = [
            *RUN,
            *LAYOUT,
            f"data.sources={_prompts(tmp_path)}",
            f"train.objective={objective}",
        ]
        overrides += ["peft.method=lora", "peft.targets=[q_proj, v_proj, o_proj]"]
        overrides += ["train.beta=0.1", "train.steps=4", "optim.lr=3e-2", f"run.dir={run}"]
        train(config.load(None, overrides))
        m = _metrics(run)
        assert m[0]["kl"] == pytest.approx(0.0, abs=1e-6)
        assert abs(m[-1]["kl"]) > 1e-4, (objective, [r["kl"] for r in m])


@pytest.mark.slow
def test_rloo_with_a_reference_on_a_mesh_equals_one_device(tmp_path, request):
    base = [*RUN, f"data.sources={_prompts(tmp_path)}", "train.steps=3", "optim.lr=3e-3"]
    base += ["train.objective=rloo", "train.beta=0.05", "train.updates_per_rollout=2"]
    base += [f"checkpoint.init_from={_lm_run(tmp_path / 'start')}"]
    losses = {}
    for name, layout in (("mesh", MESH), ("one", ONE_DEVICE)):
        if name == "one":
            request.getfixturevalue("one_device")
        train(config.load(None, [*base, *layout, f"run.dir={tmp_path / name}"]))
        keys = ("loss", "grad_norm", "reward", "kl")
        losses[name] = [[r[k] for k in keys] for r in _metrics(tmp_path / name)]
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=2e-5, atol=1e-7)
    # steps 1-2 train on a rollout of the reference itself (KL 0); step 3's is sampled after
    assert abs(losses["one"][0][3]) < 1e-6 and abs(losses["one"][2][3]) > 1e-6


@pytest.mark.slow
def test_a_resumed_dapo_run_makes_the_same_batches(tmp_path):
    """Dynamic sampling's extra rounds are seeded by the rollout number: a run stopped after
    step 3 and resumed logs the uninterrupted run's steps 4-5 bit for bit."""
    base = [*RUN, *LAYOUT, f"data.sources={_prompts(tmp_path)}", "train.steps=5"]
    base += ["train.objective=dapo", "train.num_generations=2"]
    straight = tmp_path / "straight"
    train(config.load(None, [*base, f"run.dir={straight}"]))
    split = tmp_path / "split"
    cut = [*base, f"run.dir={split}"]
    train(config.load(None, [*cut, "train.steps=3", "checkpoint.save_final=true"]))
    train(config.load(None, cut))
    resumed = {r["step"]: r for r in _metrics(split)}
    for r in _metrics(straight)[3:]:
        for key in ("loss", "reward", "grad_norm", "completions/mean_length"):
            assert resumed[r["step"]][key] == r[key], (r["step"], key)

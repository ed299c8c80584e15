"""One step off-policy rollouts (`train.rollout_ahead=1`): with a zero update the same run as
the synchronous one; otherwise each rollout is sampled from the parameters before the update
it overlaps, pi_old is that sampling policy's, and a resumed run is bit-identical (the next
rollout travels in the checkpoint)."""

import pytest
from test_rollouts import ONE_DEVICE, RUN, _metrics, _prompts

from jaxllm import config
from jaxllm.config import ConfigError
from jaxllm.objectives.rollout.sampling import Rollouts
from jaxllm.train.loop import train

KEYS = ("loss", "reward", "grad_norm", "completions/mean_length", "clip_ratio/region_mean")


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
    import jax

    first = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *a: first)


def _run(tmp_path, name, *overrides):
    run = tmp_path / name
    base = [*RUN, *ONE_DEVICE, f"data.sources={_prompts(tmp_path)}", f"run.dir={run}"]
    train(config.load(None, [*base, *overrides]))
    return _metrics(run)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.objective=grpo", "train.rollout_ahead=2"], "must be 0 .on-policy. or 1"),
        (
            ["train.objective=sft", "data.sources=[{path: x, format: prompt_completion}]"]
            + ["train.rollout_ahead=1"],
            "train.rollout_ahead has no effect",
        ),
    ],
)
def test_config_refusals(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg = config.load(None, [f"data.sources={_prompts(tmp_path)}", *overrides])
        cfg.validate(1)


def test_a_process_must_hold_whole_groups(tmp_path):
    cfg = config.load(None, [*RUN, f"data.sources={_prompts(tmp_path)}"])  # G = 4 of 16 rows
    with pytest.raises(ConfigError, match="splits a group of train.num_generations=4"):
        Rollouts(cfg, None, None, slice(2, 10))


def test_with_a_zero_update_it_is_the_synchronous_run(tmp_path):
    """lr = 0: the parameters never move, so rollout k sampled one update early is rollout k."""
    steps = ["train.steps=3", "optim.lr=0"]
    sync = _run(tmp_path, "sync", *steps)
    ahead = _run(tmp_path, "ahead", *steps, "train.rollout_ahead=1")
    assert [[r[k] for k in KEYS] for r in ahead] == [[r[k] for k in KEYS] for r in sync]
    assert len({r["reward"] for r in sync}) == 3  # three different rollouts


def test_pi_old_is_the_sampling_policy_and_a_resume_is_bit_identical(tmp_path):
    """Step 1 trains rollout 0 on the parameters that sampled it (ratio 1, nothing clipped);
    step 2 trains rollout 1, sampled from the same parameters while step 1 ran, on the updated
    ones: ratio off 1. A run stopped after step 3 resumes with rollout 3 from its checkpoint
    (sampled before step 3 updated the parameters) and repeats step 4 exactly."""
    common = ["train.rollout_ahead=1", "train.clip_epsilon=0.01"]
    m = _run(tmp_path, "straight", *common, "train.steps=4")
    clipped = [r["clip_ratio/region_mean"] for r in m]
    assert clipped[0] == 0.0 and min(clipped[1:]) > 0.0
    first = _run(tmp_path, "split", *common, "train.steps=3", "checkpoint.save_final=true")
    assert [[r[k] for k in KEYS] for r in first] == [[r[k] for k in KEYS] for r in m[:3]]
    resumed = {r["step"]: r for r in _run(tmp_path, "split", *common, "train.steps=4")}
    assert [resumed[4][k] for k in KEYS] == [m[3][k] for k in KEYS]


@pytest.mark.slow
def test_grpo_one_step_off_policy_raises_a_reward(tmp_path):
    m = _run(tmp_path, "run", "train.rollout_ahead=1", "train.steps=16")
    first = sum(r["reward"] for r in m[:4]) / 4
    last = sum(r["reward"] for r in m[-4:]) / 4
    assert last > first + 0.05, (first, last)

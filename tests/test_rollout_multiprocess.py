"""GRPO / PPO rollouts over several processes: each process samples and scores its own rows
(whole groups), with a sampling key per row, so two processes (gloo on 127.0.0.1, as in
`test_sharding`) make the same batches and the same steps as one."""

import json

import jax
import numpy as np
import pytest
from conftest import tiny_model
from test_rollouts import ONE_DEVICE, RUN
from test_rollouts import _prompts as _rollout_prompts
from test_sharding import REPO, _free_port, _jaxllm_train

from jaxllm import config, sharding
from jaxllm.config import GenerateConfig
from jaxllm.infer import generate
from jaxllm.model import build, split_peft
from jaxllm.objectives.rollout.sampling import Rollouts, _Weights
from jaxllm.train.step import BATCH_AXES


def test_a_rows_seed_makes_its_sample_independent_of_the_batch():
    """Per-row seeds: a prompt's completion is the same alone, first, or last in a batch, so
    however the rows are split over processes; one seed for the batch would not do that."""
    model = build(tiny_model(init_std=0.5), seed=0)
    gen = GenerateConfig(max_new_tokens=8, temperature=1.0)
    prompts, seeds = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [11, 22, 33]
    batch = generate(model, prompts, gen, seeds=seeds).tokens
    assert generate(model, prompts[2:], gen, seeds=seeds[2:]).tokens == batch[2:]
    assert generate(model, prompts[::-1], gen, seeds=seeds[::-1]).tokens == batch[::-1]
    other = generate(model, prompts, gen, seeds=[11, 22, 34]).tokens
    assert other[:2] == batch[:2] and other[2] != batch[2]


def test_a_processs_rows_are_those_rows_of_the_whole_rollout(tmp_path):
    """What each of two processes samples and scores (rows 0-7 and 8-15, two groups of 4 each)
    is those rows of the rollout one process makes of all 16: the same prompts, completions
    and rewards."""
    cfg = config.load(None, [*RUN, *ONE_DEVICE, f"data.sources={_rollout_prompts(tmp_path)}"])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    batch_sh = sharding.named(mesh, BATCH_AXES)
    weights = _Weights(*split_peft(build(cfg.model, 0), None)[1:])
    seqs, scores, rows = Rollouts(cfg, mesh, batch_sh, slice(0, 16))._sample(1, weights)
    assert len({tuple(s) for s in seqs}) > 4  # samples, not one completion per prompt
    for part in (slice(0, 8), slice(8, 16)):
        own = Rollouts(cfg, mesh, batch_sh, part)._sample(1, weights)
        assert [s.tolist() for s in own[0]] == [s.tolist() for s in seqs[part]]
        np.testing.assert_array_equal(own[1][0], scores[0][part])  # (rewards, PRM rows)
        for key, value in rows.items():
            np.testing.assert_array_equal(own[2][key], value[part], err_msg=key)


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(10):
            f.write(json.dumps({"prompt": f"q{i}:", "answer": ""}) + "\n")
    return f"[{{path: {path}, format: rollout}}]"


# three processes compiling a train step each: minutes on a busy 2-core machine
@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["train.rollout_ahead=1"],
        ["train.objective=ppo", "model.value_head=true"],
    ],
    ids=["grpo_ahead", "ppo"],
)
def test_two_processes_make_the_rollouts_of_one(tmp_path, extra):
    common = [
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
        "train.objective=grpo",
        "train.beta=0",
        "train.global_batch_size=8",
        "train.num_generations=4",
        "train.max_completion_tokens=6",
        # test_grpo's reward (its module imports no test helpers: a `jaxllm train` loads it)
        f"train.reward={REPO / 'tests' / 'test_grpo.py'}:lowercase_share",
        "train.sample_tokens=0",
        "train.steps=3",
        "train.log_every=1",
        "train.eval_every=0",
        "optim.lr=1e-2",
        "optim.warmup_steps=0",
        "mesh.data=-1",
        f"data.sources={_prompts(tmp_path)}",
        *extra,
    ]
    port = _free_port()
    procs = [
        _jaxllm_train(
            [*common, f"run.dir={tmp_path / 'multi'}"],
            devices=1,
            extra_env={
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
            },
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert "in 2 processes" in outs[0]
    single = _jaxllm_train([*common, f"run.dir={tmp_path / 'single'}"], devices=1)
    out = single.communicate(timeout=600)[0]
    assert single.returncode == 0, out

    def metrics(run):
        rows = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r) for r in rows]

    multi, one = metrics("multi"), metrics("single")
    assert len(multi) == len(one) == 3
    # the same samples (the means differ in the order of their sums over devices at most)
    assert [r["completion_length"] for r in multi] == [r["completion_length"] for r in one]
    assert len({r["reward_mean"] for r in one}) == 3
    for key in ("reward_mean", "loss", "grad_norm"):
        got, want = [r[key] for r in multi], [r[key] for r in one]
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7, err_msg=key)

"""The DPO family trains through `jaxllm.train.loop.train` on a learnable synthetic preference set
(every prompt prefers " yes" to " no"): the loss falls and the reward accuracy rises, with the
step counting pairs, and evaluation reports the preference loss."""

import json
import math

import jax
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm import config, sharding
from jaxllm.data.pipeline import load_splits
from jaxllm.train.loop import compile_steps, to_global, train
from jaxllm.train.state import init_state, layout

RUN = [
    "data.seq_len=32",
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.vocab_size=320",
    "model.dtype=float32",
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "optim.lr=3e-3",
    "optim.warmup_steps=0",
    "checkpoint.save_final=false",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


def pairs_file(tmp_path, n=64):
    records = [{"prompt": f"q{i % 7}:", "chosen": " yes", "rejected": " no"} for i in range(n)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "kind,beta", [("simpo", 2.0), pytest.param("orpo", 0.5, marks=pytest.mark.slow)]
)
def test_reference_free_losses_learn_a_preference(tmp_path, kind, beta):
    source = f"[{{path: {pairs_file(tmp_path)}, format: preference}}]"
    run = tmp_path / "run"
    overrides = [*RUN, f"data.sources={source}", f"data.eval_sources={source}"]
    overrides += [f"train.objective={kind}", f"train.beta={beta}", "train.steps=10"]
    train(config.load(None, [*overrides, f"run.dir={run}"]))
    rows = run_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 11))
    # 32 slots hold two pairs of 6 + 5 predictions each: 16 pairs per batch of 8 rows
    assert all(r["tokens"] == 16 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.05
    assert rows[0]["rewards/accuracies"] < 1 and rows[-1]["rewards/accuracies"] == 1
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    for r in rows:
        margin = r["rewards/chosen"] - r["rewards/rejected"]
        assert math.isclose(r["rewards/margins"], margin, rel_tol=1e-4, abs_tol=1e-6)
    # the eval batch is a training batch here: its loss is the preference loss, near the last
    assert abs(rows[-1]["eval_loss"] - rows[-1]["loss"]) < 0.05


def _steps(cfg, devices, batches):
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    metrics = []
    for batch in batches:
        state, m = step(state, to_global(batch, batch_sh))
        metrics.append({k: float(v) for k, v in m.items()})
    return metrics, state


@pytest.mark.parametrize("kind", ["simpo"])
def test_one_device_equals_data_fsdp_tensor_parallel(tmp_path, kind):
    """The same preference steps on 1 device and on data 2 x fsdp 2 x tensor 2: equal losses,
    rewards and parameters (pairs never straddle the batch split: a pair lives in one row)."""
    src = config.SourceConfig(path=str(pairs_file(tmp_path)), format="preference")
    data = config.DataConfig(sources=(src,), eval_sources=(src,), seq_len=32)
    rows = load_splits(data)[0]
    batches = [
        {k: np.stack([rows[(8 * b + i) % len(rows)][k] for i in range(8)]) for k in rows[0]}
        for b in range(3)
    ]

    def cfg(**mesh):
        return config.Config(
            model=tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128),
            mesh=config.MeshConfig(**{"data": 1, **mesh}),
            data=data,
            train=config.TrainConfig(global_batch_size=8, steps=3, objective=kind, beta=2.0),
            optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
        )

    want, one = _steps(cfg(), jax.devices()[:1], batches)
    got, many = _steps(cfg(data=2, fsdp=2, tensor=2), jax.devices(), batches)
    for w, g in zip(want, got):
        for name in ("loss", "rewards/margins", "rewards/chosen", "logps/rejected", "tokens"):
            np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert want[-1]["loss"] < want[0]["loss"]
    for a, b in zip(jax.tree.leaves(many.params), jax.tree.leaves(jax.device_get(one.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)

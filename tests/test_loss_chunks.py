"""`train.loss_chunks`: the LM head and cross-entropy in chunks of the sequence give the same
loss and gradients with less memory, on one device, sharded, and through pipeline stages."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.config import ConfigError
from jaxllm.model import build
from jaxllm.objectives import mlm, next_token
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout


def _batch(b, l, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "inputs": jnp.asarray(rng.integers(0, vocab, (b, l)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, vocab, (b, l)), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l)),
        "segment_ids": jnp.ones((b, l), jnp.int32),
        "loss_mask": jnp.asarray(rng.integers(0, 2, (b, l)), jnp.int32),
    }


@pytest.mark.parametrize(
    "make,model",
    [
        (next_token, dict(tie_embeddings=False, final_soft_cap=5.0)),
        (next_token, dict(tie_embeddings=True)),
        (mlm, dict(kind="encoder", position="learned")),
    ],
    ids=["untied-softcap", "tied", "encoder-mlm"],
)
def test_chunks_give_the_same_loss_and_gradients(make, model):
    cfg = tiny_model(vocab_size=97, **model)
    gd, params, rest = nnx.split(build(cfg), nnx.Param, ...)
    batch = _batch(3, 24, 97)

    @jax.jit
    def value_and_grad(params):
        def loss(params, chunks):
            out = make(0.1, loss_chunks=chunks)(nnx.merge(gd, params, rest), batch, None)
            return out.loss_sum, out.metrics["z_loss"]

        return [jax.value_and_grad(loss, has_aux=True)(params, c) for c in (1, 2, 8)]

    ((want, want_z), want_g), *chunked = value_and_grad(params)
    for (got, got_z), got_g in chunked:
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(got_z, want_z, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _cfg(chunks=1, **mesh) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=4096, d_model=32, num_layers=2),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=64),
        train=config.TrainConfig(global_batch_size=8, steps=2, loss_chunks=chunks),
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0),
    )


def _steps(cfg, devices, steps=2):
    mesh = sharding.make_mesh(cfg.validate(len(devices)).mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    batch = to_global(synthetic_batch(cfg), batch_sh)
    temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, temp


def test_chunks_cut_the_step_memory_by_the_logits():
    """At a vocabulary of 4096 the [8, 64, 4096] float32 logits (8 MiB, and as much for their
    gradient) dominate the step's temporaries; 8 chunks keep one eighth of them."""
    devices = jax.devices()[:1]
    losses, temp = _steps(_cfg(1), devices)
    chunked, chunked_temp = _steps(_cfg(8), devices)
    np.testing.assert_allclose(chunked, losses, rtol=1e-5)
    logits_bytes = 8 * 64 * 4096 * 4
    assert temp - chunked_temp > logits_bytes, (temp, chunked_temp)


@pytest.mark.parametrize(
    "mesh",
    [
        # ~16 s each; the chunked loss is a per-row computation the one-device cases above check
        pytest.param(dict(data=2, fsdp=2, tensor=2), marks=pytest.mark.slow),
        pytest.param(dict(stage=2, data=2, tensor=2), marks=pytest.mark.slow),
    ],
    ids=["dp-fsdp-tp", "pp2"],
)
def test_chunks_sharded_and_pipelined_match_one_device(mesh):
    want, _ = _steps(_cfg(1), jax.devices()[:1])
    cfg = _cfg(4, **mesh)
    if mesh.get("stage"):
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=4))
    got, _ = _steps(cfg, jax.devices())
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["train.loss_chunks=0"], "loss_chunks must be >= 1"),
        (["train.loss_chunks=3", "data.seq_len=64"], "must divide data.seq_len"),
    ],
)
def test_refusals(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        config.load(None, overrides).validate(1)


def test_refused_for_objectives_that_do_not_read_it():
    from jaxllm.config.train import validate_train

    for objective in ("dpo", "reward", "grpo", "distill"):
        with pytest.raises(ConfigError, match=f"no effect with train.objective={objective}"):
            validate_train(config.TrainConfig(objective=objective, loss_chunks=2))

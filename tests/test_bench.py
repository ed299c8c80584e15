"""The benchmark's FLOP accounting: analytic 6N + attention against XLA's count of the step."""

import dataclasses

import jax
from conftest import tiny_model
from flax import nnx

from jaxllm import config, sharding
from jaxllm.bench import compiled_step_flops
from jaxllm.metrics import flops_per_token, param_counts, peak_flops
from jaxllm.model import build


def _cfg(**model) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=258, d_model=64, mlp_dim=192, num_layers=3, **model),
        mesh=config.MeshConfig(data=1),
        data=config.DataConfig(seq_len=64),
        train=config.TrainConfig(global_batch_size=4),
    )


def test_param_count_matches_the_model():
    for tie in (False, True):
        cfg = _cfg(tie_embeddings=tie)
        state = nnx.state(build(cfg.model), nnx.Param)
        actual = sum(x.size for x in jax.tree.leaves(state))
        assert param_counts(cfg.model)["total"] == actual


def test_compiled_flops_within_10_percent_of_analytic_without_remat():
    cfg = _cfg(remat="none")
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    analytic = flops_per_token(cfg.model, cfg.data.seq_len)["total"] * 4 * 64
    ratio = compiled_step_flops(cfg, mesh) / analytic
    assert 0.9 <= ratio <= 1.1, ratio


def test_full_remat_adds_a_forward_pass_of_flops():
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    none = compiled_step_flops(_cfg(remat="none"), mesh)
    full = compiled_step_flops(_cfg(remat="full"), mesh)
    assert 1.15 < full / none < 1.45  # ideal 4/3: forward recomputed in the backward pass


def test_grad_accumulation_counts_every_microbatch():
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    cfg = _cfg()
    accum = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=2))
    one, two = compiled_step_flops(cfg, mesh), compiled_step_flops(accum, mesh)
    assert abs(two / one - 1) < 0.05


def test_peak_flops_table():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("TPU v5 lite") == 197e12
    assert peak_flops("TPU v5p") == 459e12
    assert peak_flops("cpu") is None

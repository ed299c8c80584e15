"""`jaxllm prune --method slicegpt`: the rotation with its norm scales folded in leaves the
model's function unchanged (any orthogonal Q at S = 0, on an untied and a tied model); slicing
along the calibration stream's principal components loses less than slicing the same number of
raw channels; the sliced run is a plain run with a smaller d_model that evaluates, generates
and exports (docs/compression.md)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import train_for_quantization
from flax import nnx

import jaxllm
from jaxllm.cli import main
from jaxllm.compress import slicegpt
from jaxllm.compress.calibrate import calibration_rows
from jaxllm.config import ModelConfig
from jaxllm.evaluate import evaluate_checkpoint
from jaxllm.model import abstract_model
from jaxllm.model.transformer import build

IDS = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 24)))


def _sliced_logits(model, q, ids=IDS):
    """The logits of `model` rotated by q [d, d'] and sliced, built as a d'-wide model."""
    m = model.cfg
    _, _, axes = abstract_model(m)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    p = slicegpt.slice_params(params, axes, q, offset=m.norm_offset, tied=m.tie_embeddings)
    cfg = dataclasses.replace(
        m, d_model=q.shape[1], head_dim=m.resolved_head_dim, tie_embeddings=False
    )
    new = build(cfg, 0)
    graphdef, state = nnx.split(new, nnx.Param)
    nnx.replace_by_pure_dict(state, p)
    return np.asarray(nnx.merge(graphdef, state, nnx.state(new, nnx.Not(nnx.Param)))(ids).logits)


@pytest.mark.parametrize("tied,offset", [(False, 0.0), (True, 1.0)])
def test_rotation_with_folded_norms_keeps_the_function(tied, offset):
    """Random norm scales (Gemma-style offset 1 too) and a random orthogonal Q: the same
    logits, to float rounding."""
    cfg = ModelConfig(
        vocab_size=300, d_model=48, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=96,
        tie_embeddings=tied, norm_offset=offset, init_std=0.2, dtype="float32",
    )  # fmt: skip
    model = build(cfg, 0)
    rng = np.random.default_rng(1)
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "scale") and isinstance(module.scale, nnx.Param):
            module.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, module.scale.shape), jnp.float32)
    q = np.linalg.qr(rng.normal(size=(48, 48)))[0]
    want = np.asarray(model(IDS).logits)
    np.testing.assert_allclose(_sliced_logits(model, q), want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def trained():
    return train_for_quantization()


def test_slicegpt_beats_slicing_raw_channels(trained, tmp_path):
    """--sparsity 0.25 of the trained run: d_model 64 -> 48; its held-out loss is below that of
    the same model with its last 16 raw channels sliced instead (Q = identity), on held-out
    rows (the calibration's first 32 are used; these are its first 8), and the run
    generates and exports."""
    out = tmp_path / "sliced"
    argv = ["prune", str(trained), str(out), "--method", "slicegpt", "--sparsity", "0.25"]
    assert main([*argv, "--samples", "32"]) == 0
    sliced = jaxllm.load_model(out)
    assert (sliced.cfg.d_model, sliced.cfg.head_dim, sliced.cfg.tie_embeddings) == (48, 16, False)
    model = jaxllm.load_model(trained)
    ids = calibration_rows(jaxllm.config.load(trained / "config.yaml"))["inputs"][:8]
    raw = _sliced_logits(model, np.eye(64)[:, :48], jnp.asarray(ids))

    def nll(logits):
        logp = logits[:, :-1] - np.log(np.exp(logits[:, :-1]).sum(-1, keepdims=True))
        return -np.take_along_axis(logp, ids[:, 1:, None], -1).mean()

    full = np.asarray(model(jnp.asarray(ids)).logits)
    got = np.asarray(sliced(jnp.asarray(ids)).logits)
    assert nll(got) - nll(full) < nll(raw) - nll(full), (nll(full), nll(got), nll(raw))
    assert evaluate_checkpoint(out)["eval_loss"] > 0
    assert main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert main(["convert", "export", str(out), str(tmp_path / "hf")]) == 0

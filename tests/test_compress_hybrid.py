"""Compression of a hybrid model (`model.layer_pattern`, Gated DeltaNet blocks between softmax
ones): the calibrated quantizers and pruners walk its `hybrid_layers` block by block and
rewrite the linear-attention projections too; the structured pruners, which do not know the
linear blocks' shapes, refuse it in one line."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL_RUN

import jaxllm
from jaxllm.bench import write_random_run
from jaxllm.cli import main
from jaxllm.evaluate import evaluate_checkpoint
from jaxllm.model import quantized

HYBRID = [
    "model.layer_pattern=[linear,full]",
    "model.linear_attention.kind=gated_deltanet",
    "model.linear_attention.num_k_heads=2",
    "model.linear_attention.num_v_heads=2",
    "model.linear_attention.k_head_dim=16",
    "model.linear_attention.v_head_dim=16",
    "model.linear_attention.chunk_size=16",
]
LINEAR_PROJ = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("hybrid") / "float"
    argv = ["train", *SMALL_RUN, *HYBRID, "train.steps=60", "optim.lr=1e-2", "train.log_every=30"]
    assert main([*argv, "train.eval_batches=2", f"run.dir={run}"]) == 0
    return run


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """The hybrid of random weights: the refusals read its config only."""
    run = tmp_path_factory.mktemp("hybrid") / "random"
    return write_random_run(run, overrides=[*SMALL_RUN, *HYBRID])


def _linear_attn(model):
    return model.hybrid_layers.block_0.attn


@pytest.mark.parametrize("method", ["gptq", pytest.param("awq", marks=pytest.mark.slow)])
def test_calibrated_quantizers_rewrite_the_linear_attention_blocks(trained, tmp_path, method):
    out = tmp_path / method
    argv = ["quantize", str(trained), str(out), "--method", method, "--bits", "4"]
    assert main([*argv, "--samples", "8"]) == 0
    model = jaxllm.load_model(out)
    for name in LINEAR_PROJ:
        assert isinstance(getattr(_linear_attn(model), name).get_value(), quantized.QuantizedTensor)
    assert isinstance(
        model.hybrid_layers.block_1.attn.q_proj.get_value(), quantized.QuantizedTensor
    )
    base, got = evaluate_checkpoint(trained)["eval_loss"], evaluate_checkpoint(out)["eval_loss"]
    assert np.isfinite(got) and got != base
    assert got < base + 0.5, (method, base, got)


def test_wanda_zeroes_half_of_every_linear_attention_projection(trained, tmp_path):
    out = tmp_path / "wanda"
    argv = ["prune", str(trained), str(out), "--method", "wanda", "--sparsity", "0.5"]
    assert main([*argv, "--samples", "8"]) == 0
    attn = _linear_attn(jaxllm.load_model(out))
    for name in LINEAR_PROJ:
        w = np.asarray(getattr(attn, name).get_value())
        assert (w == 0).mean() == pytest.approx(0.5, abs=1e-6), name
    assert np.isfinite(evaluate_checkpoint(out)["eval_loss"])


@pytest.mark.parametrize("method", ["layers", "heads", "channels", "slicegpt"])
def test_structured_pruning_refuses_a_hybrid_in_one_line(untrained, tmp_path, capsys, method):
    out = tmp_path / method
    argv = ["prune", str(untrained), str(out), "--method", method, "--sparsity", "0.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm:") and "layer_pattern" in err[0], err
    assert not out.exists()

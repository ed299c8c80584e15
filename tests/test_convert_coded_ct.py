"""compressed-tensors' own fp8, int8 W8A8 and MXFP4 checkpoints into jaxllm: a tiny Llama
quantized with the library's preset schemes (its `calculate_qparams` scales, compressed and
saved by its `ModelCompressor`, as llm-compressor saves them) imports keeping its codes as the
jaxllm kind each preset is, computes transformers' logits from the same files and exports back
to the library's own tensors; the presets jaxllm cannot run (static FP8 activation scales,
MXFP4 activations) are refused keeping the codes and import with --dequantize."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle import forward
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils import calculate_qparams, helpers
from flax import nnx
from hf_models import hf_logits, hf_model, sample_tokens, stderr_of_failure
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

import jaxllm
from jaxllm import config
from jaxllm.cli import main
from jaxllm.model import coded

# preset -> (quantize.method, fp8_activations) of the run keeping its codes; None: refused
PRESETS = {
    "FP8_DYNAMIC": ("fp8", True),
    "W8A8": ("smoothquant", False),
    "MXFP4A16": ("mxfp4", False),
    "FP8": None,
    "MXFP4": None,
}


def _checkpoint(preset: str, path):
    """A tiny Llama's projections quantized by compressed-tensors' `preset` (the LM head left
    in float), each weight's scales from its min / max as the library computes them (static
    activation scales, where the preset has them, set to 0.02), saved compressed."""
    model = hf_model("llama2")
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
    groups = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, groups)
    args = scheme.weights
    with torch.no_grad():
        for m in model.modules():
            if not hasattr(m, "weight_scale"):
                continue
            w = m.weight
            if args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "tensor":
                lo, hi = w.amin(), w.amax()
            else:
                g = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = g.amin(-1), g.amax(-1)
            s, _ = calculate_qparams(lo, hi, args)
            m.weight_scale.copy_(s.reshape(m.weight_scale.shape))
            if hasattr(m, "input_scale"):
                m.input_scale.fill_(0.02)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return path


def _symmetric_int8(monkeypatch) -> None:
    """compressed-tensors rounds int8 activations into [-128, 127] with scale max|x| / 127.5,
    jaxllm (as vLLM) into [-127, 127] with max|x| / 127: the library's int range made
    symmetric, so that its per-token fake quantization is jaxllm's."""
    full = helpers.calculate_range

    def symmetric(args, device):
        lo, hi = full(args, device)
        return (-hi, hi) if args.type == "int" else (lo, hi)

    for module in (forward, helpers):
        monkeypatch.setattr(module, "calculate_range", symmetric)


def _weight_only(model):
    """`model` with its coded weights' activations in float (act none)."""
    is_coded = lambda x: isinstance(x, coded.CodedTensor)  # noqa: E731
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = jax.tree.map(
        lambda x: x.replace(act="none") if is_coded(x) else x, params, is_leaf=is_coded
    )
    return nnx.merge(nnx.graphdef(model), params, nnx.state(model, nnx.Not(nnx.Param)))


def _close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("preset", list(PRESETS))
def test_import_of_compressed_tensors_presets(preset, tmp_path, capsys, monkeypatch):
    """Kept codes: the run's quantize.* is the preset's kind; with float activations its
    logits are transformers' on the decompressed weights (`dequantize=True`), with its own
    activations (FP8_DYNAMIC's E4M3, W8A8's int8 per token) those of transformers' quantized
    forward, to float32 rounding; exported again, the library's tensors exactly. Refused
    presets: one line, nothing written; with --dequantize, transformers' dequantized logits."""
    src = _checkpoint(preset, tmp_path / "ct")
    tokens = sample_tokens()
    how = CompressedTensorsConfig(dequantize=True)
    dequantized = hf_logits(
        AutoModelForCausalLM.from_pretrained(src, quantization_config=how), tokens
    )
    run = tmp_path / "run"
    if PRESETS[preset] is None:
        capsys.readouterr()
        err = stderr_of_failure(capsys, "convert", "import", src, run)
        assert err.startswith("jaxllm: ") and err.count("\n") == 1, err
        assert "cannot import keeping the codes" in err and "--dequantize" in err
        assert not run.exists()
        assert main(["convert", "import", str(src), str(run), "--dequantize"]) == 0
        _close(jaxllm.load_model(run)(tokens).logits, dequantized)
        return
    assert main(["convert", "import", str(src), str(run)]) == 0
    q = config.load(run / "config.yaml").quantize
    assert (q.method, q.fp8_activations) == PRESETS[preset]
    ours = jaxllm.load_model(run)
    assert isinstance(ours.layers.mlp.gate_proj.get_value(), coded.CodedTensor)
    _close(_weight_only(ours)(tokens).logits, dequantized)
    if preset != "MXFP4A16":  # (transformers' MXFP4 forward mixes bfloat16 scales in)
        if preset == "W8A8":
            _symmetric_int8(monkeypatch)
        quantized = hf_logits(AutoModelForCausalLM.from_pretrained(src), tokens)
        assert np.abs(quantized - dequantized).max() > 1e-3 * np.abs(dequantized).max()
        _close(ours(tokens).logits, quantized)
    assert main(["convert", "export", str(run), str(tmp_path / "again")]) == 0
    theirs, again = (
        load_file(src / "model.safetensors"),
        load_file(tmp_path / "again" / "model.safetensors"),
    )
    assert sorted(theirs) == sorted(again)
    for name, t in theirs.items():
        assert again[name].dtype == t.dtype and torch.equal(again[name], t), name

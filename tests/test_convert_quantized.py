"""Quantized runs out in the compressed-tensors layout: `jaxllm convert export` of a run made by
`jaxllm quantize` loads in transformers (compressed-tensors decompressing on load) with the
logits of jaxllm's quantized model; its int32 packing is compressed-tensors' own
(`pack_to_int32`), its config its `QuantizationConfig`; what the layout cannot express is
refused."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationConfig
from flax import nnx
from hf_models import hf_logits, hf_model, sample_tokens, save_hf, stderr_of_failure
from safetensors.numpy import load_file, save_file
from trained_runs import shared_quantized
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

import jaxllm
from jaxllm import config
from jaxllm.cli import main
from jaxllm.convert import packed
from jaxllm.model import quantized

KINDS = {  # name -> jaxllm quantize options
    "int8": ["--bits", "8"],
    "int4-g32": ["--bits", "4", "--group-size", "32"],
    "int4-g32-asym": ["--bits", "4", "--group-size", "32", "--asymmetric"],
    "int3-g32-asym": ["--bits", "3", "--group-size", "32", "--asymmetric"],
}


@pytest.fixture(scope="module")
def runs(small_run):
    """{kind: (quantized run, its export)} of the session's small run: shared by the session
    (the int4-g32 run is test_quantized_uses' too), read-only."""
    opts = ["--method", "rtn"]
    return {
        kind: shared_quantized(f"small-{kind}", small_run, *opts, *k) for kind, k in KINDS.items()
    }


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_packing_is_compressed_tensors_own(bits):
    """`pack_int32` of unsigned codes is `pack_to_int32` of the signed ones, along the input
    (a row of 40: the last int32 part-filled) and, transposed, along the output; and back."""
    q = np.random.default_rng(bits).integers(0, 2**bits, (6, 40)).astype(np.uint8)
    signed = torch.tensor(q.astype(np.int16) - 2 ** (bits - 1), dtype=torch.int8)
    want = pack_to_int32(signed, bits).numpy()
    np.testing.assert_array_equal(packed.pack_int32(q, bits), want)
    want0 = pack_to_int32(signed.T.contiguous(), bits, packed_dim=0).numpy()
    np.testing.assert_array_equal(packed.pack_int32(q, bits).T, want0)
    np.testing.assert_array_equal(packed.unpack_int32(want, bits, 40), q)


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_loads_in_transformers_with_jaxllm_logits(runs, kind):
    """transformers' compressed-tensors integration decompresses the export to the weights
    jaxllm computes with: the logits agree to float32 rounding (2e-5 of their scale)."""
    q, hf = runs[kind]
    cfg = json.loads((hf / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(cfg)  # the library's own schema
    scheme = parsed.config_groups["group_0"].weights
    assert (scheme.num_bits, scheme.symmetric) == (int(KINDS[kind][1]), "asym" not in kind)
    assert cfg["ignore"] == ["lm_head"] and len(cfg["config_groups"]["group_0"]["targets"]) == 14
    tensors = load_file(hf / "model.safetensors")
    packed = tensors["model.layers.0.self_attn.o_proj.weight_packed"]
    assert packed.dtype == np.int32 and packed.shape == (64, 64 * scheme.num_bits // 32)
    assert ("model.layers.1.mlp.down_proj.weight_zero_point" in tensors) == ("asym" in kind)
    model = AutoModelForCausalLM.from_pretrained(
        hf, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    tokens = np.random.default_rng(0).integers(0, 320, (2, 16))
    want = np.asarray(jaxllm.load_model(q)(tokens).logits)
    with torch.no_grad():
        got = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_export_refuses_a_layout_compressed_tensors_cannot_express(tmp_path, capsys):
    """GPT-2's Conv1D weights (q, k and v fused in one tensor) are not one linear module each:
    a quantized GPT-2 run is refused in one line and nothing is written."""
    src = save_hf(hf_model("gpt2"), tmp_path / "hf")
    assert main(["convert", "import", str(src), str(tmp_path / "run")]) == 0
    opts = ["--method", "rtn", "--bits", "4"]
    assert main(["quantize", str(tmp_path / "run"), str(tmp_path / "q"), *opts]) == 0
    capsys.readouterr()
    err = stderr_of_failure(capsys, "convert", "export", tmp_path / "q", tmp_path / "out")
    assert err.startswith("jaxllm: ") and err.count("\n") == 1, err
    assert "compressed-tensors cannot express it" in err
    assert not (tmp_path / "out").exists()


def _params(model) -> list:
    return jax.tree.leaves(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("kind", ["int8", "int4-g32-asym", "int3-g32-asym"])
def test_import_keeps_the_codes(runs, kind, tmp_path):
    """run -> export -> import: the same codes, scales and zero points (and every other
    parameter), in a run whose quantize.* is the original's."""
    q, hf = runs[kind]
    assert main(["convert", "import", str(hf), str(tmp_path / "back")]) == 0
    a, b = jaxllm.load_model(q), jaxllm.load_model(tmp_path / "back")
    assert isinstance(b.layers.mlp.down_proj.get_value(), quantized.QuantizedTensor)
    for x, y in zip(_params(a), _params(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    saved = lambda run: config.load(run / "config.yaml").quantize  # noqa: E731
    assert saved(tmp_path / "back") == saved(q)


def test_import_refuses_what_it_cannot_hold(runs, tmp_path, capsys):
    """Another quant_method, or activations quantized too: one line, nothing written."""
    _, hf = runs["int4-g32"]
    cfg = json.loads((hf / "config.json").read_text())
    qc = cfg["quantization_config"]
    act = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    group = {**qc["config_groups"]["group_0"], "input_activations": act}
    for bad, says in [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method bitsandbytes"),
        ({"quant_method": "gptq", "bits": 4}, "but config.json's quantization_config says"),
        ({**qc, "config_groups": {"group_0": group}}, "quantized activations"),
    ]:
        src = tmp_path / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(hf, src)
        (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": bad}))
        err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "out")
        assert err.startswith("jaxllm: ") and err.count("\n") == 1 and says in err, err
        assert not (tmp_path / "out").exists()
    # one projection left in float: the run would not load as the quantize.* it records
    tensors = load_file(src / "model.safetensors")
    m = "model.layers.1.mlp.up_proj"
    w = packed.dequantized(tensors.__getitem__, m, 4, np.float32)
    tensors = {k: v for k, v in tensors.items() if not k.startswith(f"{m}.")}
    save_file({**tensors, f"{m}.weight": w}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(cfg))
    err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "out")
    assert "in float for model.layers.1.mlp.up_proj.weight" in err, err
    assert not (tmp_path / "out").exists()
    # the LM head in codes too, which a run with quantize.head=false holds in float
    tensors = load_file(hf / "model.safetensors")
    head = tensors.pop("lm_head.weight")
    q = np.random.default_rng(0).integers(0, 16, head.shape).astype(np.uint8)
    tensors["lm_head.weight_packed"] = packed.pack_int32(q, 4)
    tensors["lm_head.weight_scale"] = np.ones((head.shape[0], 2), np.float32)
    tensors["lm_head.weight_shape"] = np.array(head.shape, np.int64)
    save_file(tensors, str(src / "model.safetensors"))
    err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "out")
    assert "in codes here only: ['lm_head']" in err, err
    assert not (tmp_path / "out").exists()


def test_import_of_compressed_tensors_own_checkpoint(tmp_path):
    """A Llama quantized by compressed-tensors itself (int4 in groups of 32, asymmetric; its
    `calculate_qparams` scales, its `ModelCompressor`) imports as an int4 run whose logits are
    those transformers computes from the same file."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = hf_model("llama2")
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=32
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "weight_scale"):
                w = m.weight.reshape(m.weight.shape[0], -1, 32)
                s, z = calculate_qparams(w.amin(-1), w.amax(-1), args)
                m.weight_scale.copy_(s.reshape(m.weight_scale.shape))
                m.weight_zero_point.copy_(z.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    src = tmp_path / "ct"
    model.save_pretrained(src)
    compressor.update_config(str(src))
    assert main(["convert", "import", str(src), str(tmp_path / "run")]) == 0
    ours = jaxllm.load_model(tmp_path / "run")
    assert ours.layers.mlp.up_proj.get_value().bits == 4
    ref = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    tokens = sample_tokens()
    want = hf_logits(ref, tokens)
    np.testing.assert_allclose(ours(tokens).logits, want, rtol=0, atol=2e-5 * np.abs(want).max())

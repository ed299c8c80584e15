"""The coded kinds out in compressed-tensors' layouts: `jaxllm convert export` of a run quantized
with `--method fp8` (weight-only and W8A8-FP8), `smoothquant` (int8 W8A8) and `mxfp4` writes the
tensors and `quantization_config` of compressed-tensors' own schemes, which its compressors
decompress to exactly jaxllm's decoded weights and transformers loads with jaxllm's logits;
LLM.int8(), which it cannot express, is refused."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from flax import nnx
from hf_models import stderr_of_failure
from safetensors.torch import load_file
from trained_runs import shared_quantized
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

import jaxllm
from jaxllm import config
from jaxllm.cli import main
from jaxllm.config.quantize import QuantizeConfig
from jaxllm.convert import export_hf
from jaxllm.model import coded
from jaxllm.model import quantized_float as qf

KINDS = {  # name -> (jaxllm quantize options, format, compressed-tensors' preset scheme)
    "fp8": (["--method", "fp8"], "naive-quantized", "FP8_DYNAMIC"),
    "fp8-w8a8": (
        ["--method", "fp8", "quantize.fp8_activations=true"],
        "float-quantized",
        "FP8_DYNAMIC",
    ),
    "smoothquant": (["--method", "smoothquant", "--samples", "8"], "int-quantized", "W8A8"),
    "mxfp4": (["--method", "mxfp4"], "mxfp4-pack-quantized", "MXFP4A16"),
}
TOKENS = np.random.default_rng(0).integers(0, 320, (2, 16))


@pytest.fixture(scope="module")
def runs(small_run):
    """{kind: (quantized run, its export)} of the session's small run, and the run: shared by
    the session (test_convert_coded_import's too), read-only."""
    kinds = {
        kind: shared_quantized(f"small-{kind}", small_run, *opts)
        for kind, (opts, _, _) in KINDS.items()
    }
    return {"float": small_run, **kinds}


def _is_coded(x) -> bool:
    return isinstance(x, coded.CodedTensor)


def _model(run, weight_only: bool = False):
    """The run's model; `weight_only`: its coded weights with float activations (act none)."""
    model = jaxllm.load_model(run)
    if not weight_only:
        return model
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = jax.tree.map(
        lambda x: x.replace(act="none") if _is_coded(x) else x, params, is_leaf=_is_coded
    )
    return nnx.merge(nnx.graphdef(model), params, nnx.state(model, nnx.Not(nnx.Param)))


def _scheme(hf) -> QuantizationScheme:
    cfg = json.loads((hf / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(cfg)  # the library's own schema
    assert list(parsed.config_groups) == ["group_0"] and parsed.ignore == ["lm_head"]
    return parsed.config_groups["group_0"]


def test_mxfp4_packing_is_compressed_tensors_own():
    """compressed-tensors' MXFP4 compressor, given jaxllm's E8M0 scales, rounds a weight to
    jaxllm's E2M1 codes in jaxllm's nibble order (element 2j low, 2j + 1 high), ties to the even
    code included, stores jaxllm's scale bytes, and decompresses to jaxllm's decoded weight."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 40)) * np.exp2(rng.integers(-6, 4, (1, 40)))).astype(np.float32)
    ties = np.array([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -5, -2.5, -0.25, 0.1, 7])
    w[:32, 0] = np.resize(ties, 32) / 8  # block max 0.875 -> X = 2^-3: the E2M1 grid's ties
    w[32:64, 1] = 0  # an all-zero block: E8M0 byte 0
    codes, scales = (np.asarray(a) for a in qf.mxfp4_quantize(w))
    assert scales[1, 1] == 0 and scales[0, 0] == 127 - 3
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["MXFP4A16"])
    compressor = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
    scale_float = decompress_mx_scale(torch.tensor(scales.T.copy()))
    state = {"weight": torch.tensor(w.T.copy()), "weight_scale": scale_float}
    packed = compressor.compress(state, scheme)
    np.testing.assert_array_equal(packed["weight_packed"].numpy(), codes.T)
    np.testing.assert_array_equal(packed["weight_scale"].numpy(), scales.T)
    dense = compressor.decompress(packed, scheme)["weight"].float().numpy()
    np.testing.assert_array_equal(dense, np.asarray(qf.mxfp4_dequantize(codes, scales)).T)


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_is_compressed_tensors_scheme_and_decodes_exactly(runs, kind, tmp_path):
    """config.json's scheme is the library's preset (format as it infers it), the tensors have
    its dtypes and shapes, and each module decompressed by the library's own compressor is
    bit for bit the weight jaxllm decodes (its float export, mapped by the float links)."""
    q, hf = runs[kind]
    _, fmt, preset = KINDS[kind]
    scheme = _scheme(hf)
    want = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
    acts = want.input_activations if kind in ("fp8-w8a8", "smoothquant") else None
    assert scheme.weights == want.weights and scheme.input_activations == acts
    assert scheme.format == fmt == infer_module_format(torch.nn.Linear, scheme)
    assert len(scheme.targets) == 14

    tensors = load_file(hf / "model.safetensors")
    o = "model.layers.0.self_attn.o_proj"
    dtypes = {
        "fp8": torch.float8_e4m3fn,
        "fp8-w8a8": torch.float8_e4m3fn,
        "smoothquant": torch.int8,
    }
    if kind == "mxfp4":
        assert tensors[f"{o}.weight_packed"].shape == (64, 32)
        assert tensors[f"{o}.weight_scale"].dtype == torch.uint8
        assert tensors[f"{o}.weight_scale"].shape == (64, 2)
    else:
        assert tensors[f"{o}.weight"].dtype == dtypes[kind]
        assert tensors[f"{o}.weight"].shape == (64, 64)
        assert tensors[f"{o}.weight_scale"].dtype == torch.float32
        assert tensors[f"{o}.weight_scale"].shape == (64, 1)

    # jaxllm's decoded weights through the float export's own links
    model = jaxllm.load_model(q)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    dense = jax.tree.map(
        lambda x: coded.decode(x) if _is_coded(x) else x, params, is_leaf=_is_coded
    )
    cfg = config.load(q / "config.yaml")
    export_hf(dense, dataclasses.replace(cfg, quantize=QuantizeConfig()), tmp_path / "dense")
    floats = load_file(tmp_path / "dense" / "model.safetensors")
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    for module in scheme.targets:
        state = {
            k.removeprefix(f"{module}."): v
            for k, v in tensors.items()
            if k.startswith(f"{module}.")
        }
        got = compressor.decompress(state, scheme)["weight"].float()
        torch.testing.assert_close(got, floats[f"{module}.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_loads_in_transformers_with_jaxllm_logits(runs, kind):
    """transformers' compressed-tensors integration with `dequantize=True` computes with the
    decompressed weights and float activations: jaxllm's logits with the same coded weights and
    float activations, to float32 rounding. Without it (on the first forward compressed-tensors
    decompresses and fake-quantizes each linear input per token), the W8A8-FP8 export gives
    jaxllm's W8A8-FP8 logits: both round each token's row to E4M3 with scale max|x| / 448. (Its
    int8 rows take max|x| / 127.5 over [-128, 127], jaxllm's and vLLM's max|x| / 127: not
    compared.)"""
    q, hf = runs[kind]
    model = AutoModelForCausalLM.from_pretrained(
        hf, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    want = np.asarray(_model(q, weight_only=True)(TOKENS).logits)
    with torch.no_grad():
        got = model(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    if kind != "fp8-w8a8":
        return
    w8a8 = np.asarray(_model(q)(TOKENS).logits)
    assert np.abs(w8a8 - want).max() > 1e-3 * np.abs(want).max()  # activations do round
    model = AutoModelForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        got = model(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(got, w8a8, rtol=0, atol=2e-5 * np.abs(w8a8).max())


def test_llm_int8_export_is_refused(runs, tmp_path, capsys):
    """LLM.int8()'s 16-bit outlier features have no compressed-tensors scheme: one line, exit
    2, nothing written. (The other kinds' exports import back: test_convert_coded_import.py.)"""
    q = tmp_path / "llm_int8"
    assert main(["quantize", str(runs["float"]), str(q), "--method", "llm_int8"]) == 0
    capsys.readouterr()
    err = stderr_of_failure(capsys, "convert", "export", q, tmp_path / "out")
    assert err.startswith("jaxllm: ") and err.count("\n") == 1, err
    assert "quantize.method=llm_int8" in err and "cannot express" in err
    assert not (tmp_path / "out").exists()

"""GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ GEMM) checkpoints in: an int4 run's codes,
exported in compressed-tensors' layout and re-packed here as AutoGPTQ's `pack` and AutoAWQ's
`WQLinear_GEMM.from_linear` pack them (GPTQ v1 storing z - 1; AWQ's nibble order), import
with the same codes (so the same logits) as the run, or with `--dequantize` as a float run of
the same function; act-order groups and unsupported widths are refused. And checkpoints a
GPTQ library itself wrote (golden/autoquant) read as its own dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm.cli import main
from jaxllm.convert import packed
from jaxllm.convert.reader import Reader

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def gptq_pack(q):
    """AutoGPTQ's pack: codes [in, out] -> int32 [in / 8, out], row j of each 8 at 4 j."""
    words = np.zeros((q.shape[0] // 8, q.shape[1]), np.uint32)
    for j in range(8):
        words |= q[j::8].astype(np.uint32) << (4 * j)
    return words.view(np.int32)


def cols_pack(q, order=range(8)):
    """Packing along the outputs: [rows, out] -> int32 [rows, out / 8], nibble i holding
    column 8 c + order[i] (AutoAWQ's order, or in order for GPTQ's qzeros)."""
    words = np.zeros((q.shape[0], q.shape[1] // 8), np.uint32)
    for i, col in enumerate(order):
        words |= q[:, col::8].astype(np.uint32) << (4 * i)
    return words.view(np.int32)


def repack(ct_dir, out_dir, method: str, symmetric: bool, act_order: bool = False):
    """The compressed-tensors export `ct_dir` as a GPTQ / AWQ checkpoint in `out_dir`."""
    shutil.copytree(ct_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    read = tensors.__getitem__
    for m in [n.removesuffix(".weight_packed") for n in list(tensors) if n.endswith("_packed")]:
        q, s, z = packed.module_codes(read, m, 4, np.float32)  # [out, in], [out, groups]
        z = np.full(s.shape, 8) if z is None else z.astype(np.int64)
        for suffix in packed.SUFFIXES:
            tensors.pop(f"{m}.{suffix}", None)
        if method == "gptq":
            groups = np.arange(q.shape[1]) // (q.shape[1] // s.shape[1])
            if act_order:
                groups = groups[::-1].copy()
            tensors |= {
                f"{m}.qweight": gptq_pack(q.T),
                f"{m}.qzeros": cols_pack((z.T - 1) & 15),
                f"{m}.g_idx": groups.astype(np.int32),
            }
        else:
            tensors |= {
                f"{m}.qweight": cols_pack(q.T, AWQ_ORDER),
                f"{m}.qzeros": cols_pack(z.T, AWQ_ORDER),
            }
        tensors[f"{m}.scales"] = np.ascontiguousarray(s.T, np.float16)
    save_file(tensors, out_dir / "model.safetensors")
    hf = json.loads((out_dir / "config.json").read_text())
    group = hf["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    hf["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": symmetric}
        | {"desc_act": act_order, "checkpoint_format": "gptq"}
        if method == "gptq"
        else {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True}
        | {"version": "gemm"}
    )
    (out_dir / "config.json").write_text(json.dumps(hf))
    return out_dir


@pytest.fixture(scope="module")
def int4_runs(small_run, tmp_path_factory):
    """{symmetric: (int4 run in groups of 32 with float16 scales, its compressed-tensors
    export)}."""
    root = tmp_path_factory.mktemp("autoquant")
    out = {}
    for sym in (True, False):
        q, hf = root / f"q{sym}", root / f"q{sym}-hf"
        opts = ["--bits", "4", "--group-size", "32", *([] if sym else ["--asymmetric"])]
        argv = ["quantize", str(small_run), str(q), "--method", "rtn", *opts]
        assert main([*argv, "model.param_dtype=float16"]) == 0
        assert main(["convert", "export", str(q), str(hf)]) == 0
        out[sym] = (q, hf)
    return out


@pytest.mark.parametrize("method, symmetric", [("gptq", True), ("gptq", False), ("awq", False)])
def test_gptq_and_awq_checkpoints_keep_their_codes(int4_runs, tmp_path, method, symmetric):
    run, ct = int4_runs[symmetric]
    hf = repack(ct, tmp_path / "hf", method, symmetric)
    f32 = "model.dtype=float32"  # the run computes in float32 (config.json says float16)
    assert main(["convert", "import", str(hf), str(tmp_path / "q"), f32]) == 0
    assert main(["convert", "import", str(hf), str(tmp_path / "f"), f32, "--dequantize"]) == 0
    tokens = np.arange(32).reshape(2, 16) * 7 % 320
    want = jaxllm.load_model(run)
    got = jaxllm.load_model(tmp_path / "q")
    saved = jaxllm.config.load(tmp_path / "q" / "config.yaml").quantize
    assert (saved.method, saved.bits, saved.group_size) == (method, 4, 32)
    assert saved.symmetric == symmetric
    a, b = want.layers.mlp.down_proj.get_value(), got.layers.mlp.down_proj.get_value()
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    np.testing.assert_array_equal(np.asarray(want(tokens).logits), np.asarray(got(tokens).logits))
    floats = jaxllm.load_model(tmp_path / "f")
    assert not jaxllm.config.load(tmp_path / "f" / "config.yaml").quantize.enabled
    np.testing.assert_allclose(
        np.asarray(floats(tokens).logits), np.asarray(want(tokens).logits), rtol=2e-3, atol=2e-3
    )


def test_refused_gptq_checkpoints(int4_runs, small_run, tmp_path, capsys):
    _, ct = int4_runs[True]
    hf = repack(ct, tmp_path / "act", "gptq", True, act_order=True)
    capsys.readouterr()
    assert main(["convert", "import", str(hf), str(tmp_path / "q")]) == 2
    assert "groups the input channels out of order" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (hf / "config.json").write_text(json.dumps(cfg))
    assert main(["convert", "import", str(hf), str(tmp_path / "q")]) == 2
    assert "3-bit codes (2, 4 and 8 are imported)" in capsys.readouterr().err
    assert main(["convert", "export", str(small_run), str(tmp_path / "float")]) == 0
    capsys.readouterr()
    argv = ["convert", "import", str(tmp_path / "float"), str(tmp_path / "g"), "--dequantize"]
    assert main(argv) == 2
    assert "holds no quantized weights to dequantize" in capsys.readouterr().err


GOLDEN = Path(__file__).parent / "golden" / "autoquant"


@pytest.mark.parametrize("name", ["gptq4_g32_sym", "gptq4_g32_asym", "awq4_g32"])
def test_checkpoints_a_gptq_library_wrote(name, tmp_path):
    """Tiny Llamas quantized and saved by GPTQModel 7.7.0 (GPTQ v1 symmetric and not, AWQ
    GEMM; golden/autoquant/README.md): every packed module reads as the library's own
    dequantized weight, and the imported run (its codes kept) computes the logits of
    transformers' float32 Llama on those weights."""
    src = GOLDEN / name
    ref = load_file(src / "reference.safetensors")
    reader = Reader(src)
    modules = [k for k in ref if k.endswith(".weight")]
    assert len(modules) == 14 and set(modules) <= set(reader.modules)
    for m in modules:
        np.testing.assert_array_equal(reader.read(m), ref[m])
    assert main(["convert", "import", str(src), str(tmp_path / "q"), "model.dtype=float32"]) == 0
    saved = jaxllm.config.load(tmp_path / "q" / "config.yaml").quantize
    assert (saved.method, saved.bits, saved.group_size) == (name.split("4")[0], 4, 32)
    logits = jaxllm.load_model(tmp_path / "q")(np.arange(16)[None] * 7 % 320).logits
    np.testing.assert_allclose(np.asarray(logits), ref["logits_fp32"], rtol=1e-4, atol=1e-4)

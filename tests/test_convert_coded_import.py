"""The coded kinds back in from compressed-tensors' layouts: `jaxllm convert import` of an fp8
(weight-only or W8A8-FP8), int8 W8A8 (smoothquant) or MXFP4 export keeps its codes and scales
bit for bit, records the run's quantize.*, computes the original's logits and exports to the
same bytes; `--dequantize` gives the decoded weights as a float run; what jaxllm cannot hold
is refused in one line with nothing written. (compressed-tensors' own checkpoints:
test_convert_coded_ct.py.)"""

from __future__ import annotations

import copy
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from trained_runs import shared_quantized

import jaxllm
from jaxllm import config
from jaxllm.cli import main
from jaxllm.convert.reader import tensor_bytes
from jaxllm.model import coded

KINDS = {  # name -> jaxllm quantize options
    "fp8": ["--method", "fp8"],
    "fp8-w8a8": ["--method", "fp8", "quantize.fp8_activations=true"],
    "smoothquant": ["--method", "smoothquant", "--samples", "8"],
    "mxfp4": ["--method", "mxfp4"],
}
TOKENS = np.random.default_rng(0).integers(0, 320, (2, 16))


@pytest.fixture(scope="module")
def runs(small_run, tmp_path_factory):
    """{kind: (quantized run, its export, the export imported back)} of the small run (the
    quantized runs and exports shared by the session, test_convert_coded's too: read-only)."""
    root = tmp_path_factory.mktemp("coded-import")
    out = {}
    for kind, opts in KINDS.items():
        q, hf = shared_quantized(f"small-{kind}", small_run, *opts)
        assert main(["convert", "import", str(hf), str(root / kind)]) == 0
        out[kind] = (q, hf, root / kind)
    return out


def _is_coded(x) -> bool:
    return isinstance(x, coded.CodedTensor)


def _params(run) -> dict:
    model = jaxllm.load_model(run)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _tensors(hf) -> dict:
    """The tensors of an export's model.safetensors (E4M3 ones through their bytes: numpy's
    safetensors reader has no float8)."""
    path = hf / "model.safetensors"
    with safe_open(path, framework="numpy") as h:
        return {
            n: tensor_bytes(path, n).view(ml_dtypes.float8_e4m3fn)
            if h.get_slice(n).get_dtype() == "F8_E4M3"
            else h.get_tensor(n)
            for n in h.keys()
        }


def _copy(hf, dst, qc=None, tensors=None):
    """A copy of the export `hf` at `dst`, with config.json's quantization_config `qc` and the
    safetensors `tensors` where given."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(hf, dst)
    if qc is not None:
        cfg = json.loads((hf / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _qc(hf) -> dict:
    return json.loads((hf / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_keeps_codes_scales_and_logits(runs, kind, tmp_path):
    """run -> export -> import: every parameter equal, the coded weights of the original's
    kind and activations with the same codes and scales, quantize.* the original's method, the
    same logits; exported again, the same safetensors file, byte for byte."""
    q, hf, back = runs[kind]
    ours, theirs = _params(q), _params(back)
    # the same tree: coded weights of the same kind, activations, dims and dtype
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert _is_coded(theirs["layers"]["mlp"]["down_proj"])
    keys = lambda run: (lambda c: (c.method, c.bits, c.fp8_activations))(  # noqa: E731
        config.load(run / "config.yaml").quantize
    )
    assert keys(back) == keys(q)
    want = np.asarray(jaxllm.load_model(q)(TOKENS).logits)
    np.testing.assert_array_equal(np.asarray(jaxllm.load_model(back)(TOKENS).logits), want)
    assert main(["convert", "export", str(back), str(tmp_path / "again")]) == 0
    again = tmp_path / "again"
    assert (again / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    assert _qc(again) == _qc(hf)


@pytest.mark.parametrize("kind", ["fp8-w8a8", "smoothquant", "mxfp4"])
def test_dequantize_imports_the_decoded_weights(runs, kind, tmp_path):
    """`--dequantize`: a float run (quantize.method none) whose weights are exactly the coded
    weights decoded (`coded.decode`), the activations' quantization left behind."""
    q, hf, _ = runs[kind]
    argv = ["convert", "import", str(hf), str(tmp_path / "float"), "--dequantize"]
    assert main(argv) == 0
    assert config.load(tmp_path / "float" / "config.yaml").quantize.method == "none"
    decoded = jax.tree.map(
        lambda x: coded.decode(x) if _is_coded(x) else x, _params(q), is_leaf=_is_coded
    )
    got = _params(tmp_path / "float")
    for x, y in zip(jax.tree.leaves(decoded), jax.tree.leaves(got), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_per_tensor_scale_is_every_channels(runs, tmp_path):
    """fp8 weights with one scale a tensor (compressed-tensors' strategy tensor) import with
    their codes as they are and that scale on every output channel."""
    _, hf, back = runs["fp8"]
    tensors = _tensors(hf)
    one = {}
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        one[name] = np.float32(2.0 ** -(len(one) % 5 + 6))
        tensors[name] = np.array([one[name]], np.float32)
    qc = _qc(hf)
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    src = _copy(hf, tmp_path / "src", qc, tensors)
    assert main(["convert", "import", str(src), str(tmp_path / "run")]) == 0
    got, want = _params(tmp_path / "run"), _params(back)
    for layer in range(2):
        for path in [("mlp", "up_proj"), ("attn", "o_proj")]:
            a, b = (t["layers"][path[0]][path[1]] for t in (got, want))
            np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
            hf_name = "mlp.up_proj" if path[0] == "mlp" else "self_attn.o_proj"
            s = one[f"model.layers.{layer}.{hf_name}.weight_scale"]
            assert (np.asarray(a.scales[layer]) == s).all()


def _refused(capsys, *argv) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxllm: ") and err.count("\n") == 1, err
    return err


def _edit(qc: dict, part: str, **fields) -> dict:
    """`qc` with its scheme's `part` (weights, input_activations) updated by `fields`, or
    without it (None) when there are none."""
    qc = copy.deepcopy(qc)
    group = qc["config_groups"]["group_0"]
    group[part] = {**(group[part] or {}), **fields} if fields else None
    return qc


def test_import_refuses_what_it_cannot_hold(runs, tmp_path, capsys):
    """Static activation scales, activations of another type or strategy, int8 weights with
    float activations, MXFP4 activations, grouped or asymmetric fp8 weights, an unknown format
    and a module stored in another dtype: one line, exit 2, nothing written. Static activation
    scales import with --dequantize (left behind); weights that do not decode do not."""
    fp8, sq, mx = (runs[k][1] for k in ("fp8-w8a8", "smoothquant", "mxfp4"))
    static = _edit(_qc(fp8), "input_activations", dynamic=False, strategy="tensor")
    grouped = _edit(_qc(fp8), "weights", strategy="group", group_size=32)
    nvfp4 = copy.deepcopy(_qc(mx))
    nvfp4["format"] = nvfp4["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    mx_weights = _qc(mx)["config_groups"]["group_0"]["weights"]
    out = tmp_path / "out"
    for hf, qc, says in [
        (fp8, static, "static activation scales"),
        (fp8, _edit(_qc(fp8), "input_activations", type="int"), "activations of type int"),
        (fp8, _edit(_qc(fp8), "input_activations", strategy="tensor"), "strategy tensor"),
        (fp8, grouped, "fp8 weights by strategy group"),
        (fp8, _edit(_qc(fp8), "weights", symmetric=False), "asymmetric weights"),
        (sq, _edit(_qc(sq), "input_activations"), "int8 weights with float activations"),
        (mx, nvfp4, "format nvfp4-pack-quantized"),
        (
            mx,
            _edit(_qc(mx), "input_activations", **{**mx_weights, "dynamic": True}),
            "MXFP4 activations",
        ),
    ]:
        src = _copy(hf, tmp_path / "src", qc)
        assert says in _refused(capsys, "convert", "import", src, out)
        assert not out.exists()
    src = _copy(fp8, tmp_path / "src", static)
    assert main(["convert", "import", str(src), str(out), "--dequantize"]) == 0
    src = _copy(fp8, tmp_path / "src", grouped)
    err = _refused(capsys, "convert", "import", src, tmp_path / "out2", "--dequantize")
    assert "keeping the codes or dequantized" in err
    tensors = _tensors(fp8)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].astype(np.float32)
    src = _copy(fp8, tmp_path / "src", tensors=tensors)
    err = _refused(capsys, "convert", "import", src, tmp_path / "out2")
    assert f"{name} F32 [128, 64]" in err and "are not fp8 codes" in err
    assert not (tmp_path / "out2").exists()

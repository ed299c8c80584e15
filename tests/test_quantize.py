"""Post-training quantization: RTN against a NumPy re-derivation (and Qwix's rounding), the
packed format's sizes, the matmul seam (also under LoRA), and `jaxllm quantize` end to end:
`load_model` of its run against a model built from NumPy-dequantized weights, 1 vs 8 devices,
`generate` / `eval`, and the eval loss of int8 and int4 against the float run."""

from __future__ import annotations

import math
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import SMALL_RUN, train_for_quantization
from flax import nnx

import jaxllm
from jaxllm import sharding
from jaxllm.cli import main
from jaxllm.config import MeshConfig
from jaxllm.evaluate import evaluate_checkpoint
from jaxllm.model import layers, lora, quantized

# ------------------------------------------------------------------ the NumPy re-derivation


def np_rtn(w, bits, group, symmetric, n_in, n_out):
    """(codes [*w.shape] in [0, 2^b), scales, zero points) of round-to-nearest, as GPTQ's
    Quantizer and compressed-tensors compute them, over groups of the flattened inputs."""
    w = np.asarray(w, np.float32)
    lead = w.ndim - n_in - n_out
    k, outs = math.prod(w.shape[lead : lead + n_in]), w.shape[lead + n_in :]
    g = group or k
    x = w.reshape(*w.shape[:lead], k // g, g, *outs)
    top = 2**bits - 1
    if symmetric:
        s = np.abs(x).max(axis=lead + 1, keepdims=True) * np.float32(2 / top)
    else:
        lo = np.minimum(x.min(axis=lead + 1, keepdims=True), 0)
        s = (np.maximum(x.max(axis=lead + 1, keepdims=True), 0) - lo) * np.float32(1 / top)
    s = np.where(s == 0, np.float32(1), s).astype(np.float32)
    inv = np.float32(1) / s  # w / s as w * (1 / s) in float32, round half to even
    z = np.full_like(s, 2 ** (bits - 1)) if symmetric else np.clip(np.round(-lo * inv), 0, top)
    q = np.clip(np.round(x * inv) + z, 0, top)
    return q.reshape(w.shape).astype(np.uint8), s, z


def np_dequantize(q, s, z, n_in, n_out):
    lead = q.ndim - n_in - n_out
    g = s.shape[lead]
    x = q.astype(np.float32).reshape(*q.shape[:lead], g, -1, *q.shape[lead + n_in :])
    return ((x - z) * s).reshape(q.shape)


def test_matmul_dequantizes_inside_jit_and_under_lora():
    """`layers.matmul` of a quantized kernel equals the matmul of its dequantized array, as the
    base of a LoRA kernel too."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (64, 4, 16)).astype(np.float32)
    x = rng.normal(0, 1, (2, 3, 64)).astype(np.float32)
    t = quantized.quantize(w, bits=4, group=32, symmetric=False, n_in=1, n_out=2)
    dense = quantized.dequantize(t)
    f = jax.jit(lambda x, k: layers.matmul("bld,dhk->blhk", x, k, jnp.float32))
    np.testing.assert_allclose(f(x, t), f(x, dense), rtol=1e-6, atol=1e-6)
    a, b = rng.normal(0, 0.1, (64, 8)), rng.normal(0, 0.1, (8, 4, 16))

    @jax.jit
    def g(x, base):
        kernel = lora.LoRAKernel(
            base, jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), 2.0
        )
        return layers.matmul("bld,dhk->blhk", x, kernel, jnp.float32)

    np.testing.assert_allclose(g(x, t), g(x, dense), rtol=1e-5, atol=1e-6)
    assert not np.allclose(g(x, t), f(x, t))  # the adapter path is there


# ------------------------------------------------------------------------ runs end to end


@pytest.fixture(scope="module")
def trained():
    """SMALL_RUN trained 300 steps at a high learning rate: enough that quantizing its layers
    shows in the loss."""
    return train_for_quantization()


@pytest.fixture(scope="module")
def quantized_runs(trained, tmp_path_factory):
    """{name: run} of `trained` quantized by rtn: int8 per channel, int4 groups of 32
    (asymmetric)."""
    root, out = tmp_path_factory.mktemp("quantized"), {}
    for name, opts in {
        "int8": ["--bits", "8"],
        "int4-g32": ["--bits", "4", "--group-size", "32", "--asymmetric"],
    }.items():
        out[name] = root / name
        assert main(["quantize", str(trained), str(out[name]), "--method", "rtn", *opts]) == 0
    return out


def _eval_loss(run) -> float:
    return evaluate_checkpoint(run)["eval_loss"]


def _params(model) -> dict:
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_quantized_run_computes_its_dequantized_weights(trained, quantized_runs):
    """`load_model` of the int4 run gives the logits of the float model whose chosen weights
    are replaced by their NumPy re-derived RTN (the head, embeddings and norms as they were);
    the int8 run's are close to the float model's."""
    src = jaxllm.load_model(trained)
    graphdef = nnx.graphdef(src)
    params = _params(src)
    tokens = np.random.default_rng(0).integers(0, 320, (2, 32))
    float_logits = np.asarray(src(tokens).logits)
    want = {}
    for name, (bits, group, sym) in {"int8": (8, 0, True), "int4-g32": (4, 32, False)}.items():
        changed = jax.tree.map(lambda x: x, params)
        for block in ("attn", "mlp"):
            for k, w in params["layers"][block].items():
                if k.endswith("_proj"):
                    n_in = 2 if k == "o_proj" else 1
                    n_out = w.ndim - 1 - n_in
                    q, s, z = np_rtn(w, bits, group, sym, n_in, n_out)
                    changed["layers"][block][k] = np_dequantize(q, s, z, n_in, n_out)
        model = nnx.merge(graphdef, changed)
        want[name] = np.asarray(model(tokens).logits)
        got_model = jaxllm.load_model(quantized_runs[name])
        assert isinstance(got_model.layers.attn.q_proj.get_value(), quantized.QuantizedTensor)
        assert isinstance(got_model.lm_head.get_value(), jax.Array)  # the head stays
        np.testing.assert_allclose(got_model(tokens).logits, want[name], rtol=1e-5, atol=1e-5)
    assert np.abs(want["int8"] - float_logits).max() < 0.05 * np.abs(float_logits).max()
    assert not np.allclose(want["int4-g32"], float_logits, atol=1e-3)


def test_quantized_run_is_the_same_on_8_devices(quantized_runs):
    tokens = np.random.default_rng(1).integers(0, 320, (8, 16))
    run = quantized_runs["int4-g32"]
    one = jaxllm.load_model(run, mesh=sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    mesh = sharding.make_mesh(MeshConfig(fsdp=4, tensor=2))
    eight = jaxllm.load_model(run, mesh=mesh)
    codes = eight.layers.attn.q_proj.get_value().codes
    assert len(codes.sharding.device_set) == 8 and not codes.sharding.is_fully_replicated
    np.testing.assert_allclose(
        np.asarray(eight(tokens).logits), np.asarray(one(tokens).logits), rtol=1e-5, atol=1e-5
    )


def test_quantized_runs_eval_generate_and_stay_small(trained, quantized_runs, capsys):
    """int8 RTN costs little eval loss, int4 in groups of 32 a little more, and moves the
    logits further from the float model's (the loss itself may move either way by a few
    thousandths on a model this small); both generate; the int4 checkpoint's parameters are
    well under half the float run's on disk."""
    base = _eval_loss(trained)
    int8 = _eval_loss(quantized_runs["int8"])
    int4 = _eval_loss(quantized_runs["int4-g32"])
    assert abs(int8 - base) < 0.002 and abs(int4 - base) < 0.03
    tokens = (np.arange(64, dtype=np.int32).reshape(2, 32) * 7) % 300

    def logits(run):
        return np.asarray(jaxllm.load_model(run)(tokens).logits, np.float64)

    want = logits(trained)
    err8 = np.sqrt(np.mean((logits(quantized_runs["int8"]) - want) ** 2))
    err4 = np.sqrt(np.mean((logits(quantized_runs["int4-g32"]) - want) ** 2))
    assert 0 < err8 < err4 / 4  # an int4 step is 16 times an int8 one (8 with groups)
    capsys.readouterr()
    assert main(["eval", str(quantized_runs["int4-g32"])]) == 0
    said = re.search(r"eval loss ([0-9.]+)", capsys.readouterr().out).group(1)
    assert float(said) == pytest.approx(int4, abs=1e-4)
    argv = ["generate", str(quantized_runs["int4-g32"]), "--prompt", "def ", "--max-new-tokens"]
    assert main([*argv, "4"]) == 0

    def size(run, step):
        files = (run / "checkpoints" / step / "params").rglob("*")
        return sum(f.stat().st_size for f in files if f.is_file())

    bits, src_shape = {"int8": 8, "int4-g32": 4}, (2, 64, 4, 16)  # q_proj: [N, D, H, K]
    packed, total = {}, {}  # bytes in memory: of the quantized weights, of all parameters
    for name, run in quantized_runs.items():
        weights = jax.tree.leaves(
            nnx.state(jaxllm.load_model(run), nnx.Param),
            is_leaf=lambda x: isinstance(x, quantized.QuantizedTensor),
        )
        chosen = [w for w in weights if isinstance(w, quantized.QuantizedTensor)]
        assert len(chosen) == 7
        packed[name] = sum(w.nbytes for w in chosen)
        total[name] = sum(w.nbytes for w in weights)
        floats = sum(math.prod(w.shape) * 4 for w in chosen)
    assert packed["int8"] < floats / 3.5 and packed["int4-g32"] < floats / 5.5
    # what the checkpoints store: the packed arrays, their bytes those in memory
    for name, run in quantized_runs.items():
        stored = ocp.StandardCheckpointer().metadata(run / "checkpoints" / "0" / "params")
        tree = stored.item_metadata.tree
        q_proj = tree["layers"]["attn"]["q_proj"]
        assert q_proj["codes"].dtype == np.uint8
        assert math.prod(q_proj["codes"].shape) * 8 == math.prod(src_shape) * bits[name]
        nbytes = [math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)]
        assert sum(nbytes) == total[name]
    # on disk: Orbax compresses chunks and its metadata grows between releases, so of the
    # bytes saved in memory at least 30% show on disk (about 45% on newer Orbax, 60% on older)
    assert size(quantized_runs["int8"], "0") < size(trained, "300") - 0.3 * (
        floats - packed["int8"]
    )


def test_skip_and_head_choose_the_weights(trained, tmp_path):
    out = tmp_path / "q"
    extra = ["quantize.head=true", "quantize.skip=[layers/mlp/*]"]
    assert main(["quantize", str(trained), str(out), "--method", "rtn", *extra]) == 0
    model = jaxllm.load_model(out)
    assert isinstance(model.lm_head.get_value(), quantized.QuantizedTensor)
    assert isinstance(model.layers.mlp.down_proj.get_value(), jax.Array)
    assert isinstance(model.layers.attn.o_proj.get_value(), quantized.QuantizedTensor)
    # --overwrite replaces the whole run
    assert (
        main(["quantize", str(trained), str(out), "--method", "rtn", "--bits", "2"]) == 2
    )  # refused: OUT exists
    again = ["quantize", str(trained), str(out), "--method", "rtn", "--bits", "2", "--overwrite"]
    assert main(again) == 0
    model = jaxllm.load_model(out)
    assert model.layers.attn.o_proj.get_value().bits == 2
    assert isinstance(model.lm_head.get_value(), jax.Array)
    shutil.rmtree(out)


def test_plan_bills_the_packed_bytes(quantized_runs, capsys):
    """int4 in asymmetric groups of 32 with float32 scales: 4 + 32 / 32 + 8 / 32 bits."""
    capsys.readouterr()
    assert main(["plan", str(quantized_runs["int4-g32"] / "config.yaml")]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "quantized weights" in ln)
    assert "rtn 4-bit groups of 32 asymmetric: 73,728 parameters in" in line
    assert line.endswith("5.250 bits each")


def _same_codes(a, b) -> None:
    leaves = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))  # noqa: E731
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_sources_hf_peft_and_moe(trained, quantized_runs, small_moe, tmp_path):
    """A Hugging Face export of the run quantizes to the same codes as the run; a LoRA run
    quantizes as its merged model; a MoE run's routed and shared experts are quantized (the
    router is not) and its logits are those of its dequantized weights."""
    hf = tmp_path / "hf"
    assert main(["convert", "export", str(trained), str(hf)]) == 0
    opts = ["--method", "rtn", "--bits", "4", "--group-size", "32", "--asymmetric"]
    assert main(["quantize", str(hf), str(tmp_path / "qhf"), *opts]) == 0
    _same_codes(
        jaxllm.load_model(tmp_path / "qhf", overrides=["model.dtype=float32"]),
        jaxllm.load_model(quantized_runs["int4-g32"]),
    )

    lora_run = tmp_path / "lora"
    argv = ["train", *SMALL_RUN, "train.steps=2", "peft.method=lora", f"run.dir={lora_run}"]
    assert main([*argv, f"checkpoint.init_from={trained}"]) == 0
    assert main(["quantize", str(lora_run), str(tmp_path / "qlora"), "--method", "rtn"]) == 0
    merged = tmp_path / "merged"
    assert main(["convert", "export", str(lora_run), str(merged), "--merge"]) == 0
    assert main(["quantize", str(merged), str(tmp_path / "qmerged"), "--method", "rtn"]) == 0
    _same_codes(
        jaxllm.load_model(tmp_path / "qlora"),
        jaxllm.load_model(tmp_path / "qmerged", overrides=["model.dtype=float32"]),
    )

    assert main(["quantize", str(small_moe), str(tmp_path / "qmoe"), *opts]) == 0
    model = jaxllm.load_model(tmp_path / "qmoe")
    mlp = model.moe_layers.moe.mlp
    assert isinstance(mlp.gate_proj.get_value(), quantized.QuantizedTensor)  # [N, E, D, F]
    assert isinstance(mlp.shared.up_proj.get_value(), quantized.QuantizedTensor)
    assert isinstance(mlp.router.get_value(), jax.Array)
    is_q = lambda x: isinstance(x, quantized.QuantizedTensor)  # noqa: E731
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    dense = jax.tree.map(lambda x: quantized.dequantize(x) if is_q(x) else x, params, is_leaf=is_q)
    tokens = np.random.default_rng(2).integers(0, 320, (2, 16))
    want = nnx.merge(nnx.graphdef(model), dense, nnx.state(model, nnx.Not(nnx.Param)))
    np.testing.assert_allclose(model(tokens).logits, want(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_float_and_weight_activation_methods(trained, tmp_path, capsys):
    """fp8 (weight-only and W8A8-FP8), mxfp4, llm_int8 and smoothquant: each run holds its
    kind's codes, evaluates within its error of the float run, and `plan` bills its bits;
    SmoothQuant's scales are folded into the norms (its float function unchanged)."""
    want = _eval_loss(trained)
    cases = {  # name -> (options, kind, act, tolerance in nats)
        "fp8": ([], "fp8", "none", 0.005),
        "fp8-w8a8": (["quantize.fp8_activations=true"], "fp8", "fp8", 0.005),
        "mxfp4": ([], "mxfp4", "none", 0.02),
        "llm_int8": ([], "int8", "llm_int8", 0.005),
        "smoothquant": (["--samples", "16"], "int8", "int8", 0.005),
    }
    for name, (opts, kind, act, tol) in cases.items():
        out = tmp_path / name
        method = name.split("-")[0]
        assert main(["quantize", str(trained), str(out), "--method", method, *opts]) == 0
        loss = _eval_loss(out)
        assert abs(loss - want) < tol, (name, loss, want)
        model = jaxllm.load_model(out)
        q_proj = model.layers.attn.q_proj.get_value()
        assert (q_proj.kind, q_proj.act) == (kind, act)
    src, smoothed = jaxllm.load_model(trained), jaxllm.load_model(tmp_path / "smoothquant")
    assert not np.allclose(src.layers.attn_norm.scale[...], smoothed.layers.attn_norm.scale[...])
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "mxfp4" / "config.yaml")]) == 0
    assert "4.250 bits each" in capsys.readouterr().out

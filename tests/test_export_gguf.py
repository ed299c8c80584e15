"""`jaxllm convert export RUN OUT --format gguf`: a tiny Llama run written as GGUF f16, q8_0
and q4_0 and read back with gguf's own reader: llama.cpp's metadata and tensor names, Q/K rows
permuted as convert_hf_to_gguf.py does, f16 within rounding of the weights, q8_0 / q4_0 the
bytes of gguf's own quantization of them; bad inputs one line, exit 2, nothing written."""

import sys

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import hf_model, run_cli, save_hf, stderr_of_failure
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxllm import sharding
from jaxllm.config import MeshConfig
from jaxllm.convert.gguf_export import gguf_name, permute, unpermute
from jaxllm.load import restore
from jaxllm.model import quantized


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    src = save_hf(hf_model("llama2"), tmp / "hf")
    _byte_bpe().save(str(src / "tokenizer.json"))
    assert run_cli("convert", "import", src, tmp / "run", "model.dtype=float32") == 0
    return tmp, load_file(str(src / "model.safetensors"))


def _byte_bpe() -> Tokenizer:
    """A byte-level BPE of 300 tokens (the model has 320 rows) with two special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return tok


def _weights(hf, n_head, n_kv):
    """The Hugging Face tensors under their GGUF names, Q/K permuted, float32."""
    out = {}
    for name, t in hf.items():
        g, t = gguf_name(name), t.astype(np.float32)
        if g.endswith("attn_q.weight"):
            t = permute(t, n_head)
        elif g.endswith("attn_k.weight"):
            t = permute(t, n_kv)
        out[g] = t
    return out


def test_permute_inverts():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(unpermute(permute(w, 4), 4), w)
    assert not np.array_equal(permute(w, 4), w)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
def test_export_reads_back(run, kind):
    tmp, hf = run
    out = tmp / f"model-{kind}.gguf"
    assert (
        run_cli("convert", "export", tmp / "run", out, "--format", "gguf", "--gguf-type", kind) == 0
    )
    r = gguf.GGUFReader(str(out))
    meta = {f.name: f.contents() for f in r.fields.values()}
    assert meta["general.architecture"] == "llama"
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    assert (
        meta["llama.block_count"] == 2
        and meta["llama.embedding_length"] == hf["model.embed_tokens.weight"].shape[1]
    )
    for key in (
        "llama.context_length",
        "llama.feed_forward_length",
        "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.rope.dimension_count",
        "llama.vocab_size",
    ):
        assert key in meta, key
    assert meta["tokenizer.ggml.model"] == "gpt2"
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 320 and tokens[:2] == ["<s>", "</s>"] and tokens[-1] == "[PAD319]"
    types = meta["tokenizer.ggml.token_type"]
    assert types[0] == gguf.TokenType.CONTROL and types[-1] == gguf.TokenType.UNUSED
    assert types[100] == gguf.TokenType.NORMAL and meta["tokenizer.ggml.merges"]
    want = _weights(hf, n_head, n_kv)
    got = {t.name: t for t in r.tensors}
    assert sorted(got) == sorted(want)
    assert "blk.1.attn_q.weight" in got and "output.weight" in got
    T = gguf.GGMLQuantizationType
    qtype = {"f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[kind]
    for name, w in want.items():
        t = got[name]
        assert tuple(int(d) for d in reversed(t.shape)) == w.shape, name
        if w.ndim == 1:
            assert t.tensor_type == T.F32 and np.array_equal(np.asarray(t.data), w), name
            continue
        assert t.tensor_type == qtype, name
        if kind == "f16":
            np.testing.assert_array_equal(np.asarray(t.data), w.astype(np.float16), err_msg=name)
        else:
            expect = gguf.quants.quantize(w, qtype)
            assert np.asarray(t.data).tobytes() == expect.tobytes(), name
            back = gguf.quants.dequantize(np.asarray(t.data), qtype).reshape(w.shape)
            assert np.abs(back - w).max() <= np.abs(w).max() / (6 if kind == "q4_0" else 100)
    if kind == "f16":  # un-permuted, attn_q is the Hugging Face q_proj within f16 rounding
        q = np.asarray(got["blk.0.attn_q.weight"].data).astype(np.float32)
        np.testing.assert_allclose(
            unpermute(q, n_head), hf["model.layers.0.self_attn.q_proj.weight"], rtol=1e-3, atol=1e-4
        )


def test_bad_inputs_one_line(run, capsys, monkeypatch):
    tmp, _ = run
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "gguf", None)  # not installed: import gguf raises ImportError
        err = stderr_of_failure(
            capsys, "convert", "export", tmp / "run", tmp / "m.gguf", "--format", "gguf"
        )
    assert "jaxllm[export]" in err and err.count("\n") == 1 and not (tmp / "m.gguf").exists()
    out = tmp / "exists.gguf"
    out.write_bytes(b"x")
    err = stderr_of_failure(capsys, "convert", "export", tmp / "run", out, "--format", "gguf")
    assert "already exists" in err and err.count("\n") == 1 and out.read_bytes() == b"x"
    err = stderr_of_failure(
        capsys,
        "convert",
        "export",
        tmp / "run",
        tmp / "g.gguf",
        "--format",
        "gguf",
        "--family",
        "gpt2",
    )
    assert "llama, mistral" in err and err.count("\n") == 1 and not (tmp / "g.gguf").exists()
    err = stderr_of_failure(
        capsys, "convert", "export", tmp / "run", tmp / "h", "--gguf-type", "q8_0"
    )
    assert "--format gguf" in err and not (tmp / "h").exists()


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf_q")
    src = save_hf(hf_model("llama2"), tmp / "hf")
    assert run_cli("convert", "import", src, tmp / "run", "model.param_dtype=bfloat16") == 0
    return tmp


@pytest.mark.parametrize("bits,kind", [(8, "Q8_0"), (4, "Q4_0")])
def test_quantized_run_codes_map_exactly(bf16_run, bits, kind):
    """A bf16 run quantized symmetric in groups of 32: its GGUF blocks dequantize to jaxllm's
    dequantized weights bit for bit (Q/K un-permuted)."""
    tmp = bf16_run
    q_run, out = tmp / f"q{bits}", tmp / f"q{bits}.gguf"
    opts = ["--method", "rtn", "--bits", str(bits), "--group-size", "32"]
    assert run_cli("quantize", tmp / "run", q_run, *opts) == 0
    assert run_cli("convert", "export", q_run, out, "--format", "gguf") == 0
    restored = restore(q_run, mesh=sharding.make_mesh(MeshConfig()))
    attn = restored.params["layers"]["attn"]
    n_head = restored.cfg.model.num_heads
    want = np.asarray(quantized.dequantize(attn["q_proj"], jnp.float32))
    got = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    T = gguf.GGMLQuantizationType
    n_quantized = sum(t.tensor_type == T[kind] for t in got.values())
    assert n_quantized == 14  # 7 projections x 2 layers; embedding, head, norms stay float
    assert got["token_embd.weight"].tensor_type == T.F16
    for layer in range(2):
        t = got[f"blk.{layer}.attn_q.weight"]
        back = gguf.quants.dequantize(np.asarray(t.data), T[kind])
        back = unpermute(back.reshape(-1, back.shape[-1]), n_head)  # [out, in]
        ours = want[layer].reshape(want[layer].shape[0], -1).T  # [in, heads*dim] -> [out, in]
        assert back.dtype == np.float32 and np.array_equal(back, ours), layer


def test_quantized_run_refusals(bf16_run, capsys):
    tmp = bf16_run
    opts = ["--method", "rtn", "--bits", "8", "--group-size", "64"]
    assert run_cli("quantize", tmp / "run", tmp / "g64", *opts) == 0
    capsys.readouterr()
    err = stderr_of_failure(
        capsys, "convert", "export", tmp / "g64", tmp / "a.gguf", "--format", "gguf"
    )
    assert "no exact GGUF type" in err and err.count("\n") == 1 and not (tmp / "a.gguf").exists()
    q = tmp / "q8"
    if not q.exists():
        opts = ["--method", "rtn", "--bits", "8", "--group-size", "32"]
        assert run_cli("quantize", tmp / "run", q, *opts) == 0
        capsys.readouterr()
    err = stderr_of_failure(
        capsys, "convert", "export", q, tmp / "b.gguf", "--format", "gguf", "--gguf-type", "q4_0"
    )
    assert "would re-quantize" in err and not (tmp / "b.gguf").exists()


def test_refuses_a_sliding_window(tmp_path, capsys):
    src = save_hf(hf_model("mistral"), tmp_path / "hf")
    assert run_cli("convert", "import", src, tmp_path / "run") == 0
    capsys.readouterr()
    out = tmp_path / "m.gguf"
    err = stderr_of_failure(capsys, "convert", "export", tmp_path / "run", out, "--format", "gguf")
    assert "sliding window (6)" in err and err.count("\n") == 1 and not out.exists()

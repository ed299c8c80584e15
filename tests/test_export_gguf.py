"""`jaxllm convert export RUN OUT --format gguf`: a tiny Llama run written as GGUF f16, q8_0
and q4_0 and read back with gguf's own reader: llama.cpp's metadata and tensor names, Q/K rows
permuted as convert_hf_to_gguf.py does, f16 within rounding of the weights, q8_0 / q4_0 the
bytes of gguf's own quantization of them; bad inputs one line, exit 2, nothing written."""

import gguf
import numpy as np
import pytest
from hf_models import hf_model, run_cli, save_hf, stderr_of_failure
from safetensors.numpy import load_file

from jaxllm.convert.gguf_export import gguf_name, permute, unpermute


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    src = save_hf(hf_model("llama2"), tmp / "hf")
    assert run_cli("convert", "import", src, tmp / "run", "model.dtype=float32") == 0
    return tmp, load_file(str(src / "model.safetensors"))


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


def test_bad_inputs_one_line(run, capsys):
    tmp, _ = run
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

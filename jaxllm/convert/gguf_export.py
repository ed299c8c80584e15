"""GGUF files out, for llama.cpp: `jaxllm convert export RUN OUT --format gguf`.

The export builds on the Hugging Face one (`export_hf`, into a temporary directory) and maps
its state dict to the names llama.cpp's convert_hf_to_gguf.py writes (token_embd.weight,
blk.N.attn_q.weight, ..., output_norm.weight, output.weight), with the llama architecture's
metadata and the run's byte-level BPE tokenizer (tokenizer.ggml.model "gpt2").

Q/K rows. Hugging Face's Llama rotates the two halves of each head (rotate_half); llama.cpp's
llama architecture rotates adjacent pairs, so convert_hf_to_gguf.py's `LlamaModel.permute`
reorders each head's rows: W.reshape(H, 2, d/2, in).swapaxes(1, 2).reshape(H*d, in), with H
the query heads for attn_q and the key/value heads for attn_k. The same is done here.

Tensor types (`gguf_type`): f32, f16, bf16 store every 2-D weight in that type; q8_0 and q4_0
quantize them with GGUF's own block formats along each row (the input dim), blocks of 32
(`gguf.quants.quantize`): Q8_0 a f16 scale d = absmax / 127 and 32 int8 codes round(x / d);
Q4_0 d = m / -8 with m the value of largest magnitude and 16 bytes of codes
clip(round(x / d) + 8, 0, 15) (llama.cpp's ggml-quants.c). A weight whose rows are not a
multiple of 32 long stays f16, as convert_hf_to_gguf.py keeps it; norms (1-D) stay f32.

A jaxllm-quantized run (`jaxllm quantize`, rtn) is written from its own codes where they map
exactly, never re-quantized: jaxllm's symmetric b-bit codes are offset binary, q = k + 2^(b-1)
with k = clip(round(w / s), -2^(b-1), 2^(b-1) - 1), dequantized as (q - 2^(b-1)) * s. GGUF's
Q8_0 dequantizes d * k8 (k8 an int8) and Q4_0 d * (n - 8) (n a nibble), so int8 groups of 32
are Q8_0 blocks with k8 = q - 128 and int4 groups of 32 are Q4_0 blocks with the nibbles
unchanged (Q4_0 stores element j of a block in the low nibble of byte j and element j + 16 in
its high nibble), both with d = s. The only loss could be d's f16: a scale that f16 does not
hold exactly (a bf16 one below f16's normal range, a float32 one with more mantissa) is
refused, as are other bit widths, asymmetric codes (zero points) and groups other than 32.
Every GGUF block then dequantizes to jaxllm's dequantized weight bit for bit; weights jaxllm
left in float (embedding, norms, an unquantized head) are written f16 (norms f32).

The codes and scales reach the Hugging Face layout by the same export as the weights (the
family's transposes and head reshapes move elements, never mix them): once with each quantized
weight replaced by its signed codes (exact in float32) and once by its scale broadcast over
its group, so each GGUF row of 32 carries one scale, checked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path

import jax
import numpy as np

from jaxllm import config as config_lib
from jaxllm.config import ConfigError
from jaxllm.config.quantize import INTEGER_CODES
from jaxllm.config.urls import looks_like_url
from jaxllm.convert.export import export_hf
from jaxllm.convert.families import export_family, hf_config
from jaxllm.model import quantized

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
FAMILIES = ("llama", "mistral")  # the llama architecture in llama.cpp
BLOCK = 32
_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConfigError(
            "--format gguf needs the gguf package: pip install 'jaxllm[export]'."
        ) from None
    return gguf


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face Llama tensor."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if not found or found[2] not in _LAYER:
        raise ConfigError(f"{hf_name} has no GGUF name in the llama architecture.")
    return f"blk.{found[1]}.{_LAYER[found[2]]}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute` (module docstring): rotate_half's row
    order of each of `n_head` heads to llama.cpp's interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute`."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def check_gguf(cfg: config_lib.Config, family: str | None, gguf_type: str | None) -> str:
    """The tensor type to write, or a ConfigError for what GGUF export cannot hold."""
    _gguf()
    mapped = _mapped_type(cfg.quantize)
    if mapped and gguf_type not in (None, mapped):
        raise ConfigError(
            f"this run's codes map to GGUF {mapped} exactly; --gguf-type {gguf_type} would "
            "re-quantize them: leave --gguf-type out, or export the float run it came from."
        )
    fam = export_family(cfg.model, family)
    if fam.name not in FAMILIES:
        raise ConfigError(
            f"--format gguf writes the llama architecture ({', '.join(FAMILIES)} families); "
            f"this run exports as {fam.name}."
        )
    hf = hf_config(cfg.model, fam)
    if hf.get("sliding_window"):  # llama.cpp's llama architecture attends to the whole context
        raise ConfigError(
            f"--format gguf writes full attention; this run's sliding window "
            f"({hf['sliding_window']}) has no place in llama.cpp's llama architecture."
        )
    rope = hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConfigError(
            f"--format gguf writes plain RoPE; this run's RoPE scaling ({kind}) is not written."
        )
    return mapped or gguf_type or "f16"


def _mapped_type(q) -> str | None:
    """The GGUF type a quantized run's codes are (module docstring), None for a float run."""
    if not q.enabled:
        return None
    kind = {8: "q8_0", 4: "q4_0"}.get(q.bits)
    if q.method not in INTEGER_CODES or not q.symmetric or q.group_size != BLOCK or kind is None:
        raise ConfigError(
            f"this run's codes (quantize.method={q.method}, bits={q.bits}, group_size="
            f"{q.group_size}, symmetric={q.symmetric}) have no exact GGUF type: --format gguf "
            "takes symmetric int8 or int4 codes in groups of 32 (Q8_0 / Q4_0); export the float "
            "run it came from with --gguf-type q8_0 or q4_0."
        )
    return kind


def _is_q(x) -> bool:
    return isinstance(x, quantized.QuantizedTensor)


def _signed_codes(t: quantized.QuantizedTensor) -> np.ndarray:
    """k = q - 2^(b-1) of a symmetric `t`, float32 in the weight's shape."""
    q = np.asarray(quantized._unpack(jax.device_get(t.codes), t.bits, t.packed_axis))
    return q.astype(np.float32) - 2 ** (t.bits - 1)


def _group_scales(t: quantized.QuantizedTensor) -> np.ndarray:
    """`t`'s scale at each element of the weight, float32."""
    s = np.asarray(jax.device_get(t.scales)).astype(np.float32)
    lead = s.ndim - 1 - t.n_out
    return np.repeat(s, t.group, axis=lead).reshape(t.shape)


def check_gguf_out(out, overwrite: bool) -> Path:
    """`out` as a Path when it may be written: absent, or with `overwrite` a GGUF file (never
    a directory, nor another file such as a run's config.yaml)."""
    if looks_like_url(str(out)):
        raise ConfigError(
            f"OUT {out}: --format gguf writes a local file; write it there and copy it to the "
            "bucket."
        )
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"OUT {out} is a directory; --format gguf writes one file.")
    if out.exists() and not overwrite:
        raise ConfigError(f"OUT {out} already exists; pass --overwrite to replace it.")
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"OUT {out} cannot be made: {existing} is a file.")
    if out.exists():
        with open(out, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ConfigError(
                f"OUT {out} is not a GGUF file; --overwrite replaces only one: choose a new path."
            )
    return out


def export_gguf(
    params: dict,
    cfg: config_lib.Config,
    out,
    gguf_type: str | None = None,
    family: str | None = None,
    model_state: dict | None = None,
    run_dir=None,
    overwrite: bool = False,
) -> list[str]:
    """Writes `out` (one .gguf file) of `params`, whole or not at all (a temporary sibling
    renamed into place); an existing `out` is refused unless `overwrite`. Returns one report
    line per tensor: GGUF name, shape, type."""
    gguf = _gguf()
    out = check_gguf_out(out, overwrite)
    kind = check_gguf(cfg, family, gguf_type)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        scales = None
        if cfg.quantize.enabled:  # codes and scales through the same export (module docstring)
            float_cfg = dataclasses.replace(
                cfg, quantize=dataclasses.replace(cfg.quantize, method="none")
            )
            nan = lambda x: x if _is_q(x) else np.full(x.shape, np.nan, np.float32)  # noqa: E731
            per = jax.tree.map(
                lambda x: _group_scales(x) if _is_q(x) else nan(x), params, is_leaf=_is_q
            )
            export_hf(per, float_cfg, Path(tmp) / "scales", family, model_state=model_state)
            scales = _tensors(Path(tmp) / "scales")
            params = jax.tree.map(
                lambda x: _signed_codes(x) if _is_q(x) else x, params, is_leaf=_is_q
            )
            cfg = float_cfg
        export_hf(params, cfg, hf_dir, family, model_state=model_state, run_dir=run_dir)
        hf = json.loads((hf_dir / "config.json").read_text())
        tensors = _tensors(hf_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(f".{out.name}.partial")
        try:
            # the byte tokenizer's tokenizer.json has no merges, which llama.cpp's "gpt2"
            # vocabulary must hold and gguf cannot write as an empty list: no vocabulary
            tokenizer = None if cfg.data.tokenizer == "byte" else hf_dir / "tokenizer.json"
            report = _write(gguf, part, hf, tensors, kind, tokenizer, scales)
            os.replace(part, out)
        finally:
            part.unlink(missing_ok=True)
    return report


def _tensors(hf_dir: Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _blocks(gguf, name: str, k: np.ndarray, s: np.ndarray, kind: str) -> np.ndarray:
    """GGUF Q8_0 / Q4_0 bytes [rows, blocks * block bytes] of signed codes `k` with scales `s`
    (both [rows, cols], one scale per block of 32), exactly (module docstring)."""
    rows, cols = k.shape
    k = k.reshape(rows, cols // BLOCK, BLOCK)
    s = s.reshape(rows, cols // BLOCK, BLOCK)
    d = s[..., 0]
    if not (s == d[..., None]).all():
        raise ConfigError(f"{name}: its scale groups do not fall on GGUF's rows of 32.")
    d16 = d.astype(np.float16)
    if not (d16.astype(np.float32) == d).all():
        raise ConfigError(
            f"{name} has scales that f16 does not hold exactly, so GGUF's blocks cannot carry "
            "its codes losslessly; export the float run it came from with --gguf-type."
        )
    head = d16[..., None].view(np.uint8)
    if kind == "q8_0":
        body = k.astype(np.int8).view(np.uint8)
    else:
        n = (k + 8).astype(np.uint8)
        body = n[..., :16] | (n[..., 16:] << 4)
    return np.concatenate([head, body], axis=-1).reshape(rows, -1)


def _write(
    gguf, path: Path, hf: dict, tensors: dict, kind: str, tokenizer: Path | None, scales=None
) -> list[str]:
    arch = "llama"
    n_head, n_kv = (
        hf["num_attention_heads"],
        hf.get("num_key_value_heads") or hf["num_attention_heads"],
    )
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(hf.get("_name_or_path") or "jaxllm")
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(hf.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(hf["vocab_size"])
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[kind]
    w.add_file_type(file_type)
    if tokenizer is not None and tokenizer.is_file():
        _add_tokenizer(gguf, w, tokenizer, hf)
    report = []
    for hf_name, t in tensors.items():
        name = gguf_name(hf_name)
        x = t.astype(np.float32)
        if name.endswith("attn_q.weight"):
            x = permute(x, n_head)
        elif name.endswith("attn_k.weight"):
            x = permute(x, n_kv)
        qtype = _tensor_type(gguf, kind, x)
        s = None if scales is None else scales[hf_name].astype(np.float32)
        if s is not None and np.isnan(s).all():  # a weight the run left in float
            qtype = gguf.GGMLQuantizationType.F32 if x.ndim == 1 else gguf.GGMLQuantizationType.F16
        elif s is not None:
            if name.endswith("attn_q.weight"):
                s = permute(s, n_head)
            elif name.endswith("attn_k.weight"):
                s = permute(s, n_kv)
            w.add_tensor(name, _blocks(gguf, hf_name, x, s, kind), raw_dtype=qtype)
            report.append(f"{hf_name} -> {name} {list(t.shape)} {qtype.name} (the run's codes)")
            continue
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        report.append(f"{hf_name} -> {name} {list(t.shape)} {qtype.name}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return report


def _tensor_type(gguf, kind: str, x: np.ndarray):
    """The GGML type of one tensor: norms f32, rows not a multiple of 32 f16 when quantizing."""
    T = gguf.GGMLQuantizationType
    if x.ndim == 1 or kind == "f32":
        return T.F32
    if kind in ("q8_0", "q4_0") and x.shape[-1] % BLOCK:
        return T.F16
    return {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[kind]


def _add_tokenizer(gguf, w, path: Path, hf: dict) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocabulary: tokens by id (ids the
    file lacks up to the model's vocab as [PADi]), their types (added special tokens CONTROL,
    other added USER_DEFINED), merges and the special-token ids (`gguf.SpecialVocab`)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    model = json.loads(path.read_text()).get("model", {})
    if model.get("type") != "BPE":
        raise ConfigError(
            f"--format gguf writes byte-level BPE tokenizers; {path.name} is a "
            f"{model.get('type')} one."
        )
    vocab = tok.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    added = {a.content: a.special for a in tok.get_added_tokens_decoder().values()}
    T = gguf.TokenType
    tokens, types = [], []
    for i in range(max(hf["vocab_size"], len(vocab))):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        else:
            tokens.append(t)
            types.append((T.CONTROL if added[t] else T.USER_DEFINED) if t in added else T.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(path.parent, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)

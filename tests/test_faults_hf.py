"""Broken Hugging Face directories: each case breaks one copy of a tiny valid Llama directory
(or the output directory) the way downloads, hand edits and stale files do, and `jaxllm convert
import` must answer with one `jaxllm:` line on stderr and exit 2: no traceback, the input
untouched, nothing written. The files-and-config cases also go through `jaxllm.load_model` and
`checkpoint.init_from` (`load_weights`), which read Hugging Face directories the same way."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as hf
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm import cli, config, sharding
from jaxllm.config import ConfigError, MeshConfig

SMALL = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def valid_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers: config.json + model.safetensors."""
    torch.manual_seed(0)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(**SMALL)).eval()
    path = tmp_path_factory.mktemp("valid") / "hf"
    model.save_pretrained(path)
    return path


def _tensors(d: Path) -> dict[str, np.ndarray]:
    return load_file(str(d / WEIGHTS))


def _save(d: Path, tensors: dict, name: str = WEIGHTS) -> None:
    save_file(tensors, str(d / name), metadata={"format": "pt"})


DELETE = object()


def _edit_config(d: Path, **changes) -> None:
    """config.json with `changes` (DELETE removes a key)."""
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not DELETE}))


def _shard(d: Path, keep_index: bool = True) -> None:
    """model.safetensors split in two shards (+ index when `keep_index`)."""
    tensors = _tensors(d)
    names = sorted(tensors)
    half = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in half.items():
        _save(d, {n: tensors[n] for n in part}, file)
    (d / WEIGHTS).unlink()
    if keep_index:
        weight_map = {n: f for f, part in half.items() for n in part}
        (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# Each case: (breaks the copy `hf` of the valid directory or the output `out`) -> the
# (HF_DIR, OUT_DIR) to import, and a fragment the one stderr line must contain.


def index_names_a_missing_file(hf, out):
    _shard(hf)
    (hf / "model-00002-of-00002.safetensors").unlink()
    return hf, out


def index_is_not_json(hf, out):
    _shard(hf)
    (hf / INDEX).write_text('{"weight_map": ')
    return hf, out


def index_puts_a_tensor_in_the_wrong_file(hf, out):
    _shard(hf)
    index = json.loads((hf / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (hf / INDEX).write_text(json.dumps(index))
    return hf, out


def tensor_in_two_files(hf, out):
    tensors = _tensors(hf)
    _shard(hf, keep_index=False)
    _save(hf, {"model.norm.weight": tensors["model.norm.weight"]}, "extra.safetensors")
    return hf, out


def integer_tensor(hf, out):
    tensors = _tensors(hf)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    _save(hf, tensors)
    return hf, out


def bool_tensor(hf, out):
    tensors = _tensors(hf)
    tensors["model.layers.1.input_layernorm.weight"] = np.ones(32, bool)
    _save(hf, tensors)
    return hf, out


def truncated_safetensors(hf, out):
    data = (hf / WEIGHTS).read_bytes()
    (hf / WEIGHTS).write_bytes(data[: len(data) // 2])
    return hf, out


def garbage_safetensors(hf, out):
    (hf / WEIGHTS).write_bytes(b"<html>rate limited</html>" * 10)
    return hf, out


def empty_safetensors(hf, out):
    (hf / WEIGHTS).write_bytes(b"")
    return hf, out


def no_safetensors(hf, out):
    (hf / WEIGHTS).unlink()
    return hf, out


def config_is_not_json(hf, out):
    (hf / "config.json").write_text('{"model_type": "llama", "hidden_size": 32,')
    return hf, out


def config_is_a_list(hf, out):
    (hf / "config.json").write_text("[1, 2]")
    return hf, out


def config_lacks_hidden_size(hf, out):
    _edit_config(hf, hidden_size=DELETE)
    return hf, out


def config_lacks_vocab_size(hf, out):
    _edit_config(hf, vocab_size=DELETE)
    return hf, out


def config_hidden_size_is_text(hf, out):
    _edit_config(hf, hidden_size="32")
    return hf, out


def config_heads_is_null(hf, out):
    _edit_config(hf, num_attention_heads=None)
    return hf, out


def unknown_model_type(hf, out):
    _edit_config(hf, model_type="falcon")
    return hf, out


def quantized(hf, out):
    _edit_config(hf, quantization_config={"quant_method": "gptq", "bits": 4})
    return hf, out


def shape_mismatch(hf, out):
    _edit_config(hf, intermediate_size=96)
    return hf, out


def missing_tensor(hf, out):
    tensors = _tensors(hf)
    del tensors["model.norm.weight"]
    _save(hf, tensors)
    return hf, out


def unmapped_tensor(hf, out):
    tensors = _tensors(hf)
    tensors["model.layers.0.self_attn.rotary_scale"] = np.ones(4, np.float32)
    _save(hf, tensors)
    return hf, out


def tied_config_with_a_different_head(hf, out):
    _edit_config(hf, tie_word_embeddings=True)  # the file keeps its own lm_head.weight
    return hf, out


def tokenizer_is_garbage(hf, out):
    (hf / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    return hf, out


def _word_tokenizer(hf: Path, n: int) -> None:
    """A tokenizer.json of n word ids."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(n)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(hf / "tokenizer.json"))


def tokenizer_larger_than_vocab(hf, out):
    _word_tokenizer(hf, 400)
    return hf, out


def generation_config_eos_is_text(hf, out):
    _word_tokenizer(hf, 300)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    return hf, out


def out_dir_holds_checkpoints(hf, out):
    (out / "checkpoints" / "0").mkdir(parents=True)
    (out / "checkpoints" / "0" / "marker").write_text("a previous import")
    return hf, out


def out_dir_is_a_file(hf, out):
    out.write_text("not a directory")
    return hf, out


def hf_dir_does_not_exist(hf, out):
    return hf.parent / "nowhere", out


def hf_dir_is_a_file(hf, out):
    return hf / "config.json", out


CASES = [
    (index_names_a_missing_file, "names model-00002-of-00002.safetensors, which is not in"),
    (index_is_not_json, "model.safetensors.index.json is not valid JSON"),
    (index_puts_a_tensor_in_the_wrong_file, "which does not hold it"),
    (
        tensor_in_two_files,
        "tensor model.norm.weight is in both extra.safetensors and "
        "model-00002-of-00002.safetensors",
    ),
    (integer_tensor, "model.norm.weight is stored as I32"),
    (bool_tensor, "model.layers.1.input_layernorm.weight is stored as BOOL"),
    (truncated_safetensors, "model.safetensors is not a readable safetensors file"),
    (garbage_safetensors, "model.safetensors is not a readable safetensors file"),
    (empty_safetensors, "model.safetensors is not a readable safetensors file"),
    (no_safetensors, "holds no .safetensors files"),
    (config_is_not_json, "config.json is not valid JSON"),
    (config_is_a_list, "config.json holds a JSON list, not an object"),
    (config_lacks_hidden_size, "config.json has no 'hidden_size'"),
    (config_lacks_vocab_size, "config.json has no 'vocab_size'"),
    (
        config_hidden_size_is_text,
        "config.json does not describe a valid model (model.d_model must be an integer, not '32')",
    ),
    (config_heads_is_null, "config.json holds a value of the wrong type or range"),
    (unknown_model_type, "model_type 'falcon' is not supported"),
    (quantized, "quantized checkpoint (quantization_config: quant_method gptq)"),
    (shape_mismatch, "model.layers.0.mlp.gate_proj.weight has shape [64, 32]"),
    (missing_tensor, "missing tensor model.norm.weight"),
    (unmapped_tensor, "model.layers.0.self_attn.rotary_scale [4] maps to no parameter"),
    (
        tied_config_with_a_different_head,
        "lm_head.weight is stored and differs from model.embed_tokens.weight",
    ),
    (tokenizer_is_garbage, "cannot read tokenizer"),
    (tokenizer_larger_than_vocab, "has 400 ids but config.json's vocab_size is 320"),
    (generation_config_eos_is_text, "eos_token_id is a token id or a list of them"),
    (out_dir_holds_checkpoints, "already holds files"),
    (out_dir_is_a_file, "is a file; give a directory to write into"),
    (hf_dir_does_not_exist, "nowhere does not exist"),
    (hf_dir_is_a_file, "config.json is a file, not a directory"),
]


def _digest(path: Path) -> str | None:
    """What is at `path`: None when nothing, else a hash of every file's name and bytes."""
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _broken(case, valid_dir, tmp_path) -> tuple[Path, Path]:
    hf_dir = tmp_path / "hf"
    shutil.copytree(valid_dir, hf_dir)
    return case(hf_dir, tmp_path / "out")


@pytest.mark.parametrize("case, fragment", CASES, ids=[c.__name__ for c, _ in CASES])
def test_convert_import_refuses_in_one_line(case, fragment, valid_dir, tmp_path, capsys):
    hf_dir, out = _broken(case, valid_dir, tmp_path)
    before = _digest(hf_dir), _digest(out)
    code = cli.main(["convert", "import", str(hf_dir), str(out)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert (code, captured.out) == (cli.EXIT_USER_ERROR, "")
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxllm:"), captured.err
    assert fragment in lines[0]
    assert (_digest(hf_dir), _digest(out)) == before


# The cases about the directory's own files: `jaxllm.load_model(HF_DIR)` and
# `checkpoint.init_from=HF_DIR` read them through the same model_config / Reader.
FILE_CASES = [
    c
    for c in CASES
    if c[0]
    not in (
        out_dir_holds_checkpoints,
        out_dir_is_a_file,
        hf_dir_does_not_exist,
        hf_dir_is_a_file,
        tokenizer_is_garbage,
        tokenizer_larger_than_vocab,
        generation_config_eos_is_text,
    )
]


@pytest.mark.parametrize("case, fragment", FILE_CASES, ids=[c.__name__ for c, _ in FILE_CASES])
def test_load_model_and_init_from_refuse_with_a_config_error(case, fragment, valid_dir, tmp_path):
    from jaxllm.load import load_weights

    hf_dir, _ = _broken(case, valid_dir, tmp_path)
    before = _digest(hf_dir)
    with pytest.raises(ConfigError) as e:
        jaxllm.load_model(hf_dir)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    model_cfg = config.from_dict({"model": _valid_model_fields(valid_dir)}).model
    mesh = sharding.make_mesh(MeshConfig(), _one_device())
    with pytest.raises(ConfigError) as e:
        load_weights(hf_dir, model_cfg, mesh)
    assert fragment in str(e.value) or "other parameters" in str(e.value)
    assert _digest(hf_dir) == before


def _valid_model_fields(valid_dir) -> dict:
    from jaxllm.convert.families import model_fields

    return model_fields(json.loads((valid_dir / "config.json").read_text()))


def _one_device():
    import jax

    return jax.devices()[:1]

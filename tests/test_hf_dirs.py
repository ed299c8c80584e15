"""Hugging Face directories as they come from the Hub, beyond config.json + model.safetensors:
an index next to extra files (Mistral's consolidated.safetensors), a tied model that stores its
head anyway, the tokenizer's side files and generation_config.json (special tokens, chat
template, EOS ids), models without a tokenizer; and the way back: an exported run that
transformers' AutoModelForCausalLM + AutoTokenizer generate from exactly as `jaxllm generate`
does, stopping at the same EOS."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers as hf
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm import JaxllmWarning, cli, config, sharding
from jaxllm.config import ConfigError, MeshConfig
from jaxllm.convert import hf as convert_hf
from jaxllm.convert import reader
from jaxllm.convert.export import export_hf
from jaxllm.data import tokenizer as tokenizer_lib

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TEXT = [
    "the cat sat on the mat and the dog sat on the log. " * 4,
    "a quick brown fox jumps over the lazy dog; then it naps in the sun. " * 4,
]
PROMPT, NEW = "the dog", 10


def _llama(vocab: int, seed: int = 0, cls=hf.LlamaForCausalLM, config_cls=hf.LlamaConfig, **extra):
    """A tiny transformers model with every weight perturbed (varied greedy output)."""
    torch.manual_seed(seed)
    model = cls(config_cls(vocab_size=vocab, **SMALL, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model


def _run(*argv) -> int:
    return cli.main([str(a) for a in argv])


def _one_device_mesh():
    return sharding.make_mesh(MeshConfig(), jax.devices()[:1])


def _equal_trees(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_index_decides_which_files_are_read(tmp_path):
    """A Mistral Hub repo: sharded Hugging Face files + index, and consolidated.safetensors with
    the same weights under Mistral's own names, which transformers never reads. Without an
    index, model.safetensors is the only file read when present."""
    model = _llama(320, cls=hf.MistralForCausalLM, config_cls=hf.MistralConfig)
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    repo = tmp_path / "repo"
    model.save_pretrained(repo, max_shard_size="20KB")
    assert (repo / reader.INDEX).is_file() and not (repo / "model.safetensors").exists()
    tensors = load_file(str(plain / "model.safetensors"))
    mistral = {
        n.replace("model.embed_tokens.", "tok_embeddings.")
        .replace("model.layers.", "layers.")
        .replace("self_attn.q_proj", "attention.wq"): t
        for n, t in tensors.items()
    }
    save_file(mistral, str(repo / "consolidated.safetensors"))
    assert reader.is_hf_dir(repo)
    hf.AutoModelForCausalLM.from_pretrained(repo)  # transformers reads it: so must we

    cfg = convert_hf.model_config(repo)
    mesh = _one_device_mesh()
    want, _, _ = convert_hf.load_params(plain, cfg.model, mesh)
    got, _, _ = convert_hf.load_params(repo, cfg.model, mesh)
    _equal_trees(got, want)

    # model.safetensors without an index: consolidated.safetensors beside it is not read
    shutil.copy(repo / "consolidated.safetensors", plain)
    _equal_trees(convert_hf.load_params(plain, cfg.model, mesh)[0], want)
    # an index alone (its shards still to be downloaded) is a Hugging Face directory to refuse
    only_index = tmp_path / "only_index"
    only_index.mkdir()
    for name in ("config.json", reader.INDEX):
        shutil.copy(repo / name, only_index)
    assert reader.is_hf_dir(only_index)
    with pytest.raises(ConfigError, match="which is not in .*download every file the index"):
        convert_hf.model_config(only_index)


def test_tied_model_storing_its_head_imports_when_the_head_is_the_embedding(tmp_path):
    model = _llama(320, tie_word_embeddings=True)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    tensors = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    cfg = convert_hf.model_config(src)
    mesh = _one_device_mesh()
    want, _, _ = convert_hf.load_params(src, cfg.model, mesh)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    got, _, report = convert_hf.load_params(src, cfg.model, mesh)
    _equal_trees(got, want)
    assert not any("lm_head" in str(m) for m in report)


def _bpe(tmp_path) -> Path:
    """A byte-level BPE tokenizer.json (<pad>, <bos>, <eos> = 0, 1, 2) in its own directory."""
    return tokenizer_lib.train_bpe(TEXT, 300, tmp_path / "tok")


def _greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens of a transformers model, with no EOS stop."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def _first_new(seq: list[int], seen: set[int], start: int = 2) -> int:
    """The position of the first token at or after `start` that neither the prompt nor an
    earlier step has (so making it a stop token changes nothing before it)."""
    return next(k for k in range(start, len(seq)) if seq[k] not in seen | set(seq[:k]))


def _hf_text(model_dir: Path, n: int, prompt_ids: list[int] | None = None) -> tuple[str, list]:
    """transformers' greedy continuation of PROMPT (text, new ids), tokenized (unless
    `prompt_ids` are given), decoded and stopped by the directory's own tokenizer and
    generation config."""
    tok = hf.AutoTokenizer.from_pretrained(model_dir)
    model = hf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    ids = ids if prompt_ids is None else torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n
        )
    new = out[0, ids.shape[1] :].tolist()
    return tok.decode(new, skip_special_tokens=True), new


def _jaxllm_text(run: Path, capsys, n: int) -> str:
    capsys.readouterr()
    assert (
        _run(
            "generate",
            run,
            "--prompt",
            PROMPT,
            "--temperature",
            "0",
            "--max-new-tokens",
            n,
            "--kv-cache-dtype",
            "float32",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def test_import_brings_tokenizer_files_and_generate_stops_at_their_eos(tmp_path, capsys):
    """tokenizer_config.json (specials, a list-form chat template), special_tokens_map.json and
    generation_config.json travel into the run; `jaxllm generate` stops at generation_config's
    extra EOS id as transformers does, with the same text."""
    tok_json = _bpe(tmp_path)
    tok = tokenizer_lib.load_tokenizer(str(tok_json))
    model = _llama(tok.vocab_size, seed=1)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    shutil.copy(tok_json, src / "tokenizer.json")
    templates = [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools }}"},
    ]
    (src / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "chat_template": templates,
            }
        )
    )
    (src / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<bos>"}))
    prompt_ids = [tok.bos_id, *tok.encode(PROMPT).tolist()]
    seq = _greedy(model, prompt_ids, NEW)
    k = _first_new(seq, set(prompt_ids) | {0, 1, 2})
    assert 2 not in seq[:k]
    (src / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": [2, seq[k]]})
    )

    run = tmp_path / "run"
    assert _run("convert", "import", src, run, "model.dtype=float32") == 0
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        assert (run / name).read_bytes() == (src / name).read_bytes(), name
    run_cfg = config.load(run / "config.yaml")
    assert run_cfg.data.tokenizer == str((run / "tokenizer.json").resolve())
    run_tok = tokenizer_lib.load_tokenizer(run_cfg.data.tokenizer)
    assert (run_tok.bos_id, run_tok.eos_id, run_tok.pad_id) == (1, 2, 0)
    assert run_tok.chat_template == templates[0]["template"]
    assert run_tok.chat_templates["tool_use"] == "{{ tools }}"

    _, new = _hf_text(src, NEW, prompt_ids)  # (its tokenizer.json adds no BOS itself)
    assert new == seq[: k + 1]  # stopped by the extra EOS id, which transformers keeps
    assert _jaxllm_text(run, capsys, NEW) == tok.decode(seq[:k])


def test_small_vocabulary_without_tokenizer_imports_with_no_tokenizer(tmp_path, capsys):
    """Fewer ids than the byte tokenizer's 258 and no tokenizer.json: the run gets
    data.tokenizer=none (with a warning) and computes logits; text is refused in one line."""
    model = _llama(200)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    run = tmp_path / "run"
    with pytest.warns(JaxllmWarning, match=r"smaller than the byte tokenizer's \(258\)"):
        convert_hf.import_hf(src, run, ["model.dtype=float32"])
    assert config.load(run / "config.yaml").data.tokenizer == "none"
    tokens = np.random.default_rng(0).integers(0, 200, (1, 8))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(jaxllm.load_model(run)(tokens).logits, want, atol=1e-4, rtol=1e-4)
    with pytest.warns(JaxllmWarning, match="data.tokenizer=none"):
        jaxllm.load_model(src)  # the same for a Hugging Face directory loaded directly

    capsys.readouterr()
    assert _run("generate", run, "--prompt", "hi") == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "this run has no tokenizer (imported without one)" in err[0]
    with pytest.raises(ConfigError, match="set data.tokenizer=PATH to a tokenizer.json"):
        tokenizer_lib.load_tokenizer("none")
    assert tokenizer_lib.tokenizer_fingerprint("none") == "none"


def test_byte_tokenizer_on_a_large_vocabulary_warns_and_exports_its_ids(
    tmp_path, monkeypatch, capsys
):
    """An HF model with 1024 ids imported without tokenizer.json gets the byte tokenizer, which
    decodes only ids < 258: a warning at import and at generate. Its export still writes the
    byte tokenizer's special ids (there is no tokenizer file to write)."""
    monkeypatch.setattr(tokenizer_lib, "_COVERAGE_WARNED", set())
    src = tmp_path / "hf"
    _llama(1024).save_pretrained(src)
    run = tmp_path / "run"
    with pytest.warns(JaxllmWarning, match="ids >= 258 decode to nothing") as record:
        convert_hf.import_hf(src, run)
    assert len(record) == 1
    tokenizer_lib._COVERAGE_WARNED.clear()
    # warnings are errors here (pyproject): generate stops at its warning, before decoding
    with pytest.raises(JaxllmWarning, match="jaxllm generate: model.vocab_size is 1024"):
        _run("generate", run, "--prompt", "hi")
    capsys.readouterr()
    assert _run("convert", "export", run, tmp_path / "out") == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    ids = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 0}
    assert {k: exported[k] for k in ids} == ids
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == ids
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def _random_params(model_cfg) -> dict:
    """Parameters of the model's shapes, drawn in numpy (norm scales near 1): what init would
    give, without compiling init."""
    from jaxllm.model import abstract_model

    rng = np.random.default_rng(0)

    def draw(path, a):
        noise = rng.normal(0.0, 0.5, a.shape).astype(a.dtype)
        return 1 + 0.2 * noise if path[-1].key == "scale" else noise

    return jax.tree_util.tree_map_with_path(draw, abstract_model(model_cfg)[1])


def _swap(params: dict, a: int, b: int) -> dict:
    """The same model with token ids a and b exchanged (embedding rows, head columns)."""
    out = jax.tree.map(np.array, params)
    emb = out["embed"]["embedding"]
    emb[[a, b]] = emb[[b, a]]
    if "lm_head" in out:
        out["lm_head"][:, [a, b]] = out["lm_head"][:, [b, a]]
    return out


def test_exported_run_generates_in_transformers_like_jaxllm(tmp_path, capsys):
    """A run with a BPE tokenizer (random parameters, no training) exported: the
    directory holds config.json and generation_config.json with the BOS/EOS/PAD ids, the
    tokenizer.json and a minimal tokenizer_config.json, so AutoModelForCausalLM + AutoTokenizer
    greedy-generate the same text as `jaxllm generate`; two token ids are exchanged so that
    the greedy output reaches EOS after a few tokens, and both stop there."""
    from jaxllm import checkpoint

    tok_json = _bpe(tmp_path)
    tok = tokenizer_lib.load_tokenizer(str(tok_json))
    run = tmp_path / "run"
    cfg = config.from_dict(
        {
            "run": {"dir": str(run)},
            "model": dict(
                vocab_size=tok.vocab_size,
                d_model=32,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                mlp_dim=64,
                max_seq_len=64,
                dtype="float32",
                param_dtype="float32",
            ),
            "data": {"tokenizer": str(tok_json), "seq_len": 32},
        }
    ).validate()
    params = _random_params(cfg.model)

    probe = tmp_path / "probe"  # the model as transformers sees it, to find its greedy tokens
    export_hf(params, cfg, probe)
    prompt_ids = [tok.bos_id, *tok.encode(PROMPT).tolist()]
    seq = _greedy(hf.AutoModelForCausalLM.from_pretrained(probe).eval(), prompt_ids, NEW)
    k = _first_new(seq, set(prompt_ids) | {0, 1, 2}, start=3)
    assert 2 not in seq[:k]
    params = _swap(params, seq[k], tok.eos_id)  # now EOS where seq[k] was

    checkpoint.save_params(
        checkpoint.checkpoint_dir(run),
        params,
        step=0,
        config=config.to_dict(cfg),
        tokenizer=checkpoint.tokenizer_record(cfg.data.tokenizer),
    )
    config.dump(cfg, run / "config.yaml")
    out = tmp_path / "exported"
    assert _run("convert", "export", run, out) == 0
    exported = json.loads((out / "config.json").read_text())
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert {k: exported[k] for k in ids} == ids
    assert json.loads((out / "generation_config.json").read_text()) == ids
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<eos>"

    assert hf.AutoTokenizer.from_pretrained(out)(PROMPT)["input_ids"] == prompt_ids
    theirs, new = _hf_text(out, NEW)
    assert new == [*seq[:k], 2]  # stopped at EOS, after k tokens
    assert _jaxllm_text(run, capsys, NEW) == theirs == tok.decode(seq[:k])


def test_load_model_computes_in_the_dtype_config_json_names(tmp_path):
    model = _llama(300)
    model.save_pretrained(tmp_path / "hf")  # float32 weights, config.json dtype float32
    tokens = (np.arange(12, dtype=np.int32).reshape(2, 6) * 7) % 300
    with torch.no_grad():
        want = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got = np.asarray(jaxllm.load_model(tmp_path / "hf")(tokens).logits)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    bf16 = np.asarray(
        jaxllm.load_model(tmp_path / "hf", overrides=["model.dtype=bfloat16"])(tokens).logits
    )
    assert np.abs(bf16 - want).max() > 1e-3  # an override still decides

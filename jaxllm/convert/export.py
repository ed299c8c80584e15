"""Hugging Face directories out: `jaxllm convert export` (`export_hf`) writes a model's
config.json and safetensors in a family's layout, one layer (or one layer's expert) on the host
at a time, with the run's tokenizer and its special-token ids.

The directory is written whole or not at all (`jaxllm.config.outputs.written`): built in a
hidden sibling, config.json last, and renamed into place; a directory that already holds files
is refused unless `overwrite`. safetensors and Orbax report a full or read-only disk in their own
exception types; `library_os_errors` gives those back as the OSError they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, processors

from jaxllm import config as config_lib
from jaxllm.config import ConfigError
from jaxllm.config.outputs import check_output, written
from jaxllm.convert import compressed, compressed_coded, mxfp4
from jaxllm.convert.byte_tokenizer import write_byte_tokenizer
from jaxllm.convert.families import (
    SCORE_ARCHITECTURE,
    TOKEN_ARCHITECTURE,
    TOKEN_CLASSIFIER_FAMILIES,
    export_family,
    hf_config,
)
from jaxllm.convert.links import token_classifier
from jaxllm.convert.mapping import Mapped, each, flatten
from jaxllm.convert.reader import (
    INDEX,
    PREPROCESSOR,
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    with_pixel_budget,
)
from jaxllm.data.tokenizer import (
    GENERATION_CONFIG,
    NO_TOKENIZER,
    ByteTokenizer,
    HFTokenizer,
    generation_config,
    load_tokenizer,
)
from jaxllm.model import coded, fp8_delayed, quantized

SHARD_BYTES = 4 * 2**30  # a new safetensors file past this many bytes
OUT_FLAG = "HF_DIR"  # how refusals name the output directory
# The OS error code in safetensors' (Rust) and tensorstore's messages.
_OS_ERROR = re.compile(r"os error (\d+)|os_error_code='?(\d+)")


@contextlib.contextmanager
def library_os_errors(path) -> Iterator[None]:
    """An exception of safetensors, tokenizers or Orbax that carries an OS error code (a full
    disk: `File too large (os error 27)`) raised again as that OSError, naming `path`."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        found = _OS_ERROR.search(str(e))
        if not found:
            raise
        code = int(found[1] or found[2])
        raise OSError(code, os.strerror(code), str(path)) from e


def _history(path: str) -> bool:
    return path.rsplit("/", 1)[-1].endswith(fp8_delayed.SUFFIX)


def export_hf(
    params: dict,
    cfg: config_lib.Config,
    hf_dir,
    family: str | None = None,
    shard_bytes: int = SHARD_BYTES,
    model_state: dict | None = None,
    run_dir=None,
    overwrite: bool = False,
) -> list[Mapped]:
    """Writes config.json and model.safetensors (or shards + index) of `params` and
    `model_state` (nested dicts of arrays, possibly sharded: each tensor is fetched to the host
    one layer, or one layer's expert, at a time), in the family's first layout (Mixtral,
    DeepSeek-V3: per-expert tensors); and the run's tokenizer with its special-token ids
    (`_write_tokenizer`; `run_dir`: where else to look for a generation_config.json, and a
    vision-language model's processor files). A
    `hf_dir` that holds files is refused, or with `overwrite` replaced once the new one is
    complete."""
    check_output(hf_dir, flag=OUT_FLAG, overwrite=overwrite)
    if cfg.model.value_head or cfg.model.distill_proj:
        # PPO's critic and feature distillation's projections have no Hugging Face
        # counterpart and no part in the LM's output: the LM goes alone
        params = {k: v for k, v in params.items() if k not in ("value", "distill_proj")}
        lm = dataclasses.replace(cfg.model, value_head=False, distill_proj=())
        cfg = dataclasses.replace(cfg, model=lm)
    m = cfg.model
    compressed_coded.check_exportable(cfg.quantize)
    fam = export_family(m, family)
    hf = hf_config(m, fam)
    # delayed fp8's amax histories are training state, not weights: they stay behind
    state = flatten(model_state or {})
    flat = {**flatten(params), **{p: a for p, a in state.items() if not _history(p)}}
    shapes = {p: tuple(a.shape) for p, a in flat.items()}
    if m.head == "score" and cfg.train.objective == "prm":
        hf = _token_classifier(hf, fam.name, m.score_bias)
        fam = token_classifier(fam)  # the score head's two labels (0, s)
    elif m.head == "score" and m.score_bias:
        raise ConfigError(
            f"{hf['architectures'][0]} has no bias on its score head, and this reward model "
            "has one (model.score_bias=true): transformers would drop it and change the scores."
        )
    elif m.head == "score":
        _check_pad(cfg, hf["architectures"][0])
    links = fam.layouts(m)[0]
    owned = {p for link in links for p in link.ours}
    if owned != set(flat):
        raise ConfigError(
            f"the {fam.name} mapping does not cover the parameters {sorted(set(flat) ^ owned)}."
        )
    files: list[dict] = [{}]
    size = 0
    report = []
    targets, ignore = [], []  # compressed-tensors' quantized and float linear modules
    coded_kind = None  # a `coded.CodedTensor` of the run (fp8, int8 W8A8, mxfp4), if any
    for link in links:
        first = flat[link.ours[0]]
        writer = None  # how a quantized weight is written: integer codes or the coded kinds
        if isinstance(first, quantized.QuantizedTensor):
            writer = compressed
        elif isinstance(first, coded.CodedTensor) and fam.name == "gpt_oss":
            if first.kind != mxfp4.METHOD or ".experts." not in link.hf:
                raise ConfigError(
                    f"{link.hf}: a gpt_oss checkpoint holds MXFP4 experts only, not "
                    f"{first.kind} codes of {link.ours[0]}; export the float run, or quantize "
                    "it with --method mxfp4 and quantize.skip=['*/attn/*']."
                )
            writer, coded_kind = mxfp4, first  # the released files' *_blocks / *_scales
        elif isinstance(first, coded.CodedTensor):
            writer, coded_kind = compressed_coded, first
        for index in each(link, shapes):  # one layer (and expert) at a time to the host
            xs = [jax.device_get(_at(flat[p], index)) for p in link.ours]
            if writer is mxfp4:
                tensors = mxfp4.link_tensors(link, xs, link.name(index))
                targets.append(link.name(index))
            elif writer:
                tensors = writer.link_tensors(link, xs[0], link.name(index))
                targets.append(link.name(index).removesuffix(".weight"))
            else:
                tensors = {link.name(index): link.to_hf([np.asarray(x) for x in xs])}
                if link.kind == "linear" and link.name(index).endswith(".weight"):
                    ignore.append(link.name(index).removesuffix(".weight"))
            nbytes = sum(t.nbytes for t in tensors.values())
            if size and size + nbytes > shard_bytes:
                files.append({})
                size = 0
            files[-1].update(tensors)
            size += nbytes
        report.append(Mapped.of(link, shapes, str(flat[link.ours[0]].dtype)))
    if targets and fam.name == "gpt_oss" and coded_kind is not None:
        hf["quantization_config"] = mxfp4.quantization_config(targets)
    elif targets and coded_kind is not None:
        hf["quantization_config"] = compressed_coded.quantization_config(
            coded_kind, targets, ignore
        )
    elif targets:
        hf["quantization_config"] = compressed.quantization_config(cfg.quantize, targets, ignore)
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    with written(hf_dir, flag=OUT_FLAG, overwrite=overwrite) as tmp, library_os_errors(tmp):
        for name, tensors in zip(names, files):
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        if len(files) > 1:
            index = {
                "metadata": {"total_size": sum(t.nbytes for f in files for t in f.values())},
                "weight_map": {t: n for n, f in zip(names, files) for t in f},
            }
            (tmp / INDEX).write_text(json.dumps(index, indent=2))
        ids = _write_tokenizer(cfg, tmp, run_dir)
        for name in PROCESSOR_FILES if m.vision is not None and run_dir is not None else ():
            if (Path(run_dir) / name).is_file():  # the image processor's, kept by the import
                shutil.copy(Path(run_dir) / name, tmp / name)
        if m.vision is not None and (tmp / PREPROCESSOR).is_file():  # with the run's budget
            pre = json.loads((tmp / PREPROCESSOR).read_text())
            new = with_pixel_budget(pre, m.vision.min_pixels, m.vision.max_pixels)
            if new != pre:
                (tmp / PREPROCESSOR).write_text(json.dumps(new, indent=2) + "\n")
        if m.encoder.position_offset:  # RoBERTa: pad_token_id places the positions, it stays
            ids.pop("pad_token_id", None)
        hf = {**hf, **ids}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return report


def _at(x, index: tuple[int, ...]):
    """Element `index` of a stacked parameter (an array or a `QuantizedTensor`)."""
    return jax.tree.map(lambda a: a[index], x) if index else x


def _token_classifier(hf: dict, family: str, bias: bool) -> dict:
    """config.json of a process reward model (`train.objective=prm`): the family's
    `*ForTokenClassification` with TRL's two labels, whose logits (0, s) at each token give
    softmax(...)[1] = sigmoid(s), the PRM's step probability (`links.PRM_HEAD`)."""
    if family not in TOKEN_CLASSIFIER_FAMILIES:
        raise ConfigError(
            f"a process reward model exports as a *ForTokenClassification, which jaxllm writes "
            f"for {', '.join(TOKEN_CLASSIFIER_FAMILIES)}, not {family}; export with --family "
            "set to one of those."
        )
    name = hf["architectures"][0].removesuffix(SCORE_ARCHITECTURE)
    return {
        **hf,
        "architectures": [name + TOKEN_ARCHITECTURE],
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
        "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        "token_classification_bias": bias,
        "classifier_dropout": 0.0,
    }


def _check_pad(cfg: config_lib.Config, architecture: str) -> None:
    """A reward model's export needs a pad id: transformers' `*ForSequenceClassification`
    reads each sequence's score at its last token that is not `pad_token_id`."""
    spec = cfg.data.tokenizer
    if spec == NO_TOKENIZER or load_tokenizer(spec).found_pad_id is None:
        raise ConfigError(
            f"the run's tokenizer ({spec}) has no pad token, which a {architecture} needs to "
            "find each sequence's last token; give the tokenizer one (pad_token in its "
            "tokenizer_config.json) and export again."
        )


def exported_backend(data_cfg, tok: HFTokenizer) -> tuple[Tokenizer, bool]:
    """The run's tokenizer.json as an export writes it, and whether that differs from the file:
    with a BOS post-processor added when the run puts BOS before every document
    (data.add_bos) and the file has none."""
    backend = Tokenizer.from_file(tok.name)
    if data_cfg.add_bos and tok.bos_id is not None and backend.post_processor is None:
        bos = backend.id_to_token(tok.bos_id)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
        )
        return backend, True
    return backend, False


def _write_tokenizer(cfg: config_lib.Config, hf_dir: Path, run_dir=None) -> dict:
    """Writes the run's tokenizer files into `hf_dir` and returns the special-token ids for
    config.json, so that `AutoTokenizer` and `generate` in transformers see what jaxllm sees.

    generation_config.json: the run's own (imported with the model; found beside its
    tokenizer file or in `run_dir`) with any missing bos/eos/pad id filled in from the
    tokenizer. For a tokenizer.json: the file itself, the run's tokenizer_config.json,
    special_tokens_map.json and chat template where it has them (else a minimal
    tokenizer_config.json naming the special tokens, which `AutoTokenizer` needs to know them),
    and, when the run puts BOS before every document (data.add_bos) and the tokenizer.json
    has no post-processor, one that does the same, since transformers' tokenizer adds only
    what tokenizer.json says (jaxllm encodes without it: the packer adds BOS). The byte
    tokenizer's tokenizer.json and tokenizer_config.json are built (`byte_tokenizer`) for a
    run made for it; a model of more than twice its ids (an import that fell back to bytes)
    gets only its ids."""
    spec = cfg.data.tokenizer
    if spec == NO_TOKENIZER:
        return {}
    tok = load_tokenizer(spec)
    pad = tok.found_pad_id  # not pad_id, which is 0 (a real token) for a tokenizer without one
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": pad}
    gen = generation_config(spec, run_dir)
    gen = {**{k: v for k, v in ids.items() if v is not None}, **gen}
    (hf_dir / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    if isinstance(tok, ByteTokenizer) and cfg.model.vocab_size <= 2 * tok.vocab_size:
        # a run made for the byte tokenizer (`check_coverage`), not an HF model's fallback
        write_byte_tokenizer(hf_dir, cfg.data.add_bos, cfg.model.max_seq_len)
    if not isinstance(tok, HFTokenizer):
        return ids
    source = Path(tok.name)
    backend, changed = exported_backend(cfg.data, tok)
    if changed:
        backend.save(str(hf_dir / "tokenizer.json"))
    else:
        shutil.copy(source, hf_dir / "tokenizer.json")
    for name in TOKENIZER_FILES:
        if (source.parent / name).is_file():
            shutil.copy(source.parent / name, hf_dir / name)
    if not (source.parent / "tokenizer_config.json").is_file():
        specials = {
            f"{k}_token": backend.id_to_token(i)
            for k, i in (("bos", tok.bos_id), ("eos", tok.eos_id), ("pad", pad))
            if i is not None
        }
        minimal = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "model_max_length": cfg.model.max_seq_len,
            "clean_up_tokenization_spaces": False,
        }
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(minimal, indent=2) + "\n")
    return ids

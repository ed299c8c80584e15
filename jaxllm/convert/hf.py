"""Hugging Face directories in: the run config of one (`model_config`), its parameters
streamed onto a mesh (`load_params`), and `jaxllm convert import` (`import_hf`).

Import never assembles the model on one device or in host memory at once: every parameter is
created with `jax.make_array_from_callback` and its `NamedSharding`, and the callback reads only
what the asking device's shard needs (for a stacked [N, ...] parameter, the layers in its
slice, and for stacked experts [N, E, ...] the experts in its slice too; for a tensor of
identical layout, just the shard's rows and columns through `safe_open(...).get_slice`).
Before anything is read, `check` (`mapping.py`) picks the family's tensor layout that the files
hold (Mixtral, DeepSeek-V3: per-expert or fused experts), compares every expected name and
shape with the files' headers and refuses, with one ConfigError, tensors it cannot map, missing
ones and shape mismatches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import checkpoint, sharding
from jaxllm import config as config_lib
from jaxllm.config import ConfigError, JaxllmWarning, ModelConfig
from jaxllm.config.outputs import check_output, written
from jaxllm.convert import compressed, packed
from jaxllm.convert.export import library_os_errors
from jaxllm.convert.families import family_of, first_line, is_token_classifier, model_fields
from jaxllm.convert.links import Link, token_classifier
from jaxllm.convert.mapping import Mapped, check, each, element_shapes, flatten, unflatten
from jaxllm.convert.reader import (
    DTYPES,
    PREPROCESSOR,
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    Reader,
    pixel_budget,
    read_hf_config,
)
from jaxllm.data.tokenizer import (
    GENERATION_CONFIG,
    NO_TOKENIZER,
    ByteTokenizer,
    check_coverage,
    generation_stop_ids,
    load_tokenizer,
)
from jaxllm.model import abstract_model, abstract_model_state

OUT_FLAG = "OUT_DIR"  # how refusals name the run directory being written
PRM_SOURCE = {"path": "steps.jsonl", "format": "stepwise"}
"""An imported process reward model's data source, a name to replace (`data.sources=...`)
before training it on: train.objective=prm reads stepwise solutions only."""


def load_params(hf_dir, cfg: ModelConfig, mesh) -> tuple[dict, dict, list[Mapped]]:
    """(parameters, model state, report) of `cfg` from a Hugging Face directory, each array
    created in its shards on `mesh`. The model state (MoE routing biases) comes from the
    checkpoint where the family has it (DeepSeek-V3's `e_score_correction_bias`) and starts at
    zero otherwise, as in a fresh train state (a Mixtral fine-tuned with bias balancing)."""
    hf = read_hf_config(hf_dir)
    family = family_of(hf)
    if is_token_classifier(hf):  # a process reward model: two labels for our one score
        family = token_classifier(family)
    reader = Reader(hf_dir)
    _, abstract, axes = abstract_model(cfg)
    abstract_ms, ms_axes = abstract_model_state(cfg)
    sharding.check_divisible(mesh, abstract, axes)
    state_paths = frozenset(flatten(abstract_ms))
    flat = {**flatten(abstract), **flatten(abstract_ms)}
    shapes = {p: tuple(a.shape) for p, a in flat.items()}
    links = check(reader, family, cfg, shapes, optional=state_paths)
    flat_sh = {
        **flatten(sharding.tree_shardings(mesh, axes)),
        **flatten(sharding.tree_shardings(mesh, ms_axes)),
    }
    out = {}
    for link in links:
        for k, path in enumerate(link.ours):
            out[path] = jax.make_array_from_callback(
                shapes[path], flat_sh[path], _callback(reader, link, k, shapes, flat[path].dtype)
            )
    for path in state_paths - set(out):
        zeros = functools.partial(jnp.zeros, shapes[path], flat[path].dtype)
        out[path] = jax.jit(zeros, out_shardings=flat_sh[path])()
    report = [Mapped.of(link, shapes, _stored_dtype(reader, link, shapes)) for link in links]
    params = unflatten({p: a for p, a in out.items() if p not in state_paths})
    return params, unflatten({p: a for p, a in out.items() if p in state_paths}), report


def _stored_dtype(reader: Reader, link: Link, shapes: dict) -> str:
    """The dtype of the link's (first) HF tensor, as a numpy name where we know it."""
    dt = reader.dtypes[link.name(next(each(link, shapes)))]
    return DTYPES.get(dt, dt)


def _callback(reader: Reader, link: Link, k: int, shapes: dict, dtype) -> Callable:
    """Shard reader for component k of `link`: stacks the HF tensors of the layers (and
    experts) in the shard's slice, each cut to the rest of the shard's index. Devices holding
    the same shard (replicas) ask for the same index one after another, so the last shard
    built is kept."""
    per_element = element_shapes(link, shapes)
    depth, lead = len(link.indices), link.n_lead
    last: dict = {}

    def one(at, index):
        """Component k of the HF tensor `at` (layer, expert, ...) at `index`."""
        name = link.name(at)
        if link.kind == "same" and len(link.ours) == 1:  # same layout: read just the slice
            return reader.read(name, index)
        # Axes kept in front (fused experts) are read only in the shard's slice.
        w = reader.read(name, index[:lead]) if lead else reader.read(name)
        parts = [w.shape[:lead] + s[lead:] for s in per_element]
        return link.to_ours(w, parts)[k][(slice(None),) * lead + index[lead:]]

    def build(index, at=()):
        if len(at) == depth:
            return one(at, index)
        split = range(shapes[link.ours[k]][len(at)])[index[0]]
        return np.stack([build(index[1:], (*at, j)) for j in split])

    def callback(index):
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in last:
            last.clear()
            last[key] = np.ascontiguousarray(build(tuple(index)).astype(dtype))
        return last[key]

    return callback


def _json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({first_line(e)}).") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{path} holds {type(out).__name__}, not a JSON object.")
    return out


def model_config(hf_dir, overrides=(), dequantize: bool = False) -> config_lib.Config:
    """The run config of a Hugging Face directory: its architecture, its storage dtype as
    param_dtype, config.json's dtype (else the storage dtype) as the compute dtype, its
    tokenizer.json if any; then `key=value` overrides.

    Without a tokenizer.json the run gets the byte tokenizer, or, when the vocabulary is too
    small for it (fewer than 258 ids), `data.tokenizer=none` with a JaxllmWarning: the model
    still loads and computes logits from ids, and only encoding or decoding text is refused."""
    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    quantize = packed.run_quantize(hf, hf_dir, dequantize)  # {}, or its codes' quantize.*
    if dequantize and not quantize:
        raise ConfigError(f"--dequantize: {hf_dir} holds no quantized weights to dequantize.")
    if dequantize:  # a float run: the Reader dequantizes every packed module
        quantize = {}
    fields = model_fields(hf, hf_dir / "config.json")
    if "vision" in fields and (hf_dir / PREPROCESSOR).is_file():  # the images' pixel budget
        fields["vision"] = {**fields["vision"], **pixel_budget(_json(hf_dir / PREPROCESSOR))}
    family = family_of(hf)
    if family.file_fields is not None:  # what the tensors say (BERT's pooler)
        for key, value in family.file_fields(frozenset(Reader(hf_dir).shapes)).items():
            fields[key] = {**fields.get(key, {}), **value}
    try:  # types of the file's values, before overrides (whose errors name their own keys)
        config_lib.from_dict({"model": dict(fields)})
    except ConfigError as e:
        raise ConfigError(
            f"{hf_dir / 'config.json'} does not describe a valid model ({str(e).rstrip('.')}); "
            "compare it with the model's original config.json."
        ) from None
    fields["param_dtype"] = Reader(hf_dir).param_dtype()
    # Compute in the dtype config.json names (transformers 5 `dtype`, older `torch_dtype`), as
    # transformers does; without one, in the storage dtype. `model.dtype=...` overrides it.
    named = hf.get("dtype") or hf.get("torch_dtype")
    fields["dtype"] = (
        named if named in ("float32", "bfloat16", "float16") else fields["param_dtype"]
    )
    offset = fields.get("encoder", {}).get("position_offset", 0)  # RoBERTa's first rows
    tree = {"model": fields, "data": {"seq_len": min(256, fields["max_seq_len"] - offset)}}
    if quantize:
        tree["quantize"] = quantize
    objective = {"encoder": "mlm", "encoder_decoder": "span_corruption"}.get(fields.get("kind"))
    if objective:  # what an encoder / encoder–decoder trains with
        tree["train"] = {"objective": objective}
    if is_token_classifier(hf):  # a PRM: its objective reads stepwise solutions (PRM_SOURCE)
        tree["train"] = {"objective": "prm"}
        tree["data"]["sources"] = [PRM_SOURCE]
    tree = config_lib.apply_overrides(tree, overrides)
    vocab, data = tree["model"].get("vocab_size"), tree["data"]
    tokenizer = hf_dir / "tokenizer.json"
    if "tokenizer" in data:  # chosen by an override
        pass
    elif tokenizer.is_file():
        data["tokenizer"] = str(tokenizer.resolve())
        n = load_tokenizer(data["tokenizer"]).vocab_size
        if isinstance(vocab, int) and n > vocab:
            raise ConfigError(
                f"{tokenizer} has {n} ids but config.json's vocab_size is {vocab}, so it is not "
                "this model's tokenizer; put the model's own tokenizer.json there (or pass "
                "data.tokenizer=PATH)."
            )
    elif isinstance(vocab, int) and vocab < ByteTokenizer.vocab_size:
        data["tokenizer"] = NO_TOKENIZER
        warnings.warn(
            f"{hf_dir} has no tokenizer.json and its vocabulary ({vocab} ids) is smaller than "
            f"the byte tokenizer's ({ByteTokenizer.vocab_size}), so the run has none "
            "(data.tokenizer=none): it computes logits from token ids but cannot encode or "
            "decode text; copy the model's tokenizer.json into the directory (or set "
            "data.tokenizer=PATH) to use text.",
            JaxllmWarning,
            stacklevel=2,
        )
    return config_lib.from_dict(tree).validate()


def import_hf(
    hf_dir, out_dir, overrides=(), mesh=None, overwrite=False, dequantize=False
) -> list[Mapped]:
    """`jaxllm convert import`: a run directory (config.yaml, a weights-only checkpoint at step
    0, and the tokenizer.json with its tokenizer_config.json, special_tokens_map.json, chat
    template and generation_config.json, where the directory has them) that `jaxllm generate
    / eval / train` accept. Every check and every tensor read happens before anything is
    written: a refused import leaves no `out_dir` behind, and one that holds files is refused
    (replaced whole with `overwrite`). A quantized checkpoint (compressed-tensors, GPTQ, AWQ)
    keeps its codes, or with `dequantize` becomes a float run."""
    new = new_run(hf_dir, out_dir, overrides, overwrite=overwrite, dequantize=dequantize)
    mesh = mesh or sharding.make_mesh(new.cfg.mesh)
    params, model_state, report = load_params(hf_dir, new.cfg.model, mesh)
    if new.cfg.quantize.enabled:  # compressed-tensors, GPTQ, AWQ: the codes themselves
        params = compressed.imported_codes(hf_dir, params, new.cfg)
    new.write(params, model_state)
    return report


def check_out_dir(
    out, *, flag: str, overwrite: bool = False, reads=(), nested: bool = True
) -> Path:
    """`out` as a Path when a convert command may write it (`check_output`), and neither it nor
    anything in it is one of the paths `reads` that the command reads (with `overwrite` it
    would be replaced); without `nested`, nor inside one of them (a new run written into the
    run it comes from)."""
    out = Path(out)
    for source in filter(None, reads):
        if Path(source).resolve().is_relative_to(out.resolve()):
            raise ConfigError(
                f"{flag} {out} is or holds {source}, which this command reads; choose another "
                "directory to write into."
            )
    if not nested:
        refuse_inside(out, reads, flag)
    return check_output(out, flag=flag, overwrite=overwrite)


def refuse_inside(out, reads, flag: str, what: str = "new run") -> None:
    """ConfigError when `out` lies inside one of the directories `reads` that the command
    reads (a new run written into the run it comes from)."""
    for source in filter(None, reads):
        if Path(out).resolve().is_relative_to(Path(source).resolve()):
            raise ConfigError(
                f"{flag} {out} lies inside {source}, which this command reads; write the "
                f"{what} outside it."
            )


def _inside(path: Path, parent: Path) -> Path | None:
    """`path` relative to `parent` when it is `parent` or under it, else None."""
    path, parent = path.resolve(), parent.resolve()
    return path.relative_to(parent) if path.is_relative_to(parent) else None


@dataclasses.dataclass(frozen=True)
class NewRun:
    """A run directory about to be written from a Hugging Face directory: its config, its
    checkpoints directory and the tokenizer files to copy (`new_run`)."""

    out_dir: Path
    cfg: config_lib.Config
    ckpt_dir: Path
    copies: tuple[Path, ...]
    overwrite: bool = False

    def write(self, params, model_state, base: dict | None = None, files=None) -> None:
        """Writes the directory: the copied files, `files` ({name: text}, e.g. merge.json), a
        weights-only checkpoint at step 0 of `params` (the adapters of a PEFT run, whose `base`
        record it keeps), and config.yaml last; built in a hidden sibling, renamed into place when complete. A checkpoint.dir
        outside the run directory is written the same way, before it."""
        with written(self.out_dir, flag=OUT_FLAG, overwrite=self.overwrite) as tmp:
            for f in self.copies:
                shutil.copy(f, tmp / f.name)
            for name, text in (files or {}).items():
                (tmp / name).write_text(text)
            # The config names the final tokenizer.json; its record is read from the copy.
            copied = any(f.name == "tokenizer.json" for f in self.copies)
            tokenizer = tmp / "tokenizer.json" if copied else self.cfg.data.tokenizer
            within = _inside(self.ckpt_dir, self.out_dir)
            ckpt = (
                contextlib.nullcontext(tmp / within)
                if within is not None
                else written(self.ckpt_dir, flag="checkpoint.dir", overwrite=self.overwrite)
            )
            with ckpt as ckpt_dir, library_os_errors(ckpt_dir):
                checkpoint.save_params(
                    ckpt_dir,
                    params,
                    step=0,
                    model_state=model_state,
                    config=config_lib.to_dict(self.cfg),
                    tokenizer=checkpoint.tokenizer_record(str(tokenizer)),
                    base=base,
                )
            config_lib.dump(self.cfg, tmp / "config.yaml")


def new_run(hf_dir, out_dir, overrides=(), overwrite=False, reads=(), dequantize=False) -> NewRun:
    """The checked plan of importing `hf_dir` into the new run directory `out_dir` (with
    `key=value` overrides); nothing is written yet. `out_dir` is checked first (it may not
    hold files unless `overwrite`, nor `hf_dir` or the other paths `reads`)."""
    hf_dir = Path(hf_dir)
    out_dir = check_out_dir(out_dir, flag=OUT_FLAG, overwrite=overwrite, reads=(hf_dir, *reads))
    cfg = model_config(hf_dir, [f"run.dir={out_dir}", *overrides], dequantize)
    ckpt_dir = checkpoint.checkpoint_dir(out_dir, cfg.checkpoint.dir)
    if _inside(ckpt_dir, out_dir) is None:
        check_out_dir(ckpt_dir, flag="checkpoint.dir", overwrite=overwrite, reads=(hf_dir, *reads))
    if cfg.data.tokenizer != NO_TOKENIZER:
        tok = load_tokenizer(cfg.data.tokenizer)
        check_coverage(tok, cfg.model.vocab_size, f"importing {hf_dir}")
    # The tokenizer's files, and generation_config.json, whose EOS ids are that tokenizer's
    # (without it the run decodes bytes or nothing, and those ids would mean other tokens).
    copies = []
    tokenizer = hf_dir / "tokenizer.json"
    if tokenizer.is_file() and cfg.data.tokenizer == str(tokenizer.resolve()):
        names = [*TOKENIZER_FILES, GENERATION_CONFIG]
        copies = [tokenizer, *(hf_dir / n for n in names if (hf_dir / n).is_file())]
        if (hf_dir / GENERATION_CONFIG).is_file():
            generation_stop_ids(hf_dir / GENERATION_CONFIG)  # a broken file fails now, not later
        run_tokenizer = str((out_dir / "tokenizer.json").resolve())
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=run_tokenizer))
    if cfg.model.vision is not None:  # the image processor's files, whatever the tokenizer
        kept = {f.name for f in copies}
        copies += [hf_dir / n for n in PROCESSOR_FILES if (hf_dir / n).is_file() and n not in kept]
    return NewRun(out_dir, cfg, ckpt_dir, tuple(copies), overwrite)

"""Hugging Face safetensors in and out: streaming import onto a mesh, export, run directories.

Import never assembles the model on one device or in host memory at once: every parameter is
created with `jax.make_array_from_callback` and its `NamedSharding`, and the callback reads only
what the asking device's shard needs (for a stacked [N, ...] parameter, the layers in its
slice, and for stacked experts [N, E, ...] the experts in its slice too; for a tensor of
identical layout, just the shard's rows and columns through `safe_open(...).get_slice`).
Before anything is read, `check` picks the family's tensor layout that the files hold
(Mixtral, DeepSeek-V3: per-expert or fused experts), compares every expected name and shape with the files'
headers and refuses, with one ConfigError, tensors it cannot map, missing ones and shape
mismatches.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxllm import config as config_lib
from jaxllm.config import ConfigError, JaxllmWarning, ModelConfig
from jaxllm.convert.families import (
    Family,
    Link,
    family_of,
    first_line,
    guess_family,
    hf_config,
    model_fields,
)
from jaxllm.data.tokenizer import (
    GENERATION_CONFIG,
    NO_TOKENIZER,
    ByteTokenizer,
    HFTokenizer,
    check_coverage,
    generation_config,
    generation_stop_ids,
    load_tokenizer,
)

DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
SHARD_BYTES = 4 * 2**30  # export: a new safetensors file past this many bytes


INDEX = "model.safetensors.index.json"
# Files beside tokenizer.json that import copies into the run directory with it (its specials,
# chat template) and export writes back; generation_config.json travels with them too.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def is_hf_dir(path) -> bool:
    path = Path(path)
    has_weights = (path / INDEX).is_file() or any(path.glob("*.safetensors"))
    return (path / "config.json").is_file() and has_weights


def read_json(path: Path):
    """The JSON value of `path`; ConfigError (one line, with the position) when it is not JSON."""
    try:
        return json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix it "
            "or download it again."
        ) from None
    except (ValueError, OSError) as e:  # not UTF-8 text, unreadable
        raise ConfigError(f"cannot read {path} ({first_line(e)}); download it again.") from None


def read_hf_config(hf_dir) -> dict:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        state = "is a file, not a directory" if hf_dir.exists() else "does not exist"
        raise ConfigError(
            f"{hf_dir} {state}; give a Hugging Face model directory (config.json + *.safetensors)."
        )
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir} has no config.json; give a Hugging Face model directory.")
    hf = read_json(path)
    if not isinstance(hf, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(hf).__name__}, not an object; give the model's own "
            "config.json."
        )
    return hf


def safetensors_files(hf_dir) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files transformers reads, and the index's tensor -> file map if any.

    With `model.safetensors.index.json`, exactly the files its weight_map names: Mistral's Hub
    repos ship `consolidated.safetensors` (Mistral's own tensor names) beside the sharded
    Hugging Face files, and reading both would see every weight twice under two names. Without
    one, `model.safetensors` when present (transformers reads nothing else), else every
    `*.safetensors` (a hand-made directory)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not (isinstance(weight_map, dict) and weight_map
                and all(isinstance(v, str) and Path(v).name == v for v in weight_map.values())):  # fmt: skip
            raise ConfigError(
                f"{index} has no weight_map of tensor names to file names; fix it or download "
                "it again."
            )
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (hf_dir / n).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConfigError(
                f"{index} names {missing[0]}{more}, which is not in {hf_dir}; download every "
                "file the index lists."
            )
        return [hf_dir / n for n in names], weight_map
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"], None
    return sorted(hf_dir.glob("*.safetensors")), None


class Reader:
    """Names, shapes and dtypes of every tensor in a directory's safetensors files (headers
    only); `read` loads one tensor, or one slice of it.

    The files are not trusted blindly: an unreadable file (truncated, not safetensors) and a
    tensor stored in two files (which one would win?) are ConfigErrors naming the files."""

    def __init__(self, hf_dir):
        hf_dir = Path(hf_dir)
        self.files, weight_map = safetensors_files(hf_dir)
        if not self.files:
            raise ConfigError(
                f"{hf_dir} holds no .safetensors files; give a Hugging Face model directory "
                "with its weights."
            )
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for f in self.files:
            for name, shape, dtype in _header(f):
                if name in self.where:
                    raise ConfigError(
                        f"tensor {name} is in both {self.where[name].name} and {f.name} in "
                        f"{hf_dir}; remove the stale file (or add the {INDEX} that names the "
                        "files to read)."
                    )
                self.where[name], self.shapes[name], self.dtypes[name] = f, shape, dtype
        for name, file in (weight_map or {}).items():
            if self.where.get(name) != hf_dir / file:
                raise ConfigError(
                    f"{hf_dir / INDEX} puts tensor {name} in {file}, which does not hold it; "
                    "download the files again."
                )

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        try:
            with safe_open(self.where[name], framework="numpy") as h:
                if index is None:
                    return h.get_tensor(name)
                return h.get_slice(name)[index]
        except SafetensorError as e:
            raise ConfigError(
                f"cannot read tensor {name} from {self.where[name]} ({first_line(e)}); "
                "download the file again."
            ) from None

    def param_dtype(self) -> str:
        """The checkpoint's storage dtype: the most common float dtype, by bytes (integer
        tensors where floats belong are refused by `check`, by name)."""
        count: dict[str, int] = {}
        for name, dt in self.dtypes.items():
            count[dt] = count.get(dt, 0) + math.prod(self.shapes[name])
        floats = {dt: n for dt, n in count.items() if dt in DTYPES}
        if not floats:
            raise ConfigError(
                f"{self.files[0].parent} holds no float tensors (dtypes {', '.join(sorted(count))}"
                "); jaxllm imports F32, BF16 and F16 weights: dequantize them first."
            )
        return DTYPES[max(floats, key=floats.get)]

    def equal(self, a: str, b: str, rows: int = 4096) -> bool:
        """Whether tensors `a` and `b` hold the same values (compared `rows` rows at a time, so
        two vocabulary-sized matrices are never in memory whole)."""
        if self.shapes[a] != self.shapes[b] or self.dtypes[a] != self.dtypes[b]:
            return False
        if not self.shapes[a]:
            return bool(np.array_equal(self.read(a), self.read(b)))
        n = self.shapes[a][0]
        return all(
            np.array_equal(self.read(a, (slice(i, min(i + rows, n)),)),
                           self.read(b, (slice(i, min(i + rows, n)),)))
            for i in range(0, n, rows)
        )  # fmt: skip


def _header(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor of one safetensors file."""
    try:
        with safe_open(path, framework="numpy") as h:
            out = []
            for name in h.keys():
                s = h.get_slice(name)
                out.append((name, tuple(s.get_shape()), s.get_dtype()))
            return out
    except (SafetensorError, OSError) as e:
        raise ConfigError(
            f"{path} is not a readable safetensors file ({first_line(e)}); download it again."
        ) from None


def _flat(tree, prefix=()) -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, (*prefix, k)))
        else:
            out["/".join((*prefix, k))] = v
    return out


def _unflat(flat: dict[str, object]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


COUNTED = {"i": "layers", "j": "experts"}  # the report's word for each placeholder of a name


@dataclasses.dataclass
class Mapped:
    """One line of the report: an HF tensor name (with `{i}` for N layers, `{j}` for E
    experts), how many of each, and our params."""

    hf: str
    counts: tuple[int, ...]
    ours: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    offset: int = 0  # the HF number of the first layer

    @classmethod
    def of(cls, link: Link, shapes: dict, dtype: str) -> Mapped:
        return cls(link.hf, link.counts(shapes), link.ours, tuple(shapes[p] for p in link.ours),
                   dtype, link.offset)  # fmt: skip

    def __str__(self) -> str:
        indices = Link(self.hf, self.ours).indices
        n = "".join(f" x{c} {COUNTED.get(i, i)}" for i, c in zip(indices, self.counts))
        if self.offset:
            n += f" (from layer {self.offset})"
        ours = ", ".join(f"{p} {list(s)}" for p, s in zip(self.ours, self.shapes))
        return f"{self.hf}{n} -> {ours} {self.dtype}"


def _element_shapes(link: Link, shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Shapes of one HF tensor's share of each of `link.ours` (the split axes dropped)."""
    return [shapes[p][len(link.indices) :] for p in link.ours]


def _each(link: Link, shapes: dict) -> itertools.product:
    """Every index tuple (layer, expert, ...) of the link's separate HF tensors."""
    return itertools.product(*(range(c) for c in link.counts(shapes)))


def check(reader: Reader, family: Family, cfg: ModelConfig, shapes: dict,
          optional: frozenset[str] = frozenset()) -> list[Link]:  # fmt: skip
    """The family's links for `cfg` in the layout the files hold, after checking names and
    shapes against them; when no layout fits, the errors of the closest one. `optional`:
    paths of `shapes` the family may leave unlinked (model state)."""
    best: list[str] | None = None
    for links in family.layouts(cfg):
        _check_owned(family, links, shapes, optional)
        errors = _mismatches(reader, family, cfg, links, shapes)
        if not errors:
            return links
        if best is None or len(errors) < len(best):
            best = errors
    more = f" (and {len(best) - 5} more)" if len(best) > 5 else ""
    raise ConfigError(f"cannot convert this {family.name} checkpoint: "
                      f"{'; '.join(best[:5])}{more}.")  # fmt: skip


def _check_owned(family: Family, links: list[Link], shapes: dict, optional=frozenset()) -> None:
    owned = [p for link in links for p in link.ours]
    unowned = sorted(set(shapes) - set(owned) - set(optional))
    if unowned or set(owned) - set(shapes):
        raise ConfigError(
            f"the {family.name} mapping and the model disagree on parameters "
            f"({', '.join(unowned or sorted(set(owned) - set(shapes)))}); check the model keys."
        )


def _mismatches(reader: Reader, family: Family, cfg: ModelConfig, links: list[Link],
                shapes: dict) -> list[str]:  # fmt: skip
    errors, expected = [], set()
    for link in links:
        want = link.hf_shape(_element_shapes(link, shapes))
        for index in _each(link, shapes):
            name = link.name(index)
            expected.add(name)
            if name not in reader.shapes:
                errors.append(f"missing tensor {name}")
            elif reader.shapes[name] != want:
                errors.append(f"{name} has shape {list(reader.shapes[name])}, the model needs "
                              f"{list(want)}")  # fmt: skip
            elif reader.dtypes[name] not in DTYPES:
                errors.append(f"{name} is stored as {reader.dtypes[name]}, the model needs a float "
                              "tensor (F32, BF16 or F16)")  # fmt: skip
    extra = sorted(n for n in set(reader.shapes) - expected if not family.ignored(n, cfg))
    if cfg.tie_embeddings and TIED_HEAD in extra:
        errors += _tied_head(reader, links)
        extra.remove(TIED_HEAD)
    return errors + [f"tensor {n} {list(reader.shapes[n])} maps to no parameter" for n in extra]


TIED_HEAD = "lm_head.weight"


def _tied_head(reader: Reader, links: list[Link]) -> list[str]:
    """A tied model's file may store the head anyway (some exporters write every tensor):
    transformers then ties it to the embedding and drops it. Dropped here too when it equals
    the embedding; a different head is an error, since tying would silently change the model."""
    embed = next((link.hf for link in links if link.ours == ("embed/embedding",)), None)
    if embed in reader.shapes and reader.equal(TIED_HEAD, embed):
        return []
    return [f"{TIED_HEAD} is stored and differs from {embed}, but tie_word_embeddings is true; "
            "set tie_word_embeddings to false in config.json to keep the separate head"]  # fmt: skip


def load_params(hf_dir, cfg: ModelConfig, mesh) -> tuple[dict, dict, list[Mapped]]:
    """(parameters, model state, report) of `cfg` from a Hugging Face directory, each array
    created in its shards on `mesh`. The model state (MoE routing biases) comes from the
    checkpoint where the family has it (DeepSeek-V3's `e_score_correction_bias`) and starts at
    zero otherwise, as in a fresh train state (a Mixtral fine-tuned with bias balancing)."""
    import jax.numpy as jnp

    from jaxllm import sharding
    from jaxllm.model import abstract_model, abstract_model_state

    family = family_of(read_hf_config(hf_dir))
    reader = Reader(hf_dir)
    _, abstract, axes = abstract_model(cfg)
    abstract_ms, ms_axes = abstract_model_state(cfg)
    sharding.check_divisible(mesh, abstract, axes)
    state_paths = frozenset(_flat(abstract_ms))
    flat = {**_flat(abstract), **_flat(abstract_ms)}
    shapes = {p: tuple(a.shape) for p, a in flat.items()}
    links = check(reader, family, cfg, shapes, optional=state_paths)
    flat_sh = {**_flat(sharding.tree_shardings(mesh, axes)),
               **_flat(sharding.tree_shardings(mesh, ms_axes))}  # fmt: skip
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
    params = _unflat({p: a for p, a in out.items() if p not in state_paths})
    return params, _unflat({p: a for p, a in out.items() if p in state_paths}), report


def _stored_dtype(reader: Reader, link: Link, shapes: dict) -> str:
    """The dtype of the link's (first) HF tensor, as a numpy name where we know it."""
    dt = reader.dtypes[link.name(next(_each(link, shapes)))]
    return DTYPES.get(dt, dt)


def _callback(reader: Reader, link: Link, k: int, shapes: dict, dtype) -> Callable:
    """Shard reader for component k of `link`: stacks the HF tensors of the layers (and
    experts) in the shard's slice, each cut to the rest of the shard's index. Devices holding
    the same shard (replicas) ask for the same index one after another, so the last shard
    built is kept."""
    per_element = _element_shapes(link, shapes)
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


def model_config(hf_dir, overrides=()) -> config_lib.Config:
    """The run config of a Hugging Face directory: its architecture, its storage dtype as
    param_dtype, config.json's dtype (else the storage dtype) as the compute dtype, its
    tokenizer.json if any; then `key=value` overrides.

    Without a tokenizer.json the run gets the byte tokenizer, or, when the vocabulary is too
    small for it (fewer than 258 ids), `data.tokenizer=none` with a JaxllmWarning: the model
    still loads and computes logits from ids, and only encoding or decoding text is refused."""
    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ConfigError(
            f"{hf_dir} is a quantized checkpoint (quantization_config: quant_method {method}); "
            "jaxllm imports float32 / bfloat16 / float16 tensors: dequantize it first (for "
            "DeepSeek-V3's FP8 weights, to bfloat16 with their weight_scale_inv scales)."
        )
    fields = model_fields(hf, hf_dir / "config.json")
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
    tree = config_lib.apply_overrides(
        {"model": fields, "data": {"seq_len": min(256, fields["max_seq_len"])}}, overrides
    )
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


def import_hf(hf_dir, out_dir, overrides=(), mesh=None) -> list[Mapped]:
    """`jaxllm convert import`: a run directory (config.yaml, a weights-only checkpoint at step
    0, and the tokenizer.json with its tokenizer_config.json, special_tokens_map.json, chat
    template and generation_config.json, where the directory has them) that `jaxllm generate
    / eval / train` accept. Every check and every tensor read happens before anything is
    written: a refused import leaves no `out_dir` behind."""
    from jaxllm import checkpoint, sharding

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file; give a new directory to import into.")
    cfg = model_config(hf_dir, [f"run.dir={out_dir}", *overrides])
    ckpt_dir = checkpoint.checkpoint_dir(out_dir, cfg.checkpoint.dir)
    if ckpt_dir.is_dir() and any(ckpt_dir.iterdir()):
        raise ConfigError(f"{ckpt_dir} already holds checkpoints; import into a new directory.")
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
    mesh = mesh or sharding.make_mesh(cfg.mesh)
    params, model_state, report = load_params(hf_dir, cfg.model, mesh)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in copies:
        shutil.copy(f, out_dir / f.name)
    config_lib.dump(cfg, out_dir / "config.yaml")
    checkpoint.save_params(
        ckpt_dir, params, step=0, model_state=model_state,
        config=config_lib.to_dict(cfg), tokenizer=checkpoint.tokenizer_record(cfg.data.tokenizer),
    )  # fmt: skip
    return report


def export_hf(params: dict, cfg: config_lib.Config, hf_dir, family: str | None = None,
              shard_bytes: int = SHARD_BYTES, model_state: dict | None = None,
              run_dir=None) -> list[Mapped]:  # fmt: skip
    """Writes config.json and model.safetensors (or shards + index) of `params` and
    `model_state` (nested dicts of arrays, possibly sharded: each tensor is fetched to the host
    one layer, or one layer's expert, at a time), in the family's first layout (Mixtral,
    DeepSeek-V3: per-expert tensors); and the run's tokenizer with its special-token ids
    (`_write_tokenizer`; `run_dir`: where else to look for a generation_config.json)."""
    from jaxllm.convert.families import FAMILIES

    m = cfg.model
    if family is not None and family not in FAMILIES:
        raise ConfigError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}.")
    fam = FAMILIES[family] if family else guess_family(m)
    hf = hf_config(m, fam)
    flat = {**_flat(params), **_flat(model_state or {})}
    shapes = {p: tuple(a.shape) for p, a in flat.items()}
    links = fam.links(m)
    owned = {p for link in links for p in link.ours}
    if owned != set(flat):
        raise ConfigError(f"the {fam.name} mapping does not cover the parameters "
                          f"{sorted(set(flat) ^ owned)}.")  # fmt: skip
    hf_dir = Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    files: list[dict] = [{}]
    size = 0
    report = []
    for link in links:
        for index in _each(link, shapes):  # one layer (and expert) at a time to the host
            xs = [np.asarray(jax.device_get(flat[p][index] if index else flat[p]))
                  for p in link.ours]  # fmt: skip
            t = link.to_hf(xs)
            if size and size + t.nbytes > shard_bytes:
                files.append({})
                size = 0
            files[-1][link.name(index)] = t
            size += t.nbytes
        report.append(Mapped.of(link, shapes, str(flat[link.ours[0]].dtype)))
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])  # fmt: skip
    for old in hf_dir.glob("*.safetensors"):
        old.unlink()
    for name, tensors in zip(names, files):
        save_file(tensors, str(hf_dir / name), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for f in files for t in f.values())},
                 "weight_map": {t: n for n, f in zip(names, files) for t in f}}  # fmt: skip
        (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = {**hf, **_write_tokenizer(cfg, hf_dir, run_dir)}
    (hf_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return report


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
    tokenizer has no file to write; its ids are written all the same."""
    from tokenizers import Tokenizer, processors

    spec = cfg.data.tokenizer
    if spec == NO_TOKENIZER:
        return {}
    tok = load_tokenizer(spec)
    pad = tok.found_pad_id  # not pad_id, which is 0 (a real token) for a tokenizer without one
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": pad}
    gen = generation_config(spec, run_dir)
    gen = {**{k: v for k, v in ids.items() if v is not None}, **gen}
    (hf_dir / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    if not isinstance(tok, HFTokenizer):
        return ids
    source = Path(tok.name)
    backend = Tokenizer.from_file(str(source))
    if cfg.data.add_bos and tok.bos_id is not None and backend.post_processor is None:
        bos = backend.id_to_token(tok.bos_id)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
        )
        backend.save(str(hf_dir / "tokenizer.json"))
    else:
        shutil.copy(source, hf_dir / "tokenizer.json")
    for name in TOKENIZER_FILES:
        if (source.parent / name).is_file():
            shutil.copy(source.parent / name, hf_dir / name)
    if not (source.parent / "tokenizer_config.json").is_file():
        specials = {f"{k}_token": backend.id_to_token(i)
                    for k, i in (("bos", tok.bos_id), ("eos", tok.eos_id), ("pad", pad))
                    if i is not None}  # fmt: skip
        minimal = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
                   "model_max_length": cfg.model.max_seq_len,
                   "clean_up_tokenization_spaces": False}  # fmt: skip
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(minimal, indent=2) + "\n")
    return ids

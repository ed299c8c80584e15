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
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxllm import config as config_lib
from jaxllm.config import ConfigError, ModelConfig
from jaxllm.convert.families import Family, Link, family_of, guess_family, hf_config

DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
SHARD_BYTES = 4 * 2**30  # export: a new safetensors file past this many bytes


def is_hf_dir(path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_hf_config(hf_dir) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir} has no config.json; give a Hugging Face model directory.")
    return json.loads(path.read_text())


class Reader:
    """Names, shapes and dtypes of every tensor in a directory's safetensors files (headers
    only); `read` loads one tensor, or one slice of it."""

    def __init__(self, hf_dir):
        self.files = sorted(Path(hf_dir).glob("*.safetensors"))
        if not self.files:
            raise ConfigError(f"{hf_dir} holds no .safetensors files.")
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for f in self.files:
            with safe_open(f, framework="numpy") as h:
                for name in h.keys():
                    s = h.get_slice(name)
                    self.where[name] = f
                    self.shapes[name] = tuple(s.get_shape())
                    self.dtypes[name] = s.get_dtype()

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        with safe_open(self.where[name], framework="numpy") as h:
            if index is None:
                return h.get_tensor(name)
            return h.get_slice(name)[index]

    def param_dtype(self) -> str:
        """The checkpoint's storage dtype (the most common one, by bytes)."""
        count: dict[str, int] = {}
        for name, dt in self.dtypes.items():
            count[dt] = count.get(dt, 0) + math.prod(self.shapes[name])
        dt = max(count, key=count.get)
        if dt not in DTYPES:
            raise ConfigError(f"tensors of dtype {dt} are not supported (F32, BF16, F16 are).")
        return DTYPES[dt]


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
    extra = sorted(n for n in set(reader.shapes) - expected if not family.ignored(n, cfg))
    return errors + [f"tensor {n} {list(reader.shapes[n])} maps to no parameter" for n in extra]


def load_params(hf_dir, cfg: ModelConfig, mesh) -> tuple[dict, dict, list[Mapped]]:
    """(parameters, model state, report) of `cfg` from a Hugging Face directory, each array
    created in its shards on `mesh`. The model state (MoE routing biases) comes from the
    checkpoint where the family has it (DeepSeek-V3's `e_score_correction_bias`) and starts at
    zero otherwise, as in a fresh train state (a Mixtral fine-tuned with bias balancing)."""
    import jax.numpy as jnp

    from jaxllm import sharding
    from jaxllm.train.state import abstract_model, abstract_model_state

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
    param_dtype, its tokenizer.json if any; then `key=value` overrides."""
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
    fields = family_of(hf).to_model(hf)
    fields["param_dtype"] = Reader(hf_dir).param_dtype()
    data: dict = {"seq_len": min(256, fields["max_seq_len"])}
    if (hf_dir / "tokenizer.json").is_file():
        data["tokenizer"] = str((hf_dir / "tokenizer.json").resolve())
    tree = config_lib.apply_overrides({"model": fields, "data": data}, overrides)
    return config_lib.from_dict(tree).validate()


def import_hf(hf_dir, out_dir, overrides=(), mesh=None) -> list[Mapped]:
    """`jaxllm convert import`: a run directory (config.yaml, tokenizer.json, a weights-only
    checkpoint at step 0) that `jaxllm generate / eval / train` accept."""
    from jaxllm import checkpoint, sharding

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    cfg = model_config(hf_dir, [f"run.dir={out_dir}", *overrides])
    ckpt_dir = checkpoint.checkpoint_dir(out_dir, cfg.checkpoint.dir)
    if ckpt_dir.is_dir() and any(ckpt_dir.iterdir()):
        raise ConfigError(f"{ckpt_dir} already holds checkpoints; import into a new directory.")
    tokenizer = hf_dir / "tokenizer.json"
    if tokenizer.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(tokenizer, out_dir / "tokenizer.json")
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, tokenizer=str((out_dir / "tokenizer.json")
                                                                  .resolve()))
        )  # fmt: skip
    mesh = mesh or sharding.make_mesh(cfg.mesh)
    params, model_state, report = load_params(hf_dir, cfg.model, mesh)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_lib.dump(cfg, out_dir / "config.yaml")
    checkpoint.save_params(
        ckpt_dir, params, step=0, model_state=model_state,
        config=config_lib.to_dict(cfg), tokenizer=checkpoint.tokenizer_record(cfg.data.tokenizer),
    )  # fmt: skip
    return report


def export_hf(params: dict, cfg: config_lib.Config, hf_dir, family: str | None = None,
              shard_bytes: int = SHARD_BYTES, model_state: dict | None = None) -> list[Mapped]:  # fmt: skip
    """Writes config.json and model.safetensors (or shards + index) of `params` and
    `model_state` (nested dicts of arrays, possibly sharded: each tensor is fetched to the host
    one layer, or one layer's expert, at a time), in the family's first layout (Mixtral,
    DeepSeek-V3: per-expert tensors)."""
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
    (hf_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    tok = Path(cfg.data.tokenizer)
    if tok.name == "tokenizer.json" and tok.is_file():
        shutil.copy(tok, hf_dir / "tokenizer.json")
    return report

"""Hugging Face safetensors in and out: streaming import onto a mesh, export, run directories.

Import never assembles the model on one device or in host memory at once: every parameter is
created with `jax.make_array_from_callback` and its `NamedSharding`, and the callback reads only
what the asking device's shard needs (for a stacked [N, ...] parameter, the layers in its
slice; for an unstacked tensor of identical layout, just the shard's rows and columns through
`safe_open(...).get_slice`). Before anything is read, `check` compares every expected name and
shape with the files' headers and refuses, with one ConfigError, tensors it cannot map,
missing ones and shape mismatches.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass
class Mapped:
    """One line of the report: an HF tensor name (with `{i}` for N layers) and our params."""

    hf: str
    layers: int | None
    ours: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str

    def __str__(self) -> str:
        n = f" x{self.layers} layers" if self.layers else ""
        ours = ", ".join(f"{p} {list(s)}" for p, s in zip(self.ours, self.shapes))
        return f"{self.hf}{n} -> {ours} {self.dtype}"


def _layer_shapes(link: Link, shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, ...]]:
    return [shapes[p][1:] if link.layered else shapes[p] for p in link.ours]


def check(reader: Reader, family: Family, cfg: ModelConfig, shapes: dict) -> list[Link]:
    """The family's links for `cfg`, after checking names and shapes against the files."""
    links = family.links(cfg)
    owned = [p for link in links for p in link.ours]
    unowned = sorted(set(shapes) - set(owned))
    if unowned or set(owned) - set(shapes):
        raise ConfigError(
            f"the {family.name} mapping and the model disagree on parameters "
            f"({', '.join(unowned or sorted(set(owned) - set(shapes)))}); check the model keys."
        )
    errors, expected = [], set()
    for link in links:
        want = link.hf_shape(_layer_shapes(link, shapes))
        for layer in range(cfg.num_layers) if link.layered else [None]:
            name = link.name(layer)
            expected.add(name)
            if name not in reader.shapes:
                errors.append(f"missing tensor {name}")
            elif reader.shapes[name] != want:
                errors.append(f"{name} has shape {list(reader.shapes[name])}, the model needs "
                              f"{list(want)}")  # fmt: skip
    extra = sorted(n for n in set(reader.shapes) - expected
                   if not any(n.endswith(s) for s in family.ignore))  # fmt: skip
    errors += [f"tensor {n} {list(reader.shapes[n])} maps to no parameter" for n in extra]
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise ConfigError(f"cannot convert this {family.name} checkpoint: "
                          f"{'; '.join(errors[:5])}{more}.")  # fmt: skip
    return links


def load_params(hf_dir, cfg: ModelConfig, mesh) -> tuple[dict, list[Mapped]]:
    """Parameters of `cfg` from a Hugging Face directory, each created in its shards on `mesh`;
    and the report of what was mapped."""
    from jaxllm import sharding
    from jaxllm.train.state import abstract_model

    family = family_of(read_hf_config(hf_dir))
    reader = Reader(hf_dir)
    _, abstract, axes = abstract_model(cfg)
    sharding.check_divisible(mesh, abstract, axes)
    flat = _flat(abstract)
    shapes = {p: tuple(a.shape) for p, a in flat.items()}
    links = check(reader, family, cfg, shapes)
    flat_sh = _flat(sharding.tree_shardings(mesh, axes))
    out = {}
    for link in links:
        for k, path in enumerate(link.ours):
            out[path] = jax.make_array_from_callback(
                shapes[path], flat_sh[path], _callback(reader, link, k, shapes, flat[path].dtype)
            )
    report = [
        Mapped(link.hf, cfg.num_layers if link.layered else None, link.ours,
               tuple(shapes[p] for p in link.ours),
               DTYPES.get(d := reader.dtypes[link.name(0 if link.layered else None)], d))
        for link in links
    ]  # fmt: skip
    return _unflat(out), report


def _callback(reader: Reader, link: Link, k: int, shapes: dict, dtype) -> Callable:
    """Shard reader for component k of `link`. Devices holding the same shard (replicas) ask
    for the same index one after another, so the last shard built is kept."""
    per_layer = _layer_shapes(link, shapes)
    last: dict = {}

    def one(layer, index):
        if link.kind == "same" and len(link.ours) == 1:  # same layout: read just the slice
            return reader.read(link.name(layer), index)
        return link.to_ours(reader.read(link.name(layer)), per_layer)[k][index]

    def build(index):
        if not link.layered:
            return one(None, index)
        layers = range(shapes[link.ours[k]][0])[index[0]]
        return np.stack([one(i, tuple(index[1:])) for i in layers])

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
    fields = family_of(read_hf_config(hf_dir)).to_model(read_hf_config(hf_dir))
    fields["param_dtype"] = Reader(hf_dir).param_dtype()
    data: dict = {"seq_len": min(256, fields["max_seq_len"])}
    if (hf_dir / "tokenizer.json").is_file():
        data["tokenizer"] = str((hf_dir / "tokenizer.json").resolve())
    tree = {"model": fields, "data": data}
    for item in overrides:
        config_lib._deep_merge(tree, config_lib._parse_override(item))
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
    params, report = load_params(hf_dir, cfg.model, mesh)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_lib.dump(cfg, out_dir / "config.yaml")
    checkpoint.save_params(
        ckpt_dir, params, step=0,
        config=config_lib.to_dict(cfg), tokenizer=checkpoint.tokenizer_record(cfg.data.tokenizer),
    )  # fmt: skip
    return report


def export_hf(params: dict, cfg: config_lib.Config, hf_dir, family: str | None = None,
              shard_bytes: int = SHARD_BYTES) -> list[Mapped]:  # fmt: skip
    """Writes config.json and model.safetensors (or shards + index) of `params` (a nested dict
    of arrays, possibly sharded: each tensor is fetched to the host one layer at a time)."""
    from jaxllm.convert.families import FAMILIES

    m = cfg.model
    if family is not None and family not in FAMILIES:
        raise ConfigError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}.")
    fam = FAMILIES[family] if family else guess_family(m)
    hf = hf_config(m, fam)
    flat = _flat(params)
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
        for layer in range(m.num_layers) if link.layered else [None]:
            xs = [np.asarray(jax.device_get(flat[p][layer] if link.layered else flat[p]))
                  for p in link.ours]  # fmt: skip
            t = link.to_hf(xs)
            if size and size + t.nbytes > shard_bytes:
                files.append({})
                size = 0
            files[-1][link.name(layer)] = t
            size += t.nbytes
        report.append(Mapped(link.hf, m.num_layers if link.layered else None, link.ours,
                             tuple(shapes[p] for p in link.ours), str(flat[link.ours[0]].dtype)))  # fmt: skip
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

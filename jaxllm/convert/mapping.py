"""How a family's tensor layout meets a directory's safetensors files: `check` picks the
layout the files hold and refuses, with one ConfigError, tensors it cannot map, missing ones and
shape mismatches; `Mapped` is one line of the report import and export print. Parameters are
handled as flat {"a/b/c": array} dicts here (`flatten`, `unflatten`)."""

from __future__ import annotations

import dataclasses
import itertools

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.convert.links import Family, Link
from jaxllm.convert.reader import DTYPES, Reader


def flatten(tree, prefix=()) -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, (*prefix, str(k))))
        else:
            out["/".join(map(str, (*prefix, k)))] = v
    return out


def unflatten(flat: dict[str, object]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:  # digits: an `nnx.List` index (the vision tower's blocks)
            node = node.setdefault(int(p) if p.isdigit() else p, {})
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
        return cls(
            link.hf,
            link.counts(shapes),
            link.ours,
            tuple(shapes[p] for p in link.ours),
            dtype,
            link.offset,
        )

    def __str__(self) -> str:
        indices = Link(self.hf, self.ours).indices
        n = "".join(f" x{c} {COUNTED.get(i, i)}" for i, c in zip(indices, self.counts))
        if self.offset:
            n += f" (from layer {self.offset})"
        ours = ", ".join(f"{p} {list(s)}" for p, s in zip(self.ours, self.shapes))
        return f"{self.hf}{n} -> {ours} {self.dtype}"


def element_shapes(link: Link, shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Shapes of one HF tensor's share of each of `link.ours` (the split axes dropped)."""
    return [shapes[p][len(link.indices) :] for p in link.ours]


def each(link: Link, shapes: dict) -> itertools.product:
    """Every index tuple (layer, expert, ...) of the link's separate HF tensors."""
    return itertools.product(*(range(c) for c in link.counts(shapes)))


def check(
    reader: Reader,
    family: Family,
    cfg: ModelConfig,
    shapes: dict,
    optional: frozenset[str] = frozenset(),
) -> list[Link]:
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
    raise ConfigError(f"cannot convert this {family.name} checkpoint: {'; '.join(best[:5])}{more}.")


def _check_owned(family: Family, links: list[Link], shapes: dict, optional=frozenset()) -> None:
    owned = [p for link in links for p in link.ours]
    unowned = sorted(set(shapes) - set(owned) - set(optional))
    if unowned or set(owned) - set(shapes):
        raise ConfigError(
            f"the {family.name} mapping and the model disagree on parameters "
            f"({', '.join(unowned or sorted(set(owned) - set(shapes)))}); check the model keys."
        )


def _mismatches(
    reader: Reader, family: Family, cfg: ModelConfig, links: list[Link], shapes: dict
) -> list[str]:
    errors, expected = [], set()
    for link in links:
        want = link.hf_shape(element_shapes(link, shapes))
        for index in each(link, shapes):
            name = link.name(index)
            expected.add(name)
            if name not in reader.shapes:
                errors.append(f"missing tensor {name}")
            elif reader.shapes[name] != want:
                errors.append(
                    f"{name} has shape {list(reader.shapes[name])}, the model needs {list(want)}"
                )
            elif reader.dtypes[name] not in DTYPES:
                errors.append(
                    f"{name} is stored as {reader.dtypes[name]}, the model needs a float "
                    "tensor (F32, BF16 or F16)"
                )
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
    return [
        f"{TIED_HEAD} is stored and differs from {embed}, but tie_word_embeddings is true; "
        "set tie_word_embeddings to false in config.json to keep the separate head"
    ]

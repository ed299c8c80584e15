"""Incremental checkpoints (`checkpoint.incremental=true`): a save writes only the items that
changed since the last save to the same directory; an unchanged one (the resolved config, the
tokenizer, a fine-tuning run's base record and the objective's frozen models' records, a model
state or loss scale that did not move, ...) is not written again but named in the small JSON
item `increment` ({item: step}), and once Orbax has finalized the step the earlier copy's files
are hard-linked into it. So every finalized checkpoint reads like a full one, retention may
delete any step (a link keeps the bytes alive), and no reader needs to know.

What is unchanged: JSON items compare by value; array items by a 64-bit fingerprint of their
bits, computed on device (two independent multiply-add hashes per leaf). The train item (its
step always moves), the data iterator's state and the step's metrics row are always written.

A process killed between Orbax's finalization and the linking leaves a step without its linked
items; `repair` links them at the next start, before anything reads the directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.checkpoint.files import read_json_item, steps

ITEM = "increment"
ALWAYS = frozenset({"train", "data", "metrics_row", ITEM})


def _bits(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).ravel()


@jax.jit
def _fingerprint(tree):
    def one(x):
        u = _bits(x)
        i = jnp.arange(u.shape[0], dtype=jnp.uint32)
        h1 = jnp.sum(u * (i * jnp.uint32(2654435761) + jnp.uint32(1)))
        h2 = jnp.sum((u ^ (i * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B))
        return jnp.stack([h1, h2, jnp.uint32(u.shape[0])])

    return [one(x) for x in jax.tree.leaves(tree)]


def signature(value, is_json: bool) -> str:
    """What tells an item's content: its JSON text, or its arrays' structure and fingerprints."""
    if is_json:
        return "json:" + json.dumps(value, sort_keys=True)
    prints = [np.asarray(p).tolist() for p in jax.device_get(_fingerprint(value))]
    return f"arrays:{jax.tree.structure(value)}:{prints}"


class Increments:
    """The last saved copy of each item per directory, and the links owed to finalized steps."""

    def __init__(self):
        self._last: dict[Path, dict[str, tuple[str, int]]] = {}
        self._owed: list[tuple[Path, int, dict[str, int]]] = []

    def split(self, directory: Path, step: int, values: dict, json: set) -> dict[str, int]:
        """{item: earlier step} for the items of `values` (name -> saved value; those in `json`
        are JSON items, the others pytrees of arrays) unchanged since
        the last save to `directory` whose copy is still there; the rest are to be written.
        Records this step as the newest copy of every item."""
        last = self._last.setdefault(directory, {})
        refs = {}
        for name, value in values.items():
            if name in ALWAYS:
                continue
            sig = signature(value, name in json)
            seen = last.get(name)
            if seen and seen[0] == sig and (directory / str(seen[1]) / name).exists():
                refs[name] = seen[1]
            last[name] = (sig, step)
        return refs

    def owe(self, directory: Path, step: int, refs: dict[str, int]) -> None:
        if refs:
            self._owed.append((directory, step, refs))

    def settle(self, log=None) -> None:
        """Links the items owed to finalized steps (call once their saves have finished)."""
        owed, self._owed = self._owed, []
        for directory, step, refs in owed:
            link(directory, step, refs)
            if log is not None:
                written = _bytes(directory / str(step), skip=set(refs))
                log(
                    f"checkpoint {step}: {written:,} bytes written; "
                    + ", ".join(f"{k} (as at step {s})" for k, s in sorted(refs.items()))
                    + " linked"
                )


def link(directory: Path, step: int, refs: dict[str, int]) -> None:
    """Hard-links each referred item's files from its step into `step` (skipping those there)."""
    for name, src_step in refs.items():
        dst = directory / str(step) / name
        src = directory / str(src_step) / name
        if dst.exists() or not src.exists():
            continue
        tmp = dst.with_name(f".{name}.linking")
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(src, tmp, copy_function=os.link)
        tmp.rename(dst)


def repair(directory: Path) -> None:
    """Links what a killed process still owed to its finalized steps, oldest first."""
    for s in steps(directory):
        if refs := read_json_item(directory, s, ITEM):
            link(directory, s, {k: int(v) for k, v in refs.items()})


def _bytes(path: Path, skip: set[str]) -> int:
    return sum(
        p.stat().st_size
        for p in path.rglob("*")
        if p.is_file() and p.relative_to(path).parts[0] not in skip
    )

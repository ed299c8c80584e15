"""Collectives in an optimized HLO module, by kind, with the bytes they move: what `jaxllm
plan` reports and what tests of a layout's communication assert.

A ragged all-to-all is counted by the rows it sends, not by its buffers (`_ragged_rows`).

XLA:CPU has no pass that fuses an all-reduce and the dynamic slice that keeps one shard of it
into a reduce-scatter (GPU and TPU compilers have one, ReduceScatterCreator), so the SPMD
partitioner's reduce-scatters reach a CPU module as an all-reduce whose every user reads
1 / n of it; `collectives` counts such an all-reduce as the reduce-scatter it becomes there.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}


def _shape_bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"([a-z0-9]+)\[([\d,]*)\]", shape_text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def _group_size(line: str) -> int | None:
    """Devices per replica group of a collective (None when the line does not say)."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):
        return int(m.group(1))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2))]))
    return None


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Collective ops in an optimized HLO module: kind -> {count, bytes of their results}.

    Static counts: an op inside a loop body (the layer scan) appears once but runs every
    iteration. Ops over groups of one device (left for mesh axes of size 1, e.g. by
    `shard_map`) move nothing and are not counted.
    """
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    pattern = re.compile(
        r"(%[\w.-]+)\s*=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\("
    )
    # long tuples carry `/*index=5*/` comments, whose `=` would end a shape early
    lines = [re.sub(r"/\*.*?\*/", "", line) for line in hlo_text.splitlines()]
    users = None
    for line in lines:
        m = pattern.search(line)
        n = _group_size(line)
        if not m or n == 1:
            continue
        kind, nbytes = m.group(3), _shape_bytes(m.group(2))
        if kind == "all-reduce" and n:
            users = _users(lines) if users is None else users
            if _keeps_one_shard(m.group(1), m.group(2), n, users):
                kind, nbytes = "reduce-scatter", nbytes // n
        if (ragged := _ragged_rows(line, m.group(2))) is not None:
            kind, nbytes = "ragged-all-to-all", ragged
        out[kind]["count"] += 1
        out[kind]["bytes"] += nbytes
    return dict(out)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w-]+)\((.*)$")


def _users(lines: list[str]) -> dict[str, list[tuple[str, str, str]]]:
    """{instruction: [(user, its result shape, its opcode)]} of an HLO module's text."""
    out: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for line in lines:
        if m := _INSTRUCTION.match(line):
            for operand in set(re.findall(r"%[\w.-]+", m.group(4).split(", metadata=")[0])):
                out[operand].append((m.group(1), m.group(2), m.group(3)))
    return out


def _ragged_rows(line: str, shape_text: str) -> int | None:
    """Bytes of the rows a ragged all-to-all sends, for an exchange that
    `jaxllm.model.moe_ragged` names `ragged_all_to_all_rows{sent}_of{buffer}` (the ragged op or
    the padded all-to-all standing in for it where the backend lacks one, and their transposes):
    `sent` rows of the buffer's; None for other ops and the exchange's small index traffic."""
    m = re.search(r"ragged_all_to_all_rows(\d+)_of(\d+)", line)
    parts = [d.split(",") for d in re.findall(r"[a-z0-9]+\[([\d,]*)\]", shape_text)]
    if not m or not parts or min(len(p) for p in parts) < 2:
        return None  # rows are [rows, D] or [rows, k]; the offsets [n] are not
    rows = sum(int(p[0]) for p in parts)  # an XLA:CPU all-to-all: a tuple of a part per device
    if rows not in (int(m.group(1)), int(m.group(2))):
        return None
    return _shape_bytes(shape_text) // rows * int(m.group(1))


def _dims(shape_text: str) -> list[int] | None:
    """The dims of a single array shape like `f32[4,64,64]{2,1,0}` (None for a tuple)."""
    found = re.findall(r"[a-z0-9]+\[([\d,]*)\]", shape_text)
    if len(found) != 1:
        return None
    return [int(d) for d in found[0].split(",") if d]


def _keeps_one_shard(name: str, shape_text: str, n: int, users, depth: int = 0) -> bool:
    """Whether every use of `name`'s result keeps one 1 / n slice of it: each user's result
    has its dims with exactly one divided by `n`, or is the same shape (a dtype convert:
    XLA:CPU sums bfloat16 in float32) whose own users do. A tuple (combined all-reduces):
    every element's `get-tuple-element` users do."""
    used = users.get(name, [])
    if not used or depth > 3:
        return False
    if shape_text.startswith("("):
        return all(
            op == "get-tuple-element" and _keeps_one_shard(u, shape, n, users, depth + 1)
            for u, shape, op in used
        )
    dims = _dims(shape_text)
    if not dims:
        return False
    for user, shape, _ in used:
        got = _dims(shape)
        if got is None or len(got) != len(dims):
            return False
        diff = [(a, b) for a, b in zip(dims, got, strict=True) if a != b]
        if not diff:
            if not _keeps_one_shard(user, shape, n, users, depth + 1):
                return False
        elif len(diff) != 1 or diff[0][0] != diff[0][1] * n:
            return False
    return True

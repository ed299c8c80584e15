"""`jaxllm bench comm`: time of the collectives over each mesh axis, reported as nccl-tests does.

Each collective runs under `jax.shard_map` over one mesh axis at a time (the devices of the
other axes form independent groups doing the same at once), on a per-device buffer of `size`
bytes, the larger of its input and output as nccl-tests counts it:

    all_reduce      lax.psum                     in size     out size
    all_gather      lax.all_gather, tiled        in size/n   out size
    reduce_scatter  lax.psum_scatter, tiled      in size     out size/n
    all_to_all      lax.all_to_all, tiled        in size     out size
    ppermute        lax.ppermute, ring shift     in size     out size

algbw = size / time. busbw = algbw * factor, the share of `size` each device's link carries
with the best algorithm (nccl-tests, doc/PERFORMANCE.md): 2(n-1)/n for all-reduce, (n-1)/n for
all-gather, reduce-scatter and all-to-all, 1 for a send/receive. busbw is the number to hold
against a link's peak bandwidth. Every result is checked once against the value it must have
(`#wrong`: elements that differ, 0 expected). GB here is 1e9 bytes, as in nccl-tests.
"""

from __future__ import annotations

import re
import statistics
import time

import jax
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.config import ConfigError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")
DTYPES = ("float32", "bfloat16", "float16", "int32")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30}
_UNITS["gib"] = 2**30


def parse_size(text: str, flag: str) -> int:
    """'16M' or '16MiB' -> 16777216; plain numbers are bytes (powers of 1024, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{flag} {text!r} is not a size like 1024, 1K, 16M or 1GiB.")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_ops(text: str) -> tuple[str, ...]:
    """'all_reduce,ppermute' -> ('all_reduce', 'ppermute'); 'all' -> every collective."""
    if text.strip() == "all":
        return OPS
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise ConfigError(
            f"--ops names {', '.join(map(repr, unknown)) or 'no collective'}; choose from "
            f"{','.join(OPS)} (comma-separated)."
        )
    return ops


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """min_bytes, doubling, up to max_bytes (nccl-tests' -b, -e, -f 2)."""
    if min_bytes < 1:
        raise ConfigError(f"--min-bytes must be at least 1, not {min_bytes}.")
    if min_bytes > max_bytes:
        raise ConfigError(
            f"--min-bytes ({min_bytes}) is larger than --max-bytes ({max_bytes}); give the "
            "smaller size first."
        )
    out = [min_bytes]
    while out[-1] * 2 <= max_bytes:
        out.append(out[-1] * 2)
    return out


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` over `n` devices (nccl-tests' factors)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "ppermute":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def bandwidths(op: str, n: int, size_bytes: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) for one collective of `size_bytes` taking `seconds`."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, n)


def _collective(op: str, axis: str, n: int):
    """The per-device body of `op` over mesh axis `axis` of size `n`."""
    if op == "all_reduce":
        return lambda x: lax.psum(x, axis)
    if op == "all_gather":
        return lambda x: lax.all_gather(x, axis, tiled=True)
    if op == "reduce_scatter":
        return lambda x: lax.psum_scatter(x, axis, tiled=True)
    if op == "all_to_all":
        return lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True)
    ring = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: lax.ppermute(x, axis, ring)


def _fill(op: str, i: int) -> int:
    """What device `i` of the axis sends: ones to the reductions, its index to the others."""
    return 1 if op in ("all_reduce", "reduce_scatter") else i


def _expected(op: str, i: int, n: int, count: int) -> np.ndarray:
    """What device `i` of the axis must hold after `op` (inputs from `_fill`)."""
    if op == "all_reduce":
        return np.full(count, n)
    if op == "reduce_scatter":
        return np.full(count // n, n)
    if op in ("all_gather", "all_to_all"):  # block j came from device j
        return np.repeat(np.arange(n), count // n)
    return np.full(count, (i - 1) % n)  # ppermute: from the previous device on the ring


def _axis_index(mesh: Mesh, axis: str, block: int) -> int:
    """The index along `axis` of the device holding block `block` of an array split over every
    mesh axis in order (row-major over the mesh's device array)."""
    coords = np.unravel_index(block, mesh.devices.shape)
    return int(coords[mesh.axis_names.index(axis)])


def time_one(mesh: Mesh, op: str, axis: str, count: int, dtype, iters: int, warmup: int) -> dict:
    """Median seconds of `op` over `axis` on `count` elements per device, and the elements of its
    result, on every device of every process, that differ from what they must be."""
    n = mesh.shape[axis]
    every = PartitionSpec(mesh.axis_names)  # each device its own block
    sharding = NamedSharding(mesh, every)
    local_in = count // n if op == "all_gather" else count
    local_out = count // n if op == "reduce_scatter" else count

    def block(index):
        b = (index[0].start or 0) // local_in
        return np.full(local_in, _fill(op, _axis_index(mesh, axis, b)), dtype)

    x = jax.make_array_from_callback((mesh.size * local_in,), sharding, block)
    program = jax.shard_map(_collective(op, axis, n), mesh=mesh, in_specs=every, out_specs=every)
    compiled = jax.jit(program).lower(x).compile()
    out = jax.block_until_ready(compiled(x))
    wrong = 0
    for shard in out.addressable_shards:
        i = _axis_index(mesh, axis, (shard.index[0].start or 0) // local_out)
        got = np.asarray(shard.data).astype(np.float64)
        wrong += int(np.count_nonzero(got != _expected(op, i, n, count)))
    if jax.process_count() > 1:  # each process checks its own devices; all report the sum
        wrong = int(np.sum(multihost_utils.process_allgather(np.int64(wrong))))
    for _ in range(warmup):
        jax.block_until_ready(compiled(x))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(x))
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "wrong": wrong}


def check_options(dtype: str, iters: int, warmup: int) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    if iters < 1 or warmup < 0:
        raise ConfigError(f"--iters must be >= 1 and --warmup >= 0, not {iters} and {warmup}.")


def axes_to_test(mesh: Mesh) -> list[str]:
    """The mesh axes of more than one device; on a mesh of one device, `data` (a smoke test)."""
    return [a for a in mesh.axis_names if mesh.shape[a] > 1] or ["data"]


def bench_comm(
    mesh: Mesh,
    ops: tuple[str, ...] = OPS,
    min_bytes: int = 1024,
    max_bytes: int = 16 * 2**20,
    iters: int = 20,
    warmup: int = 5,
    dtype: str = "float32",
) -> dict:
    """Times each of `ops` over each mesh axis of more than one device, at every size from
    `sizes(min_bytes, max_bytes)`; one row per (op, axis, size)."""
    check_options(dtype, iters, warmup)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    size_list = sizes(min_bytes, max_bytes)
    rows = []
    for axis in axes_to_test(mesh):
        n = mesh.shape[axis]
        for op in ops:
            counts = []  # elements per device: a multiple of n, at least n, each size once
            for size in size_list:
                count = max(n, size // np_dtype.itemsize // n * n)
                if count not in counts:
                    counts.append(count)
            for count in counts:
                r = time_one(mesh, op, axis, count, np_dtype, iters, warmup)
                size = count * np_dtype.itemsize
                algbw, busbw = bandwidths(op, n, size, r["seconds"])
                rows.append(
                    {
                        "op": op,
                        "axis": axis,
                        "devices": n,
                        "groups": mesh.size // n,
                        "size": size,
                        "count": count,
                        "type": dtype,
                        "redop": "sum" if op in ("all_reduce", "reduce_scatter") else "none",
                        "time_us": r["seconds"] * 1e6,
                        "algbw": algbw,
                        "busbw": busbw,
                        "wrong": r["wrong"],
                    }
                )
    devices = mesh.devices.flat
    first = next(iter(devices))
    return {
        "device": f"{mesh.size} x {first.device_kind}",
        "processes": jax.process_count(),
        "mesh": {a: int(s) for a, s in mesh.shape.items()},
        "smoke_test": mesh.size == 1,
        "dtype": dtype,
        "iters": iters,
        "warmup": warmup,
        "rows": rows,
    }


_HEADER = (
    "#       size         count      type   redop     time   algbw   busbw  #wrong\n"
    "#        (B)    (elements)                       (us)  (GB/s)  (GB/s)"
)


def format_result(result: dict) -> str:
    """One nccl-tests table per (collective, mesh axis), each with its average bus bandwidth."""
    mesh = " ".join(f"{a}={s}" for a, s in result["mesh"].items() if s > 1) or "one device"
    lines = [
        f"# jaxllm bench comm: {result['device']}, {result['processes']} process(es), "
        f"mesh {mesh}, median of {result['iters']} after {result['warmup']} warm-up",
    ]
    if result["smoke_test"]:
        lines.append(
            "# one device: a smoke test (the collectives run over 1 device; nothing crosses a "
            "link, so busbw is 0)"
        )
    tables: dict[tuple[str, str], list[dict]] = {}
    for row in result["rows"]:
        tables.setdefault((row["op"], row["axis"]), []).append(row)
    for (op, axis), rows in tables.items():
        n, groups = rows[0]["devices"], rows[0]["groups"]
        lines += ["", f"# {op} over mesh axis {axis}: {n} devices, {groups} group(s)", _HEADER]
        for r in rows:
            lines.append(
                f"{r['size']:>12} {r['count']:>13} {r['type']:>9} {r['redop']:>7} "
                f"{r['time_us']:>8.1f} {r['algbw']:>7.2f} {r['busbw']:>7.2f} {r['wrong']:>7}"
            )
        avg = statistics.mean(r["busbw"] for r in rows)
        lines.append(f"# Avg bus bandwidth    : {avg:.4g} GB/s")
    wrong = sum(r["wrong"] for r in result["rows"])
    lines += ["", f"# wrong elements in all results: {wrong}"]
    return "\n".join(lines)

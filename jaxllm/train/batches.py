"""Global batches on the mesh: which rows of each batch a process feeds, and their assembly
into global jax arrays."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


def process_rows(batch_sharding: NamedSharding, global_batch_size: int) -> slice:
    """The rows of each global batch that this process's devices hold (a contiguous range)."""
    index_map = batch_sharding.addressable_devices_indices_map((global_batch_size, 1))
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [
        global_batch_size if idx[0].stop is None else idx[0].stop for idx in index_map.values()
    ]
    rows = slice(min(starts), max(stops))
    held = set().union(*(range(a, b) for a, b in zip(starts, stops)))
    if len(held) != rows.stop - rows.start:
        raise ValueError(f"this process's batch rows {sorted(held)} are not contiguous")
    return rows


def to_global(batch: dict, batch_sharding: NamedSharding, global_batch_size: int | None = None):
    """This process's rows of a batch (numpy) -> global jax arrays laid out on the mesh."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        v = v.astype(np.float32 if v.dtype.kind == "f" else np.int32)  # ids, masks; log-probs
        shape = None if global_batch_size is None else (global_batch_size, *v.shape[1:])
        out[k] = jax.make_array_from_process_local_data(batch_sharding, v, shape)
    return out

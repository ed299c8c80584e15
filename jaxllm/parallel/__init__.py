"""Model operations that run per device under `jax.shard_map`: the one seam between the model
and the mesh.

`jaxllm.sharding` names mesh axes and holds the active `Parallel` settings; the functions here
read those settings and run the model's per-device functions on each device's shard (a plain
call without a mesh). The model passes its functions in and imports only this package, never a
mesh, `shard_map` or a module below:

- `per_shard.py`: a kernel per batch/head shard (`per_shard_attention`), or per shard of any
  logical axes (`per_shard`).
- `ring.py`: context-parallel ring attention over the `sequence` axis (`ring_active`,
  `ring_attention`), the zigzag layout of a batch (`sequence_layout`); `ring_xla.py` and
  `ring_flash.py` hold its two block algorithms.
- `ulysses.py`: Ulysses context parallelism over the `sequence` axis (`ulysses_active`,
  `ulysses_attention`): all-to-alls between length shards and whole-sequence head groups; and
  USP (`usp_active`, `usp_attention`): Ulysses inside groups of devices, the ring across them.
- `collective_matmul.py`: the all-gather before a column-parallel matmul decomposed into
  ring steps overlapped with partial matmuls (`collective_matmul_active`, `collective_matmul`).
- `moe_dispatch.py`: mixture-of-experts dropless and all-to-all dispatch
  (`per_shard_dropless`, `per_shard_all_to_all`, `expert_all_to_all_active`,
  `dropless_ragged_active`).
- `ragged.py`: `ragged_all_to_all`, `jax.lax.ragged_all_to_all` or, where the backend lacks it
  (XLA:CPU), an exact padded all-to-all (`padded_ragged_all_to_all`).
"""

from jaxllm.parallel.collective_matmul import collective_matmul, collective_matmul_active
from jaxllm.parallel.moe_dispatch import (
    dropless_ragged_active,
    expert_all_to_all_active,
    per_shard_all_to_all,
    per_shard_dropless,
)
from jaxllm.parallel.per_shard import per_shard, per_shard_attention
from jaxllm.parallel.ragged import ragged_all_to_all
from jaxllm.parallel.ring import ring_active, ring_attention, sequence_layout
from jaxllm.parallel.ulysses import ulysses_active, ulysses_attention, usp_active, usp_attention

__all__ = [
    "dropless_ragged_active",
    "collective_matmul",
    "collective_matmul_active",
    "expert_all_to_all_active",
    "per_shard",
    "per_shard_all_to_all",
    "per_shard_attention",
    "per_shard_dropless",
    "ragged_all_to_all",
    "ring_active",
    "ring_attention",
    "sequence_layout",
    "ulysses_active",
    "ulysses_attention",
    "usp_active",
    "usp_attention",
]

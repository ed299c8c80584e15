"""Device mesh and logical-axis rules: the only module that names mesh axes.

Model code tags every parameter and activation with *logical* axis names (`embed`, `heads`,
`mlp`, ...). `RULES` maps each logical name to the mesh axes it is split over; `spec()` turns a
tuple of logical names into a `PartitionSpec`. Changing the parallel layout is a config change
(`mesh.*` degrees), never a model change.

The model operations that run per device under `shard_map` (kernels per shard, ring attention,
MoE dispatch) live in `jaxllm.parallel`, which reads the active `Parallel` settings from here.

`process_rows` and `to_global` place the batches: the rows of each global batch a process
feeds, and their assembly into global arrays on the mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.config import MESH_AXES, ConfigError, MeshConfig, mesh_degrees

__all__ = [
    "RULES",
    "Parallel",
    "active",
    "check_divisible",
    "constrain",
    "current",
    "make_mesh",
    "named",
    "process_rows",
    "shard_map_mesh",
    "spec",
    "to_global",
    "tree_shardings",
]

# logical axis -> mesh axes it is sharded over (None: replicated). One entry per name; no order.
RULES: dict[str, tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp", "expert"),  # outside MoE layers, expert shards act as data shards
    # rows of expert-major MoE buffers [B, E, C, D], whose experts hold the `expert` axis
    "expert_group": ("data", "fsdp"),
    "length": ("sequence",),
    # the residual stream's length: with mesh.tensor_sequence_parallel over `tensor` too
    # (Megatron-SP; `constrain` adds it where the length divides)
    "res_length": ("sequence",),
    # the model dim of activations: over `tensor2` with 2D tensor parallelism (mesh.tensor2),
    # the residual stream's between blocks over `tensor` too (`constrain` adds it)
    "act_embed": ("tensor2",),
    "act_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_kv_length": None,  # keys/values all-gathered over `sequence` for attention
    # parameters
    # the stacked blocks: pipeline stage s holds its slice of the stack (`jaxllm.parallel.pipeline`)
    "layers": ("stage",),
    # with pipeline stages, the unstacked parameters (embedding, head) are split over them too,
    # like fsdp (a stacked one's `stage` goes to its `layers` axis first); 2D tensor parallelism
    # splits it over `tensor2` too, so [embed, heads | mlp] weights lie over tensor2 x tensor
    "embed": ("fsdp", "stage", "tensor2"),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "q_lora": None,  # MLA latents: narrow, their projections split over `embed` / `heads`
    "kv_lora": None,
    "positions": None,  # rows of a learned position table
    "relative_buckets": None,  # rows of a T5 relative position bias table
    "mlp": ("tensor",),
    "norm": ("fsdp", "tensor2"),
    "expert": ("expert",),
    "router_expert": None,  # router columns: every token scores every expert
    "lora_rank": None,
    "adapter": None,  # a bottleneck adapter's narrow dim (its other dim is `embed`)
    "virtual_tokens": None,  # soft-prompt rows  # LoRA factors: their other dims follow the weight they adapt
    "quant_block": None,  # NF4 codes of a weight's trailing dims, packed into blocks
    "vision_patch": None,  # the pixels of a patch, input of a vision tower's patch embedding
}


def spec(logical_axes: Sequence[str | None]) -> PartitionSpec:
    """('embed', 'mlp') -> PartitionSpec('fsdp', 'tensor'). Unknown names are an error."""
    out = []
    used: set[str] = set()
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in RULES:
            raise KeyError(f"logical axis {name!r} has no rule in jaxllm.sharding.RULES")
        axes = tuple(a for a in (RULES[name] or ()) if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with one axis per parallelism dimension, sizes from the config.

    With `dcn_*` degrees, devices are grouped into slices (TPU slices, else processes; on a single
    process, contiguous groups stand in for slices) and each axis is laid out slice-major, so the
    fast-network degree varies fastest, as `mesh_utils.create_hybrid_device_mesh` does.
    """
    if not isinstance(cfg, MeshConfig):
        raise TypeError(
            f"make_mesh takes a MeshConfig (a Config's .mesh), not {type(cfg).__name__}"
        )
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_degrees(cfg, len(devices))
    dcn = [getattr(cfg, f"dcn_{a}", 1) for a in MESH_AXES]
    ici = [sizes[a] // d for a, d in zip(MESH_AXES, dcn)]
    n_slices = int(np.prod(dcn))
    if n_slices == 1:
        try:
            device_array = mesh_utils.create_device_mesh(ici, devices)
        except (AssertionError, NotImplementedError, ValueError):
            device_array = np.asarray(devices).reshape(ici)
    else:
        groups = _slices(devices, n_slices)
        per_slice = [np.asarray(g).reshape(ici) for g in groups]
        device_array = np.stack(per_slice).reshape(*dcn, *ici)
        n = len(MESH_AXES)  # interleave (dcn_0, ici_0, dcn_1, ici_1, ...) then merge pairs
        order = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]
        device_array = device_array.transpose(order).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(device_array, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def _slices(devices: list, n: int) -> list[list]:
    key = "slice_index" if hasattr(devices[0], "slice_index") else "process_index"
    by_key: dict[int, list] = {}
    for d in devices:
        by_key.setdefault(getattr(d, key), []).append(d)
    if len(by_key) == n:
        return [by_key[k] for k in sorted(by_key)]
    if len(by_key) == 1:  # one host: contiguous groups stand in for slices (tests, planning)
        size = len(devices) // n
        return [devices[i * size : (i + 1) * size] for i in range(n)]
    raise ValueError(
        f"the mesh asks for {n} DCN slices but the devices form {len(by_key)} ({key}); "
        "make the product of the mesh.dcn_* degrees equal the number of slices or hosts."
    )


def named(mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
    """The sharding of `logical_axes` on `mesh`; without pipeline stages the spec names no
    `stage` (the `layers` axis stays replicated), without 2D tensor parallelism no `tensor2`."""
    return NamedSharding(mesh, _without(spec(logical_axes), _unused(mesh)))


# Mesh axes the specs name only where the mesh splits over them (size > 1).
_OPTIONAL = ("stage", "tensor2")


def _unused(mesh) -> set[str]:
    return {a for a in _OPTIONAL if mesh.shape.get(a, 1) == 1}


def _without(partition: PartitionSpec, axes: set[str]) -> PartitionSpec:
    """`partition` with the mesh `axes` left out of every entry."""
    entries = []
    for e in partition:
        kept = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def check_divisible(mesh: Mesh, abstract_params: dict, logical_tree: dict) -> None:
    """Every sharded dimension must split evenly; names the parameter and the mesh axis if not."""
    flat_axes = jax.tree_util.tree_flatten_with_path(
        logical_tree, is_leaf=lambda x: isinstance(x, tuple)
    )[0]
    flat_params = jax.tree.leaves(abstract_params)
    for (path, axes), leaf in zip(flat_axes, flat_params):
        for dim, entry in zip(leaf.shape, spec(axes)):
            mesh_axes = (entry,) if isinstance(entry, str) else entry or ()
            size = int(np.prod([mesh.shape.get(a, 1) for a in mesh_axes]))
            if dim % size:
                name = "/".join(str(getattr(k, "key", k)) for k in path)
                raise ConfigError(
                    f"parameter {name} has a dimension of {dim} that cannot be split "
                    f"{size} ways over mesh {'x'.join(mesh_axes)}; change the model size or "
                    f"the mesh.{mesh_axes[0]} degree."
                )


def tree_shardings(mesh: Mesh, logical_tree):
    """A tree of logical-axes tuples -> the same tree of NamedShardings."""
    return jax.tree.map(
        lambda axes: named(mesh, axes), logical_tree, is_leaf=lambda x: isinstance(x, tuple)
    )


# Global batches: which rows of each batch a process feeds, and their assembly into global
# jax arrays laid out on the mesh.


def process_rows(batch_sharding: NamedSharding, global_batch_size: int) -> slice:
    """The rows of each global batch that this process's devices hold (a contiguous range)."""
    # later dims as long as the device count, so a split of the length (mesh.sequence) divides
    rank = max(len(batch_sharding.spec), 2)
    shape = (global_batch_size,) + (len(batch_sharding.device_set),) * (rank - 1)
    index_map = batch_sharding.addressable_devices_indices_map(shape)
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


# Activation constraints: the train step makes its `Parallel` settings active while tracing;
# model code calls `constrain(x, ('batch', 'length', 'act_embed'))`, a no-op without a mesh.


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How model operations run on the mesh, as one object: the train and eval steps take it.

    `sequence_attention` (`all_gather`, `ring`, `ulysses` or `usp`, with its Ulysses degree
    `sequence_ulysses`) is how attention runs over a sharded sequence;
    `expert_dispatch` (`all_to_all` or `annotations`) is how capacity-mode MoE layers reach
    experts on other devices, `dropless_dispatch` (`all_gather` or `ragged_all_to_all`) how
    dropless ones do; `overlap` holds the switches of `mesh.overlap`
    (`collective_matmul` is read by `jaxllm.parallel.collective_matmul`). No mesh: everything
    runs as plain single-device code."""

    mesh: Mesh | None = None
    sequence_attention: str = "all_gather"
    expert_dispatch: str = "annotations"
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_ulysses: int = 1
    tensor_sequence_parallel: bool = False
    dropless_dispatch: str = "all_gather"
    overlap: tuple[str, ...] = ()

    @classmethod
    def of(cls, mesh: Mesh | None, cfg: MeshConfig) -> Parallel:
        """The settings of a config's `mesh` section on `mesh`."""
        return cls(
            mesh,
            cfg.sequence_attention,
            cfg.expert_dispatch,
            cfg.pipeline_schedule,
            cfg.virtual_stages,
            cfg.sequence_ulysses,
            cfg.tensor_sequence_parallel,
            cfg.dropless_dispatch,
            tuple(cfg.overlap),
        )

    @property
    def stages(self) -> int:
        """Pipeline stages of the mesh (1: no pipeline)."""
        return 1 if self.mesh is None else self.mesh.shape.get("stage", 1)


_ACTIVE: contextvars.ContextVar[Parallel] = contextvars.ContextVar("parallel", default=Parallel())


@contextlib.contextmanager
def active(parallel: Parallel):
    """Within it, `constrain` and the per-shard operations of `jaxllm.parallel` use `parallel`."""
    token = _ACTIVE.set(parallel)
    try:
        yield parallel
    finally:
        _ACTIVE.reset(token)


def current() -> Parallel:
    """The active `Parallel` settings (no mesh outside `active`)."""
    return _ACTIVE.get()


def shard_map_mesh(mesh: Mesh):
    """The mesh a nested `shard_map` names: inside one manual over some axes (a pipeline
    stage) the context's abstract mesh, which carries those axes as manual, else `mesh`."""
    inner = jax.sharding.get_abstract_mesh()
    return inner if inner.manual_axes else mesh


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`x` constrained to the layout its logical axes map to (`RULES`) on the active mesh
    (`active`); unchanged without a mesh or on one device."""
    parallel = _ACTIVE.get()
    mesh = parallel.mesh
    if mesh is None or mesh.size == 1:
        return x
    partition = spec(logical_axes)
    if parallel.tensor_sequence_parallel and "res_length" in logical_axes:
        partition = _with_tensor(partition, list(logical_axes).index("res_length"), x, mesh)
    if mesh.shape.get("tensor2", 1) > 1 and {"res_length", "act_embed"} <= set(logical_axes):
        # 2D TP: between blocks the residual's model dim lies over tensor2 x tensor, so a
        # reduce-scatter ends each row-parallel matmul and an all-gather starts each block
        partition = _with_tensor(partition, list(logical_axes).index("act_embed"), x, mesh)
    inner = jax.sharding.get_abstract_mesh()
    if inner.manual_axes:  # inside a shard_map manual over some axes (pipeline stages)
        inside = _without(partition, set(inner.manual_axes) | _unused(inner))
        return jax.lax.with_sharding_constraint(x, NamedSharding(inner, inside))
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, _without(partition, _unused(mesh)))
    )


def _with_tensor(partition: PartitionSpec, dim: int, x, mesh: Mesh) -> PartitionSpec:
    """`partition` with `tensor` added to dimension `dim` (the residual stream's length, or
    with mesh.tensor2 its model dim) when no other dimension holds it and the dim divides (a
    decode step's single token stays whole)."""
    entries = [(e,) if isinstance(e, str) else tuple(e or ()) for e in partition]
    if any("tensor" in e for e in entries) or mesh.shape.get("tensor", 1) == 1:
        return partition
    axes = (*entries[dim], "tensor")
    if x.shape[dim] % int(np.prod([mesh.shape[a] for a in axes])):
        return partition
    entries[dim] = axes
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))

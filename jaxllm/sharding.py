"""Device mesh and logical-axis rules: the only module that names mesh axes.

Model code tags every parameter and activation with *logical* axis names (`embed`, `heads`,
`mlp`, ...). `RULES` maps each logical name to the mesh axes it is split over; `spec()` turns a
tuple of logical names into a `PartitionSpec`. Changing the parallel layout is a config change
(`mesh.*` degrees), never a model change.
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

from jaxllm.config import MESH_AXES, MeshConfig, mesh_degrees

# logical axis -> mesh axes it is sharded over (None: replicated). One entry per name; no order.
RULES: dict[str, tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp", "expert"),  # outside MoE layers, expert shards act as data shards
    # rows of expert-major MoE buffers [B, E, C, D], whose experts hold the `expert` axis
    "expert_group": ("data", "fsdp"),
    "length": ("sequence",),
    "act_embed": None,
    "act_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_kv_length": None,  # keys/values all-gathered over `sequence` for attention
    # parameters
    "layers": None,
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "q_lora": None,  # MLA latents: narrow, their projections split over `embed` / `heads`
    "kv_lora": None,
    "positions": None,  # rows of a learned position table
    "mlp": ("tensor",),
    "norm": ("fsdp",),
    "expert": ("expert",),
    "router_expert": None,  # router columns: every token scores every expert
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
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_degrees(cfg, len(devices))
    dcn = [getattr(cfg, f"dcn_{a}") for a in MESH_AXES]
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
    return NamedSharding(mesh, spec(logical_axes))


def check_divisible(mesh: Mesh, abstract_params: dict, logical_tree: dict) -> None:
    """Every sharded dimension must split evenly; names the parameter and the mesh axis if not."""
    from jaxllm.config import ConfigError

    flat_axes = jax.tree_util.tree_flatten_with_path(
        logical_tree, is_leaf=lambda x: isinstance(x, tuple)
    )[0]
    flat_params = jax.tree.leaves(abstract_params)
    for (path, axes), leaf in zip(flat_axes, flat_params):
        for dim, entry in zip(leaf.shape, spec(axes)):
            mesh_axes = (entry,) if isinstance(entry, str) else entry or ()
            size = int(np.prod([mesh.shape[a] for a in mesh_axes]))
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


# Activation constraints: the train step makes its `Parallel` settings active while tracing;
# model code calls `constrain(x, ('batch', 'length', 'act_embed'))`, a no-op without a mesh.


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How model operations run on the mesh, as one object: the train and eval steps take it.

    `sequence_attention` (`all_gather` or `ring`) is how attention runs over a sharded sequence;
    `expert_dispatch` (`all_to_all` or `annotations`) is how capacity-mode MoE layers reach
    experts on other devices. No mesh: everything runs as plain single-device code."""

    mesh: Mesh | None = None
    sequence_attention: str = "all_gather"
    expert_dispatch: str = "annotations"

    @classmethod
    def of(cls, mesh: Mesh | None, cfg: MeshConfig) -> Parallel:
        """The settings of a config's `mesh` section on `mesh`."""
        return cls(mesh, cfg.sequence_attention, cfg.expert_dispatch)


_ACTIVE: contextvars.ContextVar[Parallel] = contextvars.ContextVar("parallel", default=Parallel())


@contextlib.contextmanager
def active(parallel: Parallel):
    """Within it, `constrain` and the per-shard operations use `parallel`."""
    token = _ACTIVE.set(parallel)
    try:
        yield parallel
    finally:
        _ACTIVE.reset(token)


def current() -> Parallel:
    """The active `Parallel` settings (no mesh outside `active`)."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    mesh = _ACTIVE.get().mesh
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, named(mesh, logical_axes))


def _ring_mesh() -> Mesh | None:
    mesh, mode = _ACTIVE.get().mesh, _ACTIVE.get().sequence_attention
    if mesh is None or mode != "ring" or mesh.shape["sequence"] == 1:
        return None
    return mesh


def ring_active() -> bool:
    """Whether attention should run as ring attention over the `sequence` axis."""
    return _ring_mesh() is not None


def sequence_layout(batch: dict) -> dict:
    """Lays each row out in zigzag order along length when ring attention is active, so the
    causal work of the sequence shards is balanced. Losses are sums over tokens, so nothing has
    to be put back; RoPE reads the permuted `positions`."""
    mesh = _ring_mesh()
    if mesh is None:
        return batch
    from jaxllm.model.ring_attention import zigzag_permutation

    perm = zigzag_permutation(batch["inputs"].shape[1], mesh.shape["sequence"])
    return {k: v[:, perm] for k, v in batch.items()}


def ring_attention(
    q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, impl: str = "xla"
) -> jax.Array:
    """Ring attention over the `sequence` axis on batches in `sequence_layout` order; `impl`
    (the resolved `attention_impl`) picks the per-block computation (`flash`: the kernel)."""
    from jaxllm.model.ring_attention import ring_attention as ring

    mesh = _ring_mesh()
    return ring(
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL=segment_ids_BxL, mesh=mesh,
        axis_name="sequence", batch_axes=RULES["batch"], head_axis=RULES["act_heads"][0],
        impl=impl,
    )  # fmt: skip


def per_shard_attention(fn, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS):
    """Runs `fn(q, k, v, q_seg, kv_seg)` on each device's batch and head shard under the active
    mesh (whole sequences: a sequence-sharded input is gathered first); plain call without one."""
    mesh = _ACTIVE.get().mesh
    if mesh is None or mesh.size == 1:
        return fn(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS)
    batch, heads = RULES["batch"], RULES["act_heads"][0]
    qkv = PartitionSpec(batch, None, heads, None)
    seg = None if q_seg_BxL is None else PartitionSpec(batch, None)
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(qkv, qkv, qkv, seg, seg), out_specs=qkv, check_vma=False
    )(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS)


def per_shard(fn, args: tuple, in_axes: tuple, out_axes):
    """Runs `fn(*args)` per device under the active mesh with `shard_map`, the inputs and outputs
    split as their logical axes say (trees of axes tuples; None: replicated). For kernels, which
    the SPMD partitioner cannot split. A plain call without a mesh."""
    mesh = _ACTIVE.get().mesh
    if mesh is None or mesh.size == 1:
        return fn(*args)

    def to_spec(tree):
        return jax.tree.map(
            lambda ax: PartitionSpec() if ax is None else spec(ax),
            tree,
            is_leaf=lambda x: x is None or isinstance(x, tuple),
        )

    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=tuple(to_spec(a) for a in in_axes),
        out_specs=to_spec(out_axes),
        check_vma=False,
    )(*args)


# Mixture-of-experts placement: the model's MoE layer (`jaxllm.model.moe`) calls these with
# per-device functions that take the mesh axis names of experts and expert hidden units.


def _expert_specs():
    """(expert axis, tensor axis) and the specs of stacked expert weights inside shard_map:
    experts split over `expert`, hidden units over `tensor`, `embed` gathered (FSDP)."""
    expert, tensor = RULES["expert"][0], RULES["mlp"][0]
    return expert, tensor, PartitionSpec(expert, None, tensor), PartitionSpec(expert, tensor, None)


def expert_all_to_all_active() -> bool:
    """Whether capacity-mode MoE buffers go to their experts by an explicit all-to-all."""
    mesh = _ACTIVE.get().mesh
    return (
        mesh is not None
        and mesh.shape[RULES["expert"][0]] > 1
        and _ACTIVE.get().expert_dispatch == "all_to_all"
    )


def per_shard_dropless(fn, x_BxLxD, idx_BxLxX, w_BxLxX, gate_ExDxF, up_ExDxF, down_ExFxD):
    """Runs `fn(x, idx, w, gate, up, down, expert_axis=, tensor_axis=)` on each device's tokens
    and its slice of the experts under `shard_map` (a plain call without a mesh), so the sort
    by expert and the grouped matmul of dropless routing stay local to each device."""
    mesh = _ACTIVE.get().mesh
    if mesh is None or mesh.size == 1:
        return fn(x_BxLxD, idx_BxLxX, w_BxLxX, gate_ExDxF, up_ExDxF, down_ExFxD,
                  expert_axis=None, tensor_axis=None)  # fmt: skip
    expert, tensor, in_w, out_w = _expert_specs()
    tokens = PartitionSpec(RULES["batch"], RULES["length"][0], None)

    def local(x, idx, w, gate, up, down):
        return fn(x, idx, w, gate, up, down, expert_axis=expert, tensor_axis=tensor)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(tokens, tokens, tokens, in_w, in_w, out_w), out_specs=tokens
    )(x_BxLxD, idx_BxLxX, w_BxLxX, gate_ExDxF, up_ExDxF, down_ExFxD)


def per_shard_all_to_all(fn, buf_BxExCxD, gate_ExDxF, up_ExDxF, down_ExFxD):
    """Runs `fn(buf, gate, up, down, expert_axis=, tensor_axis=)` under `shard_map` on each
    device's rows of expert buffers [B, E, C, D] (rows split like the batch); `fn` exchanges
    them with the devices holding the experts."""
    mesh = _ACTIVE.get().mesh
    expert, tensor, in_w, out_w = _expert_specs()
    bufs = PartitionSpec(RULES["batch"], None, None, None)

    def local(buf, gate, up, down):
        return fn(buf, gate, up, down, expert_axis=expert, tensor_axis=tensor)

    return jax.shard_map(local, mesh=mesh, in_specs=(bufs, in_w, in_w, out_w), out_specs=bufs)(
        buf_BxExCxD, gate_ExDxF, up_ExDxF, down_ExFxD
    )

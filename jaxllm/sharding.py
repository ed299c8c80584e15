"""Device mesh and logical-axis rules: the only module that names mesh axes.

Model code tags every parameter and activation with *logical* axis names (`embed`, `heads`,
`mlp`, ...). `RULES` maps each logical name to the mesh axes it is split over; `spec()` turns a
tuple of logical names into a `PartitionSpec`. Changing the parallel layout is a config change
(`mesh.*` degrees), never a model change.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.config import MESH_AXES, MeshConfig, mesh_degrees

# logical axis -> mesh axes it is sharded over (None: replicated). One entry per name; no order.
RULES: dict[str, tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp"),
    "length": ("sequence",),
    "act_embed": None,
    "act_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    # parameters
    "layers": None,
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "mlp": ("tensor",),
    "norm": None,
    "expert": ("expert",),
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
    """A mesh with one axis per parallelism dimension, degrees from the config."""
    devices = list(devices if devices is not None else jax.devices())
    degrees = mesh_degrees(cfg, len(devices))
    shape = tuple(degrees[a] for a in MESH_AXES)
    device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def named(mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(mesh, spec(logical_axes))


def tree_shardings(mesh: Mesh, logical_tree):
    """A tree of logical-axes tuples -> the same tree of NamedShardings."""
    return jax.tree.map(
        lambda axes: named(mesh, axes), logical_tree, is_leaf=lambda x: isinstance(x, tuple)
    )


# Activation constraints: the train step sets the mesh while tracing; model code calls
# `constrain(x, ('batch', 'length', 'act_embed'))`, a no-op when no mesh is active.
_ACTIVE_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("mesh", default=None)


@contextlib.contextmanager
def active_mesh(mesh: Mesh | None):
    token = _ACTIVE_MESH.set(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE_MESH.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    mesh = _ACTIVE_MESH.get()
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, named(mesh, logical_axes))

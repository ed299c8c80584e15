"""Lowering for an accelerator from this CPU-only machine, on every supported jax.

`jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))` compiles nothing: it emits the
StableHLO that the platform's compiler would take, custom calls (Mosaic TPU, Mosaic GPU, Triton)
included. For CUDA, newer jax reads the target GPU (the Triton lowering needs its compute
capability) from the abstract device of the active abstract mesh and refuses when neither it
nor a real GPU is there; jax 0.10 fell back to a default. Naming the target GPU works on both.
"""

from __future__ import annotations

import contextlib

import jax

TARGET_GPU = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")


def target(platform: str):
    """A context in which lowering for `platform` sees a device of that platform."""
    if platform not in ("cuda", "rocm"):
        return contextlib.nullcontext()
    mesh = jax.sharding.AbstractMesh(
        (1,), ("target",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=TARGET_GPU
    )
    return jax.sharding.use_abstract_mesh(mesh)


def lower(fn, *args, platform: str):
    """`fn` (not jitted yet) traced at `args` (arrays or ShapeDtypeStructs) and lowered."""
    with target(platform):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))

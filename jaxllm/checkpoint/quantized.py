"""Optimizer states stored compactly (`checkpoint.quantize_opt_state=int8`): each float moment
of the optimizer state (Adam's mu and nu, momentum traces, Adafactor's factors, ...; never the
float32 master weights of `optim.master_weights`, nor scalars) is saved as one 8-bit code per
element plus one float32 absmax per block of `BLOCK` elements along its last dim, with the
signed dynamic code book of the 8-bit optimizers (`jaxllm.optim.adamw_8bit`: its blocking, so
codes and scales shard like the moment). About a quarter of the bytes; lossy, so a resume
continues from the dequantized moments, not bit-identically.

The checkpoint records how it was stored in the JSON item `opt_codec`; a checkpoint without it
holds the optimizer state as it was, so either kind resumes under either setting."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.blockwise import blocks_per_row, dequantize, dynamic_code, quantize

BLOCK = 256
CODEC_ITEM = "opt_codec"
_KEYS = frozenset({"codes", "absmax"})


def record() -> dict:
    return {"format": "int8", "code": "dynamic_signed", "block": BLOCK}


def _quantized(path, x) -> bool:
    """A float moment: a floating array of rank >= 1 outside the master weights."""
    names = {getattr(k, "name", None) for k in path}
    return (
        hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and len(x.shape) >= 1
    ) and "master" not in names


def _is_packed(x) -> bool:
    return isinstance(x, dict) and set(x) == _KEYS


def _on_device(sharding):
    """`sharding` in device memory (an offloaded optimizer state lives in host memory)."""
    kind = getattr(sharding, "memory_kind", None)
    return sharding.with_memory_kind("device") if kind not in (None, "device") else sharding


@jax.jit
def _quantize(x, code):
    q, absmax = quantize(x.astype(jnp.float32), code, BLOCK)
    return {"codes": q, "absmax": absmax}


def pack(opt_state):
    """The optimizer state with each float moment as {"codes": uint8, "absmax": float32}, one
    moment at a time (brought to device memory when offloaded)."""
    code = jnp.asarray(dynamic_code(signed=True))

    def one(path, x):
        if not _quantized(path, x):
            return x
        return _quantize(jax.device_put(x, _on_device(x.sharding)), code)

    return jax.tree_util.tree_map_with_path(one, opt_state)


def packed_target(abstract_opt):
    """The restore target of a packed state: ShapeDtypeStructs, codes and scales placed with
    the sharding of the moment they stand for."""

    def one(path, x):
        if not _quantized(path, x):
            return x
        shape = (*x.shape[:-1], blocks_per_row(x.shape[-1], BLOCK)[0])
        s = getattr(x, "sharding", None)
        s = _on_device(s) if s is not None else None
        return {
            "codes": jax.ShapeDtypeStruct(x.shape, jnp.uint8, sharding=s),
            "absmax": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=_fitted(s, shape)),
        }

    return jax.tree_util.tree_map_with_path(one, abstract_opt)


def _fitted(sharding, shape):
    """The moment's sharding for its scales: a dim counted in blocks that its mesh axes do not
    divide is kept whole (scales are 1/BLOCK of the moment)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))

    def size(axes):
        axes = axes if isinstance(axes, tuple) else (axes,)
        return math.prod(sharding.mesh.shape[a] for a in axes if a is not None)

    kept = [a if a is None or n % size(a) == 0 else None for a, n in zip(spec, shape)]
    return NamedSharding(sharding.mesh, PartitionSpec(*kept))


def unpack(packed, abstract_opt, block: int = BLOCK):
    """The optimizer state of `abstract_opt`'s structure and dtypes from a packed one."""
    code = jnp.asarray(dynamic_code(signed=True))
    want, treedef = jax.tree.flatten(abstract_opt)
    got = jax.tree.leaves(packed, is_leaf=_is_packed)
    out = []
    for w, g in zip(want, got, strict=True):
        if _is_packed(g):
            g = _dequantize(g["codes"], g["absmax"], code, block, w.dtype)
            if getattr(w, "sharding", None) is not None:  # back where the state lives
                g = jax.device_put(g, w.sharding)
        out.append(g)
    return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def _dequantize(q, absmax, code, block, dtype):
    return dequantize(q, absmax, code, block).astype(dtype)

"""Mixture-of-experts placement: the model's MoE layer (`jaxllm.model.moe`) calls these with
per-device functions that take the mesh axis names of experts and expert hidden units, and they
run them under `jax.shard_map` on each device's tokens and its slice of the experts."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from jaxllm import sharding


def _expert_specs(gate_ExDxF, up_ExDxF, down_ExFxD):
    """(expert axis, tensor axis) and the specs of the stacked expert weights inside shard_map:
    experts split over `expert`, hidden units over `tensor`, `embed` gathered (FSDP). A coded
    stack's (`jaxllm.model.coded`) codes are laid out like the weight; its per-output-channel
    scales [E, out] take the expert and output entries."""
    expert, tensor = sharding.RULES["expert"][0], sharding.RULES["mlp"][0]

    def like(w, spec: PartitionSpec):
        scales = PartitionSpec(spec[0], spec[2])
        return jax.tree.map(lambda leaf: spec if leaf.ndim == len(spec) else scales, w)

    in_w, out_w = PartitionSpec(expert, None, tensor), PartitionSpec(expert, tensor, None)
    specs = (like(gate_ExDxF, in_w), like(up_ExDxF, in_w), like(down_ExFxD, out_w))
    return expert, tensor, specs


def expert_all_to_all_active() -> bool:
    """Whether capacity-mode MoE buffers go to their experts by an explicit all-to-all."""
    settings = sharding.current()
    mesh = settings.mesh
    return (
        mesh is not None
        and mesh.shape[sharding.RULES["expert"][0]] > 1
        and settings.expert_dispatch == "all_to_all"
    )


def dropless_ragged_active() -> bool:
    """Whether dropless MoE layers send tokens to their experts' devices by a ragged
    all-to-all (instead of gathering the tokens of the expert group)."""
    settings = sharding.current()
    mesh = settings.mesh
    return (
        mesh is not None
        and mesh.shape[sharding.RULES["expert"][0]] > 1
        and settings.dropless_dispatch == "ragged_all_to_all"
    )


def per_shard_dropless(fn, x_BxLxD, idx_BxLxX, w_BxLxX, gate_ExDxF, up_ExDxF, down_ExFxD):
    """Runs `fn(x, idx, w, gate, up, down, expert_axis=, tensor_axis=)` on each device's tokens
    and its slice of the experts under `shard_map` (a plain call without a mesh), so the sort
    by expert and the grouped matmul of dropless routing stay local to each device."""
    mesh = sharding.current().mesh
    if mesh is None or mesh.size == 1:
        return fn(
            x_BxLxD,
            idx_BxLxX,
            w_BxLxX,
            gate_ExDxF,
            up_ExDxF,
            down_ExFxD,
            expert_axis=None,
            tensor_axis=None,
        )
    expert, tensor, weights = _expert_specs(gate_ExDxF, up_ExDxF, down_ExFxD)
    tokens = PartitionSpec(sharding.RULES["batch"], sharding.RULES["length"][0], None)

    def local(x, idx, w, gate, up, down):
        return fn(x, idx, w, gate, up, down, expert_axis=expert, tensor_axis=tensor)

    return jax.shard_map(
        local,
        mesh=sharding.shard_map_mesh(mesh),
        in_specs=(tokens, tokens, tokens, *weights),
        out_specs=tokens,
    )(x_BxLxD, idx_BxLxX, w_BxLxX, gate_ExDxF, up_ExDxF, down_ExFxD)


def per_shard_all_to_all(fn, buf_BxExCxD, gate_ExDxF, up_ExDxF, down_ExFxD):
    """Runs `fn(buf, gate, up, down, expert_axis=, tensor_axis=)` under `shard_map` on each
    device's rows of expert buffers [B, E, C, D] (rows split like the batch); `fn` exchanges
    them with the devices holding the experts."""
    mesh = sharding.current().mesh
    expert, tensor, weights = _expert_specs(gate_ExDxF, up_ExDxF, down_ExFxD)
    bufs = PartitionSpec(sharding.RULES["batch"], None, None, None)

    def local(buf, gate, up, down):
        return fn(buf, gate, up, down, expert_axis=expert, tensor_axis=tensor)

    return jax.shard_map(
        local,
        mesh=sharding.shard_map_mesh(mesh),
        in_specs=(bufs, *weights),
        out_specs=bufs,
    )(buf_BxExCxD, gate_ExDxF, up_ExDxF, down_ExFxD)

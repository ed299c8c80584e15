"""Qwen2.5-VL's vision tower (`Qwen2_5_VisionTransformerPretrainedModel`, under `visual.` of a
`Qwen2_5_VLForConditionalGeneration` checkpoint) <-> `jaxllm.model.vision.VisionTower`.

The HF Conv3d patch embedding [D, C, T, P, P] is ours [C T P P, D]; the fused `qkv` [3 D, D]
(q, k, v, each heads-major) is ours q/k/v [D, H, K]; the merger's `mlp.0` / `mlp.2` are our
`fc1` / `fc2`; every other Linear is transposed, every RMSNorm weight is our `scale`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from jaxllm.config.vision import VisionConfig

Pair = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]


def vision_config_from_hf(hf: Mapping) -> VisionConfig:
    """Our VisionConfig from the `vision_config` of a Qwen2.5-VL config.json (a dict)."""
    rope = hf.get("rope_parameters") or {}
    return VisionConfig(
        patch_size=int(hf.get("patch_size", 14)),
        temporal_patch_size=int(hf.get("temporal_patch_size", 2)),
        in_channels=int(hf.get("in_channels", 3)),
        depth=int(hf.get("depth", 32)),
        width=int(hf.get("hidden_size", 3584)),
        heads=int(hf.get("num_heads", 16)),
        mlp_dim=int(hf.get("intermediate_size", 3420)),
        spatial_merge=int(hf.get("spatial_merge_size", 2)),
        window_size=int(hf.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in hf.get("fullatt_block_indexes", ())),
        out_dim=int(hf.get("out_hidden_size", 3584)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


def _linear() -> Pair:
    return (lambda w: w.T, lambda x: x.T)


def _links(cfg: VisionConfig) -> dict[str, tuple[tuple[str, ...], Pair]]:
    """HF name (without prefix) -> (our attribute path, (to ours, to HF))."""
    d, h, k = cfg.width, cfg.heads, cfg.head_dim
    same: Pair = (lambda w: w, lambda x: x)
    embed: Pair = (
        lambda w: w.reshape(w.shape[0], -1).T,
        lambda x: x.T.reshape(
            d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size
        ),
    )
    out: dict[str, tuple[tuple[str, ...], Pair]] = {
        "patch_embed.proj.weight": (("patch_embed",), embed),
        "merger.ln_q.weight": (("merger", "norm", "scale"), same),
        "merger.mlp.0.weight": (("merger", "fc1"), _linear()),
        "merger.mlp.0.bias": (("merger", "fc1_bias"), same),
        "merger.mlp.2.weight": (("merger", "fc2"), _linear()),
        "merger.mlp.2.bias": (("merger", "fc2_bias"), same),
    }
    for i in range(cfg.depth):
        b, blk = f"blocks.{i}.", ("blocks", i)
        out[b + "norm1.weight"] = (blk + ("norm1", "scale"), same)
        out[b + "norm2.weight"] = (blk + ("norm2", "scale"), same)
        # qkv is split in three below (`vision_from_hf`, `vision_to_hf`)
        out[b + "attn.proj.weight"] = (
            blk + ("attn", "o_proj"),
            (lambda w: w.T.reshape(h, k, d), lambda x: x.reshape(h * k, d).T),
        )
        out[b + "attn.proj.bias"] = (blk + ("attn", "o_bias"), same)
        for name in ("gate", "up", "down"):
            out[b + f"mlp.{name}_proj.weight"] = (blk + ("mlp", f"{name}_proj"), _linear())
            out[b + f"mlp.{name}_proj.bias"] = (blk + ("mlp", f"{name}_bias"), same)
    return out


def _get(tower, path: tuple):
    node = tower
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _set(param, value: np.ndarray, name: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{name}: shape {value.shape} does not fit ours {param.shape}")
    param[...] = jnp.asarray(value, param[...].dtype)


def vision_from_hf(tower, tensors: Mapping[str, np.ndarray], prefix: str = "visual.") -> None:
    """Fill `tower` (a `VisionTower`) in place from HF tensors named `prefix` + HF name."""
    cfg = tower.cfg
    h, k = cfg.heads, cfg.head_dim
    names = set(tensors)
    qkv = [f"blocks.{i}.attn.qkv.{w}" for i in range(cfg.depth) for w in ("weight", "bias")]
    missing = [prefix + n for n in [*_links(cfg), *qkv] if prefix + n not in names]
    if missing:
        raise ValueError(f"HF vision tensors missing: {missing[:3]} ({len(missing)} in all)")
    for hf, (path, (to_ours, _)) in _links(cfg).items():
        _set(_get(tower, path), to_ours(np.asarray(tensors[prefix + hf])), prefix + hf)
        names.discard(prefix + hf)
    for i in range(cfg.depth):
        attn = tower.blocks[i].attn
        w = np.asarray(tensors[f"{prefix}blocks.{i}.attn.qkv.weight"]).reshape(3, h, k, -1)
        bias = np.asarray(tensors[f"{prefix}blocks.{i}.attn.qkv.bias"]).reshape(3, h, k)
        for j, name in enumerate("qkv"):
            _set(getattr(attn, f"{name}_proj"), w[j].transpose(2, 0, 1), f"{prefix}blocks.{i}.qkv")
            _set(getattr(attn, f"{name}_bias"), bias[j], f"{prefix}blocks.{i}.qkv.bias")
        names -= {f"{prefix}blocks.{i}.attn.qkv.weight", f"{prefix}blocks.{i}.attn.qkv.bias"}
    left = sorted(n for n in names if n.startswith(prefix))
    if left:
        raise ValueError(f"HF vision tensors with no place in the tower: {left[:3]}")


def vision_to_hf(tower, prefix: str = "visual.") -> dict[str, np.ndarray]:
    """The HF tensors (float32 numpy, named `prefix` + HF name) of `tower`."""
    cfg = tower.cfg
    out = {}
    for hf, (path, (_, to_hf)) in _links(cfg).items():
        out[prefix + hf] = np.ascontiguousarray(to_hf(np.asarray(_get(tower, path)[...])))
    for i in range(cfg.depth):
        attn = tower.blocks[i].attn
        ws = [np.asarray(getattr(attn, f"{n}_proj")[...]).transpose(1, 2, 0) for n in "qkv"]
        bs = [np.asarray(getattr(attn, f"{n}_bias")[...]).reshape(-1) for n in "qkv"]
        out[f"{prefix}blocks.{i}.attn.qkv.weight"] = np.concatenate(ws).reshape(-1, cfg.width)
        out[f"{prefix}blocks.{i}.attn.qkv.bias"] = np.concatenate(bs)
    return out

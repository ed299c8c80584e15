"""gpt-oss's MXFP4 expert weights (transformers' `quant_method: mxfp4`, the released
openai/gpt-oss-20b / -120b files): per layer `mlp.experts.gate_up_proj_blocks` uint8
[E, out, in / 32, 16] (two E2M1 codes a byte, the first in the low nibble) and
`..._scales` uint8 [E, out, in / 32] (E8M0: 2^(byte - 127)), likewise `down_proj_*`. Import sees
each pair as the float tensor transformers dequantizes it to (`gate_up_proj` [E, in, out], as
`integrations/mxfp4.py`'s `convert_moe_packed_tensors`): every E2M1 value times a power of two
is exact in bfloat16 and float32. jaxllm's own MXFP4 codes (`jaxllm.model.coded`) hold the same
bits transposed (`to_ours`), so import keeps them as a `quantize.method=mxfp4` run of the
experts (`imported_codes`; `--dequantize`: a float run), and export writes the same bytes back
(`link_tensors`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxllm.model.quantized_float import E2M1_GRID, E8M0_BIAS, MX_BLOCK

METHOD = "mxfp4"
SUFFIXES = ("_blocks", "_scales")


def packed_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """{float tensor name: its shape [*lead, in, out]} for every `NAME_blocks` with its
    `NAME_scales` among `shapes`."""
    out = {}
    for name, shape in shapes.items():
        base = name.removesuffix("_blocks")
        if base == name or shapes.get(base + "_scales") != shape[:-1]:
            continue
        *lead, rows, groups, _ = shape
        out[base] = (*lead, groups * MX_BLOCK, rows)
    return out


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [*lead, in, out] of MXFP4 `blocks` [*lead, out, in / 32, 16] and E8M0 `scales`
    [*lead, out, in / 32]."""
    signed = np.concatenate([E2M1_GRID, -E2M1_GRID]).astype(np.float32)  # code -> value
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    values = signed[codes.reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])]
    x = np.ldexp(np.float32(1.0), scales.astype(np.int32) - E8M0_BIAS).astype(np.float32)
    w = (values * x[..., None]).reshape(*blocks.shape[:-2], -1)  # [*lead, out, in]
    return np.ascontiguousarray(np.swapaxes(w, -1, -2))


def to_ours(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same bits in jaxllm's MXFP4 layout (`jaxllm.model.coded`): codes [*lead, in / 2, out]
    and scales [*lead, in / 32, out] of `blocks` [*lead, out, in / 32, 16] / `scales`
    [*lead, out, in / 32]: byte j of a block holds elements 2j (low nibble) and 2j + 1 in both,
    so the codes are a transpose."""
    *lead, out, groups, width = blocks.shape
    codes = blocks.reshape(*lead, out, groups * width)
    return np.swapaxes(codes, -1, -2), np.swapaxes(scales, -1, -2)


def from_ours(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `to_ours`: (blocks, scales) as the released files hold them."""
    *lead, half, out = codes.shape
    blocks = np.swapaxes(codes, -1, -2).reshape(*lead, out, half // (MX_BLOCK // 2), -1)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(np.swapaxes(scales, -1, -2))


def run_quantize() -> dict:
    """The `quantize.*` of an import that keeps the experts' codes: mxfp4 on the expert
    projections only (gpt-oss leaves attention, router, embeddings and head in bfloat16)."""
    return {"method": METHOD, "bits": 4, "skip": ["*/attn/*"]}


def quantization_config(targets: list[str]) -> dict:
    """config.json's `quantization_config` as the released gpt-oss files write it."""
    del targets  # transformers' Mxfp4Config names what it does not convert
    return {
        "quant_method": METHOD,
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }


def link_tensors(link, parts: list, name: str) -> dict[str, np.ndarray]:
    """`NAME_blocks` / `NAME_scales` of one layer's coded expert stacks `parts` (gate and up
    interleaved on the output axis for gate_up_proj, as the float layout)."""
    codes = [np.asarray(t.codes) for t in parts]
    scales = [np.asarray(t.scales) for t in parts]
    if len(parts) > 1:  # interleaved outputs: gate at even, up at odd
        codes = [np.stack(codes, axis=-1).reshape(*codes[0].shape[:-1], -1)]
        scales = [np.stack(scales, axis=-1).reshape(*scales[0].shape[:-1], -1)]
    blocks, sc = from_ours(codes[0], scales[0])
    return {f"{name}_blocks": blocks, f"{name}_scales": sc}


def imported_codes(reader, links, flat: dict, targets: dict) -> dict:
    """`flat` (params read through the decoding `Reader`) with every expert stack the files
    hold in MXFP4 replaced by the run's `CodedTensor` of those very codes (`targets`: the run's
    abstract quantized parameters)."""
    for link in links:
        names = {link.name((i,)) for i in range(flat[link.ours[0]].shape[0])}
        if not names <= set(reader.modules):
            continue
        per_layer: dict[str, list] = {p: [] for p in link.ours}
        per_scale: dict[str, list] = {p: [] for p in link.ours}
        for i in range(len(names)):
            name = link.name((i,))
            codes, scales = to_ours(reader._read(name + "_blocks"), reader._read(name + "_scales"))
            n = len(link.ours)
            for j, p in enumerate(link.ours):  # interleaved parts of the output axis
                per_layer[p].append(codes[..., j::n] if n > 1 else codes)
                per_scale[p].append(scales[..., j::n] if n > 1 else scales)
        for p in link.ours:
            target = targets[p]
            flat[p] = target.replace(
                codes=jnp.asarray(np.stack(per_layer[p]).reshape(target.codes.shape)),
                scales=jnp.asarray(np.stack(per_scale[p]).reshape(target.scales.shape)),
            )
    return flat

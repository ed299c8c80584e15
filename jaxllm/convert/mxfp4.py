"""gpt-oss's MXFP4 expert weights (transformers' `quant_method: mxfp4`, the released
openai/gpt-oss-20b / -120b files): per layer `mlp.experts.gate_up_proj_blocks` uint8
[E, out, in / 32, 16] (two E2M1 codes a byte, the first in the low nibble) and
`..._scales` uint8 [E, out, in / 32] (E8M0: 2^(byte - 127)), likewise `down_proj_*`. Import sees
each pair as the float tensor transformers dequantizes it to (`gate_up_proj` [E, in, out], as
`integrations/mxfp4.py`'s `convert_moe_packed_tensors`): every E2M1 value times a power of two
is exact in bfloat16 and float32, so the dequantized experts are the released weights exactly.
(jaxllm's own MXFP4 codes, `jaxllm.model.quantized_float`, share the nibble order and scales;
they block the input channels of [in, out] per column, so the experts are decoded, not kept.)
"""

from __future__ import annotations

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

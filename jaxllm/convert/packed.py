"""compressed-tensors' `pack-quantized` tensors, the lowest layer of reading and writing them:
the int32 packing of codes (as `pack_to_int32` packs them), the `quantization_config` a
checkpoint must have for jaxllm to keep its codes (`run_quantize`), and one packed module's
codes or float weight (`module_codes`, `dequantized`). The layout is described in
`jaxllm.convert.compressed`, which builds the export and the import on these; the `Reader` uses
them to see a packed module as its float weight."""

from __future__ import annotations

import math

import numpy as np

from jaxllm.config import ConfigError
from jaxllm.convert import autoquant, coded_formats, mxfp4
from jaxllm.model import quantized

FORMAT = "pack-quantized"
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def pack_int32(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [rows, n] (< 2^bits) -> int32 [rows, ceil(n * bits / 32)], the dense
    little-endian bit stream of `pack_to_int32`."""
    rows, n = q.shape
    stream = ((q[..., None].astype(np.uint8) >> np.arange(bits, dtype=np.uint8)) & 1).reshape(
        rows, n * bits
    )
    words = math.ceil(n * bits / 32)
    stream = np.pad(stream, ((0, 0), (0, words * 32 - n * bits)))
    packed = np.packbits(stream, axis=-1, bitorder="little")  # bytes, little-endian words
    return packed.view("<u4").view(np.int32).reshape(rows, words)


def unpack_int32(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The inverse of `pack_int32`: int32 [rows, words] -> uint8 codes [rows, n]."""
    rows = packed.shape[0]
    stream = np.unpackbits(
        np.ascontiguousarray(packed).astype("<i4").view(np.uint8).reshape(rows, -1),
        axis=-1,
        bitorder="little",
    )[:, : n * bits]
    weights = (1 << np.arange(bits)).astype(np.uint16)
    return (stream.reshape(rows, n, bits) * weights).sum(-1).astype(np.uint8)


def run_quantize(hf: dict, where, dequantize: bool = False) -> dict:
    """The `quantize.*` of a checkpoint whose config.json has a compressed-tensors
    `quantization_config` ({} without one); what jaxllm cannot hold keeping the codes (another
    quant_method or format, activations quantized, several schemes, not int, an
    `actorder`) is refused naming it. The fp8, int8 W8A8 and MXFP4 formats are
    `coded_formats.run_quantize`'s (with `dequantize`, only their weights are checked)."""
    qc = hf.get("quantization_config")
    if not qc:
        return {}
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
    if method in autoquant.METHODS:
        return autoquant.run_quantize(qc, where)
    if coded_formats.is_coded(qc):
        return coded_formats.run_quantize(qc, where, dequantize)
    if method == mxfp4.METHOD:  # gpt-oss's experts: their codes kept (`jaxllm.convert.mxfp4`)
        return mxfp4.run_quantize()
    if method != "compressed-tensors":
        raise ConfigError(
            f"{where} is a quantized checkpoint (quantization_config: quant_method {method}); "
            "jaxllm imports float32 / bfloat16 / float16 tensors, compressed-tensors' "
            f"{FORMAT} weight-only integers, its fp8, int8 W8A8 and MXFP4 formats and GPTQ / "
            "AWQ (GEMM) codes: dequantize it first (for DeepSeek-V3's FP8 weights, to bfloat16 "
            "with their weight_scale_inv scales)."
        )
    groups = list((qc.get("config_groups") or {}).values())
    w = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
    fmt = groups[0].get("format") or qc.get("format") if len(groups) == 1 else None
    problems = [
        len(groups) != 1 and f"{len(groups)} config groups (one is imported)",
        fmt != FORMAT and f"format {fmt} (not {FORMAT})",
        any(groups[0].get(k) for k in ("input_activations", "output_activations"))
        and "quantized activations (weight-only schemes are imported)",
        w.get("type") != "int" and f"weights of type {w.get('type')} (not int)",
        w.get("num_bits") not in quantized.BITS and f"{w.get('num_bits')}-bit weights",
        w.get("strategy") not in ("channel", "group") and f"strategy {w.get('strategy')}",
        w.get("actorder") and f"actorder {w.get('actorder')}",
        qc.get("kv_cache_scheme") and "a quantized KV cache",
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError(
            f"{where}'s compressed-tensors quantization_config has {'; '.join(problems)}, "
            "which jaxllm cannot import keeping the codes."
        )
    return {
        "method": "rtn",
        "bits": w["num_bits"],
        "group_size": w.get("group_size") or 0 if w["strategy"] == "group" else 0,
        "symmetric": bool(w.get("symmetric", True)),
    }


def module_codes(read, module: str, bits: int, dtype) -> tuple[np.ndarray, ...]:
    """(unsigned codes [out, in], scales [out, groups], zero points [out, groups] or None) of
    the compressed-tensors module `module`; `read(name)` reads one tensor."""
    out, n_in = (int(x) for x in read(f"{module}.weight_shape"))
    q = unpack_int32(read(f"{module}.weight_packed"), bits, n_in)
    scales = read(f"{module}.weight_scale").astype(dtype)
    try:
        zp = read(f"{module}.weight_zero_point")
    except KeyError:
        return q, scales, None
    return q, scales, unpack_int32(zp.T, bits, out).T


def dequantized(read, module: str, bits: int, dtype) -> np.ndarray:
    """The float [out, in] weight of a compressed-tensors module: (q - z) * s."""
    q, s, z = module_codes(read, module, bits, dtype)
    g = s.shape[1]
    z = np.full(s.shape, 2 ** (bits - 1)) if z is None else z
    x = q.astype(np.float32).reshape(q.shape[0], g, -1) - z.astype(np.float32)[..., None]
    return (x * s.astype(np.float32)[..., None]).reshape(q.shape).astype(dtype)

"""GPTQ and AWQ checkpoints as the Hub has them: AutoGPTQ / GPTQModel's (`quantization_config.
quant_method = "gptq"`) and AutoAWQ's GEMM layout (`quant_method = "awq"`, version `gemm`).

Each quantized linear module M of torch shape [out, in] holds, in jaxllm's [in, out] order:

- GPTQ: `M.qweight` int32 [in * b / 32, out], code of input row i in word i // (32 / b) at
  bits b * (i % (32 / b)) (little-endian); `M.qzeros` int32 [groups, out * b / 32], packed the
  same way along the outputs, storing z - 1 (`checkpoint_format` `gptq`, the v1 format; `gptq_v2`
  stores z); `M.scales` [groups, out]; `M.g_idx` int32 [in], each row's group, which must be
  i // group_size (act-order checkpoints whose rows are grouped out of order are refused: a
  jaxllm run keeps contiguous groups).
- AWQ (GEMM): `M.qweight` int32 [in, out * b / 32] packed along the outputs, the 8 codes of a
  word in AutoAWQ's order: the nibble at bits 4 j is output 8 c + (0, 2, 4, 6, 1, 3, 5, 7)[j];
  `M.qzeros` int32 [groups, out * b / 32] the same way; `M.scales` [groups, out].

Both dequantize to w = (q - z) * s per group, the `jaxllm.model.quantized.QuantizedTensor`
formula, so the codes import unchanged (`module_codes` returns them in compressed-tensors'
orientation, [out, in], as `jaxllm.convert.packed.module_codes` does).
"""

from __future__ import annotations

import numpy as np

from jaxllm.config import ConfigError

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
METHODS = ("gptq", "awq")


def run_quantize(qc: dict, where) -> dict:
    """The `quantize.*` of a GPTQ or AWQ `quantization_config`; what jaxllm cannot hold
    keeping the codes is refused naming it."""
    method = qc["quant_method"]
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size", -1))
    if method == "gptq":
        problems = [
            bits not in (2, 4, 8) and f"{bits}-bit codes (2, 4 and 8 are imported)",
            qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2")
            and f"checkpoint_format {qc.get('checkpoint_format')}",
        ]
        symmetric = bool(qc.get("sym", True))
    else:
        version = str(qc.get("version", "gemm")).lower()
        problems = [
            bits != 4 and f"{bits}-bit codes (4 is imported)",
            version != "gemm" and f"version {version} (gemm is imported)",
        ]
        symmetric = not qc.get("zero_point", True)
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError(
            f"{where}'s {method} quantization_config has {'; '.join(problems)}, which jaxllm "
            "cannot import keeping the codes."
        )
    return {
        "method": method,
        "bits": int(bits),
        "group_size": 0 if group in (None, -1, 0) else int(group),
        "symmetric": symmetric,
    }


def shape(read, module: str, qc: dict) -> tuple[int, int]:
    """The torch shape [out, in] of a packed module."""
    qweight = read(f"{module}.qweight")
    per = 32 // int(qc.get("bits", qc.get("w_bit")))
    if qc["quant_method"] == "gptq":
        return qweight.shape[1], qweight.shape[0] * per
    return qweight.shape[1] * per, qweight.shape[0]


def _gptq_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ's qweight [in * b / 32, out] -> codes [in, out]."""
    per = 32 // bits
    w = np.ascontiguousarray(words).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    q = (w[:, None, :] >> shifts) & (2**bits - 1)
    return q.reshape(-1, w.shape[1]).astype(np.uint8)


def _cols(words: np.ndarray, bits: int, order=None) -> np.ndarray:
    """Words packed along the last dim [rows, n * b / 32] -> codes [rows, n] (`order`: the
    output each nibble of a word holds)."""
    per = 32 // bits
    w = np.ascontiguousarray(words).view(np.uint32)
    q = ((w[..., None] >> (np.arange(per, dtype=np.uint32) * bits)) & (2**bits - 1)).astype(
        np.uint8
    )
    if order is not None:
        out = np.empty_like(q)
        out[..., list(order)] = q
        q = out
    return q.reshape(w.shape[0], -1)


def module_codes(read, module: str, qc: dict, dtype):
    """(codes [out, in], scales [out, groups], zero points [out, groups] or None when the
    checkpoint is symmetric) of a GPTQ / AWQ module."""
    bits = int(qc.get("bits", qc.get("w_bit")))
    scales = read(f"{module}.scales").astype(dtype)
    if qc["quant_method"] == "gptq":
        q = _gptq_rows(read(f"{module}.qweight"), bits)
        z = _cols(read(f"{module}.qzeros"), bits).astype(np.int32)
        if qc.get("checkpoint_format", "gptq") == "gptq":
            z = z + 1  # v1 stores z - 1
        groups = scales.shape[0]
        try:
            g_idx = read(f"{module}.g_idx")
        except KeyError:
            g_idx = None
        if g_idx is not None and not np.array_equal(
            g_idx, np.arange(q.shape[0]) // (q.shape[0] // groups)
        ):
            raise ConfigError(
                f"{module}.g_idx groups the input channels out of order (GPTQ act order "
                "without static groups); jaxllm keeps contiguous groups: dequantize it "
                "(convert import --dequantize)."
            )
    else:
        q = _cols(read(f"{module}.qweight"), bits, AWQ_ORDER)
        z = _cols(read(f"{module}.qzeros"), bits, AWQ_ORDER).astype(np.int32)
    z = z[:, : scales.shape[1]]
    if run_quantize(qc, module)["symmetric"]:
        if not np.all(z == 2 ** (bits - 1)):
            raise ConfigError(
                f"{module}.qzeros are not the symmetric zero point {2 ** (bits - 1)} its "
                "quantization_config (sym / zero_point) promises; fix config.json."
            )
        return q.T, scales.T, None
    if np.any(z > 255):
        raise ConfigError(f"{module}.qzeros holds zero points past 255.")
    return q.T, scales.T, z.T.astype(np.uint8)


def dequantized(read, module: str, qc: dict, dtype) -> np.ndarray:
    """The float [out, in] weight of a GPTQ / AWQ module: (q - z) * s."""
    q, s, z = module_codes(read, module, qc, np.float32)
    bits = int(qc.get("bits", qc.get("w_bit")))
    z = np.full(s.shape, 2 ** (bits - 1)) if z is None else z
    x = q.astype(np.float32).reshape(q.shape[0], s.shape[1], -1) - z.astype(np.float32)[..., None]
    return (x * s[..., None]).reshape(q.shape).astype(dtype)

"""compressed-tensors' fp8, int8 and MXFP4 formats (`float-quantized`, `naive-quantized`,
`int-quantized`, `mxfp4-pack-quantized`) read back, the lowest layer of importing them: the
`quantization_config` a checkpoint must have for jaxllm to keep its codes as a
`coded.CodedTensor` run (`run_quantize`) or to decode its weights (`weight_kind`), and one
module's codes (`module_codes`) or float weight (`dequantized`). The layouts are those
`jaxllm.convert.compressed_coded` writes:

    weights            tensors of a module M (Hugging Face weight [out, in])
    fp8, per channel   M.weight float8_e4m3fn [out, in], M.weight_scale float [out, 1]
    int8, per channel  M.weight int8 [out, in], M.weight_scale float [out, 1]
    mxfp4              M.weight_packed uint8 [out, in / 2], M.weight_scale uint8 [out, in / 32]

each decoding as w = q * s, as `coded.decode` does. A per-tensor scale (one for the whole
weight, compressed-tensors' `FP8` preset) is the same scale on every output channel: it is
taken as that, so the codes and the decoded weights are kept exactly (a re-export writes it
per channel). The quantize.* kept: fp8 weights alone or with E4M3 activations per token,
dynamic (`FP8_DYNAMIC`) -> fp8 (fp8_activations false / true); int8 weights with int8
activations per token, dynamic (`W8A8`) -> smoothquant; MXFP4 weights alone (`MXFP4A16`) ->
mxfp4. Static activation scales, activations quantized another way (MXFP4's, in groups), int8
weights with float activations, grouped or block scales and zero points have no jaxllm
counterpart: refused keeping the codes. `--dequantize` takes any of them whose weights decode
(per channel or per tensor, MXFP4), dropping the activations' quantization as transformers'
`dequantize=True` does.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxllm.config import ConfigError
from jaxllm.model import quantized_float as qf

MXFP4_FORMAT = "mxfp4-pack-quantized"
FORMATS = ("float-quantized", "naive-quantized", "int-quantized", MXFP4_FORMAT)
# (type, num_bits) of the weights -> the coded kind
KINDS = {("float", 8): "fp8", ("int", 8): "int8", ("float", 4): "mxfp4"}
# the kind -> the safetensors dtype of its codes
STORED = {"fp8": "F8_E4M3", "int8": "I8", "mxfp4": "U8"}
# a module's tensors besides M.weight: the activations' static scales are read by no one
SUFFIXES = ("weight_packed", "weight_scale", "input_scale", "input_zero_point")
FLOATS = ("F32", "BF16", "F16")


def _scheme(qc: dict) -> tuple[list, str | None, dict, dict]:
    """(the config groups, the format, the weights' and the input activations' args) of a
    compressed-tensors `quantization_config` with one group ({} where there are none)."""
    groups = list((qc.get("config_groups") or {}).values())
    group = groups[0] if len(groups) == 1 and isinstance(groups[0], dict) else {}
    fmt = group.get("format") or qc.get("format")
    return groups, fmt, group.get("weights") or {}, group


def is_coded(qc) -> bool:
    """Whether `qc` (config.json's `quantization_config`) is compressed-tensors' in one of the
    formats read here."""
    return (
        isinstance(qc, dict)
        and qc.get("quant_method") == "compressed-tensors"
        and _scheme(qc)[1] in FORMATS
    )


def _refuse(where, problems: list, keeping: bool) -> None:
    problems = [p for p in problems if p]
    if problems:
        how = (
            "keeping the codes; import it with --dequantize for a float run of its weights"
            if keeping
            else "(keeping the codes or dequantized)"
        )
        raise ConfigError(
            f"{where}'s compressed-tensors quantization_config has {'; '.join(problems)}, "
            f"which jaxllm cannot import {how}."
        )


def weight_kind(qc: dict, where) -> str:
    """The coded kind ("fp8", "int8" or "mxfp4") of the weights of an `is_coded` config, when
    jaxllm decodes them exactly (module docstring); ConfigError naming what it cannot."""
    groups, fmt, w, group = _scheme(qc)
    if len(groups) != 1:
        _refuse(where, [f"{len(groups)} config groups (one is imported)"], False)
    kind = KINDS.get((w.get("type"), w.get("num_bits")))
    mx = kind == "mxfp4"
    strategy = w.get("strategy")
    _refuse(
        where,
        [
            not kind and f"{w.get('num_bits')}-bit weights of type {w.get('type')}",
            kind and mx != (fmt == MXFP4_FORMAT) and f"{kind} weights in format {fmt}",
            not w.get("symmetric", True) and "asymmetric weights (zero points)",
            w.get("dynamic") and "weights quantized at run time (dynamic)",
            w.get("actorder") and f"actorder {w.get('actorder')}",
            mx
            and (strategy, w.get("group_size")) != ("group", 32)
            and f"MXFP4 weights by strategy {strategy}, groups of {w.get('group_size')}",
            mx
            and not str(w.get("scale_dtype") or "uint8").endswith("uint8")
            and f"MXFP4 scales of dtype {w.get('scale_dtype')} (E8M0 bytes are imported)",
            kind
            and not mx
            and strategy not in ("channel", "tensor")
            and f"{kind} weights by strategy {strategy} (per channel or per tensor are imported)",
            group.get("output_activations") and "quantized output activations",
            qc.get("kv_cache_scheme") and "a quantized KV cache",
        ],
        False,
    )
    return kind


def run_quantize(qc: dict, where, dequantize: bool = False) -> dict:
    """The `quantize.*` of a run keeping the codes of an `is_coded` config (module docstring);
    what jaxllm cannot hold is refused naming it. `dequantize`: only the weights are checked
    (they are decoded, the activations' quantization is not kept)."""
    kind = weight_kind(qc, where)
    run = {
        "fp8": {"method": "fp8", "bits": 8},
        "int8": {"method": "smoothquant", "bits": 8},
        "mxfp4": {"method": "mxfp4", "bits": 4},
    }[kind]
    if dequantize:
        return run
    acts = _scheme(qc)[3].get("input_activations")
    if not acts:
        _refuse(
            where,
            [
                kind == "int8"
                and "int8 weights with float activations (jaxllm keeps int8 codes with "
                "int8 activations; weight-only int8 is imported from pack-quantized)"
            ],
            True,
        )
        return {**run, "fp8_activations": False} if kind == "fp8" else run
    if kind == "mxfp4":
        _refuse(where, ["MXFP4 activations (MXFP4A16, the weights alone, is imported)"], True)
    if acts.get("dynamic") is not True:
        _refuse(
            where,
            [
                "static activation scales (input_activations not dynamic; jaxllm quantizes "
                "each token's activations at run time)"
            ],
            True,
        )
    want = "float" if kind == "fp8" else "int"
    _refuse(
        where,
        [
            (acts.get("type"), acts.get("num_bits")) != (want, 8)
            and f"{acts.get('num_bits')}-bit activations of type {acts.get('type')} with "
            f"{kind} weights",
            acts.get("strategy") != "token"
            and f"activations by strategy {acts.get('strategy')} (per token is imported)",
            not acts.get("symmetric", True) and "asymmetric activations",
        ],
        True,
    )
    return {**run, "fp8_activations": True} if kind == "fp8" else run


def weight_shape(kind: str, shapes: dict, dtypes: dict, module: str, where) -> tuple[int, int]:
    """(out, in) of `module`'s weight, once its tensors (`shapes` and safetensors `dtypes` by
    name) are those of `kind` (module docstring); ConfigError naming the first that is not."""
    codes = f"{module}.weight_packed" if kind == "mxfp4" else f"{module}.weight"
    scale = f"{module}.weight_scale"
    if codes not in shapes:
        raise ConfigError(f"{where} holds {scale} but no {codes}; download the files again.")
    shape, s_shape = shapes[codes], shapes[scale]
    out, n_in = (shape[0], shape[-1] * (2 if kind == "mxfp4" else 1)) if shape else (0, 0)
    if kind == "mxfp4":
        ok = (dtypes[scale] == "U8", s_shape == (out, n_in // 32) and n_in % 32 == 0)
        want_scale = f"U8 [{out}, in / 32]"
    else:
        per_tensor = len(s_shape) <= 2 and int(np.prod(s_shape)) == 1
        ok = (dtypes[scale] in FLOATS, s_shape == (out, 1) or per_tensor)
        want_scale = f"float [{out}, 1] or one per tensor"
    if len(shape) != 2 or dtypes[codes] != STORED[kind] or not all(ok):
        raise ConfigError(
            f"{where}: {codes} {dtypes[codes]} {list(shape)} with {scale} {dtypes[scale]} "
            f"{list(s_shape)} are not {kind} codes (a 2-D {STORED[kind]} weight, scales "
            f"{want_scale}) as its quantization_config says; download the files again."
        )
    return out, n_in


def module_codes(read, module: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes [out, in] (MXFP4: [out, in / 2], two a byte), scales [out, groups]) of `module`
    as jaxllm holds them: E4M3 and MXFP4 codes as uint8, int8 codes as int8, the fp8 and int8
    scales in float32 (exactly: from bfloat16 / float16 too), per channel, E8M0 scales as
    uint8. `read(name)` reads one tensor (E4M3 as its bytes, uint8)."""
    if kind == "mxfp4":
        return read(f"{module}.weight_packed"), read(f"{module}.weight_scale")
    codes = read(f"{module}.weight")
    scales = read(f"{module}.weight_scale").astype(np.float32)
    return codes, np.broadcast_to(scales.reshape(-1, 1), (codes.shape[0], 1)).copy()


def dequantized(read, module: str, kind: str, dtype) -> np.ndarray:
    """The float [out, in] weight of `module`: q * s, computed in float32 as `coded.decode`."""
    q, s = module_codes(read, module, kind)
    if kind == "mxfp4":
        nibbles = np.stack([q & 0xF, q >> 4], axis=-1).reshape(q.shape[0], -1)
        mag = qf.E2M1_GRID[nibbles & 7]
        val = np.where(nibbles & 8, -mag, mag).reshape(q.shape[0], -1, qf.MX_BLOCK)
        x = np.ldexp(np.float32(1), s.astype(np.int32) - qf.E8M0_BIAS).astype(np.float32)
        w = (val * x[..., None]).reshape(q.shape[0], -1)
    elif kind == "fp8":
        w = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
    else:
        w = q.astype(np.float32) * s
    return w.astype(dtype)

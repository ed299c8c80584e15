"""The float and weight-activation kinds out in compressed-tensors' layouts: `jaxllm convert
export` of a run made by `jaxllm quantize --method fp8 | smoothquant | mxfp4`
(`coded.CodedTensor`), which transformers loads with its compressed-tensors integration and
vLLM serves. Each quantized linear module M (a Hugging Face weight [out, in]) becomes

    kind, act       format                  tensors of M
    fp8, none       naive-quantized         weight float8_e4m3fn [out, in], weight_scale
                                            float32 [out, 1]
    fp8, fp8        float-quantized         the same
    int8, int8      int-quantized           weight int8 [out, in], weight_scale float32 [out, 1]
    mxfp4, none     mxfp4-pack-quantized    weight_packed uint8 [out, in / 2] (element 2j in
                                            the low nibble, 2j + 1 in the high), weight_scale
                                            uint8 [out, in / 32] (E8M0: 2^(e - 127))

with the scheme compressed-tensors' presets name for each: weight-only FP8 per channel (its
`FP8_DYNAMIC` weights; a scheme with weights alone is inferred as naive-quantized), `FP8_DYNAMIC`
(E4M3 activations per token, dynamic, symmetric), `W8A8` (int8 per channel, int8 activations per
token, dynamic, symmetric) and `MXFP4A16`. Those decode as w = q * s, jaxllm's numbers
(`coded.decode`): E4M3 and int8 codes per output channel, E2M1 nibbles in the same order and E8M0
bytes with the same bias, so the codes and scales move across as they are stored, bit-identical.

LLM.int8() (`llm_int8`) keeps its outlier features in 16 bits at run time, which no
compressed-tensors scheme expresses: its export is refused (`check_exportable`). `jaxllm
convert import` reads these layouts back (`jaxllm.convert.coded_formats`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxllm import config as config_lib
from jaxllm.config import ConfigError
from jaxllm.convert.compressed import hf_order, wrap_config
from jaxllm.convert.links import Link
from jaxllm.model import coded

_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
_INT8 = {**_FP8, "type": "int"}
_PER_CHANNEL = {"strategy": "channel", "dynamic": False}
_PER_TOKEN = {"strategy": "token", "dynamic": True}
_MXFP4 = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": 32,
    "strategy": "group",
    "dynamic": False,
    "scale_dtype": "torch.uint8",
    "zp_dtype": "torch.uint8",
}
# (kind, act) -> (format, weights, input_activations)
SCHEMES = {
    ("fp8", "none"): ("naive-quantized", {**_FP8, **_PER_CHANNEL}, None),
    ("fp8", "fp8"): ("float-quantized", {**_FP8, **_PER_CHANNEL}, {**_FP8, **_PER_TOKEN}),
    ("int8", "int8"): ("int-quantized", {**_INT8, **_PER_CHANNEL}, {**_INT8, **_PER_TOKEN}),
    ("mxfp4", "none"): ("mxfp4-pack-quantized", _MXFP4, None),
}


def check_exportable(q: config_lib.QuantizeConfig) -> None:
    """Refuses a run whose codes compressed-tensors has no scheme for (LLM.int8())."""
    if q.method == "llm_int8":
        raise ConfigError(
            "this run's weights are quantize.method=llm_int8 codes, whose 16-bit outlier "
            "features compressed-tensors cannot express; export the float run it was "
            "quantized from, or quantize that with --method smoothquant or fp8 and export it."
        )


def link_tensors(link: Link, t: coded.CodedTensor, name: str) -> dict[str, np.ndarray]:
    """The compressed-tensors tensors of one element (one layer / expert) `t` of a coded
    weight that `link` maps to the Hugging Face tensor `name` (`<module>.weight`)."""
    if link.kind != "linear" or len(link.ours) != 1 or link.n_lead:
        raise ConfigError(
            f"{name} is quantized but is not one Hugging Face linear weight (its link is "
            f"{link.kind} of {len(link.ours)} parameters); compressed-tensors cannot express it."
        )
    if (t.kind, t.act) not in SCHEMES:
        raise ConfigError(f"{name}: {t.kind} codes with {t.act} activations have no export.")
    shape = t.shape  # the weight's [*in, *out]
    if t.n_in != link.n_in or len(shape) != t.n_in + t.n_out:
        raise ConfigError(f"{name}: the quantized tensor does not match its link's dims.")
    perm, n_in = hf_order(link, shape)
    n = len(perm)
    module = name.removesuffix(".weight")
    scales = np.asarray(t.scales).reshape(-1, n)[:, perm].T  # [out, groups]
    if t.kind == "mxfp4":  # pairs along the (flattened) input, as compressed-tensors packs them
        packed = np.asarray(t.codes).reshape(n_in // 2, n)[:, perm].T
        return {
            f"{module}.weight_packed": np.ascontiguousarray(packed, np.uint8),
            f"{module}.weight_scale": np.ascontiguousarray(scales, np.uint8),
        }
    codes = np.ascontiguousarray(np.asarray(t.codes).reshape(n_in, n)[:, perm].T)
    weight = codes.view(ml_dtypes.float8_e4m3fn) if t.kind == "fp8" else codes.view(np.int8)
    return {
        f"{module}.weight": weight,
        f"{module}.weight_scale": np.ascontiguousarray(scales, np.float32),
    }


def quantization_config(t: coded.CodedTensor, targets: list[str], ignore: list[str]) -> dict:
    """config.json's `quantization_config` for the `targets` modules coded like `t` (one
    scheme: `jaxllm quantize` codes every projection the same way)."""
    fmt, weights, acts = SCHEMES[(t.kind, t.act)]
    return wrap_config(fmt, weights, acts, targets, ignore)

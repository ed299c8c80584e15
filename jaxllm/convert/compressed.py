"""A quantized run out in the compressed-tensors layout (`jaxllm convert export` of a run made by
`jaxllm quantize`), which transformers loads with its compressed-tensors integration and vLLM
serves. The fp8, int8 W8A8 and MXFP4 kinds (`coded.CodedTensor`) go out through
`jaxllm.convert.compressed_coded`, in their own formats.

compressed-tensors' `pack-quantized` format (its `PackedQuantizationCompressor`) stores a
weight-only integer linear layer W [out, in] quantized as w = (q_s - z_s) * s, with signed codes
q_s in [-2^(b-1), 2^(b-1) - 1], as

- `weight_packed`: int32 [out, ceil(in * b / 32)], the codes offset to unsigned
  q = q_s + 2^(b-1) and packed densely along the input, little-endian: code i at bits
  b*i .. b*i + b - 1 of the row's bit stream, a code may straddle two words (`pack_to_int32`);
- `weight_scale`: [out, groups] in the weight's dtype (groups of `group_size` consecutive
  inputs; per channel: one);
- `weight_zero_point`: asymmetric only, the signed z_s as int8 codes packed the same way along
  the *output* dim: int32 [ceil(out * b / 32), groups];
- `weight_shape`: int64 [2], (out, in).

jaxllm's `QuantizedTensor` (docs/compression.md "The tensor format") holds the same unsigned
codes q (symmetric: z = 2^(b-1), the offset), packed little-endian along the contracted dim into
bytes, and groups over the flattened input, so the export moves codes, scales and zero points
across without re-rounding: the integer codes are bit-identical.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxllm import config as config_lib
from jaxllm.compress.weights import is_quantized, quantized_abstract
from jaxllm.config import ConfigError
from jaxllm.convert import mxfp4
from jaxllm.convert.families import family_of
from jaxllm.convert.links import Link
from jaxllm.convert.mapping import each, flatten, unflatten
from jaxllm.convert.packed import (
    FORMAT,
    pack_int32,
)
from jaxllm.convert.reader import Reader, read_hf_config
from jaxllm.model import abstract_model, coded, quantized


def hf_order(link: Link, shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """(the permutation of our flattened outputs that gives Hugging Face's rows, the number of
    inputs) of a `linear` link's element of `shape` [*in, *out], found by sending the elements'
    indices through the link. The inputs must keep their (flattened row-major) order, since the
    groups run along them; a link that reorders them is refused."""
    n_out = math.prod(shape[link.n_in :])
    ids = link.to_hf([np.arange(math.prod(shape), dtype=np.float64).reshape(shape)])
    if ids.ndim != 2:
        raise ConfigError(f"{link.hf} is not a 2-D linear weight in the Hugging Face layout.")
    ids = ids.astype(np.int64)
    rows, cols = ids // n_out, ids % n_out
    if not (rows == np.arange(ids.shape[1])).all() or not (cols == cols[:, :1]).all():
        raise ConfigError(
            f"{link.hf}: the Hugging Face layout reorders the weight's inputs, which the "
            "compressed-tensors groups cannot follow; it cannot be exported quantized."
        )
    return cols[:, 0], ids.shape[1]


def link_tensors(link: Link, t: quantized.QuantizedTensor, name: str) -> dict[str, np.ndarray]:
    """The compressed-tensors tensors of one element (one layer / expert) `t` of a quantized
    weight that `link` maps to the Hugging Face tensor `name` (`<module>.weight`)."""
    if link.kind != "linear" or len(link.ours) != 1 or link.n_lead:
        raise ConfigError(
            f"{name} is quantized but is not one Hugging Face linear weight (its link is "
            f"{link.kind} of {len(link.ours)} parameters); compressed-tensors cannot express it."
        )
    if t.n_in != link.n_in or t.codes.ndim != t.n_in + t.n_out:
        raise ConfigError(f"{name}: the quantized tensor does not match its link's dims.")
    codes = np.asarray(quantized._unpack(t.codes, t.bits, t.packed_axis))
    shape = codes.shape
    perm, n_in = hf_order(link, shape)
    q = codes.reshape(n_in, -1)[:, perm].T  # [out, in], Hugging Face's rows
    scales = np.asarray(t.scales).reshape(-1, len(perm))[:, perm].T  # [out, groups]
    module = name.removesuffix(".weight")
    out = {
        f"{module}.weight_packed": pack_int32(q, t.bits),
        f"{module}.weight_scale": np.ascontiguousarray(scales),
        f"{module}.weight_shape": np.array(q.shape, np.int64),
    }
    if t.zeros is not None:
        z = np.asarray(t.zeros).reshape(-1, len(perm))[:, perm]  # [groups, out]
        out[f"{module}.weight_zero_point"] = np.ascontiguousarray(pack_int32(z, t.bits).T)
    return out


def quantization_config(
    q: config_lib.QuantizeConfig, targets: list[str], ignore: list[str]
) -> dict:
    """config.json's `quantization_config`: one scheme, weight-only int of the run's bits,
    symmetric or not, per channel or in groups, over the `targets` modules (by name);
    `ignore`: the linear modules left in float (the LM head unless quantized)."""
    weights = {
        "num_bits": q.bits,
        "type": "int",
        "symmetric": q.symmetric,
        "strategy": "group" if q.group_size else "channel",
        "group_size": q.group_size or None,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    return wrap_config(FORMAT, weights, None, targets, ignore)


def wrap_config(
    fmt: str, weights: dict, input_activations: dict | None, targets: list[str], ignore: list[str]
) -> dict:
    """A `quantization_config` of one scheme (`weights` and `input_activations` as
    compressed-tensors' `QuantizationArgs` fields) in format `fmt` over the `targets`."""
    scheme = {
        "targets": targets,
        "weights": weights,
        "input_activations": input_activations,
        "output_activations": None,
        "format": fmt,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def imported_codes(hf_dir, params: dict, cfg: config_lib.Config) -> dict:
    """`params` (read through the dequantizing `Reader`) with each compressed-tensors module's
    weight replaced by the run's quantized tensor of its own codes and scales: a
    `QuantizedTensor` (with its zero points) for pack-quantized, a `coded.CodedTensor` of the
    kind `cfg.quantize` records for the fp8, int8 W8A8 and MXFP4 formats; the inverse of
    `link_tensors` and `compressed_coded.link_tensors`, bit-identical."""

    reader = Reader(hf_dir)
    flat = flatten(params)
    if reader.mx:  # gpt-oss's MXFP4 experts
        _, abstract, axes = abstract_model(cfg.model)
        targets = flatten(quantized_abstract(abstract, axes, cfg.quantize)[0])
        links = family_of(read_hf_config(hf_dir)).layouts(cfg.model)[0]
        return unflatten(mxfp4.imported_codes(reader, links, flat, targets))
    shapes = {p: tuple(a.shape) for p, a in flat.items()}
    found = {}  # path -> (its link, the link's indices), the weights the files hold in codes
    for link in family_of(read_hf_config(hf_dir)).layouts(cfg.model)[0]:
        indices = list(each(link, shapes))
        packed = [link.name(i) in reader.modules for i in indices]
        if not any(packed):
            continue
        if not all(packed):
            raise ConfigError(
                f"the checkpoint holds {link.hf} in codes for some layers and in float for "
                f"{link.name(indices[packed.index(False)])}; a jaxllm run quantizes a weight in "
                "every layer or none: dequantize it first."
            )
        found[link.ours[0]] = (link, indices)
    _, abstract, axes = abstract_model(cfg.model)
    targets = flatten(quantized_abstract(abstract, axes, cfg.quantize)[0])
    _check_chosen(set(found), targets)
    for path, (link, indices) in found.items():
        counts = link.counts(shapes)
        elem = shapes[path][len(counts) :]  # one layer's (and expert's) weight
        if isinstance(targets[path], coded.CodedTensor):
            perm = hf_order(link, elem)[0]
            flat[path] = _coded_weight(reader, link, indices, perm, targets[path])
        else:
            how = (counts, elem, flat[path].dtype, cfg.quantize)
            flat[path] = _integer_weight(reader, link, indices, *how)
    return unflatten(flat)


def _coded_weight(reader: Reader, link: Link, indices, perm, target: coded.CodedTensor):
    """`target` (the run's abstract coded weight: its kind, shapes and dtypes) holding the
    codes and scales of the link's modules as they are stored."""
    n = len(perm)
    parts: dict[str, list] = {"codes": [], "scales": []}
    for index in indices:
        for key, x in zip(parts, reader.codes(link.name(index), None)):
            ours = np.empty((x.shape[1], n), x.dtype)  # [in (groups), out], our outputs' order
            ours[:, perm] = x.T
            parts[key].append(ours)
    codes, scales = (np.stack(parts[k]) for k in parts)
    assert (codes.dtype, scales.dtype) == (target.codes.dtype, target.scales.dtype)
    return target.replace(
        codes=jnp.asarray(codes.reshape(target.codes.shape)),
        scales=jnp.asarray(scales.reshape(target.scales.shape)),
    )


def _integer_weight(reader: Reader, link: Link, indices, counts, elem, dtype, q_cfg):
    """The `QuantizedTensor` (of `q_cfg`'s bits and groups, in `dtype`) of the link's
    pack-quantized modules, `counts` of elements of shape `elem`: their codes, scales and zero
    points."""
    perm, n_in = hf_order(link, elem)
    parts: dict[str, list] = {"codes": [], "scales": [], "zeros": []}
    for index in indices:
        q, s, z = reader.codes(link.name(index), dtype)
        codes = np.empty((n_in, len(perm)), np.uint8)
        codes[:, perm] = q.T
        scales = np.empty((s.shape[1], len(perm)), s.dtype)
        scales[:, perm] = s.T
        parts["codes"].append(codes.reshape(elem))
        parts["scales"].append(scales.reshape(s.shape[1], *elem[link.n_in :]))
        if z is not None:
            zeros = np.empty((z.shape[1], len(perm)), np.uint8)
            zeros[:, perm] = z.T
            parts["zeros"].append(zeros.reshape(s.shape[1], *elem[link.n_in :]))
    stack = {k: np.stack(v).reshape(*counts, *v[0].shape) for k, v in parts.items() if v}
    lead = len(counts)
    return quantized.QuantizedTensor(
        codes=quantized._pack(jnp.asarray(stack["codes"]), q_cfg.bits, lead + link.n_in - 1),
        scales=jnp.asarray(stack["scales"]),
        zeros=jnp.asarray(stack["zeros"]) if "zeros" in stack else None,
        bits=q_cfg.bits,
        group=q_cfg.group_size,
        n_in=link.n_in,
        n_out=len(elem) - link.n_in,
        dtype=np.dtype(dtype),
    )


def _check_chosen(got: set[str], targets: dict) -> None:
    """The weights imported in codes (`got`) must be those the run's `quantize.*` quantizes
    (the projections, not the LM head: the quantized leaves of `targets`, the run's abstract
    parameters), since that is what loading the run expects."""

    want = {p for p, x in targets.items() if is_quantized(x)}
    if want != got:
        raise ConfigError(
            "the checkpoint quantizes a different set of weights than a jaxllm quantized run "
            f"holds (in codes here only: {sorted(got - want)[:3]}; in float here only: "
            f"{sorted(want - got)[:3]}); dequantize it first."
        )

"""Compression of trained models: post-training quantization methods (docs/compression.md).

A method maps a weight (and, for the calibrated methods to come, statistics of its inputs) to a
`jaxllm.model.quantized.QuantizedTensor`, the packed form the model's `layers.matmul` seam
multiplies by. `weights` chooses the weights a `quantize.*` config takes and quantizes a
model's parameters on its mesh; `rtn` is round-to-nearest. The command that reads a run and
writes the quantized one is `jaxllm.quantize`.
"""

from jaxllm.compress.rtn import rtn
from jaxllm.compress.weights import (
    METHODS,
    dims,
    not_trained,
    quantize_params,
    quantized_abstract,
    weight_bytes,
)

__all__ = [
    "METHODS",
    "dims",
    "not_trained",
    "quantize_params",
    "quantized_abstract",
    "rtn",
    "weight_bytes",
]

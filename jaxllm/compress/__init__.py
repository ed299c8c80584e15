"""Compression of trained models: post-training quantization and pruning methods
(docs/compression.md).

A method maps a weight (and, for the calibrated methods to come, statistics of its inputs) to a
`jaxllm.model.quantized.QuantizedTensor`, the packed form the model's `layers.matmul` seam
multiplies by. `weights` chooses the weights a `quantize.*` config takes and quantizes a
model's parameters on its mesh; `rtn` is round-to-nearest. The command that reads a run and
writes the quantized one is `jaxllm.quantize`. `prune` zeroes weights (magnitude, Wanda,
SparseGPT; unstructured or N:M) for `jaxllm.prune`, calibrated through the same block-by-block
pass (`calibrate.sequential`).
"""

from jaxllm.compress.rtn import rtn
from jaxllm.compress.weights import (
    METHODS,
    dims,
    not_trained,
    path_of,
    quantize_params,
    quantized_abstract,
    weight_bytes,
)

__all__ = [
    "METHODS",
    "dims",
    "not_trained",
    "path_of",
    "quantize_params",
    "quantized_abstract",
    "rtn",
    "weight_bytes",
]

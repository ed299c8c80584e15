"""Inference: KV-cached generation (bf16 / int8 / int4 / int2 caches) and the cache-free
reference."""

from jaxllm.infer.generate import Generation, generate, greedy_continue, score_with_cache
from jaxllm.infer.sampling import filter_logits, sample

__all__ = [
    "Generation",
    "filter_logits",
    "generate",
    "greedy_continue",
    "sample",
    "score_with_cache",
]

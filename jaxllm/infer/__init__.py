"""Inference: KV-cached generation (bf16 / int8 / int4 / int2 caches) and the cache-free
reference. `generate(model, prompts, GenerateConfig(...))` takes its settings as the
`generate.*` config section, `GenerateConfig`, exported here too."""

from jaxllm.config import GenerateConfig
from jaxllm.infer.generate import Generation, generate, greedy_continue, score_with_cache
from jaxllm.infer.sampling import filter_logits, sample

__all__ = [
    "GenerateConfig",
    "Generation",
    "filter_logits",
    "generate",
    "greedy_continue",
    "sample",
    "score_with_cache",
]

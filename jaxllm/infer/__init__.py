"""Inference: decoding from a trained model."""

from jaxllm.infer.generate import greedy_continue

__all__ = ["greedy_continue"]

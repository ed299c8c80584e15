"""Benchmark N train steps of any config: the same as `jaxllm bench train`.

    python scripts/bench_train.py [CONFIG.yaml] [key=value ...] [--steps N] [--warmup W]

Prints parameter count, compile time, median step time, tokens/s, model FLOPs per token
(6N + attention), the compiled step's FLOPs from XLA's cost analysis and their ratio, and MFU
where the device's peak is known (H100, H200, TPU v4/v5e/v5p/v6e).
"""

import sys

from jaxllm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "train", *sys.argv[1:]]))

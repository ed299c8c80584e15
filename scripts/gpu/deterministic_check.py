"""train.deterministic on a GPU: two runs of the same config, bit for bit, with and without it.

Trains a small MoE model (tiny_mixtral: scatter-adds in the embedding gradients and the
experts' combine) for a few bfloat16 steps twice with `train.deterministic=true` and twice
without, and compares every logged loss and gradient norm exactly. Prints one line per mode;
exit 1 when the deterministic pair differs.

    JAX_PLATFORMS=cuda python scripts/gpu/deterministic_check.py [STEPS [OVERRIDES...]]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from jaxllm.metrics import read_jsonl

RUN = [
    "configs/models/tiny_mixtral.yaml",
    "data.max_files=200",
    "data.seq_len=512",
    "model.dtype=bfloat16",
    "train.global_batch_size=32",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
]


def _run(steps, deterministic, run_dir, extra) -> list[tuple[float, float]]:
    cmd = [sys.executable, "-m", "jaxllm", "train", *RUN, f"train.steps={steps}", *extra]
    cmd += [f"train.deterministic={str(deterministic).lower()}", f"run.dir={run_dir}"]
    subprocess.run(cmd, check=True)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    return [(r["loss"], r["grad_norm"]) for r in rows]


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for mode in (True, False):
            a, b = (_run(steps, mode, Path(tmp) / f"{mode}-{i}", sys.argv[2:]) for i in (0, 1))
            diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
            head = f"deterministic={str(mode).lower()}:"
            if diff:
                print(f"{head} runs differ from step {diff[0] + 1} ({len(diff)} of {steps})")
            else:
                print(f"{head} bit-identical over {steps} steps, final loss {a[-1][0]:.6f}")
            failed |= mode and bool(diff)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

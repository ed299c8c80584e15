"""`train.deterministic`: the same config and data give bit-identical runs.

- XLA:GPU's determinism options, per compile (as `overlap` passes its own):
  `xla_gpu_deterministic_ops` (deterministic scatters, the scatter-adds of embedding gradients
  and of the MoE combine among them, and autotuning limited to deterministic kernels; it
  implies `xla_gpu_exclude_nondeterministic_ops`, set as well for XLAs that split them).
- float32 matmuls at full precision: the steps are traced under
  `jax.default_matmul_precision("highest")`, so no TF32 on GPU and no bfloat16 passes on TPU.
- Every seed already comes from the config (`run.seed`, `data.seed`); nothing draws from the
  clock or the OS.

On CPU XLA's reductions run in a fixed order and two runs are bit-identical already; the
options above are GPU compiler flags and are set only there. Refused in one line: an XLA that
has no such options (nothing would make the run deterministic).
"""

from __future__ import annotations

import functools

import jax

from jaxllm.config import ConfigError
from jaxllm.train.overlap import known_option

GPU_OPTIONS: dict[str, bool] = {
    "xla_gpu_deterministic_ops": True,
    "xla_gpu_exclude_nondeterministic_ops": True,
}


def compiler_options(deterministic: bool, platform: str) -> dict[str, bool]:
    """The XLA options of `train.deterministic` on a backend `platform` (`gpu`, `cpu`, `tpu`)."""
    if not deterministic or platform != "gpu":
        return {}
    missing = [name for name in GPU_OPTIONS if not known_option(name)]
    if missing:
        raise ConfigError(
            f"train.deterministic=true: this XLA (jax {jax.__version__}) has no compile option "
            f"{missing[0]}, so its GPU ops cannot be made deterministic; drop train.deterministic."
        )
    return dict(GPU_OPTIONS)


def full_precision(fn, deterministic: bool):
    """`fn` traced with float32 matmuls at full precision when `deterministic`, else `fn`."""
    if not deterministic:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return traced

"""The compiler side of `mesh.overlap`: XLA options passed per compile (`jax.jit(...,
compiler_options=...)`), so they change this run's steps and nothing else in the process (no
XLA_FLAGS). `collective_matmul` is not here: it is model code under shard_map
(`jaxllm.parallel.collective_matmul`) and runs on every backend.

- `latency_hiding`: XLA:GPU's latency-hiding scheduler, which orders the program so that
  asynchronous collectives (start/done pairs) run while independent compute does.
- `async_fusion`: XLA:GPU's pipelined collectives: the all-gathers, reduce-scatters and
  all-reduces of a layer loop started one iteration early, so each overlaps the previous
  layer's compute (NeMo's overlap of parameter gathers and gradient reduce-scatters).

Both are flags of the GPU compiler; on another backend they would change nothing, so they
are refused there with one line naming the key.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.config import ConfigError

GPU_OPTIONS: dict[str, dict[str, bool]] = {
    "latency_hiding": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "async_fusion": {
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
    },
}


def compiler_options(switches, platform: str) -> dict[str, bool]:
    """The XLA options of `switches` (`mesh.overlap`) for a backend `platform` (`gpu`, `cpu`,
    `tpu`); a ConfigError when one of them is a GPU compiler flag and `platform` is not."""
    options: dict[str, bool] = {}
    for switch in switches:
        if switch not in GPU_OPTIONS:
            continue
        if platform != "gpu":
            raise ConfigError(
                f"mesh.overlap={switch} sets flags of XLA's GPU compiler, and this backend is "
                f"{platform}: drop it from mesh.overlap (collective_matmul runs anywhere)."
            )
        missing = [name for name in GPU_OPTIONS[switch] if not known_option(name)]
        if missing:  # newer XLAs dropped the pipelined-collective flags
            raise ConfigError(
                f"mesh.overlap={switch}: this XLA (jax {jax.__version__}) has no compile "
                f"option {missing[0]}; drop it from mesh.overlap."
            )
        options.update(GPU_OPTIONS[switch])
    return options


@functools.cache
def known_option(name: str) -> bool:
    """Whether this XLA takes the compile option `name` (a tiny compile with it set: XLA
    refuses an option it does not know, whatever the backend)."""
    try:
        jax.jit(lambda x: x + 1).lower(jnp.ones(1)).compile(compiler_options={name: True})
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" in str(e):
            return False
        raise
    return True

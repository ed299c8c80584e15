"""Multi-process (multi-host) start-up: one `jax.distributed.initialize` before anything else.

The coordinator address, process count and process id come from flags, else from the
environment variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else from
JAX's own cluster detection (SLURM, Open MPI, Cloud TPU pods), so the same `jaxllm train` command
runs under a scheduler unchanged. On CPU, collectives between processes go through gloo.
"""

from __future__ import annotations

import os

import jax


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def wants_distributed(coordinator: str | None, num_processes: int | None) -> bool:
    if coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if num_processes is not None and num_processes > 1:
        return True
    # a scheduler that launched several tasks (JAX's cluster detection fills in the rest)
    return (_env_int("SLURM_NTASKS") or 1) > 1 or (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1


def initialize(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Joins the process group when asked to (flags, environment or scheduler); returns whether
    it did. Must run before the first use of any device."""
    if not wants_distributed(coordinator, num_processes):
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"),
        num_processes=num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES"),
        process_id=process_id if process_id is not None else _env_int("JAX_PROCESS_ID"),
    )
    return True

"""Multi-process (multi-host) start-up: one `jax.distributed.initialize` before anything else.

The coordinator address, process count and process id come from flags, else from the
environment variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else from
JAX's own cluster detection (SLURM, Open MPI, Cloud TPU pods), so the same `jaxllm train` command
runs under a scheduler unchanged. On CPU, collectives between processes go through gloo.

`jax.distributed` takes a bad value with a traceback, and a coordinator it cannot reach (or
whose port is taken) by aborting the whole process after its timeout, so the values are checked
first (`settings`: a ConfigError naming the flag or variable) and so are the network's (in
`initialize`: process 0 makes sure it can listen on the coordinator's port, the others wait
for it to answer; a RunError when it does not).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import time

from jaxllm.config import ConfigError, RunError

CONNECT_TIMEOUT_S = 300
"""How long a process waits for the coordinator (JAX's own default)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """The process group asked for; None where neither flag nor variable gives a value."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def wanted(self) -> bool:
        """Whether this process is one of several (or names a coordinator)."""
        if self.coordinator or (self.num_processes or 1) > 1:
            return True
        # a scheduler that launched several tasks (JAX's cluster detection fills in the rest)
        tasks = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
        return any((_env_int(name, name) or 1) > 1 for name in tasks)


def _env_int(name: str, blame: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{blame} must be an integer, not {text!r}.") from None


def _host_port(address: str, name: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not (host.strip("[]") and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"{name} must be HOST:PORT with a port in 1..65535, not {address!r}.")
    return host.strip("[]"), int(port)


def settings(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> Settings:
    """The flags' values, else the environment's, checked before anything starts."""
    n_name = "--num-processes" if num_processes is not None else "JAX_NUM_PROCESSES"
    i_name = "--process-id" if process_id is not None else "JAX_PROCESS_ID"
    a_name = "--coordinator" if coordinator is not None else "JAX_COORDINATOR_ADDRESS"
    n = num_processes if num_processes is not None else _env_int(n_name, n_name)
    i = process_id if process_id is not None else _env_int(i_name, i_name)
    address = coordinator if coordinator is not None else os.environ.get(a_name) or None
    if n is not None and n < 1:
        raise ConfigError(f"{n_name} must be at least 1, not {n}.")
    if i is not None and n is None:
        raise ConfigError(
            f"{i_name} goes with --num-processes (or JAX_NUM_PROCESSES), the processes in the "
            "run; give both, or neither for one process."
        )
    if i is not None and not 0 <= i < n:
        raise ConfigError(f"{i_name} must be in 0..{n - 1} ({n_name} {n}), not {i}.")
    if address is not None:
        _host_port(address, a_name)
    return Settings(address, n, i)


def _check_port_free(port: int, address: str) -> None:
    """Process 0 serves the coordinator on every address at `port`, as JAX binds it."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            s = socket.socket(family)
        except OSError:  # no IPv6 here
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    continue
                raise RunError(
                    f"process 0 cannot serve as the coordinator on port {port} of {address} "
                    f"({e.strerror}); stop what holds the port, or pick another."
                ) from None
        return


def _await_coordinator(host: str, port: int, address: str) -> None:
    """The other processes wait (as JAX would) until the coordinator takes connections."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            socket.create_connection((host, port), timeout=5).close()
            return
        except socket.gaierror as e:
            raise RunError(f"the coordinator's host in {address} is unknown ({e.strerror}).")
        except OSError:
            if time.monotonic() >= deadline:
                raise RunError(
                    f"no coordinator answered at {address} in {CONNECT_TIMEOUT_S} s; start "
                    "process 0 there (or check the address and the firewall between the hosts)."
                ) from None
            time.sleep(min(1.0, CONNECT_TIMEOUT_S / 10))


def initialize(group: Settings) -> bool:
    """Joins the process group when asked to (flags, environment or scheduler); returns whether
    it did. Must run before the first use of any device."""
    if not group.wanted:
        return False
    import jax

    address, n, i = group.coordinator, group.num_processes, group.process_id
    if None not in (address, n, i):
        host, port = _host_port(address, "--coordinator")
        if i > 0:
            _await_coordinator(host, port, address)
        elif not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
            _check_port_free(port, address)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=n,
            process_id=i,
            initialization_timeout=CONNECT_TIMEOUT_S,
        )
    except (ValueError, TypeError) as e:  # what cluster detection could not fill in
        raise ConfigError(
            f"the process group is incomplete ({e}); give --coordinator HOST:PORT, "
            "--num-processes N and --process-id I (or their JAX_* variables)."
        ) from None
    except RuntimeError as e:
        raise RunError(f"joining the process group at {address} failed: {e}") from None
    return True

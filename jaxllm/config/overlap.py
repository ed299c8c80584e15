"""Checks of `mesh.overlap` (the switches that hide collectives behind compute) and of
`model.param_offload` against the rest of the config."""

from __future__ import annotations

from jaxllm.config.errors import fail as _fail

OVERLAP_SWITCHES = ("collective_matmul", "latency_hiding", "async_fusion")


def validate_overlap(cfg, degrees: dict[str, int] | None) -> None:
    """ConfigError naming the key when a switch is unknown, repeated, or cannot run this
    config; `degrees`: the mesh's degrees (None before the device count is known)."""
    switches = cfg.mesh.overlap
    for s in switches:
        if s not in OVERLAP_SWITCHES:
            _fail(f"mesh.overlap: unknown switch {s!r}; choose from {list(OVERLAP_SWITCHES)}.")
    if len(set(switches)) != len(switches):
        _fail(f"mesh.overlap names a switch twice: {list(switches)}.")
    if "collective_matmul" in switches and not cfg.mesh.tensor_sequence_parallel:
        _fail(
            "mesh.overlap=collective_matmul decomposes the all-gather of "
            "mesh.tensor_sequence_parallel; set mesh.tensor_sequence_parallel=true."
        )
    stages = 1 if degrees is None else degrees["stage"]
    if stages > 1 and "collective_matmul" in switches:
        _fail("mesh.overlap=collective_matmul does not run under pipeline stages (mesh.stage > 1).")
    if stages > 1 and cfg.model.param_offload == "host":
        _fail("model.param_offload=host does not run under pipeline stages (mesh.stage > 1).")

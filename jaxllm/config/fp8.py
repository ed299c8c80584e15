"""Checks of the float8 matmul keys (`model.matmul_dtype`, `model.fp8_scaling`,
`model.fp8_amax_history`)."""

from __future__ import annotations

from jaxllm.config.errors import fail as _fail


def validate_fp8(m) -> None:
    """ConfigError naming the key when a float8 setting cannot run or would do nothing."""
    if m.matmul_dtype not in (None, "float8", m.dtype):
        _fail(
            f"model.matmul_dtype must be null (the compute dtype, model.dtype={m.dtype}) "
            f"or float8, not {m.matmul_dtype!r}."
        )
    if m.fp8_scaling != "current" and m.matmul_dtype != "float8":
        _fail(f"model.fp8_scaling={m.fp8_scaling} needs model.matmul_dtype=float8.")
    if m.fp8_amax_history < 1:
        _fail(f"model.fp8_amax_history must be >= 1, not {m.fp8_amax_history}.")
    if m.fp8_amax_history != 1024 and m.fp8 != "delayed":
        _fail("model.fp8_amax_history needs model.fp8_scaling=delayed (and float8 matmuls).")
    if m.fp8 == "blockwise" and m.moe.enabled and m.moe.dispatch == "dropless":
        _fail(
            "model.fp8_scaling=blockwise covers the capacity MoE experts, not dropless ones: "
            "use model.fp8_scaling=current or model.moe.dispatch=capacity."
        )

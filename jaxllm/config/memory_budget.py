"""The checks of `model.remat=auto`'s budget keys (`train.memory_budget`,
`train.device_memory`) and the sizes they and `jaxllm plan --hbm` are written in."""

from __future__ import annotations

import re

from jaxllm.config.errors import fail as _fail

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str, key: str) -> int:
    """'80GiB' -> 85899345920; plain numbers are bytes; ConfigError naming `key` otherwise."""
    m = re.fullmatch(r"\s*([\d.]+(?:[eE]\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        _fail(f"{key} {text!r} is not a size like 80GiB, 16GB or 1e9.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def validate_memory_budget(cfg) -> None:
    """train.memory_budget in (0, 1]; both keys only with model.remat=auto, which reads them."""
    t = cfg.train
    if not 0 < t.memory_budget <= 1:
        _fail(f"train.memory_budget must be in (0, 1], not {t.memory_budget}.")
    if t.device_memory is not None:
        parse_size(t.device_memory, "train.device_memory")
    if cfg.model.remat != "auto":
        for key in ("memory_budget", "device_memory"):
            if getattr(t, key) != getattr(type(t), key):
                _fail(
                    f"train.{key} has no effect with model.remat={cfg.model.remat}; it is the "
                    "budget of model.remat=auto."
                )

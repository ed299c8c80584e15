"""What jaxllm raises and warns: configuration mistakes (exit 2), failures of the machine or
files around a run (exit 1), and its own warnings. Here, at the bottom floor, so that every
module can use them without importing upward."""

from __future__ import annotations

import typing


class ConfigError(ValueError):
    """A configuration the user can fix; the message names the key and the fix."""


class RunError(RuntimeError):
    """The environment stopped a run (a read-only or full disk, a path that is a file, a
    directory removed under it, another process holding the run); one sentence naming the path.
    The newest good checkpoint is left as it was."""


class JaxllmWarning(UserWarning):
    """Warnings jaxllm itself raises (tests turn them into errors)."""


def fail(msg: str) -> typing.NoReturn:
    raise ConfigError(msg)

"""The one exception of configuration mistakes."""

from __future__ import annotations

import typing


class ConfigError(ValueError):
    """A configuration the user can fix; the message names the key and the fix."""


def fail(msg: str) -> typing.NoReturn:
    raise ConfigError(msg)

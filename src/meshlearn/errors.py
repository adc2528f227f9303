"""The one error a user's bad input raises: ``ConfigError``, and ``require``, which raises it.

It lives apart from the config tree so that any module (checkpoints, run folders, a runtime's
bootstrap) can refuse a value without importing the module that imports every component.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad configuration value: names the field, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        super().__init__(f"{key} = {value!r}: {allowed}")
        self.key = key


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raise ``ConfigError(key, value, allowed)`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, value, allowed)

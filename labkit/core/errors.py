"""The error every layer raises for a bad input: `ConfigError`, whose message says how to fix it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message says how to fix it."""


def positive_int(name: str, value, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number, got {value!r}. {hint}")
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}. {hint}")

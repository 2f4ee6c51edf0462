"""The API key: read from the environment, never written anywhere.

The key lives only in the ``Authorization`` header of outgoing requests. Everything
that leaves the engine as text (attempt messages, log lines, error reports) goes
through :func:`scrub`, because exception texts from HTTP libraries can quote headers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import GenerateError

__all__ = ["ApiKey", "MissingApiKey", "read_api_key", "scrub", "scrub_bytes"]

_MASK = "***"


class MissingApiKey(GenerateError):
    """The environment variable that should hold the key is unset or empty."""


@dataclass(frozen=True)
class ApiKey:
    """A key whose repr/str never shows the value (so tracebacks and logs can't leak it)."""

    env_name: str
    _value: str

    @property
    def value(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"ApiKey(env={self.env_name!r}, value={_MASK})"

    __str__ = __repr__


def read_api_key(env_name: str = "OPENROUTER_API_KEY", *, required: bool = True) -> ApiKey | None:
    """The key from ``$env_name``; :class:`MissingApiKey` (naming the variable) if absent."""
    value = os.environ.get(env_name, "").strip()
    if not value:
        if required:
            raise MissingApiKey(f"environment variable {env_name} is not set (it must hold the API key)")
        return None
    return ApiKey(env_name, value)


def scrub(text: str, key: ApiKey | str | None) -> str:
    """``text`` with every occurrence of the key replaced by ``***``."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or not text:
        return text
    return text.replace(value, _MASK)


def scrub_bytes(data: bytes, key: ApiKey | str | None) -> bytes:
    """Like :func:`scrub` for raw bytes (a server that echoes the key must not get it stored)."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or not data:
        return data
    raw = value.encode("utf-8")
    return data.replace(raw, _MASK.encode()) if raw in data else data

"""The API key: read from the environment, never written anywhere, in any encoding.

The key lives only in the ``Authorization`` header of outgoing requests. Everything
that leaves the engine (attempt messages, log lines, error reports, stored bodies) goes
through :func:`scrub` / :func:`scrub_bytes`, because exception texts from HTTP libraries
can quote headers and a hostile or buggy server can echo the key back.

Forms masked (each replaced by ``***``):
  * raw: ``sk-or-v1-...``;
  * JSON-escaped, any mix of literal characters and ``\\uXXXX`` escapes (any hex case,
    any number of backslashes, so a JSON string nested in a JSON string is covered too),
    which a JSON reader would decode back to the key;
  * URL-encoded, any mix of literal characters and ``%XX`` (any hex case);
  * base64 (standard and URL-safe alphabet) at each of the three byte alignments, so the
    key inside a longer encoded blob (``Basic ...``, ``Bearer ...``) is caught too.

Callers mask *before* clipping text (a clipped key is still a key) and scrub the
assembled body of a stream, not its pieces (see the engine).

A key shorter than :data:`MIN_MASKED` characters is a placeholder (vLLM's ``EMPTY``, a
local server's ``dummy``), not a secret, and is not masked: masking ``e`` or ``the``
turned every stored response into ``So *** plan is`` and every body's ``"choices"`` into
``"choic***s"`` (all samples failed, each paid for). Real keys are far longer
(OpenRouter's are 73 characters); :func:`placeholder_notice` says so once a run.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

from .errors import GenerateError

__all__ = ["MIN_MASKED", "ApiKey", "MissingApiKey", "keys_read", "placeholder_notice", "read_api_key", "scrub",
           "scrub_bytes"]

_MASK = "***"
MIN_MASKED = 16  # shorter keys are placeholders; masking them corrupts responses (see above)
_MIN_B64 = 8  # shorter base64 fragments would mask innocent text (a key is 20+ characters)
_PERCENT_HEX = re.compile(rb"%[0-9A-Fa-f]{2}")


class MissingApiKey(GenerateError):
    """The environment variable that should hold the key is unset or empty."""


@dataclass(frozen=True)
class ApiKey:
    """A key whose repr/str never shows the value (so tracebacks and logs can't leak it)."""

    env_name: str
    _value: str = field(repr=False)

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
    _READ.add(value)
    return ApiKey(env_name, value)


def placeholder_notice(key: ApiKey | None) -> str | None:
    """What to tell the user when ``key`` is too short to be masked, else None."""
    if key is None or len(key.value) >= MIN_MASKED:
        return None
    return (f"the key in ${key.env_name} is {len(key.value)} characters, a placeholder rather than a secret: it is "
            f"not masked in stored responses or messages (masking so short a text would corrupt them)")


#: Every key this process has read, whatever its variable is called (``api_key_env`` is the
#: user's to name): the console script's last-resort traceback is scrubbed of each.
_READ: set[str] = set()


def keys_read() -> tuple[str, ...]:
    """The values of every key :func:`read_api_key` has returned in this process."""
    return tuple(_READ)


def scrub(text: str, key: ApiKey | str | None) -> str:
    """``text`` with every known encoding of the key replaced by ``***``."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or not text or len(value) < MIN_MASKED:
        return text
    return scrub_bytes(text.encode("utf-8", "surrogatepass"), value).decode("utf-8", "surrogatepass")


def scrub_bytes(data: bytes, key: ApiKey | str | None) -> bytes:
    """Like :func:`scrub` for raw bytes (a server that echoes the key must not get it stored)."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or not data or len(value) < MIN_MASKED:
        return data
    forms = _forms(value)
    mask = _MASK.encode()
    raw = value.encode("utf-8")
    if raw in data:
        data = data.replace(raw, mask)
    if forms.escape_mark in data:  # cheap gate: the regex costs ~70 ms/MB, the gate ~1 ms/MB
        data = forms.json_escaped.sub(mask, data)
    if b"%" in data and _PERCENT_HEX.search(data):
        data = forms.url_encoded.sub(mask, data)
    for piece in forms.base64:
        if piece in data:
            data = data.replace(piece, mask)
    return data


@dataclass(frozen=True)
class _Forms:
    escape_mark: bytes  # what any JSON escape of a key character starts with
    json_escaped: re.Pattern[bytes]
    url_encoded: re.Pattern[bytes]
    base64: tuple[bytes, ...]


@lru_cache(maxsize=4)
def _forms(value: str) -> _Forms:
    raw = value.encode("utf-8")
    json_parts = []
    url_parts = []
    for ch in value:
        code = ord(ch)
        lit = re.escape(ch.encode("utf-8"))
        if code < 0x10000:
            json_parts.append(b"(?:" + lit + b"|\\\\+u" + _hex_ci(f"{code:04x}") + b")")
        else:  # a JSON escape of an astral character is a surrogate pair
            hi, lo = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
            json_parts.append(b"(?:" + lit + b"|\\\\+u" + _hex_ci(f"{hi:04x}") + b"\\\\+u" + _hex_ci(f"{lo:04x}") + b")")
        pct = b"".join(b"%" + _hex_ci(f"{b:02x}") for b in ch.encode("utf-8"))
        url_parts.append(b"(?:" + lit + b"|" + pct + b")")
    pieces: set[bytes] = set()
    for shift in range(3):
        enc = base64.b64encode(b"\0" * shift + raw)
        # characters that depend on the key's bytes alone: skip the shift's lead-in and the tail
        start = (shift * 8 + 5) // 6
        end = ((shift + len(raw)) * 8) // 6
        piece = enc[start:end]
        if len(piece) >= _MIN_B64:
            pieces.add(piece)
            pieces.add(piece.replace(b"+", b"-").replace(b"/", b"_"))
    return _Forms(
        escape_mark=b"\\u00" if value.isascii() else b"\\u",  # JSON escapes are a lower-case 'u'
        json_escaped=re.compile(b"".join(json_parts)),
        url_encoded=re.compile(b"".join(url_parts)),
        base64=tuple(sorted(pieces, key=len, reverse=True)),
    )


def _hex_ci(digits: str) -> bytes:
    return b"".join(b"[" + d.lower().encode() + d.upper().encode() + b"]" if d.isalpha() else d.encode()
                    for d in digits)

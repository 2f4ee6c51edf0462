"""Deterministic keys and draws: the same request always meets the same fate.

Nothing here uses the global random state, so runs repeat byte for byte and a test can
reproduce any fault by sending the same request again.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["canonical_json", "draw", "sample_key", "request_key"]


def canonical_json(value: Any) -> str:
    """Stable JSON text (sorted keys, no spaces, non-ASCII kept) for hashing."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def sample_key(messages: Any) -> str:
    """The key ``/stats`` counts requests under: a hash of the request messages."""
    return _digest(canonical_json(messages))


def request_key(body: dict[str, Any]) -> str:
    """A hash of the whole request except the streaming switches (same sample, same key)."""
    return _digest(canonical_json({k: v for k, v in body.items() if k not in ("stream", "stream_options")}))


def draw(*parts: Any) -> float:
    """A number in [0, 1) fixed by ``parts``: ``draw(...) < rate`` is a deterministic coin."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64

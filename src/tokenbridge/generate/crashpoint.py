"""Test-only crash injection at commit points: prove a ``kill -9`` anywhere loses nothing.

``TOKENBRIDGE_CRASH_AT=N`` (set only by tests) makes the process SIGKILL itself at the
Nth call of :func:`commit_point` — each durable step of ``generate`` (a store commit, an
atomic file replace) calls it just before and just after. Counting calls instead of
timing them makes every kill point reachable, repeatable and independent of load.
Unset (always, outside tests) it costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["CRASH_ENV", "commit_point"]

CRASH_ENV = "TOKENBRIDGE_CRASH_AT"
_calls = 0


def commit_point(name: str) -> None:
    """One more commit point passed (``name`` documents where; tests count, not match)."""
    global _calls
    at = os.environ.get(CRASH_ENV)
    if not at:
        return
    _calls += 1
    if _calls == int(at):
        os.kill(os.getpid(), signal.SIGKILL)

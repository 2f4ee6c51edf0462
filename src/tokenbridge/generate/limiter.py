"""Concurrency that adapts to rate limits (AIMD: halve on 429, creep back up on success).

The limit starts at the configured concurrency (the ceiling). A 429 halves it, but only
a 429 for a request sent *after* the last cut counts (as TCP ignores losses from the old
window): a burst of 429s from requests already in flight is one signal. Each success
adds ``1/limit``, i.e. about +1 per round of requests.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

__all__ = ["AIMDLimiter"]


@dataclass
class AIMDLimiter:
    ceiling: int
    floor: int = 1
    decrease: float = 0.5
    limit: float = 0.0
    in_flight: int = 0
    shrinks: int = 0
    _last_shrink: float = field(default=-1e18, repr=False)
    _waiters: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        self.floor = max(1, min(self.floor, self.ceiling))
        self.limit = float(self.ceiling) if not self.limit else self.limit

    async def acquire(self) -> None:
        """Take a slot; waiters are served in arrival order."""
        if not self._waiters and self.in_flight < int(self.limit):
            self.in_flight += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands the slot over (in_flight already counts it)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        while self._waiters and self.in_flight < int(self.limit):
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)

    def on_success(self) -> None:
        if self.limit < self.ceiling:
            self.limit = min(float(self.ceiling), self.limit + 1.0 / max(self.limit, 1.0))
            self._hand_over()

    def on_rate_limited(self, sent_at: float, now: float | None = None) -> bool:
        """Shrink the limit for a 429 on a request sent at ``sent_at`` (monotonic seconds).

        Returns whether it shrank: a request sent before the last cut changes nothing.
        """
        if sent_at < self._last_shrink:
            return False
        self._last_shrink = time.monotonic() if now is None else now
        self.limit = max(float(self.floor), self.limit * self.decrease)
        self.shrinks += 1
        return True

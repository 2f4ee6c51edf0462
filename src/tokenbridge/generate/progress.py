"""Live progress: a rich bar on a terminal, plain log lines otherwise.

Both show done/total, failed, requests and output tokens per second (per minute or hour
when fewer than one a second came), spend, errors by class and ETA, read from
:class:`~.engine.EngineStats` (the engine never waits on the display).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import deque
from contextlib import suppress
from datetime import timedelta
from typing import TYPE_CHECKING, TextIO
from collections.abc import Callable, Iterable

from ..display import printable

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from .engine import EngineStats

__all__ = ["RateMeter", "Reporter", "format_line"]

#: Plain lines come every ``interval_s`` (``log_interval_s``), but never more often than this.
PLAIN_MIN_INTERVAL_S = 0.1


class RateMeter:
    """Completions and completion tokens per second over the last ``window_s`` seconds, or
    over the last ``min_count`` completions where the window holds fewer.

    Counts go into ``bucket_s``-wide time buckets, so memory and cost stay the same at
    any rate (a bounded buffer of single completions saturates: 4,096 entries over 30 s
    could never show more than 136.5/s). A window alone is wrong at low rates: at one
    completion a minute (one slot, long reasoning) a 30 s window shows 0 or 1/30 s by
    turns; the last ``min_count`` completions give 1/60 s. At most ``max_buckets`` are
    kept (a rate that low is then over fewer completions).

    Either way the estimate is unbiased: a span that starts at a set time (the window's
    first bucket, or the meter's start) is divided into the completions in it; a span
    that starts at a completion (the oldest of the last ``min_count``) into the
    completions after it, the intervals it holds. Counting that first one too read 20
    completions over 19 intervals: 5% high.
    """

    def __init__(self, window_s: float = 30.0, bucket_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, *, min_count: int = 20,
                 max_buckets: int = 1024) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.clock = clock
        self.min_count = max(2, min_count)  # a span from a completion needs one after it
        self.max_buckets = max_buckets
        self.started = clock()
        self._buckets: deque[list[int]] = deque()  # [bucket index, completions, tokens], oldest first
        self._count = 0  # completions in _buckets

    def add(self, tokens: int = 0) -> None:
        """One completion that produced ``tokens`` completion tokens."""
        index = math.floor(self.clock() / self.bucket_s)
        if self._buckets and self._buckets[-1][0] == index:
            last = self._buckets[-1]
            last[1] += 1
            last[2] += tokens
        else:
            self._buckets.append([index, 1, tokens])
        self._count += 1
        self._trim(self._window_start(index))

    def rates(self) -> tuple[float, float]:
        """(completions/s, completion tokens/s) over the window, or over the last
        ``min_count`` completions (taken from the oldest bucket they need in proportion)."""
        now = self.clock()
        first = self._window_start(math.floor(now / self.bucket_s))
        self._trim(first)
        count = tokens = 0.0
        older: list[list[int]] = []  # the buckets before the window, newest first
        for bucket in reversed(self._buckets):
            if bucket[0] < first:
                older.append(bucket)
            else:
                count, tokens = count + bucket[1], tokens + bucket[2]
        if count >= self.min_count:  # the window
            span = max(now - max(first * self.bucket_s, self.started), 1e-6)
            return count / span, tokens / span
        if self._count < self.min_count:
            # fewer in all than min_count: every one since the start is held (_trim drops
            # none before that), so all of them over the whole time since the start
            if not self._count:
                return 0.0, 0.0
            tokens += sum(bucket[2] for bucket in older)
            span = max(now - self.started, 1e-6)
            return self._count / span, tokens / span
        since = now
        for index, n, tok in older:  # until min_count completions
            take = min(n, self.min_count - count)
            count, tokens = count + take, tokens + tok * take / n
            # the oldest one taken, were the bucket's n spread evenly over it
            since = (index + (n - take + 0.5) / n) * self.bucket_s
            if count >= self.min_count:
                break
        intervals = count - 1  # the completions after the one the span starts at
        span = max(now - max(since, self.started), 1e-6)
        return intervals / span, tokens * intervals / count / span

    def _window_start(self, index: int) -> int:
        """The first bucket of the window that ends in bucket ``index``."""
        return index - max(1, round(self.window_s / self.bucket_s)) + 1

    def _trim(self, first: int) -> None:
        """Drop the buckets before bucket ``first`` (the window's first) but for those the
        last ``min_count`` completions need; never keep more than ``max_buckets``."""
        buckets = self._buckets
        while buckets and (len(buckets) > self.max_buckets
                           or (buckets[0][0] < first and self._count - buckets[0][1] >= self.min_count)):
            self._count -= buckets.popleft()[1]


def _eta(stats: EngineStats, rps: float) -> str:
    left = stats.total - stats.done - stats.failed - stats.abandoned
    if left <= 0:
        return "0:00:00"
    if rps <= 0:
        return "--:--:--"
    return str(timedelta(seconds=int(left / rps)))


def _errors(stats: EngineStats) -> str:
    if not stats.errors:
        return "none"
    return " ".join(f"{k}={v}" for k, v in stats.errors.most_common(6))


def _rates(rps: float, tps: float, tokens: str, sep: str) -> str:
    """Completions and ``tokens`` per second, or per minute or hour where fewer than one
    a second (or minute) came: one a minute read "0.0 req/s", 30 an hour "0.0 req/min"."""
    scale, unit = 1.0, "s"
    if 0 < rps < 1:
        scale, unit = (60.0, "min") if rps * 60 >= 1 else (3600.0, "h")
    return f"{_amount(rps * scale, '.1f')} req/{unit}{sep}{_amount(tps * scale, ',.0f')} {tokens}/{unit}"


def _amount(x: float, spec: str) -> str:
    """``x`` in ``spec``, or in two significant digits where that would round it to 0
    (a stall of days, a few tokens an hour): never "0.0" for a rate that is not 0."""
    shown = format(x, spec)
    return format(x, ".2g") if x and not shown.strip("0.,") else shown


def format_line(stats: EngineStats) -> str:
    """One plain progress line (also the final summary line)."""
    rps, tps = stats.rates()
    return (
        f"[generate] {stats.done}/{stats.total} done, {stats.failed} failed, "
        f"{_rates(rps, tps, 'out tok', ', ')}, ${stats.spent:.4f} spent, "
        f"in flight {stats.in_flight}/{int(stats.limit)}, errors: {_errors(stats)}, ETA {_eta(stats, rps)}"
    )


class Reporter:
    """Render progress until closed. ``mode``: auto | rich | plain | none."""

    def __init__(self, mode: str = "auto", *, interval_s: float = 15.0, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        if mode == "auto":
            mode = "rich" if self.out.isatty() else "plain"
        self.mode = mode
        self.interval_s = interval_s
        self._progress: Progress | None = None
        self._task_id: TaskID | None = None
        self._stats: EngineStats | None = None
        self._runner: asyncio.Task[None] | None = None

    def log(self, message: str, *, warn: bool = False) -> None:
        """A one-off notice, printed without breaking the live bar. Notices quote API error
        messages and prompt rows' own keys: every control character is shown escaped.
        ``none`` turns the progress display off, not the warnings (``warn``: what the user
        must know, a dataset that gave nothing, spend booked from an earlier run): those
        still go to stderr."""
        if self.mode == "none" and not warn:
            return
        message = printable(message)
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=sys.stderr, flush=True)

    def start(self, stats: EngineStats) -> None:
        """Show ``stats`` until :meth:`close`. Its total may be set after this (the engine
        sets it as it starts sending): nothing is drawn while it is 0, and every line or
        refresh reads it anew. Call it only when there is something to send."""
        self._stats = stats
        if self.mode in ("rich", "plain"):
            self._runner = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        stats = self._stats  # set by start(), which runs this loop
        if stats is None:
            return
        if self.mode == "rich":
            while True:
                await asyncio.sleep(0.25)
                self._update_rich()
        else:
            period = max(self.interval_s, PLAIN_MIN_INTERVAL_S)
            while True:  # a line every period from the start, none before the total is known
                await asyncio.sleep(period)
                if stats.total:
                    print(format_line(stats), file=self.out, flush=True)

    def _start_rich(self, total: int) -> None:
        from rich.console import Console, RenderableType
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.text import Text

        class TwoLines(Progress):
            """The bar, count and time on one line, the detail below it, wrapped where the
            terminal is narrow: on one line an 80-column terminal lost the bar, the count
            and the ETA to it."""

            def get_renderables(self) -> Iterable[RenderableType]:
                yield self.make_tasks_table(self.tasks)
                for task in self.tasks:
                    yield Text.from_markup(str(task.fields.get("detail", "")))

        self._progress = TwoLines(
            TextColumn("[bold]generate"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(file=self.out),
            refresh_per_second=4,
            transient=False,
        )
        self._progress.start()
        self._task_id = self._progress.add_task("generate", total=total, detail="")

    def _update_rich(self) -> None:
        stats = self._stats
        if stats is None or not stats.total:  # no "0/0" bar: nothing to send, or not known yet
            return
        if self._progress is None:
            self._start_rich(stats.total)
        if self._progress is None or self._task_id is None:
            return
        rps, tps = stats.rates()
        detail = (
            f"[red]{stats.failed} failed[/] {_rates(rps, tps, 'tok', ' ')} "
            f"[green]${stats.spent:.4f}[/] inflight {stats.in_flight}/{int(stats.limit)} "
            f"errors: {_errors(stats)} ETA {_eta(stats, rps)}"
        )
        self._progress.update(self._task_id, completed=stats.done + stats.failed, total=stats.total, detail=detail)

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            with suppress(asyncio.CancelledError):
                await self._runner
        if self.mode == "rich":
            self._update_rich()  # the final state, drawn even where the run ended before a refresh
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.mode == "plain" and self._stats is not None and self._stats.total:
            print(format_line(self._stats), file=self.out, flush=True)

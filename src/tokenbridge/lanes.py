"""A file's lines mapped over worker processes, each worker on a stretch of its own,
results handed back in file order.

Why not ``multiprocessing.Pool``: it deals chunks out in file order, so two workers
alternate and each sees every other part of a stretch of conversations (a multi-turn
history's pieces land in the other process's prompt cache), and its three handler
threads in the parent pickle and pipe every input byte while competing with the workers
for the same cores. Here the parent never reads the data. It hands out byte ranges:
each worker starts on its own stretch of the file (an equal share of what is not yet
given out, at most :data:`STRETCH_BYTES`) and works forward through it; a worker whose
stretch is done takes the next one, and when none is left, ranges off the back of the
stretch with the most left. Ranges shrink as the work left does, so the workers finish
together. The parent puts the results back in file order; out-of-order results wait,
at most about one stretch per worker of them.

A range ``[a, b)`` owns the lines that *start* in it (a line starts at 0 or after a
``\\n``): the worker skips the line ``a`` cuts and reads through the one ``b`` cuts, so
any partition of the file into ranges reads every line exactly once.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import stat
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, TypeVar

__all__ = ["STRETCH_BYTES", "InputChanged", "Snapshot", "WorkerDied", "map_lines", "owned_lines", "text_lines"]

R = TypeVar("R")

#: The most of the file one worker is given to work through on its own.
STRETCH_BYTES = 16 << 20
#: Ranges handed out: at most this many bytes, at least the smaller one (towards the end).
RANGE_BYTES = 256 * 1024
MIN_RANGE_BYTES = 16 * 1024
#: Ranges queued per worker: it starts the next while the parent takes the last one's result.
_DEPTH = 2
_READ = 64 * 1024


def owned_lines(fd: int, a: int, b: int) -> tuple[int, bytes]:
    """Where the lines that start in ``[a, b)`` of the file open as ``fd`` start, and
    their bytes."""
    start = a
    if a > 0:  # the line a cuts belongs to the range before: start after its newline, if in range
        pos = a - 1
        while True:  # never past b: a range inside one long line owns nothing and reads only itself
            block = os.pread(fd, min(_READ, b - pos), pos)
            if not block:
                return pos, b""
            cut = block.find(b"\n")
            if cut >= 0:
                start = pos + cut + 1
                break
            pos += len(block)
            if pos >= b:
                return b, b""
    if start >= b:
        return start, b""
    parts = [os.pread(fd, b - start, start)]
    end = start + len(parts[0])
    if end == b and not parts[0].endswith(b"\n"):  # b cuts a line: read through its newline
        while block := os.pread(fd, _READ, end):
            cut = block.find(b"\n")
            if cut >= 0:
                parts.append(block[: cut + 1])
                break
            parts.append(block)
            end += len(block)
    return start, parts[0] if len(parts) == 1 else b"".join(parts)


def lone_crs(data: bytes) -> int:
    """How many ``\\r`` in ``data`` no ``\\n`` follows: each ends a line in text mode."""
    return data.count(b"\r") - data.count(b"\r\n") if b"\r" in data else 0


def text_lines(data: bytes) -> int:
    """How many lines text mode ends in ``data`` (``\\n``, ``\\r\\n`` and a lone ``\\r``
    each end one)."""
    return data.count(b"\n") + lone_crs(data)


def _lines_before(path: str, offset: int) -> int:
    """:func:`text_lines` of the file's first ``offset`` bytes, read a block at a time."""
    n, last = 0, b""
    with open(path, "rb") as fh:
        while offset > 0 and (block := fh.read(min(offset, 1 << 20))):
            offset -= len(block)
            n += text_lines(block) - (last == b"\r" and block[:1] == b"\n")
            last = block[-1:]
    return n


class InputChanged(Exception):
    """The file being read is not the one the run started on (renamed or copied over), or
    is shorter now: reading on would mix two files, or leave records out without a word."""


@dataclass(frozen=True)
class Snapshot:
    """A file as a run found it: every later open by path (each pass, each worker) must find
    the same file (device and inode), at least ``size`` bytes long; its first ``size`` bytes
    are what the run reads (a line being appended then is read whole, later ones not).
    ``shown`` is the name errors give (the path the user typed)."""

    path: str
    shown: str
    dev: int
    ino: int
    size: int

    @classmethod
    def of(cls, path: str, shown: str | None = None) -> Snapshot:
        info = os.stat(path)
        return cls(path, path if shown is None else shown, info.st_dev, info.st_ino, info.st_size)

    def check(self, fd: int) -> None:
        """Raise :class:`InputChanged` unless ``fd`` is this file, still ``size`` bytes or more."""
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != (self.dev, self.ino):
            raise InputChanged(f"{self.shown}: another file took its name while it was being read (renamed or "
                               "copied over it); nothing partial was kept: run again on a file nothing is writing")
        if info.st_size < self.size:
            self.cut_short(info.st_size)

    def cut_short(self, now: int) -> NoReturn:
        raise InputChanged(f"{self.shown}: cut short while it was being read ({self.size:,} bytes at the start, "
                           f"{now:,} now); nothing partial was kept: run again on a file nothing is writing")


class _RemoteTraceback(Exception):
    """A worker's traceback (its one argument), as the ``__cause__`` of the exception it raised."""


@dataclass
class _Stretch:
    front: int
    end: int


class _Ranges:
    """Which byte range each worker reads next (the parent's bookkeeping, no I/O)."""

    def __init__(self, size: int, workers: int, stretch: int = STRETCH_BYTES):
        self.size, self.workers, self.stretch = size, workers, stretch
        self.unassigned = 0
        self.stretches: list[_Stretch | None] = [None] * workers

    def take(self, worker: int) -> tuple[int, int] | None:
        busy = [s for s in self.stretches if s is not None and s.front < s.end]
        left = self.size - self.unassigned + sum(s.end - s.front for s in busy)
        span = max(MIN_RANGE_BYTES, min(RANGE_BYTES, left // (2 * self.workers)))
        mine = self.stretches[worker]
        if mine is None or mine.front >= mine.end:
            # A stretch of its own (a share of what is not given out), unless the stretches
            # behind are so far behind that results would pile up waiting for them: then,
            # or when nothing is left to give out, ranges off the back of the busiest one.
            behind = self.unassigned - min((s.front for s in busy), default=self.unassigned)
            if self.unassigned < self.size and behind < self.workers * self.stretch:
                share = -(-(self.size - self.unassigned) // (self.workers - len(busy)))
                length = min(self.stretch, max(share, span))
                mine = self.stretches[worker] = _Stretch(self.unassigned, min(self.size, self.unassigned + length))
                self.unassigned = mine.end
            else:
                most = max(busy, key=lambda s: s.end - s.front, default=None)
                if most is None:
                    return None
                a = max(most.front, most.end - span)
                b, most.end = most.end, a
                return a, b
        a = mine.front
        mine.front = min(mine.end, a + span)
        return a, mine.front


def _serve(conn: Connection, inherited: list[Connection], snapshot: Snapshot, init: Callable[..., None],
           init_args: tuple[Any, ...], work: Callable[[bytes], Any]) -> None:
    """A worker: read each range it is sent, ``work`` its lines, send back the result.
    Any failure (in ``init`` too) is sent back as ``("err", ...)`` before it ends."""
    for other in inherited:  # the parent's ends a fork copied: with them open, a dead parent is no EOF
        other.close()
    start = -1
    try:
        init(*init_args)
        fd = os.open(snapshot.path, os.O_RDONLY)
        try:
            snapshot.check(fd)
            while (task := conn.recv()) is not None:
                a, b = task
                start, data = owned_lines(fd, a, b)
                if start + len(data) < b:  # the file ends before the range does: it shrank since the check
                    snapshot.cut_short(os.fstat(fd).st_size)
                conn.send(("ok", a, b, text_lines(data), work(data)))
        finally:
            os.close(fd)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent is gone
        return
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(_failure(start, exc))


def _failure(start: int, exc: BaseException) -> tuple[Any, ...]:
    """The reply for an exception: itself if it survives a round trip through pickle,
    else a RuntimeError with its type and text (and its notes and attributes that do)."""
    text = "".join(traceback.format_exception(exc))
    if not _travels(exc):
        plain = RuntimeError(f"{type(exc).__name__}: {exc}")
        plain.__dict__.update({k: v for k, v in getattr(exc, "__dict__", {}).items() if _travels(v)})
        exc = plain
    return ("err", start, exc, text)


def _travels(value: object) -> bool:
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:
        return False
    return True


@dataclass
class _Worker:
    process: Any
    conn: Connection
    queued: int = 0
    stopped: bool = False


def map_lines(path: str, workers: int, init: Callable[..., None], init_args: tuple[Any, ...],
              work: Callable[[bytes], R], *, on_error: Callable[[BaseException, int], None] | None = None,
              stretch: int = STRETCH_BYTES, snapshot: Snapshot | None = None) -> Iterator[tuple[int, R]]:
    """``(number of the first line, work(lines))`` for ranges of ``path``, in file order,
    on ``workers`` processes, each set up once with ``init(*init_args)``.

    ``path`` must be a regular file (ranges are offsets), read as it is now, or as
    ``snapshot`` found it (a caller reading it twice reads the same lines of the same file:
    :class:`InputChanged` where it cannot). ``work`` gets the bytes
    of whole lines (the last may lack its newline). An exception in ``init`` or ``work``
    is raised here, its worker traceback as ``__cause__``; ``on_error(exc, first_line)``
    may annotate one from ``work`` first. A worker that dies stops the run with an error.
    Results waiting for earlier ones are held here: ``stretch`` bounds them (about one
    stretch of input a worker), so make it small where a result is large.
    """
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file (a pipe or device cannot be read in ranges)")
    # fork shares the already-loaded tokenizer (start-up in milliseconds, not a second a
    # worker); it is only safe while this process runs no other threads.
    fork = threading.active_count() == 1 and "fork" in mp.get_all_start_methods()
    ctx = mp.get_context("fork") if fork else mp.get_context("spawn")
    if snapshot is None:
        snapshot = Snapshot(path, path, info.st_dev, info.st_ino, info.st_size)
    ranges = _Ranges(snapshot.size, workers, stretch)
    pool: list[_Worker] = []
    finished = False
    try:
        for _ in range(workers):
            here, there = ctx.Pipe()
            inherited = [*(w.conn for w in pool), here] if fork else []
            process = ctx.Process(target=_serve, args=(there, inherited, snapshot, init, init_args, work), daemon=True)
            pool.append(_Worker(process, here))
            process.start()
            there.close()
        for i, w in enumerate(pool):
            _feed(ranges, i, w)
        yield from _collect(path, pool, ranges, on_error)
        finished = True
    finally:
        _stop(pool, finished)


def _feed(ranges: _Ranges, i: int, w: _Worker) -> None:
    """Keep the worker :data:`_DEPTH` ranges ahead; one with nothing left to do is told to
    stop now, so it has exited by the time the parent is done."""
    while w.queued < _DEPTH and (task := ranges.take(i)) is not None:
        _send(w, task)
        w.queued += 1
    if not w.queued and not w.stopped:
        _send(w, None)
        w.stopped = True


def _send(w: _Worker, message: tuple[int, int] | None) -> None:
    with contextlib.suppress(OSError):  # the worker is gone: _collect reads why (its error, sent first) or its death
        w.conn.send(message)


def _collect(path: str, pool: list[_Worker], ranges: _Ranges,
             on_error: Callable[[BaseException, int], None] | None) -> Iterator[tuple[int, R]]:
    done: dict[int, tuple[int, int, R]] = {}
    expected, line = 0, 1
    while expected < ranges.size:
        waiting = [(i, w) for i, w in enumerate(pool) if w.queued]
        if not waiting:
            raise RuntimeError(f"lanes: no worker holds the range at byte {expected}")  # a bug in _Ranges
        ready = wait([handle for _, w in waiting for handle in (w.conn, w.process.sentinel)])
        for i, w in waiting:
            if w.conn not in ready:
                if w.process.sentinel in ready and not w.conn.poll():
                    _died(w)
                continue
            try:
                reply = w.conn.recv()
            except (EOFError, OSError):
                _died(w)
            w.queued -= 1
            if reply[0] == "err":
                _, start, exc, text = reply
                exc.__cause__ = _RemoteTraceback(text)
                if on_error is not None and start >= 0:
                    on_error(exc, 1 + _lines_before(path, start))
                raise exc
            _, a, b, n, result = reply
            done[a] = (b, n, result)
            _feed(ranges, i, w)
        while expected in done:
            b, n, result = done.pop(expected)
            yield line, result
            line += n
            expected = b


class WorkerDied(Exception):
    """A worker process ended before its work was done: killed (the out-of-memory killer, most
    often) or exited; the run stops with nothing partial kept. Not a bug in the data or code."""


def _died(w: _Worker) -> NoReturn:
    w.process.join(1)
    code = w.process.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"was killed by {name}" + (" (most often the system's out-of-memory killer: give it more memory, or "
                                         "fewer --workers)" if -code == signal.SIGKILL else "")
    else:
        how = f"exited (code {code})"
    raise WorkerDied(f"a reconstruct worker {how} before finishing its work; nothing partial was kept")


def _stop(pool: list[_Worker], finished: bool) -> None:
    """End every worker: when the work is done they were told to stop and are waited for
    (they exit as they run out of ranges); otherwise each is terminated first."""
    for w in pool:
        if w.process.pid is None:  # never started
            continue
        if not finished:
            w.process.terminate()
        w.process.join(5)
        if w.process.is_alive():  # a finished worker that did not exit when told
            w.process.terminate()
            w.process.join()
    for w in pool:
        w.conn.close()

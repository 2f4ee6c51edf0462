"""One process per run folder: an exclusive ``flock`` on ``RUN/.lock`` for the whole run.

Two processes on one folder would send every pending sample twice and the second
response of each would be dropped (paid, but not stored), and two writers of the later
stages would interleave their outputs. ``tokenbridge run`` holds the lock for every stage;
``generate`` and the standalone stages writing into a run folder take it too. The lock
is re-entrant within one process (``run`` holds it, the ``generate`` it calls re-enters
for free). It is advisory and tied to the open file, so a ``kill -9`` releases it; the
file itself stays and holds the owner's pid and command for the error message. Only a
folder the holder made itself and left holding nothing but the lock file (its command
failed before writing anything) goes with it; a process that locked the file as it was
being deleted sees its path no longer names that file and starts over.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

from ..fsio import real_path
from .errors import GenerateError, RunFolderBusy

__all__ = ["LOCK_FILE", "run_lock"]

LOCK_FILE = ".lock"

#: resolved run folder -> (pid, depth) of the locks this process holds
_held: dict[Path, tuple[int, int]] = {}
_guard = threading.Lock()


@contextmanager
def run_lock(run_dir: str | Path, command: str = "generate", retry: str = "or use another --out") -> Iterator[Path]:
    """Hold ``RUN/.lock`` (creating RUN) or raise :class:`RunFolderBusy` at once.

    ``command`` is what this process is (recorded for the other side's message);
    ``retry`` is how the user of *this* command picks another folder."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    key = real_path(run_dir)
    with _guard:
        pid, depth = _held.get(key, (0, 0))
        if pid == os.getpid():
            _held[key] = (pid, depth + 1)
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield path
        finally:
            with _guard:
                pid, depth = _held[key]
                _held[key] = (pid, depth - 1)
        return
    fd, created = _lock(run_dir, path, retry)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} tokenbridge {command}\n".encode("ascii", "replace"), 0)
        with _guard:
            _held[key] = (os.getpid(), 1)
        try:
            yield path
        finally:
            with _guard:
                _held.pop(key, None)
            if created:  # still locked: no other tokenbridge process is in the folder
                _remove_if_only_lock(path, created)
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _lock(run_dir: Path, path: Path, retry: str) -> tuple[int, list[Path]]:
    """The descriptor of ``path``, flocked, and the folders made for it (innermost first).

    A holder that made the folder removes it with the lock file when it leaves nothing else
    (:func:`_remove_if_only_lock`); a process that opened that file just before, and locks
    it just after, holds an unlinked file: it sees the path no longer names its file and
    starts again (the usual check of a lock file that may be deleted)."""
    created: list[Path] = []
    for _ in range(10):
        created = _missing(run_dir) or created  # made on an earlier try, they are still ours
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise GenerateError(f"{run_dir}: cannot use as a run folder ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            owner, _, what = os.pread(fd, 200, 0).decode("ascii", "replace").strip().partition(" ")
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunFolderBusy(
                f"{run_dir}: run folder in use by pid {owner or '?'} (another tokenbridge process: "
                f"{what or 'tokenbridge'}); wait for it to finish {retry}"
            ) from None
        try:
            mine, now = os.fstat(fd), os.stat(path)
        except FileNotFoundError:
            pass
        else:
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                return fd, created
        os.close(fd)  # the lock file was removed (or replaced) between our open and our lock
    raise GenerateError(f"{run_dir}: cannot use as a run folder (its lock file {LOCK_FILE} keeps being replaced)")


def _missing(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, innermost first."""
    out = []
    at = Path(os.path.abspath(folder))
    while not os.path.lexists(at) and at != at.parent:
        out.append(at)
        at = at.parent
    return out


def _remove_if_only_lock(path: Path, created: list[Path]) -> None:
    """A run folder this process made and left holding nothing but its lock file (the
    command failed before writing anything: a prompt file it could not read, a tokenizer
    it could not load) is removed, with the parents it made that are left empty: the user
    is left no folder they did not make. Whatever else is in one keeps it (rmdir
    removes only an empty folder)."""
    try:
        if os.listdir(path.parent) != [LOCK_FILE]:
            return
        os.unlink(path)
        for folder in created:
            os.rmdir(folder)
    except OSError:
        return  # kept: something was put there meanwhile, or it cannot be listed

"""One process per run folder: an exclusive ``flock`` on ``RUN/.lock`` for the whole run.

Two processes on one folder would send every pending sample twice and the second
response of each would be dropped (paid, but not stored), and two writers of the later
stages would interleave their outputs. ``tokenbridge run`` holds the lock for every stage;
``generate`` and the standalone stages writing into a run folder take it too. The lock
is re-entrant within one process (``run`` holds it, the ``generate`` it calls re-enters
for free). It is advisory and tied to the open file, so a ``kill -9`` releases it; the
file itself stays (deleting it would let a third process lock a different inode) and
holds the owner's pid and command for the error message.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

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
    key = run_dir.resolve()
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
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise GenerateError(f"{run_dir}: cannot use as a run folder ({exc.strerror or exc})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            owner, _, what = os.pread(fd, 200, 0).decode("ascii", "replace").strip().partition(" ")
            raise RunFolderBusy(
                f"{run_dir}: run folder in use by pid {owner or '?'} (another tokenbridge process: "
                f"{what or 'tokenbridge'}); wait for it to finish {retry}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} tokenbridge {command}\n".encode("ascii", "replace"), 0)
        with _guard:
            _held[key] = (os.getpid(), 1)
        try:
            yield path
        finally:
            with _guard:
                _held.pop(key, None)
    finally:
        os.close(fd)  # closing the descriptor releases the lock

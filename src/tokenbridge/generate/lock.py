"""One process per run folder: an exclusive ``flock`` on ``RUN/.lock`` for the whole run.

Two processes on one folder would send every pending sample twice and the second
response of each would be dropped (paid, but not stored). The lock is advisory and
tied to the open file, so a ``kill -9`` releases it; the file itself stays (deleting
it would let a third process lock a different inode) and holds the owner's pid for the
error message.
"""

from __future__ import annotations

import errno
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import GenerateError, RunFolderBusy

__all__ = ["LOCK_FILE", "run_lock"]

LOCK_FILE = ".lock"


@contextmanager
def run_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold ``RUN/.lock`` (creating RUN) or raise :class:`RunFolderBusy` at once."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
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
            owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            raise RunFolderBusy(
                f"{run_dir}: run folder in use by pid {owner} (another tokenbridge generate); "
                "wait for it to finish or use another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the lock

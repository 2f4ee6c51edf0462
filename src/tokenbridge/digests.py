"""SHA-256 digests of files, cached by file identity, so an unchanged file is never read twice.

A cached digest stands for a file only while the file's identity (size, ``mtime_ns``,
``ctime_ns``, inode, device) is what it was when the digest was taken, and only when that
identity could not have been kept by a later write:

* every output tokenbridge writes is a rename of a fresh temp file (:mod:`tokenbridge.fsio`,
  generate's ``exchanges.jsonl``), so a rewrite by tokenbridge always brings a new inode,
  even one of the same size within the same timestamp tick;
* any other write sets ``mtime`` and ``ctime`` to the current time. The one write that
  leaves them as they were is one within the same timestamp tick as the state that was
  read (git's "racy" index entries). So a digest is *trusted* only when the file's mtime
  and ctime were at least :data:`RACY_NS` older than the start of the read that produced
  it: a write after that read necessarily moves them (2 s covers the coarsest common
  timestamps, FAT's). A digest of a fresher file is kept but not trusted, so the next
  lookup reads the file again, unless :meth:`DigestCache.settle` re-read it once it aged.

This assumes the file system's clock agrees with this machine's to within ``RACY_NS``
(true of a local disk; of NFS with synchronised clocks).
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from .jsonl import is_count

__all__ = ["RACY_NS", "Digest", "DigestCache", "FileIdentity", "file_identity", "now_ns", "read_digest"]

#: How much older than the read a file's mtime/ctime must be for its digest to be trusted.
RACY_NS = 2_000_000_000
_BLOCK = 1 << 20


def now_ns() -> int:
    """The clock digests are dated by (one place, so a test can move it on)."""
    return time.time_ns()


@dataclass(frozen=True)
class FileIdentity:
    """What ``stat`` says about a file's content without reading it."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def settled(self, at_ns: int) -> bool:
        """No write at or after ``at_ns`` could leave this identity unchanged."""
        return max(self.mtime_ns, self.ctime_ns) + RACY_NS <= at_ns


def file_identity(path: str | Path) -> FileIdentity | None:
    """The identity of the regular file at ``path`` (symlinks followed); None if there is none."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return FileIdentity.of(st) if stat.S_ISREG(st.st_mode) else None


@dataclass(frozen=True)
class Digest:
    """``sha256`` is the content of the file that had identity ``file``, as read from ``checked_ns``."""

    sha256: str
    file: FileIdentity
    checked_ns: int

    @property
    def trusted(self) -> bool:
        return self.file.settled(self.checked_ns)

    def stands_for(self, current: FileIdentity | None) -> bool:
        """True when this digest may be used for a file whose identity is now ``current``."""
        return self.trusted and current == self.file

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, **asdict(self.file), "checked_ns": self.checked_ns}

    @classmethod
    def from_json(cls, obj: Any) -> Digest:
        """Raises ValueError for anything but what :meth:`to_json` writes."""
        if not isinstance(obj, dict):
            raise ValueError("not an object")
        sha = obj.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise ValueError("sha256 is not 64 hex digits")
        nums = {}
        for name in ("size", "mtime_ns", "ctime_ns", "ino", "dev", "checked_ns"):
            v = obj.get(name)
            if not is_count(v):
                raise ValueError(f"{name} is not a non-negative integer")
            nums[name] = v
        checked = nums.pop("checked_ns")
        return cls(sha, FileIdentity(**nums), checked)


def read_digest(path: str | Path) -> Digest:
    """Read the whole file and return its digest. If the file changed while it was read (its
    identity before and after differ) the digest is returned untrusted (``checked_ns`` 0)."""
    started = now_ns()
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        before = FileIdentity.of(os.fstat(fh.fileno()))
        for block in iter(lambda: fh.read(_BLOCK), b""):
            h.update(block)
        after = FileIdentity.of(os.fstat(fh.fileno()))
    return Digest(h.hexdigest(), before, started if after == before else 0)


class DigestCache:
    """path -> :class:`Digest`, what ``RUN/pipeline.json`` keeps under ``"digests"``.

    :meth:`digest` reads a file only when no trusted digest stands for it; ``read`` lists the
    files it read in full (for tests and benchmarks); ``changed`` says whether there is
    anything new to save."""

    def __init__(self, entries: Mapping[str, Digest] | None = None) -> None:
        self._entries: dict[str, Digest] = dict(entries or {})
        self._used: set[str] = set()
        self.read: list[str] = []
        self.changed = False

    @classmethod
    def from_json(cls, obj: Any) -> tuple[DigestCache, list[str]]:
        """The cache saved by :meth:`to_json`; entries that cannot be read are dropped and
        named in the second value (they are only computed again)."""
        if obj is None:
            return cls(), []
        if not isinstance(obj, dict):
            return cls(), ["digests: not an object"]
        entries, problems = {}, []
        for key, value in obj.items():
            try:
                entries[key] = Digest.from_json(value)
            except ValueError as exc:
                problems.append(f"digests[{key!r}]: {exc}")
        return cls(entries), problems

    def to_json(self) -> dict[str, Any]:
        return {k: v.to_json() for k, v in sorted(self._entries.items())}

    def entry(self, path: str | Path) -> Digest | None:
        return self._entries.get(os.path.abspath(path))

    def digest(self, path: str | Path) -> str:
        """The file's SHA-256 hex digest; raises OSError when it cannot be read."""
        key = os.path.abspath(path)
        self._used.add(key)
        known = self._entries.get(key)
        if known is not None and known.stands_for(file_identity(key)):
            return known.sha256
        return self._read(key).sha256

    def settle(self) -> None:
        """Read again each file looked up since this cache was loaded whose digest is not
        trusted yet but can be now (unchanged, and older than :data:`RACY_NS`), so the next
        run finds it trusted; forget the files not looked up (no longer inputs)."""
        for key in [k for k in self._entries if k not in self._used]:
            del self._entries[key]
            self.changed = True
        now = now_ns()
        for key in sorted(self._used):
            known = self._entries.get(key)
            current = file_identity(key)
            if known is None or known.trusted or current != known.file or not current.settled(now):
                continue
            try:
                self._read(key)
            except OSError:
                continue

    def _read(self, key: str) -> Digest:
        fresh = read_digest(key)
        self.read.append(key)
        self._entries[key] = fresh
        self.changed = True
        return fresh

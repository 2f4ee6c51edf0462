"""The one place that writes output files: atomic, fsynced, and cleaned up after a kill.

Every output is built under a temporary name in its own folder and moved into place only
when complete, so a reader (or a rerun after ``kill -9``) sees the old output or the new
one, never half of one:

* :func:`staged_file` — one file: temp file, fsync, ``rename``, fsync of the folder;
* :func:`publish_dir` — a folder whose files belong together (an export, ``vocab/``,
  ``report/``): the whole folder is staged, then swapped in with one atomic
  ``renameat2(RENAME_EXCHANGE)`` (two renames where the filesystem lacks it; a kill
  between them is repaired by the next start); every entry of the old folder tokenbridge
  did not write (the marker lists what it did) is moved into the new one first, so a
  re-export keeps a user's ``hidden_states/``;
* :func:`write_bytes` / :func:`write_text` — small files at once.

A file output replaces only a regular file (:func:`output_file`): the rename would put a
regular file in place of a named pipe, a device node (``-o /dev/null`` as root) or a
socket, so those are refused (:class:`OutputRefused`) before anything is written. A
symlink is written through: the regular file it names is replaced and the link is kept;
a symlink to anything else (or to nothing) is refused.

Temp names are ``.<name>.<pid>-<random>.tbtmp`` (and ``.tbold`` for a replaced folder on
its way out): unique per process and call, and carrying the pid, so
:func:`clean_stale_temps` (run before every write into a folder) removes exactly the
temps whose process is dead, and never anything that does not match that pattern.

File modes: outputs are ``0644`` (folders ``0755``), whatever the umask, so the same data
never has two modes (``exchanges.jsonl`` too). ``generate.json``, which may hold error
text, is :data:`PRIVATE_MODE` ``0600``, and so is generate's store ``state.sqlite`` (made
``0600`` before SQLite opens it, which gives its ``-wal`` / ``-shm`` the same mode).

JSON lines are :mod:`tokenbridge.jsonl`'s (``loads_line`` / ``dumps_line`` are
re-exported here for older imports).

Tests only: ``TOKENBRIDGE_TEST_KILL_AT=<point>:<n>`` makes the process ``SIGKILL`` itself
the ``n``-th time it passes the named commit point (:func:`kill_point`), for seeded,
timing-free crash tests; ``TOKENBRIDGE_TEST_KILL_SIGNAL=SIGSTOP`` sends that signal
instead (a test then holds the process there, e.g. to run a second one beside it).
Points: ``reconstruct:record``, ``export:row``, ``export:written``, ``vocab:written``,
``report:written``, and for each file or folder written ``<label>:staged`` (complete,
not yet in place), ``<label>:carried`` (a folder: after each entry that is not
tokenbridge's is moved from the old folder into the new one), ``<label>:renamed`` /
``<label>:swapped`` (in place, old not yet removed) with labels ``reconstruct``, ``export``, ``vocab``, ``report``, ``state``
(``RUN/pipeline.json``) and ``file``.
"""

from __future__ import annotations

import codecs
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import signal
import stat
import threading
from collections import Counter
from contextlib import contextmanager, suppress
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from collections.abc import Callable, Iterator, Sequence

from .jsonl import JsonLineError, dumps_line, loads_document, loads_line

__all__ = [
    "FILE_MODE",
    "real_path",
    "kind_of",
    "JsonLineError",
    "MARKER",
    "PRIVATE_MODE",
    "OutputRefused",
    "OutputWriteError",
    "CARRIED",
    "FILES_NESTED",
    "clean_stale_temps",
    "reading",
    "foreign_entries",
    "marker_files",
    "marker_owned",
    "unlisted_folders",
    "read_marker",
    "dumps_line",
    "is_temp_name",
    "kill_point",
    "loads_line",
    "open_staged",
    "output_file",
    "parent_problem",
    "publish_dir",
    "read_small_text",
    "staged_file",
    "temp_path",
    "write_bytes",
    "write_text",
]

FILE_MODE = 0o644
DIR_MODE = 0o755
PRIVATE_MODE = 0o600
#: The file inside an output folder that says tokenbridge wrote it, and as what.
MARKER = ".tokenbridge-output"
KILL_ENV = "TOKENBRIDGE_TEST_KILL_AT"
KILL_SIGNAL_ENV = "TOKENBRIDGE_TEST_KILL_SIGNAL"

_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-[0-9a-f]{8}\.(?P<kind>tbtmp|tbold)$")


class OutputWriteError(Exception):
    """Writing an output failed (no space, read-only, ...); names the output. Nothing
    partial is left behind."""

    def __init__(self, path: Path, exc: OSError) -> None:
        self.path = path
        self.errno: int | None = exc.errno
        why = exc.strerror or str(exc)
        super().__init__(f"{path}: cannot write ({why}); nothing partial was kept")


class OutputRefused(OutputWriteError):
    """The output path would replace something tokenbridge did not create; nothing was
    written. An :class:`OutputWriteError` too, so every handler of failed writes shows it
    as one line (:mod:`tokenbridge.outdir` raises it for folders)."""

    exit_code = 2

    def __init__(self, message: str, path: Path | None = None) -> None:
        Exception.__init__(self, message)
        self.path = path if path is not None else Path()
        self.errno = None


# --- test hook ------------------------------------------------------------------------

_passes: Counter[str] = Counter()


def kill_point(point: str) -> None:
    """Signal this process (SIGKILL) on the n-th passage of ``point`` when the test hook asks.

    The hook is ``<point>:<n>``, or ``<prefix>*:<n>`` for the n-th passage of any point
    starting with ``prefix`` (``generate:*:7``: generate's seventh commit point, whichever
    it is). Read at each call (a dict lookup) so a forked test child can set it.
    """
    at = os.environ.get(KILL_ENV)
    if not at:
        return
    name, _, nth = at.rpartition(":")
    if name.endswith("*") and point.startswith(name[:-1]):
        point = name
    elif name != point:
        return
    _passes[point] += 1
    if _passes[point] == int(nth):
        os.kill(os.getpid(), getattr(signal, os.environ.get(KILL_SIGNAL_ENV, "SIGKILL")))


# --- temp names and their cleanup -----------------------------------------------------


def temp_path(target: Path, kind: str = "tbtmp") -> Path:
    """A fresh hidden name beside ``target`` that carries this process's pid."""
    return target.parent / f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.{kind}"


def is_temp_name(name: str) -> bool:
    return _TEMP.match(name) is not None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: The files this process was asked to read, as (device, inode): never a stale temp to
#: sweep, whatever their name (a killed run's temp copy of a pipe, salvaged by the user and
#: given back as the input, was deleted before it was read).
_INPUTS: set[tuple[int, int]] = set()


@contextmanager
def reading(*paths: str | Path) -> Iterator[None]:
    """While inside, :func:`clean_stale_temps` leaves ``paths`` (the command's inputs) alone."""
    added = []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:  # not there (yet): nothing to keep
            continue
        key = (info.st_dev, info.st_ino)
        if key not in _INPUTS:
            _INPUTS.add(key)
            added.append(key)
    try:
        yield
    finally:
        _INPUTS.difference_update(added)


def _an_input(entry: os.DirEntry[str]) -> bool:
    try:
        info = entry.stat()
    except OSError:
        return False
    return (info.st_dev, info.st_ino) in _INPUTS


def clean_stale_temps(folder: Path) -> list[Path]:
    """Remove our own temps in ``folder`` whose process is gone; returns what was removed.

    A replaced folder (``.tbold``) whose new version never arrived (killed between the two
    renames of the fallback swap) is moved back instead, so a kill never loses an output.
    A file being read (:func:`reading`) is left alone whatever its name.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in sorted(entries, key=lambda e: e.name.endswith(".tbtmp")):  # restores (.tbold) first
        m = _TEMP.match(entry.name)
        if m is None or _alive(int(m["pid"])) or _an_input(entry):
            continue
        path = Path(entry.path)
        target = path.parent / m["name"]
        if m["kind"] == "tbold" and not target.exists() and not target.is_symlink():
            os.rename(path, target)
            continue
        if path.is_dir() and not path.is_symlink():
            _discard(path, target)  # a user's entry carried into it goes back first
            if target.is_dir() and not target.is_symlink():
                _unlink_record(target)  # a record swapped in with the new folder: its work is done
        else:
            path.unlink(missing_ok=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


# --- writing --------------------------------------------------------------------------


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path, mode: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


#: Most buffers one ``writev`` takes (POSIX's IOV_MAX; Linux and macOS say 1024).
_IOV_MAX = 1024


def write_parts(fd: int, parts: Sequence[bytes | memoryview]) -> int:
    """Write ``parts`` one after another at ``fd``'s position, with no joined copy of them
    (``writev``, :data:`_IOV_MAX` buffers a call; a short write is resumed). Returns the
    bytes written. Why: joining a chunk's rows first is a megabyte allocated, faulted in
    and copied for every chunk, a few per cent of a worker."""
    total = 0
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        done = os.writev(fd, batch)
        if done == 0:
            raise OSError(errno.EIO, "write_parts: writev wrote nothing")
        total += done
        for view in batch:  # skip what went out whole; resume inside the one it cut
            if done < len(view):
                views[i] = view[done:]
                break
            done -= len(view)
            i += 1
    return total


def copy_range(src_fd: int, offset: int, length: int, dst_fd: int) -> None:
    """Append ``length`` bytes of ``src_fd`` from ``offset`` at ``dst_fd``'s position,
    inside the kernel where it can (``copy_file_range``, then ``sendfile``), else by
    ``pread``/``write``. Why: a user-space copy maps or reads every page first, and the
    parent that gathers the workers' rows shares their two cores.

    A kernel way that fails before it has copied a byte (not there, refused across
    filesystems, by a seccomp filter, a filesystem that copies nothing) hands over to the
    next, as :func:`shutil.copyfile` does; once it has copied some, its error is the
    error (the disk filled, the file went)."""
    end = offset + length
    for way in (_kernel_copy_file_range, _kernel_sendfile):
        if offset >= end:
            return
        offset = way(src_fd, offset, end, dst_fd)
    while offset < end:
        block = os.pread(src_fd, min(end - offset, 1 << 20), offset)
        if not block:
            raise OSError(errno.EIO, f"copy_range: the source ended {end - offset} bytes early")
        offset += write_parts(dst_fd, [block])


def _kernel_copy_file_range(src_fd: int, offset: int, end: int, dst_fd: int) -> int:
    """Copy with ``copy_file_range`` from ``offset`` towards ``end``; where it stopped."""
    copy = getattr(os, "copy_file_range", None)
    return _kernel_copy(lambda at, n: copy(src_fd, dst_fd, n, at), offset, end) if copy else offset


def _kernel_sendfile(src_fd: int, offset: int, end: int, dst_fd: int) -> int:
    """Copy with ``sendfile`` (a file to a file: Linux; macOS's writes only to sockets)."""
    send = getattr(os, "sendfile", None)
    return _kernel_copy(lambda at, n: send(dst_fd, src_fd, at, n), offset, end) if send else offset


def _kernel_copy(call: Callable[[int, int], int], offset: int, end: int) -> int:
    """Run one kernel copy call until ``end``; where it stopped: ``offset`` itself when it
    could not start (its error or a first call that copies nothing), so the next way goes on."""
    start = offset
    while offset < end:
        try:
            n = call(offset, min(end - offset, 1 << 30))
        except OSError:
            if offset == start:
                return offset
            raise
        if n == 0:
            if offset == start:
                return offset
            raise OSError(errno.EIO, f"copy_range: the source ended {end - offset} bytes early")
        offset += n
    return offset


class WriteBehind:
    """Puts a file being written on disk while it is still being written: every
    ``every`` bytes reported by :meth:`wrote`, one background thread runs
    ``fdatasync`` on it (one at a time; the writer never waits for it), so the final
    fsync of a large output only waits for its last part. :meth:`finish` waits for the
    thread and raises what it met (its error would not be reported to a later fsync).
    Start one only after any fork: a forked child must not inherit a thread."""

    def __init__(self, fd: int, every: int = 4 << 20):
        self._fd, self._every, self._unsynced = fd, every, 0
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None

    def wrote(self, n: int) -> None:
        self._unsynced += n
        if self._unsynced < self._every or (self._thread is not None and self._thread.is_alive()):
            return
        self._unsynced = 0
        self._thread = threading.Thread(target=self._sync, name="tokenbridge-write-behind", daemon=True)
        self._thread.start()

    def _sync(self) -> None:
        try:
            _datasync(self._fd)
        except OSError as exc:
            self._error = exc

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


#: fdatasync where the platform has it (not macOS): the file's data, not its times.
_datasync = getattr(os, "fdatasync", os.fsync)


_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def real_path(path: str | os.PathLike[str]) -> Path:
    """``Path(path).resolve()``, except that a symlink loop is left for the next open or
    stat to refuse (an ``OSError``, "Too many levels of symbolic links", that names the
    path), where pathlib raises a RuntimeError no caller expects (a traceback, exit 8)."""
    return Path(os.path.realpath(path))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words: "a folder", "a named pipe (FIFO)", ..."""
    return "a regular file" if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_small_text(path: str | Path, limit: int = 1 << 20) -> str:
    """The first ``limit`` bytes of the regular file ``path`` as UTF-8 text. Something else
    there (a FIFO, a device, a folder) raises :class:`OSError` without waiting on it: a plain
    ``read_text`` of a FIFO blocks until something writes to it, and a marker or sign file
    that a user (or anything) replaced with one hung every command that looked at its folder.
    Text that is not UTF-8 raises :class:`UnicodeDecodeError` (a ``ValueError``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"is {kind_of(info.st_mode)}, not a regular file", str(path))
        data = os.read(fd, limit) if limit else b""
    finally:
        os.close(fd)
    # a read cut at ``limit`` may end inside a character: that piece is left out, not an error
    return codecs.getincrementaldecoder("utf-8")().decode(data, final=len(data) < limit)


def output_file(target: str | Path, *, flag: str | None = None) -> Path:
    """The path a file output is renamed onto: ``target``, or the regular file a symlink
    there names (the link is kept). Raises :class:`OutputRefused` (``flag`` leads its
    message) when that is not missing or a regular file: a rename would replace a FIFO or
    a device node with a plain file."""
    target = Path(target)
    lead = f"{flag} {target}" if flag else str(target)
    try:
        info = os.lstat(target)
    except OSError:  # missing (or unreachable: the write itself says why)
        return target
    if stat.S_ISREG(info.st_mode):
        return target
    if not stat.S_ISLNK(info.st_mode):
        kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
        raise OutputRefused(f"{lead}: is {kind}, not a regular file; refusing to replace it: give a file name", target)
    try:
        real = Path(os.path.realpath(target, strict=True))
        info = os.stat(real)
    except OSError:
        missing = OutputRefused(f"{lead}: is a symlink to a missing file (or a loop); refusing to write through it: "
                                "give a file name", target)
        try:  # /dev/stdout on a pipe: a link the kernel follows to what no path names
            info = os.stat(target)
        except OSError:
            raise missing from None
        if stat.S_ISREG(info.st_mode):  # a deleted file behind /proc's link: no path to rename onto
            raise missing from None
        real = Path(os.readlink(target))
    if not stat.S_ISREG(info.st_mode):
        kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
        raise OutputRefused(f"{lead}: is a symlink to {real}, {kind}; refusing to replace it: give a file name",
                            target)
    return real


@contextmanager
def staged_file(target: str | Path, *, point: str = "file", mode: int = FILE_MODE) -> Iterator[Path]:
    """Yield a temp path beside ``target``; write it, and on a clean exit it is fsynced
    and renamed onto ``target``. On any exception the temp is removed; an ``OSError``
    becomes :class:`OutputWriteError` naming ``target``. A ``target`` that is not a
    regular file is refused first, and a symlink written through (:func:`output_file`)."""
    target = output_file(target)
    _prepare_parent(target)
    tmp = temp_path(target)
    try:
        yield tmp
        _fsync_file(tmp, mode)
        kill_point(f"{point}:staged")
        os.replace(tmp, target)
        kill_point(f"{point}:renamed")
        fsync_dir(target.parent)
    except BaseException as exc:
        with suppress(OSError):  # a read-only filesystem refuses the unlink too: the first error is the one to tell
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OutputWriteError(target, exc) from None
        raise


def write_bytes(target: str | Path, data: bytes, *, point: str = "file", mode: int = FILE_MODE) -> None:
    """Replace ``target`` with ``data`` atomically (durable once this returns)."""
    with staged_file(target, point=point, mode=mode) as tmp, open(tmp, "xb") as fh:
        fh.write(data)


def write_text(target: str | Path, text: str, *, point: str = "file", mode: int = FILE_MODE) -> None:
    write_bytes(target, text.encode("utf-8"), point=point, mode=mode)


@contextmanager
def open_staged(target: str | Path, *, point: str = "file", mode: int = FILE_MODE) -> Iterator[BinaryIO]:
    """:func:`staged_file`, opened for binary writing."""
    with staged_file(target, point=point, mode=mode) as tmp, open(tmp, "xb") as fh:
        yield fh


def _prepare_parent(target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = parent_problem(target)  # "File exists" / "Not a directory" said what mkdir met, not what is wrong
        raise OutputWriteError(target, OSError(exc.errno, why) if why else exc) from None
    clean_stale_temps(target.parent)


def write_protected(path: str | Path) -> bool:
    """Whether the existing file at ``path`` refuses writing: this process may not write it,
    or no one may (no write bit; ``rm`` asks before removing one, root's too). An output
    renamed over it would replace it all the same, so an output named there honours it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) and (not mode & 0o222 or not os.access(path, os.W_OK))


def parent_problem(target: str | Path) -> str | None:
    """Why no folder can be made to hold ``target``, or None: the nearest of its parents that
    exists is not a folder (a file, a FIFO, a symlink to one), said as such ("afile is a
    file, not a folder"; mkdir says "File exists" or "Not a directory"). Nothing is opened."""
    for parent in Path(target).parents:
        try:
            mode = os.stat(parent).st_mode
        except FileNotFoundError:
            if os.path.islink(parent):
                return f"its parent {parent} is a symbolic link to nothing, not a folder"
            continue
        except NotADirectoryError:  # a file further up: the loop reaches it
            continue
        except OSError:
            return None  # unreachable (a permission): the write itself says why
        if stat.S_ISDIR(mode):
            return None
        return f"its parent {parent} is {kind_of(mode)}, not a folder"
    return None


#: Which names of an existing output folder tokenbridge wrote: given the folder, a test of
#: one entry's name (:func:`tokenbridge.outdir.own_names`).
Owned = Callable[[Path], Callable[[str], bool]]


@contextmanager
def publish_dir(target: str | Path, *, point: str = "dir", marker: dict[str, Any] | None = None,
                owned: Owned | None = None) -> Iterator[Path]:
    """Yield an empty temp folder beside ``target``; on a clean exit its files are
    fsynced (mode 0644), ``marker`` is written as ``.tokenbridge-output`` (with ``files``,
    the names written) and the folder replaces ``target`` in one step. On any exception the
    temp folder is removed and ``target`` is left as it was. The caller decides whether
    ``target`` may be replaced (:mod:`tokenbridge.outdir`).

    Only what tokenbridge wrote in ``target`` is replaced: ``owned(target)`` tells its own
    names (default: those its marker's ``files`` lists, or every name where it lists none).
    Every other entry (a user's ``hidden_states/``, notes) is moved into the new folder
    before the swap, so the swap is still one step and the entry is never copied or lost;
    the names carried are recorded first (:data:`CARRIED`), so a kill at any point leaves
    them in ``target`` or in the dead process's temp folder, from which
    :func:`clean_stale_temps` moves them back. An entry whose name the new output also
    writes is refused (:class:`OutputRefused`, ``target`` untouched).

    The caller checked ``target`` just before this is entered; a folder another command
    published there meanwhile (two exports of other formats into one new folder: both said
    done, one was gone) is refused at the swap (:func:`_swap_in`: checked again right
    before it; a rename never replaces a folder that has entries)."""
    target = Path(target)
    _prepare_parent(target)
    seen = _identity(target)
    tmp = temp_path(target)
    swapped = False
    try:
        tmp.mkdir()
        yield tmp
        written = _entries(tmp) - {MARKER, CARRIED}
        if marker is not None:
            _write_marker(tmp, marker, written)
        _sync_tree(tmp)
        kill_point(f"{point}:staged")
        _unchanged(target, seen)
        ours = _owned_test(target, owned)
        made = _carry(target, tmp, ours, written | {MARKER}, point)
        if made and marker is not None:  # a folder made to hold a user's nested entry is ours, as before
            _write_marker(tmp, marker, written | made)
            _fsync_file(tmp / MARKER, FILE_MODE)
        _keep_attributes(target, tmp)
        _unchanged(target, seen)
        old = _swap_in(tmp, target, point)
        swapped = True
        kill_point(f"{point}:swapped")
        fsync_dir(target.parent)
        if old is not None:
            _discard(old, target, ours)
        _unlink_record(target)
    except BaseException as exc:
        if not swapped:  # only what the record lists goes back: the rest is this output's
            _discard(tmp, target, lambda name: True)
        if isinstance(exc, OSError):
            raise OutputWriteError(target, exc) from None
        raise


#: The file a folder being published holds while entries that are not tokenbridge's are
#: moved into it: their names, one JSON list, written (and fsynced) before the first move.
CARRIED = ".tokenbridge-carried"


def _owned_test(target: Path, owned: Owned | None) -> Callable[[str], bool]:
    if not target.is_dir() or target.is_symlink():
        return lambda name: True
    if owned is not None:
        return owned(target)
    return marker_owned(target) or (lambda name: True)


def read_marker(folder: Path) -> dict[str, Any] | None:
    """``folder``'s marker as written, or None (none there, unreadable, not a JSON object)."""
    try:
        data = loads_document(read_small_text(folder / MARKER))
    except (OSError, ValueError):  # ValueError: not UTF-8, not JSON, nested too deeply (JsonLineError)
        return None
    return data if isinstance(data, dict) else None


def marker_files(folder: Path) -> frozenset[str] | None:
    """The names ``folder``'s marker says tokenbridge wrote there (``files``), or None."""
    data = read_marker(folder)
    files = data.get("files") if data is not None else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return frozenset(files)


#: A marker key: ``files`` lists every entry tokenbridge wrote, inside its folders too, so
#: a folder listed with nothing inside it listed (one made to hold a user's entries) holds
#: nothing of tokenbridge's. Markers written before it listed a folder's entries only where
#: they listed any: :func:`unlisted_folders`.
FILES_NESTED = "files_nested"


def unlisted_folders(folder: Path) -> frozenset[str]:
    """The folders ``folder``'s marker lists without the entries inside them, where that
    means they are tokenbridge's whole (a marker from before nested lists, which listed
    ``data`` alone); none for a marker that says it lists nested entries
    (:data:`FILES_NESTED`), or that lists none."""
    data = read_marker(folder)
    files = marker_files(folder)
    if data is None or files is None or data.get(FILES_NESTED) is True:
        return frozenset()
    listed_in = {name.split("/", 1)[0] for name in files if "/" in name}
    return frozenset(name for name in files if "/" not in name and name not in listed_in)


def marker_owned(folder: Path) -> Callable[[str], bool] | None:
    """Which entries of ``folder`` tokenbridge wrote, by its marker: the names the marker
    lists (``data/train-00000-of-00001.parquet`` inside a folder it wrote; a folder listed
    with nothing inside it listed, as markers before those lists had it, is all its own:
    :func:`unlisted_folders`), the marker itself and the carried-entries record; None when
    the marker lists none."""
    files = marker_files(folder)
    if files is None:
        return None
    whole = unlisted_folders(folder)

    def ours(name: str) -> bool:
        if name in files or name in (MARKER, CARRIED):
            return True
        top, nested, _ = name.partition("/")
        return bool(nested) and top in whole
    return ours


def _entries(root: Path) -> set[str]:
    """Every entry of ``root``, those inside its folders as relative paths (``data/x``)."""
    out: set[str] = set()
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        out.update(prefix + n for n in (*dirs, *files))
    return out


def foreign_entries(target: Path, ours: Callable[[str], bool]) -> list[str]:
    """The entries of ``target`` tokenbridge did not write (temps aside), sorted; inside a
    folder of its own, each entry is asked about by its relative path (``data/x``): a user's
    file beside the shards of a Parquet export's ``data/`` is the user's."""
    out: list[str] = []

    def walk(folder: Path, prefix: str) -> None:
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            rel = prefix + name
            if is_temp_name(name) or rel == CARRIED:
                continue
            if not ours(rel):
                out.append(rel)
            elif (folder / name).is_dir() and not (folder / name).is_symlink():
                walk(folder / name, rel + "/")
    walk(target, "")
    return sorted(out)


def _carry(target: Path, tmp: Path, ours: Callable[[str], bool], written: set[str], point: str) -> set[str]:
    """Move every entry of ``target`` that is not tokenbridge's into ``tmp`` (see :func:`publish_dir`);
    returns the folders made in ``tmp`` to hold nested ones (``data`` for ``data/x``)."""
    if not target.is_dir() or target.is_symlink():
        return set()
    keep = foreign_entries(target, ours)
    clash = [name for name in keep if name in written]
    if clash:
        raise OutputRefused(f"{target}: {target / clash[0]} is not tokenbridge's and the new output writes that "
                            "name; nothing was written: move it away or give another folder", target / clash[0])
    if not keep:
        return set()
    made = {str(p) for name in keep for p in PurePosixPath(name).parents if p.name} - written  # data for data/x
    with open(tmp / CARRIED, "x", encoding="utf-8") as fh:
        fh.write(json.dumps(keep) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)
    for name in keep:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)  # a user's file inside a folder of ours
        os.rename(target / name, tmp / name)
        kill_point(f"{point}:carried")
    fsync_dir(tmp)
    fsync_dir(target)
    return made


def _write_marker(folder: Path, marker: dict[str, Any], files: set[str]) -> None:
    """The staged folder's marker: ``marker`` with ``files``, the entries tokenbridge wrote."""
    record = {**marker, "files": sorted(files), FILES_NESTED: True}
    (folder / MARKER).write_text(json.dumps(record, sort_keys=True) + "\n", encoding="utf-8")


def _unlink_record(folder: Path) -> None:
    try:
        (folder / CARRIED).unlink()
    except FileNotFoundError:
        return
    except OSError:
        return  # harmless where it stays: the record is tokenbridge's own name
    fsync_dir(folder)


def _discard(folder: Path, target: Path, ours: Callable[[str], bool] | None = None) -> None:
    """Remove a temp folder, first moving back into ``target`` every entry that is not
    tokenbridge's: the names its :data:`CARRIED` record lists, and (``ours`` or, without
    it, its marker's ``files``; neither: nothing else) every name it does not claim. An
    entry that cannot go back (``target`` holds that name) keeps the folder where it is."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return
    carried: set[str] = set()
    try:
        listed = loads_document(read_small_text(folder / CARRIED, 64 << 20))
        carried = {n for n in listed if isinstance(n, str)} if isinstance(listed, list) else set()
    except (OSError, ValueError):
        pass
    if ours is None:
        ours = marker_owned(folder) or (lambda name: True)
    back = sorted({n for n in carried if os.path.lexists(folder / n)}
                  | {n for n in names if n not in carried and n != CARRIED and not ours(n)})
    stuck = False
    for name in back:
        if os.path.lexists(target / name):
            stuck = True
            continue
        try:
            (target / name).parent.mkdir(parents=True, exist_ok=True)  # a nested one: its folder back too
            os.rename(folder / name, target / name)
        except OSError:
            stuck = True
    if back:
        fsync_dir(target) if target.is_dir() else None
    if not stuck:
        shutil.rmtree(folder, ignore_errors=True)


def _sync_tree(root: Path) -> None:
    for folder, dirs, files in os.walk(root):
        for name in files:
            _fsync_file(Path(folder, name), FILE_MODE)
        for name in dirs:
            os.chmod(Path(folder, name), DIR_MODE)
        fsync_dir(Path(folder))
    os.chmod(root, DIR_MODE)


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what is at ``path`` now, or None where nothing is."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def _unchanged(target: Path, seen: tuple[int, int] | None) -> None:
    """Refuse to publish over a folder another command put at ``target`` since ``seen``
    (what was there when this one started; one the user removed meanwhile is made again)."""
    now = _identity(target)
    if now is not None and now != seen:
        raise _published_meanwhile(target, seen)


def _published_meanwhile(target: Path, seen: tuple[int, int] | None) -> OutputRefused:
    return OutputRefused(f"{target}: another command wrote this folder while this one ran (it was "
                         f"{'not there' if seen is None else 'another folder'} when this one started); "
                         "nothing was replaced: look at it, then run again", target)


def _keep_attributes(target: Path, new: Path) -> None:
    """Give ``new`` the mode, owner and group of the folder it replaces: a folder the user
    made private (0700, a group's with setgid) came back 0755 with this process's group,
    its files listable by everyone. The owner and group are kept where this process may
    set them (root; a group it belongs to); the mode is set after them (a chown clears
    setgid), with the owner's own rwx kept (a 0555 folder came back unwritable, and the next
    output could not clear the files it replaces)."""
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        return
    try:
        os.chown(new, info.st_uid, info.st_gid)
    except OSError:  # another owner (not root; or an id a user namespace does not map): the group alone
        with suppress(OSError):
            os.chown(new, -1, info.st_gid)
    os.chmod(new, stat.S_IMODE(info.st_mode) | stat.S_IRWXU)


def _swap_in(new: Path, target: Path, point: str) -> Path | None:
    """Put ``new`` at ``target``; returns where the old ``target`` now is (to remove). Where
    nothing was, a folder with entries another command put there since is never replaced
    (the rename fails: refused as :func:`_unchanged` refuses it)."""
    if not target.exists():
        try:
            os.rename(new, target)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise _published_meanwhile(target, None) from None
            raise
        return None
    if _exchange(new, target):
        return new  # the old contents now live under the temp name
    old = temp_path(target, "tbold")
    os.rename(target, old)
    kill_point(f"{point}:half-swapped")
    os.rename(new, target)
    return old


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2``); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    res = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE))
    if res == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))

"""tokenbridge.fsio: the one JSON-lines pair, file modes, and what stale-temp cleanup may touch."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys

import pytest

from tokenbridge import fsio
from tokenbridge.fsio import (
    FILE_MODE,
    JsonLineError,
    OutputWriteError,
    clean_stale_temps,
    dumps_line,
    loads_line,
    publish_dir,
    temp_path,
    WriteBehind,
    write_text,
)
from tokenbridge.rows import JsonlRowSink


def test_dumps_line_is_compact_utf8_like_the_stdlib():
    obj = {"id": "x", "text": "naïve 東京 🙂", "ids": [1, 2, 3], "ok": True, "none": None}
    assert dumps_line(obj) == json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def test_a_lone_surrogate_round_trips_as_an_escape_and_the_line_stays_utf8():
    obj = {"content": "bad \ud800 text"}
    line = dumps_line(obj)
    assert line == b'{"content":"bad \\ud800 text"}'
    line.decode("utf-8")  # valid UTF-8
    assert loads_line(line.decode("ascii")) == obj


def test_an_invalid_line_names_the_column():
    with pytest.raises(JsonLineError, match=r"not valid JSON \(Expecting value at column 7\)"):
        loads_line('{"a": }')
    # the stdlib's messages that end in "at" say it once (it read "at at", a cold tester's)
    for line, said in (('{"id": "x\x01y"}', "Invalid control character at column 10"),
                       ('{"id": "open', "Unterminated string starting at column 8")):
        with pytest.raises(JsonLineError) as info:
            loads_line(line)
        assert info.value.detail == f"not valid JSON ({said})"


def test_outputs_get_one_mode_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_text(tmp_path / "a.json", "{}\n")
        with publish_dir(tmp_path / "set") as tmp:
            (tmp / "b.json").write_text("{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == FILE_MODE
    assert stat.S_IMODE((tmp_path / "set" / "b.json").stat().st_mode) == FILE_MODE


def test_a_failed_write_names_the_output_and_leaves_nothing(tmp_path):
    target = tmp_path / "out.json"
    with pytest.raises(OutputWriteError, match=f"^{target}: cannot write"), publish_dir(target):
        raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_stale_temps_of_a_dead_process_go_and_nothing_else(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / f".r.jsonl.{pid}-0123abcd.tbtmp").write_text("half")
    (tmp_path / f".vocab.{pid}-0123abcd.tbtmp").mkdir()
    live = temp_path(tmp_path / "r.jsonl")
    live.write_text("being written")
    keep = [".r.jsonl.partial", f"r.jsonl.{pid}-0123abcd.tbtmp", f".r.{pid}.tbtmp", "notes.txt"]
    for name in keep:
        (tmp_path / name).write_text("user")
    removed = clean_stale_temps(tmp_path)
    assert sorted(p.name for p in removed) == [f".r.jsonl.{pid}-0123abcd.tbtmp", f".vocab.{pid}-0123abcd.tbtmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, live.name])


def test_write_behind_syncs_every_so_many_bytes_one_at_a_time(tmp_path, monkeypatch):
    synced: list[int] = []
    monkeypatch.setattr(fsio, "_datasync", synced.append)
    with open(tmp_path / "out", "wb") as fh:
        behind = WriteBehind(fh.fileno(), every=2000)
        for _ in range(5):
            behind.wrote(1000)
            behind.finish()  # the sync (if one started) is done before the next write
        assert synced == [fh.fileno()] * 2  # after 2,000 and 4,000 bytes; 1,000 left for the final fsync


def test_write_behind_reports_a_failed_sync_once(tmp_path, monkeypatch):
    def fail(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fsio, "_datasync", fail)
    sink = JsonlRowSink(tmp_path / "rows.jsonl")
    sink._behind._every = 10
    sink.write(b'{"a": 1}\n' * 3)
    with pytest.raises(OSError, match="I/O error"):
        sink.close()
    sink = JsonlRowSink(tmp_path / "other.jsonl")
    sink._behind._every = 10
    sink.write(b'{"a": 1}\n' * 3)
    sink.abort()  # thrown away: the sync's error is not the one to tell
    assert not (tmp_path / "other.jsonl").exists()


def test_write_parts_writes_every_part_in_order_through_short_writes(tmp_path, monkeypatch):
    """More parts than one writev takes, and a kernel that writes at most 7 bytes a call
    (cutting parts anywhere): the file is the parts joined, byte for byte."""
    parts = [bytes([65 + i % 26]) * (i % 5) for i in range(fsio._IOV_MAX * 2 + 37)]
    writev = os.writev
    calls = []

    def short(fd, buffers):
        calls.append(len(buffers))
        assert len(buffers) <= fsio._IOV_MAX
        take = b"".join(bytes(b) for b in buffers)[:7]
        return os.write(fd, take) if take else writev(fd, buffers)

    monkeypatch.setattr(os, "writev", short)
    path = tmp_path / "parts"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert fsio.write_parts(fd, [b"head", *parts, memoryview(b"tail")]) == 8 + sum(map(len, parts))
    finally:
        os.close(fd)
    assert path.read_bytes() == b"head" + b"".join(parts) + b"tail"
    assert len(calls) > 100


def test_write_parts_refuses_a_kernel_that_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "writev", lambda fd, buffers: 0)
    fd = os.open(tmp_path / "x", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="wrote nothing"):
            fsio.write_parts(fd, [b"abc"])
    finally:
        os.close(fd)


@pytest.mark.parametrize("way", ["copy_file_range", "sendfile", "pread", "sendfile to sockets only"])
def test_copy_range_appends_the_range_whichever_way_the_kernel_allows(tmp_path, monkeypatch, way):
    """A range from the middle of one file appended after what another already holds
    (its buffered writes flushed first), by copy_file_range, by sendfile where that is
    refused (EXDEV, as across filesystems), by pread/write where neither exists or
    sendfile writes only to sockets (macOS: ENOTSOCK)."""
    def refused(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def sockets_only(*args):
        raise OSError(errno.ENOTSOCK, "Socket operation on non-socket")

    if way != "copy_file_range":
        monkeypatch.setattr(os, "copy_file_range", refused, raising=False)
    if way == "pread":
        monkeypatch.delattr(os, "sendfile", raising=False)
    if way == "sendfile to sockets only":
        monkeypatch.setattr(os, "sendfile", sockets_only, raising=False)
    data = bytes(range(256)) * 5000  # 1.28 MB: more than one pread block
    src = tmp_path / "src"
    src.write_bytes(data)
    sink = JsonlRowSink(tmp_path / "out")
    sink.write(b"before|")
    fd = os.open(src, os.O_RDONLY)
    try:
        sink.copy_from(fd, 1000, len(data) - 2000)
        sink.write(b"|after")
        other = os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError, match="ended 10 bytes early"):
                fsio.copy_range(fd, len(data) - 5, 15, other)
        finally:
            os.close(other)
    finally:
        os.close(fd)
    sink.close()
    assert (tmp_path / "out").read_bytes() == b"before|" + data[1000:-1000] + b"|after"


@pytest.mark.parametrize("first", ["EPERM", "nothing copied"])
def test_copy_range_goes_on_another_way_when_the_kernel_copy_cannot_start(tmp_path, monkeypatch, first):
    """A copy_file_range a seccomp filter refuses (EPERM) or that copies nothing on a
    filesystem that cannot: the copy goes on by sendfile, as shutil's does."""
    def refuse(*args):
        if first == "EPERM":
            raise OSError(errno.EPERM, "Operation not permitted")
        return 0

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    data = os.urandom(100_000)
    (tmp_path / "src").write_bytes(data)
    fd, out = os.open(tmp_path / "src", os.O_RDONLY), os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        fsio.copy_range(fd, 7, len(data) - 7, out)
    finally:
        os.close(fd)
        os.close(out)
    assert (tmp_path / "out").read_bytes() == data[7:]


def test_copy_range_passes_on_an_error_after_the_copy_began(tmp_path, monkeypatch):
    """The disk filling once bytes have gone out is the copy's error, not a reason to
    start over another way (which would append them twice)."""
    if not hasattr(os, "copy_file_range"):
        pytest.skip("no copy_file_range here (Linux only)")
    real = os.copy_file_range
    calls = []

    def fills(src, dst, count, offset_src=None, *rest):
        calls.append(count)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, 10, offset_src)

    monkeypatch.setattr(os, "copy_file_range", fills)
    (tmp_path / "src").write_bytes(b"x" * 100)
    fd, out = os.open(tmp_path / "src", os.O_RDONLY), os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="No space left"):
            fsio.copy_range(fd, 0, 100, out)
    finally:
        os.close(fd)
        os.close(out)
    assert (tmp_path / "out").read_bytes() == b"x" * 10


def test_a_staged_file_on_a_read_only_filesystem_says_so_once(tmp_path, monkeypatch):
    """EROFS refuses the write and then the cleanup's unlink too: the unlink's error replaced
    the first with a traceback (``reconstruct -o`` onto a read-only mount, a cold tester)."""
    from pathlib import Path

    from tokenbridge.fsio import staged_file

    def refuse(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    target = tmp_path / "rec.jsonl"
    with pytest.raises(OutputWriteError) as err, staged_file(target):
        monkeypatch.setattr(Path, "unlink", refuse)
        monkeypatch.setattr(Path, "mkdir", refuse)
        (tmp_path / "spool").mkdir()
    assert str(err.value) == f"{target}: cannot write (Read-only file system); nothing partial was kept"


def test_an_input_named_like_a_killed_runs_temp_is_read_not_swept(tmp_path, kimi_dir, stage_inputs):
    """A kill -9 while a pipe was copied leaves ``.NAME.PID-RAND.tbtmp`` beside the output:
    a user who salvaged it and gave it back as the input had it deleted by the stale-temp
    sweep before it was read, told only that the output could not be written (a cold
    tester's). A file a command reads is never swept; a real stale temp beside it still is."""
    from conftest import EXAMPLE_EXCHANGES
    from tokenbridge.export import export_file
    from tokenbridge.reconstruct import reconstruct_file

    salvaged = tmp_path / ".salvaged.jsonl.999999-deadbeef.tbtmp"  # pid 999999: no such process
    data = EXAMPLE_EXCHANGES.read_bytes()
    salvaged.write_bytes(data)
    stale = tmp_path / ".out.jsonl.999999-cafebabe.tbtmp"
    stale.write_bytes(b"half\n")
    summary = reconstruct_file(salvaged, tmp_path / "out.jsonl", kimi_dir, workers=1)
    assert summary.records + len(summary.bad_lines) == len(data.splitlines()) == 8  # the example's broken line too
    assert salvaged.read_bytes() == data and not stale.exists()
    rows = tmp_path / ".rows.jsonl.999999-0badf00d.tbtmp"
    rows.write_bytes((stage_inputs / "reconstructed.jsonl").read_bytes())
    export_file(rows, tmp_path / "export", "specforge")
    assert rows.read_bytes() == (stage_inputs / "reconstructed.jsonl").read_bytes()


@pytest.mark.parametrize("before", [False, True])
def test_a_folder_another_writer_published_meanwhile_is_not_replaced(tmp_path, before):
    """A cold tester's race: two exports of other formats into one new folder both checked
    it missing, both said done, and the second swap replaced the first's output. Whatever
    another writer published at the target while this one worked is refused at the swap."""
    from tokenbridge.fsio import MARKER, OutputRefused

    target = tmp_path / "out"
    if before:
        with publish_dir(target, marker={"kind": "export", "format": "parquet"}) as first:
            (first / "old.txt").write_bytes(b"old")
    with (pytest.raises(OutputRefused, match="another command wrote this folder while this one ran"),
          publish_dir(target, marker={"kind": "export", "format": "parquet"}) as outer):
        (outer / "a.txt").write_bytes(b"outer")
        with publish_dir(target, marker={"kind": "export", "format": "specforge"}) as inner:
            (inner / "b.txt").write_bytes(b"inner")
    assert sorted(os.listdir(target)) == [MARKER, "b.txt"] and sorted(os.listdir(tmp_path)) == ["out"]
    # nothing else at work: the folder the check saw is replaced as before, and one removed meanwhile is made again
    with publish_dir(target, marker={"kind": "export", "format": "specforge"}) as again:
        (again / "c.txt").write_bytes(b"again")
    assert sorted(os.listdir(target)) == [MARKER, "c.txt"]
    with publish_dir(target, marker={"kind": "export", "format": "specforge"}) as gone:
        fsio.shutil.rmtree(target)
        (gone / "d.txt").write_bytes(b"d")
    assert sorted(os.listdir(target)) == [MARKER, "d.txt"]


def test_a_folder_whose_owner_cannot_be_given_still_gets_its_group_and_is_published(tmp_path, monkeypatch):
    """A reviewer's: a non-root writer (or root in a user namespace: EINVAL) cannot give the
    new folder the old one's owner, and the failed chown set no group either; a shared
    setgid folder came back with the writer's group and the old mode, locking the group out.
    EINVAL failed the publish."""
    target = tmp_path / "shared"
    target.mkdir()
    target.chmod(0o2770)
    calls = []

    def chown(path, uid, gid):
        calls.append((uid, gid))
        if uid != -1:
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fsio.os, "chown", chown)
    with publish_dir(target, marker={"kind": "export", "format": "parquet"}) as tmp:
        (tmp / "a.txt").write_bytes(b"a")
    info = os.stat(target)
    assert calls == [(info.st_uid, info.st_gid), (-1, info.st_gid)]
    assert oct(info.st_mode & 0o7777) == oct(0o2770) and (target / "a.txt").read_bytes() == b"a"

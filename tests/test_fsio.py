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

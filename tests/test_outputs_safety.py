"""Outputs never destroy what tokenbridge did not create (issue 12 item 1).

Each refusal: exit 2, one ``error:`` line that says why, and the user's files byte-identical.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from outputs_support import leftovers, snapshot
from test_export_support import make_run, write_jsonl
from tokenbridge.cli import app


@pytest.fixture(scope="module")
def rows(kimi):
    return make_run(kimi, 10)


@pytest.fixture
def run_dir(tmp_path, rows) -> Path:
    """A run folder as generate + reconstruct leave it (its store empty: a run folder is
    recognised by the store's schema, never by a file's name or header)."""
    from tokenbridge.generate.store import Store

    run = tmp_path / "run"
    exchanges, recs = rows
    Store.open(run).close()  # first, as generate makes it: exchanges without their store are refused
    write_jsonl(run / "exchanges.jsonl", exchanges)
    write_jsonl(run / "reconstructed.jsonl", recs)
    return run


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def _refused(res, *needles: str) -> str:
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _export(src: Path, out: Path | str, *extra: str):
    return _invoke("export", str(src), "-o", str(out), "--format", "specforge", *extra)


@pytest.mark.parametrize("force", [False, True])
def test_export_into_the_run_folder_is_refused(run_dir, force):
    before = snapshot(run_dir)
    res = _export(run_dir / "reconstructed.jsonl", run_dir, *(["--force"] if force else []))
    _refused(res, str(run_dir), "folder of the input")
    assert snapshot(run_dir) == before and not leftovers(run_dir.parent)


def test_export_into_a_folder_holding_a_run_folder_is_refused_even_forced(run_dir, tmp_path):
    src = tmp_path / "elsewhere" / "r.jsonl"
    src.parent.mkdir()
    shutil.copy(run_dir / "reconstructed.jsonl", src)
    before = snapshot(tmp_path)
    _refused(_export(src, tmp_path / "run", "--force"), "is a run folder")
    assert snapshot(tmp_path) == before


def test_export_into_a_user_folder_is_refused(run_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes", encoding="utf-8")
    _refused(_export(run_dir / "reconstructed.jsonl", mine), "not an earlier tokenbridge export", "--force")
    assert snapshot(mine) == {"notes.txt": b"my notes"} and not leftovers(tmp_path)


def test_force_writes_into_a_user_folder_and_keeps_its_entries(run_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes", encoding="utf-8")
    res = _export(run_dir / "reconstructed.jsonl", mine, "--force")
    assert res.exit_code == 0, res.output
    assert sorted(snapshot(mine)) == [".tokenbridge-output", "README.md", "notes.txt", "train.jsonl"]
    assert (mine / "notes.txt").read_bytes() == b"my notes"


def test_export_twice_into_the_same_folder_replaces_its_own_output(run_dir, tmp_path):
    out = tmp_path / "sf"
    assert _export(run_dir / "reconstructed.jsonl", out).exit_code == 0
    first = snapshot(out)
    res = _export(run_dir / "reconstructed.jsonl", out)
    assert res.exit_code == 0, res.output
    assert snapshot(out) == first and not leftovers(tmp_path)


def test_an_export_of_another_format_is_not_replaced_without_force(run_dir, tmp_path):
    """``-o ex --format parquet`` over a SpecForge export replaced it silently (a cold
    tester): a re-export replaces its own format; another one is most likely a mistake."""
    src, out = run_dir / "reconstructed.jsonl", tmp_path / "ex"
    assert _export(src, out).exit_code == 0
    first = snapshot(out)
    res = _invoke("export", str(src), "-o", str(out), "-f", "parquet")
    _refused(res, f"-o {out}: holds a specforge export and this is a parquet export; give another folder "
                  f"(such as {tmp_path / 'parquet'}), or --force to replace it")
    assert snapshot(out) == first and not leftovers(tmp_path)
    res = _invoke("export", str(src), "-o", str(out), "-f", "parquet", "--force")
    assert res.exit_code == 0, res.output
    assert json.loads((out / ".tokenbridge-output").read_text())["format"] == "parquet"


def test_an_export_written_before_markers_counts_as_ours(run_dir, tmp_path):
    out = tmp_path / "sf"
    assert _export(run_dir / "reconstructed.jsonl", out).exit_code == 0
    (out / ".tokenbridge-output").unlink()
    res = _export(run_dir / "reconstructed.jsonl", out)
    assert res.exit_code == 0, res.output


def test_export_into_a_vocab_folder_is_refused(run_dir, tmp_path):
    vocab = tmp_path / "vocab"
    res = _invoke("vocab", str(run_dir / "reconstructed.jsonl"), "-n", "64", "-o", str(vocab),
                  "--target-vocab-size", "163840")
    assert res.exit_code == 0, res.output
    before = snapshot(vocab)
    _refused(_export(run_dir / "reconstructed.jsonl", vocab), "not an earlier tokenbridge export")
    assert snapshot(vocab) == before


def test_export_to_the_current_folder_is_refused(run_dir, tmp_path, monkeypatch):
    cwd = tmp_path / "work"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    _refused(_export(run_dir / "reconstructed.jsonl", ".", "--force"), "the current folder")
    assert list(tmp_path.iterdir()) == [run_dir, cwd] or sorted(tmp_path.iterdir()) == sorted([run_dir, cwd])
    assert not list(cwd.iterdir()) and not leftovers(tmp_path)


def test_export_to_a_parent_of_the_current_folder_is_refused(run_dir, tmp_path, monkeypatch):
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    _refused(_export(run_dir / "reconstructed.jsonl", "..", "--force"), "a parent of the current folder")
    assert cwd.is_dir()


def test_export_to_a_parent_of_the_input_is_refused(run_dir, tmp_path):
    src = tmp_path / "data" / "deep" / "r.jsonl"
    src.parent.mkdir(parents=True)
    shutil.copy(run_dir / "reconstructed.jsonl", src)
    before = snapshot(tmp_path / "data")
    _refused(_export(src, tmp_path / "data", "--force"), "a parent of the input")
    assert snapshot(tmp_path / "data") == before


def test_export_to_home_is_refused(run_dir, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export X=1\n", encoding="utf-8")
    monkeypatch.setenv("HOME", str(home))
    _refused(_export(run_dir / "reconstructed.jsonl", home, "--force"), "your home folder")
    assert snapshot(home) == {".bashrc": b"export X=1\n"}


def test_export_onto_a_file_is_refused(run_dir, tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("keep", encoding="utf-8")
    _refused(_export(run_dir / "reconstructed.jsonl", target, "--force"), "is not a folder")
    assert target.read_text(encoding="utf-8") == "keep"


def test_vocab_into_a_user_folder_is_refused(run_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "d2t.npy").write_bytes(b"not ours")
    (mine / "other.bin").write_bytes(b"user data")
    res = _invoke("vocab", str(run_dir / "reconstructed.jsonl"), "-n", "64", "-o", str(mine),
                  "--target-vocab-size", "163840")
    _refused(res, "not an earlier tokenbridge vocab")
    assert snapshot(mine) == {"d2t.npy": b"not ours", "other.bin": b"user data"}


@pytest.mark.parametrize("force", [False, True])
def test_vocab_into_the_tokenizer_folder_it_reads_is_refused(run_dir, tmp_path, kimi_dir, force):
    """``reconstruct -o`` inside the tokenizer folder was refused, ``vocab -o`` wrote there."""
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(kimi_dir, tok)
    before = snapshot(tok)
    res = _invoke("vocab", str(run_dir / "reconstructed.jsonl"), "-n", "64", "-o", str(tok / "vocab"), "-t", str(tok),
                  *(["--force"] if force else []))
    _refused(res, f"lies in the input folder {tok}")
    assert snapshot(tok) == before


def test_vocab_into_the_run_folder_is_refused(run_dir):
    before = snapshot(run_dir)
    res = _invoke("vocab", str(run_dir / "reconstructed.jsonl"), "-n", "64", "-o", str(run_dir),
                  "--target-vocab-size", "163840", "--force")
    _refused(res, "folder of the input")
    assert snapshot(run_dir) == before


def test_report_over_a_user_report_folder_is_refused_unless_forced(run_dir):
    (run_dir / "report").mkdir()
    (run_dir / "report" / "slides.pdf").write_bytes(b"%PDF mine")
    before = snapshot(run_dir)
    _refused(_invoke("report", str(run_dir)), "not an earlier tokenbridge report")
    assert snapshot(run_dir) == before
    res = _invoke("report", str(run_dir), "--force")
    assert res.exit_code == 0, res.output
    assert sorted(snapshot(run_dir / "report")) == [".tokenbridge-output", "report.html", "report.json", "slides.pdf"]
    assert (run_dir / "report" / "slides.pdf").read_bytes() == b"%PDF mine"  # --force writes in, never destroys


def test_reconstruct_onto_its_input_is_refused(run_dir, kimi_dir):
    src = run_dir / "exchanges.jsonl"
    before = src.read_bytes()
    res = _invoke("reconstruct", str(src), "-o", str(src), "-t", str(kimi_dir))
    _refused(res, "is the input file")
    assert src.read_bytes() == before


def test_reconstruct_onto_a_symlink_to_its_input_is_refused(run_dir, tmp_path, kimi_dir):
    src = run_dir / "exchanges.jsonl"
    before = src.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(src)
    _refused(_invoke("reconstruct", str(src), "-o", str(tmp_path / "link.jsonl"), "-t", str(kimi_dir)),
             "is the input file")
    assert src.read_bytes() == before and (tmp_path / "link.jsonl").is_symlink()


def test_reconstruct_onto_a_hard_link_of_its_input_is_refused(run_dir, tmp_path, kimi_dir):
    src = run_dir / "exchanges.jsonl"
    before = src.read_bytes()
    os.link(src, tmp_path / "hard.jsonl")
    _refused(_invoke("reconstruct", str(src), "-o", str(tmp_path / "hard.jsonl"), "-t", str(kimi_dir)),
             "is the input file")
    assert src.read_bytes() == before


def test_reconstruct_to_the_current_folder_is_one_line(run_dir, tmp_path, kimi_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(_invoke("reconstruct", str(run_dir / "exchanges.jsonl"), "-o", ".", "-t", str(kimi_dir)), "is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not leftovers(tmp_path)


# --- the run folder's lock -----------------------------------------------------------------


def test_the_run_lock_is_reentrant_within_one_process(tmp_path):
    from tokenbridge.generate.lock import run_lock

    with run_lock(tmp_path, command="run"), run_lock(tmp_path):  # run holds it; its generate re-enters
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()} tokenbridge run\n"
    with run_lock(tmp_path):  # released once the outermost holder is done
        pass


def test_a_run_folder_the_lock_made_and_left_holding_only_the_lock_is_removed(tmp_path):
    """A run that failed before writing anything (a prompt file it could not read) left the
    folder it had made holding only ``.lock``; the parents it made go too, when empty."""
    from tokenbridge.generate.lock import run_lock

    run = tmp_path / "a" / "b" / "run"
    with pytest.raises(RuntimeError), run_lock(run, command="run"):
        assert os.listdir(run) == [".lock"]
        raise RuntimeError("the command failed")
    assert os.listdir(tmp_path) == []
    with run_lock(run):  # and after a clean end alike
        pass
    assert os.listdir(tmp_path) == []


def test_a_run_folder_the_lock_made_is_kept_once_anything_is_in_it(tmp_path):
    from tokenbridge.generate.lock import run_lock

    run = tmp_path / "a" / "run"
    with run_lock(run):
        (tmp_path / "a" / "mine.txt").write_text("the user's")  # beside it: the parent stays too
        (run / "state.sqlite").write_bytes(b"")
    assert sorted(os.listdir(run)) == [".lock", "state.sqlite"] and (tmp_path / "a" / "mine.txt").exists()
    shutil.rmtree(run)
    with run_lock(run):
        pass
    assert os.listdir(tmp_path / "a") == ["mine.txt"]  # the run folder went, the user's parent stays


def test_a_folder_the_user_made_is_never_removed(tmp_path):
    from tokenbridge.generate.lock import run_lock

    run = tmp_path / "run"
    run.mkdir()
    with run_lock(run):
        pass
    assert os.listdir(run) == [".lock"]  # as before: the lock of a run killed before its store is ours


def test_a_lock_file_deleted_between_open_and_lock_is_not_held(tmp_path, monkeypatch):
    """The holder that made the folder deletes the lock file as it leaves; a process that
    opened that file just before locks an unlinked file: it must start over, or two
    processes would each hold "the" lock of one folder."""
    import fcntl

    import tokenbridge.generate.lock as lock

    real_flock, calls = fcntl.flock, []

    def flock_after_unlink(fd, op):
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:  # the first holder leaves between this process's open and its lock
            os.unlink(tmp_path / "run" / ".lock")
        return real_flock(fd, op)

    monkeypatch.setattr(lock.fcntl, "flock", flock_after_unlink)
    with lock.run_lock(tmp_path / "run"):
        held = os.stat(tmp_path / "run" / ".lock").st_ino
        assert len(calls) == 2 and calls[1] == held
        other = os.open(tmp_path / "run" / ".lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # the file at the path is the one locked
                real_flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    assert os.listdir(tmp_path) == []  # made on its first try, still this process's to remove


def test_a_stage_writing_into_a_busy_run_folder_is_refused(run_dir):
    import subprocess
    import sys

    from outputs_support import SRC

    hold = ("import sys\nfrom tokenbridge.generate.lock import run_lock\n"
            "with run_lock(sys.argv[1], command='run'):\n    print('locked', flush=True)\n    sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = _export(run_dir / "reconstructed.jsonl", run_dir / "export" / "specforge")
    finally:
        holder.communicate("")
    assert res.exit_code == 7, res.output
    assert res.output.strip().splitlines() == [
        f"error: {run_dir.resolve()}: run folder in use by pid {holder.pid} (another tokenbridge process: "
        "tokenbridge run); wait for it to finish or write outside that run folder"
    ]
    assert not (run_dir / "export").exists()


def test_force_into_a_folder_of_exports_replaces_only_that_format(run_dir):
    """``-o RUN/export --force`` for one format: that format's folder is replaced, its siblings kept byte for byte."""
    exports = run_dir / "export"
    src = run_dir / "reconstructed.jsonl"
    for fmt in ("specforge", "parquet"):
        res = _invoke("export", str(src), "-o", str(exports / fmt), "--format", fmt)
        assert res.exit_code == 0, res.output
    (exports / "specforge" / "train.jsonl").write_text("stale\n", encoding="utf-8")
    parquet = snapshot(exports / "parquet")
    res = _export(src, exports, "--force")
    assert res.exit_code == 0, res.output
    assert f"→ {exports / 'specforge'} [specforge]" in res.output  # the folder written, not the one asked for
    assert sorted(p.name for p in exports.iterdir()) == ["parquet", "specforge"]
    assert snapshot(exports / "parquet") == parquet
    assert sorted(snapshot(exports / "specforge")) == [".tokenbridge-output", "README.md", "train.jsonl"]
    assert (exports / "specforge" / "train.jsonl").read_bytes().count(b"\n") == sum(r["status"] == "ok" for r in _rows(src))
    assert not leftovers(run_dir)


def _rows(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_reconstruct_onto_a_write_protected_file_is_refused(run_dir, tmp_path, kimi_dir):
    """A cold tester's: the output is renamed over its target, which bypassed the file's own
    write permission (0444, or another user's file in a folder anyone may write): the file was
    gone with exit 1. Refused before any work; a writable file of the user's is still replaced."""
    mine = tmp_path / "keep.jsonl"
    mine.write_bytes(b"precious\n")
    mine.chmod(0o444)
    try:
        line = _refused(_invoke("reconstruct", str(run_dir / "exchanges.jsonl"), "-o", str(mine), "-t", str(kimi_dir)),
                        "is write-protected (mode 0444)", "make it writable")
        assert str(mine) in line
        assert mine.read_bytes() == b"precious\n" and not leftovers(tmp_path)
        mine.chmod(0o644)
        res = _invoke("reconstruct", str(run_dir / "exchanges.jsonl"), "-o", str(mine), "-t", str(kimi_dir))
        assert res.exit_code == 0, res.output
        other = tmp_path / "other.jsonl"
        assert _invoke("reconstruct", str(run_dir / "exchanges.jsonl"), "-o", str(other), "-t", str(kimi_dir)).exit_code == 0
        assert mine.read_bytes() == other.read_bytes()
    finally:
        mine.chmod(0o644)


@pytest.mark.parametrize("mode", [0o700, 0o2750, 0o550])
def test_a_rewritten_output_folder_keeps_the_folders_mode_and_group(run_dir, tmp_path, mode):
    """A cold tester's: the folder is replaced by a new one in one step, and the new one had
    this process's umask and group, so a folder the user made private (0700) came back 0755,
    its files listable by everyone (and a group's setgid folder lost both)."""
    import grp

    out = tmp_path / "private"
    out.mkdir()
    notes = mode & 0o200  # a folder its owner may not write holds nothing of theirs to carry (empty, as made)
    if notes:
        (out / "notes.txt").write_bytes(b"secret\n")
    gid = os.getgid() if os.getuid() else grp.getgrnam("nogroup").gr_gid  # root may hand it to another group
    os.chown(out, -1, gid)
    out.chmod(mode)
    for _ in range(2):  # into the user's folder, then over tokenbridge's own output (its old files cleared)
        res = _export(run_dir / "reconstructed.jsonl", out, "--force")
        assert res.exit_code == 0, res.output
        info = out.stat()
        assert (oct(info.st_mode & 0o7777), info.st_gid) == (oct(mode | 0o700), gid)  # the owner's rwx kept
        assert (out / "train.jsonl").exists() and not leftovers(tmp_path)
        assert not notes or (out / "notes.txt").read_bytes() == b"secret\n"

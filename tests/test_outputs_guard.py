"""Every output path is checked before any work, and nothing the user owns is replaced.

* ``reconstruct --summary-json`` naming the input, the ``-o`` output or a folder is refused
  before anything is written (it used to replace the input with the summary);
* a file output naming a FIFO or a device node (or a symlink to one, or to nothing) is
  refused by :func:`tokenbridge.fsio.output_file`, which every single-file writer passes;
  a symlink to a regular file is written through and kept;
* ``run``'s ``[run] out`` must be missing, empty or an earlier run's folder, never ``/``,
  a system folder or ``$HOME`` (it used to write a run's files into any folder).

Each refusal: exit 2, one ``error:`` line, and the user's files byte-identical.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import EXAMPLE_EXCHANGES, write_run_config
from outputs_support import leftovers, snapshot
from test_outputs_safety import _invoke
from tokenbridge.cli import app
from tokenbridge.fsio import OutputRefused, staged_file, write_text
from tokenbridge.outdir import is_own_run_folder, run_folder_problem
from tokenbridge.pipeline import PipelineError, load_run_config, run_pipeline

_FIFO = "is a named pipe (FIFO), not a regular file; refusing to replace it: give a file name"


@pytest.fixture
def src(tmp_path) -> Path:
    """The README's seven good exchange records (no bad line: reconstruct exits 0)."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(EXAMPLE_EXCHANGES.read_text(encoding="utf-8").splitlines(keepends=True)[:7]),
                    encoding="utf-8")
    return path


def _reconstruct(src: Path, out: Path, kimi_dir: Path, *extra: str):
    return _invoke("reconstruct", str(src), "-o", str(out), "-t", str(kimi_dir), *extra)


def _refused_with(res, line: str) -> None:
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.output
    assert res.output.splitlines() == [f"error: {line}"]


def _fifo(path: Path) -> tuple[int, int]:
    os.mkfifo(path)
    return os.lstat(path).st_ino, os.lstat(path).st_mode


# --- 1. reconstruct --summary-json ---------------------------------------------------------


@pytest.mark.parametrize("how", ["path", "symlink", "hard link"])
def test_summary_json_naming_the_input_is_refused_before_any_work(src, tmp_path, kimi_dir, how):
    summary = {"path": src, "symlink": tmp_path / "link.json", "hard link": tmp_path / "hard.json"}[how]
    if how == "symlink":
        summary.symlink_to(src)
    elif how == "hard link":
        os.link(src, summary)
    before = snapshot(tmp_path)
    _refused_with(_reconstruct(src, tmp_path / "rec.jsonl", kimi_dir, "--summary-json", str(summary)),
                  f"--summary-json {summary}: is the input file; give another output name")
    assert snapshot(tmp_path) == before and not (tmp_path / "rec.jsonl").exists()
    assert how != "symlink" or summary.is_symlink()


def test_summary_json_naming_the_output_is_refused(src, tmp_path, kimi_dir):
    rec = tmp_path / "rec.jsonl"
    assert _reconstruct(src, rec, kimi_dir).exit_code == 0
    before = snapshot(tmp_path)
    _refused_with(_reconstruct(src, rec, kimi_dir, "--summary-json", str(rec)),
                  f"--summary-json {rec}: is also the -o output; give another name")
    assert snapshot(tmp_path) == before


def test_summary_json_naming_a_folder_is_refused_before_the_output_is_written(src, tmp_path, kimi_dir):
    folder = tmp_path / "d"
    folder.mkdir()
    _refused_with(_reconstruct(src, tmp_path / "rec.jsonl", kimi_dir, "--summary-json", str(folder)),
                  f"--summary-json {folder}: is a folder; give a file name such as {folder / 'summary.json'}")
    assert sorted(os.listdir(tmp_path)) == ["d", "in.jsonl"] and not os.listdir(folder)


def test_summary_json_to_a_new_file_then_over_its_own_previous_outputs(src, tmp_path, kimi_dir):
    rec, summary = tmp_path / "rec.jsonl", tmp_path / "summary.json"
    first = _reconstruct(src, rec, kimi_dir, "--summary-json", str(summary))
    assert first.exit_code == 0, first.output
    rows, doc = rec.read_bytes(), json.loads(summary.read_text(encoding="utf-8"))
    assert doc["status"] == {"ok": 4, "flagged": 1, "rejected": 2} and len(rows.splitlines()) == 7
    again = _reconstruct(src, rec, kimi_dir, "--summary-json", str(summary))
    assert again.exit_code == 0, again.output
    assert rec.read_bytes() == rows and json.loads(summary.read_text(encoding="utf-8")) == doc
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "rec.jsonl", "summary.json"]


# --- 2. outputs that are not regular files ---------------------------------------------------


@pytest.mark.parametrize("flag", ["-o", "--summary-json"])
def test_an_output_that_is_a_fifo_is_refused_before_any_work(src, tmp_path, kimi_dir, flag):
    fifo = tmp_path / "pipe"
    made = _fifo(fifo)
    out, extra = (fifo, ()) if flag == "-o" else (tmp_path / "rec.jsonl", ("--summary-json", str(fifo)))
    _refused_with(_reconstruct(src, out, kimi_dir, *extra), f"{flag} {fifo}: {_FIFO}")
    assert (os.lstat(fifo).st_ino, os.lstat(fifo).st_mode) == made and stat.S_ISFIFO(made[1])
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "pipe"]


def test_an_output_that_is_a_device_node_is_refused(src, tmp_path, kimi_dir):
    node = tmp_path / "null"  # a /dev/null of our own: the real one is never put at risk
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs CAP_MKNOD")
    made = os.lstat(node)
    _refused_with(_reconstruct(src, node, kimi_dir),
                  f"-o {node}: is a character device, not a regular file; refusing to replace it: give a file name")
    after = os.lstat(node)
    assert (after.st_ino, after.st_mode, after.st_rdev) == (made.st_ino, made.st_mode, made.st_rdev)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "null"]


@pytest.mark.parametrize("to", ["fifo", "nothing"])
def test_a_symlink_to_a_fifo_or_to_nothing_is_refused(src, tmp_path, kimi_dir, to):
    link = tmp_path / "out.jsonl"
    if to == "fifo":
        _fifo(tmp_path / "pipe")
        link.symlink_to(tmp_path / "pipe")
        why = f"is a symlink to {(tmp_path / 'pipe').resolve()}, a named pipe (FIFO); refusing to replace it"
    else:
        link.symlink_to(tmp_path / "missing.jsonl")
        why = "is a symlink to a missing file (or a loop); refusing to write through it"
    _refused_with(_reconstruct(src, link, kimi_dir), f"-o {link}: {why}: give a file name")
    assert link.is_symlink() and not leftovers(tmp_path)
    assert to == "nothing" or stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)


def test_a_symlink_to_a_regular_file_is_written_through_and_kept(src, tmp_path, kimi_dir):
    (tmp_path / "real").mkdir()
    real, link, plain = tmp_path / "real" / "rec.jsonl", tmp_path / "link.jsonl", tmp_path / "plain.jsonl"
    real.write_text("an older output\n", encoding="utf-8")
    link.symlink_to(real)
    assert _reconstruct(src, link, kimi_dir).exit_code == 0
    assert _reconstruct(src, plain, kimi_dir).exit_code == 0
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() == plain.read_bytes() and not leftovers(tmp_path)


def test_every_file_writer_refuses_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    made = _fifo(fifo)
    with pytest.raises(OutputRefused) as caught:
        write_text(fifo, "x")
    assert str(caught.value) == f"{fifo}: {_FIFO}"
    with pytest.raises(OutputRefused, match=r"is a named pipe \(FIFO\)"), staged_file(fifo):
        pytest.fail("a staged file onto a FIFO was started")
    assert (os.lstat(fifo).st_ino, os.lstat(fifo).st_mode) == made and os.listdir(tmp_path) == ["pipe"]


def test_generate_summary_json_onto_a_fifo_is_one_line(tmp_path):
    """Another command writing single files (through fsio.write_text): the FIFO is kept."""
    prompts, fifo = tmp_path / "p.jsonl", tmp_path / "pipe"
    prompts.write_text('{"prompt": "hi"}\n', encoding="utf-8")
    made = _fifo(fifo)
    res = CliRunner().invoke(app, ["generate", str(prompts), "--out", str(tmp_path / "run"), "--model", "m",
                                   "--dry-run", "--summary-json", str(fifo)])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:") or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: --summary-json {fifo}: "), res.output
    assert errors[0].endswith(_FIFO)
    assert (os.lstat(fifo).st_ino, os.lstat(fifo).st_mode) == made


def test_generate_checks_its_outputs_before_any_request(tmp_path):
    """generate wrote exchanges.jsonl and its store into any folder, and checked
    --summary-json only after the (paid) generation: both are refused before a request."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n', encoding="utf-8")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "exchanges.jsonl").write_bytes(b"my exchanges\n")
    unreachable = ["--model", "m", "--base-url", "http://127.0.0.1:9/v1"]  # a request would fail, not hang
    res = CliRunner().invoke(app, ["generate", str(prompts), "--out", str(mine), *unreachable])
    assert res.exit_code == 2 and res.output.strip() == (
        f"error: --out {mine}: folder is not empty and is not a tokenbridge run folder (no state.sqlite or .lock of "
        "an earlier run); nothing was written: give a new or empty folder")
    assert os.listdir(mine) == ["exchanges.jsonl"] and (mine / "exchanges.jsonl").read_bytes() == b"my exchanges\n"
    res = CliRunner().invoke(app, ["generate", str(prompts), "--out", str(tmp_path / "run"), *unreachable,
                                   "--summary-json", str(tmp_path)])
    assert res.exit_code == 2 and res.output.strip() == (
        f"error: --summary-json {tmp_path}: is a folder; give a file name such as {tmp_path / 'summary.json'}")
    assert not (tmp_path / "run").exists()


# --- 3. run's [run] out ---------------------------------------------------------------------


_USER_FILES = {"exchanges.jsonl": b"my exchanges\n", "reconstructed.jsonl": b"my rows\n", "pipeline.json": b"{}\n"}


@pytest.mark.parametrize("extra", [{}, {"state.sqlite": b"my notes, not a database\n"}])
def test_run_into_a_user_folder_is_refused_before_anything_is_written(tmp_path, kimi_dir, extra):
    cfg = write_run_config(tmp_path, kimi_dir)
    out = load_run_config(cfg).out
    out.mkdir()
    for name, data in {**_USER_FILES, **extra}.items():
        (out / name).write_bytes(data)
    names = sorted(os.listdir(out))
    res = CliRunner().invoke(app, ["run", str(cfg)])
    why = (f"{out / 'state.sqlite'}: not a usable tokenbridge state file (not an SQLite database)" if extra else
           f"{out}: folder is not empty and is not a tokenbridge run folder (no state.sqlite or .lock of an earlier run)")
    _refused_with(res, f"{cfg}:3: run.out: {why}; nothing was written: give a new or empty folder")
    assert snapshot(out) == {**_USER_FILES, **extra} and sorted(os.listdir(out)) == names  # no .lock either
    with pytest.raises(PipelineError, match="not a usable tokenbridge state file" if extra else
                       "is not a tokenbridge run folder") as caught:  # the API too
        run_pipeline(load_run_config(cfg), echo=lambda _: None)
    assert caught.value.code == 2 and sorted(os.listdir(out)) == names


def test_run_into_the_tokenizer_folder_is_refused_as_the_standalone_commands_refuse_it(tmp_path, kimi_dir):
    """With ``out`` inside the tokenizer folder the run wrote vocab/, export/... into it,
    where ``vocab`` and ``reconstruct`` alone refuse (a cold tester)."""
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (tok / name).symlink_to(kimi_dir / name)
    cfg = write_run_config(tmp_path, tok)
    cfg.write_text(cfg.read_text().replace('out = "out"', 'out = "tok/run"'), encoding="utf-8")
    before = sorted(os.listdir(tok))
    res = CliRunner().invoke(app, ["run", str(cfg)])
    _refused_with(res, f"{cfg}:3: run.out: {tmp_path / 'tok' / 'run'}: lies in the input folder {tok}; "
                       "give a folder outside it")
    assert sorted(os.listdir(tok)) == before


@pytest.mark.parametrize(("out", "what"), [("/", "the root folder"), ("/etc", "a system folder"),
                                           ("HOME", "your home folder")])
def test_run_into_the_root_a_system_folder_or_home_is_refused(tmp_path, kimi_dir, monkeypatch, out, what):
    import tokenbridge.generate.lock as lock

    def no_lock(*_a: object, **_k: object) -> None:
        raise AssertionError("the run went on to lock (and write into) its folder")

    monkeypatch.setattr(lock, "run_lock", no_lock)  # a regression must not write into / or /etc
    if out == "HOME":
        home = tmp_path / "home"
        home.mkdir()
        (home / ".lock").write_bytes(b"1 tokenbridge run\n")  # even when it looks like a run folder
        monkeypatch.setenv("HOME", str(home))
        out = str(home)
    cfg = write_run_config(tmp_path, kimi_dir)
    cfg.write_text(cfg.read_text(encoding="utf-8").replace('out = "out"', f'out = "{out}"'), encoding="utf-8")
    _refused_with(CliRunner().invoke(app, ["run", str(cfg)]),
                  f"{cfg}:3: run.out: {out}: refusing to write a run into {what}; give a new or empty folder")


def test_run_starts_in_an_empty_folder_and_resumes_its_own(tmp_path, kimi_dir):
    cfg = write_run_config(tmp_path, kimi_dir)
    cfg.write_text(cfg.read_text(encoding="utf-8").replace("limit = 12", "limit = 2").replace("limit = 4", "limit = 1"),
                   encoding="utf-8")
    out = load_run_config(cfg).out
    out.mkdir()
    first = {r.name: r.status for r in run_pipeline(load_run_config(cfg), echo=lambda _: None)}
    assert set(first.values()) == {"ran"} and is_own_run_folder(out)
    res = CliRunner().invoke(app, ["run", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "done: generate ran, reconstruct skipped, export:specforge skipped" in res.output
    # a FIFO where the run keeps exchanges.jsonl: reading it to compare would hang, replacing it destroys it
    (out / "exchanges.jsonl").unlink()
    made = _fifo(out / "exchanges.jsonl")
    res = CliRunner().invoke(app, ["run", str(cfg)])
    assert res.exit_code == 6, res.output
    assert f"{out / 'exchanges.jsonl'} not rewritten: {out / 'exchanges.jsonl'}: {_FIFO}" in " ".join(res.output.split())
    assert (os.lstat(out / "exchanges.jsonl").st_ino, os.lstat(out / "exchanges.jsonl").st_mode) == made


def _store_folder(folder: Path, lock: bool) -> Path:
    """A run folder holding one store of one run (and tokenbridge's lock file, or not)."""
    from tokenbridge.generate.store import Store

    with Store.open(folder) as store:
        store.begin_run({"seed": 1})
    if lock:
        (folder / ".lock").write_bytes(b"4242 tokenbridge run\n")
    return folder


def _full_disk(monkeypatch) -> None:
    """What SQLite says when a read-only open must grow ``-shm`` on a full disk (a cold
    tester's 12 MB tmpfs): SQLITE_IOERR_SHMSIZE, "disk I/O error"."""
    import sqlite3

    from tokenbridge import outdir

    def full(path):
        exc = sqlite3.OperationalError("disk I/O error")
        exc.sqlite_errorcode, exc.sqlite_errorname = 4874, "SQLITE_IOERR_SHMSIZE"
        raise exc

    monkeypatch.setattr(outdir, "open_read_only", full)


def test_a_store_that_cannot_be_read_now_is_never_called_not_a_store(tmp_path, kimi_dir, monkeypatch):
    """A full disk made ``run`` call a healthy store "not an SQLite database" and advise a new
    folder, away from every answer paid for. Read-only, the store cannot be told now: in a
    folder tokenbridge's lock marks as a run's it is let through (writing to it then fails as
    the disk error it is, exit 6); without the lock the refusal says to keep it."""
    from tokenbridge.outdir import store_kind, store_problem

    cfg = write_run_config(tmp_path, kimi_dir)
    out = _store_folder(load_run_config(cfg).out, lock=False)
    before = snapshot(out)
    _full_disk(monkeypatch)
    assert store_kind(out / "state.sqlite") == "unreadable" and store_problem(out / "state.sqlite") is None
    res = CliRunner().invoke(app, ["run", str(cfg)])
    _refused_with(res, f"{cfg}:3: run.out: {out / 'state.sqlite'}: cannot be read now (disk I/O error); nothing was "
                       "written: the file may be a run's store holding answers already paid for, so keep this "
                       "folder: free disk space, or wait for the program that holds the file, and run the same "
                       "command again")
    assert snapshot(out) == before
    (out / ".lock").write_bytes(b"4242 tokenbridge run\n")
    assert is_own_run_folder(out) and run_folder_problem(out) is None
    monkeypatch.undo()
    assert store_kind(out / "state.sqlite") == "tokenbridge"  # the disk freed: the same file, a store


def test_a_damaged_store_is_not_called_not_a_database(tmp_path):
    """SQLite's own "malformed": a damaged store may still hold paid answers; the refusal
    says to keep it (and how to read it), not that it is no database."""
    out = _store_folder(tmp_path / "run", lock=True)
    data = bytearray((out / "state.sqlite").read_bytes())
    data[100:4096] = b"\xff" * 3996  # the first page's b-tree (sqlite_master), the header kept
    (out / "state.sqlite").write_bytes(bytes(data))
    assert not is_own_run_folder(out)
    assert run_folder_problem(out) == (
        f"{out / 'state.sqlite'}: an SQLite database that SQLite reads as damaged (database disk image is malformed); "
        "nothing was written: if it is a run's store it holds answers already paid for: keep it (sqlite3's .recover "
        "can read what is left of it) and give this run a new or empty folder")


@pytest.mark.parametrize(("files", "ours"), [
    ({"state.sqlite": b"SQLite format 3\x00..."}, False),  # the header alone: not a database, not ours
    ({".lock": b"4242 tokenbridge run\n"}, True),  # killed before its store existed
    (_USER_FILES, False),
    ({"state.sqlite": b"my notes"}, False),
    ({".lock": b""}, False),
    ({".lock": b"my lock file\n"}, False),
])
def test_what_marks_a_run_folder(tmp_path, files, ours):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert is_own_run_folder(tmp_path) is ours
    why = None if ours else (
        f"{tmp_path / 'state.sqlite'}: not a usable tokenbridge state file (not an SQLite database); nothing was "
        "written: give a new or empty folder" if "state.sqlite" in files else
        f"{tmp_path}: folder is not empty and is not a tokenbridge run folder (no state.sqlite or .lock of an "
        "earlier run); nothing was written: give a new or empty folder")
    assert run_folder_problem(tmp_path) == why


def test_a_fifo_named_like_a_marker_is_not_opened(tmp_path):
    _fifo(tmp_path / "state.sqlite")  # opening it would block
    _fifo(tmp_path / ".lock")
    assert not is_own_run_folder(tmp_path)
    assert run_folder_problem(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert run_folder_problem(tmp_path / "empty") is None
    (tmp_path / "file").write_text("x", encoding="utf-8")
    assert run_folder_problem(tmp_path / "file") == f"{tmp_path / 'file'}: exists and is not a folder; " \
                                                    "give a new or empty folder"


def test_run_exits_1_and_names_what_generate_left_behind(tmp_path, kimi_dir):
    """run exited 0 when every sample failed or prompt rows were bad, and printed only a
    count: now each, as generate alone does, is exit 1 with the first rows named."""
    cfg = write_run_config(tmp_path, kimi_dir)
    text = cfg.read_text(encoding="utf-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": ""}\n', encoding="utf-8")
    cfg.write_text(text.replace('  { name = "chat", path = "builtin:prompts/chat.jsonl", limit = 12 },\n', "")
                   .replace('{ name = "plain", path = "builtin:prompts/plain.jsonl", limit = 4 }',
                            f'{{ name = "p", path = "{bad}" }}'), encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(cfg)])
    assert res.exit_code == 1, res.output
    assert f"generate: bad row: {bad}: line 2: field 'prompt'" in res.output and "done: generate ran" in res.output
    again = CliRunner().invoke(app, ["run", str(cfg)])  # nothing new, still incomplete
    assert again.exit_code == 1, again.output
    failing = tmp_path / "failing"
    failing.mkdir()
    cfg2 = write_run_config(failing, kimi_dir, "")
    cfg2.write_text(cfg2.read_text(encoding="utf-8").replace("latency_ms = 0", "latency_ms = 0\nfault_rate = 1.0")
                    .replace("progress = \"none\"", "progress = \"none\"\nmax_attempts = 1")
                    .replace("limit = 12", "limit = 2").replace("limit = 4", "limit = 1"), encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(cfg2)])
    assert res.exit_code == 1, res.output
    assert "generate: failed: " in res.output


def test_an_output_folder_given_as_a_symlink_is_refused_naming_the_folder(tmp_path):
    """An export replaces its folder whole, so a symlink there would be swapped out, not
    followed: refused, but saying so (it said "exists and is not a folder")."""
    from tokenbridge.outdir import OutputRefused, check_output_dir

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OutputRefused) as err:
        check_output_dir(tmp_path / "link", "export")
    assert str(err.value) == (f"-o {tmp_path / 'link'}: is a symbolic link (to {tmp_path / 'real'}); give the folder "
                              f"itself ({(tmp_path / 'real').resolve()}) or a new one")


def test_an_output_under_a_file_says_a_parent_is_a_file(src, tmp_path, kimi_dir):
    """A parent that is a file read "cannot write (File exists)" (or "Not a directory"), after
    the work: mkdir's words for what it met. It is refused before any work, naming the file."""
    afile = tmp_path / "afile"
    afile.write_bytes(b"mine\n")
    why = f"its parent {afile} is a regular file, not a folder"
    _refused_with(_reconstruct(src, afile / "r.jsonl", kimi_dir), f"-o {afile / 'r.jsonl'}: {why}; give a path inside a "
                                                                    "folder")
    _refused_with(_reconstruct(src, afile / "sub" / "r.jsonl", kimi_dir),
                  f"-o {afile / 'sub' / 'r.jsonl'}: {why}; give a path inside a folder")
    rows = tmp_path / "rows.jsonl"
    assert _reconstruct(src, rows, kimi_dir).exit_code == 0
    _refused_with(CliRunner().invoke(app, ["export", str(rows), "-o", str(afile / "x"), "-f", "specforge"]),
                  f"-o {afile / 'x'}: {why}; give a path inside a folder")
    _refused_with(CliRunner().invoke(app, ["generate", "--out", str(afile / "run"), "--base-url",
                                           "http://127.0.0.1:9/api/v1", "--model", "m", str(src)]),
                  f"--out {afile / 'run'}: {why}; give a new or empty folder")
    assert afile.read_bytes() == b"mine\n"
    from tokenbridge.fsio import OutputWriteError, write_text

    with pytest.raises(OutputWriteError) as caught:  # the writer itself, where nothing checked first
        write_text(afile / "f.txt", "x")
    assert str(caught.value) == f"{afile / 'f.txt'}: cannot write ({why}); nothing partial was kept"


@pytest.mark.parametrize(("stage", "name"), [("export", "README.md"), ("export", ".tokenbridge-output"),
                                             ("vocab", "vocab.json"), ("vocab", ".tokenbridge-output"),
                                             ("report", "report.json")])
def test_a_fifo_where_an_output_folder_keeps_its_sign_never_hangs_a_command(src, tmp_path, kimi_dir, stage, name):
    """A marker, a pre-marker export's dataset card or a legacy summary replaced by a FIFO was
    read with ``read_text``, which waits for a writer: the command hung for good. The folder
    is now read as not tokenbridge's, without opening the FIFO for long, and the FIFO is kept."""
    import subprocess
    import sys

    rows = tmp_path / "run" / "reconstructed.jsonl"
    rows.parent.mkdir()
    assert _reconstruct(src, rows, kimi_dir).exit_code == 0
    folder = tmp_path / "run" / "report" if stage == "report" else tmp_path / "out"
    folder.mkdir()
    before = _fifo(folder / name)
    args = {"export": ["export", str(rows), "-o", str(folder), "-f", "specforge"],
            "vocab": ["vocab", str(rows), "-n", "10", "-o", str(folder), "-t", str(kimi_dir)],
            "report": ["report", str(tmp_path / "run")]}[stage]
    done = subprocess.run([sys.executable, "-c", "from tokenbridge.cli import app; app()", *args], capture_output=True,
                          text=True, timeout=120)  # a hang fails here, not the whole suite
    assert done.returncode == 2, done.stderr
    assert ("is a named pipe (FIFO), where tokenbridge keeps the file that marks its output" if name.startswith(".")
            else "folder is not empty and is not an earlier tokenbridge") in done.stderr
    assert (os.lstat(folder / name).st_ino, os.lstat(folder / name).st_mode) == before


def test_reading_a_small_file_refuses_what_is_no_regular_file_at_once(tmp_path):
    from tokenbridge.fsio import read_small_text

    _fifo(tmp_path / "pipe")
    with pytest.raises(OSError, match=r"is a named pipe \(FIFO\), not a regular file"):
        read_small_text(tmp_path / "pipe")
    with pytest.raises(OSError, match="is a folder"):
        read_small_text(tmp_path)
    (tmp_path / "f").write_bytes("ab€".encode())
    assert (read_small_text(tmp_path / "f"), read_small_text(tmp_path / "f", 3)) == ("ab€", "ab")  # a cut character left out


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_where_the_marker_goes_is_refused_before_any_work(src, tmp_path, kimi_dir, force):
    """A user's folder named ``.tokenbridge-output`` in an export's folder failed the write at
    the end (exit 1, "File exists", naming nothing); an empty one was replaced by the marker."""
    rows = tmp_path / "rows.jsonl"
    assert _reconstruct(src, rows, kimi_dir).exit_code == 0
    out = tmp_path / "out"
    assert _invoke("export", str(rows), "-o", str(out), "-f", "specforge").exit_code == 0
    (out / ".tokenbridge-output").unlink()
    (out / ".tokenbridge-output").mkdir()
    before = snapshot(out)
    res = _invoke("export", str(rows), "-o", str(out), "-f", "specforge", *(["--force"] if force else []))
    _refused_with(res, f"-o {out}: {out / '.tokenbridge-output'} is a folder, where tokenbridge keeps the file that "
                       "marks its output; nothing was written: move it away or give another folder")
    assert snapshot(out) == before


def test_dev_stdout_on_a_pipe_is_named_a_pipe(kimi_dir):
    """``-o /dev/stdout`` with stdout a pipe was "a symlink to a missing file (or a loop)":
    the kernel follows that link to a pipe no path names (a cold tester's)."""
    from outputs_support import cli

    res = cli("reconstruct", str(EXAMPLE_EXCHANGES), "-o", "/dev/stdout", "-t", str(kimi_dir))  # stdout: a pipe
    assert res.returncode == 2 and res.stderr.splitlines() == [
        "error: -o /dev/stdout: is a symlink to /proc/self/fd/1, a named pipe (FIFO); refusing to replace it: give a "
        "file name"]


def test_dev_stdout_to_a_deleted_file_is_refused_as_a_link_to_nothing(tmp_path, kimi_dir):
    """The kernel's link names a deleted file no path reaches: refused as before, not
    written into /proc (a cold reviewer's)."""
    import shlex
    import subprocess
    import sys

    from outputs_support import SRC

    target = tmp_path / "f"
    cmd = (f"rm {shlex.quote(str(target))}; exec {shlex.quote(sys.executable)} -m tokenbridge.cli reconstruct "
           f"{shlex.quote(str(EXAMPLE_EXCHANGES))} -o /dev/stdout -t {shlex.quote(str(kimi_dir))}")
    with open(target, "wb") as out:
        res = subprocess.run(["sh", "-c", cmd], stdout=out, stderr=subprocess.PIPE, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": SRC})
    assert res.returncode == 2 and res.stderr.splitlines() == [
        "error: -o /dev/stdout: is a symlink to a missing file (or a loop); refusing to write through it: give a "
        "file name"]


@pytest.mark.parametrize("name", ["generate.json", "exchanges.jsonl"])
@pytest.mark.parametrize("where", ["other_run", "own"])
def test_a_run_file_linked_to_a_store_is_refused_before_anything_is_sent(tmp_path, name, where):
    """A cold tester's: ``RUN/generate.json`` (or ``exchanges.jsonl``) as a symlink to a store
    (another run's, or this folder's own): the rerun wrote its summary through the link and
    the store of paid answers became JSON text. A link to a file of the user's elsewhere is
    still written through (that is what a link there is for)."""
    other = _store_folder(tmp_path / "other", lock=True)
    out = _store_folder(tmp_path / "run", lock=True)
    store = (other if where == "other_run" else out) / "state.sqlite"
    (out / name).symlink_to(store)
    before = store.read_bytes()
    assert run_folder_problem(out) == (
        f"{out / name}: is a symlink to {store}, which is the store (every response, attempt and cost) of the run "
        f"folder {store.parent}; the run would write over it: nothing was written: move the link away and run again")
    res = CliRunner().invoke(app, ["generate", "--out", str(out), "--base-url", "http://127.0.0.1:9/api/v1",
                                   "--model", "m", "builtin:prompts/chat.jsonl"])
    assert res.exit_code == 2 and store.read_bytes() == before
    (out / name).unlink()
    mine = tmp_path / "mine.json"
    mine.write_text("{}", encoding="utf-8")
    (out / name).symlink_to(mine)
    assert run_folder_problem(out) is None


def test_a_store_kept_elsewhere_behind_a_link_is_still_resumed(tmp_path):
    """A cold reviewer's: the guard against writing a summary over a linked store refused a
    run folder whose own ``state.sqlite`` is a link to where the user keeps it (the run
    writes into its store, never over it); following its advice started a new store."""
    out = _store_folder(tmp_path / "run", lock=True)
    kept = tmp_path / "big" / "k25.sqlite"
    kept.parent.mkdir()
    (out / "state.sqlite").rename(kept)
    (out / "state.sqlite").symlink_to(kept)
    assert run_folder_problem(out) is None


def test_a_run_folder_linked_file_by_file_to_where_the_user_keeps_it_resumes(tmp_path):
    """A cold reviewer's: ``run/`` holding only links to ``keep/``'s store, exchanges.jsonl and
    generate.json (the run kept elsewhere) was refused as writing over another run's files:
    they are this run's own, beside its store."""
    keep = _store_folder(tmp_path / "keep", lock=True)
    for name in ("exchanges.jsonl", "generate.json"):
        (keep / name).write_text("{}\n", encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("state.sqlite", "exchanges.jsonl", "generate.json"):
        (run / name).symlink_to(keep / name)
    (run / ".lock").write_bytes(b"4242 tokenbridge run\n")
    assert run_folder_problem(run) is None
    (run / "generate.json").unlink()  # but a summary linked to another run's file is still refused
    other = _store_folder(tmp_path / "other", lock=True)
    (other / "generate.json").write_text("{}\n", encoding="utf-8")
    (run / "generate.json").symlink_to(other / "generate.json")
    assert "the run would write over it" in (run_folder_problem(run) or "")

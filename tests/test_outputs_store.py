"""A run folder is recognised by its store's schema, never by a file's name or header.

A cold attack put a user's own SQLite database, named ``state.sqlite`` (its own
``accounts`` table), in a folder beside the user's ``exchanges.jsonl``: ``generate -o``
took it for a run folder (the check read only the SQLite header), replaced the user's
exchanges.jsonl and added 6 tables and 8 triggers to the user's database. Now the store is
recognised read only (:func:`tokenbridge.outdir.store_kind`: ``meta.schema_version`` and
tokenbridge's tables) before anything is written, and anything else is refused with one
line naming it (exit 2). A new store is made 0600, as the README says it is.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import EXAMPLE_EXCHANGES, write_run_config
from outputs_support import snapshot
from tokenbridge.cli import app
from tokenbridge.generate.store import Store, StoreError
from tokenbridge.outdir import is_own_run_folder, run_folder_of, store_kind
from tokenbridge.pipeline import PipelineError, load_run_config, run_pipeline

_FOREIGN = ("an SQLite database that is not a tokenbridge store (a store holds meta.schema_version and the tables "
            "meta, samples, attempts, responses and runs, no other); refusing to write into it; nothing was written: "
            "give a new or empty folder")
_UNREACHABLE = ["--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--max-attempts", "1", "--progress", "none"]


def _user_folder(folder: Path, *, wal: bool = False) -> Path:
    """The attack's folder: the user's notes, exchanges and a database of their own."""
    folder.mkdir()
    (folder / "notes.txt").write_bytes(b"my notes\n")
    (folder / "exchanges.jsonl").write_bytes(b'{"mine": true}\n')
    con = sqlite3.connect(folder / "state.sqlite")
    if wal:
        con.execute("PRAGMA journal_mode=WAL")
    con.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance REAL)")
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")  # a common name proves nothing
    con.execute("INSERT INTO accounts VALUES (1, 100.0)")
    con.commit()
    con.close()
    return folder


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n', encoding="utf-8")
    return path


def _one_error(res, line: str, code: int = 2) -> None:
    assert res.exit_code == code and isinstance(res.exception, SystemExit), res.output
    assert res.output.splitlines() == [f"error: {line}"]


@pytest.mark.parametrize("wal", [False, True])
@pytest.mark.parametrize("lock", [False, True])
def test_generate_refuses_a_folder_holding_a_user_database_named_state_sqlite(tmp_path, wal, lock):
    user = _user_folder(tmp_path / "userdir", wal=wal)
    if lock:  # not even a tokenbridge lock file makes the user's database ours
        (user / ".lock").write_bytes(b"4242 tokenbridge generate\n")
    before, names = snapshot(user), sorted(os.listdir(user))
    res = CliRunner().invoke(app, ["generate", str(_prompts(tmp_path)), "-o", str(user), *_UNREACHABLE])
    _one_error(res, f"--out {user / 'state.sqlite'}: {_FOREIGN}")
    assert snapshot(user) == before and sorted(os.listdir(user)) == names  # no -wal, -shm or .lock left either
    assert not is_own_run_folder(user) and run_folder_of(user / "x.jsonl") is None


def test_run_refuses_a_run_folder_holding_a_user_database(tmp_path, kimi_dir):
    cfg = write_run_config(tmp_path, kimi_dir)
    out = _user_folder(load_run_config(cfg).out)
    before = snapshot(out)
    res = CliRunner().invoke(app, ["run", str(cfg)])
    _one_error(res, f"{cfg}:3: run.out: {out / 'state.sqlite'}: {_FOREIGN}")
    with pytest.raises(PipelineError, match="not a tokenbridge store"):  # the API too
        run_pipeline(load_run_config(cfg), echo=lambda _: None)
    assert snapshot(out) == before and sorted(os.listdir(out)) == ["exchanges.jsonl", "notes.txt", "state.sqlite"]


def test_the_store_refuses_a_user_database_before_writing_into_it(tmp_path):
    """Every opener of the store (generate, --dry-run's estimate, run's report counters)
    goes through Store.open: it reads before it writes."""
    user = _user_folder(tmp_path / "userdir")
    before = snapshot(user)
    with pytest.raises(StoreError) as caught:
        Store.open(user)
    assert str(caught.value) == f"{user / 'state.sqlite'}: {_FOREIGN}" and caught.value.exit_code == 2
    assert snapshot(user) == before and sorted(os.listdir(user)) == ["exchanges.jsonl", "notes.txt", "state.sqlite"]
    con = sqlite3.connect(f"{(user / 'state.sqlite').as_uri()}?mode=ro", uri=True)
    assert [n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")] == ["accounts", "meta"]
    con.close()


@pytest.mark.parametrize("store", ["missing", "empty file", "no tables"])
def test_exchanges_whose_store_is_gone_are_never_paid_for_again(tmp_path, store):
    """A run folder whose state.sqlite was deleted, emptied, or copied without the -wal
    that held its data, beside the exchanges.jsonl it wrote: a run there sent every request
    again and replaced the only copy of the paid responses. Refused, nothing written."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "exchanges.jsonl").write_bytes(b'{"id": "a", "paid": true}\n')
    (run / ".lock").write_bytes(b"4242 tokenbridge generate\n")  # what a run leaves
    if store == "empty file":
        (run / "state.sqlite").write_bytes(b"")
    elif store == "no tables":
        sqlite3.connect(run / "state.sqlite").close()
    before = snapshot(run)
    why = (f"{run}: exchanges.jsonl holds responses but state.sqlite, the store they came from, is missing or empty: "
           "a run here would pay for every one again and write exchanges.jsonl anew without them. Restore "
           "state.sqlite (with its -wal and -shm files), or move exchanges.jsonl away to start over")
    with pytest.raises(StoreError) as caught:
        Store.open(run)
    assert str(caught.value) == why and caught.value.exit_code == 2
    res = CliRunner().invoke(app, ["generate", str(_prompts(tmp_path)), "-o", str(run), *_UNREACHABLE])
    _one_error(res, why)
    assert snapshot(run) == before and not (run / "state.sqlite-wal").exists()


def test_a_new_store_beside_empty_exchanges_opens(tmp_path):
    (tmp_path / "exchanges.jsonl").write_bytes(b"")
    Store.open(tmp_path).close()
    assert store_kind(tmp_path / "state.sqlite") == "tokenbridge"


def test_a_user_database_an_older_tokenbridge_wrote_its_tables_into_stays_the_users(tmp_path):
    """The attack's aftermath: the user's database with generate's schema added to it.
    A store holds no table of its own version's schema but tokenbridge's, so it is the
    user's still, and nothing more is written into it."""
    from tokenbridge.generate import store

    user = _user_folder(tmp_path / "userdir")
    con = sqlite3.connect(user / "state.sqlite", isolation_level=None)
    con.executescript(store._SCHEMA)  # what the old Store.open did to it: 6 tables, 8 triggers, schema_version
    con.close()
    before = snapshot(user)
    res = CliRunner().invoke(app, ["generate", str(_prompts(tmp_path)), "-o", str(user), *_UNREACHABLE])
    _one_error(res, f"--out {user / 'state.sqlite'}: {_FOREIGN}")
    assert snapshot(user) == before and sorted(os.listdir(user)) == ["exchanges.jsonl", "notes.txt", "state.sqlite"]


def test_the_versions_outdir_knows_include_the_stores(tmp_path):
    """The store generate makes today is tokenbridge's to outdir: its version is known and
    every table it holds (in_flight included) is one of a store's own."""
    from tokenbridge import outdir
    from tokenbridge.generate.store import SCHEMA_VERSION, Store

    assert str(SCHEMA_VERSION) in outdir._STORE_VERSIONS
    Store.open(tmp_path).close()
    assert outdir.store_kind(tmp_path / "state.sqlite") == "tokenbridge"


def test_reconstruct_into_a_user_folder_takes_no_lock_there(tmp_path, kimi_dir):
    """A folder with a user's state.sqlite counted as a run folder for the lock too: writing
    an output there truncated the user's own ``.lock`` file to hold the pid."""
    user = _user_folder(tmp_path / "userdir")
    (user / ".lock").write_bytes(b"the user's own lock file\n")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(EXAMPLE_EXCHANGES.read_text(encoding="utf-8").splitlines(keepends=True)[:3]),
                   encoding="utf-8")
    before = snapshot(user) | {".lock": (user / ".lock").read_bytes()}
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(user / "rec.jsonl"), "-t", str(kimi_dir)])
    assert res.exit_code == 0, res.output
    after = snapshot(user) | {".lock": (user / ".lock").read_bytes()}
    assert after.pop("rec.jsonl") and after == before


def _make(tmp_path: Path, what: str) -> Path:
    path = tmp_path / "state.sqlite"
    if what == "tokenbridge":
        Store.open(tmp_path).close()
    elif what in ("a store with the user's tables", "a newer store"):
        Store.open(tmp_path).close()
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE accounts (id INTEGER)" if what != "a newer store" else "CREATE TABLE extra (x)")
        if what == "a newer store":
            con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
        con.commit()
        con.close()
    elif what == "zero bytes":
        path.write_bytes(b"")
    elif what == "no tables":
        con = sqlite3.connect(path)
        con.execute("PRAGMA user_version = 7")  # writes the header: a database with no table
        con.close()
    elif what == "foreign":
        _user_folder(tmp_path / "u")
        os.rename(tmp_path / "u" / "state.sqlite", path)
    elif what == "meta without schema_version":
        con = sqlite3.connect(path)
        for table in ("meta (key TEXT, value TEXT)", "samples (id)", "attempts (n)", "responses (b)", "runs (r)"):
            con.execute(f"CREATE TABLE {table}")
        con.commit()
        con.close()
    elif what == "header then garbage":
        path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)
    elif what == "text":
        path.write_bytes(b"my notes\n")
    elif what == "fifo":
        os.mkfifo(path)  # opening it would block
    elif what == "folder":
        path.mkdir()
    elif what == "dangling symlink":
        path.symlink_to(tmp_path / "nowhere")
    return path


@pytest.mark.parametrize(("what", "kind"), [
    ("missing", None), ("tokenbridge", "tokenbridge"), ("zero bytes", "empty"), ("no tables", "empty"),
    ("foreign", "foreign"), ("meta without schema_version", "foreign"),
    ("a store with the user's tables", "foreign"),  # what an older tokenbridge left in a user's database
    ("a newer store", "tokenbridge"),  # then refused by Store.open for its version ("header then garbage", "not sqlite"),
    ("text", "not sqlite"), ("fifo", "not a file"), ("folder", "not a file"), ("dangling symlink", "not a file"),
])
def test_store_kind_reads_only(tmp_path, what, kind):
    path = _make(tmp_path, what)
    names = sorted(os.listdir(tmp_path))
    data = path.read_bytes() if path.is_file() else None
    assert store_kind(path) == kind
    assert sorted(os.listdir(tmp_path)) == names and (data is None or path.read_bytes() == data)
    lock = tmp_path / ".lock"
    lock.write_bytes(b"4242 tokenbridge generate\n")  # a run killed before its store had a schema: ours
    assert is_own_run_folder(tmp_path) is (kind in ("tokenbridge", "empty", None))


def test_a_store_with_its_schema_only_in_the_wal_is_recognised(tmp_path):
    """A generate killed before a checkpoint leaves the store's pages in state.sqlite-wal."""
    store = Store.open(tmp_path)
    try:
        assert (tmp_path / "state.sqlite-wal").exists()
        assert store_kind(tmp_path / "state.sqlite") == "tokenbridge"
    finally:
        store.close()


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_a_new_store_and_its_side_files_are_private(tmp_path, umask):
    old = os.umask(umask)
    try:
        store = Store.open(tmp_path / "run")
    finally:
        os.umask(old)
    try:
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "run").iterdir()}
    finally:
        store.close()
    assert modes == {"state.sqlite": 0o600, "state.sqlite-wal": 0o600, "state.sqlite-shm": 0o600}

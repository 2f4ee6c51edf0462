"""What a resume reads of the store: the small columns of every response (base_url, cost,
usage, which sit after ``body`` in the row) come from indexes, never from the rows, so a
rerun reads a sliver of ``state.sqlite`` however large its bodies are; and a store written
before those indexes (schema 3 as it was) opens, gets them, and answers the same.

Evidence: the bytes the process reads (``/proc/self/io``'s ``rchar``, every ``read`` the
kernel served, page cache or not) and ``EXPLAIN QUERY PLAN`` of the statements run."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from pathlib import Path

import pytest

from tokenbridge.exit_codes import ExitCode
from tokenbridge.generate import store as store_mod
from tokenbridge.generate.store import AttemptRecord, Batch, ResponseRecord, Store, StoreError
from tokenbridge.outdir import store_kind

URL = "https://api.example/v1"
OTHER_URL = "https://other.example/v1"
BODY_BYTES = 96_000  # per response: the rows are mostly body, as in a real store
DONE = 48

#: schema 3 as tokenbridge wrote it before the indexes: what an existing store holds
OLD_V3_SCHEMA = """
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at REAL NOT NULL,
    finished_at REAL,
    settings TEXT NOT NULL,
    outcome TEXT
);
CREATE TABLE IF NOT EXISTS samples (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL UNIQUE,
    dataset TEXT NOT NULL,
    source TEXT NOT NULL DEFAULT '',
    request TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done', 'failed')),
    error_class TEXT,
    error TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    updated_at REAL
);
CREATE INDEX IF NOT EXISTS samples_status ON samples(status);
CREATE TABLE IF NOT EXISTS attempts (
    sample_id TEXT NOT NULL REFERENCES samples(id),
    n INTEGER NOT NULL,
    run INTEGER,
    started_at REAL NOT NULL,
    latency_s REAL,
    http_status INTEGER,
    error_class TEXT,
    message TEXT,
    cost REAL,
    stream INTEGER NOT NULL DEFAULT 0,
    possible_cost REAL,
    body BLOB,
    PRIMARY KEY (sample_id, n)
);
CREATE TABLE IF NOT EXISTS in_flight (
    sample_id TEXT NOT NULL REFERENCES samples(id),
    n INTEGER NOT NULL,
    run INTEGER,
    started_at REAL NOT NULL,
    reservation REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (sample_id, n)
);
CREATE TABLE IF NOT EXISTS responses (
    sample_id TEXT PRIMARY KEY REFERENCES samples(id),
    body BLOB NOT NULL,
    raw_stream BLOB,
    provider TEXT,
    model TEXT,
    usage TEXT,
    cost REAL,
    latency_s REAL,
    started_at REAL,
    finished_at REAL,
    attempts INTEGER,
    stream INTEGER NOT NULL DEFAULT 0,
    base_url TEXT
);
INSERT OR IGNORE INTO meta(key, value) VALUES ('done_changes', '0'), ('attempt_changes', '0');
INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', '3');
CREATE TRIGGER IF NOT EXISTS responses_inserted AFTER INSERT ON responses BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'done_changes'; END;
CREATE TRIGGER IF NOT EXISTS responses_updated AFTER UPDATE ON responses BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'done_changes'; END;
CREATE TRIGGER IF NOT EXISTS responses_deleted AFTER DELETE ON responses BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'done_changes'; END;
CREATE TRIGGER IF NOT EXISTS done_sample_updated AFTER UPDATE ON samples WHEN OLD.status = 'done' OR NEW.status = 'done'
    BEGIN UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'done_changes'; END;
CREATE TRIGGER IF NOT EXISTS done_sample_deleted AFTER DELETE ON samples WHEN OLD.status = 'done' BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'done_changes'; END;
CREATE TRIGGER IF NOT EXISTS attempts_inserted AFTER INSERT ON attempts BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'attempt_changes'; END;
CREATE TRIGGER IF NOT EXISTS attempts_updated AFTER UPDATE ON attempts BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'attempt_changes'; END;
CREATE TRIGGER IF NOT EXISTS attempts_deleted AFTER DELETE ON attempts BEGIN
    UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'attempt_changes'; END;
COMMIT;
"""


def _rows(n: int) -> list[tuple[str, str, str, str]]:
    return [(f"d-{i}", "d", "", json.dumps({"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}))
            for i in range(n)]


def _usage(i: int) -> dict[str, int]:
    return {"prompt_tokens": 10 + i, "completion_tokens": 20 + i, "total_tokens": 30 + 2 * i}


def _body(i: int) -> bytes:
    return json.dumps({"id": f"gen-{i}", "pad": ""}).encode() + os.urandom(BODY_BYTES)


def _cost(i: int) -> float:
    return 0.001 * (i + 1)


def _fill(run_dir: Path) -> None:
    """DONE done samples (the last one from OTHER_URL, the first two with no attempt row, as an
    older tool left them), one failed, one pending, one request in flight."""
    with Store.open(run_dir) as store:
        store.add_samples(_rows(DONE + 2))
        store.begin_run({})
        responses = [ResponseRecord(f"d-{i}", _body(i), None, "prov", "m", _usage(i), _cost(i), 0.5, 1.0, 2.0, 1,
                                    False, OTHER_URL if i == DONE - 1 else URL) for i in range(DONE)]
        attempts = [AttemptRecord(f"d-{i}", 1, 1.0, 0.5, 200, None, "ok", _cost(i)) for i in range(2, DONE)]
        attempts.append(AttemptRecord(f"d-{DONE}", 1, 1.0, 9.0, None, "timeout", "t", None, possible_cost=0.5))
        store.commit(Batch(attempts=attempts, responses=responses, failures=[(f"d-{DONE}", "timeout", "t")]))


def _resume(store: Store) -> dict[str, object]:
    """What generate's resume asks of the store (run.py ``_begin`` / ``_reconcile``, the budget,
    the dry run's estimate), answered."""
    rows = _rows(DONE + 2)
    ids = [r[0] for r in rows]
    return {
        "statuses": store.statuses(),
        "diff": store.diff_requests(rows),
        "base_urls": store.done_base_urls(ids),
        "added": store.add_samples(rows),
        "samples": [(s.id, s.status, s.attempts) for s in store.samples(ids)],
        "spent": round(store.total_cost(), 9),
        "possible": store.possible_cost(),
        "prices": sorted(store.price_observations()),
        "tokens": store.token_totals(),
        "counts": store.change_counts(),
    }


def _expected() -> dict[str, object]:
    return {
        "statuses": {**{f"d-{i}": "done" for i in range(DONE)}, f"d-{DONE}": "failed", f"d-{DONE + 1}": "pending"},
        "diff": [],
        "base_urls": {URL: (DONE - 1, "d-0"), OTHER_URL: (1, f"d-{DONE - 1}")},
        "added": (0, []),
        "samples": [(f"d-{i}", "done", 1 if i >= 2 else 0) for i in range(DONE)]
                   + [(f"d-{DONE}", "failed", 1), (f"d-{DONE + 1}", "pending", 0)],
        "spent": round(sum(_cost(i) for i in range(DONE)), 9),
        "possible": 0.5,
        "prices": sorted(("prov", 10 + i, 20 + i, _cost(i)) for i in range(DONE)),
        "tokens": (sum(10 + i for i in range(DONE)), sum(20 + i for i in range(DONE)),
                   pytest.approx(sum(_cost(i) for i in range(DONE)))),
    }


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads are counted from /proc/self/io (Linux)")
def test_a_resume_reads_a_sliver_of_the_store_never_the_response_bodies(tmp_path):
    _fill(tmp_path)
    size = sum(p.stat().st_size for p in tmp_path.glob("state.sqlite*"))
    assert size > DONE * BODY_BYTES
    before = _rchar()
    with Store.open(tmp_path) as store:
        answers = _resume(store)
    read = _rchar() - before
    answers.pop("counts")
    assert answers == _expected()
    # the bodies are 4.6 MB (the version before the indexes read 19 MB here: each query read
    # them all). What is read is the rest: the schema, a few dozen pages of samples, attempts
    # and indexes, and a page at the start of each read transaction (about 100 kB in all).
    assert read < size // 10, f"a resume read {read} bytes of a {size}-byte store"


def _reads_of_rows(conn: sqlite3.Connection, sql: str, table: str) -> list[str]:
    """The lines of ``sql``'s query plan that read ``table``'s rows (a scan or search of the
    table itself, or through an index that does not cover the columns wanted)."""
    names = {table} | set(re.findall(rf"\b{table}\s+(?:AS\s+)?(?!INDEXED\b|WHERE\b|ON\b|JOIN\b)(\w+)", sql, re.I))
    out = []
    for *_, detail in conn.execute("EXPLAIN QUERY PLAN " + sql):
        words = detail.split()
        if words[0] in ("SCAN", "SEARCH") and words[1] in names and "COVERING INDEX" not in detail:
            out.append(detail)
    return out


def test_every_statement_of_a_resume_reads_responses_from_an_index(tmp_path):
    """Every statement a resume runs that names ``responses`` reads it through a covering
    index: no row (body and all) is visited."""
    _fill(tmp_path)
    statements: list[str] = []
    with Store.open(tmp_path) as store:
        store._conn.set_trace_callback(statements.append)
        _resume(store)
        store._conn.set_trace_callback(None)
        touching = [s for s in statements if re.search(r"\bresponses\b", s) and s.lstrip().upper().startswith("SELECT")]
        assert len(touching) >= 4  # base urls, the orphans' cost, prices, tokens
        assert {s: _reads_of_rows(store._conn, s, "responses") for s in touching} == {s: [] for s in touching}


def test_statuses_come_from_an_index_not_the_rows_that_hold_the_requests(tmp_path):
    """Every sample's status (read twice a run, and to tell done samples' base URLs) comes
    from samples_status_id: the rows, each with its request, are not read for it."""
    _fill(tmp_path)
    with Store.open(tmp_path) as store:
        statements: list[str] = []
        store._conn.set_trace_callback(statements.append)
        store.statuses()
        store.done_base_urls([r[0] for r in _rows(DONE + 2)])
        store._conn.set_trace_callback(None)
        reading = [s for s in statements if re.search(r"\bsamples\b", s) and s.lstrip().upper().startswith("SELECT")]
        assert len(reading) == 2
        assert {s: _reads_of_rows(store._conn, s, "samples") for s in reading} == {s: [] for s in reading}


def test_a_rerun_of_generate_reads_responses_from_indexes_only(tmp_path, kimi, monkeypatch):
    """The real thing: generate run again over a finished folder, with a budget (so it learns
    prices from the stored responses). Every statement it runs that names ``responses``
    reads it through a covering index."""
    from tokenbridge import digests
    from tokenbridge.emulator import EmulatorConfig, running_emulator
    from tokenbridge.generate import GenerateSettings, RequestSettings, generate_run
    from tokenbridge.generate.settings import DatasetSpec

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"Question {i}?"}) + "\n" for i in range(6)))
    statements: list[str] = []
    real_connect = sqlite3.connect

    def connect(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        conn.set_trace_callback(statements.append)
        return conn

    with running_emulator(EmulatorConfig(min_tokens=5, max_tokens=20, retry_after_s=0, slow_s=0.0), tokenizer=kimi) as url:
        settings = GenerateSettings(datasets=(DatasetSpec("p", prompts),), request=RequestSettings(model="moonshotai/kimi-k2.5"),
                                    base_url=url, progress="none", max_cost=100.0)
        assert generate_run(settings, tmp_path / "run", key=None).done == 6
        # exchanges.jsonl aged past the racy window: the next run reads it once and trusts it,
        # so the one after is a rerun of a finished folder, which writes nothing
        monkeypatch.setattr(digests, "now_ns", lambda: time.time_ns() + 10_000_000_000)
        generate_run(settings, tmp_path / "run", key=None)
        monkeypatch.setattr(sqlite3, "connect", connect)
        again = generate_run(settings, tmp_path / "run", key=None)
        monkeypatch.setattr(sqlite3, "connect", real_connect)
    assert (again.requests, again.already_done) == (0, 6)
    assert not any("r.body" in s for s in statements)  # exchanges.jsonl kept, not written again
    touching = [s for s in statements if re.search(r"\bresponses\b", s) and s.lstrip().upper().startswith("SELECT")]
    assert any("base_url" in s for s in touching) and any("SUM(r.cost)" in s for s in touching)
    assert any("usage" in s for s in touching)  # the budget's price observations
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    for s in statements:  # the temporary tables the statements name
        if s.startswith("CREATE TEMP TABLE"):
            con.execute(s)
    assert {s: _reads_of_rows(con, s, "responses") for s in touching} == {s: [] for s in touching}
    # the samples' rows (each holds its request) are read once: to compare the stored requests
    # with these. A search by status reads the rows of that status only (pending, failed: none).
    selects = [s for s in statements if re.search(r"\bsamples\b", s) and s.lstrip().upper().startswith("SELECT")]
    row_reads = {s: [d for d in _reads_of_rows(con, s, "samples") if "(status=?)" not in d] for s in selects}
    assert [s for s, lines in row_reads.items() if lines] == [
        next(s for s in selects if "s.request != i.request" in s)]
    con.close()


def _old_store(run_dir: Path) -> None:
    """A store as the version before the indexes wrote it: schema 3, written with plain SQL."""
    run_dir.mkdir()
    con = sqlite3.connect(run_dir / "state.sqlite", isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.executescript(OLD_V3_SCHEMA)
    con.execute("BEGIN")
    con.executemany("INSERT INTO samples(id, seq, dataset, source, request) VALUES (?,?,?,?,?)",
                    [(sid, i, ds, src, req) for i, (sid, ds, src, req) in enumerate(_rows(DONE + 2))])
    con.executemany(
        "INSERT INTO responses(sample_id, body, raw_stream, provider, model, usage, cost, latency_s, started_at,"
        " finished_at, attempts, stream, base_url) VALUES (?,?,NULL,'prov','m',?,?,0.5,1.0,2.0,1,0,?)",
        [(f"d-{i}", _body(i), json.dumps(_usage(i)), _cost(i), OTHER_URL if i == DONE - 1 else URL)
         for i in range(DONE)])
    con.executemany("INSERT INTO attempts(sample_id, n, started_at, latency_s, http_status, message, cost)"
                    " VALUES (?, 1, 1.0, 0.5, 200, 'ok', ?)", [(f"d-{i}", _cost(i)) for i in range(2, DONE)])
    con.execute("INSERT INTO attempts(sample_id, n, started_at, latency_s, error_class, message, possible_cost)"
                f" VALUES ('d-{DONE}', 1, 1.0, 9.0, 'timeout', 't', 0.5)")
    con.execute(f"UPDATE samples SET status='done', attempts=1 WHERE seq < {DONE}")
    con.execute(f"UPDATE samples SET status='failed', error_class='timeout', error='t', attempts=1 WHERE seq = {DONE}")
    con.execute("COMMIT")
    con.close()


def _indexes(path: Path) -> set[str]:
    con = sqlite3.connect(path)
    try:
        return {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='index' AND sql IS NOT NULL")}
    finally:
        con.close()


def test_a_store_written_before_the_indexes_opens_gets_them_and_answers_the_same(tmp_path):
    run = tmp_path / "run"
    _old_store(run)
    con = sqlite3.connect(run / "state.sqlite")
    bodies = {sid: bytes(b) for sid, b in con.execute("SELECT sample_id, body FROM responses")}
    con.close()
    assert store_kind(run / "state.sqlite") == "tokenbridge"
    assert _indexes(run / "state.sqlite") == {"samples_status"}

    with Store.open(run) as store:
        answers = _resume(store)
        assert {sid: body for sid, _, _, body, _ in store.iter_done()} == bodies  # every paid answer kept
    assert _indexes(run / "state.sqlite") >= set(store_mod._INDEXES)
    counts = answers.pop("counts")
    assert answers == _expected()
    assert counts["samples"] == {"done": DONE, "failed": 1, "pending": 1}
    con = sqlite3.connect(run / "state.sqlite")
    assert con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("3",)  # same schema
    assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    # what the older version's open does to the file now (its schema script, again), and a
    # response it writes: the indexes stay and SQLite keeps them up to date for it too
    con.isolation_level = None
    con.executescript(OLD_V3_SCHEMA)
    con.execute("INSERT INTO responses(sample_id, body, cost, base_url) VALUES (?, ?, 0.25, ?)",
                (f"d-{DONE + 1}", b"{}", OTHER_URL))
    con.execute(f"UPDATE samples SET status='done' WHERE id='d-{DONE + 1}'")
    con.close()
    assert store_kind(run / "state.sqlite") == "tokenbridge"
    with Store.open(run) as store:
        assert store.done_base_urls([f"d-{i}" for i in range(DONE + 2)]) == {
            URL: (DONE - 1, "d-0"), OTHER_URL: (2, f"d-{DONE - 1}")}
        assert store.total_cost() == pytest.approx(sum(_cost(i) for i in range(DONE)) + 0.25)


def test_indexes_are_made_in_one_transaction_or_not_at_all(tmp_path, monkeypatch):
    """A failure while building them (a full disk, a kill) leaves the file as it was: no
    index half made, every response there; the next open makes them."""
    run = tmp_path / "run"
    _old_store(run)
    broken = {**store_mod._INDEXES, "zz_broken": "CREATE INDEX zz_broken ON responses(no_such_column)"}
    monkeypatch.setattr(store_mod, "_INDEXES", broken)
    with pytest.raises(StoreError, match="not a usable tokenbridge state file"):
        Store.open(run)
    assert _indexes(run / "state.sqlite") == {"samples_status"}
    monkeypatch.undo()
    with Store.open(run) as store:
        assert len(list(store.iter_done())) == DONE
    assert _indexes(run / "state.sqlite") >= set(store_mod._INDEXES)


def test_a_full_disk_while_building_the_indexes_is_the_disk_not_the_file(tmp_path, monkeypatch):
    """SQLITE_FULL on the first open of an older store (the one that builds the indexes)
    said 'not a usable tokenbridge state file': the file is fine, the disk is full."""
    run = tmp_path / "run"
    _old_store(run)
    real = store_mod._add_indexes

    def full(conn):
        exc = sqlite3.OperationalError("database or disk is full")
        exc.sqlite_errorcode = 13  # SQLITE_FULL
        raise exc

    monkeypatch.setattr(store_mod, "_add_indexes", full)
    with pytest.raises(StoreError) as err:
        Store.open(run)
    assert err.value.exit_code == ExitCode.STORE
    assert str(err.value) == (f"{run / 'state.sqlite'}: cannot write the run state (database or disk is full); "
                              "nothing was lost: free space or fix the folder and run again")
    monkeypatch.setattr(store_mod, "_add_indexes", real)
    with Store.open(run) as store:
        assert len(list(store.iter_done())) == DONE

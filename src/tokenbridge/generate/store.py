"""The run's durable state: ``RUN/state.sqlite`` (SQLite, WAL, ``synchronous=FULL``).

Tables
  ``samples``    one row per prompt: id, input order (``seq``), dataset, source, the
                 canonical request JSON (never a key or header), status
                 (pending | done | failed), last error, attempt count.
  ``attempts``   every HTTP attempt, appended, never overwritten: run, number (unique per
                 sample), start, latency, HTTP status, error class and (scrubbed) message,
                 cost when the provider billed it, ``possible_cost`` when it may have been
                 billed but no cost came back (a timeout, a cut stream: its reservation),
                 and ``body``: the bytes of an HTTP 200 that was not kept (malformed, no
                 choices, a choice error; a stream's raw bytes), zlib, key masked, so an
                 answer that was paid for is never dropped.
  ``responses``  the response of each done sample: ``body`` = the bytes the API returned
                 (for a streamed call: the assembled chat.completion JSON), ``raw_stream``
                 = every byte of the SSE stream (zlib), plus provider, model, usage, cost,
                 latency, timestamps, attempts, stream flag, and the ``base_url`` it came from.
  ``in_flight``  one row per request whose send has begun and whose attempt row is not yet
                 written: (sample, number, run, start, reservation), committed *before* the
                 request goes out and deleted in the transaction that writes its attempt. A
                 row left by a ``kill -9`` becomes an ``unanswered`` attempt (its reservation
                 as ``possible_cost``) when the next run begins (:meth:`Store.settle_in_flight`).
  ``runs``       one row per invocation: settings (no secret), start/end, outcome.
  ``meta``       ``schema_version``; ``done_changes`` / ``attempt_changes``, counters that
                 triggers move on every change to a done sample or response / to an attempt
                 (whoever writes: a hand edit too), so readers can tell "nothing changed"
                 without reading rows; ``exchanges``, what ``exchanges.jsonl`` was last
                 written from (see :mod:`.run`).

Indexes beside the tables' own: ``responses_books`` (sample_id, base_url, cost) and
``responses_usage`` (provider, cost, usage; rows with a usage) hold copies of the small
columns that a resume reads from every response (where each came from, what those
without an attempt row cost, the prices it learns), so SQLite answers from the index's
few pages instead of reading each row, body and all (those columns come after ``body``);
``samples_status_id`` (status, id) does the same for the samples' statuses, which would
otherwise be read from rows that hold each request.
An index changes no table: the open that finds one missing makes it (:data:`_INDEXES`),
the schema version stays, and an older tokenbridge reads and writes such a file unchanged.

Money spent is the sum of ``attempts.cost`` (every billed attempt has a row there, a
retried one too); money possibly spent adds ``possible_cost`` of attempts without a cost,
and the reservations of requests still ``in_flight``.
Older files are upgraded in place on open (schema 1: no ``base_url``, no ``possible_cost``;
schema 2: no ``attempts.body``).

A sample becomes ``done`` in the same transaction that stores its response, and the
engine counts it only after that commit returns: a ``kill -9`` at any instant leaves
each sample either fully stored or still pending (sent again on resume).

All methods are blocking. The engine writes a batch on its event-loop thread
(:meth:`Store.stage`: a few ``executemany`` calls; doing them in a thread would fight the
loop for the GIL on every row) and runs only the ``COMMIT`` (the fsync) in a thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Iterator

from ..exit_codes import ExitCode
from ..fsio import PRIVATE_MODE, real_path
from ..jsonl import is_count, loads_document
from ..outdir import store_problem
from .body import MAX_PLAUSIBLE_COST, MAX_PLAUSIBLE_TOKENS
from .errors import GenerateError

__all__ = ["EXCHANGES_FILE", "STATE_FILE", "AttemptRecord", "ResponseRecord", "SendRecord", "Store", "StoreError", "StoredSample"]

STATE_FILE = "state.sqlite"
#: What generate writes from the store: every stored response, one exchange record a line.
EXCHANGES_FILE = "exchanges.jsonl"
SCHEMA_VERSION = 3

_SCHEMA = """
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
    attempts INTEGER NOT NULL DEFAULT 0,  -- set when the sample ends (done/failed)
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
INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', '""" + str(SCHEMA_VERSION) + """');
""" + "".join(
    f"CREATE TRIGGER IF NOT EXISTS {name} AFTER {event} BEGIN UPDATE meta SET value = CAST(value AS INTEGER) + 1"
    f" WHERE key = '{counter}'; END;\n"
    for name, event, counter in (
        ("responses_inserted", "INSERT ON responses", "done_changes"),
        ("responses_updated", "UPDATE ON responses", "done_changes"),
        ("responses_deleted", "DELETE ON responses", "done_changes"),
        ("done_sample_updated", "UPDATE ON samples WHEN OLD.status = 'done' OR NEW.status = 'done'", "done_changes"),
        ("done_sample_deleted", "DELETE ON samples WHEN OLD.status = 'done'", "done_changes"),
        ("attempts_inserted", "INSERT ON attempts", "attempt_changes"),
        ("attempts_updated", "UPDATE ON attempts", "attempt_changes"),
        ("attempts_deleted", "DELETE ON attempts", "attempt_changes"),
    )
) + "COMMIT;\n"
#: Indexes that keep a resume's reads off the response bodies and the stored requests (see
#: the module's doc): name ->
#: statement. Made by :func:`_add_indexes` after any upgrade (a schema 1 file has no
#: ``base_url`` until then).
_INDEXES: dict[str, str] = {
    "responses_books": "CREATE INDEX IF NOT EXISTS responses_books ON responses(sample_id, base_url, cost)",
    "responses_usage": "CREATE INDEX IF NOT EXISTS responses_usage ON responses(provider, cost, usage)"
                       " WHERE usage IS NOT NULL",
    "samples_status_id": "CREATE INDEX IF NOT EXISTS samples_status_id ON samples(status, id)",
}
#: schema version -> the statements that take a file of that version to the next one
_UPGRADES: dict[str, tuple[str, ...]] = {
    "1": ("ALTER TABLE attempts ADD COLUMN possible_cost REAL", "ALTER TABLE responses ADD COLUMN base_url TEXT"),
    "2": ("ALTER TABLE attempts ADD COLUMN body BLOB",),
}


_COST_OK = f"cost >= 0 AND cost <= {MAX_PLAUSIBLE_COST}"
_UNANSWERED = "sent, but the run ended before its answer was stored: booked at its reservation as possible spend"


def _upgrade(conn: sqlite3.Connection, version: str) -> None:
    """Take a file of an older schema ``version`` to :data:`SCHEMA_VERSION`, in one transaction."""
    conn.execute("BEGIN IMMEDIATE")
    while version in _UPGRADES:
        for stmt in _UPGRADES[version]:
            conn.execute(stmt)
        version = str(int(version) + 1)
    conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
    conn.execute("COMMIT")


#: SQLite's primary result codes that mean the storage failed, not the file's content:
#: BUSY, LOCKED, READONLY, IOERR, FULL, CANTOPEN.
_STORAGE_ERRORS = frozenset({5, 6, 8, 10, 13, 14})


def _add_indexes(conn: sqlite3.Connection) -> None:
    """Make the :data:`_INDEXES` a file lacks (one written before them), in one transaction:
    on such a file the first open reads every response once to build them. Nothing is
    locked or written when all are there."""
    have = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    if have >= _INDEXES.keys():
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        for stmt in _INDEXES.values():
            conn.execute(stmt)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _usage(usage_json: str | None) -> dict[str, Any]:
    try:
        usage = loads_document(usage_json) if usage_json else None
    except ValueError:  # JsonLineError too: nested too deeply to read
        return {}
    return usage if isinstance(usage, dict) else {}


def _count(v: Any) -> int | None:
    return v if is_count(v) and v <= MAX_PLAUSIBLE_TOKENS else None


def _plausible_cost(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_PLAUSIBLE_COST


def _create_private(path: Path) -> None:
    """Make the empty store file ``0600`` whatever the umask, before SQLite opens it: SQLite
    gives its ``-wal``, ``-shm`` and ``-journal`` files the database file's mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)
    finally:
        os.close(fd)


class StoreError(GenerateError):
    """The state file cannot be used (not SQLite, corrupt, from an incompatible version),
    or (``exit_code`` 6) cannot be written."""


@dataclass(frozen=True)
class StoredSample:
    id: str
    seq: int
    dataset: str
    request: str  # canonical request JSON text
    status: str
    attempts: int
    error_class: str | None = None  # of the last failure (kept when a failed sample is reopened)


@dataclass(frozen=True)
class AttemptRecord:
    sample_id: str
    n: int
    started_at: float
    latency_s: float | None
    http_status: int | None
    error_class: str | None
    message: str
    cost: float | None = None
    stream: bool = False
    possible_cost: float | None = None
    body: bytes | None = None  # an HTTP 200 not kept (malformed...): what the API sent, key masked


@dataclass(frozen=True)
class SendRecord:
    """A request about to go out: recorded (and committed) first, so no end of the process can
    make it vanish from the books."""

    sample_id: str
    n: int
    started_at: float
    reservation: float


@dataclass(frozen=True)
class ResponseRecord:
    sample_id: str
    body: bytes
    raw_stream: bytes | None
    provider: str | None
    model: str | None
    usage: dict[str, Any] | None
    cost: float | None
    latency_s: float
    started_at: float
    finished_at: float
    attempts: int
    stream: bool
    base_url: str | None = None


@dataclass
class Batch:
    """What one commit writes: requests about to go out, attempts (each settles its request's
    in-flight row), finished responses, samples given up on."""

    sends: list[SendRecord] = field(default_factory=list)
    unsent: list[tuple[str, int]] = field(default_factory=list)  # (sample_id, n) recorded, then never sent
    attempts: list[AttemptRecord] = field(default_factory=list)
    responses: list[ResponseRecord] = field(default_factory=list)
    failures: list[tuple[str, str, str]] = field(default_factory=list)  # (sample_id, error_class, message)

    def __bool__(self) -> bool:
        return bool(self.sends or self.unsent or self.attempts or self.responses or self.failures)


#: An attempt's number (parameters: the number asked for, the sample id): that one, or the
#: next after the sample's highest when it is taken (attempt rows are append only).
_NEXT_FREE_N = "MAX(?, (SELECT COALESCE(MAX(n), 0) + 1 FROM attempts WHERE sample_id = ?))"


#: What SQLite keeps beside a WAL-mode database while a connection has it open.
_WAL_FILES = ("-wal", "-shm")


def _tidy_wal(path: Path) -> None:
    """Let SQLite remove the WAL files a read-only connection made (``--dry-run`` writes
    nothing): the last connection to close a WAL database checkpoints it and deletes them,
    which a read-only one cannot. A second connection, opened to read and closed, does that
    where it is the last; with a run's connection open, SQLite leaves them to the run."""
    if not any(os.path.lexists(f"{path}{end}") for end in _WAL_FILES):
        return
    try:
        conn = sqlite3.connect(path, timeout=0.0, isolation_level=None)
        try:
            conn.execute("SELECT 1 FROM meta LIMIT 1").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return  # a folder we may not write, a run mid-commit: the files stay, as SQLite keeps them


class Store:
    """One run folder's SQLite state. Open with :meth:`open`; close when done."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn
        self.run: int | None = None
        self._readonly = False
        #: opened read-only where the WAL's files were not: close leaves none behind
        self._made_wal = False

    @classmethod
    def open(cls, run_dir: str | Path) -> Store:
        """Open (or make) ``RUN/state.sqlite``. A file there that is not a tokenbridge store
        (the user's own database, not SQLite, not a regular file) is refused, read only,
        before anything is written into it (:func:`tokenbridge.outdir.store_kind`); a new
        store is made ``0600`` (it holds every prompt and response), its schema in one
        transaction, so a store is never left half made."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / STATE_FILE
        why = store_problem(path)
        if why is not None:
            raise StoreError(f"{why}; nothing was written: give a new or empty folder")
        try:
            if not os.path.lexists(path):  # store_problem found nothing there, or an empty or own store
                _orphaned_exchanges(run_dir)
                _create_private(path)
            conn = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
            if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
                try:
                    _orphaned_exchanges(run_dir)
                except StoreError:
                    conn.close()
                    raise
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.executescript(_SCHEMA)
            # _SCHEMA inserts the version when there is none, so a row is always there
            (version,) = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if version in _UPGRADES:
                _upgrade(conn, version)
                version = str(SCHEMA_VERSION)
            if str(version) == str(SCHEMA_VERSION):
                _add_indexes(conn)
        except sqlite3.DatabaseError as exc:
            with contextlib.suppress(NameError, sqlite3.Error):
                conn.close()
            if (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _STORAGE_ERRORS:  # the disk, not the file
                raise StoreError(f"{path}: cannot write the run state ({exc}); nothing was lost: free space or "
                                 "fix the folder and run again", exit_code=ExitCode.STORE) from None
            raise StoreError(f"{path}: not a usable tokenbridge state file ({exc})") from None
        except OSError as exc:
            raise StoreError(f"{path}: cannot create the run state ({exc.strerror or exc})",
                             exit_code=ExitCode.STORE) from None
        if str(version) != str(SCHEMA_VERSION):  # compared as text: a damaged file's version may be any value
            conn.close()
            raise StoreError(f"{path}: schema version {str(version)[:40]!r}, this tokenbridge reads {SCHEMA_VERSION}")
        return cls(path, conn)

    @classmethod
    def open_readonly(cls, run_dir: str | Path) -> Store:
        """``RUN/state.sqlite`` opened to read only (``--dry-run``): no schema made or upgraded,
        no pragma set, no lock that keeps a run out. An older schema is refused (a run
        upgrades it), as is anything that is no tokenbridge store."""
        path = Path(run_dir) / STATE_FILE
        why = store_problem(path)
        if why is not None:
            raise StoreError(f"{why}; nothing was read")
        # SQLite makes the WAL's two files beside a WAL database even to read it
        made = not any(os.path.lexists(f"{path}{end}") for end in _WAL_FILES)
        try:
            conn = sqlite3.connect(f"{real_path(path).as_uri()}?mode=ro", uri=True, timeout=60.0, isolation_level=None,
                                   check_same_thread=False)
            try:
                row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            except sqlite3.DatabaseError:
                conn.close()
                raise
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: not a usable tokenbridge state file ({exc})") from None
        version = row[0] if row else None
        if str(version) != str(SCHEMA_VERSION):
            conn.close()
            older = " (the next run upgrades it; a dry run writes nothing)" if version in _UPGRADES else ""
            raise StoreError(f"{path}: schema version {str(version)[:40]!r}, this tokenbridge reads {SCHEMA_VERSION}{older}")
        store = cls(path, conn)
        store._readonly = True
        store._made_wal = made
        return store

    def close(self) -> None:
        self._conn.close()
        if self._readonly and self._made_wal:
            _tidy_wal(self.path)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- runs ---------------------------------------------------------------------------

    def begin_run(self, settings: dict[str, Any]) -> int:
        cur = self._conn.execute(
            "INSERT INTO runs(started_at, settings) VALUES (?, ?)", (time.time(), json.dumps(settings, sort_keys=True))
        )
        if cur.lastrowid is None:  # sqlite sets it on every INSERT into a rowid table
            raise StoreError("runs: the new row has no id")
        self.run = cur.lastrowid
        return self.run

    def end_run(self, run: int, outcome: str) -> None:
        self._conn.execute("UPDATE runs SET finished_at=?, outcome=? WHERE run=?", (time.time(), outcome, run))

    # --- samples ------------------------------------------------------------------------

    def add_samples(self, rows: Iterable[tuple[str, str, str, str]]) -> tuple[int, list[str]]:
        """Insert (id, dataset, source, request_json) rows not yet stored, after the last seq.

        Returns (how many were new, ids whose stored request differs from the given one:
        the stored request wins, so a resumed sample is never sent in a different form).
        """
        rows = list(rows)
        if not rows:  # a rerun's: nothing to lock, load or compare
            return 0, []
        with self._tx():
            self._load_incoming(rows)
            changed = [
                sid
                for (sid,) in self._conn.execute(
                    "SELECT i.id FROM incoming i JOIN samples s ON s.id = i.id WHERE s.request != i.request"
                    " ORDER BY i.pos"
                )
            ]
            (top,) = self._conn.execute("SELECT COALESCE(MAX(seq), -1) FROM samples").fetchone()
            cur = self._conn.execute(
                "INSERT INTO samples(id, seq, dataset, source, request, updated_at)"
                " SELECT id, ? + ROW_NUMBER() OVER (ORDER BY pos), dataset, source, request, ? FROM incoming"
                " WHERE id NOT IN (SELECT id FROM samples) ORDER BY pos",
                (top, time.time()),
            )
            added = cur.rowcount
            self._conn.execute("DELETE FROM incoming")
        return added, changed

    def diff_requests(self, rows: Iterable[tuple[str, str, str, str]]) -> list[tuple[str, str, str]]:
        """(id, status, stored request) of the given rows whose stored request differs (reads only)."""
        with self._tx():
            self._load_incoming(list(rows))
            out = list(
                self._conn.execute(
                    "SELECT i.id, s.status, s.request FROM incoming i JOIN samples s ON s.id = i.id"
                    " WHERE s.request != i.request ORDER BY i.pos"
                )
            )
            self._conn.execute("DELETE FROM incoming")
        return out

    def answered_elsewhere(self, rows: Iterable[tuple[str, str, str, str]],
                           ids: Iterable[str]) -> list[tuple[str, str, str, str]]:
        """(id, dataset, stored id, stored dataset) for each of ``rows`` (new samples) whose
        request a done sample not among ``ids`` already holds byte for byte: the same prompt
        under another sample id (its dataset renamed), answered and paid for. The first
        stored match per row, in the rows' order. Reads every done request once (one pass,
        matched in a dict: a join on the unindexed text took minutes for 150,000), so callers
        ask only when the store holds done samples outside ``ids``."""
        wanted = set(ids)
        asked: dict[str, list[int]] = {}
        rows = list(rows)
        for pos, row in enumerate(rows):
            asked.setdefault(row[3], []).append(pos)
        found: dict[int, tuple[str, str, str, str]] = {}
        cur = self._conn.execute("SELECT id, dataset, request FROM samples WHERE status = 'done' ORDER BY seq")
        while batch := cur.fetchmany(1024):
            for sid, dataset, request in batch:
                if sid in wanted or request not in asked:
                    continue
                for pos in asked.pop(request):
                    found[pos] = (rows[pos][0], rows[pos][1], sid, dataset)
        return [found[pos] for pos in sorted(found)]

    def replace_requests(self, pairs: Iterable[tuple[str, str]]) -> int:
        """New (id, request) for samples not done yet (a done sample keeps what it was sent with)."""
        with self._tx():
            cur = self._conn.executemany(
                "UPDATE samples SET request=?, updated_at=? WHERE id=? AND status!='done'",
                [(req, time.time(), sid) for sid, req in pairs],
            )
        return cur.rowcount

    def done_base_urls(self, ids: Iterable[str]) -> dict[str | None, tuple[int, str]]:
        """base_url -> (done samples answered from it, first such id) over the given ids."""
        with self._tx():
            self._load_wanted(ids)
            rows = self._conn.execute(
                "SELECT r.base_url, COUNT(*), MIN(w.pos) FROM wanted w"
                # the index, not the table: the autoindex on sample_id, which the planner
                # takes for this lookup, would read each row (its body) for base_url
                " JOIN responses r INDEXED BY responses_books ON r.sample_id = w.id"
                # done ids from samples_status_id: a join on samples.id would read each row
                " WHERE w.id IN (SELECT id FROM samples WHERE status='done') GROUP BY r.base_url"
            ).fetchall()
            out = {}
            for url, n, pos in rows:
                (first,) = self._conn.execute("SELECT id FROM wanted WHERE pos=?", (pos,)).fetchone()
                out[url] = (n, first)
            self._conn.execute("DELETE FROM wanted")
        return out

    def _load_incoming(self, rows: list[tuple[str, str, str, str]]) -> None:
        self._conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS incoming (pos INTEGER PRIMARY KEY, id TEXT, dataset TEXT,"
            " source TEXT, request TEXT)"
        )
        self._conn.execute("DELETE FROM incoming")
        self._conn.executemany("INSERT INTO incoming(id, dataset, source, request) VALUES (?,?,?,?)", rows)

    def _load_wanted(self, ids: Iterable[str]) -> None:
        self._conn.execute("CREATE TEMP TABLE IF NOT EXISTS wanted (pos INTEGER PRIMARY KEY, id TEXT)")
        self._conn.execute("DELETE FROM wanted")
        self._conn.executemany("INSERT INTO wanted(id) VALUES (?)", ((i,) for i in ids))

    def samples(self, ids: Iterable[str] | None = None, *, status: str | None = None) -> list[StoredSample]:
        # attempts so far = the highest attempt number logged (a kill can land between an
        # attempt's commit and its sample's update, so the log is the truth)
        sql = (
            "SELECT id, seq, dataset, request, status,"
            " (SELECT COALESCE(MAX(n), 0) FROM attempts a WHERE a.sample_id = samples.id), error_class FROM samples"
        )
        args: tuple[Any, ...] = ()
        if status is not None:
            sql += " WHERE status=?"
            args = (status,)
        sql += " ORDER BY seq"
        rows = [StoredSample(*r) for r in self._conn.execute(sql, args)]
        if ids is not None:
            wanted = set(ids)
            rows = [r for r in rows if r.id in wanted]
        return rows

    def statuses(self) -> dict[str, str]:
        """id -> status for every stored sample (without loading the requests)."""
        return dict(self._conn.execute("SELECT id, status FROM samples"))

    def status_counts(self) -> dict[str, int]:
        return dict(self._conn.execute("SELECT status, COUNT(*) FROM samples GROUP BY status"))

    def change_counts(self) -> dict[str, Any]:
        """The change counters and the samples per status: equal values, equal rows (see ``meta``)."""
        counters = dict(self._conn.execute(
            "SELECT key, CAST(value AS INTEGER) FROM meta WHERE key IN ('done_changes', 'attempt_changes')"))
        return {**counters, "samples": dict(sorted(self.status_counts().items()))}

    def exchanges_record(self) -> dict[str, Any] | None:
        """What ``exchanges.jsonl`` was last written from (:func:`.run._write_exchanges`), or None."""
        row = self._conn.execute("SELECT value FROM meta WHERE key='exchanges'").fetchone()
        try:
            value = loads_document(row[0]) if row else None
        except ValueError:  # JsonLineError too: nested too deeply to read
            return None
        return value if isinstance(value, dict) else None

    def record_exchanges(self, record: dict[str, Any]) -> None:
        with self._tx():
            self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('exchanges', ?)",
                               (json.dumps(record, sort_keys=True),))

    def total_cost(self) -> float:
        """Everything billed so far: the cost of every attempt, kept or retried."""
        # a negative/absurd figure stored by an older version never lowers the total
        (att,) = self._conn.execute(f"SELECT COALESCE(SUM(cost), 0) FROM attempts WHERE {_COST_OK}").fetchone()
        # responses stored without an attempt row (written by hand or by an older tool)
        (orphan,) = self._conn.execute(
            f"SELECT COALESCE(SUM(r.cost), 0) FROM responses r WHERE {_COST_OK.replace('cost', 'r.cost')} AND NOT EXISTS"
            " (SELECT 1 FROM attempts a WHERE a.sample_id = r.sample_id)"
        ).fetchone()
        return float(att) + float(orphan)

    def possible_cost(self) -> float:
        """What attempts without a reported cost, and requests sent without an attempt row yet,
        may have been billed (their reservations)."""
        (v,) = self._conn.execute(
            "SELECT COALESCE(SUM(possible_cost), 0) FROM attempts WHERE cost IS NULL"
        ).fetchone()
        (sent,) = self._conn.execute("SELECT COALESCE(SUM(reservation), 0) FROM in_flight WHERE reservation > 0").fetchone()
        return float(v) + float(sent)

    def settle_in_flight(self) -> int:
        """Requests a run sent and never settled (it was killed): each becomes an ``unanswered``
        attempt, its reservation as possible spend, so the books keep it and the next attempt
        of its sample takes the next number. Returns how many."""
        with self._tx():
            rows = self._conn.execute(
                "SELECT sample_id, n, run, started_at, reservation FROM in_flight ORDER BY sample_id, n").fetchall()
            self._conn.executemany(  # row after row, so each takes the next free number
                "INSERT INTO attempts(sample_id, n, run, started_at, error_class, message, possible_cost) VALUES"
                f" (?, {_NEXT_FREE_N}, ?, ?, 'unanswered', ?, ?)",
                [(sid, n, sid, run, started_at, _UNANSWERED,
                  reservation if isinstance(reservation, (int, float)) and reservation > 0 else None)
                 for sid, n, run, started_at, reservation in rows],
            )
            self._conn.execute("DELETE FROM in_flight")
        return len(rows)

    def price_observations(self) -> Iterator[tuple[str, int, int, float]]:
        """(provider, prompt tokens, completion tokens, cost) of stored responses with a cost."""
        for prov, usage_json, cost in self._conn.execute(
            "SELECT provider, usage, cost FROM responses WHERE cost IS NOT NULL AND usage IS NOT NULL"
        ):
            usage = _usage(usage_json)
            p, c = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
            if p is not None and c is not None and _plausible_cost(cost):
                yield prov or "", p, c, float(cost)

    def costed_requests(self) -> Iterator[tuple[str, float]]:
        """(request JSON, cost) of stored responses with a plausible cost."""
        for request, cost in self._conn.execute(
            "SELECT s.request, r.cost FROM responses r JOIN samples s ON s.id = r.sample_id WHERE r.cost IS NOT NULL"
        ):
            if _plausible_cost(cost):
                yield request, float(cost)

    def token_totals(self) -> tuple[int, int, float]:
        """(prompt tokens, completion tokens, cost) over stored responses that report usage."""
        p = c = 0
        cost = 0.0
        for usage_json, cst in self._conn.execute("SELECT usage, cost FROM responses WHERE usage IS NOT NULL"):
            usage = _usage(usage_json)  # rows of older versions were stored unchecked
            p += _count(usage.get("prompt_tokens")) or 0
            c += _count(usage.get("completion_tokens")) or 0
            cost += float(cst) if _plausible_cost(cst) else 0.0
        return p, c, cost

    def commit(self, batch: Batch) -> None:
        """Write one batch in one transaction (durable when this returns)."""
        if not batch:
            return
        self.stage(batch)
        self.finish()

    def stage(self, batch: Batch) -> None:
        """Open a transaction and write the batch into it (CPU work, no fsync yet)."""
        now = time.time()
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            self._conn.executemany(
                "INSERT OR REPLACE INTO in_flight(sample_id, n, run, started_at, reservation) VALUES (?,?,?,?,?)",
                [(s.sample_id, s.n, self.run, s.started_at, s.reservation) for s in batch.sends],
            )
            # append only: the number is the engine's unless taken (then the next free one)
            self._conn.executemany(
                "INSERT INTO attempts(sample_id, n, run, started_at, latency_s, http_status, error_class,"
                " message, cost, stream, possible_cost, body) VALUES"
                f" (?, {_NEXT_FREE_N},?,?,?,?,?,?,?,?,?,?)",
                [
                    (a.sample_id, a.n, a.sample_id, self.run, a.started_at, a.latency_s, a.http_status, a.error_class,
                     a.message, a.cost, int(a.stream), a.possible_cost,
                     zlib.compress(a.body, 6) if a.body is not None else None)
                    for a in batch.attempts
                ],
            )
            self._conn.executemany(  # an attempt settles its request (by the engine's number)
                "DELETE FROM in_flight WHERE sample_id=? AND n=?",
                [(a.sample_id, a.n) for a in batch.attempts] + batch.unsent,
            )
            self._conn.executemany(
                "INSERT OR IGNORE INTO responses(sample_id, body, raw_stream, provider, model, usage, cost,"
                " latency_s, started_at, finished_at, attempts, stream, base_url) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (
                        r.sample_id,
                        r.body,
                        zlib.compress(r.raw_stream, 6) if r.raw_stream is not None else None,
                        r.provider,
                        r.model,
                        json.dumps(r.usage) if r.usage is not None else None,
                        r.cost,
                        r.latency_s,
                        r.started_at,
                        r.finished_at,
                        r.attempts,
                        int(r.stream),
                        r.base_url,
                    )
                    for r in batch.responses
                ],
            )
            self._conn.executemany(
                "UPDATE samples SET status='done', error_class=NULL, error=NULL, attempts=?, updated_at=? WHERE id=?",
                [(r.attempts, now, r.sample_id) for r in batch.responses],
            )
            self._conn.executemany(
                "UPDATE samples SET status='failed', error_class=?, error=?, updated_at=?,"
                " attempts=(SELECT COALESCE(MAX(n), 0) FROM attempts WHERE sample_id=?)"
                " WHERE id=? AND status!='done'",
                [(cls, msg, now, sid, sid) for sid, cls, msg in batch.failures],
            )
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise

    def finish(self) -> None:
        """Commit the staged transaction: the fsync (and any WAL checkpoint) happens here, so
        the engine runs it in a thread while the event loop goes on."""
        try:
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    def reopen_failed(self, ids: Iterable[str]) -> int:
        """These samples, where failed, go back to pending so this run tries them again."""
        with self._tx():
            cur = self._conn.executemany(
                "UPDATE samples SET status='pending' WHERE id=? AND status='failed'", [(i,) for i in ids]
            )
        return cur.rowcount

    # --- reading back ---------------------------------------------------------------------

    def iter_done(self, ids: Iterable[str] | None = None) -> Iterator[tuple[str, str, str, bytes, dict[str, Any]]]:
        """(id, dataset, request_json, body, meta) for done samples: all of them in store order,
        or those of ``ids`` in the order given."""
        cols = (
            "s.id, s.dataset, s.request, r.body, r.provider, r.model, r.latency_s, r.cost, r.attempts,"
            " r.started_at, r.finished_at, r.stream, r.base_url"
        )
        if ids is None:
            sql = (f"SELECT {cols} FROM samples s JOIN responses r ON r.sample_id = s.id"
                   " WHERE s.status='done' ORDER BY s.seq")
        else:
            with self._tx():
                self._load_wanted(ids)
            sql = (f"SELECT {cols} FROM wanted w JOIN samples s ON s.id = w.id JOIN responses r ON r.sample_id = s.id"
                   " WHERE s.status='done' ORDER BY w.pos")
        cur = self._conn.cursor()
        cur.execute(sql)
        while True:
            rows = cur.fetchmany(256)
            if not rows:
                return
            for sid, ds, req, body, prov, model, lat, cost, att, t0, t1, stream, base_url in rows:
                meta = {
                    "provider": prov,
                    "model": model,
                    "latency_s": lat,
                    "cost": cost,
                    "attempts": att,
                    "started_at": t0,
                    "finished_at": t1,
                    "stream": bool(stream),
                }
                if base_url is not None:
                    meta["base_url"] = base_url
                # a body stored as TEXT (by hand, by an older tool) is still handed on as bytes
                yield sid, ds, req, body.encode("utf-8", "surrogatepass") if isinstance(body, str) else bytes(body), meta

    def response(self, sample_id: str) -> tuple[bytes, bytes | None] | None:
        """(body, raw SSE bytes or None) as stored for one sample."""
        row = self._conn.execute("SELECT body, raw_stream FROM responses WHERE sample_id=?", (sample_id,)).fetchone()
        if row is None:
            return None
        body, raw = row
        return bytes(body), (zlib.decompress(raw) if raw is not None else None)

    def attempts(self, sample_id: str) -> list[AttemptRecord]:
        rows = self._conn.execute(
            "SELECT sample_id, n, started_at, latency_s, http_status, error_class, message, cost, stream,"
            " possible_cost, body FROM attempts WHERE sample_id=? ORDER BY n",
            (sample_id,),
        )
        return [AttemptRecord(sid, n, started, latency, status, error_class, message, cost, stream=bool(stream),
                              possible_cost=possible, body=zlib.decompress(body) if body is not None else None)
                for sid, n, started, latency, status, error_class, message, cost, stream, possible, body in rows]

    def failures(self) -> list[tuple[str, str | None, str | None]]:
        return list(self._conn.execute("SELECT id, error_class, error FROM samples WHERE status='failed' ORDER BY seq"))

    class _Tx:
        def __init__(self, conn: sqlite3.Connection, readonly: bool = False) -> None:
            self.conn = conn
            self.begin = "BEGIN" if readonly else "BEGIN IMMEDIATE"  # a read-only one takes no write lock

        def __enter__(self) -> None:
            self.conn.execute(self.begin)

        def __exit__(self, exc_type: object, *rest: object) -> None:
            self.conn.execute("COMMIT" if exc_type is None else "ROLLBACK")

    def _tx(self) -> Store._Tx:
        return Store._Tx(self._conn, self._readonly)



def _orphaned_exchanges(run_dir: Path) -> None:
    """:class:`StoreError` when ``run_dir`` holds a non-empty exchanges file although its
    store is missing or empty: responses already paid for, which a run would send for again
    and then replace (the exchanges are written from the store)."""
    try:
        if (run_dir / EXCHANGES_FILE).stat().st_size == 0:
            return
    except OSError:
        return
    raise StoreError(
        f"{run_dir}: {EXCHANGES_FILE} holds responses but {STATE_FILE}, the store they came from, is missing or empty: "
        f"a run here would pay for every one again and write {EXCHANGES_FILE} anew without them. Restore {STATE_FILE} "
        f"(with its -wal and -shm files), or move {EXCHANGES_FILE} away to start over")

"""One ``generate`` run end to end: prompts -> store -> engine -> exchanges.jsonl.

Re-running the same settings on the same folder resumes: done samples are skipped,
failed ones are tried again, and ``exchanges.jsonl`` is rewritten from the store with
this invocation's samples (input order; other stored samples are counted in
``RunSummary.left_out``), unless it already is that file: the store records what it was
written from and which file it became (``meta.exchanges``). The whole run holds ``RUN/.lock``.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import re
import signal
import sqlite3
import tempfile
import threading
import time
import warnings
from collections import Counter
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import aiohttp
import orjson

from .. import __version__, digests
from ..digests import Digest, file_identity, read_digest
from ..display import printable
from ..exit_codes import ExitCode
from ..interrupt import stop_on_signals
from ..fsio import FILE_MODE, PRIVATE_MODE, OutputWriteError, fsync_dir, kill_point, output_file, reading, write_bytes
from ..jsonl import dumps_document, text_of
from .budget import Budget, reserved_tokens
from .body import BodyError, check_body, one_line
from .engine import DRAIN_S, Engine, StopReason, WorkItem
from .errors import AlreadyAnswered, SettingsChanged
from .lock import run_lock
from .progress import Reporter
from .prompts import SHOWN_BAD_ROWS, LoadedPrompts, Sample, keep_stored_ids, load_prompts, unread_entries
from .request import build_request
from .secrets import ApiKey, check_api_key, holds_key, placeholder_notice, read_api_key, scrub, scrub_message
from .settings import ConfigError, GenerateSettings, Prices, endpoint_identity, is_loopback_url, plain_http_problem
from .store import EXCHANGES_FILE, STATE_FILE, Store, StoreError

__all__ = [
    "EXCHANGES_FILE",
    "check_sendable",
    "ExitCode",
    "RunSummary",
    "agenerate_run",
    "generate_run",
    "write_exchanges",
]


def check_sendable(settings: GenerateSettings) -> None:
    """:class:`ConfigError` for settings no run can send from (no model, no datasets): the
    run and its dry run refuse them alike (a dry run said "0 samples", exit 0)."""
    if not settings.request.model:
        raise ConfigError("no model given (set --model or model = ... in the config)")
    if not settings.datasets:
        raise ConfigError("no prompt datasets given")
SUMMARY_FILE = "generate.json"


_STOP_CODES = {
    StopReason.PAYMENT: ExitCode.PAYMENT,
    StopReason.BUDGET: ExitCode.BUDGET,
    StopReason.UNAUTHORIZED: ExitCode.UNAUTHORIZED,
    StopReason.STORE: ExitCode.STORE,
    StopReason.INTERRUPTED: ExitCode.INTERRUPTED,
    StopReason.INTERNAL: ExitCode.INTERNAL,
}


@dataclass
class RunSummary:
    """What one invocation did; ``exit_code`` tells the CLI (and the pipeline) how it ended."""

    out_dir: str
    run: int
    samples: int  # samples of this invocation's datasets
    already_done: int  # done before this run started
    done: int  # done in this run
    failed: int  # failed in this run (reason in the store / failures)
    pending: int  # not done, not failed: stopped before they were sent
    requests: int
    spent_run: float
    spent_total: float  # billed, run folder total
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float  # the whole call: loading, sending, writing exchanges
    errors: dict[str, int]
    stop_reason: str | None
    exit_code: int
    bad_rows: list[str] = field(default_factory=list)
    spent_possible: float = 0.0  # maybe billed without a reported cost (timeouts, cut streams), folder total
    changed_requests: int = 0  # stored samples whose request differs from this invocation's
    kept_old_settings: int = 0  # done samples kept from other settings (--force-settings)
    left_out: int = 0  # done samples in the store that are not this invocation's (not in exchanges.jsonl)
    failures: list[dict[str, Any]] = field(default_factory=list)  # first 50: id, error_class, error
    notices: list[str] = field(default_factory=list)
    exchanges: str = ""
    send_s: float = 0.0  # the engine alone: first request to last commit
    bad_usage: int = 0  # responses kept whose usage fields were unusable (ignored, see generate.body)
    bad_usage_examples: list[str] = field(default_factory=list)  # first 10: "id: usage.cost = -5"
    bad_stored: int = 0  # stored responses that cannot be re-emitted (older versions): left out of exchanges
    internal_errors: int = 0  # bugs caught so the run went on (their samples failed as "internal")
    tracebacks: list[str] = field(default_factory=list)  # the first 3 of them, the key masked
    no_finish: int = 0  # samples that got answers without finish_reason this run (each sent again, billed)
    no_finish_attempts: int = 0  # those answers (kept in state.sqlite's attempt rows, not in exchanges.jsonl)
    no_finish_cost: float = 0.0  # their reported cost
    no_finish_failed: int = 0  # of the no_finish samples, those that ended failed (never answered with one)
    no_finish_examples: list[str] = field(default_factory=list)  # first 10 sample ids

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def generate_run(
    settings: GenerateSettings,
    out_dir: str | Path,
    *,
    key: ApiKey | None = None,
    reporter: Reporter | None = None,
    session: aiohttp.ClientSession | None = None,
    force_settings: bool = False,
) -> RunSummary:
    """Blocking entry point: run to completion (or a clean stop); SIGINT/SIGTERM stop cleanly.

    Loading the prompts and recording the run happen before the event loop starts, where
    the first SIGINT or SIGTERM raises ``KeyboardInterrupt`` at once (the run row, if one
    was opened, closed as interrupted; every sample added before it is whole): inside
    ``asyncio.run`` a Ctrl-C only cancelled the task at its next ``await``, so a 150,000-row
    load ran to its end and stored every sample first. While sending, the first stops
    sending and lets requests in flight be stored, a second aborts the engine; the summary
    then says interrupted (130)."""
    with ExitStack() as stack:
        with stop_on_signals():
            prepared = stack.enter_context(_prepared(settings, out_dir, key, reporter, force=force_settings))
        return asyncio.run(_execute(prepared, session, signals=True))


async def agenerate_run(
    settings: GenerateSettings,
    out_dir: str | Path,
    *,
    key: ApiKey | None = None,
    reporter: Reporter | None = None,
    session: aiohttp.ClientSession | None = None,
    signals: bool = False,
    force_settings: bool = False,
) -> RunSummary:
    """The async form of :func:`generate_run` (for callers that own an event loop; the
    loading and the run's start block that loop, as they did).

    Raises a :class:`~.errors.GenerateError` (nothing sent) for: bad settings
    (``ConfigError``), no key (``MissingApiKey``), an unreadable source
    (``PromptSourceError``), an unusable state file (``StoreError``), a run folder held by
    another process (``RunFolderBusy``), done samples made with other settings
    (``SettingsChanged``, unless ``force_settings``), new samples the folder holds
    answers to under other ids (``AlreadyAnswered``).
    """
    with _prepared(settings, out_dir, key, reporter, force=force_settings) as prepared:
        return await _execute(prepared, session, signals=signals)


@dataclass
class _Prepared:
    """A run ready to send: the folder locked, its store open and the run recorded."""

    settings: GenerateSettings
    out_dir: Path
    key: ApiKey | None
    reporter: Reporter
    store: Store
    ready: _Begun
    bad_rows: list[str]
    t0: float
    summary: RunSummary | None = None  # set once the run's end is recorded


@contextmanager
def _prepared(settings: GenerateSettings, out_dir: str | Path, key: ApiKey | None, reporter: Reporter | None, *,
              force: bool) -> Iterator[_Prepared]:
    """Everything before the first request, synchronously: the key, the prompts, the lock,
    the store and the run's row. On a clean exit the outputs are written (under the lock);
    on any other the run's row is closed (:func:`_close_run`) and nothing is written."""
    with reading(*(spec.path for spec in settings.datasets)):  # a prompt file is never swept as a stale temp
        yield from _prepared_here(settings, Path(out_dir), key, reporter, force=force)


def _prepared_here(settings: GenerateSettings, out_dir: Path, key: ApiKey | None, reporter: Reporter | None, *,
                   force: bool) -> Iterator[_Prepared]:
    """:func:`_prepared`, its inputs registered."""
    check_sendable(settings)
    if key is None:
        key = read_api_key(settings.api_key_env, required=not is_local_url(settings.base_url))
    check_request_settings(settings, key)
    if key is not None and (why := plain_http_problem(settings.base_url, settings.allow_plain_http)):
        raise ConfigError(f"base_url {why}")
    reporter = reporter or Reporter(settings.progress, interval_s=settings.log_interval_s)
    if (notice := placeholder_notice(key)) is not None:
        reporter.log(notice, warn=True)
    t0 = time.monotonic()
    rows, bad_rows = _load_rows(settings, reporter, key)

    with run_lock(out_dir):
        for stale in out_dir.glob(f".{SUMMARY_FILE}.*.tmp"):  # left by a process killed while writing
            stale.unlink(missing_ok=True)
        store = Store.open(out_dir)
        try:
            ready = _begin(store, rows, settings, key, force=force, reporter=reporter, out_dir=out_dir)
            del rows
            prepared = _Prepared(settings, out_dir, key, reporter, store, ready, bad_rows, t0)
            try:
                yield prepared
            except BaseException as exc:
                if prepared.summary is None:
                    _close_run(store, ready.run, exc)
                raise
        finally:
            store.close()
        assert prepared.summary is not None  # a clean exit is _execute's return
        _write_outputs(out_dir, ready.ids, prepared.summary, reporter)


async def _execute(prepared: _Prepared, session: aiohttp.ClientSession | None, *, signals: bool) -> RunSummary:
    """Send what is pending and record how the run ended (the summary)."""
    p, ready = prepared, prepared.ready
    engine = Engine(p.settings, p.key, p.store, ready.budget, session=session, log=p.reporter.log)
    if ready.already_done:
        p.reporter.log(f"resuming: {ready.already_done} of {len(ready.ids)} samples already done, "
                       f"{len(ready.pending)} to send")
    send_s = await _send(engine, ready.pending, p.reporter, signals)
    summary = _summarize(p.store, engine, ready, p.bad_rows, p.key, p.out_dir)
    summary.elapsed_s, summary.send_s = time.monotonic() - p.t0, send_s
    p.summary = summary
    return summary


def _close_run(store: Store, run: int, exc: BaseException) -> None:
    """Record why a run that never reached its summary ended: ``interrupted`` (Ctrl-C,
    SIGTERM, a cancelled task), ``store_error``, else ``internal_error``; a store that
    cannot take even that keeps the row open, as a kill does."""
    if isinstance(exc, (KeyboardInterrupt, asyncio.CancelledError)):
        outcome = StopReason.INTERRUPTED
    else:
        outcome = StopReason.STORE if isinstance(exc, (sqlite3.Error, StoreError)) else StopReason.INTERNAL
    with suppress(sqlite3.Error):
        store.end_run(run, outcome)


_Row = tuple[str, str, str, str]  # (id, dataset, source, request JSON)


def _load_rows(settings: GenerateSettings, reporter: Reporter, key: ApiKey | None) -> tuple[list[_Row], list[str]]:
    """The samples of every dataset as store rows, and the bad source rows (the first few said)."""
    loaded = load_prompts(settings.datasets, default_limit=settings.limit)
    rows, errors = sendable(loaded, settings, key)
    for err in errors[:SHOWN_BAD_ROWS]:
        reporter.log(f"bad row: {err}")
    if len(errors) > SHOWN_BAD_ROWS:
        reporter.log(f"... {len(errors) - SHOWN_BAD_ROWS} more bad rows (all listed in {SUMMARY_FILE})")
    for line in gave_nothing(settings, loaded) + tools_unsent(settings, loaded) + folders_unread(settings):
        reporter.log(f"warning: {line}", warn=True)
    return rows, errors


def check_request_settings(settings: GenerateSettings, key: ApiKey | None) -> None:
    """:class:`ConfigError` for a key that cannot be sent (:func:`.secrets.check_api_key`:
    its own text, the headers, ``extra_body``), and where what the settings put in every
    request (the model, provider routing, reasoning, sampling) holds the API key: named as a
    setting, before any prompt is read, not as a bad row for each prompt."""
    check_api_key(key, settings.headers, settings.request.extra_body)
    if key is not None and holds_key(json.dumps(build_request(Sample("", "", []), settings.request), ensure_ascii=False), key):
        raise ConfigError(f"request settings (model, provider, reasoning, ...) hold the API key from ${key.env_name} "
                          "(not shown here): the key is sent only as Authorization; take it out of the setting")


def sendable(loaded: LoadedPrompts, settings: GenerateSettings, key: ApiKey | None) -> tuple[list[_Row], list[str]]:
    """The store rows (:func:`store_row`) of ``loaded``'s samples but those whose request
    or id holds the API key (pasted into a prompt, a tool declaration that is sent, or the
    row's id), which leave ``loaded`` too; and every bad row, the key masked where a
    message quotes a row's value: sent, every provider would get the key, and every stored
    copy (the store, ``exchanges.jsonl``, the exports, ``generate.json``) would hold it."""
    rows = [store_row(s, settings) for s in loaded.samples]
    errors = [scrub_message(str(e), key) for e in loaded.errors]
    if key is None:
        return rows, errors
    held: dict[str, tuple[str, str, str]] = {}  # id -> (field, what holds it, where to take it out of)
    for row in rows:
        if holds_key(row[3], key):
            held[row[0]] = ("<prompt>", "its request holds the API key", "the prompt")
        elif holds_key(row[0], key):
            held[row[0]] = ("id", "its id holds the API key", "the row's id")
    if not held:
        return rows, errors
    bad = [f"{row[2]}: field '{held[row[0]][0]}': {held[row[0]][1]} from ${key.env_name} (not shown here): not sent, "
           f"so no provider gets it and nothing stored holds it; take it out of {held[row[0]][2]}"
           for row in rows if row[0] in held]
    loaded.samples[:] = [s for s in loaded.samples if s.id not in held]
    return [row for row in rows if row[0] not in held], errors + bad


def gave_nothing(settings: GenerateSettings, loaded: LoadedPrompts) -> list[str]:
    """A line for each dataset that gave no prompt although its limit allows some (as
    reconstruct says of an empty input: a typo'd or unfilled file sends nothing); the run
    warns of them, the dry run notes them."""
    given = {s.dataset for s in loaded.samples}
    return [f"dataset {spec.name} ({spec.path}) gave no prompt: nothing of it is sent" for spec in settings.datasets
            if spec.name not in given and (spec.limit if spec.limit is not None else settings.limit) != 0]


def folders_unread(settings: GenerateSettings) -> list[str]:
    """A line for each dataset folder holding entries that are not prompt files (a ``.json``
    file, a sub-folder), which are not read: a folder of a thousand files that sent one
    said nothing of the rest."""
    out = []
    for spec in settings.datasets:
        if other := unread_entries(spec):
            shown = ", ".join(map(printable, other[:5])) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
            out.append(f"dataset {spec.name} ({spec.path}): {len(other)} entr{'y' if len(other) == 1 else 'ies'} not "
                       f"read ({shown}): a folder's prompt files are its .jsonl, .parquet and .arrow files")
    return out


def tools_unsent(settings: GenerateSettings, loaded: LoadedPrompts) -> list[str]:
    """A line for each dataset whose rows carry ``tools`` that are not sent (``send_tools``
    is off, as exact tokens want: calls then come back as raw marker text): the model sees no
    declaration of them, which the rows' authors may have counted on."""
    if settings.request.send_tools:
        return []
    carry = Counter(s.dataset for s in loaded.samples if s.tools)
    return [f"dataset {name}: {n} row(s) carry tools, not sent (send_tools = false: the model sees no tool "
            "declaration, and the stored request holds none; send_tools = true sends them)"
            for name, n in carry.items()]


def store_row(sample: Sample, settings: GenerateSettings) -> _Row:
    """A sample as the store keeps it: (id, dataset, source, the request's JSON, byte for
    byte what is sent and what a renamed dataset is matched by)."""
    request = json.dumps(build_request(sample, settings.request), ensure_ascii=False, separators=(",", ":"))
    return sample.id, sample.dataset, text_of(sample.source), request


def refuse_as_the_run(store: Store, rows: list[_Row], settings: GenerateSettings, key: ApiKey | None, out_dir: Path,
                      *, force_settings: bool = False) -> list[str]:
    """What a run checks before it adds ``rows`` (:func:`store_row`, every sample of the
    run) to ``store``, for ``--dry-run`` to refuse what the run refuses, with the same
    messages: done samples made with other settings (:class:`SettingsChanged`, unless
    ``force_settings``), new samples the folder holds answers to under other ids
    (:class:`AlreadyAnswered`). Reads only. Returns the run's sample ids (a folder's older
    ids kept, as the run keeps them)."""
    stored = store.statuses()
    rows, ids = keep_stored_ids(rows, stored)
    refusal = _settings_check(store, rows, ids, settings, key, out_dir)[3]
    if refusal is not None and not force_settings:
        raise refusal
    _refuse_answered_elsewhere(store, [r for r in rows if r[0] not in stored], ids, stored, out_dir)
    return ids


def _described(settings: GenerateSettings, key: ApiKey | None) -> dict[str, Any]:
    """The settings as the store's run log keeps them, with the key masked wherever it sits
    (a gateway that takes it in ``base_url``'s path puts it there)."""
    described: dict[str, Any] = json.loads(scrub(json.dumps(settings.describe()), key))
    return described


@dataclass
class _Begun:
    """A run recorded in the store: its samples, what is left to send, the budget so far."""

    run: int
    ids: list[str]
    already_done: int
    pending: list[WorkItem]
    budget: Budget
    spent_before: float
    changed: int
    kept_old: int


def _begin(store: Store, rows: list[_Row], settings: GenerateSettings, key: ApiKey | None, *, force: bool,
           reporter: Reporter, out_dir: Path) -> _Begun:
    """Add the samples, check the stored ones against these settings, record the run and
    reopen the failed ones (a store that cannot be written is a StoreError, exit 6)."""
    try:
        stored = store.statuses()
        rows, ids = keep_stored_ids(rows, stored)  # ids from before the prefix fix
        changed, kept_old = _reconcile(store, rows, ids, stored, settings, key, force=force, reporter=reporter,
                                       out_dir=out_dir)
        kill_point("generate:samples added")
        run = store.begin_run(_described(settings, key))
    except sqlite3.Error as exc:  # a damaged page fails a read ("could not decode"), a full disk a write
        raise StoreError(f"{store.path}: cannot read or write the run state: {exc}", exit_code=ExitCode.STORE) from None
    try:
        kill_point("generate:run begun")
        store.reopen_failed(ids)
        kill_point("generate:failed reopened")
        unanswered = store.settle_in_flight()  # before the attempt counts and the spend are read
        # the requests of the samples to send only: a rerun of a finished run reads none
        pending = store.samples(ids, status="pending")
        statuses = store.statuses()
        spent_before, possible_before = store.total_cost(), store.possible_cost()
        shown_low = _table_shown_low(store, settings.prices) if settings.max_cost and pending else None
        learns = settings.max_cost and (not settings.prices or shown_low is not None)
        observations = list(store.price_observations()) if learns else []
    except BaseException as exc:  # Ctrl-C too: the run's row says how it ended, not NULL
        _close_run(store, run, exc)
        if isinstance(exc, sqlite3.Error):
            raise StoreError(f"{store.path}: cannot read or write the run state: {exc}",
                             exit_code=ExitCode.STORE) from None
        raise
    if unanswered:  # without [prices] nothing priced their reservations: "$0.0000 in all" said they cost nothing
        booked = (f"are booked at their reservations as possibly billed (${possible_before:.4f} in all)"
                  if possible_before else "may have been billed: no [prices] priced their reservations, so what they "
                  "cost is unknown and not counted")
        reporter.log(f"{unanswered} request(s) sent by an earlier run that ended without storing their answers "
                     f"(killed?) {booked}", warn=True)
    budget = Budget(settings.max_cost, settings.prices, spent=spent_before, possible=possible_before)
    if shown_low is not None:  # the engine says so before it sends anything
        budget.table_shown_low(*shown_low)
    for prov, p, c, k in observations:
        budget.observe(prov, p, c, k)
    return _Begun(run=run, ids=ids, already_done=sum(1 for i in set(ids) if statuses.get(i) == "done"),
                  pending=[WorkItem.from_stored(s) for s in pending],
                  budget=budget, spent_before=spent_before, changed=changed, kept_old=kept_old)


def _table_shown_low(store: Store, prices: Prices | None) -> tuple[float, float] | None:
    """(cost, reservation) of the first stored answer that cost more than ``prices`` reserves
    for its request (the run that stored it stopped trusting the table then), or None."""
    if prices is None:
        return None
    for request_json, cost in store.costed_requests():
        try:
            request = json.loads(request_json)
        except ValueError:  # a store row no run of this version wrote: nothing to learn from it
            continue
        reservation = prices.cost(*reserved_tokens(request_json, request))
        if cost > reservation * (1 + 1e-9):
            return cost, reservation
    return None


async def _send(engine: Engine, pending: list[WorkItem], reporter: Reporter, signals: bool) -> float:
    """Send every pending sample (SIGINT/SIGTERM stop cleanly when ``signals``); the seconds it took."""
    if pending:  # the display reads the total that engine.run() sets; nothing to send: no "0/0" bar, no display
        reporter.start(engine.stats)
    restore = _install_signals(engine, reporter) if signals else None
    t_send = time.monotonic()
    try:
        with _fewer_collections():
            await engine.run(pending)
    finally:
        send_s = time.monotonic() - t_send
        if restore:
            restore()
        await reporter.close()
    return send_s


#: The cyclic collector's thresholds while requests are in flight, each at least this
#: (CPython's default is (700, 10, 10)).
_SENDING_GC = (50_000, 20, 10)
_gc_lock = threading.Lock()
_gc_runs = 0
_gc_before: tuple[int, int, int] = (0, 0, 0)
_gc_raised: tuple[int, int, int] | None = None  # what the outermost run set (None: it left them)


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """Raise the collector's thresholds while sending; the outermost run puts them back.

    Why: hundreds of requests in flight keep thousands of young objects alive, which the
    default thresholds scan and promote over and over (3,000 requests at 512 concurrent:
    0.25 s of collections, a fifth of the client's CPU; 0.05 s with these). Cycles are
    still collected, a few megabytes later. Thresholds the caller changes meanwhile are
    theirs: they are left as the caller set them."""
    global _gc_runs, _gc_before, _gc_raised
    with _gc_lock:
        if _gc_runs == 0:
            _gc_before, _gc_raised = gc.get_threshold(), None
            if _gc_before[0] > 0:  # 0: the caller turned automatic collection off; it stays off
                raised = tuple(max(mine, theirs) for mine, theirs in zip(_SENDING_GC, _gc_before))
                gc.set_threshold(*raised)
                _gc_raised = gc.get_threshold()
        _gc_runs += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_runs -= 1
            if _gc_runs == 0 and _gc_raised is not None and gc.get_threshold() == _gc_raised:
                gc.set_threshold(*_gc_before)


def _summarize(store: Store, engine: Engine, begun: _Begun, bad_rows: list[str], key: ApiKey | None,
               out_dir: Path) -> RunSummary:
    """What the run did, from the engine's counters and the store; records the run's end."""
    stats, stop, ids, budget = engine.stats, engine.stopping, begun.ids, begun.budget
    wanted = set(ids)
    failures = [{"id": sid, "error_class": cls, "error": err} for sid, cls, err in store.failures() if sid in wanted]
    statuses = store.statuses()
    counts = [statuses[i] for i in ids]
    n_done = counts.count("done")
    n_failed = counts.count("failed")
    exit_code = _exit_code(stop, n_failed, len(bad_rows))
    notices = [scrub(n, key) for n in stats.notices]
    try:
        store.end_run(begun.run, stop or ("complete" if exit_code == ExitCode.OK else "incomplete"))
        kill_point("generate:run ended")
    except sqlite3.Error as exc:  # the disk that failed the engine may fail this too
        notices.append(f"could not record the run's end: {exc}")
    return RunSummary(
        out_dir=str(out_dir),
        run=begun.run,
        samples=len(counts),
        already_done=begun.already_done,
        done=stats.done,
        failed=stats.failed,
        pending=len(counts) - n_done - n_failed,
        requests=stats.requests,
        spent_run=budget.spent - begun.spent_before,
        spent_total=budget.spent,
        spent_possible=budget.possible,
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        elapsed_s=0.0,
        errors=dict(stats.errors),
        stop_reason=stop,
        exit_code=exit_code,
        bad_rows=bad_rows,
        changed_requests=begun.changed,
        kept_old_settings=begun.kept_old,
        left_out=sum(1 for v in statuses.values() if v == "done") - n_done,
        failures=failures[:50],
        notices=notices,
        bad_usage=stats.bad_usage,
        bad_usage_examples=list(stats.bad_usage_examples),
        internal_errors=stats.internal_errors,
        tracebacks=list(stats.tracebacks),
        no_finish=len(stats.no_finish),
        no_finish_attempts=stats.no_finish_attempts,
        no_finish_cost=stats.no_finish_cost,
        no_finish_failed=sum(1 for sid in stats.no_finish if statuses.get(sid) == "failed"),
        no_finish_examples=[sid for sid in ids if sid in stats.no_finish][:10] if stats.no_finish else [],
    )


def _write_outputs(out_dir: Path, ids: Sequence[str], summary: RunSummary, reporter: Reporter) -> None:
    """exchanges.jsonl from the store (a failure is exit 6), then generate.json (0600)."""
    try:
        path, bad = _write_exchanges(out_dir, ids)
        summary.exchanges = str(path)
        if bad:
            summary.bad_stored = len(bad)
            summary.notices.append(
                f"{len(bad)} stored response(s) cannot be re-emitted and were left out of {EXCHANGES_FILE} "
                f"(stored by an older version; e.g. {bad[0]}); send them again in a new run folder")
            reporter.log(summary.notices[-1], warn=True)
    except (OSError, sqlite3.Error, OutputWriteError) as exc:
        summary.notices.append(f"{out_dir / EXCHANGES_FILE} not rewritten: {exc}")
        summary.exit_code = summary.exit_code or ExitCode.STORE
    try:
        text = dumps_document(summary.to_dict())
        write_bytes(out_dir / SUMMARY_FILE, text.encode(), point="generate:summary", mode=PRIVATE_MODE)
    except (OSError, OutputWriteError) as exc:
        summary.notices.append(f"{out_dir / SUMMARY_FILE} not written: {exc}")


#: A path segment that may be a key (an older tokenbridge stored base URLs unmasked, and the
#: key it masked then may not be this run's): 16 or more characters of a key's alphabet, a
#: digit among them (``openrouter-proxy`` is a name, ``sk-or-v1-5f0c...`` is not).
_KEYLIKE_SEGMENT = re.compile(r"(?<=/)(?=[^/]*[0-9])[A-Za-z0-9_\-.~]{16,}(?=/|$)")


def _stored_url(url: str, key: ApiKey | None) -> str:
    """A base URL from the store, for a message: masked with this run's key, and any
    key-like path segment masked too (an older version stored the URL as given)."""
    return _KEYLIKE_SEGMENT.sub("***", scrub(url, key))


def _reconcile(
    store: Store,
    rows: list[tuple[str, str, str, str]],
    ids: list[str],
    stored: dict[str, str],
    settings: GenerateSettings,
    key: ApiKey | None,
    *,
    force: bool,
    reporter: Reporter,
    out_dir: Path,
) -> tuple[int, int]:
    """Add the new samples and check the stored ones against this invocation's settings.

    A done sample answered with another request (model, sampling, messages...) or from
    another API (``base_url``, see :func:`~.settings.endpoint_identity`) is refused with
    :class:`SettingsChanged` unless ``force``; then it keeps its stored answer. A sample
    not done yet takes the new request. Returns (samples whose request changed, done
    samples kept from other settings). Base URLs are compared and shown with ``key``
    masked, as they are stored. ``stored``: the status of each sample the store held
    before this run. New samples whose requests it holds answers to under other ids are
    refused (:func:`_refuse_answered_elsewhere`).
    """
    diffs, new_request, kept_old, refusal = _settings_check(store, rows, ids, settings, key, out_dir)
    if refusal is not None and not force:
        raise refusal
    # only the new rows: diff_requests compared the stored ones (add_samples would again,
    # reading every stored request), and a stored sample is never added twice
    new = [r for r in rows if r[0] not in stored]
    _refuse_answered_elsewhere(store, new, ids, stored, out_dir)
    store.add_samples(new)
    redo = [(sid, new_request[sid]) for sid, status, _ in diffs if status != "done"]
    if redo:
        store.replace_requests(redo)
        reporter.log(f"{len(redo)} sample(s) not done yet take the new settings (e.g. {redo[0][0]})", warn=True)
    if kept_old:
        reporter.log(f"--force-settings: {kept_old} done sample(s) keep answers made with other settings", warn=True)
    return len(diffs), kept_old


def _settings_check(store: Store, rows: list[_Row], ids: list[str], settings: GenerateSettings, key: ApiKey | None,
                    out_dir: Path) -> tuple[list[tuple[str, str, str]], dict[str, str], int, SettingsChanged | None]:
    """(stored rows whose request differs, the new request of each, done samples made with
    other settings, the :class:`SettingsChanged` that says so, None where there are none)."""
    diffs = store.diff_requests(rows)
    new_request = {r[0]: r[3] for r in rows} if diffs else {}
    done_diffs = [(sid, old) for sid, status, old in diffs if status == "done"]
    here = endpoint_identity(scrub(settings.base_url, key))
    other_urls = {u: v for u, v in store.done_base_urls(ids).items()
                  if u is not None and endpoint_identity(scrub(u, key)) != here}
    kept_old = len(done_diffs) + sum(n for n, _ in other_urls.values())
    if not (done_diffs or other_urls):
        return diffs, new_request, kept_old, None
    what = []
    if done_diffs:
        sid, old = done_diffs[0]
        what.append(f"{len(done_diffs)} with another request ({_request_delta(old, new_request[sid])}, e.g. {sid})")
    for url, (n, sid) in other_urls.items():
        what.append(f"{n} answered by {_stored_url(url, key)} (now {scrub(settings.base_url, key)}, e.g. {sid})")
    refusal = SettingsChanged(f"{out_dir}: done samples were generated with other settings: {'; '.join(what)}")
    return diffs, new_request, kept_old, refusal


def _refuse_answered_elsewhere(store: Store, new: list[_Row], ids: list[str], stored: dict[str, str],
                               out_dir: Path) -> None:
    """:class:`AlreadyAnswered` when new samples send requests the store holds answers to
    under other ids: renaming a dataset (``d=p.jsonl`` then ``dd=p.jsonl``, or a config's
    ``name = "train"`` then the file alone, named after its stem) changed every id, and the
    run paid for every answer again, saying only "(3 other stored samples left out)".
    Repeats within this run (a prompt twice in a dataset) are its own samples: not refused."""
    wanted = set(ids)
    if not new or not any(status == "done" and sid not in wanted for sid, status in stored.items()):
        return  # the common runs (a first run, a resume, a dataset added) compare nothing
    found = store.answered_elsewhere(new, ids)
    if not found:
        return
    pairs: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for sid, dataset, old_id, old_dataset in found:
        pairs.setdefault((dataset, old_dataset), []).append((sid, old_id))
    what = "; ".join(f"{len(same)} of dataset {dataset!r} as answered under dataset {old!r} (e.g. {same[0][0]} = "
                     f"{same[0][1]})" for (dataset, old), same in pairs.items())
    renamed = [(d, o) for d, o in pairs if d != o]
    if renamed:
        old = renamed[0][1]
        fix = (f"give the dataset its old name again ({old}=PATH on the command line, or name = \"{old}\" in a "
               "config; a PATH alone is named after its file)")
    else:  # the name is the same: the rows' own ids changed (edited, or removed and content-hashed)
        fix = "give the rows their old ids again (the row's id field; a row without one is named by its content)"
    raise AlreadyAnswered(
        f"{out_dir}: {len(found)} new sample(s) send requests this folder already holds answers to under other "
        f"sample ids: {what}; sending them would pay for those answers again, and nothing was sent. To use those "
        f"answers, {fix}; for fresh answers to the same prompts, use another run folder or another seed "
        "(--seed, request.seed)")


def _request_delta(old: str, new: str) -> str:
    """Which top-level request fields differ, e.g. ``max_tokens 50 -> 99``."""
    a, b = json.loads(old), json.loads(new)
    parts = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            if k in ("messages", "tools"):
                parts.append(f"{k} differ")
            else:
                parts.append(f"{k} {_short(a.get(k))} -> {_short(b.get(k))}")
    return ", ".join(parts[:4]) + (", ..." if len(parts) > 4 else "")


def _short(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=False) if v is not None else "unset"
    return text if len(text) <= 60 else text[:57] + "..."


def _exit_code(stop: str | None, failed: int, bad_rows: int) -> int:
    if stop is not None:
        return _STOP_CODES.get(stop, ExitCode.INCOMPLETE)
    return ExitCode.INCOMPLETE if failed or bad_rows else ExitCode.OK


def write_exchanges(out_dir: str | Path, ids: Sequence[str] | None = None) -> Path:
    """Rewrite ``RUN/exchanges.jsonl`` from the store, atomically: the done samples among
    ``ids`` in that order, or (``ids`` None) every done sample in store order.

    Takes the run folder's lock (:class:`RunFolderBusy` while a run holds it). A stored row
    that cannot be re-emitted (stored by an older version) is left out with a
    :class:`UserWarning` naming how many and the first; the others are written."""
    with run_lock(out_dir):
        path, bad = _write_exchanges(Path(out_dir), ids)
    if bad:
        warnings.warn(f"{path}: {len(bad)} stored response(s) cannot be re-emitted and were left out "
                      f"(e.g. {bad[0]})", stacklevel=2)
    return path


def _write_exchanges(out_dir: Path, ids: Sequence[str] | None) -> tuple[Path, list[str]]:
    """Write the file, unless it already is what the store holds; returns it and "id: reason"
    for each stored row left out because it cannot be re-emitted (never an exception for
    what is stored)."""
    if not (out_dir / STATE_FILE).is_file():
        raise FileNotFoundError(f"{out_dir / STATE_FILE}: no generate state in this folder")
    target = output_file(out_dir / EXCHANGES_FILE)  # a FIFO there would hang the read below: refused
    for stale in out_dir.glob(".exchanges.*.tmp"):  # left by a run killed while writing
        stale.unlink(missing_ok=True)
    store = Store.open(out_dir)
    bad: list[str] = []
    try:
        source = _exchanges_source(store, ids)
        kept = _kept_exchanges(store, target, source)
        if kept is not None:
            return target, kept
        digest = hashlib.sha256()
        started = digests.now_ns()
        fd, tmp = tempfile.mkstemp(prefix=".exchanges.", suffix=".tmp", dir=target.parent)  # a link's file: its folder
        try:
            os.fchmod(fd, FILE_MODE)  # the same mode as reconstructed.jsonl, which holds the same data
            with os.fdopen(fd, "wb") as fh:
                for sid, dataset, request, body, meta in store.iter_done(ids):
                    try:
                        line = _exchange_line(sid, dataset, request, body, meta)
                    except (BodyError, ValueError, TypeError) as exc:
                        bad.append(f"{sid}: {exc}")
                        continue
                    fh.write(line)
                    digest.update(line)
                fh.flush()
                os.fsync(fh.fileno())
            kill_point("generate:exchanges written")
            os.replace(tmp, target)  # a fresh inode: how a later run tells this file from any other
            kill_point("generate:exchanges replaced")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(target.parent)
        written = file_identity(target)
        if written is not None:
            # never trusted as it stands (the file is as new as the read): a later run confirms
            # it by reading it, or the pipeline does (confirm_exchanges) once it has aged
            record = {"source": source, "file": Digest(digest.hexdigest(), written, started).to_json(), "bad": bad}
            with suppress(sqlite3.Error):  # the old record names another file: the next run rewrites this one
                store.record_exchanges(record)
    finally:
        store.close()
    return target, bad


def _exchanges_source(store: Store, ids: Sequence[str] | None) -> dict[str, Any]:
    """What decides exchanges.jsonl's bytes: the ids asked for, the done samples and their
    responses (the store's ``done_changes`` counter), and the code that formats them."""
    chosen = None if ids is None else hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()
    return {"tokenbridge": __version__, "ids": chosen, "done_changes": store.change_counts().get("done_changes")}


def _kept_exchanges(store: Store, target: Path, source: dict[str, Any]) -> list[str] | None:
    """The rows left out of ``target`` when it is the file last written from ``source`` (no
    need to write it again), else None. Its identity tells, once trusted; else (fresh, or
    touched) its content is read and compared, when it is old enough to be read reliably."""
    record = store.exchanges_record()
    if record is None or record.get("source") != source:
        return None
    bad = record.get("bad")
    try:
        written = Digest.from_json(record.get("file"))
    except ValueError:
        return None
    current = file_identity(target)
    if current is None or not isinstance(bad, list) or not all(isinstance(b, str) for b in bad):
        return None
    if written.stands_for(current):
        return bad
    if not current.settled(digests.now_ns()):
        return None
    try:
        now = read_digest(target)
    except OSError:
        return None
    if now.sha256 != written.sha256:
        return None
    store.record_exchanges({**record, "file": now.to_json()})
    return bad


def confirm_exchanges(out_dir: str | Path, known: Digest) -> bool:
    """Record that ``RUN/exchanges.jsonl`` is the file generate last wrote, given a trusted
    digest of it taken by someone else (the pipeline, which reads it anyway): the next
    generate then trusts it without reading it. Returns whether anything was recorded.
    The caller holds the run folder's lock."""
    out_dir = Path(out_dir)
    if not known.trusted or not (out_dir / STATE_FILE).is_file():
        return False
    with Store.open(out_dir) as store:
        record = store.exchanges_record()
        if record is None:  # nothing recorded: from_json(None) would refuse it too
            return False
        try:
            written = Digest.from_json(record.get("file"))
        except ValueError:
            return False
        if written.trusted or written.sha256 != known.sha256 or file_identity(out_dir / EXCHANGES_FILE) != known.file:
            return False
        store.record_exchanges({**record, "file": known.to_json()})
    return True


def _exchange_line(sid: str, dataset: str, request: str, body: bytes, meta: dict[str, Any]) -> bytes:
    """One exchange record. The response is spliced in as the bytes the API sent (less the
    keep-alive whitespace around it; line breaks, which valid JSON holds only between
    tokens, become spaces), so the file carries the provider's JSON verbatim. A body that
    cannot be re-emitted so (only rows stored by older versions) raises :class:`BodyError`;
    one that gives a key twice (stored before that was refused) is written as it is, for
    reconstruct to name."""
    check_body(body, keys_once=False)
    head = orjson.dumps({"id": sid, "dataset": dataset})[:-1]
    return b"".join([head, b',"request":', request.encode("utf-8"), b',"response":', one_line(body),
                     b',"meta":', orjson.dumps(meta), b"}\n"])


def is_local_url(base_url: str) -> bool:
    """A loopback API (the emulator, a local vLLM) may run without a key."""
    return is_loopback_url(base_url)


def _install_signals(engine: Engine, reporter: Reporter) -> Callable[[], None] | None:
    """First SIGINT/SIGTERM: stop sending, give in-flight requests :data:`DRAIN_S` to finish
    and be stored. Second: abort now (in-flight requests stay pending), exit 130."""
    if threading.current_thread() is not threading.main_thread():
        return None
    loop = asyncio.get_running_loop()
    hits = {"n": 0}

    def on_signal() -> None:
        hits["n"] += 1
        if hits["n"] == 1:
            reporter.log(f"interrupted: sending stopped; waiting up to {DRAIN_S:g} s for the {engine.in_flight} "
                         "request(s) in flight to be stored (press Ctrl-C again to stop at once); "
                         "rerun the same command to continue")
            engine.request_stop(StopReason.INTERRUPTED, drain_s=DRAIN_S)
        else:
            reporter.log("interrupted again: stopping now; what was received is kept, requests in flight stay pending")
            engine.abort()

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):
            pass

    def restore() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return restore

"""One ``generate`` run end to end: prompts -> store -> engine -> exchanges.jsonl.

Re-running the same settings on the same folder resumes: done samples are skipped,
failed ones are tried again, and ``exchanges.jsonl`` is rewritten from the store with
this invocation's samples (input order; other stored samples are counted in
``RunSummary.left_out``). The whole run holds ``RUN/.lock``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlparse

import aiohttp

from .budget import Budget
from .engine import Engine, StopReason, WorkItem
from .errors import SettingsChanged
from .lock import run_lock
from .progress import Reporter
from .prompts import keep_stored_ids, load_prompts
from .request import build_request
from .secrets import ApiKey, read_api_key, scrub
from .settings import ConfigError, GenerateSettings, endpoint_identity
from .store import STATE_FILE, Store, StoreError

__all__ = [
    "EXCHANGES_FILE",
    "ExitCode",
    "RunSummary",
    "agenerate_run",
    "generate_run",
    "write_exchanges",
]

EXCHANGES_FILE = "exchanges.jsonl"
SUMMARY_FILE = "generate.json"


class ExitCode:
    """``RunSummary.exit_code`` and the CLI's exit status (see the package docstring)."""

    OK = 0
    INCOMPLETE = 1  # finished, but some samples failed or some rows were bad
    USAGE = 2
    PAYMENT = 3
    BUDGET = 4
    UNAUTHORIZED = 5
    STORE = 6
    BUSY = 7  # another process holds the run folder
    INTERRUPTED = 130


_STOP_CODES = {
    StopReason.PAYMENT: ExitCode.PAYMENT,
    StopReason.BUDGET: ExitCode.BUDGET,
    StopReason.UNAUTHORIZED: ExitCode.UNAUTHORIZED,
    StopReason.STORE: ExitCode.STORE,
    StopReason.INTERRUPTED: ExitCode.INTERRUPTED,
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
    """Blocking entry point: run to completion (or a clean stop); SIGINT/SIGTERM stop cleanly."""
    return asyncio.run(
        agenerate_run(settings, out_dir, key=key, reporter=reporter, session=session, signals=True,
                      force_settings=force_settings)
    )


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
    """The async form of :func:`generate_run` (for callers that own an event loop).

    Raises a :class:`~.errors.GenerateError` (nothing sent) for: bad settings
    (``ConfigError``), no key (``MissingApiKey``), an unreadable source
    (``PromptSourceError``), an unusable state file (``StoreError``), a run folder held by
    another process (``RunFolderBusy``), done samples made with other settings
    (``SettingsChanged``, unless ``force_settings``).
    """
    out_dir = Path(out_dir)
    if not settings.request.model:
        raise ConfigError("no model given (set --model or model = ... in the config)")
    if not settings.datasets:
        raise ConfigError("no prompt datasets given")
    if key is None:
        key = read_api_key(settings.api_key_env, required=not is_local_url(settings.base_url))
    reporter = reporter or Reporter(settings.progress, interval_s=settings.log_interval_s)
    t0 = time.monotonic()

    loaded = load_prompts(settings.datasets, default_limit=settings.limit)
    for err in loaded.errors[:20]:
        reporter.log(f"bad row: {err}")
    if len(loaded.errors) > 20:
        reporter.log(f"... {len(loaded.errors) - 20} more bad rows (all listed in {SUMMARY_FILE})")
    rows = [
        (s.id, s.dataset, s.source, json.dumps(build_request(s, settings.request), ensure_ascii=False, separators=(",", ":")))
        for s in loaded.samples
    ]
    ids = [r[0] for r in rows]
    bad_rows = [str(e) for e in loaded.errors]
    del loaded

    with run_lock(out_dir):
        store = Store.open(out_dir)
        try:
            try:
                rows, ids = keep_stored_ids(rows, store.statuses())  # ids from before the prefix fix
                changed, kept_old = _reconcile(store, rows, ids, settings, force_settings, reporter, out_dir)
                del rows
                run = store.begin_run(settings.describe())
                store.reopen_failed(ids)
                current = store.samples(ids)
                spent_before, possible_before = store.total_cost(), store.possible_cost()
                observations = list(store.price_observations()) if settings.max_cost and not settings.prices else []
            except sqlite3.Error as exc:
                raise StoreError(f"{store.path}: cannot write the run state: {exc}", exit_code=ExitCode.STORE) from None
            already_done = sum(1 for s in current if s.status == "done")
            pending = [WorkItem.from_stored(s) for s in current if s.status == "pending"]
            del current
            budget = Budget(settings.max_cost, settings.prices, spent=spent_before, possible=possible_before)
            for prov, p, c, k in observations:
                budget.observe(prov, p, c, k)
            engine = Engine(settings, key, store, budget, session=session, log=reporter.log)
            if already_done:
                reporter.log(f"resuming: {already_done} of {len(ids)} samples already done, {len(pending)} to send")
            reporter.start(engine.stats)
            restore = _install_signals(engine) if signals else None
            t_send = time.monotonic()
            try:
                stats = await engine.run(pending)
            finally:
                send_s = time.monotonic() - t_send
                if restore:
                    restore()
                await reporter.close()
            stop = engine.stopping
            wanted = set(ids)
            failures = [{"id": sid, "error_class": cls, "error": err} for sid, cls, err in store.failures() if sid in wanted]
            statuses = store.statuses()
            counts = [statuses[i] for i in ids]
            n_done = counts.count("done")
            n_failed = counts.count("failed")
            exit_code = _exit_code(stop, n_failed, len(bad_rows))
            notices = [scrub(n, key) for n in stats.notices]
            try:
                store.end_run(run, stop or ("complete" if exit_code == ExitCode.OK else "incomplete"))
            except sqlite3.Error as exc:  # the disk that failed the engine may fail this too
                notices.append(f"could not record the run's end: {exc}")
            left_out = sum(1 for v in statuses.values() if v == "done") - n_done
            summary = RunSummary(
                out_dir=str(out_dir),
                run=run,
                samples=len(counts),
                already_done=already_done,
                done=stats.done,
                failed=stats.failed,
                pending=len(counts) - n_done - n_failed,
                requests=stats.requests,
                spent_run=budget.spent - spent_before,
                spent_total=budget.spent,
                spent_possible=budget.possible,
                prompt_tokens=stats.prompt_tokens,
                completion_tokens=stats.completion_tokens,
                elapsed_s=time.monotonic() - t0,
                send_s=send_s,
                errors=dict(stats.errors),
                stop_reason=stop,
                exit_code=exit_code,
                bad_rows=bad_rows,
                changed_requests=changed,
                kept_old_settings=kept_old,
                left_out=left_out,
                failures=failures[:50],
                notices=notices,
            )
        finally:
            store.close()
        try:
            summary.exchanges = str(_write_exchanges(out_dir, ids))
        except (OSError, sqlite3.Error) as exc:
            summary.notices.append(f"{out_dir / EXCHANGES_FILE} not rewritten: {exc}")
            summary.exit_code = summary.exit_code or ExitCode.STORE
        try:
            _atomic_write(out_dir / SUMMARY_FILE,
                          (json.dumps(summary.to_dict(), indent=2, ensure_ascii=False) + "\n").encode())
        except OSError as exc:
            summary.notices.append(f"{out_dir / SUMMARY_FILE} not written: {exc}")
    return summary


def _reconcile(
    store: Store,
    rows: list[tuple[str, str, str, str]],
    ids: list[str],
    settings: GenerateSettings,
    force: bool,
    reporter: Reporter,
    out_dir: Path,
) -> tuple[int, int]:
    """Add the new samples and check the stored ones against this invocation's settings.

    A done sample answered with another request (model, sampling, messages...) or from
    another API (``base_url``, see :func:`~.settings.endpoint_identity`) is refused with
    :class:`SettingsChanged` unless ``force``; then it keeps its stored answer. A sample
    not done yet takes the new request. Returns (samples whose request changed, done
    samples kept from other settings).
    """
    diffs = store.diff_requests(rows)
    new_request = {r[0]: r[3] for r in rows} if diffs else {}
    done_diffs = [(sid, old) for sid, status, old in diffs if status == "done"]
    here = endpoint_identity(settings.base_url)
    other_urls = {u: v for u, v in store.done_base_urls(ids).items() if u is not None and endpoint_identity(u) != here}
    kept_old = len(done_diffs) + sum(n for n, _ in other_urls.values())
    if (done_diffs or other_urls) and not force:
        what = []
        if done_diffs:
            sid, old = done_diffs[0]
            what.append(f"{len(done_diffs)} with another request ({_request_delta(old, new_request[sid])}, e.g. {sid})")
        for url, (n, sid) in other_urls.items():
            what.append(f"{n} answered by {url} (now {settings.base_url}, e.g. {sid})")
        raise SettingsChanged(
            f"{out_dir}: done samples were generated with other settings: {'; '.join(what)}. "
            "Use a new --out, or --force-settings to keep those answers and send only the rest with these settings"
        )
    store.add_samples(rows)
    redo = [(sid, new_request[sid]) for sid, status, _ in diffs if status != "done"]
    if redo:
        store.replace_requests(redo)
        reporter.log(f"{len(redo)} sample(s) not done yet take the new settings (e.g. {redo[0][0]})")
    if kept_old:
        reporter.log(f"--force-settings: {kept_old} done sample(s) keep answers made with other settings")
    return len(diffs), kept_old


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

    Takes the run folder's lock (:class:`RunFolderBusy` while a run holds it)."""
    with run_lock(out_dir):
        return _write_exchanges(Path(out_dir), ids)


def _write_exchanges(out_dir: Path, ids: Sequence[str] | None) -> Path:
    if not (out_dir / STATE_FILE).is_file():
        raise FileNotFoundError(f"{out_dir / STATE_FILE}: no generate state in this folder")
    target = out_dir / EXCHANGES_FILE
    for stale in out_dir.glob(".exchanges.*.tmp"):  # left by a run killed while writing
        stale.unlink(missing_ok=True)
    store = Store.open(out_dir)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".exchanges.", suffix=".tmp", dir=out_dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                for sid, dataset, request, body, meta in store.iter_done(ids):
                    fh.write(_exchange_line(sid, dataset, request, body, meta))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    finally:
        store.close()
    _fsync_dir(out_dir)
    return target


def _exchange_line(sid: str, dataset: str, request: str, body: bytes, meta: dict[str, Any]) -> bytes:
    """One exchange record. The response is spliced in as the bytes the API sent (less the
    keep-alive whitespace around it), so the file carries the provider's JSON verbatim."""
    raw = body.strip()
    if raw.startswith(b"{") and b"\n" not in raw and b"\r" not in raw:
        head = json.dumps({"id": sid, "dataset": dataset}, ensure_ascii=False, separators=(",", ":"))[:-1]
        tail = json.dumps(meta, ensure_ascii=False, separators=(",", ":"))
        return b"".join(
            [head.encode(), b',"request":', request.encode(), b',"response":', raw, b',"meta":', tail.encode(), b"}\n"]
        )
    # pretty-printed or otherwise multi-line JSON: one line needs a re-serialisation
    record = {"id": sid, "dataset": dataset, "request": json.loads(request), "response": json.loads(body), "meta": meta}
    try:
        return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (\ud800 in the body): keep it escaped
        return (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_local_url(base_url: str) -> bool:
    """A loopback API (the emulator, a local vLLM) may run without a key."""
    host = urlparse(base_url).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


def _install_signals(engine: Engine):
    """First SIGINT/SIGTERM: stop sending, let in-flight finish. Second: abort now."""
    if threading.current_thread() is not threading.main_thread():
        return None
    loop = asyncio.get_running_loop()
    hits = {"n": 0}
    main_task = asyncio.current_task()

    def on_signal() -> None:
        hits["n"] += 1
        if hits["n"] == 1:
            engine.request_stop(StopReason.INTERRUPTED)
        elif main_task is not None:
            main_task.cancel()

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


"""One ``generate`` run end to end: prompts -> store -> engine -> exchanges.jsonl.

Re-running the same settings on the same folder resumes: done samples are skipped,
failed ones are tried again, and ``exchanges.jsonl`` is rewritten from the store.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp

from .budget import Budget
from .engine import Engine, StopReason, WorkItem
from .progress import Reporter
from .prompts import load_prompts
from .request import build_request
from .secrets import ApiKey, read_api_key, scrub
from .settings import ConfigError, GenerateSettings
from .store import STATE_FILE, Store

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
    OK = 0
    INCOMPLETE = 1  # finished, but some samples failed or some rows were bad
    USAGE = 2
    PAYMENT = 3
    BUDGET = 4
    UNAUTHORIZED = 5
    STORE = 6
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
    spent_total: float
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float  # the whole call: loading, sending, writing exchanges
    errors: dict[str, int]
    stop_reason: str | None
    exit_code: int
    bad_rows: list[str] = field(default_factory=list)
    changed_requests: int = 0
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
) -> RunSummary:
    """Blocking entry point: run to completion (or a clean stop); SIGINT/SIGTERM stop cleanly."""
    return asyncio.run(agenerate_run(settings, out_dir, key=key, reporter=reporter, session=session, signals=True))


async def agenerate_run(
    settings: GenerateSettings,
    out_dir: str | Path,
    *,
    key: ApiKey | None = None,
    reporter: Reporter | None = None,
    session: aiohttp.ClientSession | None = None,
    signals: bool = False,
) -> RunSummary:
    """The async form of :func:`generate_run` (for callers that own an event loop)."""
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

    store = Store.open(out_dir)
    try:
        run = store.begin_run(settings.describe())
        _added, changed = store.add_samples(rows)
        del rows
        if changed:
            reporter.log(
                f"{len(changed)} sample(s) already stored with a different request (e.g. {changed[0]}); "
                "the stored requests are kept - use a new --out to change settings"
            )
        store.reopen_failed(ids)
        current = store.samples(ids)
        already_done = sum(1 for s in current if s.status == "done")
        pending = [WorkItem.from_stored(s) for s in current if s.status == "pending"]
        spent_before = store.total_cost()
        budget = Budget(settings.max_cost, settings.prices, spent=spent_before)
        engine = Engine(settings, key, store, budget, session=session, log=reporter.log)
        if already_done:
            reporter.log(f"resuming: {already_done} of {len(current)} samples already done, {len(pending)} to send")
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
        store.end_run(run, stop or ("complete" if exit_code == ExitCode.OK else "incomplete"))
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
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            elapsed_s=time.monotonic() - t0,
            send_s=send_s,
            errors=dict(stats.errors),
            stop_reason=stop,
            exit_code=exit_code,
            bad_rows=bad_rows,
            changed_requests=len(changed),
            failures=failures[:50],
            notices=[scrub(n, key) for n in stats.notices],
        )
    finally:
        store.close()
    summary.exchanges = str(write_exchanges(out_dir))
    _atomic_write(out_dir / SUMMARY_FILE, (json.dumps(summary.to_dict(), indent=2, ensure_ascii=False) + "\n").encode())
    return summary


def _exit_code(stop: str | None, failed: int, bad_rows: int) -> int:
    if stop is not None:
        return _STOP_CODES.get(stop, ExitCode.INCOMPLETE)
    return ExitCode.INCOMPLETE if failed or bad_rows else ExitCode.OK


def write_exchanges(out_dir: str | Path) -> Path:
    """Rewrite ``RUN/exchanges.jsonl`` from the store (done samples, input order), atomically."""
    out_dir = Path(out_dir)
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
                for sid, dataset, request, body, meta in store.iter_done():
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


"""The request engine: asyncio + one shared aiohttp session, bounded and adaptive.

``concurrency`` workers pull samples in input order; each send first takes a slot from
the :class:`~.limiter.AdaptiveLimiter` (which shrinks when 429s are a real share) and a reservation from the
:class:`~.budget.Budget`. A retry is scheduled with ``call_later`` (jittered exponential
backoff, at least ``Retry-After``) instead of sleeping in a worker, so backoff never
idles a slot. Finished responses go to :class:`StoreWriter`, which commits them in small
batches; a sample is counted done only after its commit returns.

Stops: 402 (payment), the budget cap, 10 straight 401s with no success, a failed store
write, or :meth:`Engine.request_stop` (SIGINT). Each stops *new* sends; requests in
flight finish and are stored (after a store failure they are dropped: nothing more can
be stored); what was never sent stays pending for the next run.

Every request is recorded in the store (``in_flight``, with its reservation) and that
commit returns *before* it goes out, so nothing that may have been billed leaves the
books: one cut off by :meth:`Engine.abort` (or a bug) gets an ``interrupted`` (``internal``)
attempt row with its reservation as possible spend; one cut off by ``kill -9`` becomes an
``unanswered`` attempt when the next run begins (:meth:`~.store.Store.settle_in_flight`).
The cost is one more row per request in a group commit.

A 404 "No endpoints found" is remembered per :func:`~.request.routing_key` (every body
field but the messages; tools by presence): later samples with the same key fail
unsent (``no_endpoints_skipped``; the next run sends each of them once). A 404 that
speaks of context or length depends on the prompt, so it fails only its own sample.

Limits: every attempt, streamed or not, ends after ``attempt_timeout_s`` in all (a
stream of ``: OPENROUTER PROCESSING`` keep-alives resets nothing); a non-streamed one
also after ``timeout_s``, a streamed one after ``read_timeout_s`` of silence. A body or
stream over ``max_response_bytes`` is refused while it is read (``response_too_large``,
failed: a retry would be as large). A stream is read to ``[DONE]`` or its end; one cut
after every choice finished is kept (without usage if the usage chunk never came).

The network boundary (see :mod:`.body`): the key is masked in a body before anything
reads it (so no clipped message can keep part of it), a 200 is kept only if it can be
re-emitted losslessly (one that cannot was paid for all the same: it is billed and its
bytes stay in its attempt row), and ``usage`` is validated field by field once, here; nothing
after this point trusts a value from the network. A background task that dies (the
store writer) stops the run with ``StopReason.INTERNAL``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import sqlite3
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from collections.abc import AsyncIterator, Callable, Iterable

import aiohttp
import orjson

from ..fsio import kill_point
from .body import CheckedUsage, ResponseTooLarge, checked_usage, read_capped
from .budget import Budget, cap_setting, completion_cap, cost_of, linked_media, reserved_tokens, usd
from .classify import TRANSPORT_FAILURES, Outcome, classify_exception, classify_response, classify_too_large
from .limiter import AdaptiveLimiter
from .progress import RateMeter
from .request import routing_key, wire_body
from .secrets import MIN_MASKED, ApiKey, compressed_key, mask_scattered, scattered_key, scrub, scrub_bytes, scrub_message
from .settings import GenerateSettings
from .sse import SSEDecoder, SSEEvent, StreamAssembler, StreamError
from .store import AttemptRecord, Batch, ResponseRecord, SendRecord, Store, StoredSample

__all__ = ["DRAIN_S", "Engine", "EngineStats", "StopReason", "WorkItem", "make_session"]

#: After an interrupt, requests in flight get this long to finish and be stored.
DRAIN_S = 60.0
_MAX_MESSAGE = 500
_MAX_TRACEBACKS = 3


_UNAUTHORIZED_STOP = 10
# a 404 "No endpoints" about the prompt's size says nothing about other samples
_SAMPLE_SPECIFIC_404 = re.compile(r"context|length|too (long|large)|tokens", re.IGNORECASE)


class StopReason:
    """Why an engine run ended early (None when everything was attempted)."""

    PAYMENT = "payment_required"
    BUDGET = "budget_reached"
    UNAUTHORIZED = "unauthorized"
    INTERRUPTED = "interrupted"
    STORE = "store_error"
    INTERNAL = "internal_error"  # a background task died (a bug): nothing more can be stored


@dataclass
class WorkItem:
    sample_id: str
    seq: int
    request_json: str
    prior_attempts: int
    prompt_tokens_est: int
    completion_reserve: int
    routing: str
    tries: int = 0  # attempts in this run
    sent_at: float = 0.0  # monotonic time the latest attempt was sent
    granted_at: float = 0.0  # when the limiter gave the latest attempt its slot (the limit it was sent under)
    send_anyway: bool = False  # skipped for another sample's 404 last time: send it once

    @classmethod
    def from_stored(cls, s: StoredSample) -> WorkItem:
        req = json.loads(s.request)
        prompt, reserve = reserved_tokens(s.request, req)
        return cls(s.id, s.seq, s.request, s.attempts, prompt, reserve, routing_key(req),
                   send_anyway=s.error_class == "no_endpoints_skipped")


@dataclass
class EngineStats:
    """Live counters for progress display and the run summary."""

    total: int = 0
    done: int = 0
    failed: int = 0
    abandoned: int = 0
    requests: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)
    meter: RateMeter = field(default_factory=RateMeter)  # completions and tokens per second
    in_flight: int = 0
    limit: float = 0.0
    spent: float = 0.0
    possible: float = 0.0  # maybe billed, no cost reported (see budget)
    no_usage: int = 0  # responses kept without usage
    bad_usage: int = 0  # responses whose usage had fields dropped at the boundary (see .body)
    bad_usage_examples: list[str] = field(default_factory=list)  # "id: usage.cost = -5", first 10
    no_finish: set[str] = field(default_factory=set)  # samples answered without finish_reason (Outcome.no_finish)
    no_finish_attempts: int = 0  # those answers: each one sent again, and billed
    no_finish_cost: float = 0.0  # their reported cost (one with none reported counts as possibly billed)
    stop_reason: str | None = None
    notices: list[str] = field(default_factory=list)
    internal_errors: int = 0  # bugs caught so the run goes on (samples failed as "internal")
    tracebacks: list[str] = field(default_factory=list)  # the first few, key masked

    def rates(self) -> tuple[float, float]:
        """(samples/s, completion tokens/s) over the recent window."""
        return self.meter.rates()


def make_session(
    concurrency: int, *, proxy_from_env: bool = False, headers: dict[str, str] | None = None
) -> aiohttp.ClientSession:
    """One session for the whole run, its connection pool sized to the concurrency.

    ``proxy_from_env`` (HTTPS_PROXY, netrc) is off by default: aiohttp then looks both up
    in a thread for every request, which costs a third of the throughput.
    """
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=30)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), trust_env=proxy_from_env, headers=headers
    )


#: How long a store write waits, past SQLite's own wait, for another program to let go of the
#: store's lock before the run stops (exit 6) with the answers of that write still pending.
STORE_LOCK_WAIT_S = 600.0


class StoreWriter:
    """Batches store writes; callbacks run after the batch's commit returned.

    Group commit: whatever arrives while the loop is busy goes into the next batch, so
    batches grow with load while an idle run commits each response at once (the window
    in which a ``kill -9`` loses a received response is one commit, not a timer).
    """

    def __init__(self, store: Store, interval_s: float) -> None:
        self.store = store
        self.interval_s = interval_s
        self._batch = Batch()
        self._callbacks: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenbridge-commit")
        self.error: BaseException | None = None
        self.on_error: Callable[[BaseException], None] | None = None
        #: told once when another program holds the store's lock past SQLite's own wait
        self.on_busy: Callable[[BaseException], None] | None = None
        #: the run was told to stop at once: a lock is no longer waited for
        self.aborted = False

    def sending(self, rec: SendRecord) -> asyncio.Future[None]:
        """Record a request about to go out; the future is done once that is committed."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def committed() -> None:
            if not done.done():  # its waiter may have been cancelled
                done.set_result(None)

        self._batch.sends.append(rec)
        self._callbacks.append(committed)
        self._wake.set()
        return done

    def unsent(self, sample_id: str, n: int) -> None:
        """A request recorded by :meth:`sending` that did not go out after all."""
        self._batch.unsent.append((sample_id, n))
        self._wake.set()

    def attempt(self, rec: AttemptRecord) -> None:
        self._batch.attempts.append(rec)
        self._wake.set()

    def response(self, rec: ResponseRecord, on_commit: Callable[[], None]) -> None:
        self._batch.responses.append(rec)
        self._callbacks.append(on_commit)
        self._wake.set()

    def failure(self, sample_id: str, error_class: str, message: str, on_commit: Callable[[], None]) -> None:
        self._batch.failures.append((sample_id, error_class, message))
        self._callbacks.append(on_commit)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            # let the responses that are ready in this loop turn join the batch
            await asyncio.sleep(self.interval_s if not self._closed and self.interval_s > 0 else 0)
            self._wake.clear()
            batch, callbacks = self._batch, self._callbacks
            self._batch, self._callbacks = Batch(), []
            if batch:
                try:
                    await self._commit(batch)
                except (sqlite3.Error, OSError) as exc:  # disk full, a lock never let go: stop, keep what is committed
                    self.error = exc
                    if self.on_error:
                        self.on_error(exc)
                    return
                kill_point("generate:store.commit")
                for cb in callbacks:
                    cb()  # counters only; an exception here ends the task and Engine.run stops the run
            if self._closed and not self._batch:
                return

    async def _commit(self, batch: Batch) -> None:
        """Stage and commit ``batch`` in the writer's thread (the event loop goes on reading
        answers while SQLite waits for a lock). Another program holding the store's lock past
        SQLite's own wait (a ``sqlite3`` shell in a transaction) is waited for, up to
        :data:`STORE_LOCK_WAIT_S`: the batch holds answers already paid for, and failing there
        left them pending, bought again on the next run (a cold tester's). Each try is all or
        nothing (:meth:`Store.stage` and :meth:`Store.finish` roll back on failure)."""
        loop = asyncio.get_running_loop()
        waited_since: float | None = None
        while True:
            try:
                await loop.run_in_executor(self._pool, self._stage_and_finish, batch)
                return
            except sqlite3.OperationalError as exc:
                locked = any(word in str(exc).lower() for word in ("locked", "busy"))
                now = time.monotonic()
                waited_since = now if waited_since is None else waited_since
                if not locked or self.aborted or now - waited_since >= STORE_LOCK_WAIT_S:
                    raise
                if self.on_busy is not None and now == waited_since:
                    self.on_busy(exc)
                await asyncio.sleep(1.0)

    def _stage_and_finish(self, batch: Batch) -> None:
        self.store.stage(batch)
        kill_point("generate:store.stage")
        self.store.finish()

    async def close(self, task: asyncio.Task[None]) -> None:
        self._closed = True
        self._wake.set()
        await task
        self._pool.shutdown(wait=True)


class Engine:
    """Send every work item until it is stored, failed, or the run is stopped."""

    def __init__(
        self,
        settings: GenerateSettings,
        key: ApiKey | None,
        store: Store,
        budget: Budget,
        *,
        session: aiohttp.ClientSession | None = None,
        log: Callable[[str], None] = lambda msg: None,
    ) -> None:
        self.s = settings
        self.key = key
        self.store = store
        self.budget = budget
        self.stats = EngineStats()
        self.limiter = AdaptiveLimiter(settings.concurrency, floor=settings.min_concurrency)
        self._session = session
        self._log = log
        self._url = settings.base_url.rstrip("/") + "/chat/completions"
        self._stored_url = scrub(settings.base_url, key)  # a gateway may take the key in the path
        self._headers = {"Content-Type": "application/json", **dict(settings.headers)}
        if key is not None:
            self._headers["Authorization"] = f"Bearer {key.value}"
        self._request_headers: dict[str, str] | None = self._headers
        self._unavailable: dict[str, tuple[str, str]] = {}  # routing key -> (message, sample that got it)
        #: (sample, attempt) -> what its read had given when the run aborted it (:meth:`_attempt`)
        self._cut_short: dict[tuple[str, int], tuple[Outcome, ResponseRecord | None, AttemptRecord, CheckedUsage]] = {}
        self._unauthorized_streak = 0
        self._successes = 0
        self._queue: asyncio.PriorityQueue[tuple[int, WorkItem]] | None = None
        self._timers: dict[str, tuple[asyncio.TimerHandle, WorkItem]] = {}
        self._outstanding = 0
        self._all_done: asyncio.Event | None = None
        self._settled: asyncio.Event | None = None
        self._writer: StoreWriter | None = None
        self._stopping: str | None = None
        self.aborted = False

    # --- public -----------------------------------------------------------------------

    def request_stop(self, reason: str = StopReason.INTERRUPTED, *, drain_s: float | None = None) -> None:
        """Send nothing new; requests in flight finish and are stored (within ``drain_s``
        seconds when given: then the rest are cancelled and stay pending)."""
        if drain_s is not None and self._all_done is not None:
            asyncio.get_running_loop().call_later(drain_s, self.abort)
        if self._stopping is None:
            self._stopping = reason
            self.stats.stop_reason = reason
            for handle, item in list(self._timers.values()):
                handle.cancel()
                self._abandon(item)
            self._timers.clear()
            if self._settled is not None:
                self._settled.set()

    def abort(self) -> None:
        """Stop now: requests in flight are cancelled (their samples stay pending, each request
        booked at its reservation as possible spend); what was already received is still committed."""
        self.request_stop(StopReason.INTERRUPTED)
        self.aborted = True
        if self._writer is not None:
            self._writer.aborted = True
        if self._all_done is not None:
            self._all_done.set()

    @property
    def in_flight(self) -> int:
        return self.stats.in_flight

    @property
    def stopping(self) -> str | None:
        return self._stopping

    async def run(self, items: list[WorkItem]) -> EngineStats:
        self.stats.total = len(items)
        self.stats.limit = self.limiter.limit
        if not items:
            return self.stats
        self._queue = asyncio.PriorityQueue()
        for item in items:
            self._queue.put_nowait((item.seq, item))
        self._outstanding = len(items)
        self._all_done = asyncio.Event()
        self._settled = asyncio.Event()
        self._writer = StoreWriter(self.store, self.s.commit_interval_s)
        self._writer.on_error = lambda exc: self._store_failed(exc)
        self._writer.on_busy = lambda exc: self._notice(
            f"the store is locked by another program ({exc}): waiting up to {STORE_LOCK_WAIT_S:.0f} s for it; the "
            "answers received meanwhile are kept in memory until they can be written")
        self._prices_overrun()  # one an earlier run stored: said before anything is sent
        writer_task = asyncio.create_task(self._writer.run(), name="tokenbridge-store-writer")
        session = self._session
        own_session = session is None
        if session is None:  # headers set once on our own session instead of merged per request
            session = make_session(self.s.concurrency, proxy_from_env=self.s.proxy_from_env, headers=self._headers)
            self._request_headers = None
        workers = [asyncio.create_task(self._worker(session)) for _ in range(self.s.concurrency)]
        try:
            done_wait = asyncio.create_task(self._all_done.wait())
            await asyncio.wait([done_wait, writer_task], return_when=asyncio.FIRST_COMPLETED)
            done_wait.cancel()
            exc = writer_task.exception() if writer_task.done() and not writer_task.cancelled() else None
            if exc is not None:
                self._internal(exc)
                self._notice(f"stopping: internal error in the store writer ({type(exc).__name__}: {exc}); "
                             "responses not yet committed stay pending")
                self.request_stop(StopReason.INTERNAL)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            if not writer_task.done():
                await self._writer.close(writer_task)
            if own_session:
                await session.close()
        self._over_cap()
        return self.stats  # a store failure is stop_reason STORE, with its notice

    # --- workers ----------------------------------------------------------------------

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        assert self._queue is not None
        while True:
            _, item = await self._queue.get()
            try:
                await self._process(session, item)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug must not hang the run: fail this sample, go on
                self._internal(exc)  # counted, its traceback kept
                self._notice(f"internal error on {item.sample_id}: {type(exc).__name__}: {exc}")
                self._fail(item, "internal", f"{type(exc).__name__}: {exc}")  # _fail scrubs the key

    async def _process(self, session: aiohttp.ClientSession, item: WorkItem) -> None:
        if self._stopping:
            self._abandon(item)
            return
        known = self._unavailable.get(item.routing)
        if known is not None and not item.send_anyway:
            self._fail(item, "no_endpoints_skipped", f"not sent: {known[1]} with the same routing got: {known[0]}")
            return
        reservation = self.budget.admit(item.prompt_tokens_est, item.completion_reserve)
        if reservation is None:
            reservation = await self._admit(item)
        if reservation is None:
            self._abandon(item)
            return
        if self.budget.learning_sends > 1:
            self._notice("budget: no [prices], and the prices learned so far are loose or not yet borne out by a "
                         "response: sending one request at a time meanwhile (the cap may be passed by one request)")
        item.granted_at = await self.limiter.acquire()
        if self._stopping:  # stopped while waiting for a slot: send nothing new
            self.limiter.release()
            self.budget.cancel(reservation)
            self._abandon(item)
            return
        self.stats.in_flight += 1
        item.tries += 1
        n = item.prior_attempts + item.tries
        send = SendRecord(item.sample_id, n, time.time(), reservation)
        if not await self._recorded(send):  # stopped meanwhile: it never went out
            self._abandon(item)
            return
        try:
            result = await self._attempt(session, item, n)
        except BaseException as exc:  # aborted, or a bug: it went out, so it may have been billed
            cut = self._cut_short.pop((item.sample_id, n), None)
            if cut is None:
                self._unanswered(send, exc)
                raise
            try:  # aborted while reading: what came is settled as any cut transfer is; the sample
                # is handed on only when its answer came whole (else it stays pending, as the abort leaves all)
                self._settle(item, reservation, *cut, hand_on=cut[0].kind == "ok")
            except Exception as bug:  # noqa: BLE001 - the abort must go on: a bug here is counted, not raised
                self._internal(bug)
            raise
        finally:
            self.stats.in_flight -= 1
            self.limiter.release()
        self._settle(item, reservation, *result)

    def _settle(self, item: WorkItem, reservation: float, outcome: Outcome, record: ResponseRecord | None,
                attempt: AttemptRecord, usage: CheckedUsage, *, hand_on: bool = True) -> None:
        """Book an attempt's cost against its reservation, write its row, and hand its outcome on
        (stored, retried or failed); without ``hand_on`` (a read the run aborted) it is only counted."""
        cost = attempt.cost
        answered = outcome.kind == "ok"
        if cost is None and not answered and not outcome.maybe_billed and not (usage.prompt_tokens or
                                                                                usage.completion_tokens):
            cost = 0.0  # an error reply that counts no tokens (or 0) was not billed; one that counts some may have been
        if usage.problems:
            self._bad_usage(item.sample_id, usage)
        if outcome.no_finish:
            self._no_finish(item.sample_id, cost)
        possible = self.budget.settle(
            reservation,
            cost,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            provider=record.provider if record is not None else None,
            possible=cost is None,
            answered=answered,
            unread=not answered and outcome.maybe_billed and attempt.http_status == 200,
            lost=not answered and outcome.maybe_billed and attempt.http_status is None,
        )
        assert self._writer is not None
        self._writer.attempt(dataclasses.replace(attempt, possible_cost=possible) if possible else attempt)
        self.stats.spent = self.budget.spent
        self.stats.possible = self.budget.possible
        self._prices_overrun()
        if answered and not usage.tokens_ok:
            self.stats.no_usage += 1
            self._notice("some responses came without usage (e.g. a stream that ended before its usage chunk); "
                         "their cost is unknown and, under --max-cost, booked at their reservation")
        assert self._settled is not None
        self._settled.set()
        if hand_on:
            self._handle(item, outcome, record)
        elif outcome.error_class:
            self.stats.errors[outcome.error_class] += 1
        self.stats.limit = self.limiter.limit

    async def _recorded(self, send: SendRecord) -> bool:
        """Commit the record of a request before it goes out (a ``kill -9`` then leaves it booked
        as possible spend, not gone); False when the run stopped meanwhile (then it is not sent)."""
        assert self._writer is not None
        try:
            await self._writer.sending(send)
        except BaseException:
            self._not_sent(send)
            raise
        if self._stopping:
            self._not_sent(send)
            return False
        return True

    def _not_sent(self, send: SendRecord) -> None:
        """A recorded request that did not go out: its record, slot and reservation are let go."""
        assert self._writer is not None
        self._writer.unsent(send.sample_id, send.n)
        self.stats.in_flight -= 1
        self.limiter.release()
        self.budget.cancel(send.reservation)

    def _unanswered(self, send: SendRecord, exc: BaseException) -> None:
        """A request that went out and got no answer we kept, for a reason of ours (the run was
        aborted, or a bug): book its reservation as possible spend and write its attempt row
        (which settles its in-flight record), as for a timeout."""
        assert self._writer is not None and self._settled is not None
        aborted = isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt))
        cls = "interrupted" if aborted else "internal"
        message = ("the run stopped before its answer came; booked at its reservation" if aborted
                   else _clip(scrub(f"{type(exc).__name__}: {exc}", self.key)))
        possible = self.budget.settle(send.reservation, None, possible=True, lost=not aborted)
        self.stats.possible = self.budget.possible
        self.stats.errors[cls] += 1
        self._writer.attempt(AttemptRecord(send.sample_id, send.n, send.started_at, time.time() - send.started_at, None,
                                           cls, message, None, self.s.stream, possible_cost=possible))
        self._settled.set()

    async def _admit(self, item: WorkItem) -> float | None:
        assert self._settled is not None
        while True:
            if self._stopping:
                return None
            reservation = self.budget.admit(item.prompt_tokens_est, item.completion_reserve)
            if reservation is not None:
                return reservation
            if self.budget.exhausted:
                request = json.loads(item.request_json)
                default_reserve = completion_cap(request) is None
                self._notice("stopping: " + self.budget.stop_message(item.prompt_tokens_est, item.completion_reserve,
                                                                     default_reserve=default_reserve,
                                                                     media=linked_media(request),
                                                                     cap=cap_setting(request)))
                self.request_stop(StopReason.BUDGET)
                return None
            self._settled.clear()
            await self._settled.wait()

    async def _attempt(
        self, session: aiohttp.ClientSession, item: WorkItem, n: int
    ) -> tuple[Outcome, ResponseRecord | None, AttemptRecord, CheckedUsage]:
        """Attempt ``n`` of ``item`` over HTTP: its outcome, the response to store (when ok),
        its log row, and its usage as validated at the boundary."""
        stream = self.s.stream
        r = _Read(stream, time.time(), time.monotonic())
        item.sent_at = r.t0
        self.stats.requests += 1
        failed: Outcome | None = None  # how the transfer failed, if it did
        limit, total = _attempt_limit(self.s, stream)
        deadline = asyncio.timeout(total)
        try:
            wire = wire_body(item.request_json, stream=stream)
            timeout = aiohttp.ClientTimeout(  # the total is `deadline`, which covers our reads too
                total=None,
                sock_connect=self.s.connect_timeout_s,
                sock_read=self.s.read_timeout_s if stream else None,
            )
            # a redirect is not followed: aiohttp would turn the POST into a body-less GET and
            # store that GET's answer as this request's (see classify's 3xx)
            async with deadline, session.post(self._url, data=wire, headers=self._request_headers,
                                              timeout=timeout, allow_redirects=False) as resp:
                r.status, r.headers = resp.status, resp.headers
                if stream and r.status == 200 and _media_type(r.headers) == "text/event-stream":
                    r.sse = _StreamRead(StreamAssembler(key=self.key))
                    await self._read_events(resp.content.iter_any(), r.sse)
                else:
                    await read_capped(resp, self.s.max_response_bytes, into=r.got)
        except (asyncio.CancelledError, KeyboardInterrupt):
            if r.status is not None:  # an answer may have come whole while the server held the connection
                stopped = Outcome("retry", "interrupted", "the run stopped while the answer was being read", r.status,
                                  maybe_billed=True)
                try:
                    self._cut_short[item.sample_id, n] = self._result(item, n, r, stopped)
                except Exception as bug:  # noqa: BLE001 - the abort goes on (booked at its reservation)
                    self._internal(bug)
            raise
        except ResponseTooLarge as exc:
            failed = classify_too_large(r.status, r.headers, exc)
        except TimeoutError as exc:
            if deadline.expired():
                failed = Outcome("retry", "timeout", f"attempt took longer than {limit}={total:g} s in all",
                                 r.status, maybe_billed=True)
            else:
                failed = classify_exception(exc)
        except TRANSPORT_FAILURES as exc:  # classified; anything else is a bug (internal, with its traceback)
            failed = classify_exception(exc)
        return self._result(item, n, r, failed)

    def _result(self, item: WorkItem, n: int, r: _Read, failed: Outcome | None,
                ) -> tuple[Outcome, ResponseRecord | None, AttemptRecord, CheckedUsage]:
        """What an attempt's read ``r`` gave (``failed``: how its transfer failed, if it did):
        its outcome, the response to store (when ok), its log row and its usage."""
        status, headers, got, sse, stream, started_at = r.status, r.headers, r.got, r.sse, r.stream, r.started_at
        latency = time.monotonic() - r.t0
        too_large = failed is not None and failed.error_class == "response_too_large"
        if sse is None and stream and status == 200 and not too_large and _starts(got, _SSE_STARTS):
            # a stream under another Content-Type (none, text/plain, any case): read as the stream it is
            sse = _StreamRead(StreamAssembler(key=self.key), got)
            sse.fold(bytes(got), last=failed is None)
        raw: bytes | None = None
        parsed: Any = None
        if sse is not None and not too_large:
            body, raw, outcome, parsed = self._stream_result(sse, headers, failed)
        elif failed is not None:
            body, outcome, parsed = self._salvaged(status, headers, got, failed)
        else:
            body = self._masked(bytes(got))  # before any message is cut
            outcome, parsed = classify_response(status or 0, headers, body, key=self.key)
        streamed = raw is not None or (sse is not None and sse.asm.chunks > 0)
        message = _clip(scrub_message(outcome.message, self.key))
        usage = checked_usage(parsed, key=self.key)  # an error body may carry usage too: a billed retry counts
        cost = cost_of(usage.usage, self.s.prices)
        kept = _unkept(status, outcome, raw if streamed else body)
        if kept is not None:  # an error body kept (a 200's too): the key quoted in short pieces masked
            kept = mask_scattered(kept, self.key)
        if kept is not None and (why := compressed_key(kept, self.key, limit=self.s.max_response_bytes)):
            self._notice(f"a paid answer that was not kept {why}: its bytes are not kept in its attempt row")
            kept, message = None, f"{message} (its body {why}: not kept)"
        attempt = AttemptRecord(item.sample_id, n, started_at, latency, status, outcome.error_class, message, cost, stream,
                                body=kept)
        if outcome.kind != "ok":
            return dataclasses.replace(outcome, message=message), None, attempt, usage
        assert isinstance(parsed, dict)
        record = ResponseRecord(
            sample_id=item.sample_id,
            body=body,
            raw_stream=raw,
            provider=parsed.get("provider") if isinstance(parsed.get("provider"), str) else None,
            model=parsed.get("model") if isinstance(parsed.get("model"), str) else None,
            usage=usage.usage,
            cost=cost,
            latency_s=latency,
            started_at=started_at,
            finished_at=time.time(),
            attempts=n,
            stream=streamed,
            base_url=self._stored_url,
        )
        return outcome, record, attempt, usage

    def _salvaged(self, status: int | None, headers: Any, got: bytearray, failed: Outcome,
                  ) -> tuple[bytes, Outcome, Any]:
        """(body, outcome, parsed) of a non-streamed read that failed: a 200 whose bytes so far
        are a whole answer is kept (its transfer did not end cleanly: a reset before the last
        chunk, a short ``Content-Length``, a deadline while the server held the connection); of
        any other 200 the bytes go to the attempt row and their usage is booked."""
        if status != 200 or failed.error_class == "response_too_large" or not got:
            return b"", failed, None
        body = self._masked(bytes(got))
        outcome, parsed = classify_response(200, headers, body, key=self.key)
        if outcome.kind == "ok":
            self._notice(f"an answer whose transfer did not end cleanly ({failed.message}) came whole: kept")
            return body, outcome, parsed
        return body, dataclasses.replace(failed, maybe_billed=True), parsed

    async def _read_events(self, chunks: AsyncIterator[bytes], sse: _StreamRead) -> None:
        """Read an SSE body into ``sse``, up to ``[DONE]`` or the end. Raises what the transport
        raises, and :class:`ResponseTooLarge` past ``max_response_bytes`` unless a chunk was
        already refused (then what was read is kept, for its usage)."""
        cap = self.s.max_response_bytes
        async for chunk in chunks:
            sse.raw += chunk
            if len(sse.raw) > cap:
                if sse.failure is not None:
                    return
                raise ResponseTooLarge(f"stream passed max_response_bytes={cap} while being read")
            sse.fold(chunk)
            if sse.asm.done:  # [DONE]: nothing more belongs to this response
                return
        sse.fold(b"", last=True)

    def _stream_result(self, sse: _StreamRead, headers: Any, cut: Outcome | None,
                       ) -> tuple[bytes, bytes | None, Outcome, Any]:
        """(assembled JSON bytes, raw stream bytes, outcome, parsed) of a stream read into ``sse``;
        ``cut``: how its transfer failed (a reset, a read timeout, the attempt's deadline), if it did.

        The key is masked in the *assembled* body and in the whole raw stream, never in
        pieces; if the answer itself carried the key, it may be split across events in
        the raw stream where no byte pattern finds it, so that raw stream is not kept.
        A stream that is not kept was billed all the same: its usage is read past a refused
        chunk (``parsed`` holds only that), its raw bytes go with it, and so do a cut
        stream's. One cut after every choice finished is kept: only usage or ``[DONE]`` is
        missing (also where keep-alive comments ran on until the deadline)."""
        asm, raw, failure = sse.asm, sse.raw, sse.failure
        if not asm.chunks and failure is None and _starts(raw, (b"{",)):
            # a whole JSON answer under a stream's Content-Type: read as the answer it is, as a
            # non-streamed body is (kept if it came whole, however its transfer ended)
            if cut is not None:
                body, outcome, parsed = self._salvaged(200, headers, raw, cut)
            else:
                body = self._masked(bytes(raw))
                outcome, parsed = classify_response(200, headers, body, key=self.key)
            return body, None, outcome, parsed
        if cut is not None and failure is None:
            if not (asm.finished and not asm.errors):
                return b"", self._unkept_stream(asm, raw), dataclasses.replace(cut, maybe_billed=True), _usage_part(asm)
            self._notice(f"a stream was cut after its finish_reason ({cut.message}); kept without its tail")
        if failure is not None:
            message = scrub_message(str(failure), self.key)
            return b"", self._unkept_stream(asm, raw), Outcome("retry", "bad_stream", message, 200,
                                                                 maybe_billed=True), _usage_part(asm)
        if asm.errors:
            try:
                text = json.dumps({"error": asm.errors[-1]}, default=str)
            except RecursionError:  # parsed from a chunk (orjson: 1024 levels), too deep for json.dumps
                text = json.dumps({"error": {"message": "an error object nested too deep to show"}})
            err = scrub_bytes(text.encode(), self.key)
            out, _ = classify_response(200, {}, err, key=self.key)
            cls = "stream_error" if out.kind == "retry" else out.error_class
            message = f"mid-stream error: {out.message}"
            return (b"", self._unkept_stream(asm, raw),
                    Outcome(out.kind, cls, message, 200, out.retry_after, maybe_billed=True), _usage_part(asm))
        if not asm.chunks:
            return b"", self._unkept_stream(asm, raw), Outcome("retry", "bad_stream", "stream ended before any chunk",
                                                                 200, maybe_billed=True), None
        if not asm.finished:
            return b"", self._unkept_stream(asm, raw), Outcome(
                "retry", "truncated_stream", "stream ended without finish_reason", 200, maybe_billed=True,
                no_finish=asm.done), _usage_part(asm)  # [DONE] came: the provider sent no finish, not a cut
        try:
            assembled = orjson.dumps(asm.result())
        except (TypeError, orjson.JSONEncodeError) as exc:
            return b"", self._unkept_stream(asm, raw), Outcome(
                "retry", "bad_stream", f"stream cannot be assembled: {exc}", 200, maybe_billed=True), _usage_part(asm)
        body, kept_raw = self._masked_stream(assembled, raw, "a streamed answer carried the API key: masked, and its "
                                             "raw stream not kept")
        outcome, parsed = classify_response(200, headers, body, key=self.key)
        return body, kept_raw, outcome, parsed

    def _masked(self, data: bytes) -> bytes:
        """A response's bytes with the key masked: every spelling :func:`~.secrets.scrub_bytes`
        knows, then pieces of it that hold half the key or more together (an answer that
        quoted it as a list of short pieces was stored as it came; an error's were masked)."""
        body = scrub_bytes(data, self.key)
        pieces = self._pieces_masked(body)
        if pieces is not body:
            self._notice("a response held the API key in pieces (half of it or more): they are masked wherever it is "
                         "kept")
        return pieces

    def _unkept_stream(self, asm: StreamAssembler, raw: bytearray) -> bytes | None:
        """The raw bytes of a stream that is not kept, key masked, for its attempt row; None when
        what was assembled of it carried the key (then it may be split across events there)."""
        try:
            assembled = orjson.dumps(asm.result())
        except (StreamError, TypeError, orjson.JSONEncodeError):  # nothing assembled: no text to split a key over
            assembled = b""
        _, kept = self._masked_stream(assembled, raw, "a streamed answer that was not kept carried the API key: "
                                      "its raw stream is not kept")
        return kept or None

    def _pieces_masked(self, body: bytes) -> bytes:
        """``body`` with pieces of the key that hold half of it masked, where that half is
        :data:`~.secrets.MIN_MASKED` characters or more: half of a short key a user chose for
        a local server (``my-secret-key-2024``) is a word or two an answer may hold. (A raw
        stream that holds such pieces is not kept at all: it is no sample's text.)"""
        if self.key is None or len(self.key.value) < 2 * MIN_MASKED:
            return body
        return mask_scattered(body, self.key)

    def _masked_stream(self, assembled: bytes, raw: bytearray, notice: str) -> tuple[bytes, bytes | None]:
        """``assembled`` with the key masked, and the raw stream to keep beside it (masked), or
        None when the assembled text carried the key: there it may be split across events,
        where no byte pattern finds it (the raw stream is then not scrubbed at all); None
        too when the raw bytes hold the key in pieces too short to mask (comment lines,
        chunk ids: :func:`~.secrets.scattered_key`)."""
        body = self._pieces_masked(scrub_bytes(assembled, self.key))  # whole, or in pieces: one notice
        if body != assembled:
            self._notice(f"{notice} (the key may be split across events there)")
            return body, None
        kept = scrub_bytes(bytes(raw), self.key)
        if scattered_key(kept, self.key):  # (raw bytes are no sample's text: dropped whatever the key's length)
            self._notice("a stream's raw bytes held pieces of the API key, half of it or more (comment lines, chunk "
                         "ids, or the answer's own text): its raw stream is not kept")
            return body, None
        return body, kept

    # --- outcomes ---------------------------------------------------------------------

    def _handle(self, item: WorkItem, outcome: Outcome, record: ResponseRecord | None) -> None:
        if outcome.error_class:
            self.stats.errors[outcome.error_class] += 1
        if outcome.kind == "ok":
            assert record is not None and self._writer is not None
            self.limiter.on_success(item.granted_at)
            self._successes += 1
            self._unauthorized_streak = 0
            usage = record.usage or {}
            # validated ints (see .body): nothing here can raise on what the network sent
            pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
            pt, ct = pt if isinstance(pt, int) else 0, ct if isinstance(ct, int) else 0

            def counted() -> None:
                self.stats.done += 1
                self.stats.completion_tokens += ct
                self.stats.prompt_tokens += pt
                self.stats.meter.add(ct)
                self._finish_one()

            self._writer.response(record, counted)
            return
        if outcome.kind == "payment":
            self._notice(f"stopping: HTTP 402 payment required ({outcome.message}); in-flight requests finish")
            self.request_stop(StopReason.PAYMENT)
            self._abandon(item)
            return
        if outcome.kind == "unavailable":
            if _SAMPLE_SPECIFIC_404.search(outcome.message):
                self._fail(item, "no_endpoints", outcome.message)  # about this prompt only
                return
            if item.routing not in self._unavailable:
                self._unavailable[item.routing] = (outcome.message, item.sample_id)
                self._notice(f"routing unavailable, failing the samples sent like {item.sample_id}: {outcome.message}")
            self._fail(item, "no_endpoints", outcome.message)
            return
        if outcome.kind == "fail":
            if outcome.error_class == "bad_encoding":  # every answer may come so: say so at once, not at the end
                self._notice(f"answers are failing: {outcome.message}")
            if outcome.status == 401:
                self._unauthorized_streak += 1
                if self._unauthorized_streak >= _UNAUTHORIZED_STOP and not self._successes:
                    self._notice(f"stopping: {_UNAUTHORIZED_STOP} requests in a row refused with HTTP 401 ({outcome.message})")
                    self.request_stop(StopReason.UNAUTHORIZED)
            self._fail(item, outcome.error_class or "failed", outcome.message)
            return
        # retryable
        if outcome.kind == "rate_limited" and self.limiter.on_rate_limited(item.granted_at):
            self.stats.limit = self.limiter.limit
        if item.tries >= self.s.max_attempts:
            self._fail(item, outcome.error_class or "retry", f"gave up after {item.tries} attempts: {outcome.message}")
            return
        if self._stopping:
            self._abandon(item)
            return
        delay = self._backoff(item.tries, outcome.retry_after)
        loop = asyncio.get_running_loop()
        handle = loop.call_later(delay, self._requeue, item)
        self._timers[item.sample_id] = (handle, item)

    def _backoff(self, tries: int, retry_after: float | None) -> float:
        cap: float = min(self.s.backoff_max_s, self.s.backoff_base_s * (2 ** (tries - 1)))
        delay = cap / 2 + random.uniform(0, cap / 2)
        if retry_after is not None:
            delay = max(delay, min(retry_after, max(self.s.backoff_max_s, 300.0)))  # sane ceiling
        return delay

    def _requeue(self, item: WorkItem) -> None:
        self._timers.pop(item.sample_id, None)
        assert self._queue is not None
        if self._stopping:
            self._abandon(item)
        else:
            self._queue.put_nowait((item.seq, item))

    def _fail(self, item: WorkItem, error_class: str, message: str) -> None:
        assert self._writer is not None
        message = scrub_message(message, self.key)

        def counted() -> None:
            self.stats.failed += 1
            self._finish_one()

        self._writer.failure(item.sample_id, error_class, message, counted)

    def _abandon(self, item: WorkItem) -> None:
        self.stats.abandoned += 1
        self._finish_one()

    def _finish_one(self) -> None:
        self._outstanding -= 1
        if self._outstanding <= 0 and self._all_done is not None:
            self._all_done.set()

    def _internal(self, exc: BaseException) -> None:
        """Count a bug caught so the run goes on; keep (and log) the traceback of the first
        few, key masked (an exception's text can quote a header)."""
        self.stats.internal_errors += 1
        if len(self.stats.tracebacks) < _MAX_TRACEBACKS:
            text = scrub("".join(traceback.format_exception(exc)), self.key).rstrip("\n")
            self.stats.tracebacks.append(text)
            for line in text.split("\n"):  # a notice is one line (each shown escaped): a traceback is many
                self._log(line)

    def _prices_overrun(self) -> None:
        """Say once that ``[prices]`` proved too low: requests are no longer priced by it."""
        if self.budget.overrun is not None:
            cost, reserved = self.budget.overrun
            then = ("they go one at a time until answers bear a price out" if self.budget.max_cost is not None
                    else "what answers cost prices them")
            which = "an answer an earlier run stored" if self.budget.overrun_stored else "an answer"
            self._notice(f"budget: {which} cost {usd(cost)}, more than the {usd(reserved)} [prices] reserved for it "
                         "(prices below the provider's, or more completion tokens than max_tokens reserved): [prices] "
                         f"no longer prices requests in this run; {then}")

    def _over_cap(self) -> None:
        """A run that ended over its ``--max-cost`` (requests in flight when ``[prices]`` proved
        too low, or a learning send) says so and ends as stopped by the budget, never as if
        all were well."""
        budget, cap = self.budget, self.budget.max_cost
        if cap is None or budget.total <= cap * (1 + 1e-9):
            return
        possible = f" + {usd(budget.possible)} possibly billed" if budget.possible else ""
        self._notice(f"spent {usd(budget.spent)}{possible}, over --max-cost {usd(cap)}")
        if self._stopping is None:  # every sample done, the last answers past the cap: still the budget's end
            self._stopping = self.stats.stop_reason = StopReason.BUDGET

    def _notice(self, message: str) -> None:
        message = scrub_message(message, self.key)
        if message not in self.stats.notices:
            self.stats.notices.append(message)
            self._log(message)

    def _bad_usage(self, sample_id: str, usage: CheckedUsage) -> None:
        self.stats.bad_usage += 1
        if len(self.stats.bad_usage_examples) < 10:
            self.stats.bad_usage_examples.append(scrub(f"{sample_id}: {'; '.join(usage.problems)}", self.key))
        fallback = "cost from [prices]" if self.s.prices is not None else "cost booked at the reservation"
        self._notice(f"some responses carry unusable usage fields (e.g. {self.stats.bad_usage_examples[0]}): "
                     f"those fields are ignored ({fallback}); the responses are kept")

    def _no_finish(self, sample_id: str, cost: float | None) -> None:
        """Count an answer that came without finish_reason; the first one says so in the log."""
        self.stats.no_finish.add(sample_id)
        self.stats.no_finish_attempts += 1
        self.stats.no_finish_cost += cost or 0.0
        self._notice(f"some answers come without finish_reason (e.g. {sample_id}): each is sent again, up to "
                     f"max_attempts={self.s.max_attempts} per prompt, every attempt billed; the answers are kept in "
                     "the attempt rows of state.sqlite, not in exchanges.jsonl (the gate rejects them: finish_error)")

    def _store_failed(self, exc: BaseException) -> None:
        self._notice(f"stopping: store write failed: {exc}")
        self.request_stop(StopReason.STORE)



@dataclass
class _Read:
    """An attempt's transfer as far as it went: what its result is built from, also where
    the run aborts it mid-read (an answer that came whole is kept, as for a cut transfer)."""

    stream: bool
    started_at: float
    t0: float
    status: int | None = None
    headers: Any = field(default_factory=dict)
    got: bytearray = field(default_factory=bytearray)  # a body as read so far: kept when the read fails after it all came
    sse: _StreamRead | None = None


@dataclass
class _StreamRead:
    """A stream as read so far, held by the attempt rather than the read: a read that ends in
    an exception (a reset; the attempt's deadline, which arrives inside the read as a
    cancellation) leaves what came, so a paid answer that came whole is still kept."""

    asm: StreamAssembler
    raw: bytearray = field(default_factory=bytearray)
    decoder: SSEDecoder = field(default_factory=SSEDecoder)
    #: the first chunk refused, or bytes that did not decode
    failure: ValueError | None = None

    def fold(self, chunk: bytes, *, last: bool = False) -> None:
        """Decode ``chunk`` (``last``: and whatever the decoder held) into the assembler."""
        self.failure = _fold(self.asm, self.decoder.feed(chunk), self.failure)
        if last and not self.asm.done:
            self.failure = _fold(self.asm, self.decoder.close(), self.failure)


def _fold(asm: StreamAssembler, events: Iterable[SSEEvent], failure: ValueError | None) -> ValueError | None:
    """Add the events (a decoder's generator: it decodes as it is iterated) to the assembler,
    going on past a chunk it refuses (a usage chunk after it still bills the stream); returns
    the first failure (:class:`StreamError`, or :class:`UnicodeDecodeError` for bytes that do
    not decode: those are skipped)."""
    try:
        for event in events:
            if asm.done:  # [DONE]: nothing after it belongs to this response but a late usage chunk
                asm.add_late(event)
                continue
            try:
                asm.add_event(event)
            except StreamError as exc:
                failure = failure or exc
    except UnicodeDecodeError as exc:
        if not asm.done:  # junk bytes after [DONE] are no fault of the response
            failure = failure or exc
    return failure


#: Bytes around an SSE body's first field or a JSON body's first brace.
_SPACE = b" \t\r\n"
#: How an SSE body's first line starts (a field, or a comment such as OpenRouter's keep-alive).
_SSE_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")


def _media_type(headers: Any) -> str:
    """The ``Content-Type``'s media type, lower case (media types are case-insensitive, RFC 9110)."""
    return str(headers.get("Content-Type", "")).split(";", 1)[0].strip().lower()


def _starts(body: bytearray, starts: tuple[bytes, ...]) -> bool:
    """Whether ``body``, leading whitespace aside, starts with one of ``starts``: how a body
    is told to be a stream (or a JSON answer) whatever its ``Content-Type`` said."""
    return bytes(body[:64]).lstrip(_SPACE).startswith(starts)


def _usage_part(asm: StreamAssembler) -> dict[str, Any] | None:
    """The stream's last usage as a body to read it from, when one came (what bills a stream not kept)."""
    return {"usage": asm.top["usage"]} if asm.top.get("usage") is not None else None


def _attempt_limit(s: GenerateSettings, stream: bool) -> tuple[str, float]:
    """(the setting that bounds one attempt in all, its seconds): ``attempt_timeout_s``, or for
    a non-streamed attempt ``timeout_s`` when it is shorter, so a timeout names what to raise."""
    if not stream and s.timeout_s < s.attempt_timeout_s:
        return "timeout_s", s.timeout_s
    return "attempt_timeout_s", s.attempt_timeout_s


def _unkept(status: int | None, outcome: Outcome, received: bytes | None) -> bytes | None:
    """What a 200 that is not kept leaves in its attempt row: the bytes received (key masked),
    since the provider billed them; nothing for other answers, or when nothing arrived."""
    return received if status == 200 and outcome.kind != "ok" and received else None


def _clip(text: str, n: int = _MAX_MESSAGE) -> str:
    """Clip a message that is already scrubbed (clipping first could leave part of a key)."""
    return text if len(text) <= n else text[:n] + "…"

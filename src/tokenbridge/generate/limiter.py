"""Concurrency that finds a server's cap without mistaking random 429s for one.

The run starts at ``start`` slots (slow start), not at the ceiling: every request sent at
once before the first answer is a request a capped server may refuse, and 256 sent into a
cap of 16 are 240 refusals (8% of a 3,000-request run) before the limiter hears of any.
Each success adds ``start_growth`` slots (the window doubles per round of requests) until
the ceiling or the first cut, which ends slow start; a cut later judged to be noise (below)
resumes it. A fault-free run reaches 256 from 16 in about five rounds. The growth is
paced: each success's slot comes at a point spread over the next half mean latency. A
round's answers can come back together (a server with a steady latency), and unpaced the
window would double in one burst before the first 429 could say where the cap is: 128 to
256 into a cap of 130 is 126 refusals (4% of a 3,000-request run), paced it is the growth
during one 429's turnaround and the cut. Before any success a 429 takes its slot away
(:meth:`_refused_before_success`), so a cap under the start is found by the start's own
refusals: the cut went to in flight less the 429s so far, which at the 8th is half of 16,
and each half was sent again into the cap: 16 into a cap of 1 were 43-58 refusals, 15 of
them the start's. A random 429 before any success costs its one slot; slow start goes on.

A 429 means one of two things: noise (an upstream provider refusing a request now and
then, whatever the load: OpenRouter does this all the time), or a cap (the server
refuses whatever is over N at once). Halving on every 429 treats noise as a cap and
settles near ``sqrt(2/p)`` in flight: 6 at 5% random 429s. This limiter cuts only when
429s are a real share of recent answers: at least ``min_rate_limited`` of them and
``threshold`` more than the noise of the last ``window`` answers (200 or 429) to
requests sent since the last cut. Noise below the threshold never shrinks it. A cap
does: a 429 comes back at once and frees its slot for the next request, which is
refused too, so the slots over the cap turn into a stream of 429s that outnumbers the
successes. A share of ``decisive_share`` or more cuts at once; a smaller one only over
a whole window. The noise level is learned from the cuts: the share in the first
whole window after a cut is what the lower limit did not remove, i.e. noise (when it
is below ``decisive_share``), and a cut that removed next to nothing was made for
noise and is undone; each later window can only lower the noise level, slowly.

What a cut leaves is not always noise. Where answers reach us late (a loaded event
loop) we count in flight what the server is done with, the accepted count overstates a
cap, and a cut stops a slot or two over it: at a cap of 6, two slots over left 44% of
429s, learned as noise and held for the rest of the run. So a cut that took much away
(not one for noise) but left a share a material step (``_MATERIAL`` of ``threshold``)
over what it would be with no cap (a probe's base's share, else the noise known) is tested
a slot lower for one window (:meth:`_step_down`): fewer 429s there by more than chance is
a cap's residue, and it steps on while the share stays material (then holds for the
steps' 429s); as many is noise, and the level comes back with the noise learned over
both windows.

That share depends on how fast a cap's 429s come back: a slot over a cap answers once per
turnaround, so at a turnaround of a fifth of the latency it is 5 429s a latency beside 200
successes at a cap of 200 (2.4%), and ``threshold`` over the noise waited for a dozen
slots over. A probe (below) is therefore also a test: a cap's 429s come with the level,
noise comes whatever the level, so the share of the probe's answers is set against the
share at the base it started from (the hold before it), and ``_PROBE_Z`` standard errors
over (at least ``min_rate_limited`` 429s) is a cap. Such a cut goes back to the base and is
never undone: one window after it cannot tell a probe's few 429s from noise, and were it
noise, the next probe sees its base's share and does not cut. Slow start that reaches the
ceiling uncut is tested the same way for ``_PROBE_ROUNDS`` rounds, its own answers the
baseline (a cap of 250 under a ceiling of 256), then the ceiling has held.

A cut goes to the concurrency the server was really serving: the most requests in flight
that it accepted at once, over the mean latency up to one 429 turnaround ago. By then every
refusal of a request that was in flight has come back, so in flight (its recent changes
are kept) less the 429s in flight at that instant is exact; at a cap of C it is C. Now it
is not: the slots slow start or a probe added within the last turnaround have not been
answered yet, and those the cap will refuse look accepted (at a fifth-latency turnaround
that put the cut a slot or two over the cap, the 429s that stayed were judged noise and
the cut undone: 9% of a run). A steady cut that may be noise's stays within 0.95 of the
old limit; a probe's is not below its base. A cut within a turnaround of the last one
counts at the one instant a turnaround ago, as exact: a cap that fell, where the server
refuses every slot freed until the requests it took under the old cap are done (half a
latency from 100 to 50), the cuts come every ``min_rate_limited`` 429s, and each lands on
what the server held a turnaround before, so the chain comes down onto the cap from above.
The in-flight count it fell back on there (below) takes a slot twice where turnarounds
shrink (a loaded event loop's 429s back in 13 ms, then in 4): the chain stepped under the
cap (100 to 50 ended at 35-41, 100 to 20 at 12), and the hold after it, counted in
successes, kept it there ~37 latencies. Without that history (before any success, or
no 429 yet to time a turnaround by) the cut goes to the successes' summed time in the
server over the last mean latency, over that span (Little's law), within [0.5, 0.95] of
the old limit, or, where that figure lags a limit that just moved (in slow start, when the
level the last cut chose failed at once), to those in flight less the refused ones still in
flight, counted as the 429s whose slot went to the next request and that came back within
their own turnaround of now, not below half the old limit; before any success, to what was
admitted (above). A server that refuses above C is so cut to C wherever the window was. The
limit then holds there for as many successes as it takes to keep 429s near ``target_share``
of answers (all the probe's 429s over its base's share, not the last window's, and one for
each refused request still in flight, but not where the level the last cut chose failed at
once: those are a fallen cap's, which holding does not take back; a fall from 150 to 40
held 1,900 successes for them, 48 latencies in which a cap that rose again was not
followed); after a probe's cut also until the slot time its 429s held (their turnarounds)
averages under ``_OVER_SLOTS`` of a slot, else a cap whose 429s come back in half a
latency has a probe a slot or two over it a third of the time, then probes: +1 per round
of requests at first, the excess over the cut level doubling each round after, so a cap
that rose (or a cut made by chance) is left behind in a few rounds rather than one slot
per round.

``Retry-After`` is the one request's business (the engine delays that request's retry
by it); here a 429 is one answer in the window whatever its ``Retry-After``: one 429
never pauses or shrinks the pool (before any success, its slot is not sent again, above).
Other failures (5xx, timeouts) say nothing about a cap and are not counted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["AdaptiveLimiter"]

_SERVED_SPAN = 1.0  # served concurrency is measured over this many mean latencies
_GOLDEN = 0.6180339887498949  # successive multiples mod 1 spread evenly over [0, 1)
_HISTORY = 3.0  # in flight's changes and the 429s are kept for this many mean latencies
_PROBE_Z = 3.0  # a probe's 429 share this many standard errors over its base's is a cap
_OVER_SLOTS = 0.5  # a probe's refused requests in flight, averaged over it and the hold after it
_PROBE_ROUNDS = 4  # a probe at the ceiling is tested over this many rounds of answers, then it held
_STEP_Z = 2.0  # a step's window this many standard errors under the window a slot higher is a cap's residue
_MATERIAL = 0.25  # after a cut, a 429 share of this much of ``threshold`` is tested a slot lower before it is noise
_FLIGHT_MAX = 8  # and for at most this many changes per slot of the ceiling (memory, before any latency is known)


@dataclass
class AdaptiveLimiter:
    """Slots for requests in flight; the engine reports each answer's 200 or 429."""

    ceiling: int
    floor: int = 1
    #: Slots at the start (within [floor, ceiling]); slow start grows them to the ceiling.
    start: int = 16
    #: Slots each success adds in slow start (1: the window doubles per round of requests).
    start_growth: float = 1.0
    #: Share of 429s among recent answers that means "over a cap".
    threshold: float = 0.25
    #: Recent answers looked at.
    window: int = 64
    #: 429s needed in the window before a cut (so a handful of chance 429s never cuts).
    min_rate_limited: int = 8
    #: A share of 429s this high is a cap, never noise: it cuts without waiting for a whole window.
    decisive_share: float = 0.5
    #: After a cut, hold until the cut's 429s are this share of the answers since.
    target_share: float = 0.03
    #: Monotonic seconds; injected by tests.
    clock: Callable[[], float] = time.monotonic
    #: ``schedule(delay_s, fn)``: runs slow start's paced growth; None: the running event
    #: loop's ``call_later`` (no loop: growth at once). Injected by tests.
    schedule: Callable[[float, Callable[[], None]], object] | None = None
    limit: float = 0.0
    in_flight: int = 0
    cuts: int = 0
    #: Where the last cut left the limit, or where an undone cut restored it: probes
    #: start from here (None: never cut).
    base: float | None = None
    #: Share of 429s that comes whatever the limit (learned after cuts, see above).
    noise: float = 0.0
    _answers: deque[bool] = field(default_factory=deque, repr=False)  # True = 429, sent after the last cut
    _rate_limited: int = field(default=0, repr=False)  # 429s in _answers
    _probing: list[int] = field(default_factory=lambda: [0, 0], repr=False)  # [answers, 429s] since the probe (or slow start) began
    _refused_s: float = field(default=0.0, repr=False)  # the probe's 429s' summed turnaround: slot time refused
    _baseline: list[int] = field(default_factory=lambda: [0, 0], repr=False)  # [answers, 429s] at the base before the probe
    _probe_cut: bool = field(default=False, repr=False)  # the last cut was a probe's (never undone)
    _probe_from: float | None = field(default=None, repr=False)  # the level the probe's baseline was measured at (None: no test)
    _refused: deque[tuple[float, float]] = field(default_factory=deque, repr=False)  # (sent, answered): last 429s re-sent
    _served: deque[tuple[float, float]] = field(default_factory=deque, repr=False)  # (done_at, latency_s) of recent successes
    _flight: deque[tuple[float, int]] = field(default_factory=deque, repr=False)  # (at, in_flight): its recent changes
    _refusals: deque[tuple[float, float]] = field(default_factory=deque, repr=False)  # (sent, answered): recent 429s
    _latency: float | None = field(default=None, repr=False)  # moving mean latency of successes
    _first_sent: float = field(default=math.inf, repr=False)
    _last_cut: float = field(default=-math.inf, repr=False)
    _released: tuple[float, int] | None = field(default=None, repr=False)  # the last release: (at, in flight before it)
    _admitted: tuple[float, int] | None = field(default=None, repr=False)  # before any success: (the first 429's release, admitted)
    _hold: int = field(default=0, repr=False)  # successes to wait before probing again
    _block: list[int] = field(default_factory=lambda: [0, 0], repr=False)  # [answers, 429s] of the current window block
    _after_cut: bool = field(default=False, repr=False)  # the current block is the first since a cut
    _before_cut: float = field(default=0.0, repr=False)  # the limit before the last cut
    _cut_share: float = field(default=0.0, repr=False)  # the 429 share that made it
    _base_held: bool = field(default=False, repr=False)  # a whole window at ``base`` stayed under the threshold
    _slow: bool = field(default=False, repr=False)  # in slow start
    _cut_slow: bool = field(default=False, repr=False)  # the last cut ended slow start
    _paced: int = field(default=0, repr=False)  # slow-start growth steps scheduled
    _step: tuple[int, int, int, float] | None = field(default=None, repr=False)  # (level, answers, 429s, share expected) a step left
    _waiters: deque[asyncio.Future[float]] = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        self.floor = max(1, min(self.floor, self.ceiling))
        if not self.limit:
            self.limit = float(max(self.floor, min(self.start, self.ceiling)))
        self._slow = self.limit < self.ceiling

    # --- slots ------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return max(self.floor, int(self.limit))

    def try_acquire(self) -> float | None:
        """Take a slot if one is free and nobody waits for it: the time it was granted, or None."""
        if not self._waiters and self.in_flight < self.slots:
            return self._take()
        return None

    def _take(self) -> float:
        self.in_flight += 1
        now = self.clock()
        self._record(now)
        return now

    def _record(self, now: float) -> None:
        """Keeps in flight's recent changes: :meth:`_accepted_before` reads it back."""
        self._flight.append((now, self.in_flight))
        if len(self._flight) > _FLIGHT_MAX * self.ceiling:
            self._flight.popleft()
        if self._latency is not None:  # the entry at or before the cutoff stays: the level there
            cutoff = now - _HISTORY * self._latency
            while len(self._flight) > 1 and self._flight[1][0] <= cutoff:
                self._flight.popleft()

    async def acquire(self) -> float:
        """Take a slot (waiters are served in arrival order); returns the time it was granted,
        which is what :meth:`on_success` / :meth:`on_rate_limited` take as ``sent_at``: a slot
        granted under the old limit but sent after a cut still answers for the old limit."""
        granted = self.try_acquire()
        if granted is not None:
            return granted
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut  # release() hands the slot over (in_flight already counts it)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            raise

    def release(self) -> None:
        now = self.clock()
        self._released = (now, self.in_flight)
        self.in_flight -= 1
        self._record(now)
        self._hand_over()

    def _hand_over(self) -> None:
        while self._waiters and self.in_flight < self.slots:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(self._take())

    # --- answers ----------------------------------------------------------------------

    def on_success(self, sent_at: float) -> None:
        """A 200 for a request sent at ``sent_at`` (monotonic seconds, the same clock)."""
        now = self.clock()
        latency = max(0.0, now - sent_at)
        self._latency = latency if self._latency is None else self._latency + 0.1 * (latency - self._latency)
        self._first_sent = min(self._first_sent, sent_at)
        self._served.append((now, latency))
        while self._served and self._served[0][0] < now - _SERVED_SPAN * self._latency:
            self._served.popleft()
        if sent_at >= self._last_cut:
            self._note(False)
        self._grow()

    def on_rate_limited(self, sent_at: float) -> bool:
        """A 429 for a request sent at ``sent_at``; returns whether the limit was cut.

        A request sent before the last cut answers for the old limit and changes nothing.
        """
        # its slot went to a waiting request (the engine releases first), or is the one slot its own
        # worker takes again next (no other waiter at the ceiling); over a lower limit it stays free
        now = self.clock()
        if self.slots - 1 <= self.in_flight <= self.slots:
            self._refused.append((sent_at, now))  # sent before the last cut or after: all count below
            if len(self._refused) > self.ceiling:
                self._refused.popleft()
        self._refusals.append((sent_at, now))
        horizon = now - _HISTORY * (self._latency or math.inf)
        while self._refusals and (self._refusals[0][1] < horizon or len(self._refusals) > _FLIGHT_MAX * self.ceiling):
            self._refusals.popleft()
        lowered = self._latency is None and self._refused_before_success(sent_at, now)
        if sent_at < self._last_cut:
            return lowered
        cuts = self.cuts
        self._note(True)
        if self.cuts != cuts:  # the window it closed stepped down
            return True
        self._refused_s += now - sent_at
        n, rl = len(self._answers), self._rate_limited
        probe = self._probe_over_base()
        if not probe:
            if rl < self.min_rate_limited or rl < (self.noise + self.threshold) * n:
                return lowered
            if rl < self.decisive_share * n and n < self.window:
                return lowered  # a moderate share: judged over a whole window only
        self._cut(probe)
        return True

    def _refused_before_success(self, sent_at: float, now: float) -> bool:
        """Before any success: the requests in flight when the first 429 came back, less those
        of them refused since, are what the server admitted, and the limit goes no higher
        (returns whether it fell). Only those: a request sent later went into a slot a
        refusal freed, which was counted when it was refused."""
        if self._admitted is None:  # the first: what was in flight just before its slot was let go
            self._admitted = self._released if self._released is not None else (now, self.in_flight)
        at, admitted = self._admitted
        if sent_at >= at:
            return False  # sent since (its slot freed by a refusal): not one the server was first sent
        self._admitted = (at, admitted - 1)
        if max(self.floor, admitted - 1) >= self.limit:
            return False
        self.limit = float(max(self.floor, admitted - 1))
        if self.base is not None:  # cut already: this is its level
            self.base = self.limit
        return True

    def _probe_over_base(self) -> bool:
        """Whether a probe's 429s are a real share over its base's.

        A cap's 429s come with the level, noise's whatever the level: a probe is the test. Its
        answers' 429 share is set against the answers' at the base it started from (the hold
        before it): ``_PROBE_Z`` standard errors over is a cap. This finds a cap whose 429s come
        back slowly: the share a slot over it makes falls with the turnaround (a slot refused
        every fifth of a latency is 5 429s a latency beside 200 successes at a cap of 200),
        and a fixed ``threshold`` over the noise waited for a dozen slots over."""
        (n0, r0), (n1, r1) = self._baseline, self._probing
        if self._slow or self._hold or self._probe_from is None or not n0 or not n1:
            return False
        if self.limit >= self.ceiling and n1 > _PROBE_ROUNDS * self.limit:
            self._probe_from = None  # the ceiling held (testing on would take noise for a cap, by chance)
            self._probing, self._baseline = [0, 0], [0, 0]  # and its counts end with it (a later cut's cost)
            return False
        if self.limit <= self._probe_from or r1 < self.min_rate_limited:
            return False
        pooled = (r0 + r1) / (n0 + n1)
        se = math.sqrt(pooled * (1 - pooled) * (1 / n0 + 1 / n1))
        return se > 0 and r1 / n1 - r0 / n0 >= _PROBE_Z * se

    def served_concurrency(self) -> float | None:
        """Requests the server was serving at once, by Little's law: the successes' time in
        the server over the last mean latency (or since the first was sent), over that span."""
        if self._latency is None or not self._served:
            return None
        now = self.clock()
        span = min(_SERVED_SPAN * self._latency, now - self._first_sent)
        if span <= 0:
            return None
        return sum(min(lat, span) for done, lat in self._served if done >= now - span) / span

    def _refused_in_flight(self) -> int:
        """Refused requests in flight now: the 429s whose slot went to the next request and
        that came back within their own turnaround of now. A slot the server refuses every
        turnaround answers once per turnaround, so each such slot counts once; a slot that
        stayed free (over a lower limit, or nothing left to send) is not in flight."""
        now = self.clock()
        return sum(1 for sent, answered in self._refused if now - answered < answered - sent)

    def _accepted_before(self) -> int | None:
        """The most requests in flight that the server accepted at once over the mean latency
        up to one 429 turnaround ago: by then every refusal of a request in flight has come
        back, so in flight less the refused ones is exact. Now it is not: the requests sent
        within the last turnaround (a probe's or slow start's new slots) have not been
        answered yet, and those a cap will refuse look accepted. Not before the last cut; one
        within the turnaround leaves the one instant a turnaround ago. None: too little history."""
        if self._latency is None or not self._refusals or not self._flight:
            return None
        now = self.clock()
        until = now - max(answered - sent for sent, answered in self._refusals)
        # not before the last cut: what was accepted above the level it left says nothing of now (a cap
        # that fell is cut again within a turnaround, and the history would still show the old level)
        since = min(max(until - self._latency, self._last_cut), until)
        if self._flight[0][0] > since:
            return None  # in flight before the history began is unknown
        if len(self._refusals) >= _FLIGHT_MAX * self.ceiling and self._refusals[0][1] > since:
            return None  # refusals answered after `since` were dropped (the bound on memory): unknown
        # (at, order, in_flight or None, refused delta): a 429's own send and answer bracket its time
        points: list[tuple[float, int, int | None, int]] = [(at, 0, n, 0) for at, n in self._flight if since < at < until]
        level = next(n for at, n in reversed(self._flight) if at <= since)
        refused = 0
        for sent, answered in self._refusals:
            if sent <= since < answered:
                refused += 1
            if since < sent < until:
                points.append((sent, 1, None, 1))
            if since < answered < until:
                points.append((answered, 1, None, -1))
        points.sort(key=lambda p: (p[0], p[1]))
        best = level - refused
        for i, (at, _, n, delta) in enumerate(points):
            level = level if n is None else n
            refused += delta
            if i + 1 == len(points) or points[i + 1][0] > at:  # every change at one instant, then the count
                best = max(best, level - refused)
        return best

    def _note(self, rate_limited: bool) -> None:
        self._answers.append(rate_limited)
        self._rate_limited += rate_limited
        self._probing[0] += 1
        self._probing[1] += rate_limited
        if len(self._answers) > self.window:
            self._rate_limited -= self._answers.popleft()
        self._block[0] += 1
        self._block[1] += rate_limited
        if self._block[0] >= self.window:
            (n, refused), after = self._block, self._after_cut
            self._block, self._after_cut = [0, 0], False  # before the judgement: a step there starts the next
            if after:
                self._judge_cut(refused / n, refused)
            elif refused / n < self.noise:  # the noise may have stopped: let it fall, slowly (blocks vary)
                self.noise -= 0.1 * (self.noise - refused / n)

    def _judge_cut(self, share: float, refused: int) -> None:
        """The first whole window after a cut: what the lower limit did not remove is noise.
        A cut that removed next to nothing was made for noise: it is undone. A cut that
        removed much but left a material share may have stopped a slot or two over a cap:
        that share is tested a slot lower first (:meth:`_step_down`)."""
        step, self._step = self._step, None
        if share >= self.decisive_share:
            if step is not None:
                self.noise = step[3]  # far over a cap a slot lower too: the test is over, its noise level with it
            return  # still far over a cap: not noise
        if step is not None:
            upper, n_up, r_up, expected = step
            if self.slots != upper - 1:
                pass  # the level moved in the window: the test is void, judged as it is
            elif _fewer(r_up, n_up, refused, self.window, self.threshold):  # the level matters: a cap's 429s
                # the level it left cost its window's 429s: hold long enough to keep them near target_share
                self._hold = max(self._hold, math.ceil(r_up / self.target_share))
                if (refused >= self.min_rate_limited and share >= expected + _MATERIAL * self.threshold
                        and self.slots > self.floor):
                    self._step_down(share, refused, expected)  # and what is left is still a lot: one more
                    return
            else:  # as many 429s a slot lower: noise, and the level comes back
                self.limit = self.base = float(upper)
                self.noise = (r_up + refused) / (n_up + self.window)
                self._base_held = True
                self._hand_over()
                return
        # a probe's cut went back to a base that held: were it noise, the next probe's share
        # is its base's (the hold measures it) and it does not cut again; one window cannot tell
        # a probe's few 429s from noise, so it is never undone
        # (after a step that found fewer 429s a slot lower, the cut it tested is a cap's: not undone)
        for_noise = step is None and not self._probe_cut and share > self._cut_share - 0.75 * self.threshold
        # what the share would be with no cap over us: a probe's base measured it (its hold), else the noise known
        (n0, r0) = self._baseline
        expected = r0 / n0 if self._probe_cut and n0 else self.noise
        if (step is None and not for_noise and refused >= self.min_rate_limited
                and share >= expected + _MATERIAL * self.threshold and self.slots > self.floor):
            self._step_down(share, refused, expected)  # more than that may be a cap's residue: a slot lower tells
            return
        self.noise = share
        self._base_held = True
        if for_noise and self._before_cut > self.limit:
            self.limit = self._before_cut
            self.base = self.limit  # probe from here: the excess over it doubling per round
            self._hold = 0
            self._begin_probe()
            self._slow = self._cut_slow and self.limit < self.ceiling  # a cut for noise ended nothing
            self._hand_over()

    def _step_down(self, share: float, refused: int, expected: float) -> None:
        """One slot under the level whose last window left ``refused`` 429s, for one window:
        fewer 429s there is a cap's residue, as many is noise (:meth:`_judge_cut`). Where
        answers reach us late (a loaded event loop) we count in flight what the server is
        done with, the accepted count overstates a cap and a cut stops a slot or two over
        it; the 429s that leaves, learned as noise, were held for the rest of the run (44%
        at a cap of 6). ``expected`` is the share with no cap over us (the probe's base's, or
        the noise known): only a share a material step over it is tested. The hold outlasts
        the window (its answers, and the successes of requests sent before it), so no probe
        moves the level, and the share is the noise meanwhile, as it would be without the
        test: were it noise, a noise level of zero would take every chance window for a cap
        and cut on."""
        self.noise = share
        self._step = (self.slots, self.window, refused, expected)
        self._hold = max(self._hold, self.window + self.slots)
        self.limit = self.base = float(self.slots - 1)
        self.cuts += 1
        self._answers.clear()
        self._rate_limited = 0
        self._block = [0, 0]
        self._after_cut = True
        self._last_cut = self.clock()

    def _cut(self, probe: bool = False) -> None:
        self._step = None  # a cut in a step's window ends the test
        old = self.limit
        self._probe_cut = probe
        self._before_cut = old
        self._cut_share = self._rate_limited / len(self._answers)
        self._cut_slow, self._slow = self._slow, False
        served = self.served_concurrency()
        refused = self._refused_in_flight()
        failed_again = self.base is not None and not self._base_held and old <= self.base + 1
        resolved = self._accepted_before()
        accepted = float(self.in_flight - refused if resolved is None else resolved)
        if served is None or self._cut_slow or failed_again:  # the served level lags: count what was accepted
            new = accepted if resolved is not None else max(accepted, 0.5 * old)
        else:  # a probe that overshot started from a level that held: not below it, nor below what was accepted
            good = self.base if self.base is not None and self._base_held and self.base < old else 0.0
            if resolved is not None:  # exact: bounded by the base only (a probe far over a cap near it), but
                new = max(good, accepted)  # a share that may be noise's (refused at any level) cuts within 0.95
                new = new if probe else min(new, 0.95 * old)
            else:
                new = min(max(float(round(served)), good, accepted, 0.5 * old), 0.95 * old)
        if self._latency is None and self._admitted is not None:  # nothing succeeded: the slots refused are gone already
            self.limit = max(float(self.floor), min(old, float(self._admitted[1])))
        else:
            self.limit = max(float(self.floor), min(new, float(int(old) - 1)))  # at least one slot fewer
        self.base = self.limit
        self._base_held = False
        self.cuts += 1
        # the probe's 429s over its base's share (all of them, not the window's: a slow probe's window holds a
        # few), and one for each refused request still in flight: over target_share of answers. Where 429s
        # come back slowly, each held a slot a while: for a probe's cut (a cap), that time over _OVER_SLOTS, in
        # successes at this level.
        (n0, r0), (n1, r1) = self._baseline, self._probing
        excess = max(0.0, r1 - max(self.noise, r0 / n0 if n0 else 0.0) * n1)
        if self._probe_from is None or not n0:  # no probe under test: the counts may span the whole run so far
            excess = min(excess, max(0.0, self._cut_share - self.noise) * len(self._answers))
        # (not where the level the last cut chose failed at once: a fallen cap's, see the module's doc)
        pending = 0.0 if failed_again else min(max(0.0, self.in_flight - self.limit), refused)
        cost = excess + pending
        turnaround = self._refused_s / r1 if r1 else 0.0
        slot_s = 0.0 if not probe else cost * turnaround * self.limit / (_OVER_SLOTS * (self._latency or math.inf))
        self._hold = max(1, math.ceil(max(cost / self.target_share, slot_s)))  # its last success begins the probe
        self._probe_from = None
        self._refused_s = 0.0
        self._answers.clear()
        self._rate_limited = 0
        self._probing = [0, 0]
        self._block = [0, 0]
        self._after_cut = True
        self._last_cut = self.clock()

    def _grow(self) -> None:
        if self.limit >= self.ceiling:
            return
        if self._slow:
            self._paced += 1
            delay = (self._paced * _GOLDEN) % 1.0 * 0.5 * (self._latency or 0.0)  # over half a mean latency
            schedule = self.schedule or _loop_call_later()
            if schedule is None or delay <= 0:
                self._slow_step(self.cuts)
            else:
                cuts = self.cuts
                schedule(delay, lambda: self._slow_step(cuts))
            return
        if self._hold > 0:
            self._hold -= 1
            if not self._hold:
                self._begin_probe()
            return
        excess = self.limit - (self.base if self.base is not None else self.limit)
        self.limit = min(float(self.ceiling), self.limit + max(1.0, excess) / max(self.limit, 1.0))
        self._hand_over()

    def _begin_probe(self) -> None:
        """The answers at the base so far are the probe's baseline; its own 429s are what it costs."""
        self._baseline, self._probing = self._probing, [0, 0]
        self._refused_s = 0.0
        self._probe_from = self.limit

    def _slow_step(self, cuts: int) -> None:
        """One success's slow-start growth, paced: nothing if a cut came since it was due."""
        if self._slow and cuts == self.cuts and self.limit < self.ceiling:
            self.limit = min(float(self.ceiling), self.limit + self.start_growth)
            self._slow = self.limit < self.ceiling
            if not self._slow:  # at the ceiling: slow start's answers are the baseline, its last round the probe
                self._begin_probe()
                self._probe_from = 0.0
            self._hand_over()


def _loop_call_later() -> Callable[[float, Callable[[], None]], object] | None:
    try:
        return asyncio.get_running_loop().call_later
    except RuntimeError:  # no loop (a synchronous caller): grow at once
        return None


def _fewer(r1: int, n1: int, r0: int, n0: int, threshold: float) -> bool:
    """Whether ``r0`` 429s of ``n0`` answers are fewer than ``r1`` of ``n1`` by more than
    chance (``_STEP_Z`` standard errors) and by a quarter of ``threshold``."""
    pooled = (r0 + r1) / (n0 + n1)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n0 + 1 / n1))
    return r1 / n1 - r0 / n0 >= max(_STEP_Z * se, threshold / 4)

"""The adaptive limiter (simulated servers, injected clock), the progress rate meter, the
emulator's max_concurrency, and generate against a capped emulator end to end."""

from __future__ import annotations

import asyncio
import heapq
import json
import random
import sqlite3
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from tokenbridge.emulator import ConfigError, EmulatorConfig, ProviderConfig, load_emulator_config, running_emulator
from tokenbridge.emulator.config import ProviderFaults
from tokenbridge.generate import GenerateSettings, RequestSettings, generate_run
from tokenbridge.generate.limiter import AdaptiveLimiter
from tokenbridge.generate.progress import RateMeter
from tokenbridge.generate.settings import DatasetSpec

# asserts on the wall clock or on timings (sleeps, rates, deadlines): run alone, after the
# rest of the suite runs on every core (`make test`), so a busy machine cannot fail them
pytestmark = pytest.mark.serial

MODEL = "moonshotai/kimi-k2.5"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _simulate(lim: AdaptiveLimiter, clock: Clock, *, seconds: float, cap=None, noise=0.0,  # noqa: PLR0915 - one event loop and its handlers
              latency: float = 0.2, jitter: float = 0.2, rtt=0.001, seed: int = 1,
              measure_from: float = 0.0, lag: float = 0.0) -> dict:
    """Discrete events: an endless backlog sent as slots allow, to a server that refuses
    what is over ``cap(t)`` at once (in ``rtt``, or ``rtt(rng)`` each) and a share ``noise`` of the rest at random,
    and serves the rest in ``latency`` +- ``jitter`` of it. The limiter's paced growth runs
    as events too. ``lag``: each answer reaches the client up to that much after the server
    sent it (a loaded event loop), so the client counts in flight what the server has done
    with. Rates and in flight count from ``measure_from``; ``whole_429`` is over the whole run."""
    rng = random.Random(seed)
    events: list = []
    seq = active = ok = rl = all_ok = all_rl = peak_before_answer = 0

    def schedule(delay: float, fn) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (clock.t + delay, seq, fn, "timer", False))

    lim.schedule = schedule
    area = 0.0
    start = last = clock.t
    cuts_at: list[float] = []
    first_429_at = None

    def fill() -> None:
        nonlocal seq, active, peak_before_answer
        while (granted := lim.try_acquire()) is not None:
            if not all_ok + all_rl:
                peak_before_answer = lim.in_flight
            c = cap(clock.t - start) if callable(cap) else cap
            p = noise(clock.t - start) if callable(noise) else noise
            if c is not None and active >= c:
                status, took, holds = 429, rtt(rng) if callable(rtt) else rtt, False
            elif rng.random() < p:
                status, took, holds = 429, latency, False
            else:
                status, took, holds = 200, latency * rng.uniform(1 - jitter, 1 + jitter), True
                active += 1
            late = rng.uniform(0, lag) if lag else 0.0
            if holds and late:  # the server is done before the client hears of it
                schedule(took, server_done)
                holds = False
            seq += 1
            heapq.heappush(events, (clock.t + took + late, seq, granted, status, holds))

    def server_done() -> None:
        nonlocal active
        active -= 1

    fill()
    while events and clock.t - start < seconds:
        when, _, sent, status, holds = heapq.heappop(events)
        counting = when - start >= measure_from
        if counting:
            area += lim.in_flight * (when - max(last, start + measure_from))
        last = clock.t = when
        if status == "timer":
            sent()
            fill()
            continue
        active -= holds
        lim.release()
        fill()  # as in the engine: a freed slot goes to a waiting request before the answer is reported
        if status == 200:
            ok += counting
            all_ok += 1
            lim.on_success(sent)
        else:
            rl += counting
            all_rl += 1
            first_429_at = when - start if first_429_at is None else first_429_at
            if lim.on_rate_limited(sent):
                cuts_at.append(when - start)
        fill()
    span = seconds - measure_from
    return {"ok_s": ok / span, "in_flight": area / span, "share_429": rl / max(1, ok + rl), "cuts_at": cuts_at,
            "whole_429": all_rl / max(1, all_ok + all_rl), "successes": all_ok, "refused": all_rl,
            "first_429_at": first_429_at,
            "peak_before_answer": peak_before_answer}


def test_random_429s_keep_the_limit_high():
    for noise in (0.01, 0.05, 0.10):
        clock = Clock()
        lim = AdaptiveLimiter(256, clock=clock)
        r = _simulate(lim, clock, seconds=60, noise=noise)
        assert r["in_flight"] > 0.95 * 256, (noise, r)  # AIMD sat at 12.6 (1%) and 6.1 (5%)
        assert lim.limit == 256.0
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=60, noise=0.2)  # heavy noise: a chance cut is undone or left behind
    assert r["in_flight"] > 0.8 * 256, r


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("cap", [3, 4, 8, 16, 64, 200])
def test_a_hard_cap_is_found_quickly_and_held_with_few_429s(cap, seed):
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=60, cap=cap, measure_from=10, seed=seed)
    assert r["cuts_at"][0] - r["first_429_at"] < 0.02  # the first burst of the cap's 429s cuts at once
    assert 0.85 * cap <= r["in_flight"] <= cap + 1, r
    assert r["share_429"] <= 0.05, r  # the whole run's share: the 3,000-request test below
    assert int(lim.limit) <= cap + 2


@pytest.mark.parametrize("latency", [0.05, 0.2, 5.0, 60.0])
@pytest.mark.parametrize("cap", [4, 16, 64, 200])
def test_a_run_of_3000_requests_from_256_into_a_cap_gets_few_429s(cap, latency):
    """The whole run, start-up included: starting at 256 into a cap of C cost 256 - C
    refusals before the first answer (8% of a 3,000-request run at C = 16)."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    seconds = 3000 / cap * latency  # about 3,000 answers
    r = _simulate(lim, clock, seconds=seconds, cap=cap, latency=latency, rtt=latency / 200,
                  measure_from=seconds / 2)
    assert r["peak_before_answer"] == 16  # slow start: 16 sent before anything came back
    assert r["whole_429"] <= 0.05, r
    assert 0.85 * cap <= r["in_flight"] <= cap + 1, r  # the second half of the run


@pytest.mark.parametrize("turnaround", [2, 5, 10])
@pytest.mark.parametrize("latency", [0.2, 5.0, 60.0])
@pytest.mark.parametrize("cap", [4, 16, 64, 200])
def test_a_cap_whose_429s_come_back_slowly_is_told_from_noise(cap: int, latency: float, turnaround: int) -> None:
    """429s back in a half, a fifth, a tenth of the latency (a loaded server): a slot over the
    cap is a few 429s a latency, a share a fixed threshold takes for noise. The cut landed a
    slot or two over the cap (the slots sent within the last turnaround looked accepted), the
    share that stayed was judged noise and the cut undone: 5.1-15% of the run answered 429."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    seconds = 3000 / cap * latency  # about 3,000 answers
    r = _simulate(lim, clock, seconds=seconds, cap=cap, latency=latency, rtt=latency / turnaround,
                  measure_from=seconds / 2)
    assert r["whole_429"] <= 0.05, r
    assert 0.85 * cap <= r["in_flight"] <= cap + 1, r  # the second half of the run
    assert lim.base == cap, lim.base  # the last cut went to the cap itself: what the server accepted


@pytest.mark.parametrize("lag", [0.3, 0.5])
@pytest.mark.parametrize("cap", [4, 6])
def test_a_small_cap_is_held_when_answers_reach_the_client_late(cap: int, lag: float) -> None:
    """Answers that reach the client up to ``lag`` latencies after the server sent them (a
    loaded event loop) make the client count in flight what the server is done with, so
    the accepted count overstates the cap and a cut stops a slot or two over it. The 429s
    that leaves were learned as noise and held for the run (a median 33-43% of answers at a
    cap of 4 or 6, in every run); a window a slot lower now tells them apart. Not in every
    run: one window against one cannot always tell a one-slot step from chance (at a cap of
    6 and half a latency late, 9 seeds of 24 keep 429s to a tenth, 5 before the start took
    refused slots away; 6 seeds were too few to hold a rate to), so what is held to a bound
    is that at least a quarter of the runs keep 429s to a tenth (the old limiter: none)."""
    shares = []
    for seed in range(1, 25):
        clock = Clock()
        lim = AdaptiveLimiter(32, clock=clock)
        r = _simulate(lim, clock, seconds=6.0, cap=cap, latency=0.01, rtt=0.002, seed=seed, measure_from=2.0,
                      lag=0.01 * lag)
        shares.append(r["share_429"])
    assert sum(share <= 0.1 for share in shares) >= len(shares) / 4, shares


@pytest.mark.parametrize("turnaround", [2, 5, 10])
def test_a_cap_just_under_the_ceiling_is_found_when_its_429s_come_back_slowly(turnaround: int) -> None:
    """Slow start reached the ceiling of 256 over a cap of 250 with no cut: at a fifth-latency
    turnaround its six slots over were 9% of the run in 429s, under the fixed threshold, and
    nothing probed. Slow start's answers are the baseline of a test at the ceiling."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    seconds = 3000 / 250
    r = _simulate(lim, clock, seconds=seconds, cap=250, latency=1.0, rtt=1.0 / turnaround, measure_from=seconds / 2)
    assert r["whole_429"] <= 0.05 and 0.85 * 250 <= r["in_flight"] <= 251, r
    assert lim.base == 250, lim.base  # cut to the cap itself


def test_the_accepted_count_leaves_out_the_instant_a_refusal_answering_now_was_sent() -> None:
    """One turnaround ago is the last instant whose refusals are all back, but a request sent
    at exactly that instant answers now, maybe after the answer being handled: counted, it
    put slow start's cut (tripling, 429s back in a fifth of a latency) at 41 on a cap of 40."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock, start_growth=2.0)
    r = _simulate(lim, clock, seconds=10, cap=40, latency=1.0, rtt=0.2)
    assert len(r["cuts_at"]) == 1 and lim.base == 40, (r["cuts_at"], lim.base)


@pytest.mark.parametrize("cap", [40, 100, 130, 150, 200, 250])
def test_slow_start_is_paced_when_answers_come_back_together(cap):
    """A server with one steady latency answers a round at once: unpaced, the window
    doubled in one burst before a 429 could come back (128 to 256 into a cap of 130 was
    9.7% of a 3,000-request run refused, 250 was fine, 130 not)."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=3000 / cap, cap=cap, latency=1.0, jitter=0.0, rtt=0.05)
    assert r["whole_429"] <= 0.05, r


def test_slow_start_reaches_the_ceiling_in_a_few_rounds():
    for latency in (0.05, 1.0, 60.0):
        clock = Clock()
        lim = AdaptiveLimiter(256, clock=clock)
        r = _simulate(lim, clock, seconds=7 * latency, latency=latency, measure_from=6 * latency)
        assert r["peak_before_answer"] == 16 and r["cuts_at"] == []
        # 16, 32, 64, 128, 256, each step paced over half a latency: the 7th round is whole
        assert lim.limit == 256.0 and r["in_flight"] > 255, r
    lim = AdaptiveLimiter(256, start=256)  # no slow start when asked
    assert lim.limit == 256.0 and lim.slots == 256
    assert AdaptiveLimiter(8).limit == 8.0 and AdaptiveLimiter(64, floor=32).limit == 32.0


def test_the_cap_is_reached_within_a_few_rounds():
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=2, cap=64)  # 2 s = 10 rounds at 200 ms
    assert 56 <= lim.limit <= 66 and len(r["cuts_at"]) <= 4, (lim.limit, r["cuts_at"])
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=0.8, cap=64)  # the slow start's cut lands on the cap itself
    assert 62 <= lim.limit <= 64 and len(r["cuts_at"]) <= 2, (lim.limit, r["cuts_at"])


def test_recovers_fast_when_the_cap_is_lifted():
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    _simulate(lim, clock, seconds=60, cap=lambda t: 64 if t < 20 else None, measure_from=50)
    assert lim.limit == 256.0
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=30, cap=lambda t: 64 if t < 20 else None, measure_from=25)
    assert r["in_flight"] > 0.95 * 256, r  # back at the ceiling within 5 s (25 rounds) of the lift


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_recovers_fast_when_heavy_noise_stops(seed):
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=30, noise=lambda t: 0.4 if t < 20 else 0.0, measure_from=25, seed=seed)
    assert r["in_flight"] > 0.95 * 256 and lim.limit == 256.0, r


def test_a_cap_that_rises_is_followed_within_a_few_rounds():
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=30, cap=lambda t: 32 if t < 20 else 128, measure_from=25)
    assert 0.85 * 128 <= r["in_flight"] <= 129 and r["share_429"] <= 0.05, r


def test_a_cap_that_falls_is_followed():
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=40, cap=lambda t: 128 if t < 10 else 32, measure_from=20)
    assert 0.85 * 32 <= r["in_flight"] <= 33 and r["share_429"] <= 0.05, r


def _loaded_loop(clock: Clock, period: float = 0.03) -> Callable[[random.Random], float]:
    """429 turnarounds as a loaded event loop has them: 30 ms for half of every ``period``,
    1 ms the other half (each +-20%), as a client that writes each answer to SQLite saw them."""
    return lambda rng: (0.03 if clock.t % period < period / 2 else 0.001) * rng.uniform(0.8, 1.2)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("cap", [50, 20])
def test_a_cap_that_falls_is_met_from_above_when_turnarounds_vary(cap: int, seed: int) -> None:
    """100, then ``cap`` from 6 s (300 ms latency): while the server drains what it took under
    the old cap it refuses every slot freed, and cuts follow each other every 8 429s. Each
    counted in flight less the 429s back within their own turnaround of now, which takes a
    slot twice when turnarounds shrink: the chain stepped under the cap (here 0.73-0.9 of it;
    35 of 50 and 12 of 20 against a mock server) and the hold kept it there ~37 latencies.
    Counted at the one instant a turnaround ago (exact) it lands on the cap."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=12, cap=lambda t: 100 if t < 6 else cap, latency=0.3, jitter=0.0,
                  rtt=_loaded_loop(clock), seed=seed, measure_from=6 + 3 * 0.3)
    # from 3 latencies after the fall on: the server serves 0.95 of its cap, few 429s
    assert r["ok_s"] >= 0.95 * cap / 0.3 and r["share_429"] <= 0.05, r


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_cap_that_rises_after_a_fall_is_followed_within_a_hold_and_a_few_rounds(seed: int) -> None:
    """100, 20 from 6 s, 150 from 14 s (300 ms latency, turnarounds as above): at 20 a probe's
    hold is ~300 successes (15 latencies) and 20 to 150 eight rounds of probe growth, so within
    26 latencies of the rise it is there. Cut under 20, the hold (in successes) lasted longer
    and one seed took ~30."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=14 + 26 * 0.3 + 3, cap=lambda t: 100 if t < 6 else (20 if t < 14 else 150),
                  latency=0.3, jitter=0.0, rtt=_loaded_loop(clock), seed=seed, measure_from=14 + 26 * 0.3)
    assert r["ok_s"] >= 0.9 * 150 / 0.3 and r["share_429"] <= 0.05, r


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("turnaround", [0.06, 0.1])
def test_a_cap_that_rises_after_a_fall_is_followed_when_429s_come_back_slowly(turnaround: float, seed: int) -> None:
    """As above with 429s back in a fifth or a third of the 300 ms latency: the fall's refused
    requests in flight at its last cut were held for, 800-1,400 successes at 20 (40-70
    latencies), and 20 latencies after the rise to 150 the server was still at 20."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=14 + 20 * 0.3 + 3, cap=lambda t: 100 if t < 6 else (20 if t < 14 else 150),
                  latency=0.3, rtt=turnaround, seed=seed, measure_from=14 + 20 * 0.3)
    assert r["ok_s"] >= 0.9 * 150 / 0.3 and r["share_429"] <= 0.05, r


def test_cut_needs_a_real_share_and_one_429_with_retry_after_changes_nothing():
    clock = Clock()
    lim = AdaptiveLimiter(64, start=64, clock=clock)
    grants = [lim.try_acquire() for _ in range(64)]
    assert None not in grants and lim.try_acquire() is None
    clock.t += 0.1
    lim.release()  # one success first (before any, a 429's slot is not sent again: the test below)
    lim.on_success(grants[0])
    assert lim.try_acquire() is not None

    def refused() -> bool:  # as the engine does: release, the slot goes to the next request, then the answer
        lim.release()
        assert lim.try_acquire() is not None  # the pool is whole: nothing waits for anyone's Retry-After
        return lim.on_rate_limited(sent_at=clock.t - 0.1)

    for _ in range(7):  # a 429 (whatever its Retry-After) is one answer among the window
        assert not refused()
    assert lim.limit == 64 and lim.cuts == 0
    assert refused()  # the 8th in a row: a cap
    # one success's served level says 1; the 64 in flight less the 8 refused ones says more
    # (each came back within its own turnaround of now and its slot was sent again)
    assert lim.limit == 56 and lim.cuts == 1
    clock.t += 0.01
    assert not lim.on_rate_limited(sent_at=clock.t - 0.1)  # granted before the cut: answers for the old limit
    lim2 = AdaptiveLimiter(64, start=64, clock=clock)
    grants = [lim2.try_acquire() for _ in range(9)]
    clock.t += 0.1
    lim2.release()
    lim2.on_success(grants[0])
    for _ in range(8):  # slots that nobody took again (nothing left to send) are not refused in flight
        lim2.release()
        cut = lim2.on_rate_limited(sent_at=clock.t - 0.1)
    assert cut and lim2.limit == 32.0  # 0 in flight: half the old limit, the floor of a cut


@pytest.mark.parametrize("cap", [1, 2, 4, 8])
def test_a_cap_under_the_start_costs_the_starts_refusals_and_one_more(cap: int) -> None:
    """16 sent into a cap of C under them: 16 - C refusals are the start's. The cut went to in
    flight less the 429s so far, half of 16 at the 8th, and each half was sent again into the
    cap: 43 / 32 / 24 / 16 refusals at caps 1 / 2 / 4 / 8, the last left at 7 (58 and 32 at
    caps 1 and 4 against a mock server). Before any success a refusal now takes its slot
    away; the first one's, sent again before it was heard, is the one more."""
    for latency, rtt in ((0.1, 0.0005), (1.0, 0.2)):
        clock = Clock()
        lim = AdaptiveLimiter(256, clock=clock)
        r = _simulate(lim, clock, seconds=20 * latency, cap=cap, latency=latency, rtt=rtt)
        assert r["refused"] <= 16 - cap + 1 and lim.limit == cap, (latency, r["refused"], lim.limit)
        assert len(r["cuts_at"]) <= 16 - cap  # each a slot taken away (one of them also ends slow start)


def test_a_429_before_any_success_costs_its_one_slot_and_slow_start_goes_on() -> None:
    """A random 429 before the first success (an upstream's come back fast) is not a cap:
    its slot is not sent again, and that is all."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    sent = [lim.try_acquire() for _ in range(16)]
    clock.t += 0.05
    lim.release()  # as the engine does: release (the slot goes to the next request), then the answer
    again = lim.try_acquire()
    assert again is not None and lim.on_rate_limited(sent[1])
    assert lim.limit == 15 and lim.cuts == 0
    lim.release()  # the request sent into its slot is refused too: not one of the start's, nothing more
    assert not lim.on_rate_limited(again) and lim.limit == 15
    clock.t += 0.05
    for at in sent[2:]:  # the rest succeed: slow start grows from 15, one slot a success
        lim.release()
        lim.on_success(at)
    assert lim.limit == 15 + 14 and lim.cuts == 0 and lim._slow


def test_acquire_waits_in_order_and_returns_the_grant_time():
    clock = Clock()
    lim = AdaptiveLimiter(2, clock=clock)

    async def main():
        a, b = await lim.acquire(), await lim.acquire()
        assert a == b == 1000.0
        waiter = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0)
        assert not waiter.done()
        clock.t = 1005.0
        lim.release()
        assert await waiter == 1005.0 and lim.in_flight == 2

    asyncio.run(main())


# --- progress rate -----------------------------------------------------------------------


@pytest.mark.parametrize("rate", [10, 1_000, 100_000])
def test_rate_meter_is_right_at_any_rate(rate):
    clock = Clock(500.0)
    meter = RateMeter(clock=clock)
    seconds = 40 if rate <= 1000 else 3  # past the 30 s window, and a short burst at 100k/s
    for i in range(int(rate * seconds)):
        clock.t = 500.0 + i / rate
        meter.add(7)
    rps, tps = meter.rates()
    assert rps == pytest.approx(rate, rel=0.02) and tps == pytest.approx(7 * rate, rel=0.02)
    last = clock.t
    clock.t += 60  # nothing for a whole window: the 19 completions after the first of the last 20, over the time since it
    rps, tps = meter.rates()
    assert rps == pytest.approx(19 / (clock.t - (last - 19 / rate)), rel=0.02) and tps == pytest.approx(7 * rps)
    clock.t += 86_400 * 365  # a year later: still 20 over the time they took, never a division by zero
    assert 0 < meter.rates()[0] < 1e-6


@pytest.mark.parametrize("every_s", [60.0, 600.0])
def test_rate_meter_is_right_below_one_completion_per_window(every_s):
    """One slot and long reasoning: a 30 s window alone shows 0 or 1/30 s by turns."""
    clock = Clock(0.0)
    meter = RateMeter(clock=clock)
    seen = []
    for i in range(1, 60):
        clock.t = i * every_s
        meter.add(3)
        if i >= 21:
            for at in (0.0, 0.5 * every_s):  # right after one, and halfway to the next
                clock.t = i * every_s + at
                seen.append(meter.rates()[0] * every_s)
    assert min(seen) > 0.9 and max(seen) < 1.1, (min(seen), max(seen))  # the true rate, within 10%
    assert len(meter._buckets) <= 21  # memory: the completions the rate needs, not the history


@pytest.mark.parametrize("every_s", [60.0, 2.0])  # one a minute (long reasoning), one every 2 s (0.5/s)
def test_rate_meter_at_low_rates_counts_intervals_not_completions(every_s):
    """Fewer than 20 in the 30 s window: the rate is over the last 20 completions, from the
    first of them, so over the 19 intervals after it. 20 over 19 intervals read 5% high
    (0.53 for 0.5/s): right after a completion it is now the true rate."""
    clock = Clock(1000.0)
    meter = RateMeter(clock=clock)
    seen = []
    for i in range(1, 80):
        clock.t = 1000.0 + 0.1 + i * every_s  # off the 0.5 s bucket edges, as real completions are
        meter.add(5)
        if i >= 21:
            seen.append(meter.rates()[0] * every_s)
    assert min(seen) == pytest.approx(1, rel=0.01) and max(seen) == pytest.approx(1, rel=0.01), (min(seen), max(seen))
    assert meter.rates()[1] == pytest.approx(5 * meter.rates()[0])  # tokens per completion: 5


@pytest.mark.parametrize("every_s", [60.0, 2.0])
def test_rate_meter_at_low_rates_is_unbiased_for_random_completions(every_s):
    """Completions at random (Poisson) times, the rate read every half an interval: on
    average the true rate (it averaged 5% high at 1/min, 4% at 0.5/s)."""
    rnd = random.Random(7)
    clock = Clock(0.0)
    meter = RateMeter(clock=clock)
    seen, t, due = [], 0.0, 0.0
    for i in range(8000):
        t += rnd.expovariate(1 / every_s)
        while due < t:
            clock.t = due
            if i > 40:
                seen.append(meter.rates()[0] * every_s)
            due += every_s / 2
        clock.t = t
        meter.add(1)
    assert sum(seen) / len(seen) == pytest.approx(1, abs=0.015)


def test_rate_meter_with_few_completions_is_over_the_time_since_it_started():
    """Fewer than 20 in all: the meter's start is a set time, so all of them over the time
    since it, in the window or before it (a stall), never 0 while there were some."""
    clock = Clock(100.0)
    meter = RateMeter(clock=clock)
    assert meter.rates() == (0.0, 0.0)
    for i in range(1, 6):
        clock.t = 100.0 + 10 * i
        meter.add(3)
    assert meter.rates() == pytest.approx((5 / 50, 15 / 50))
    clock.t = 300.0  # 250 s quiet: all five are before the window
    assert meter.rates() == pytest.approx((5 / 200, 15 / 200))


def _line_at(rate: float, seconds: float, total: int, *, now: float | None = None) -> str:
    from tokenbridge.generate.engine import EngineStats
    from tokenbridge.generate.progress import format_line

    clock = Clock(0.0)
    stats = EngineStats(total=total, meter=RateMeter(clock=clock))
    n = int(rate * seconds)
    for i in range(n):
        clock.t = i / rate
        stats.meter.add(1)
    stats.done = n
    clock.t = seconds if now is None else now
    return format_line(stats)


def _eta_s(line: str) -> int:
    eta = line.rsplit("ETA ", 1)[1]  # str(timedelta): "H:MM:SS" or "N days, H:MM:SS"
    days, _, hms = eta.rpartition(", ")
    h, m, s = hms.split(":")
    return int(days.split()[0] if days else 0) * 86_400 + int(h) * 3600 + int(m) * 60 + int(s)


def test_rate_and_eta_in_the_progress_line():
    line = _line_at(5000, 10, 1_000_000)  # far past the old 136.5/s ceiling
    assert "5000.0 req/s" in line and "ETA 0:03:10" in line, line  # 950,000 left at 5,000/s
    line = _line_at(10, 60, 40_000)
    assert "10.0 req/s" in line and "ETA 1:05:40" in line, line  # 39,400 left at 10/s
    line = _line_at(1 / 60, 3600, 100, now=3540.1)  # one a minute, just after the 60th: 40 left
    assert ", 1.0 req/min, 1 out tok/min, " in line and _eta_s(line) == pytest.approx(40 * 60, abs=2), line


@pytest.mark.parametrize(("every_s", "shown"), [
    (0.1, "10.0 req/s, 50 out tok/s"),
    (1.0, "1.0 req/s, 5 out tok/s"),
    (2.0, "30.0 req/min, 150 out tok/min"),  # 0.5/s: was "0.5 req/s" (and 0.53 before the rate was fixed)
    (60.0, "1.0 req/min, 5 out tok/min"),  # was "0.0 req/s, 0 out tok/s"
    (600.0, "6.0 req/h, 30 out tok/h"),  # was "0.0 req/s"; "0.1 req/min" says little
    (86_400.0, "0.042 req/h, 0.21 out tok/h"),  # a day apart: digits, never 0.0
])
def test_a_low_rate_is_shown_per_minute_or_hour_never_as_zero(every_s, shown):
    """Completions ``every_s`` apart of 5 tokens each from the meter's start (mid-bucket,
    where a bucket's one completion is taken to be), read just after the 40th."""
    from tokenbridge.generate.engine import EngineStats
    from tokenbridge.generate.progress import format_line

    clock = Clock(0.25)
    stats = EngineStats(total=100, meter=RateMeter(clock=clock))
    for i in range(1, 41):
        clock.t = 0.25 + i * every_s
        stats.meter.add(5)
    stats.done = 40
    line = format_line(stats)
    assert f" failed, {shown}, $" in line, line
    assert _eta_s(line) == pytest.approx(60 * every_s, rel=0.001, abs=1), line  # 60 left, one every every_s


# --- emulator: max_concurrency ----------------------------------------------------------


def _post(url: str) -> int:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"{url}/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        assert e.code != 429 or e.headers["Retry-After"] == "3"
        return e.code


def test_emulator_max_concurrency_answers_429_above_the_cap(kimi):
    capped = ProviderConfig(name="capped/fp8", latency_ms=300.0, max_concurrency=3)
    cfg = EmulatorConfig(providers=(capped,), retry_after_s=3, min_tokens=4, max_tokens=8)
    with running_emulator(cfg, tokenizer=kimi) as url:
        with ThreadPoolExecutor(8) as pool:
            statuses = sorted(pool.map(lambda _: _post(url), range(8)))
        assert statuses == [200] * 3 + [429] * 5
        assert _post(url) == 200  # the slots are free again
        with urllib.request.urlopen(url.removesuffix("/api/v1") + "/stats") as r:
            stats = json.loads(r.read())
        assert stats["by_fault"] == {"over_capacity": 5} and stats["in_flight"] == 0
        assert stats["busy_s"] >= 4 * 0.3


def test_emulator_max_concurrency_is_range_checked(tmp_path):
    path = tmp_path / "emu.toml"
    path.write_text('[[providers]]\nname = "a/fp8"\nmax_concurrency = 0\n')
    with pytest.raises(ConfigError, match=r":3: providers\[0\]\.max_concurrency: "):
        load_emulator_config(path)
    path.write_text('[[providers]]\nname = "a/fp8"\nmax_concurrency = "8"\n')
    with pytest.raises(ConfigError, match=r":3: providers\[0\]\.max_concurrency: "):
        load_emulator_config(path)
    path.write_text('[[providers]]\nname = "a/fp8"\nmax_concurrency = 8\n')
    assert load_emulator_config(path).providers[0].max_concurrency == 8


# --- end to end ----------------------------------------------------------------------------


def _generate_against(kimi, tmp_path, monkeypatch, provider: ProviderConfig, n: int, *, concurrency: int):
    """``generate_run`` of ``n`` prompts against an emulator serving ``provider`` (Retry-After 1 s):
    its summary, after asserting every prompt done, and every attempt as
    (sample_id, n, started_at, latency_s, http_status)."""
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-v1-test")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"question {i % 32}"}) + "\n" for i in range(n)))
    cfg = EmulatorConfig(providers=(provider,), retry_after_s=1, min_tokens=4, max_tokens=8)
    with running_emulator(cfg, tokenizer=kimi) as url:
        settings = GenerateSettings(datasets=(DatasetSpec("d", prompts),), request=RequestSettings(model=MODEL),
                                    base_url=url, concurrency=concurrency, progress="none", backoff_base_s=0.05,
                                    backoff_max_s=0.2, max_attempts=20)
        summary = generate_run(settings, tmp_path / "run")
    assert summary.done == n and summary.failed == 0
    with sqlite3.connect(tmp_path / "run" / "state.sqlite") as con:
        attempts = con.execute("SELECT sample_id, n, started_at, latency_s, http_status FROM attempts").fetchall()
    return summary, attempts


def test_generate_against_a_capped_emulator_finishes_with_few_429s(kimi, tmp_path, monkeypatch):
    n = 600
    capped = ProviderConfig(name="capped/fp8", latency_ms=50.0, max_concurrency=8)
    summary, attempts = _generate_against(kimi, tmp_path, monkeypatch, capped, n, concurrency=64)
    by_sample = {(a[0], a[1]): a for a in attempts}
    refused = [a for a in attempts if a[4] == 429]
    for sample, k, started, latency, _ in refused:  # Retry-After: 1 delays that request's retry...
        assert by_sample[(sample, k + 1)][2] >= started + latency + 0.99
    first = min(refused, key=lambda a: a[2])
    sent_meanwhile = [a for a in attempts if first[2] + first[3] < a[2] < first[2] + first[3] + 0.9]
    assert len(sent_meanwhile) > 20  # ...and only that request: the others went on being sent
    rate_limited = summary.errors.get("http_429", 0)
    # the first burst (56: 64 sent, 8 served), the way down to 8, a few probes; a limiter deaf to
    # 429s would churn its 56 extra slots through tens of thousands of them
    assert 0 < rate_limited <= 0.4 * n, summary.errors


def test_random_429s_with_retry_after_delay_only_their_own_request(kimi, tmp_path, monkeypatch):
    """20% of answers 429 with Retry-After: 1, at any load: each refused request waits out
    its Retry-After, and the others keep the whole pool busy (the limiter does not shrink)."""
    n, conc = 400, 32
    noisy = ProviderConfig(name="noisy/fp8", latency_ms=100.0, faults=ProviderFaults(rate_limit=0.2))
    summary, attempts = _generate_against(kimi, tmp_path, monkeypatch, noisy, n, concurrency=conc)
    by_sample = {(a[0], a[1]): a for a in attempts}
    refused = [a for a in attempts if a[4] == 429]
    assert 0.1 * len(attempts) < len(refused) < 0.3 * len(attempts)
    for sample, k, started, latency, _ in refused:
        assert by_sample[(sample, k + 1)][2] >= started + latency + 0.99
    # between the first 429's answer and the last first attempt, the pool stays full
    first = min(a[2] + a[3] for a in refused)
    last_first = max(a[2] for a in attempts if a[1] == 1)
    assert last_first - first > 0.5, (first, last_first)
    busy = sum(max(0.0, min(s + lat, last_first) - max(s, first)) for _, _, s, lat, _ in attempts)
    assert busy / (last_first - first) > 0.8 * conc


def test_a_cap_that_appears_mid_run_costs_few_429s():
    """No cap, then one of 100: each cut after the first must count what is accepted since
    the last cut (the history before it still shows the old level; counting it cut one
    slot per 8 429s, 18.7% of the run refused)."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=40, cap=lambda t: 100 if t > 10 else None, measure_from=20)
    assert r["whole_429"] <= 0.05, r
    assert 0.85 * 100 <= r["in_flight"] <= 101, r


@pytest.mark.parametrize(("ceiling", "cap"), [(16, 15), (16, 14)])
def test_a_short_cap_under_noise_is_left_behind_when_it_lifts(ceiling, cap):
    """At the ceiling from the start (no slow start) with 5% noise, a cap for 10 s: the cut's
    hold pays for that cut's 429s, not for every noise 429 since the run began (a hold of
    3,767 successes kept the limit at 15 for minutes)."""
    clock = Clock()
    lim = AdaptiveLimiter(ceiling, start=ceiling, clock=clock)
    r = _simulate(lim, clock, seconds=200, noise=0.05, cap=lambda t: cap if 100 < t < 110 else None, latency=1.0,
                  rtt=0.2, measure_from=150)
    assert lim.limit == ceiling and r["in_flight"] > ceiling - 0.5, (lim.limit, lim._hold, r)


def test_the_ceiling_test_ends_with_its_counts():
    """Slow start reaches the ceiling, noise rises later, a cap comes and goes: the limit is
    back at the ceiling (the ended ceiling test's counts made a hold of 38,000 successes)."""
    clock = Clock()
    lim = AdaptiveLimiter(256, clock=clock)
    r = _simulate(lim, clock, seconds=100, noise=lambda t: 0.05 if t > 20 else 0.0,
                  cap=lambda t: 250 if 60 < t < 70 else None, measure_from=80)
    assert lim.limit == 256.0 and r["in_flight"] > 0.98 * 256, (lim.limit, lim._hold, r)

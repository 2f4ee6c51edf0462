"""What a run books and when it stops: BYOK spend, learned prices, the limits it names."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from conftest import write_prompts
from tokenbridge.generate import GenerateSettings, RequestSettings, Store, agenerate_run
from tokenbridge.generate.body import checked_usage
from tokenbridge.generate.budget import cost_of
from tokenbridge.generate.run import ExitCode
from tokenbridge.generate.secrets import ApiKey
from tokenbridge.generate.settings import DatasetSpec, Prices

# asserts on the wall clock or on timings (sleeps, rates, deadlines): run alone, after the
# rest of the suite runs on every core (`make test`), so a busy machine cannot fail them
pytestmark = pytest.mark.serial

KEY = ApiKey("TB_MONEY", "sk-or-v1-money-test-key-0123456789")
Reply = Callable[[int], Awaitable[web.StreamResponse]]  # the 1-based arrival number -> the answer


def _answer(usage: dict) -> web.Response:
    body = {"id": "gen-m", "object": "chat.completion", "created": 1, "model": "m", "provider": "p",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": usage}
    return web.json_response(body)


def _run(tmp_path: Path, n: int, reply: Reply, **kw) -> object:
    """One generate run of ``n`` prompts against a server answering each request by ``reply``."""
    arrivals = 0

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal arrivals
        await request.read()
        arrivals += 1
        return await reply(arrivals)

    async def main() -> object:
        app = web.Application()
        app.router.add_post("/api/v1/chat/completions", handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/api/v1"
        settings = dict(datasets=(DatasetSpec("m", write_prompts(tmp_path, n)),), base_url=url, progress="none",
                        request=RequestSettings(model="m", max_tokens=1000), max_attempts=2, backoff_base_s=0.01,
                        backoff_max_s=0.02, timeout_s=10.0)
        settings.update(kw)
        try:
            return await agenerate_run(GenerateSettings(**settings), tmp_path / "run", key=KEY)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


# --- BYOK: the upstream charge is the spend ------------------------------------------------

BYOK = {"prompt_tokens": 500, "completion_tokens": 1000, "cost": 0.0, "is_byok": True,
        "cost_details": {"upstream_inference_cost": 0.02}}


def test_a_byok_answer_costs_its_fee_plus_its_upstream_charge():
    assert checked_usage({"usage": BYOK}).cost == 0.02
    assert cost_of(BYOK, None) == 0.02
    fee = {**BYOK, "cost": 0.001}  # OpenRouter's BYOK fee, charged on top
    assert cost_of(fee, None) == pytest.approx(0.021)
    # without is_byok the upstream charge is already inside cost (OpenRouter's credits paid it)
    assert cost_of({**BYOK, "cost": 0.03, "is_byok": False}, None) == 0.03
    assert cost_of({k: v for k, v in BYOK.items() if k != "is_byok"} | {"cost": 0.03}, None) == 0.03


@pytest.mark.parametrize(("usage", "problem", "kept"), [
    ({"is_byok": "true", "cost_details": {"upstream_inference_cost": 0.02}}, 'usage.is_byok = "true"',
     {"cost_details": {"upstream_inference_cost": 0.02}}),
    ({"cost_details": {"upstream_inference_cost": -1, "x": 1}}, "usage.cost_details.upstream_inference_cost = -1",
     {"is_byok": True, "cost_details": {"x": 1}}),
    ({"cost_details": {"upstream_inference_cost": "0.02"}}, 'usage.cost_details.upstream_inference_cost = "0.02"',
     {"is_byok": True, "cost_details": {}}),
    ({"cost_details": None}, "usage.is_byok is true without usage.cost_details.upstream_inference_cost",
     {"is_byok": True, "cost_details": None}),
    ({"cost": 999.0, "cost_details": {"upstream_inference_cost": 2.0}},
     "usage.cost + usage.cost_details.upstream_inference_cost = 1001", {"is_byok": True,
                                                                       "cost_details": {"upstream_inference_cost": 2.0}}),
])
def test_a_byok_answer_without_a_usable_upstream_charge_has_no_known_cost(usage, problem, kept):
    """Booking OpenRouter's fee alone would let --max-cost pass: the cost is dropped with the
    bad field, so it comes from [prices] (or the reservation), as for a bad usage.cost."""
    checked = checked_usage({"usage": {"prompt_tokens": 500, "completion_tokens": 1000, "cost": 0.0, "is_byok": True}
                                       | usage})
    assert checked.cost is None and checked.problems == [problem]
    assert checked.usage == {"prompt_tokens": 500, "completion_tokens": 1000} | kept
    assert cost_of(checked.usage, None) is None  # the stored usage says the same when read again
    assert cost_of(checked.usage, Prices(prompt=1.0, completion=2.0)) == pytest.approx(0.0025)


def test_max_cost_stops_a_run_whose_answers_are_paid_on_the_users_own_key(tmp_path):
    async def reply(_: int) -> web.StreamResponse:
        return _answer(BYOK)

    # [prices] far below the upstream charge: each request reserves $0.0025 at most, costs $0.02
    summary = _run(tmp_path, 10, reply, concurrency=1, max_cost=0.05, prices=Prices(prompt=1.0, completion=2.0))
    assert (summary.exit_code, summary.done, summary.pending) == (ExitCode.BUDGET, 3, 7)
    assert summary.spent_total == pytest.approx(0.06) and summary.bad_usage == 0
    with Store.open(tmp_path / "run") as store:
        assert [a.cost for a in store.attempts("m-0")] == [0.02]
        assert store.total_cost() == pytest.approx(0.06)
    rows = [json.loads(x) for x in (tmp_path / "run" / "exchanges.jsonl").read_text().splitlines()]
    assert [r["meta"]["cost"] for r in rows] == [0.02, 0.02, 0.02]


# --- learned prices: a cheap answer does not shrink later reservations ---------------------


def test_a_free_answer_teaches_no_price_and_the_pricier_of_equal_ratios_is_kept():
    from tokenbridge.generate.budget import PriceBounds

    free = PriceBounds()
    free.add(500, 1000, 0.0)
    assert free.bound(500, 1000) is None  # unknown, not $0
    for order in ([0.002, 0.01], [0.01, 0.002]):
        b = PriceBounds()
        for cost in order:
            b.add(500, 1000, cost)
        assert b.bound(500, 1000) == (0.01, False)
    # a discounted answer further out kept for its ratio cannot pull a bound under what a
    # dearer one proved: (500, 1000) costs at least $0.01 whatever the prices
    b = PriceBounds()
    b.add(500, 1000, 0.01)
    b.add(100, 1000, 0.001)
    assert b.bound(500, 1000)[0] == pytest.approx(0.01) and b.floor(250, 500) == pytest.approx(0.005)


@pytest.mark.parametrize("first", [0.0, 0.002, 0.01])
def test_without_prices_a_cheap_first_answer_never_lets_side_by_side_sends_pass_the_cap(first):
    """Budget alone: 16 requests may be in flight, answers settle in order; every answer but
    the first costs $0.01. Before, the first answer's price let 15 requests go at once."""
    from tokenbridge.generate.budget import Budget

    b = Budget(max_cost=0.05, prices=None)
    flight: list[float] = []
    sent = 0
    while True:
        r = b.admit(400, 1000) if len(flight) < 16 else None
        if r is not None:
            flight.append(r)
            continue
        if not flight:
            break
        cost = first if sent == 0 else 0.01
        sent += 1
        b.settle(flight.pop(0), cost, prompt_tokens=500, completion_tokens=1000, provider="p")
    assert b.exhausted and b.spent <= 0.05 + 0.01 + 1e-12


def test_answers_that_all_cost_nothing_go_one_at_a_time_under_a_cap():
    from tokenbridge.generate.budget import Budget

    b = Budget(max_cost=1.0, prices=None)
    for _ in range(3):
        r = b.admit(400, 1000)
        assert r == 0.0 and b.admit(400, 1000) is None and not b.exhausted  # the second waits
        b.settle(r, 0.0, prompt_tokens=500, completion_tokens=1000, provider="free")
    assert b.learning_sends == 3 and b.providers == {}
    zero = Budget(max_cost=1.0, prices=Prices(prompt=0.0, completion=0.0))
    assert [zero.admit(400, 1000) for _ in range(3)] == [0.0, 0.0, 0.0]  # [prices] of 0: side by side


@pytest.mark.parametrize(("first", "requests", "spent"), [(0.0, 6, 0.05), (0.002, 6, 0.052)])
def test_a_free_or_discounted_first_answer_stops_the_run_within_one_request_of_max_cost(tmp_path, first, requests,
                                                                                         spent):
    async def reply(arrival: int) -> web.StreamResponse:
        await asyncio.sleep(0.05)  # answers overlap: up to 16 requests are in flight
        return _answer({"prompt_tokens": 500, "completion_tokens": 1000, "cost": first if arrival == 1 else 0.01})

    summary = _run(tmp_path, 60, reply, concurrency=16, max_cost=0.05)
    # before: the first answer priced every request at its own cost and 15 went at once ($0.20, $0.152)
    assert summary.exit_code == ExitCode.BUDGET and summary.done == requests
    assert summary.spent_total == pytest.approx(spent) and summary.spent_total <= 0.05 + 0.01 + 1e-12


@pytest.mark.parametrize("how", ["cut", "gzip_lie"])
def test_billed_answers_that_cannot_be_read_stop_a_capped_run_with_nothing_priced(tmp_path, how):
    """A cold tester's: with no [prices] and no answer priced yet, every reservation is 0, so
    a 200 whose body could not be read (cut under its Content-Length, or plain JSON under
    ``Content-Encoding: gzip``) booked nothing and stopped nothing: 30 billed requests at
    $0.50 went out under --max-cost 1 and the run said $0. Now the first stops the run."""
    body = json.dumps({"id": "g", "object": "chat.completion", "created": 1, "model": "m", "provider": "p",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 2, "cost": 0.5}}).encode()

    async def reply(_: int) -> web.StreamResponse:
        if how == "gzip_lie":
            return web.Response(body=body, content_type="application/json", headers={"Content-Encoding": "gzip"})
        return web.Response(body=body[:20], content_type="application/json",
                            headers={"Content-Length": str(len(body))})

    summary = _run(tmp_path, 10, reply, max_cost=1.0, max_attempts=3, timeout_s=2.0)
    assert summary.exit_code == ExitCode.BUDGET and summary.requests == 1
    assert any("could not be read whole" in n for n in summary.notices), summary.notices


def test_answers_received_while_another_program_holds_the_store_are_kept(tmp_path, monkeypatch):
    """A cold tester's: a ``sqlite3`` shell holding the store's lock past SQLite's wait failed
    the write (exit 6) with answers already received in it: they stayed pending and the next
    run bought them again. The write now waits for the lock (SQLite's own wait shortened
    here), and every answer is stored."""
    import threading
    import time

    real_connect = sqlite3.connect

    def connect(*args, **kwargs):  # the store's 60 s busy wait, 0.2 s here
        if kwargs.get("timeout") == 60.0:
            kwargs["timeout"] = 0.2
        return real_connect(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    held = threading.Event()

    def hold() -> None:
        con = real_connect(tmp_path / "run" / "state.sqlite", timeout=10.0, isolation_level=None)
        con.execute("BEGIN EXCLUSIVE")
        held.set()
        time.sleep(2.0)
        con.execute("ROLLBACK")
        con.close()

    async def reply(arrival: int) -> web.StreamResponse:
        if arrival == 1:
            threading.Thread(target=hold, daemon=True).start()
            await asyncio.get_running_loop().run_in_executor(None, held.wait, 5.0)
        return _answer({"prompt_tokens": 5, "completion_tokens": 2, "cost": 0.001})

    summary = _run(tmp_path, 6, reply, concurrency=2)
    assert (summary.exit_code, summary.done, summary.pending) == (ExitCode.OK, 6, 0), summary.notices
    assert any("the store is locked by another program" in n for n in summary.notices)
    with Store.open(tmp_path / "run") as store:
        assert list(store.statuses().values()).count("done") == 6


# --- limits: a timeout names the setting that set it --------------------------------------


@pytest.mark.parametrize(("limits", "named"), [
    ({"timeout_s": 0.3, "attempt_timeout_s": 900.0}, "timeout_s=0.3"),
    ({"timeout_s": 900.0, "attempt_timeout_s": 0.3}, "attempt_timeout_s=0.3"),
])
def test_a_timeout_names_the_setting_whose_limit_fired(tmp_path, limits, named):
    async def reply(_: int) -> web.StreamResponse:
        await asyncio.sleep(5)
        return _answer({"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.001})

    summary = _run(tmp_path, 1, reply, max_attempts=1, **limits)
    assert summary.failures == [{"id": "m-0", "error_class": "timeout",
                                 "error": f"gave up after 1 attempts: attempt took longer than {named} s in all"}]


def test_a_learned_bound_that_fits_but_is_not_yet_borne_out_sends_alone_never_ends_the_run():
    """A resumed run learns prices from its stored answers (``observe``), which bracket the
    next request exactly; until an answer bears them out they send one request at a time.
    That case took the 'does not fit' path and ended a $5 run at $0.02 as 'budget reached'."""
    from tokenbridge.generate.budget import Budget

    b = Budget(max_cost=5.0, prices=None)
    b.spent = 0.02
    b.observe("P", 1000, 500, 0.008)
    b.observe("P", 200, 800, 0.010)
    est = b.reservation(600, 600)
    assert est is not None and est[1] and not b.borne_out
    assert b.admit(600, 600) == est[0] and not b.exhausted and b.learning_sends == 1
    assert b.admit(600, 600) is None and not b.exhausted  # alone: the second waits for the first
    b.settle(est[0], est[0] / 2, prompt_tokens=600, completion_tokens=300, provider="P", answered=True)
    assert b.borne_out and b.admit(600, 600) == est[0]
    assert b.admit(600, 600) == est[0]  # borne out: side by side
    big = Budget(max_cost=0.021, prices=None)  # and an exact worst case over the cap still ends it
    big.spent = 0.02
    big.observe("P", 1000, 500, 0.008)
    big.observe("P", 200, 800, 0.010)
    assert big.admit(600, 600) is None and big.exhausted


# --- [prices] that prove too low ----------------------------------------------------------


@pytest.mark.parametrize(("usage", "request_kw", "sent"), [
    # the provider's cost is 50x what [prices] reserved: 16 in flight (concurrency) before the first answer
    ({"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.01}, {"max_tokens": 10}, 16),
    # honest prices, but no max_tokens: the answer ran past the 32,768 completion tokens
    # reserved ($0.033 each: 15 fit under the cap)
    ({"prompt_tokens": 5, "completion_tokens": 200_000}, {}, 15),
])
def test_prices_an_answer_costs_more_than_are_dropped_and_a_run_past_its_cap_says_so(tmp_path, usage, request_kw,
                                                                                     sent):
    """Before, every answer costing more than [prices] reserved went on side by side (16 in
    flight: $0.20 and $3.00 spent under a $0.05 / $0.50 cap, the first with exit 0 and no
    word). Now the first such answer turns [prices] off for the run: requests go one at a
    time, priced by what the answers cost, and a run that ended over its cap exits as
    stopped by it, saying by how much."""
    async def reply(_: int) -> web.StreamResponse:
        await asyncio.sleep(0.3)  # every request that fits goes out before the first answer
        return _answer(usage)

    prices = Prices(prompt=0.5, completion=1.0) if "cost" in usage else Prices(prompt=1.0, completion=1.0)
    cap = 0.05 if "cost" in usage else 0.5
    per_answer = 0.01 if "cost" in usage else 0.200005
    summary = _run(tmp_path, 20, reply, concurrency=16, max_cost=cap, prices=prices,
                   request=RequestSettings(model="m", **request_kw))
    # the requests in flight when the first answer came back cost what they cost; after it
    # nothing more fits (before: all 20 went, side by side)
    assert (summary.exit_code, summary.done, summary.pending) == (ExitCode.BUDGET, sent, 20 - sent)
    assert summary.spent_total == pytest.approx(per_answer * sent)
    notices = "\n".join(summary.notices)
    assert "more than the" in notices and "[prices] no longer prices requests in this run" in notices
    assert f"over --max-cost ${cap:.2f}" in notices


def test_a_run_that_finishes_every_sample_over_its_cap_still_exits_as_stopped_by_it(tmp_path):
    """A cold tester's: [prices] below the provider's, every request in flight at once and
    every sample done, $0.10 spent under a $0.05 cap: the notice said so, the exit was 0."""
    async def reply(_: int) -> web.StreamResponse:
        await asyncio.sleep(0.2)  # all ten go out before the first answer
        return _answer({"prompt_tokens": 5, "completion_tokens": 2, "cost": 0.01})

    summary = _run(tmp_path, 10, reply, concurrency=16, max_cost=0.05, prices=Prices(prompt=1.0, completion=1.0),
                   request=RequestSettings(model="m", max_tokens=100))
    assert (summary.done, summary.pending, summary.exit_code) == (10, 0, ExitCode.BUDGET)
    assert summary.stop_reason == "budget_reached" and summary.spent_total == pytest.approx(0.10)
    assert "spent $0.10, over --max-cost $0.05" in summary.notices


def test_a_resume_does_not_trust_prices_an_earlier_run_showed_too_low(tmp_path):
    """A run that saw [prices] reserve too little stopped trusting it; stopped and resumed,
    the next run trusted it again and sent 16 at once past the cap (a cold tester's: $1.75
    spent under a $1.00 cap). The stored answers now say so before anything is sent."""
    async def reply(_: int) -> web.StreamResponse:
        await asyncio.sleep(0.2)
        return _answer({"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.01})

    prices = Prices(prompt=0.5, completion=1.0)  # reserves about $0.001 a request (max_tokens 1000): 10x too little
    first = _run(tmp_path, 20, reply, limit=2, max_cost=1.0, prices=prices)
    assert (first.done, first.spent_total) == (2, pytest.approx(0.02))
    again = _run(tmp_path, 20, reply, concurrency=16, max_cost=0.05, prices=prices)
    assert again.exit_code == ExitCode.BUDGET and again.spent_total <= 0.05 + 1e-9  # before: 16 went at once, $0.18
    said = ("budget: an answer an earlier run stored cost $0.01, more than the $0.001178 [prices] reserved for it "
            "(prices below the provider's, or more completion tokens than max_tokens reserved): [prices] no longer "
            "prices requests in this run; they go one at a time until answers bear a price out")
    assert [n for n in again.notices if n.startswith("budget: an answer")] == [said]  # once, and said as the earlier run's


def test_a_budget_whose_prices_hold_is_unchanged_and_one_overrun_turns_them_off():
    from tokenbridge.generate.budget import Budget

    b = Budget(max_cost=1.0, prices=Prices(prompt=1.0, completion=1.0))
    r1, r2 = b.admit(1000, 1000), b.admit(1000, 1000)
    assert r1 == r2 == pytest.approx(0.002) and b.priced
    b.settle(r1, 0.002, prompt_tokens=1000, completion_tokens=1000, provider="p")  # exactly as reserved
    assert b.priced and b.overrun is None
    b.settle(r2, 0.004, prompt_tokens=1000, completion_tokens=1000, provider="p")  # twice the table's price
    assert not b.priced and b.overrun == (0.004, pytest.approx(0.002))
    assert b.reservation(1000, 1000) == (pytest.approx(0.004), False)  # learned from the answers, the dearest
    r3 = b.admit(1000, 1000)
    assert r3 == pytest.approx(0.004) and b.admit(1000, 1000) is None  # alone until an answer bears it out


def test_a_zero_price_table_a_billed_answer_contradicts_is_dropped_too():
    from tokenbridge.generate.budget import Budget

    b = Budget(max_cost=0.05, prices=Prices(prompt=0.0, completion=0.0))  # a free model, as the table says
    flight = [b.admit(1000, 1000) for _ in range(4)]
    assert flight == [0.0] * 4
    b.settle(flight.pop(), 0.01, prompt_tokens=1000, completion_tokens=1000, provider="p")  # billed after all
    assert not b.priced and b.overrun == (0.01, 0.0)
    assert b.admit(1000, 1000) is None  # three still in flight: nothing goes beside them now


def test_answers_the_dropped_table_reserved_bear_out_no_learned_price():
    """After [prices] proved too low, the requests it had reserved settle first; one that
    came in under the table's reservation made the learned prices trusted side by side."""
    from tokenbridge.generate.budget import Budget

    b = Budget(max_cost=10.0, prices=Prices(prompt=1.0, completion=1.0))
    r1, r2, r3 = (b.admit(1000, 1000) for _ in range(3))
    b.settle(r1, 0.004, prompt_tokens=1000, completion_tokens=1000, provider="p")  # twice the table
    b.settle(r2, 0.001, prompt_tokens=1000, completion_tokens=1000, provider="p")  # under the table's reservation
    assert not b.borne_out
    b.settle(r3, 0.004, prompt_tokens=1000, completion_tokens=1000, provider="p")
    r4 = b.admit(1000, 1000)  # learned ($0.004), alone: nothing has borne it out yet
    assert r4 == pytest.approx(0.004) and b.admit(1000, 1000) is None
    b.settle(r4, 0.004, prompt_tokens=1000, completion_tokens=1000, provider="p")
    assert b.borne_out and b.admit(1000, 1000) is not None and b.admit(1000, 1000) is not None


def test_without_a_cap_a_dropped_price_table_says_so_and_stops_nothing(tmp_path):
    async def reply(_: int) -> web.StreamResponse:
        return _answer({"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.01})

    summary = _run(tmp_path, 4, reply, concurrency=1, prices=Prices(prompt=0.5, completion=1.0),
                   request=RequestSettings(model="m", max_tokens=10))
    assert (summary.exit_code, summary.done, summary.spent_total) == (ExitCode.OK, 4, pytest.approx(0.04))
    assert [n for n in summary.notices if n.startswith("budget:")] == [
        "budget: an answer cost $0.01, more than the $0.000187 [prices] reserved for it (prices below the provider's, "
        "or more completion tokens than max_tokens reserved): [prices] no longer prices requests in this run; what "
        "answers cost prices them"]


def test_an_image_named_by_url_is_reserved_for_and_named_when_it_stops_the_run():
    """A URL of a few bytes stands for an image of thousands of prompt tokens: the request's
    bytes were taken as the bound, and correct [prices] still let a run pass its cap, the
    notice blaming prices and max_tokens (a cold tester's: $2.44 under $1.00). Other media by
    URL likewise (a cold reviewer's); media inline is bounded by its bytes."""
    from tokenbridge.generate.budget import MEDIA_RESERVE_TOKENS, Budget, linked_media, reserved_tokens, usd

    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    inline = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    ]
    linked = [
        {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}},
        {"type": "input_image", "image_url": "https://example.com/b.png"},
        {"type": "image", "image": "https://example.com/c.png"},
        {"type": "file", "file": {"file_id": "file-abc"}},
        # OpenRouter's PDF by link: file_data holds the URL (a cold reviewer's)
        {"type": "file", "file": {"filename": "document.pdf", "file_data": "https://bitcoin.org/bitcoin.pdf"}},
    ]
    request = {"model": "m", "max_tokens": 100, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "describe"}, image, image, *inline]}]}
    text = json.dumps(request)
    assert linked_media(request) == 2
    assert linked_media({"messages": [{"role": "user", "content": linked}]}) == 5
    assert reserved_tokens(text, request) == (len(text) + 256 + 2 * MEDIA_RESERVE_TOKENS, 100)
    plain = {"model": "m", "messages": [{"role": "user", "content": "describe"}]}
    assert linked_media(plain) == 0 and reserved_tokens(json.dumps(plain), plain)[0] == len(json.dumps(plain)) + 256
    budget = Budget(max_cost=1.0, prices=Prices(prompt=100.0, completion=100.0))
    prompt, completion = reserved_tokens(text, request)
    assert budget.admit(prompt, completion) is None and budget.exhausted  # its worst case alone is over: nothing sent
    assert budget.stop_message(prompt, completion, default_reserve=False, media=2) == (
        f"budget $1.00 reached (spent $0.00; the next request's worst case, {usd((prompt + completion) * 1e-4)}, does not "
        "fit); one request's worst case alone is above the cap (raise --max-cost or lower max_tokens; it names 2 "
        "image(s) or other media by URL, 16,384 prompt tokens reserved for each, as their size in tokens is not known "
        "before)")


def test_an_error_reply_that_counts_tokens_but_no_cost_is_booked_as_possible_spend(tmp_path):
    """An error body with ``usage: {"prompt_tokens": N}`` and no cost may have been billed:
    once a count went missing it was booked at $0 (a cold reviewer's). It is booked at its
    reservation, as possibly billed; one that counts no tokens stays unbilled."""
    async def reply(n: int) -> web.StreamResponse:
        body = {"error": {"message": "bad request", "code": 400}}
        if n == 1:
            body["usage"] = {"prompt_tokens": 120}
        elif n == 2:  # counts of 0 say nothing was billed (a cold reviewer's)
            body["usage"] = {"prompt_tokens": 0, "completion_tokens": 0}
        return web.json_response(body, status=400)

    prices = Prices(prompt=1.0, completion=1.0)
    summary = _run(tmp_path, 3, reply, concurrency=1, max_cost=10.0, prices=prices)
    assert summary.failed == 3 and summary.spent_total == 0.0
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    rows = con.execute("SELECT possible_cost FROM attempts ORDER BY started_at").fetchall()
    assert [p is None for (p,) in rows] == [False, True, True]  # the first counted tokens: possibly billed
    assert rows[0][0] == pytest.approx(summary.spent_possible) and summary.spent_possible > 0


def test_a_dry_run_says_what_the_folder_spent_and_whether_its_cap_leaves_anything(tmp_path):
    """The run counts the folder's spend against --max-cost; a dry run priced the rest
    without it, promising a run that would stop at once (a cold tester's)."""
    from tokenbridge.generate.estimate import dry_run

    async def reply(_: int) -> web.StreamResponse:
        return _answer({"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.01})

    first = _run(tmp_path, 4, reply, limit=2)
    assert first.done == 2
    base = dict(datasets=(DatasetSpec("m", tmp_path / "p.jsonl"),), base_url="http://127.0.0.1:9/api/v1",
                request=RequestSettings(model="m", max_tokens=1000))
    notes = dry_run(GenerateSettings(**base, max_cost=0.02), tmp_path / "run").notes
    assert ("this folder has spent $0.02 so far, which counts against --max-cost: its cap $0.02 is reached, so the run "
            "would send nothing") in notes
    notes = dry_run(GenerateSettings(**base, max_cost=1.0), tmp_path / "run").notes
    assert "this folder has spent $0.02 so far, which counts against --max-cost: $0.98 of its cap $1.00 is left" in notes
    assert "this folder has spent $0.02 so far" in dry_run(GenerateSettings(**base), tmp_path / "run").notes


def test_max_completion_tokens_beside_max_tokens_is_reserved_at_the_larger_cap(tmp_path):
    """``extra_body.max_completion_tokens`` beside ``max_tokens``: a server that obeys the
    first (vLLM's takes it over ``max_tokens``) bills up to it, and the run reserved the
    second: $6.40 spent under a $0.50 cap, the dry run's worst case 200x low (a cold tester's)."""
    from tokenbridge.generate.budget import DEFAULT_RESERVE_TOKENS, completion_cap, reserved_tokens

    async def reply(n: int) -> web.StreamResponse:
        return _answer({"prompt_tokens": 10, "completion_tokens": 20_000})  # what the larger cap allows

    request = RequestSettings(model="m", max_tokens=100, extra_body={"max_completion_tokens": 20_000})
    prices = Prices(prompt=0.0, completion=10.0)  # $0.20 a request at its worst
    summary = _run(tmp_path, 20, reply, concurrency=32, max_cost=0.5, prices=prices, request=request)
    assert summary.spent_total <= 0.5 and summary.done == 2  # two fit under the cap; 32 were sent at once
    from tokenbridge.generate.budget import Budget, cap_setting

    request_json = json.dumps({"max_tokens": 100, "max_completion_tokens": 20_000})
    prompt, completion = reserved_tokens(request_json, json.loads(request_json))
    budget = Budget(max_cost=0.1, prices=prices)  # one request's worst case ($0.20) alone is over
    assert budget.admit(prompt, completion) is None and cap_setting(json.loads(request_json)) == (
        "extra_body.max_completion_tokens")
    assert budget.stop_message(prompt, completion, default_reserve=False, cap=cap_setting(json.loads(request_json))
                               ).endswith("(raise --max-cost or lower extra_body.max_completion_tokens)")
    assert cap_setting({"max_tokens": 300, "max_completion_tokens": 20}) == "max_tokens"
    assert cap_setting({"max_tokens": 300, "max_completion_tokens": 300}) == (
        "max_tokens and extra_body.max_completion_tokens")
    # and the run itself says so when one request's worst case alone is over its cap
    (tmp_path / "b").mkdir()
    over = _run(tmp_path / "b", 2, reply, concurrency=1, max_cost=0.1, prices=prices, request=request)
    assert over.done == 0 and any(n.endswith("(raise --max-cost or lower extra_body.max_completion_tokens)")
                                  for n in over.notices), over.notices
    for req, cap in [({"max_tokens": 100, "max_completion_tokens": 20_000}, 20_000),
                     ({"max_tokens": 300, "max_completion_tokens": 20}, 300), ({"max_completion_tokens": 7}, 7),
                     ({"max_tokens": "9" * 9, "max_completion_tokens": True}, None), ({"max_tokens": -5}, None)]:
        assert completion_cap(req) == cap
        assert reserved_tokens("{}", {**req, "n": 2})[1] == 2 * (cap or DEFAULT_RESERVE_TOKENS)


def test_the_dry_run_bounds_the_cost_by_the_larger_completion_cap(tmp_path):
    from tokenbridge.generate.estimate import dry_run

    prompts = write_prompts(tmp_path, 3)
    settings = GenerateSettings(datasets=(DatasetSpec("m", prompts),), prices=Prices(prompt=0.0, completion=10.0),
                                request=RequestSettings(model="m", max_tokens=100,
                                                        extra_body={"max_completion_tokens": 20_000}))
    report = dry_run(settings, tmp_path / "run")
    assert report.completion_tokens_max == 3 * 20_000 and report.cost_max == pytest.approx(0.6)


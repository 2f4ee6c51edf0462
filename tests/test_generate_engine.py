"""The engine against tiny scripted aiohttp servers: retries, stops, SSE, concurrency, the store."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from aiohttp import web

from tokenbridge.generate import GenerateSettings, RequestSettings, Store, agenerate_run, write_exchanges
from tokenbridge.generate.run import ExitCode
from tokenbridge.generate.secrets import ApiKey
from tokenbridge.generate.settings import DatasetSpec

KEY = ApiKey("TB_FAKE", "sk-or-v1-engine-test-key-0000")


def _ok_body(text: str, **extra) -> dict:
    return {
        "id": "gen-x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "provider": "p",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.001},
        **extra,
    }


def _prompts(tmp_path: Path, n: int) -> DatasetSpec:
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": i, "prompt": f"q{i}"}) + "\n" for i in range(n)), encoding="utf-8")
    return DatasetSpec("b3", f)


def _prompt_of(body: dict) -> str:
    return body["messages"][-1]["content"]


class Script:
    """A server whose reply per request is decided by ``reply(prompt, attempt, body)``."""

    def __init__(self, reply):
        self.reply = reply
        self.attempts: Counter = Counter()
        self.times: dict[str, list[float]] = defaultdict(list)
        self.in_flight = 0
        self.max_in_flight = 0
        self.log: list[tuple[float, str, int]] = []  # (arrival, prompt, status)
        self.auth: set[str] = set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = _prompt_of(body)
        self.attempts[prompt] += 1
        self.times[prompt].append(time.monotonic())
        self.auth.add(request.headers.get("Authorization", ""))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = await self.reply(prompt, self.attempts[prompt], body, request)
        finally:
            self.in_flight -= 1
        self.log.append((time.monotonic(), prompt, resp.status))
        return resp


async def _serve(script: Script):
    app = web.Application()
    app.router.add_post("/api/v1/chat/completions", script.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/api/v1"


def _settings(url: str, spec: DatasetSpec, **kw) -> GenerateSettings:
    base = dict(
        datasets=(spec,),
        request=RequestSettings(model="m", max_tokens=16),
        base_url=url,
        concurrency=4,
        max_attempts=4,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        commit_interval_s=0.005,
        progress="none",
        timeout_s=5.0,
    )
    base.update(kw)
    return GenerateSettings(**base)


def _run(script: Script, tmp_path: Path, n: int, **kw):
    async def main():
        runner, url = await _serve(script)
        try:
            return await agenerate_run(_settings(url, _prompts(tmp_path, n), **kw), tmp_path / "run", key=KEY)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def _json(obj, status=200, headers=None):
    return web.Response(text=json.dumps(obj), status=status, headers=headers, content_type="application/json")


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "exchanges.jsonl").read_text(encoding="utf-8").splitlines()]


def test_transient_failures_are_retried_and_bodies_kept_verbatim(tmp_path):
    padded = "\n\n  " + json.dumps(_ok_body("done"))  # OpenRouter keep-alive padding before the JSON

    async def reply(prompt, attempt, body, request):
        faults = {
            "q0": [_json({"error": {"code": 502, "message": "upstream"}})],  # HTTP 200 error body
            "q1": [_json(_ok_body("x") | {"choices": [{"index": 0, "message": {}, "finish_reason": "error"}]})],
            "q2": [web.Response(text='{"choices": [', content_type="application/json")],  # malformed
            "q3": [web.Response(status=503, text="busy"), web.Response(status=408, text="")],
        }.get(prompt, [])
        if attempt <= len(faults):
            return faults[attempt - 1]
        return web.Response(text=padded, content_type="application/json")

    script = Script(reply)
    summary = _run(script, tmp_path, 5)
    assert summary.exit_code == ExitCode.OK and summary.done == 5
    assert summary.errors == {"api_error": 1, "choice_error": 1, "bad_json": 1, "http_503": 1, "http_408": 1}
    assert dict(script.attempts) == {"q0": 2, "q1": 2, "q2": 2, "q3": 3, "q4": 1}
    rows = _rows(tmp_path)
    assert [r["id"] for r in rows] == [f"b3-{i}" for i in range(5)]
    assert rows[3]["meta"]["attempts"] == 3 and rows[4]["meta"]["attempts"] == 1
    assert rows[0]["response"] == _ok_body("done")
    # the response sits in exchanges.jsonl as the exact bytes sent (spaces and all), padding trimmed
    assert (tmp_path / "run" / "exchanges.jsonl").read_bytes().count(b',"response":' + padded.strip().encode()) == 5
    with Store.open(tmp_path / "run") as store:
        assert store.response("b3-0") == (padded.encode(), None)  # every byte, padding included
        att = store.attempts("b3-3")
        assert [(a.http_status, a.error_class) for a in att] == [(503, "http_503"), (408, "http_408"), (200, None)]
        assert att[0].message == "busy"


def test_retry_after_is_honoured_and_4xx_is_not_retried(tmp_path):
    async def reply(prompt, attempt, body, request):
        if prompt == "q0" and attempt == 1:
            return _json({"error": {"message": "slow down"}}, 429, {"Retry-After": "0.4"})
        if prompt == "q1":
            return _json({"error": {"message": "context too long"}}, 400)
        if prompt == "q2":
            return _json({"error": {"message": "key revoked"}}, 401)
        return _json(_ok_body("ok"))

    script = Script(reply)
    summary = _run(script, tmp_path, 3, max_attempts=5)
    t = script.times["q0"]
    assert len(t) == 2 and t[1] - t[0] >= 0.4
    assert script.attempts["q1"] == 1 and script.attempts["q2"] == 1
    assert summary.exit_code == ExitCode.INCOMPLETE and summary.done == 1 and summary.failed == 2
    assert {(f["id"], f["error_class"], f["error"]) for f in summary.failures} == {
        ("b3-1", "http_400", "context too long"),
        ("b3-2", "http_401", "key revoked"),
    }


def test_gives_up_after_max_attempts_and_rerun_tries_again(tmp_path):
    state = {"healthy": False}

    async def reply(prompt, attempt, body, request):
        if not state["healthy"]:
            return web.Response(status=500, text="down")
        return _json(_ok_body("ok"))

    script = Script(reply)
    summary = _run(script, tmp_path, 2, max_attempts=3)
    assert summary.failed == 2 and script.attempts == Counter({"q0": 3, "q1": 3})
    assert summary.failures[0]["error"] == "gave up after 3 attempts: down"
    state["healthy"] = True
    summary = _run(script, tmp_path, 2, max_attempts=3)
    assert summary.exit_code == ExitCode.OK and summary.done == 2
    with Store.open(tmp_path / "run") as store:
        assert [a.n for a in store.attempts("b3-0")] == [1, 2, 3, 4]  # numbering continues across runs


def test_402_stops_cleanly_and_rerun_finishes_without_resending(tmp_path):
    state = {"credits": True, "after_402": 0}

    async def reply(prompt, attempt, body, request):
        if not state["credits"] or prompt == "q6":
            state["credits"] = False
            state["after_402"] += 1
            return _json({"error": {"code": 402, "message": "Insufficient credits"}}, 402)
        await asyncio.sleep(0.02)
        return _json(_ok_body(prompt))

    script = Script(reply)
    summary = _run(script, tmp_path, 30, concurrency=4)
    assert summary.exit_code == ExitCode.PAYMENT and summary.stop_reason == "payment_required"
    assert summary.failed == 0 and summary.done >= 5 and summary.pending == 30 - summary.done
    assert state["after_402"] <= 4  # the 402 itself plus at most the requests already in flight
    assert any("402" in n for n in summary.notices)
    first_done = {r["id"] for r in _rows(tmp_path)}
    assert len(first_done) == summary.done

    state["credits"] = True
    sent_before = Counter(script.attempts)
    script.reply = lambda p, a, b, r: asyncio.sleep(0, _json(_ok_body(p)))
    summary = _run(script, tmp_path, 30, concurrency=4)
    assert summary.exit_code == ExitCode.OK and summary.already_done == len(first_done)
    rows = _rows(tmp_path)
    assert [r["id"] for r in rows] == [f"b3-{i}" for i in range(30)]
    for sid in first_done:  # a stored sample is never sent again
        assert script.attempts[f"q{sid.split('-')[1]}"] == sent_before[f"q{sid.split('-')[1]}"]


def test_no_endpoints_fails_that_routing_fast_and_says_so_once(tmp_path):
    async def reply(prompt, attempt, body, request):
        await asyncio.sleep(0.01)
        return _json({"error": {"code": 404, "message": "No endpoints found matching your data policy"}}, 404)

    script = Script(reply)
    summary = _run(script, tmp_path, 40, concurrency=4)
    assert summary.failed == 40 and summary.done == 0
    assert sum(script.attempts.values()) <= 4  # only the first wave was sent
    assert {f["error_class"] for f in summary.failures} == {"no_endpoints"}
    assert [n for n in summary.notices if "routing unavailable" in n] == [
        "routing unavailable, failing its samples: No endpoints found matching your data policy"
    ]


def test_concurrency_is_bounded_and_429_shrinks_it(tmp_path):
    async def reply(prompt, attempt, body, request):
        if script.in_flight > 6:
            return _json({"error": {"message": "rate limited"}}, 429)
        await asyncio.sleep(0.01)
        return _json(_ok_body(prompt))

    script = Script(reply)
    summary = _run(script, tmp_path, 150, concurrency=32, max_attempts=50)
    assert summary.done == 150
    assert script.max_in_flight <= 32
    assert summary.errors["http_429"] > 0
    # after the limiter shrank, 429s stop being the common case
    assert summary.errors["http_429"] < summary.requests / 2


def test_timeouts_and_dropped_connections_are_retried(tmp_path):
    async def reply(prompt, attempt, body, request):
        if prompt == "q0" and attempt == 1:
            await asyncio.sleep(1.5)
        if prompt == "q1" and attempt == 1:
            request.transport.close()  # the connection dies before any reply
            await asyncio.sleep(0.05)
        return _json(_ok_body(prompt))

    script = Script(reply)
    summary = _run(script, tmp_path, 2, timeout_s=0.5)
    assert summary.done == 2
    assert summary.errors.get("timeout") == 1 and summary.errors.get("connection") == 1


def _sse(chunks: list, *, comments=True) -> bytes:
    out = b": OPENROUTER PROCESSING\n\n" if comments else b""
    for c in chunks:
        out += b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\r\n\r\n"
        if comments:
            out += b": OPENROUTER PROCESSING\n\n"
    return out + b"data: [DONE]\n\n"


def _chunk(delta, finish=None, **extra):
    return {"id": "gen-s", "object": "chat.completion.chunk", "created": 2, "model": "m", "provider": "p",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def test_streaming_assembles_and_stores_the_raw_stream(tmp_path):
    good = _sse([
        _chunk({"role": "assistant", "content": "", "reasoning": "hm"}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}, "stop", usage={"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.001}),
    ])
    broken = _sse([
        _chunk({"role": "assistant", "content": "Hel"}),
        _chunk({"content": ""}, "error", error={"code": 502, "message": "upstream died"}),
    ])

    async def reply(prompt, attempt, body, request):
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        payload = broken if (prompt == "q0" and attempt == 1) else good
        for i in range(0, len(payload), 7):  # dribble it out in small pieces
            await resp.write(payload[i : i + 7])
        if prompt == "q1" and attempt == 1:  # cut mid-stream
            return resp
        await resp.write_eof()
        return resp

    async def reply_cut(prompt, attempt, body, request):
        if prompt == "q1" and attempt == 1:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(_sse([_chunk({"role": "assistant", "content": "Hel"})])[:-14])
            await resp.write_eof()
            return resp
        return await reply(prompt, attempt, body, request)

    script = Script(reply_cut)
    summary = _run(script, tmp_path, 2, stream=True)
    assert summary.done == 2
    assert summary.errors == {"stream_error": 1, "truncated_stream": 1}
    rows = _rows(tmp_path)
    msg = rows[0]["response"]["choices"][0]
    assert msg["message"] == {"role": "assistant", "content": "Hello", "reasoning": "hm"}
    assert msg["finish_reason"] == "stop" and rows[0]["response"]["object"] == "chat.completion"
    assert rows[0]["meta"]["stream"] is True
    with Store.open(tmp_path / "run") as store:
        body, raw = store.response("b3-0")
    assert raw == good and json.loads(body) == rows[0]["response"]
    with Store.open(tmp_path / "run") as store:
        att = store.attempts("b3-0")
    assert att[0].error_class == "stream_error" and "upstream died" in att[0].message


def test_budget_cap_stops_before_crossing(tmp_path):
    async def reply(prompt, attempt, body, request):
        return _json(_ok_body(prompt) | {"usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.01}})

    script = Script(reply)
    from tokenbridge.generate.settings import Prices

    # each request reserves its worst case, max_tokens 16 x $1000/Mtok = $0.016, and really
    # costs $0.01: after 4 ($0.04 spent) a 5th could reach $0.056 > $0.055, so it is not sent.
    summary = _run(script, tmp_path, 20, max_cost=0.055, prices=Prices(prompt=0.0, completion=1000.0))
    assert summary.exit_code == ExitCode.BUDGET and summary.stop_reason == "budget_reached"
    assert summary.spent_total == pytest.approx(0.04) and summary.done == 4
    assert summary.pending == 16 and sum(script.attempts.values()) == 4


def test_store_survives_and_key_never_sent_elsewhere(tmp_path):
    async def reply(prompt, attempt, body, request):
        if attempt == 1:  # a hostile server echoes the auth header into an error and a body
            return _json({"error": {"message": "bad " + request.headers["Authorization"]}}, 500)
        return _json(_ok_body("echo " + request.headers["Authorization"]))

    script = Script(reply)
    summary = _run(script, tmp_path, 3)
    assert summary.done == 3 and script.auth == {f"Bearer {KEY.value}"}
    for path in (tmp_path / "run").iterdir():
        assert KEY.value.encode() not in path.read_bytes(), path
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("SELECT message FROM attempts WHERE n=1 LIMIT 1").fetchone()[0] == "bad Bearer ***"


def test_write_exchanges_is_atomic_and_in_input_order(tmp_path):
    with Store.open(tmp_path) as store:
        added, changed = store.add_samples([("b-2", "b", "", '{"m":2}'), ("b-1", "b", "", '{"m":1}')])
        assert (added, changed) == (2, [])
        assert store.add_samples([("b-1", "b", "", '{"m":"changed"}'), ("b-3", "b", "", "{}")]) == (1, ["b-1"])
        from tokenbridge.generate.store import Batch, ResponseRecord

        def rec(sid, body):
            return ResponseRecord(sid, body, None, "p", "m", None, None, 0.1, 1.0, 2.0, 1, False)

        store.commit(Batch(responses=[rec("b-1", b'{"t":"\\ud800 lone"}'), rec("b-2", '{"t":"é"}'.encode())]))
        assert [s.seq for s in store.samples()] == [0, 1, 2]
    path = write_exchanges(tmp_path)
    lines = path.read_bytes().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["b-2", "b-1"]  # input order (seq), only done ones
    assert lines[0].decode() .count("é") == 1 and b"\\ud800" in lines[1]
    assert json.loads(lines[1])["request"] == {"m": 1}  # the stored request wins
    assert not list(tmp_path.glob(".exchanges.*"))

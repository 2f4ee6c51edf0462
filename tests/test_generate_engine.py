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

from conftest import write_prompts
from tokenbridge.generate import GenerateSettings, RequestSettings, Store, agenerate_run, write_exchanges
from tokenbridge.generate.run import ExitCode
from tokenbridge.generate.secrets import ApiKey
from tokenbridge.generate.settings import DatasetSpec

# asserts on the wall clock or on timings (sleeps, rates, deadlines): run alone, after the
# rest of the suite runs on every core (`make test`), so a busy machine cannot fail them
pytestmark = pytest.mark.serial

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
    return DatasetSpec("b3", write_prompts(tmp_path, n))


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


def test_no_endpoints_fails_that_routing_fast_and_a_rerun_sends_the_skipped_once(tmp_path):
    async def reply(prompt, attempt, body, request):
        await asyncio.sleep(0.01)
        return _json({"error": {"code": 404, "message": "No endpoints found matching your data policy"}}, 404)

    script = Script(reply)
    summary = _run(script, tmp_path, 40, concurrency=4)
    assert summary.failed == 40 and summary.done == 0
    assert sum(script.attempts.values()) <= 4  # only the first wave was sent
    classes = Counter(f["error_class"] for f in summary.failures)
    assert set(classes) == {"no_endpoints", "no_endpoints_skipped"} and classes["no_endpoints"] <= 4
    skipped = next(f for f in summary.failures if f["error_class"] == "no_endpoints_skipped")
    assert skipped["error"] == ("not sent: b3-0 with the same routing got: No endpoints found matching your data "
                                "policy")
    assert [n for n in summary.notices if "routing unavailable" in n] == [
        "routing unavailable, failing the samples sent like b3-0: No endpoints found matching your data policy"
    ]
    # the next run sends every sample skipped last time once, rather than skipping it again
    summary = _run(script, tmp_path, 40, concurrency=4)
    assert set(script.attempts) == {f"q{i}" for i in range(40)}
    assert Counter(f["error_class"] for f in summary.failures)["no_endpoints"] >= 36


def test_a_404_for_tool_use_fails_only_the_samples_sent_with_tools(tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    f = tmp_path / "p.jsonl"
    rows = [{"id": i, "prompt": f"q{i}"} | ({"tools": tools} if i in (2, 7) else {}) for i in range(12)]
    rows.append({"id": 12, "prompt": "q12 " + "long " * 50})
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    async def reply(prompt, attempt, body, request):
        await asyncio.sleep(0.01)
        if "tools" in body:
            return _json({"error": {"code": 404, "message": "No endpoints found that support tool use."}}, 404)
        if prompt.startswith("q12"):  # about this prompt's size: says nothing of the others
            return _json({"error": {"code": 404, "message": "No endpoints found that support the requested "
                                    "context length"}}, 404)
        return _json(_ok_body(prompt))

    async def main():
        runner, url = await _serve(script)
        try:
            st = _settings(url, DatasetSpec("d", f), request=RequestSettings(model="m", max_tokens=16, send_tools=True),
                           concurrency=1)
            return await agenerate_run(st, tmp_path / "run", key=KEY)
        finally:
            await runner.cleanup()

    script = Script(reply)
    summary = asyncio.run(main())
    assert summary.done == 10
    assert sorted((x["id"], x["error_class"]) for x in summary.failures) == [
        ("d-12", "no_endpoints"), ("d-2", "no_endpoints"), ("d-7", "no_endpoints_skipped")]
    assert sum(script.attempts.values()) == 12  # every plain sample was sent; the 2nd tools one was not


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
    assert summary.no_finish == 0  # no [DONE]: a cut stream, not an answer that gave no finish_reason
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


def test_a_whole_stream_whose_finish_reason_says_nothing_is_an_answer_without_one(tmp_path):
    """[DONE] came, every chunk said ``finish_reason: ""``: the provider sent no finish (sent
    again, counted with the answers that came without one, its raw stream kept)."""
    empty = _sse([_chunk({"role": "assistant", "content": "Hel"}, ""), _chunk({"content": "lo"}, ""),
                  _chunk({}, "", usage={"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.01})])
    good = _sse([_chunk({"role": "assistant", "content": "Hello"}, "stop")])

    async def reply(prompt, attempt, body, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(empty if attempt == 1 else good)
        await resp.write_eof()
        return resp

    summary = _run(Script(reply), tmp_path, 1, stream=True)
    assert (summary.done, summary.errors) == (1, {"truncated_stream": 1})
    assert (summary.no_finish, summary.no_finish_attempts, summary.no_finish_failed) == (1, 1, 0)
    assert summary.no_finish_cost == pytest.approx(0.01)
    with Store.open(tmp_path / "run") as store:
        first = store.attempts("b3-0")[0]
    assert (first.error_class, first.body) == ("truncated_stream", empty)


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

        store.commit(Batch(responses=[rec("b-1", b'{\r\n  "t": "a\\u00e9"\n}\n'), rec("b-2", '{"t":"é"}'.encode())]))
        assert [s.seq for s in store.samples()] == [0, 1, 2]
    path = write_exchanges(tmp_path)
    lines = path.read_bytes().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["b-2", "b-1"]  # input order (seq), only done ones
    assert lines[0].decode() .count("é") == 1
    assert b'"response":{    "t": "a\\u00e9" }' in lines[1]  # multi-line: the same bytes, breaks as spaces
    assert json.loads(lines[1])["request"] == {"m": 1}  # the stored request wins
    assert not list(tmp_path.glob(".exchanges.*"))


def _cost(pt: int, ct: int) -> float:  # $0.6/Mtok prompt, $2.5/Mtok completion
    return pt * 0.6e-6 + ct * 2.5e-6


def test_budget_cap_holds_without_prices_when_the_first_response_is_prompt_heavy(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": i, "prompt": ("LONG " + "word " * 1500) if i == 0 else f"q{i}"}) + "\n"
                         for i in range(60)), encoding="utf-8")

    async def reply(prompt, attempt, body, request):
        await asyncio.sleep(0.02)
        pt, ct = (2000, 10) if prompt.startswith("LONG") else (10, 4000)
        return _json(_ok_body("x") | {"usage": {"prompt_tokens": pt, "completion_tokens": ct, "cost": _cost(pt, ct)}})

    async def main():
        runner, url = await _serve(script)
        try:
            st = _settings(url, DatasetSpec("d", f), request=RequestSettings(model="m", max_tokens=4000),
                           concurrency=16, max_cost=0.05)
            return await agenerate_run(st, tmp_path / "run", key=KEY)
        finally:
            await runner.cleanup()

    script = Script(reply)
    summary = asyncio.run(main())
    # documented bound: the cap plus one request's real worst case (the longest prompt + max_tokens)
    assert summary.spent_total <= 0.05 + _cost(2000, 4000)
    assert summary.spent_total <= 0.05  # here two responses pin both prices down before the cap is near
    assert summary.exit_code == ExitCode.BUDGET and summary.done >= 4
    assert summary.spent_total == pytest.approx(_cost(2000, 10) + (summary.done - 1) * _cost(10, 4000))
    assert script.max_in_flight > 1  # once priced, requests go in parallel again


def _two_datasets(tmp_path: Path) -> tuple[DatasetSpec, DatasetSpec]:
    specs = []
    for name in ("a", "b"):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps({"id": i, "prompt": f"{name}{i}"}) + "\n" for i in range(5)), encoding="utf-8")
        specs.append(DatasetSpec(name, f))
    return specs[0], specs[1]


def test_rerun_with_other_settings_is_refused_unless_forced_and_exchanges_hold_this_selection(tmp_path):
    from tokenbridge.generate import SettingsChanged

    a, b = _two_datasets(tmp_path)
    seen: dict[str, list[int]] = defaultdict(list)

    async def reply(prompt, attempt, body, request):
        seen[prompt].append(body.get("max_tokens"))
        if prompt == "a4" and attempt == 1:
            return _json({"error": {"message": "bad request"}}, 400)
        return _json(_ok_body(prompt))

    script = Script(reply)

    async def go(specs, **kw):
        runner, url = await _serve(script)
        force = kw.pop("force", False)
        base = kw.pop("base_url", url)
        try:
            st = _settings(base, specs[0], **kw).with_overrides(datasets=tuple(specs))
            return await agenerate_run(st, tmp_path / "run", key=KEY, force_settings=force)
        finally:
            await runner.cleanup()

    first = asyncio.run(go([a, b]))
    assert first.done == 9 and first.failed == 1 and len(_rows(tmp_path)) == 9
    sent = sum(script.attempts.values())

    with pytest.raises(SettingsChanged) as err:
        asyncio.run(go([a], request=RequestSettings(model="m", max_tokens=99)))
    assert "4 with another request (max_tokens 16 -> 99, e.g. a-0)" in str(err.value)
    assert "--force-settings" in str(err.value) and err.value.exit_code == 2
    with pytest.raises(SettingsChanged, match=r"9 answered by http://127\.0\.0\.1:\d+/api/v1 \(now https://openrouter"):
        asyncio.run(go([a, b], base_url="https://openrouter.ai/api/v1"))  # emulator answers are not real data
    assert sum(script.attempts.values()) == sent  # nothing was sent by the refused runs
    with Store.open(tmp_path / "run") as store:
        assert json.loads(store.samples(["a-0"])[0].request)["max_tokens"] == 16  # nor stored

    forced = asyncio.run(go([a], request=RequestSettings(model="m", max_tokens=99), force=True))
    assert forced.exit_code == ExitCode.OK and forced.kept_old_settings == 4 and forced.left_out == 5
    assert seen["a4"] == [16, 99]  # the sample not done yet was sent with the new settings
    rows = _rows(tmp_path)
    assert [r["id"] for r in rows] == ["a-0", "a-1", "a-2", "a-3", "a-4"]  # this invocation's, input order
    assert [r["request"]["max_tokens"] for r in rows] == [16, 16, 16, 16, 99]  # as each was sent
    assert all(r["meta"]["base_url"].startswith("http://127.0.0.1:") for r in rows)

    again = asyncio.run(go([b, a], force=True))  # order of this invocation's datasets
    assert [r["id"] for r in _rows(tmp_path)] == [f"b-{i}" for i in range(5)] + [f"a-{i}" for i in range(5)]
    assert again.left_out == 0 and again.done == 0


def test_store_write_failure_stops_with_exit_6_and_exchanges_hold_what_was_committed(tmp_path, monkeypatch):
    from tokenbridge.generate import store as store_mod

    real = store_mod.Store.finish
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 4:
            self._conn.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full")
        return real(self)

    monkeypatch.setattr(store_mod.Store, "finish", flaky)

    async def reply(prompt, attempt, body, request):
        await asyncio.sleep(0.01)
        return _json(_ok_body(prompt))

    summary = _run(Script(reply), tmp_path, 30, concurrency=2)
    assert summary.exit_code == ExitCode.STORE and summary.stop_reason == "store_error"
    assert "stopping: store write failed: database or disk is full" in summary.notices
    with Store.open(tmp_path / "run") as store:
        done = [s.id for s in store.samples(status="done")]
    assert 0 < len(done) < 30 and [r["id"] for r in _rows(tmp_path)] == done
    assert summary.pending == 30 - len(done)


def test_a_stream_may_outlast_timeout_s_while_bytes_keep_coming(tmp_path):
    payload = _sse([_chunk({"role": "assistant", "content": ""})] + [_chunk({"content": "x"}) for _ in range(10)]
                   + [_chunk({}, "stop", usage={"prompt_tokens": 3, "completion_tokens": 10, "cost": 0.001})])

    async def reply(prompt, attempt, body, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        step = len(payload) // 12 + 1
        for i in range(0, len(payload), step):
            await resp.write(payload[i : i + step])
            await asyncio.sleep(0.1)  # 1.2 s in all, never silent for 0.4 s
        await resp.write_eof()
        return resp

    summary = _run(Script(reply), tmp_path, 1, stream=True, timeout_s=0.5, read_timeout_s=0.4)
    assert summary.done == 1 and summary.errors == {}
    assert _rows(tmp_path)[0]["response"]["choices"][0]["message"]["content"] == "x" * 10


def test_a_stream_is_read_to_done_and_one_without_usage_is_kept_and_booked(tmp_path):
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.001}
    head = _sse([_chunk({"role": "assistant", "content": "Hi"}, "stop")])[: -len(b"data: [DONE]\n\n")]

    async def reply(prompt, attempt, body, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(head)
        if prompt == "q1":  # ends cleanly after finish_reason: no usage chunk, no [DONE]
            await resp.write_eof()
            return resp
        if prompt == "q2":  # the connection drops after finish_reason
            await asyncio.sleep(0.05)
            request.transport.close()
            return resp
        await asyncio.sleep(0.2)  # the usage chunk comes a while after the finish_reason
        await resp.write(b"data: " + json.dumps(_chunk({}, None, usage=usage) | {"choices": []}).encode()
                         + b"\n\ndata: [DONE]\n\n")
        await asyncio.sleep(3)  # a server that keeps the stream open after [DONE]
        await resp.write_eof()
        return resp

    script = Script(reply)
    summary = _run(script, tmp_path, 4, stream=True, concurrency=1, max_cost=1.0)
    assert summary.done == 4 and summary.stop_reason is None and summary.exit_code == ExitCode.OK
    assert dict(script.attempts) == {"q0": 1, "q1": 1, "q2": 1, "q3": 1}  # none sent twice
    assert not any("so what it cost is unknown" in n for n in summary.notices)
    assert any("came without usage" in n for n in summary.notices)
    rows = _rows(tmp_path)
    assert rows[0]["response"]["usage"] == usage and rows[0]["meta"]["latency_s"] < 2.0  # done at [DONE]
    assert "usage" not in rows[1]["response"] and "usage" not in rows[2]["response"]
    assert summary.spent_total == pytest.approx(0.002)
    assert summary.spent_possible > 0  # q1 and q2 are booked at their reservations


@pytest.mark.parametrize("max_cost", [1.0, None])  # with [prices], a run without a cap books it too
def test_a_timeout_is_booked_as_possible_spend(tmp_path, max_cost):
    from tokenbridge.generate.settings import Prices

    async def reply(prompt, attempt, body, request):
        if attempt == 1:
            await asyncio.sleep(1.5)
        return _json(_ok_body(prompt))

    summary = _run(Script(reply), tmp_path, 1, timeout_s=0.5, max_cost=max_cost,
                   prices=Prices(prompt=0.0, completion=1000.0))
    assert summary.done == 1 and summary.errors == {"timeout": 1}
    assert summary.spent_possible == pytest.approx(16 * 1000 / 1e6)  # its reservation: max_tokens 16
    with Store.open(tmp_path / "run") as store:
        assert [(a.error_class, a.possible_cost) for a in store.attempts("b3-0")] == [
            ("timeout", pytest.approx(0.016)), (None, None)]


def test_an_internal_error_is_stored_without_the_key(tmp_path, monkeypatch):
    from tokenbridge.generate import engine as eng

    def broken(self, item, outcome, record):
        raise RuntimeError(f"bug near Bearer {KEY.value}")

    monkeypatch.setattr(eng.Engine, "_handle", broken)
    summary = _run(Script(lambda p, a, b, r: asyncio.sleep(0, _json(_ok_body(p)))), tmp_path, 1)
    assert summary.failures == [{"id": "b3-0", "error_class": "internal", "error": "RuntimeError: bug near Bearer ***"}]
    for path in (tmp_path / "run").iterdir():
        assert KEY.value.encode() not in path.read_bytes(), path


def test_an_internal_error_is_counted_with_its_traceback(tmp_path, monkeypatch):
    """A bug caught so the run goes on is counted and its traceback kept (key masked) in generate.json."""
    from tokenbridge.generate import engine as eng

    def broken(self, item, outcome, record):
        raise RuntimeError(f"bug near Bearer {KEY.value}")

    monkeypatch.setattr(eng.Engine, "_handle", broken)
    summary = _run(Script(lambda p, a, b, r: asyncio.sleep(0, _json(_ok_body(p)))), tmp_path, 2)
    assert summary.internal_errors == 2 and len(summary.tracebacks) == 2
    first = summary.tracebacks[0]
    assert first.startswith("Traceback (most recent call last):") and "in broken" in first
    assert first.endswith("RuntimeError: bug near Bearer ***")
    saved = json.loads((tmp_path / "run" / "generate.json").read_text())
    assert (saved["internal_errors"], saved["tracebacks"]) == (2, summary.tracebacks)


def test_a_bug_while_reading_a_response_is_internal_not_a_client_error(tmp_path, monkeypatch):
    """Only transport failures are classified (and maybe retried); a bug in our reading code is an internal error."""
    from tokenbridge.generate import engine as eng

    def broken(status, headers, body, *, key=None):
        raise KeyError("a bug in classify_response")

    monkeypatch.setattr(eng, "classify_response", broken)
    summary = _run(Script(lambda p, a, b, r: asyncio.sleep(0, _json(_ok_body(p)))), tmp_path, 1)
    assert summary.failures == [{"id": "b3-0", "error_class": "internal", "error": "KeyError: 'a bug in classify_response'"}]
    assert summary.errors == {"internal": 1} and summary.internal_errors == 1 and summary.requests == 1
    assert summary.exit_code == ExitCode.INCOMPLETE
    with Store.open(tmp_path / "run") as store:  # it went out, so it has its attempt row
        assert [(a.n, a.error_class, a.message) for a in store.attempts("b3-0")] == [
            (1, "internal", "KeyError: 'a bug in classify_response'")]
        assert store._conn.execute("SELECT COUNT(*) FROM in_flight").fetchone() == (0,)


def test_a_bug_in_the_store_writer_is_internal_not_a_store_failure(tmp_path, monkeypatch):
    """The writer stops the run on a database error (exit 6); any other exception is a bug: exit 8, with its traceback."""
    from tokenbridge.generate import store as store_mod

    def broken(self, batch):
        raise TypeError("a bug in stage")

    monkeypatch.setattr(store_mod.Store, "stage", broken)
    summary = _run(Script(lambda p, a, b, r: asyncio.sleep(0, _json(_ok_body(p)))), tmp_path, 2)
    assert summary.exit_code == ExitCode.INTERNAL and summary.stop_reason == "internal_error"
    assert any(n.startswith("stopping: internal error in the store writer (TypeError: a bug in stage)")
               for n in summary.notices)
    assert summary.internal_errors == 1 and summary.tracebacks[0].endswith("TypeError: a bug in stage")


def test_bad_rows_never_crash_a_run(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"id": "x-1", "prompt": "ok"}\n{"id": 2, "prompt": "bad \\ud800 here"}\n', encoding="utf-8")
    g = tmp_path / "a-x.jsonl"
    g.write_text('{"id": 1, "prompt": "same id as a/x-1"}\n{"id": 2, "prompt": "fine"}\n', encoding="utf-8")

    async def main():
        runner, url = await _serve(Script(lambda p, a, b, r: asyncio.sleep(0, _json(_ok_body(p)))))
        try:
            st = _settings(url, DatasetSpec("a", f)).with_overrides(datasets=(DatasetSpec("a", f), DatasetSpec("a-x", g)))
            return await agenerate_run(st, tmp_path / "run", key=KEY)
        finally:
            await runner.cleanup()

    summary = asyncio.run(main())
    assert summary.done == 2 and summary.exit_code == ExitCode.INCOMPLETE
    assert summary.bad_rows == [
        f"{f}: line 2: field 'prompt': lone surrogate '\\ud800' at character 4: not valid UTF-8",
        f"{g}: line 1: field 'id': sample id 'a-x-1' collides with an earlier row's (first at {f}: line 1)",
    ]
    assert [r["id"] for r in _rows(tmp_path)] == ["a-x-1", "a-x-2"]

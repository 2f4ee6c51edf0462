"""generate against bodies built to break parsers: deep nesting, absurd error codes, SSE
floods of comments, bare CRs and endless lines. Each must end as a stored response or a
classified attempt, in time and memory proportional to its size."""

from __future__ import annotations

import contextlib
import json
import re
import time
import tracemalloc

import orjson
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from test_generate_engine import Script, _chunk, _json, _ok_body, _run, _sse
from tokenbridge.generate import Store
from tokenbridge.generate.classify import classify_response
from tokenbridge.generate.run import ExitCode
from tokenbridge.generate.settings import Prices
from tokenbridge.generate.sse import MAX_COMMENT_CHARS, MAX_COMMENTS, SSEDecoder

# asserts on the wall clock or on timings (sleeps, rates, deadlines): run alone, after the
# rest of the suite runs on every core (`make test`), so a busy machine cannot fail them
pytestmark = pytest.mark.serial


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _deep_ok(depth: int, cost: float = 0.25) -> bytes:
    """A valid completion (as check_body reads it) with one extra field nested ``depth`` deep."""
    doc = json.dumps(_ok_body("deep") | {"usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": cost}})
    return doc[:-1].encode() + b', "x": ' + _nested(depth) + b"}"


def _body(data: bytes, status: int = 200) -> web.Response:
    return web.Response(body=data, status=status, content_type="application/json")


# --- deep nesting: json.loads recurses, orjson (the boundary) reads 1024 levels ------------


def test_a_200_body_nested_1020_deep_is_stored_and_its_cost_counted(tmp_path):
    deep = _deep_ok(1020)

    async def reply(prompt, attempt, body, request):
        return _body(deep)

    summary = _run(Script(reply), tmp_path, 1)
    assert (summary.done, summary.failed, summary.exit_code, summary.errors) == (1, 0, ExitCode.OK, {})
    assert summary.internal_errors == 0
    assert summary.spent_total == pytest.approx(0.25)
    with Store.open(tmp_path / "run") as store:
        assert store.response("b3-0") == (deep, None)
        (att,) = store.attempts("b3-0")
    assert (att.http_status, att.error_class) == (200, None)


def test_a_500_nested_3000_deep_is_retried_by_its_status(tmp_path):
    async def reply(prompt, attempt, body, request):
        if attempt == 1:
            return _body(b'{"error": {"message": "m", "x": ' + _nested(3000) + b"}}", 500)
        return _json(_ok_body("ok"))

    script = Script(reply)
    summary = _run(script, tmp_path, 1)
    assert (summary.done, summary.exit_code, summary.errors, summary.internal_errors) == (1, ExitCode.OK,
                                                                                         {"http_500": 1}, 0)
    assert script.attempts["q0"] == 2
    with Store.open(tmp_path / "run") as store:
        first = store.attempts("b3-0")[0]
    assert (first.http_status, first.error_class) == (500, "http_500")
    assert first.message == '{"error": {"message": "m", "x": ' + "[" * 468 + "…"  # too deep to read: the clipped text


def test_a_200_too_deep_to_parse_is_a_retried_bad_json(tmp_path):
    async def reply(prompt, attempt, body, request):
        return _body(_deep_ok(3000)) if attempt == 1 else _json(_ok_body("ok"))

    summary = _run(Script(reply), tmp_path, 1)
    assert (summary.done, summary.errors, summary.internal_errors) == (1, {"bad_json": 1}, 0)
    with Store.open(tmp_path / "run") as store:
        first = store.attempts("b3-0")[0]
    assert (first.http_status, first.error_class) == (200, "bad_json")
    assert first.message.startswith("response is not JSON: ")


def test_deep_values_in_messages_usage_and_indexes_are_shown_by_type():
    deep = _nested(1020).decode()
    out, parsed = classify_response(502, {}, '{"error": {"message": ' + deep + "}}")
    assert (out.kind, out.error_class, out.message) == ("retry", "http_502", "<list nested too deep to show>")
    assert isinstance(parsed, dict)
    out, _ = classify_response(200, {}, '{"error": {"code": 503, "message": ' + deep + "}}")
    assert (out.kind, out.error_class, out.message) == ("retry", "api_error", "<list nested too deep to show>")
    # an index that is no count is the choice's place, as reconstruct reads it: the paid answer is kept
    msg = '"message": {"content": "x"}, "finish_reason": "stop"'
    out, _ = classify_response(200, {}, '{"choices": [{' + msg + ', "index": ' + deep + "}]}")
    assert (out.kind, out.error_class) == ("ok", None)
    out, _ = classify_response(200, {}, '{"choices": [{' + msg + ', "index": ' + deep + '}, {' + msg + ', "index": 0}]}')
    assert (out.error_class, out.message) == ("bad_choices", "response.choices[1].index: 0 is also the index of choices[0]")


def test_a_deep_bad_cost_keeps_the_response_and_is_reported(tmp_path):
    doc = json.dumps(_ok_body("ok")).replace('"cost": 0.001', '"cost": ' + _nested(1020).decode())

    async def reply(prompt, attempt, body, request):
        return _body(doc.encode())

    summary = _run(Script(reply), tmp_path, 1)
    assert (summary.done, summary.errors, summary.internal_errors) == (1, {}, 0)
    assert summary.bad_usage_examples == ["b3-0: usage.cost = <list nested too deep to show>"]


def test_a_deep_usage_field_is_left_out_of_the_stored_usage_and_the_response_kept(tmp_path):
    doc = json.dumps(_ok_body("ok")).replace('"cost": 0.001', '"cost": 0.001, "x": ' + _nested(1020).decode())

    async def reply(prompt, attempt, body, request):
        return _body(doc.encode())

    summary = _run(Script(reply), tmp_path, 1)
    assert (summary.done, summary.exit_code, summary.internal_errors) == (1, ExitCode.OK, 0)
    assert summary.spent_total == pytest.approx(0.001)
    assert summary.bad_usage_examples == ["b3-0: usage.x is nested more than 64 deep"]
    with Store.open(tmp_path / "run") as store:
        assert store.response("b3-0") == (doc.encode(), None)
        (usage,) = store._conn.execute("SELECT usage FROM responses WHERE sample_id='b3-0'").fetchone()
    assert json.loads(usage) == {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.001}


# --- error codes: only a plausible HTTP status is a status ---------------------------------


@pytest.mark.parametrize("code", ['"' + "9" * 5000 + '"', '"\u00b2"', '"0429"', '"42"', "1e3", "429.5", "true",
                                  "-503", "700", '"700"'])
def test_an_implausible_error_code_is_an_api_error(code):
    out, parsed = classify_response(200, {}, '{"error": {"code": ' + code + ', "message": "m"}}')
    assert (out.kind, out.error_class, out.message, out.status) == ("retry", "api_error", "m", 200)
    assert isinstance(parsed, dict)


@pytest.mark.parametrize(("code", "kind", "cls"), [('"429"', "rate_limited", "http_429"), ("402", "payment", "http_402"),
                                                   ('"401"', "fail", "http_401"), ("503", "retry", "api_error")])
def test_a_plausible_error_code_still_decides(code, kind, cls):
    out, _ = classify_response(200, {}, '{"error": {"code": ' + code + ', "message": "m"}}')
    assert (out.kind, out.error_class) == (kind, cls)


def test_a_5000_digit_error_code_end_to_end_is_a_retried_api_error(tmp_path):
    async def reply(prompt, attempt, body, request):
        if attempt == 1:
            return _body(b'{"error": {"code": "' + b"9" * 5000 + b'", "message": "m"}}')
        return _json(_ok_body("ok"))

    summary = _run(Script(reply), tmp_path, 1)
    assert (summary.done, summary.errors) == (1, {"api_error": 1})
    with Store.open(tmp_path / "run") as store:
        first = store.attempts("b3-0")[0]
    assert (first.error_class, first.message) == ("api_error", "m")


# --- SSE: memory and time proportional to the bytes fed ------------------------------------


def _feed(decoder: SSEDecoder, data: bytes, step: int, *, within_s: float | None = None) -> list:
    """Feed ``data`` in ``step``-byte chunks; fail as soon as ``within_s`` has passed."""
    out = []
    t0 = time.perf_counter()
    for i in range(0, len(data), step):
        out += decoder.feed(data[i : i + step])
        if within_s is not None:
            assert time.perf_counter() - t0 < within_s, f"{i} of {len(data)} bytes after {within_s} s"
    return out


def _retained(fn) -> int:
    """Bytes still allocated after ``fn()`` (what the decoder keeps, not what it passed through)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keep = fn()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del keep
    return after - before


def test_a_comment_flood_keeps_a_count_and_a_bounded_sample():
    flood = b":ab\n" * (1 << 18) + b": " + b"c" * 100_000 + b"\n"  # 1 MiB of comments, then one long one
    dec = SSEDecoder()

    def feed() -> SSEDecoder:
        assert _feed(dec, flood, 65536) == []
        return dec

    retained = _retained(feed)
    assert dec.comment_count == (1 << 18) + 1
    assert dec.comments == ["ab"] * MAX_COMMENTS
    assert retained < 64 * 1024  # a list per line would be ~15 MiB
    dec = SSEDecoder()
    list(dec.feed(b": " + b"c" * 100_000 + b"\n"))
    assert dec.comments == ["c" * MAX_COMMENT_CHARS] and dec.comment_count == 1


def test_a_flood_of_data_lines_is_held_as_text_not_one_object_per_line():
    lines = 1 << 18
    dec = SSEDecoder()
    flood = b"data:xy\n" * lines
    retained = _retained(lambda: _feed(dec, flood, 65536))
    assert retained < len(flood)  # the text and its growth room; a list of strs would be ~15 MiB
    (event,) = list(dec.feed(b"\n"))
    assert event.data == "\n".join(["xy"] * lines)


def test_a_flood_of_bare_crs_is_fed_in_linear_time():
    dec = SSEDecoder()
    assert _feed(dec, b"data: a" + b"\r" * (4 << 20), 65536, within_s=1.0) == [_event("a")]
    assert list(dec.feed(b"\ndata: b\n\n")) == [_event("b")]  # a CR at the end may be a CRLF


def test_an_endless_line_is_fed_in_linear_time():
    dec = SSEDecoder()
    assert _feed(dec, b"data: " + b"x" * (8 << 20), 4096, within_s=1.0) == []
    (event,) = list(dec.feed(b"\r\n\r\n"))
    assert len(event.data) == 8 << 20 and set(event.data) == {"x"}


def _event(data: str, name: str = "message"):
    from tokenbridge.generate.sse import SSEEvent

    return SSEEvent(data, name)


def test_a_stream_behind_floods_of_comments_and_crs_is_kept(tmp_path):
    good = _sse([_chunk({"role": "assistant", "content": "Hel"}),
                 _chunk({"content": "lo"}, "stop", usage={"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.01})])

    async def reply(prompt, attempt, body, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(4):
            await resp.write(b":ab\n" * (1 << 16))
            await resp.write(b"\r" * (1 << 18))
        await resp.write(good)
        await resp.write_eof()
        return resp

    summary = _run(Script(reply), tmp_path, 1, stream=True)
    assert (summary.done, summary.errors, summary.internal_errors) == (1, {}, 0)
    assert summary.spent_total == pytest.approx(0.01)


# --- SSE: the same events as a whole-buffer split, however the bytes arrive ---------------


def _reference(raw: bytes) -> tuple[list[tuple[str, str]], int]:
    """The event-stream rules applied to the whole text at once: (events, comment count)."""
    lines = re.split(r"\r\n|\r|\n", raw.decode("utf-8"))
    last = lines.pop()
    if last:  # a last line without its line end still counts at close
        lines.append(last)
    events, data, name, comments = [], None, "", 0
    for line in lines:
        if not line:
            if data is not None:
                events.append((name or "message", "\n".join(data)))
            data, name = None, ""
        elif line.startswith(":"):
            comments += 1
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                data = [*(data or []), value]
            elif field == "event":
                name = value
    if data is not None:
        events.append((name or "message", "\n".join(data)))
    return events, comments


_PIECES = st.sampled_from(["\r\n", "\n", "\r", "\r\r", "\n\r", "data: ", "data:", "data", "event: e", "event:",
                           ": c", ":", "x", " y", "é", "😀", "id: 1", "da", "ta: z", ":\r"])


@settings(max_examples=500, deadline=None)
@given(st.lists(_PIECES, max_size=40), st.lists(st.integers(0, 400), max_size=12))
def test_any_split_gives_the_events_of_a_whole_buffer_split(pieces, cuts):
    raw = "".join(pieces).encode("utf-8")
    bounds = sorted(min(c, len(raw)) for c in cuts)  # repeats make empty chunks
    dec = SSEDecoder()
    got = []
    for a, b in zip([0, *bounds], [*bounds, len(raw)]):
        got += [(e.event, e.data) for e in dec.feed(raw[a:b])]
    got += [(e.event, e.data) for e in dec.close()]
    events, comments = _reference(raw)
    assert got == events
    assert dec.comment_count == comments


def test_a_mid_stream_error_nested_1000_deep_is_a_retried_stream_error(tmp_path):
    """orjson reads a chunk's ``error`` 1024 levels deep; re-serialising it for the classifier
    with json.dumps recursed past Python's stack: an internal error, not a classified one."""
    deep = b'data: {"id": "x", "choices": [], "error": {"code": 502, "x": ' + _nested(1000) + b"}}\n\n"

    async def reply(prompt, attempt, body, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        payload = (b'data: ' + json.dumps(_chunk({"role": "assistant", "content": "Hel"})).encode() + b"\n\n" + deep
                   if attempt == 1 else _sse([_chunk({"content": "ok"}, "stop")]))
        await resp.write(payload)
        await resp.write_eof()
        return resp

    summary = _run(Script(reply), tmp_path, 1, stream=True)
    assert (summary.done, summary.errors, summary.internal_errors) == (1, {"stream_error": 1}, 0)


def test_a_placeholder_key_is_not_masked_in_stored_responses(tmp_path):
    """A self-hosted server's key ``e`` (or ``EMPTY``, ``the``) was masked wherever its text
    occurred: every body's ``"choices"`` became ``"choic***s"`` and all samples failed, each
    attempt paid for. Keys under MIN_MASKED characters are placeholders, said so once."""
    import asyncio

    from test_generate_engine import _prompts, _serve, _settings
    from tokenbridge.generate import agenerate_run
    from tokenbridge.generate.progress import Reporter
    from tokenbridge.generate.secrets import MIN_MASKED, ApiKey, scrub, scrub_bytes

    async def reply(prompt, attempt, body, request):
        return _json(_ok_body("So the plan is: sort the cache"))

    logged: list[str] = []

    class _Log(Reporter):
        def log(self, message: str, *, warn: bool = False) -> None:
            logged.append(message)

    async def main():
        runner, url = await _serve(Script(reply))
        try:
            return await agenerate_run(_settings(url, _prompts(tmp_path, 2)), tmp_path / "run",
                                       key=ApiKey("LOCAL_KEY", "the"), reporter=_Log("none"))
        finally:
            await runner.cleanup()

    summary = asyncio.run(main())
    assert (summary.done, summary.errors) == (2, {})
    stored = (tmp_path / "run" / "exchanges.jsonl").read_text(encoding="utf-8")
    assert stored.count("So the plan is: sort the cache") == 2 and "***" not in stored
    assert any("the key in $LOCAL_KEY is 3 characters, a placeholder rather than a secret" in m for m in logged)
    real = "sk-or-v1-" + "0123456789abcdef" * 4
    assert len(real) >= MIN_MASKED and scrub(f"echo {real}!", real) == "echo ***!"
    assert scrub_bytes(b'"choices": [1]', "e") == b'"choices": [1]' and scrub("EMPTY", "EMPTY") == "EMPTY"


# --- SSE: a chunk the assembler cannot fold is a billed bad_stream, never an internal error ---


_USAGE_05 = {"prompt_tokens": 10, "completion_tokens": 5, "cost": 0.5}


def _billed_stream(hostile: dict) -> bytes:
    """A stream with one hostile chunk in it, then its finish, a usage chunk ($0.50) and [DONE]."""
    return _sse([_chunk({"role": "assistant", "content": "hello"}), hostile, _chunk({}, "stop"),
                 _chunk({}, None, usage=_USAGE_05) | {"choices": []}], comments=False)


@pytest.mark.parametrize(("hostile", "why"), [
    ({"choices": 5}, "stream chunk has choices of type int, not a list"),
    (_chunk({"tool_calls": 7}), "stream chunk has tool_calls of type int, not a list"),
    (_chunk({"reasoning_details": 3}), "stream chunk has reasoning_details of type int, not a list"),
    ({"choices": ["x"]}, "stream chunk has a choice of type str, not an object"),
    (_chunk({"tool_calls": [{"index": 0, "function": "f"}]}),
     "stream chunk has a tool call function of type str, not an object"),
])
def test_a_hostile_stream_chunk_is_a_billed_bad_stream_with_its_raw_bytes_kept(tmp_path, hostile, why):
    stream = _billed_stream(hostile)

    async def reply(prompt, attempt, body, request):
        good = _sse([_chunk({"content": "ok"}, "stop", usage=_USAGE_05 | {"cost": 0.001})])
        return web.Response(body=stream if attempt == 1 else good, headers={"Content-Type": "text/event-stream"})

    summary = _run(Script(reply), tmp_path, 1, stream=True, max_cost=10.0, prices=Prices(prompt=1.0, completion=1.0))
    assert (summary.done, summary.errors, summary.internal_errors) == (1, {"bad_stream": 1}, 0)
    assert (summary.spent_total, summary.spent_possible) == (pytest.approx(0.501), 0.0)  # its usage chunk, after it
    with Store.open(tmp_path / "run") as store:
        first, second = store.attempts("b3-0")
    assert (first.http_status, first.error_class, first.message, first.cost) == (200, "bad_stream", why, 0.5)
    assert first.body == stream and (second.error_class, second.body) == (None, None)


def test_a_refused_stream_that_carried_the_key_keeps_no_raw_bytes(tmp_path):
    from test_generate_engine import KEY

    half = len(KEY.value) // 2
    stream = _sse([_chunk({"role": "assistant", "content": "key: " + KEY.value[:half]}),
                   _chunk({"content": KEY.value[half:]}), {"choices": 5}, _chunk({}, "stop", usage=_USAGE_05)])

    async def reply(prompt, attempt, body, request):
        return web.Response(body=stream, headers={"Content-Type": "text/event-stream"})

    summary = _run(Script(reply), tmp_path, 1, stream=True, max_attempts=1)
    assert (summary.failed, summary.errors, summary.spent_total) == (1, {"bad_stream": 1}, pytest.approx(0.5))
    with Store.open(tmp_path / "run") as store:
        (att,) = store.attempts("b3-0")
    assert (att.cost, att.body) == (0.5, None)  # the key may be split across events in the raw bytes
    assert any("its raw stream is not kept" in n for n in summary.notices)


_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.text(max_size=3)),
                    lambda c: st.one_of(st.lists(c, max_size=2), st.dictionaries(st.text(max_size=2), c, max_size=2)),
                    max_leaves=6)


def _shaped(**fields: st.SearchStrategy) -> st.SearchStrategy:
    """An object with any of these fields, or any JSON value in its place."""
    return st.one_of(_ANY, st.fixed_dictionaries({}, optional=fields))


def _listed(item: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(_ANY, st.lists(item, max_size=3))


_INDEX = st.one_of(st.integers(0, 2), _ANY)
_CALL = _shaped(index=_INDEX, id=_ANY, type=_ANY, function=_shaped(name=_ANY, arguments=_ANY))
_DETAIL = _shaped(index=_INDEX, type=_ANY, text=_ANY, signature=_ANY)
_DELTA = _shaped(role=_ANY, content=_ANY, reasoning=_ANY, tool_calls=_listed(_CALL), reasoning_details=_listed(_DETAIL))
_CHOICE = _shaped(index=_INDEX, delta=_DELTA, message=_DELTA, finish_reason=_ANY, logprobs=_ANY, error=_ANY, x=_ANY)
_CHUNK = st.fixed_dictionaries({}, optional={"choices": _listed(_CHOICE), "usage": _ANY, "error": _ANY, "id": _ANY})


@settings(max_examples=400, deadline=None)
@given(st.lists(_CHUNK, min_size=1, max_size=4))
def test_the_stream_assembler_refuses_any_shape_with_a_stream_error_only(chunks):
    from tokenbridge.generate.sse import SSEEvent, StreamAssembler, StreamError

    asm = StreamAssembler()
    for chunk in chunks:
        with contextlib.suppress(StreamError):
            asm.add_event(SSEEvent(json.dumps(chunk)))
    with contextlib.suppress(StreamError):
        json.loads(orjson.dumps(asm.result()))


# --- a 200 is kept only in the shape reconstruct reads (exchanges.check_response) -----------

#: Bodies a cold tester's server sent: each was stored as done, then refused by reconstruct as
#: a bad line, so the paid sample was never retried.
_UNREADABLE = {
    "message_null": lambda b: b["choices"][0].__setitem__("message", None),
    "finish_int": lambda b: b["choices"][0].__setitem__("finish_reason", 1),
    "content_object": lambda b: b["choices"][0]["message"].__setitem__("content", {"text": "hi"}),
    "details_object": lambda b: b["choices"][0]["message"].__setitem__("reasoning_details", {}),
    "details_index_string": lambda b: b["choices"][0]["message"].__setitem__(
        "reasoning_details", [{"type": "reasoning.text", "text": "x", "index": "0"}]),
    "token_id_negative": lambda b: b["choices"][0].__setitem__("token_ids", [-1]),
    "prompt_ids_strings": lambda b: b.__setitem__("prompt_token_ids", ["1"]),
}


def _unreadable(shape: str) -> dict:
    body = _ok_body("hi")
    _UNREADABLE[shape](body)
    return body


@pytest.mark.parametrize("shape", sorted(_UNREADABLE))
def test_a_200_reconstruct_would_refuse_is_a_billed_bad_choices_attempt(shape):
    from tokenbridge.exchanges import RecordError, parse_exchange

    body = _unreadable(shape)
    with pytest.raises(RecordError) as refused:  # what reconstruct says of the stored record
        parse_exchange({"id": "x", "request": {"messages": [{"role": "user", "content": "q"}]}, "response": body})
    out, parsed = classify_response(200, {}, json.dumps(body))
    assert (out.kind, out.error_class, out.message, out.maybe_billed) == ("retry", "bad_choices", str(refused.value), True)
    assert parsed == body  # read, so its usage is booked


def test_a_200_reconstruct_would_refuse_is_retried_and_billed_not_stored_as_done(tmp_path):
    async def reply(prompt, attempt, body, request):
        return _json(_unreadable("message_null") if attempt == 1 else _ok_body("ok"))

    script = Script(reply)
    summary = _run(script, tmp_path, 1)
    assert (summary.done, summary.exit_code, summary.errors) == (1, ExitCode.OK, {"bad_choices": 1})
    assert script.attempts["q0"] == 2
    assert summary.spent_total == pytest.approx(0.002)  # both answers were paid for
    with Store.open(tmp_path / "run") as store:
        first = store.attempts("b3-0")[0]
        kept, _ = store.response("b3-0")
    assert (first.error_class, first.message, first.cost) == (
        "bad_choices", "response.choices[0].message: missing or not an object", 0.001)
    assert json.loads(kept)["choices"][0]["message"]["content"] == "ok"


# --- an error body is an error, choices beside it or not ------------------------------------


@pytest.mark.parametrize(("code", "kind", "error_class"), [(502, "retry", "api_error"), (429, "rate_limited", "http_429"),
                                                           (402, "payment", "http_402"), (None, "retry", "api_error")])
def test_an_error_beside_choices_is_classified_by_its_code_and_billed(code, kind, error_class):
    body = _ok_body("The capital of France is Par") | {"error": {"code": code, "message": "upstream reset"}}
    out, parsed = classify_response(200, {}, json.dumps(body))
    assert (out.kind, out.error_class, out.message, out.maybe_billed) == (kind, error_class, "upstream reset", True)
    assert parsed == body  # its usage is booked
    bare, _ = classify_response(200, {}, json.dumps({"error": body["error"]}))  # no answer came with it
    assert (bare.kind, bare.error_class, bare.maybe_billed) == (kind, error_class, False)


def test_an_error_beside_choices_is_retried_and_its_usage_booked(tmp_path):
    cut = _ok_body("The capital of France is Par") | {"error": {"code": 502, "message": "upstream reset"}}

    async def reply(prompt, attempt, body, request):
        return _json(cut if attempt == 1 else _ok_body("Paris."))

    summary = _run(Script(reply), tmp_path, 1)
    assert (summary.done, summary.exit_code, summary.errors) == (1, ExitCode.OK, {"api_error": 1})
    assert summary.spent_total == pytest.approx(0.002)
    with Store.open(tmp_path / "run") as store:
        first = store.attempts("b3-0")[0]
        kept, _ = store.response("b3-0")
    assert (first.error_class, first.message, first.cost) == ("api_error", "upstream reset", 0.001)
    assert json.loads(first.body) == cut  # the paid bytes are kept
    assert "error" not in json.loads(kept)


@pytest.mark.parametrize("where", ["comments", "ids"])
def test_a_stream_that_spreads_the_key_in_short_pieces_keeps_its_answer_not_its_raw_bytes(tmp_path, where):
    """Pieces of 10 characters (under the 16 the mask needs) in comment lines or in the ids
    of the chunks (last one wins in the answer) were kept in the raw stream, whose reader
    joins them back into the key. The answer is kept (it holds no piece); its raw bytes are not."""
    from test_generate_engine import KEY

    pieces = [KEY.value[i:i + 10] for i in range(0, len(KEY.value), 10)]
    chunks = [_chunk({"role": "assistant", "content": "Hello"}), _chunk({"content": " world"}, "stop", usage=_USAGE_05)]
    if where == "comments":
        stream = "".join(f": debug {p}\n\n" for p in pieces).encode() + _sse(chunks)
    else:
        chunks = [{**_chunk({"content": ""}), "id": p} for p in pieces] + chunks
        stream = _sse(chunks)
    clean = _sse([_chunk({"role": "assistant", "content": "Hello"}), _chunk({"content": " world"}, "stop",
                                                                             usage=_USAGE_05)])

    async def reply(prompt, attempt, body, request):
        return web.Response(body=stream if prompt.endswith("0") else clean, headers={"Content-Type": "text/event-stream"})

    summary = _run(Script(reply), tmp_path, 2, stream=True)
    assert summary.done == 2
    with Store.open(tmp_path / "run") as store:
        body, raw = store.response("b3-0")
        assert raw is None and json.loads(body)["choices"][0]["message"]["content"] == "Hello world"
        assert store.response("b3-1")[1] == clean  # a stream with no piece of the key keeps its raw bytes
    assert any("held pieces of the API key" in n for n in summary.notices)


def test_a_usage_chunk_after_done_in_the_same_read_still_bills_the_answer(tmp_path):
    """It was thrown away with the rest after ``[DONE]``: the answer was booked at $0 and a
    run under --max-cost stopped as if responses carried no cost. What else follows
    ``[DONE]`` (another chunk's text, junk bytes) is still no part of the answer."""
    late = (b'data: {"id": "gen-s", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, '
            b'"cost": 0.5}}\n\n' + b'data: ' + json.dumps(_chunk({"content": " more"})).encode() + b"\n\n\xff\xfe")
    stream = _sse([_chunk({"role": "assistant", "content": "Hello"}), _chunk({}, "stop")], comments=False) + late

    async def reply(prompt, attempt, body, request):
        return web.Response(body=stream, headers={"Content-Type": "text/event-stream"})

    summary = _run(Script(reply), tmp_path, 3, stream=True, max_cost=10.0)
    assert (summary.done, summary.errors, summary.spent_total) == (3, {}, pytest.approx(1.5))
    with Store.open(tmp_path / "run") as store:
        body, raw = store.response("b3-0")
    answer = json.loads(body)
    assert answer["choices"][0]["message"]["content"] == "Hello" and answer["usage"]["cost"] == 0.5
    assert raw == stream

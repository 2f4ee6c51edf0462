"""Answers whose transfer goes wrong after the model's work is done: each was paid for, so
each is kept when it came whole, and otherwise leaves its bytes and its usage in the attempt
row. A raw socket server (aiohttp's own cannot cut a chunked body before its last chunk or
lie about Content-Length); every request after the first gets a plain good answer."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import write_prompts
from tokenbridge.generate import GenerateSettings, RequestSettings, Store, agenerate_run
from tokenbridge.generate.classify import classify_response
from tokenbridge.generate.secrets import ApiKey
from tokenbridge.generate.settings import DatasetSpec, Prices

# asserts on the wall clock or on timings (sleeps, rates, deadlines): run alone, after the
# rest of the suite runs on every core (`make test`), so a busy machine cannot fail them
pytestmark = pytest.mark.serial

KEY = ApiKey("TB_TRANSFER", "sk-or-v1-transfer-test-key-0123456789")
USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "cost": 0.001}
BODY = json.dumps({"id": "g", "object": "chat.completion", "model": "m", "provider": "p", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Hi."}, "finish_reason": "stop"}], "usage": USAGE}).encode()
Writer = asyncio.StreamWriter
#: (the 1-based request number, the connection's writer) -> writes the first answer
Mode = Callable[[Writer], Awaitable[None]]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(*, done: bool = True) -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi."}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": USAGE}]
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def _head(status: str = "200 OK", **headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _good(w: Writer) -> None:
    w.write(_head(Content_Type="application/json", Content_Length=str(len(BODY))) + BODY)


def _run(tmp_path: Path, first: Mode, **kw: Any) -> tuple[Any, list[bytes]]:
    """One generate run of one prompt: the first request answered by ``first``, any later one
    by a good answer. Returns the run's summary and the request lines the server saw."""
    seen: list[bytes] = []

    async def handle(r: asyncio.StreamReader, w: Writer) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await r.readexactly(length)
                seen.append(head.split(b"\r\n")[0])
                if len(seen) == 1:
                    await first(w)
                    if w.is_closing():
                        return
                else:
                    _good(w)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    async def main() -> Any:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/api/v1"
        settings: dict[str, Any] = dict(
            datasets=(DatasetSpec("m", write_prompts(tmp_path, 1)),), base_url=url, progress="none",
            request=RequestSettings(model="m", max_tokens=100), max_attempts=2, backoff_base_s=0.01,
            backoff_max_s=0.02, timeout_s=10.0)
        settings.update(kw)
        try:
            return await agenerate_run(GenerateSettings(**settings), tmp_path / "run", key=KEY)
        finally:
            server.close()

    return asyncio.run(asyncio.wait_for(main(), 60)), seen


def _attempts(tmp_path: Path) -> list[tuple[Any, ...]]:
    """(n, HTTP status, error class, cost, possible cost, kept body) of each attempt of the one sample."""
    with Store.open(tmp_path / "run") as store:
        rows = store.attempts(_sample(store))
    return [(a.n, a.http_status, a.error_class, a.cost, a.possible_cost, a.body) for a in rows]


def _sample(store: Store) -> str:
    (sample,) = store.samples()
    return sample.id


def _stored(tmp_path: Path) -> tuple[bytes, bytes | None]:
    with Store.open(tmp_path / "run") as store:
        got = store.response(_sample(store))
    assert got is not None
    return got


def _chunked_then_reset(content_type: str, data: bytes) -> Mode:
    """``data`` as one chunk of a chunked body, then the connection reset before its last chunk."""
    async def first(w: Writer) -> None:
        w.write(_head(Content_Type=content_type, Transfer_Encoding="chunked") + _chunk(data))
        await w.drain()
        await asyncio.sleep(0.1)
        w.transport.abort()
    return first


_cut_before_last_chunk = _chunked_then_reset("application/json", BODY)


async def _short_content_length(w: Writer) -> None:
    w.write(_head(Content_Type="application/json", Content_Length=str(len(BODY) + 40)) + BODY)
    await w.drain()
    await asyncio.sleep(0.1)
    w.transport.abort()


@pytest.mark.parametrize("first", [_cut_before_last_chunk, _short_content_length])
def test_a_whole_answer_whose_transfer_breaks_is_kept_not_bought_again(tmp_path, first):
    summary, seen = _run(tmp_path, first)
    assert len(seen) == 1 and summary.done == 1  # one request, one paid answer, kept
    assert summary.spent_total == pytest.approx(0.001)
    body, raw = _stored(tmp_path)
    assert body == BODY and raw is None
    assert [(n, status, cls) for n, status, cls, *_ in _attempts(tmp_path)] == [(1, 200, None)]


_half_body_then_reset = _chunked_then_reset("application/json", BODY[:60])


def test_a_partial_answer_is_sent_again_and_its_bytes_stay_in_the_attempt_row(tmp_path):
    summary, seen = _run(tmp_path, _half_body_then_reset, prices=Prices(prompt=0.0, completion=1000.0))
    assert len(seen) == 2 and summary.done == 1
    # billed as far as anyone knows: booked at its reservation (max_tokens 100 at $1000 a million)
    assert _attempts(tmp_path) == [(1, 200, "connection", None, pytest.approx(0.1), BODY[:60]),
                                   (2, 200, None, 0.001, None, None)]


async def _finished_stream_then_keepalives(w: Writer) -> None:
    w.write(_head(Content_Type="text/event-stream", Transfer_Encoding="chunked") + _chunk(_sse(done=False)))
    for _ in range(40):  # OpenRouter's keep-alive comments, never [DONE], past the attempt's deadline
        await w.drain()
        await asyncio.sleep(0.1)
        w.write(_chunk(b": OPENROUTER PROCESSING\n\n"))
    w.transport.abort()


def test_a_finished_stream_held_open_by_keepalives_until_the_deadline_is_kept(tmp_path):
    summary, seen = _run(tmp_path, _finished_stream_then_keepalives, stream=True, attempt_timeout_s=1.0,
                         read_timeout_s=5.0)
    assert len(seen) == 1 and summary.done == 1 and summary.spent_total == pytest.approx(0.001)
    body, raw = _stored(tmp_path)
    assert json.loads(body)["choices"][0]["message"]["content"] == "Hi."
    assert raw is not None and raw.startswith(_sse(done=False))


_stream_cut_before_finish = _chunked_then_reset(
    "text/event-stream", b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}).encode() + b"\n\n")


def test_an_unfinished_stream_cut_by_a_reset_leaves_its_raw_bytes_in_the_attempt_row(tmp_path):
    summary, seen = _run(tmp_path, _stream_cut_before_finish, stream=True)
    assert len(seen) == 2 and summary.done == 1
    first = _attempts(tmp_path)[0]
    assert first[:3] == (1, 200, "connection") and first[5].startswith(b'data: {"choices"')


def _stream_under(content_type: str | None) -> Mode:
    async def first(w: Writer) -> None:
        data = _sse()
        headers = {"Content_Length": str(len(data))}
        if content_type is not None:
            headers["Content_Type"] = content_type
        w.write(_head(**headers) + data)
    return first


@pytest.mark.parametrize("content_type", [None, "TEXT/EVENT-STREAM", "Text/Event-Stream; charset=utf-8", "text/plain",
                                          "application/octet-stream"])
def test_a_stream_is_read_as_one_whatever_its_content_type_says(tmp_path, content_type):
    summary, seen = _run(tmp_path, _stream_under(content_type), stream=True)
    assert len(seen) == 1 and summary.done == 1 and summary.spent_total == pytest.approx(0.001)
    body, raw = _stored(tmp_path)
    assert json.loads(body)["choices"][0]["message"]["content"] == "Hi." and raw == _sse()


async def _json_labelled_as_stream(w: Writer) -> None:
    w.write(_head(Content_Type="text/event-stream", Content_Length=str(len(BODY))) + BODY)


def test_a_whole_json_answer_labelled_as_a_stream_is_kept_as_the_answer_it_is(tmp_path):
    summary, seen = _run(tmp_path, _json_labelled_as_stream, stream=True)
    assert len(seen) == 1 and summary.done == 1 and summary.spent_total == pytest.approx(0.001)
    assert _stored(tmp_path) == (BODY, None)


def _finish(value: str | None, *, missing: bool = False) -> Mode:
    async def first(w: Writer) -> None:
        body = json.loads(BODY)
        if missing:
            del body["choices"][0]["finish_reason"]
        else:
            body["choices"][0]["finish_reason"] = value
        data = json.dumps(body).encode()
        w.write(_head(Content_Type="application/json", Content_Length=str(len(data))) + data)
    return first


@pytest.mark.parametrize("first", [_finish(None), _finish(None, missing=True), _finish("")], ids=["null", "missing", "empty"])
def test_an_answer_without_finish_reason_is_sent_again_as_a_choice_error(tmp_path, first):
    summary, seen = _run(tmp_path, first)
    assert len(seen) == 2 and summary.done == 1
    rows = _attempts(tmp_path)
    assert [(n, cls, cost) for n, _, cls, cost, _, _ in rows] == [(1, "choice_error", 0.001), (2, None, 0.001)]
    assert summary.spent_total == pytest.approx(0.002)  # the first was billed, and is booked


async def _redirect(w: Writer) -> None:
    w.write(_head("302 Found", Location="http://127.0.0.1:9/elsewhere", Content_Length="0"))


def test_a_redirect_is_not_followed(tmp_path):
    summary, seen = _run(tmp_path, _redirect, max_attempts=1)
    assert seen == [b"POST /api/v1/chat/completions HTTP/1.1"]  # no GET sent after it
    assert summary.done == 0 and summary.failed == 1
    assert summary.failures[0]["error"] == ("HTTP 302: the API redirected to 'http://127.0.0.1:9/elsewhere'; "
                                            "redirects are not followed: set base_url to where it points")


def test_a_gzip_body_under_a_content_encoding_not_undone_is_named_as_such():
    packed = gzip.compress(BODY)
    out, _ = classify_response(200, {"Content-Encoding": "x-gzip"}, packed)
    assert out.message == f"response is gzip-compressed but says Content-Encoding 'x-gzip', which was not undone ({len(packed)} bytes)"
    out, _ = classify_response(200, {}, packed)
    assert out.message == f"response is gzip-compressed but says no Content-Encoding ({len(packed)} bytes)"


def _installed(*modules: str) -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m.split(".")[0]) and importlib.util.find_spec(m) for m in modules)


@pytest.mark.parametrize(("coding", "modules"), [("br", ("brotli", "brotlicffi")), ("zstd", ("backports.zstd",))])
def test_an_answer_compressed_past_this_install_fails_once_booked_and_told(tmp_path, coding, modules):
    """aiohttp raises a made-up 400 ("Can not decode content-encoding") before the status is
    read: it was a retried "connection" error, paid again on every attempt. A retry comes
    compressed the same way: the sample fails at once, booked as possibly billed, and the
    run says at once what to install."""
    if _installed(*modules):
        pytest.skip(f"{modules[0]} is installed: aiohttp undoes {coding}")

    async def first(w: Writer) -> None:
        packed = b"\x28\xb5\x2f\xfd" + bytes(range(40))
        w.write(_head(Content_Type="application/json", Content_Encoding=coding, Content_Length=str(len(packed))) + packed)

    summary, seen = _run(tmp_path, first, max_attempts=3, prices=Prices(prompt=0.0, completion=1000.0))
    assert len(seen) == 1 and summary.failed == 1 and summary.done == 0
    # booked at its reservation (max_tokens 100 at $1000 a million): the answer may have been billed
    assert _attempts(tmp_path) == [(1, None, "bad_encoding", None, pytest.approx(0.1), None)]
    (failure,) = summary.failures
    assert failure["error_class"] == "bad_encoding"
    assert failure["error"].startswith("the answer could not be read: Can not decode content-encoding")
    assert "so the sample fails: install that package" in failure["error"]
    assert [n for n in summary.notices if n.startswith("answers are failing: ")] == [f"answers are failing: {failure['error']}"]


_json_labelled_as_stream_then_reset = _chunked_then_reset("text/event-stream", BODY)


def test_a_whole_json_answer_labelled_as_a_stream_is_kept_when_its_transfer_breaks(tmp_path):
    summary, seen = _run(tmp_path, _json_labelled_as_stream_then_reset, stream=True)
    assert len(seen) == 1 and summary.done == 1 and summary.spent_total == pytest.approx(0.001)
    assert _stored(tmp_path) == (BODY, None)


def _junk_after_done(content_type: str) -> Mode:
    async def first(w: Writer) -> None:
        data = _sse() + b"\xff\xfe junk\n\n"
        w.write(_head(Content_Type=content_type, Content_Length=str(len(data))) + data)
    return first


@pytest.mark.parametrize("content_type", ["text/event-stream", "text/plain"])
def test_bytes_that_do_not_decode_after_done_do_not_lose_the_stream(tmp_path, content_type):
    summary, seen = _run(tmp_path, _junk_after_done(content_type), stream=True)
    assert len(seen) == 1 and summary.done == 1 and summary.spent_total == pytest.approx(0.001)
    body, _ = _stored(tmp_path)
    assert json.loads(body)["choices"][0]["message"]["content"] == "Hi."

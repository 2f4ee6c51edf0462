"""Request building, outcome classification, SSE decoding/assembly, budget, secrets (the limiter: test_limiter.py)."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbridge.generate.budget import Budget, cost_of
from tokenbridge.generate.classify import classify_response, parse_retry_after
from tokenbridge.generate.prompts import Sample
from tokenbridge.generate.request import build_request, wire_body
from tokenbridge.generate.secrets import ApiKey, MissingApiKey, read_api_key, scrub, scrub_bytes
from tokenbridge.generate.settings import Prices, RequestSettings
from tokenbridge.generate.sse import SSEDecoder, SSEEvent, StreamAssembler, StreamError

# asserts on the wall clock or on timings (sleeps, rates, deadlines): run alone, after the
# rest of the suite runs on every core (`make test`), so a busy machine cannot fail them
pytestmark = pytest.mark.serial

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
SAMPLE = Sample("b3-1", "b3", [{"role": "user", "content": "hi"}], tools=TOOLS)


def test_build_request_fields_routing_and_extra_body():
    rs = RequestSettings(
        model="moonshotai/kimi-k2.5",
        max_tokens=100,
        temperature=0.7,
        seed=3,
        reasoning={"effort": "high"},
        provider={"ignore": ["fireworks"], "quantizations": ["int4"], "allow_fallbacks": True},
        extra_body={"provider": {"sort": "throughput"}, "return_token_ids": True, "reasoning": {"max_tokens": 50}},
    )
    body = build_request(SAMPLE, rs)
    assert body == {
        "model": "moonshotai/kimi-k2.5",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "temperature": 0.7,
        "seed": 3,
        "reasoning": {"effort": "high", "max_tokens": 50},
        "provider": {"ignore": ["fireworks"], "quantizations": ["int4"], "allow_fallbacks": True, "sort": "throughput"},
        "usage": {"include": True},
        "return_token_ids": True,
    }
    assert "tools" not in body  # not sent by default: Kimi then writes raw tool markers
    assert build_request(SAMPLE, RequestSettings(model="m", send_tools=True))["tools"] == TOOLS
    stored = json.dumps(body)
    assert wire_body(stored, stream=False) == stored.encode()
    streamed = json.loads(wire_body(stored, stream=True))
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in streamed.items() if k not in ("stream", "stream_options")} == body


@pytest.mark.parametrize(
    "status,body,kind,cls",
    [
        (200, '{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}]}', "ok", None),
        (200, "\n\n   \n" + '{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}]}', "ok", None),
        (200, '{"id":"x","choices":[{"message":{"content":"x"}', "retry", "bad_json"),
        (200, '{"error":{"code":502,"message":"upstream died"}}', "retry", "api_error"),
        (200, '{"error":{"code":429,"message":"slow down"}}', "rate_limited", "http_429"),
        (200, '{"error":{"code":402,"message":"no credits"}}', "payment", "http_402"),
        (200, '{"choices":[{"message":{"content":"x"},"finish_reason":"error"}]}', "retry", "choice_error"),
        (200, '{"choices":[{"message":{"content":"x"},"finish_reason":null}]}', "retry", "choice_error"),
        (200, '{"choices":[{"message":{"content":"x"}}]}', "retry", "choice_error"),
        # "" is no finish, as null: it was kept (and the gate flagged it finish_unknown)
        (200, '{"choices":[{"message":{"content":"x"},"finish_reason":""}]}', "retry", "choice_error"),
        (200, '{"choices":[{"message":{"content":"x"},"finish_reason":" "}]}', "retry", "choice_error"),
        # not a string: the reader refuses the record, so it is a billed bad_choices, never a crash
        (200, '{"choices":[{"message":{"content":"x"},"finish_reason":5}]}', "retry", "bad_choices"),
        (200, '{"choices":[{"message":{"content":"x"},"finish_reason":["stop"]}]}', "retry", "bad_choices"),
        (200, '{"choices":[{"message":{"content":"x"},"finish_reason":{"a":1}}]}', "retry", "bad_choices"),
        (200, '{"choices":[{"message":{"content":"x"},"finish_reason":true}]}', "retry", "bad_choices"),
        (200, '{"choices":[]}', "retry", "no_choices"),
        (408, "", "retry", "http_408"),
        (409, "", "retry", "http_409"),
        (425, "", "retry", "http_425"),
        (429, '{"error":{"message":"rate"}}', "rate_limited", "http_429"),
        (500, "oops", "retry", "http_500"),
        (503, "", "retry", "http_503"),
        (400, '{"error":{"message":"bad model"}}', "fail", "http_400"),
        (401, '{"error":{"message":"no auth"}}', "fail", "http_401"),
        (403, '{"error":{"message":"moderated"}}', "fail", "http_403"),
        (402, '{"error":{"message":"Insufficient credits"}}', "payment", "http_402"),
        (404, '{"error":{"message":"No endpoints found matching your data policy"}}', "unavailable", "no_endpoints"),
        (404, '{"error":{"message":"not here"}}', "fail", "http_404"),
    ],
)
def test_classify_table(status, body, kind, cls):
    out, _ = classify_response(status, {}, body.encode())
    assert (out.kind, out.error_class) == (kind, cls)


def test_classify_messages_and_retry_after():
    out, _ = classify_response(429, {"Retry-After": "7"}, b'{"error":{"message":"slow down"}}')
    assert out.retry_after == 7.0 and out.message == "slow down"
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def _events(raw: bytes, step: int):
    dec = SSEDecoder()
    out = []
    for i in range(0, len(raw), step):
        out += list(dec.feed(raw[i : i + step]))
    out += list(dec.close())
    return [e.data for e in out], dec.comments


def test_sse_decoder_any_split_crlf_comments_multiline():
    raw = (
        ": OPENROUTER PROCESSING\r\n\r\n"
        'data: {"a": "é"}\r\n\r\n'
        "data: line1\ndata: line2\n\n"
        "event: x\r"
        "data:nospace\r\r"
        ": OPENROUTER PROCESSING\n\n"
        "data: [DONE]"  # no trailing blank line: still delivered at close
    ).encode()
    expected = ['{"a": "é"}', "line1\nline2", "nospace", "[DONE]"]
    for step in range(1, 12):
        data, comments = _events(raw, step)
        assert data == expected, step
        assert comments == ["OPENROUTER PROCESSING", "OPENROUTER PROCESSING"]


def test_sse_decoder_drops_one_leading_byte_order_mark_however_the_bytes_are_split():
    """A stream that began with a BOM lost its first event (its field read "\ufeffdata"), and
    the answer was stored without its first text, as done. Only the stream's first character
    is dropped so: a BOM further on is text."""
    raw = "\ufeffdata: first\n\ndata: \ufeffsecond\n\n\ufeffdata: third\n\n".encode()
    for step in range(1, 8):
        data, _ = _events(raw, step)
        assert data == ["first", "\ufeffsecond"], step  # "\ufeffdata" is no field: that line is ignored
    assert _events("\ufeff\ufeffdata: x\n\n".encode(), 1)[0] == []  # one BOM dropped, not two


def _chunk(delta=None, finish=None, **extra):
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    choice.update(extra.pop("choice_extra", {}))
    return {"id": "gen-1", "object": "chat.completion.chunk", "created": 5, "model": "m", "provider": "p",
            "choices": [choice], **extra}


def test_stream_assembler_builds_the_non_streamed_shape():
    asm = StreamAssembler()
    asm.add(_chunk({"role": "assistant", "content": "", "reasoning": "Let me "}, choice_extra={"token_ids": [1, 2]},
                   prompt_token_ids=[9, 9]))
    asm.add(_chunk({"content": "", "reasoning": "think."}, choice_extra={"token_ids": [3]}))
    asm.add(_chunk({"content": "Hel", "reasoning_details": [{"type": "reasoning.text", "text": "a", "index": 0}]}))
    asm.add(_chunk({"content": "lo", "reasoning_details": [{"type": "reasoning.text", "text": "b", "index": 0}]}))
    asm.add(_chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                    "function": {"name": "f", "arguments": ""}}]}))
    asm.add(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}))
    asm.add(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}))
    asm.add(_chunk({}, "tool_calls", choice_extra={"native_finish_reason": "tool_calls", "token_ids": [4]},
                   usage={"prompt_tokens": 2, "completion_tokens": 4, "cost": 0.5}))
    assert asm.finished and not asm.errors
    assert asm.result() == {
        "id": "gen-1",
        "object": "chat.completion",
        "created": 5,
        "model": "m",
        "provider": "p",
        "prompt_token_ids": [9, 9],
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hello",
                    "reasoning": "Let me think.",
                    "tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                    "function": {"name": "f", "arguments": '{"x":1}'}}],
                    "reasoning_details": [{"type": "reasoning.text", "text": "ab", "index": 0}],
                },
                "finish_reason": "tool_calls",
                "token_ids": [1, 2, 3, 4],
                "native_finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 4, "cost": 0.5},
    }


@pytest.mark.parametrize("before", [None, ""])
def test_an_empty_finish_reason_in_a_stream_is_no_finish_and_undoes_none(before):
    """Servers that send ``finish_reason: ""`` in every chunk but the finishing one: a ""
    after the finish (a usage chunk) no longer replaces it, and a stream whose last word is
    "" is not finished (the gate rejects it as it rejects null)."""
    asm = StreamAssembler()
    asm.add(_chunk({"role": "assistant", "content": "Hi"}, before, choice_extra={"native_finish_reason": before}))
    asm.add(_chunk({"content": "."}, "stop", choice_extra={"native_finish_reason": "stop"}))
    asm.add(_chunk({}, "", choice_extra={"native_finish_reason": ""}, usage={"prompt_tokens": 2, "completion_tokens": 2}))
    assert asm.finished
    choice = asm.result()["choices"][0]
    assert (choice["finish_reason"], choice["native_finish_reason"]) == ("stop", "stop")
    cut = StreamAssembler()
    cut.add(_chunk({"role": "assistant", "content": "Hi"}, ""))
    assert not cut.finished and cut.result()["choices"][0]["finish_reason"] == ""


def test_stream_assembler_sees_errors_and_truncation():
    asm = StreamAssembler()
    asm.add(_chunk({"content": "par"}))
    assert not asm.finished  # cut short: no finish_reason
    asm.add(_chunk({"content": ""}, "error", error={"code": 502, "message": "mid-stream"}))
    assert asm.errors == [{"code": 502, "message": "mid-stream"}]


def test_stream_events_of_another_type_are_no_chunks():
    """An ``event: error`` is the server's error (it was folded into the answer's top level,
    the answer stored as done); a ping of another type is passed over; one of another type
    that carries choices refuses the stream rather than lose its text."""
    def folded(*events: SSEEvent) -> StreamAssembler:
        asm = StreamAssembler(key="sk-secret-key-0123456789")
        for e in events:
            asm.add_event(e)
        return asm

    hello = SSEEvent(json.dumps(_chunk({"role": "assistant", "content": "Hello"})))
    asm = folded(hello, SSEEvent('{"message": "overloaded", "code": 529}', "error"), SSEEvent("[DONE]"))
    assert asm.errors == [{"message": "overloaded", "code": 529}] and "message" not in asm.top
    assert folded(hello, SSEEvent('{"error": {"code": 502}}', "error")).errors == [{"code": 502}]
    assert folded(SSEEvent("upstream sk-secret-key-0123456789 died", "error")).errors == [
        {"message": "upstream *** died"}]
    asm = folded(SSEEvent('{"type": "ping"}', "ping"), hello, SSEEvent("not json", "ping"))
    assert asm.errors == [] and asm.result()["choices"][0]["message"]["content"] == "Hello"
    with pytest.raises(StreamError, match="an event of type 'delta' carries choices"):
        folded(SSEEvent(hello.data, "delta"))
    asm = folded(hello, SSEEvent('{"choices": [], "usage": {"prompt_tokens": 2, "cost": 0.5}}', "usage"))
    assert asm.top["usage"] == {"prompt_tokens": 2, "cost": 0.5}  # what the answer cost, whatever the event's name
    assert folded(SSEEvent('{"error": {"code": 500}}', "status")).errors == [{"code": 500}]


def test_a_key_held_in_overlapping_pieces_is_counted_whole():
    """Pieces of 9-15 characters counted only their first 8 (matches did not overlap): 48 of
    73 characters in 12-character pieces passed as under half."""
    from tokenbridge.generate.secrets import scattered_key

    import hashlib

    key = "sk-or-v1-" + hashlib.sha256(b"scattered").hexdigest()  # 73 characters, as OpenRouter's
    def held(size: int, upto: int) -> bytes:
        return b"".join(b": " + key[i:min(i + size, upto)].encode() + b"\n\n" for i in range(0, upto, size))
    assert scattered_key(held(12, 48), key) and scattered_key(held(15, 45), key)
    assert not scattered_key(held(12, 36), key)  # under half the key


def _windows_masked(data: bytes, key: str) -> tuple[bool, bytes]:
    """The plain reading of the scattered-key rule, window by window: every 8-byte window of
    ``data`` equal to one of the key's, either case; held when they cover half the key."""
    raw = key.encode().lower()
    grams = {raw[i:i + 8] for i in range(len(raw) - 7)}
    hits = [i for i in range(len(data) - 7) if data[i:i + 8].lower() in grams]
    covered = {j for i in range(len(raw) - 7) if raw[i:i + 8] in {data[h:h + 8].lower() for h in hits}
               for j in range(i, i + 8)}
    if 2 * len(covered) < len(raw):
        return False, data
    masked = bytearray(len(data))
    for h in hits:
        masked[h:h + 8] = b"\1" * 8
    out, i = b"", 0
    while i < len(data):
        if masked[i]:
            while i < len(data) and masked[i]:
                i += 1
            out += b"***"
        else:
            out, i = out + data[i:i + 1], i + 1
    return True, out


@settings(max_examples=400, deadline=None)
@given(key=st.one_of(st.text("0123456789abcdef", min_size=24, max_size=64).map(lambda h: "sk-or-v1-" + h),
                     st.text(string.ascii_letters + string.digits + "-_", min_size=16, max_size=60),
                     # what a character class must escape, and non-ASCII (never masked in pieces: one may split a character)
                     st.text(string.ascii_letters + "]^-\\[.*+?(){}|$ \0\né中", min_size=16, max_size=40)),
       cuts=st.lists(st.tuples(st.sampled_from([1, 7, 8, 9, 12]), st.booleans(), st.booleans(),
                               st.sampled_from([b"", b" ", b"\n: "]),
                               st.one_of(st.just(b""), st.binary(max_size=6), st.sampled_from([b"the ", b"DEADBEEF"]))),
                     max_size=16))
def test_key_pieces_are_found_as_every_window_would_find_them(key, cuts):
    """The key's pieces are looked for only in runs of its own characters (a regex over each of
    its ~60 pieces at every offset cost 8-20 ms on a 32 kB answer): held against reading
    every 8-byte window. The data is the key cut in pieces, some left out, some upper-cased,
    with separators and other bytes between them, so it holds more or less than half."""
    from tokenbridge.generate.secrets import mask_scattered, scattered_key

    parts, at = [], 0
    for size, keep, upper, sep, noise in cuts:
        piece = key[at:at + size]
        at = at + size if at + size < len(key) else 0
        parts += [noise, sep, (piece.upper() if upper else piece).encode() if keep else b""]
    data = b"".join(parts)
    held, masked = _windows_masked(data, key)
    assert scattered_key(data, key) == held
    assert mask_scattered(data, key) == (masked if key.isascii() else data)


def test_cost_and_budget_reservations():
    prices = Prices(prompt=1.0, completion=2.0)
    assert cost_of({"cost": 0.25, "prompt_tokens": 10}, prices) == 0.25
    assert cost_of({"prompt_tokens": 1_000_000, "completion_tokens": 500_000}, prices) == 2.0
    assert cost_of({"prompt_tokens": 1}, None) is None
    # counts absent are unknown, not zero: usage {} was booked at $0 and --max-cost never stopped the run
    for usage in ({}, {"total_tokens": 15}, {"prompt_tokens": 10}, {"completion_tokens": 10},
                  {"prompt_tokens": 10, "completion_tokens": None}):
        assert cost_of(usage, prices) is None, usage
    assert cost_of({"prompt_tokens": 10, "completion_tokens": 0}, prices) == pytest.approx(1e-5)

    b = Budget(max_cost=1.0, prices=prices)  # each request reserves 0.3 (100k prompt + 100k completion)
    r = [b.admit(100_000, 100_000) for _ in range(4)]
    assert r[:3] == [pytest.approx(0.3)] * 3 and r[3] is None and not b.exhausted  # waits: 0.9 reserved
    b.settle(r[0], 0.05)
    assert b.spent == pytest.approx(0.05) and b.reserved == pytest.approx(0.6)
    assert b.admit(100_000, 100_000) == pytest.approx(0.3)  # 0.05 + 0.6 + 0.3 <= 1.0
    assert b.admit(100_000, 100_000) is None  # 0.05 + 0.9 + 0.3 > 1.0


def test_budget_never_crosses_the_cap():
    b = Budget(max_cost=1.0, prices=Prices(prompt=0.0, completion=1.0))
    sent = []
    while True:
        r = b.admit(0, 300_000)  # 0.3 worst case each
        if r is None:
            if b.exhausted:
                break
            b.settle(sent.pop(0), 0.3)  # the worst case happens every time
            continue
        sent.append(r)
        assert b.spent + b.reserved <= 1.0 + 1e-9
    for r in sent:
        b.settle(r, 0.3)
    assert b.spent <= 1.0 + 1e-9 and b.exhausted


def test_budget_without_prices_learns_prompt_and_completion_prices_apart():
    # true prices: $0.6/Mtok prompt, $2.5/Mtok completion
    def price(p, c):
        return p * 0.6e-6 + c * 2.5e-6

    b = Budget(max_cost=1.0, prices=None)
    first = b.admit(100, 4000)
    assert first == 0.0 and b.admit(100, 4000) is None and not b.exhausted  # one at a time until priced
    b.settle(first, price(2000, 10), prompt_tokens=2000, completion_tokens=10, provider="p")  # prompt-heavy
    # one response: its whole cost may be completion price: 4000 x cost/10 (not the blended rate,
    # which would reserve (100 + 4000) x cost/2010 = $0.0025 for a request that can cost $0.01006)
    worst, exact = b.reservation(100, 4000)
    assert worst == pytest.approx(price(2000, 10) * 4000 / 10) and not exact
    assert worst >= price(100, 4000)
    r = b.admit(100, 4000)
    b.settle(r, price(10, 4000), prompt_tokens=10, completion_tokens=4000, provider="p")
    # two responses with different ratios bracket the request: the exact price, two unknowns
    worst, exact = b.reservation(100, 4000)
    assert exact and worst == pytest.approx(price(100, 4000))
    # outside the bracket the bound stays above the truth
    for p, c in ((5000, 1), (1, 100_000), (0, 10), (10, 0)):
        assert b.reservation(p, c)[0] >= price(p, c) - 1e-15
    # a second provider is priced on its own and the dearer one wins
    b.observe("dear", 1000, 1000, 10 * price(1000, 1000))
    assert b.reservation(100, 4000)[0] >= 10 * price(100, 4000) * 0.999

    b2 = Budget(max_cost=1.0, prices=None)
    b2.settle(b2.admit(1, 1), None, possible=True, answered=True)  # an answer without cost: cap cannot be kept
    assert b2.unpriced and b2.exhausted


def test_budget_without_prices_passes_the_cap_by_at_most_one_request():
    def price(p, c):
        return p * 0.6e-6 + c * 2.5e-6

    for order in ([(2000, 10)] + [(10, 4000)] * 50, [(10, 4000)] * 50, [(3000, 5), (2500, 8)] + [(10, 4000)] * 50):
        b = Budget(max_cost=0.05, prices=None)
        queue = list(order)
        flight: list[tuple[float, tuple[int, int]]] = []
        while queue or flight:
            r = b.admit(3000, 4000) if queue else None  # every request: <= 3000 prompt, max_tokens 4000
            if r is not None:
                flight.append((r, queue.pop(0)))
                continue
            if not flight:
                break
            res, (p, c) = flight.pop(0)
            b.settle(res, price(p, c), prompt_tokens=p, completion_tokens=c, provider="p")
        assert b.spent <= 0.05 + price(3000, 4000) + 1e-12, order
        assert b.exhausted or not queue


def test_budget_books_possible_charges_against_the_cap():
    b = Budget(max_cost=1.0, prices=Prices(prompt=0.0, completion=1.0))
    r = b.admit(0, 300_000)  # worst case $0.30
    assert b.settle(r, None, possible=True) == pytest.approx(0.3)  # a timeout: maybe billed
    assert b.possible == pytest.approx(0.3) and b.spent == 0.0
    r = b.admit(0, 300_000)
    assert b.settle(r, 0.0) is None  # an HTTP error reply: not billed
    assert [b.admit(0, 300_000) is not None for _ in range(3)] == [True, True, False]  # 0.3 + 0.6 booked/reserved


def test_the_budget_stop_message_shows_small_caps_and_says_when_one_request_alone_exceeds_it():
    """A $0.0005 cap was printed "$0.00", and nothing said that one request's worst case
    (no max_tokens: 32,768 tokens reserved) was above it, so no run under it could send."""
    from tokenbridge.generate.budget import usd

    assert [usd(x) for x in (400.0, 123.456, 0.9999, 0.5, 0.0005, 0.000123, 0.0, 1e-12)] == [
        "$400.00", "$123.46", "$0.9999", "$0.50", "$0.0005", "$0.000123", "$0.00", "$1.00e-12"]
    b = Budget(0.0005, Prices(prompt=1.0, completion=2.0))
    assert b.admit(100, 32_768) is None and b.exhausted
    assert b.stop_message(100, 32_768, default_reserve=True) == (
        "budget $0.0005 reached (spent $0.00; the next request's worst case, $0.06564, does not fit); one request's "
        "worst case alone is above the cap (no max_tokens, so 32,768 completion tokens are reserved for each: set "
        "max_tokens (--max-tokens) or raise --max-cost)")
    b = Budget(1.0, Prices(prompt=1.0, completion=2.0), spent=0.9999, possible=0.00005)
    assert b.stop_message(10, 40, default_reserve=False) == (
        "budget $1.00 reached (spent $0.9999 + $0.00005 possibly billed; the next request's worst case, $0.00009, "
        "does not fit)")


def test_settings_refuse_bad_base_urls_and_credential_headers(tmp_path):
    from tokenbridge.generate.settings import ConfigError, GenerateSettings, endpoint_identity, load_config

    for url, why in (("openrouter.ai/api/v1", "needs http:// or https://"),
                     ("https://user:pw@openrouter.ai/api/v1", "user info"),
                     ("https://openrouter.ai/api/v1?key=x", "query"),
                     ("ftp://host/v1", "needs http://")):
        with pytest.raises(ConfigError, match=why):
            GenerateSettings(base_url=url)
        with pytest.raises(ConfigError, match=why):
            GenerateSettings().with_overrides(base_url=url)
    for name in ("Authorization", "proxy-authorization", "X-Api-Key", "Api-Key", "Cookie", "X-Auth-Token"):
        with pytest.raises(ConfigError, match="look like credentials"):
            GenerateSettings(headers={name: "v"})
        with pytest.raises(ConfigError, match="look like credentials"):
            GenerateSettings().with_overrides(headers={name: "v"})
    cfg = tmp_path / "g.toml"
    cfg.write_text('model = "m"\n[headers]\nX-Title = "ok"\nx-api-key = "sk-1"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"g.toml:2: headers: header\(s\) \['x-api-key'\] look like credentials"):
        load_config(cfg)
    assert GenerateSettings(headers={"HTTP-Referer": "https://x", "X-Title": "t"}).headers["X-Title"] == "t"
    # resume identity: loopback ports are ephemeral (the emulator), anything else must match
    assert endpoint_identity("http://127.0.0.1:5001/api/v1") == endpoint_identity("http://localhost:6002/api/v1/")
    assert endpoint_identity("https://openrouter.ai/api/v1") == endpoint_identity("https://OpenRouter.ai:443/api/v1")
    assert endpoint_identity("http://127.0.0.1:5001/api/v1") != endpoint_identity("https://openrouter.ai/api/v1")


def test_store_appends_attempts_and_counts_every_billed_one(tmp_path):
    from tokenbridge.generate.store import AttemptRecord, Batch, Store

    with Store.open(tmp_path) as store:
        store.add_samples([("b-1", "b", "", "{}")])
        store.commit(Batch(attempts=[AttemptRecord("b-1", 1, 1.0, 0.1, 200, None, "", 0.25)]))
        # a second writer numbering its attempt 1 again: appended as 2, its cost kept
        store.commit(Batch(attempts=[AttemptRecord("b-1", 1, 2.0, 0.1, 200, None, "", 0.5),
                                     AttemptRecord("b-1", 1, 3.0, 9.0, None, "timeout", "t", None, possible_cost=0.125)]))
        assert [(a.n, a.cost, a.possible_cost) for a in store.attempts("b-1")] == [
            (1, 0.25, None), (2, 0.5, None), (3, None, 0.125)]
        assert store.total_cost() == pytest.approx(0.75) and store.possible_cost() == pytest.approx(0.125)


def test_api_key_scrubbing(monkeypatch):
    monkeypatch.setenv("TB_TEST_KEY", "sk-or-v1-secret123")
    key = read_api_key("TB_TEST_KEY")
    assert "secret123" not in repr(key) and "secret123" not in str(key)
    assert scrub("failed with Bearer sk-or-v1-secret123!", key) == "failed with Bearer ***!"
    assert scrub_bytes(b"echo sk-or-v1-secret123", key) == b"echo ***"
    monkeypatch.delenv("TB_TEST_KEY")
    with pytest.raises(MissingApiKey, match="TB_TEST_KEY"):
        read_api_key("TB_TEST_KEY")
    assert isinstance(ApiKey("X", "v").value, str)


def test_progress_plain_when_not_a_tty_and_rich_on_request():
    import asyncio
    import io

    from tokenbridge.generate.engine import EngineStats
    from tokenbridge.generate.progress import Reporter, format_line

    stats = EngineStats(total=10, done=4, failed=1, spent=0.25, in_flight=3, limit=8.0)
    stats.errors.update({"http_429": 3, "timeout": 1})
    line = format_line(stats)
    assert line.startswith("[generate] 4/10 done, 1 failed, ")
    assert "$0.2500 spent" in line and "errors: http_429=3 timeout=1" in line and "ETA" in line
    assert Reporter("auto", out=io.StringIO()).mode == "plain"

    async def show(mode: str) -> str:
        out = io.StringIO()
        rep = Reporter(mode, out=out)
        rep.start(stats)
        await asyncio.sleep(0.3)
        await rep.close()
        return out.getvalue()

    plain = asyncio.run(show("plain"))
    assert plain.strip().splitlines()[-1] == format_line(stats)
    rich_text = asyncio.run(show("rich"))
    assert "1 failed" in rich_text and "http_429=3" in rich_text and "$0.2500" in rich_text


@pytest.mark.parametrize("version", ["1", "2"])
def test_an_older_state_file_is_upgraded_in_place(tmp_path, version):
    import sqlite3

    from tokenbridge.generate import store as store_mod
    from tokenbridge.generate.store import AttemptRecord, Batch, ResponseRecord, Store

    with Store.open(tmp_path) as store:
        store.add_samples([("b-1", "b", "", "{}")])
        store.commit(Batch(responses=[ResponseRecord("b-1", b"{}", None, "p", "m", None, 0.5, 0.1, 1.0, 2.0, 1, False)]))
    con = sqlite3.connect(tmp_path / "state.sqlite")  # what a schema 1 / 2 file looks like
    for index in store_mod._INDEXES:  # made after those versions
        con.execute(f"DROP INDEX {index}")
    if version == "1":
        con.execute("ALTER TABLE responses DROP COLUMN base_url")
        con.execute("ALTER TABLE attempts DROP COLUMN possible_cost")
    con.execute("ALTER TABLE attempts DROP COLUMN body")  # schema 3's
    con.execute("UPDATE meta SET value=? WHERE key='schema_version'", (version,))
    con.commit()
    con.close()
    with Store.open(tmp_path) as store:
        assert [m for *_, m in store.iter_done()] == [{
            "provider": "p", "model": "m", "latency_s": 0.1, "cost": 0.5, "attempts": 1, "started_at": 1.0,
            "finished_at": 2.0, "stream": False}]  # no base_url known: none written
        assert store.total_cost() == 0.5 and store.possible_cost() == 0.0
        assert store.done_base_urls(["b-1"]) == {None: (1, "b-1")}
        store.commit(Batch(attempts=[AttemptRecord("b-1", 2, 3.0, 0.1, 200, "bad_json", "m", 0.25, body=b"{x")]))
        assert [(a.cost, a.body) for a in store.attempts("b-1")] == [(0.25, b"{x")]
    con = sqlite3.connect(tmp_path / "state.sqlite")
    assert con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("3",)
    indexes = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert indexes >= set(store_mod._INDEXES)


@pytest.mark.parametrize("version", ["abc", "99", ""])
def test_a_store_of_an_unknown_or_damaged_version_is_refused_by_name(tmp_path, version):
    """A store whose schema_version is newer, or not a number at all (a damaged file), is
    a StoreError naming it; a non-number was int()'d into a ValueError (exit 8)."""
    import sqlite3

    from tokenbridge.generate.store import Store, StoreError

    Store.open(tmp_path).close()
    con = sqlite3.connect(tmp_path / "state.sqlite")
    con.execute("UPDATE meta SET value=? WHERE key='schema_version'", (version,))
    con.commit()
    con.close()
    with pytest.raises(StoreError, match=f"schema version '{version}', this tokenbridge reads 3"):
        Store.open(tmp_path)


def test_config_tokenizer_path_is_relative_to_the_config_file(tmp_path, kimi_dir):
    from tokenbridge.generate import settings_from_mapping

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "tok").symlink_to(kimi_dir)
    s = settings_from_mapping({"model": "m", "tokenizer": "tok"}, base_dir=tmp_path / "cfg")
    assert s.tokenizer == str((tmp_path / "cfg" / "tok").resolve())
    # a Hub id (no such path beside the config) is left alone
    assert settings_from_mapping({"model": "m", "tokenizer": "moonshotai/Kimi-K2.5"}, base_dir=tmp_path).tokenizer == "moonshotai/Kimi-K2.5"


def test_run_sentence_names_failures_pending_bad_rows_and_the_stop():
    from tokenbridge.generate.outcome import describe_run
    from tokenbridge.generate.run import RunSummary

    s = RunSummary(out_dir="r", run=2, samples=10, already_done=4, done=3, failed=1, pending=2, requests=5,
                   spent_run=0.5, spent_total=1.25, prompt_tokens=0, completion_tokens=0, elapsed_s=1.0, errors={},
                   stop_reason="budget", exit_code=4, bad_rows=["x"])
    assert describe_run(s) == ("10 samples: 4 already done, 3 done now, 1 failed, 2 not sent yet; 5 requests, "
                               "$0.5000 this run, $1.2500 in all; 1 bad prompt row skipped; stopped (budget).")


def test_dry_run_without_a_tokenizer_counts_the_rendered_prompt(tmp_path):
    """No tokenizer: characters / 4 of the prompt as the chat template renders it, not of the JSON."""
    from tokenbridge.chat import DIALECTS
    from tokenbridge.generate import GenerateSettings, dry_run
    from tokenbridge.generate.prompts import load_prompts
    from tokenbridge.generate.settings import DatasetSpec

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": "word " * (3 * i + 1), "system": "Be terse."}) + "\n"
                            for i in range(5)))
    request = RequestSettings(model="m", reasoning={"enabled": False})
    settings = GenerateSettings(datasets=(DatasetSpec("d", path),), request=request)
    report = dry_run(settings)
    rendered = [DIALECTS["kimi-k2.5"].render_request(build_request(s, request))
                for s in load_prompts(settings.datasets).samples]
    assert all(r.endswith("<|im_assistant|>assistant<|im_middle|><think></think>") for r in rendered)
    assert report.prompt_tokens == sum(len(r) // 4 for r in rendered) and report.approximate
    assert report.notes[0] == "no --tokenizer: prompt tokens are approximate (characters of the kimi-k2.5-rendered prompt / 4)"


def _dry_run_dataset(tmp_path):
    from tokenbridge.generate.settings import DatasetSpec

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Question {i}?"}) + "\n" for i in range(3)))
    return DatasetSpec("d", path)


def test_dry_run_reports_a_prompt_the_dialect_cannot_render(tmp_path):
    """A render failure on the data is a reported bad row per prompt, not a crash."""
    from tokenbridge.generate import GenerateSettings, dry_run

    settings = GenerateSettings(datasets=(_dry_run_dataset(tmp_path),), request=RequestSettings(model="m"),
                                dialect="deepseek-v3.1")  # renders only with a folder's template
    report = dry_run(settings)
    assert report.to_send == 0 and len(report.bad_rows) == 3
    assert report.bad_rows[0].endswith(": cannot render the prompt: TemplateError: "
                                       "the deepseek-v3.1 dialect renders only with its folder's chat template")


def test_dry_run_does_not_hide_a_bug_as_a_bad_row(tmp_path, monkeypatch):
    from tokenbridge.chat import DIALECTS
    from tokenbridge.generate import GenerateSettings, dry_run

    def broken(self, request):
        raise RuntimeError("a bug in render_request")

    monkeypatch.setattr(type(DIALECTS["kimi-k2.5"]), "render_request", broken)
    settings = GenerateSettings(datasets=(_dry_run_dataset(tmp_path),), request=RequestSettings(model="m"))
    with pytest.raises(RuntimeError, match="a bug in render_request"):
        dry_run(settings)


@pytest.mark.parametrize("mode", ["plain", "rich"])
def test_progress_shows_no_0_of_0_bar_when_nothing_is_left_to_send(mode):
    import asyncio
    import io

    from tokenbridge.generate.engine import EngineStats
    from tokenbridge.generate.progress import Reporter

    async def show() -> str:
        out = io.StringIO()
        rep = Reporter(mode, out=out, interval_s=0.0)
        rep.start(EngineStats(total=0))
        await asyncio.sleep(0.05)
        await rep.close()
        return out.getvalue()

    assert asyncio.run(show()) == ""


@pytest.mark.parametrize(("native", "kind"), [("abort", "retry"), ("ERROR", "retry"), ("content_filter", "ok"),
                                               ("stop", "ok"), (None, "ok")])
def test_a_choice_its_upstream_gave_up_on_is_sent_again(native, kind):
    """``finish_reason: stop`` with ``native_finish_reason: abort``: the gate rejects it
    (``finish_error``), so keeping it was money lost; it is retried as a choice error. A
    content filter is kept (and rejected): it would refuse the same request again, billed."""
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Half an ans"}}
    if native is not None:
        choice["native_finish_reason"] = native
    out, parsed = classify_response(200, {}, json.dumps({"choices": [choice], "usage": {"cost": 0.01}}).encode())
    assert out.kind == kind and parsed["usage"] == {"cost": 0.01}
    if kind == "retry":
        assert out.error_class == "choice_error" and out.maybe_billed
        assert out.message == f"choice finished with native_finish_reason {native.lower()!r}"


def test_a_usage_that_says_cost_twice_is_booked_at_the_dearer_reading():
    """A cold tester's: ``"cost": 5.0, "cost": 0.001`` is refused as ambiguous (bad_json, sent
    again) yet was booked at the last, cheaper value on every attempt, so --max-cost never
    stopped a run the provider billed 5000x more for. The lenient read keeps the highest."""
    body = (b'{"id":"g","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":'
            b'{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,'
            b'"completion_tokens":2,"cost":5.0,"cost":0.001,"completion_tokens":1}}')
    outcome, parsed = classify_response(200, {"Content-Type": "application/json"}, body)
    assert (outcome.kind, outcome.error_class, outcome.maybe_billed) == ("retry", "bad_json", True)
    assert parsed is not None and parsed["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "cost": 5.0}


@pytest.mark.parametrize(("usage", "cost"), [
    ('"usage":{"cost":5.0},"usage":{"cost":0.001}', 5.0),  # the whole object twice (a cold reviewer's)
    ('"usage":{"cost":5.0,"cost":null}', 5.0),
    ('"usage":{"cost":5.0,"cost":"0.001"}', 5.0),
    ('"usage":{"cost":NaN,"cost":5.0}', 5.0),
    ('"usage":{"cost":0,"is_byok":true,"cost_details":{"upstream_inference_cost":0.02},'
     '"cost_details":{"upstream_inference_cost":0.0001}}', 0.02),
    # a second reviewer's: the BYOK flag repeated false or null, an object then a null
    ('"usage":{"cost":0.01,"is_byok":true,"is_byok":false,"cost_details":{"upstream_inference_cost":2.0}}', 2.01),
    ('"usage":{"cost":0.01,"is_byok":true,"cost_details":{"upstream_inference_cost":2.0}},"usage":{"cost":0.01}', 2.01),
    ('"usage":{"cost":0.5},"usage":null', 0.5),
])
def test_every_repeated_reading_of_a_usage_keeps_the_dearer(usage, cost):
    body = ('{"id":"g","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":'
            '{"role":"assistant","content":"hi"},"finish_reason":"stop"}],' + usage + "}").encode()
    outcome, parsed = classify_response(200, {"Content-Type": "application/json"}, body)
    assert outcome.error_class == "bad_json" and parsed is not None
    assert cost_of(parsed["usage"], None) == pytest.approx(cost)


def test_a_body_too_deep_for_the_stdlib_with_a_repeated_cost_has_no_known_cost():
    """orjson reads what json.loads cannot (about 1000 levels) but keeps a repeated key's last
    reading: the cheaper cost was booked. Such a body's usage is now unknown (booked at its
    reservation, or it stops a capped run with nothing priced)."""
    deep = '"x":' + "[" * 990 + "]" * 990
    body = ('{"id":"g","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":'
            '{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"cost":5.0,"cost":0.001},'
            + deep + "}").encode()
    outcome, parsed = classify_response(200, {"Content-Type": "application/json"}, body)
    assert (outcome.error_class, outcome.maybe_billed, parsed) == ("bad_json", True, None)


@pytest.mark.parametrize("status", [429, 500, 502])
def test_an_error_body_that_repeats_its_cost_is_booked_at_the_dearer_reading(status):
    body = b'{"error":{"message":"upstream failed"},"usage":{"prompt_tokens":5,"cost":0.5,"cost":0}}'
    outcome, parsed = classify_response(status, {"Content-Type": "application/json"}, body)
    assert outcome.error_class is not None and parsed is not None
    assert cost_of(parsed["usage"], None) == pytest.approx(0.5)

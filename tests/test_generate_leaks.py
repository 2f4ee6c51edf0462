"""The key where a plain search misses it: in the base URL's path, a UTF-16 body, a gzip body."""

from __future__ import annotations

import asyncio
import gzip
import json
import sqlite3
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from typer.testing import CliRunner

from conftest import write_prompts
from tokenbridge.cli import app
from tokenbridge.generate import GenerateSettings, RequestSettings, SettingsChanged, agenerate_run
from tokenbridge.generate.secrets import ApiKey, compressed_key
from tokenbridge.generate.settings import DatasetSpec

SECRET = "sk-or-v1-" + "0123456789abcdef" * 4
KEY = ApiKey("TB_LEAK", SECRET)
Reply = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _ok(_: web.Request | None = None) -> web.Response:
    return web.json_response({
        "id": "gen-l", "object": "chat.completion", "created": 1, "model": "m", "provider": "p",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.0001}})


async def _answer_ok(request: web.Request) -> web.StreamResponse:
    return _ok(request)


def _run(tmp_path: Path, n: int, reply: Reply, path: str = "/api/v1", *, runs: tuple[str, ...] | None = None,
         key: ApiKey = KEY, **kw):
    """A generate run against a server answering every path by ``reply``; one run per path
    in ``runs`` when given (the same folder: a resume), each result (or exception) in order."""
    paths = runs or (path,)

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        return await reply(request)

    async def main() -> list[object]:
        app_ = web.Application()
        app_.router.add_route("POST", "/{tail:.*}", handle)
        runner = web.AppRunner(app_, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        root = f"http://127.0.0.1:{runner.addresses[0][1]}"
        out: list[object] = []
        try:
            for p in paths:
                settings = dict(datasets=(DatasetSpec("l", write_prompts(tmp_path, n)),), base_url=root + p,
                                request=RequestSettings(model="m", max_tokens=16), max_attempts=1, progress="none",
                                timeout_s=10.0)
                settings.update(kw)
                try:
                    out.append(await agenerate_run(GenerateSettings(**settings), tmp_path / "run", key=key))
                except SettingsChanged as exc:
                    out.append(exc)
        finally:
            await runner.cleanup()
        return [root, *out]

    return asyncio.run(main())


def _every_stored_byte(run: Path) -> bytes:
    """Every file of the run folder, and every zlib blob in its store, as one haystack."""
    data = b"".join(f.read_bytes() for f in sorted(run.rglob("*")) if f.is_file())
    con = sqlite3.connect(run / "state.sqlite")
    for table, col in (("attempts", "body"), ("responses", "raw_stream")):
        data += b"".join(zlib.decompress(b) for (b,) in con.execute(f"SELECT {col} FROM {table} WHERE {col} IS NOT NULL"))
    return data


def _leaks(data: bytes) -> list[str]:
    """Each byte spelling of a 16-character piece of the key found in ``data`` (test oracle)."""
    piece = SECRET[9:25]
    spellings = ["utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"]
    return [codec for codec in spellings if piece.encode(codec) in data]


# --- the key in a body sent in a wide charset ---------------------------------------------


@pytest.mark.parametrize(("codec", "declared"), [("utf-16", "utf-16"), ("utf-16-be", "utf-16be"),
                                                 ("utf-32", "utf-32"), ("utf-16", None), ("utf-16-le", None)])
def test_a_utf16_error_body_quoting_the_key_is_masked_everywhere_it_goes(tmp_path, capsys, codec, declared):
    """A 400 sent as UTF-16 that quotes the Authorization header: read as UTF-8 its text put a
    NUL beside each of the key's characters, and the key reached the terminal, generate.json,
    samples.error and attempts.message. Decoded by its charset (declared, or by its BOM or its
    NULs), it reads as text and is masked as text."""
    async def reply(request: web.Request) -> web.StreamResponse:
        body = json.dumps({"error": {"code": 400, "message": "bad key " + request.headers["Authorization"]}})
        ctype = "application/json" + (f"; charset={declared}" if declared else "")
        return web.Response(status=400, body=body.encode(codec), headers={"Content-Type": ctype})

    _, summary = _run(tmp_path, 1, reply)
    assert summary.failures == [{"id": "l-0", "error_class": "http_400", "error": "bad key Bearer ***"}]
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    assert con.execute("SELECT error FROM samples").fetchall() == [("bad key Bearer ***",)]
    assert con.execute("SELECT message FROM attempts").fetchall() == [("bad key Bearer ***",)]
    assert _leaks(_every_stored_byte(tmp_path / "run")) == []
    out = capsys.readouterr()
    assert _leaks((out.out + out.err).encode("utf-8", "surrogatepass")) == []


def test_a_paid_utf16_answer_is_read_for_its_usage_and_kept_masked_in_its_attempt_row(tmp_path):
    """A 200 sent as UTF-16 is not kept (not UTF-8), but it was billed: its usage is read by
    its charset, and its bytes stay in the attempt row with the key masked in UTF-16."""
    async def reply(request: web.Request) -> web.StreamResponse:
        doc = json.loads(_ok().text)
        doc["choices"][0]["message"]["content"] = "echo " + request.headers["Authorization"]
        return web.Response(body=json.dumps(doc).encode("utf-16"),
                            headers={"Content-Type": "application/json; charset=utf-16"})

    _, summary = _run(tmp_path, 1, reply)
    assert summary.failed == 1 and summary.spent_total == pytest.approx(0.0001)
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    (body,) = con.execute("SELECT body FROM attempts").fetchone()
    stored = json.loads(zlib.decompress(body).decode("utf-16"))
    assert stored["choices"][0]["message"]["content"] == "echo Bearer ***"
    assert _leaks(_every_stored_byte(tmp_path / "run")) == []


# --- the key in a gzip body sent without Content-Encoding --------------------------------


def _gzip_reply(echo_key: bool) -> Reply:
    async def reply(request: web.Request) -> web.StreamResponse:
        text = json.dumps({"error": "x", "echo": request.headers["Authorization"] if echo_key else "nothing"})
        return web.Response(body=gzip.compress(text.encode(), mtime=0), headers={"Content-Type": "application/json"})
    return reply


def test_a_gzip_body_that_holds_the_key_is_not_kept_in_its_attempt_row(tmp_path):
    """Stored as received, the bytes kept the key compressed, where no spelling shows it. A
    body that holds it is not kept: the attempt row says why instead, as for a stream."""
    size = len(gzip.compress(json.dumps({"error": "x", "echo": f"Bearer {SECRET}"}).encode(), mtime=0))
    _, summary = _run(tmp_path, 1, _gzip_reply(echo_key=True))
    note = "is gzip that holds the API key"
    assert summary.failures[0]["error"] == (f"gave up after 1 attempts: response is gzip-compressed but says no "
                                            f"Content-Encoding ({size} bytes) (its body {note}: not kept)")
    assert f"a paid answer that was not kept {note}: its bytes are not kept in its attempt row" in summary.notices
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    assert con.execute("SELECT body FROM attempts").fetchall() == [(None,)]


def test_a_gzip_body_without_the_key_is_kept_as_received(tmp_path):
    sent = gzip.compress(json.dumps({"error": "x", "echo": "nothing"}).encode(), mtime=0)
    _, summary = _run(tmp_path, 1, _gzip_reply(echo_key=False))
    assert summary.failures[0]["error"] == ("gave up after 1 attempts: response is gzip-compressed but says no "
                                            f"Content-Encoding ({len(sent)} bytes)")
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    assert [zlib.decompress(b) for (b,) in con.execute("SELECT body FROM attempts")] == [sent]


def test_compressed_key_looks_inside_gzip_within_the_limit():
    holds = "is gzip that holds the API key"
    inner = f'{{"echo": "{SECRET}"}}'.encode()
    assert compressed_key(gzip.compress(inner), SECRET, limit=1000) == holds
    assert compressed_key(gzip.compress(gzip.compress(inner)), SECRET, limit=1000) == holds  # nested
    assert compressed_key(gzip.compress(b"ok") + gzip.compress(inner), SECRET, limit=1000) == holds  # a second member
    assert compressed_key(gzip.compress(inner.decode().encode("utf-16")), SECRET, limit=1000) == holds
    assert compressed_key(gzip.compress(b"plain"), SECRET, limit=1000) is None
    assert compressed_key(inner, SECRET, limit=1000) is None  # no gzip: scrub_bytes's business
    assert compressed_key(gzip.compress(inner), None, limit=1000) is None
    bomb = gzip.compress(b"0" * 10_000_000)
    assert compressed_key(bomb, SECRET, limit=1 << 20) == ("is gzip that does not inflate within 1048576 bytes, "
                                                           "so it cannot be checked for the API key")
    assert compressed_key(gzip.compress(inner)[:-12], SECRET, limit=1000).startswith("is gzip that does not inflate")
    deep = b"x"
    for _ in range(4):
        deep = gzip.compress(deep)
    assert compressed_key(deep, SECRET, limit=1000) is None
    assert compressed_key(gzip.compress(deep), SECRET, limit=1000) == ("is compressed more than 4 deep, so it cannot "
                                                                       "be checked for the API key")


def _raw_deflate(data: bytes) -> bytes:
    pack = zlib.compressobj(wbits=-15)
    return pack.compress(data) + pack.flush()


def test_compressed_key_looks_inside_zlib_raw_deflate_and_bzip2_too():
    """A 200 sent as zlib, raw deflate (HTTP's "deflate" coding, either way) or bzip2 without
    Content-Encoding kept the key compressed in its attempt row (a cold tester's)."""
    import bz2

    inner = f'{{"echo": "Bearer {SECRET}"}}'.encode()
    for kind, pack in (("zlib", zlib.compress), ("deflate", _raw_deflate), ("bzip2", bz2.compress)):
        assert compressed_key(pack(inner), SECRET, limit=1000) == f"is {kind} that holds the API key"
        assert compressed_key(pack(b'{"ok": 1}'), SECRET, limit=1000) is None
        assert compressed_key(gzip.compress(pack(inner)), SECRET, limit=1000) == f"is {kind} that holds the API key"
        assert compressed_key(pack(b"0" * 10_000_000), SECRET, limit=1 << 20) == (
            f"is {kind} that does not inflate within 1048576 bytes, so it cannot be checked for the API key")
        # streams one after another (pbzip2 writes bzip2 so): the second was never inflated
        assert compressed_key(pack(b'{"ok": 1}') + pack(inner), SECRET, limit=1000) == f"is {kind} that holds the API key"
        assert compressed_key(pack(b'{"ok": 1}') * 3, SECRET, limit=1000) is None
        # many tiny streams: each copied what followed it, quadratic on the event loop (a cold reviewer's)
        many = pack(bytes(range(256)) * 4) + pack(b"") * 20_000  # no UTF-8 text, so it looks compressed as a whole
        with pytest.raises(UnicodeDecodeError):
            many.decode("utf-8")
        started = time.perf_counter()
        assert compressed_key(many, SECRET, limit=64 << 20) == (
            f"is {kind} that does not inflate within {64 << 20} bytes, so it cannot be checked for the API key")
        assert time.perf_counter() - started < 2.0
    many_gzip = gzip.compress(b"") * 20_000
    assert compressed_key(many_gzip, SECRET, limit=64 << 20).startswith("is gzip that does not inflate")
    for other in (bytes(range(256)) * 20, b"\x78\x9c not zlib at all", b"BZh9 not bzip2", b"plain text"):
        assert compressed_key(other, SECRET, limit=1000) is None  # only looks compressed: kept, as received


def test_a_zlib_body_that_holds_the_key_is_not_kept_in_its_attempt_row(tmp_path):
    async def reply(request: web.Request) -> web.StreamResponse:
        text = json.dumps({"error": "x", "echo": request.headers["Authorization"]})
        return web.Response(body=zlib.compress(text.encode()), headers={"Content-Type": "application/json"})

    _, summary = _run(tmp_path, 1, reply)
    assert "a paid answer that was not kept is zlib that holds the API key: its bytes are not kept in its attempt row" \
        in summary.notices
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    assert con.execute("SELECT body FROM attempts").fetchall() == [(None,)]


# --- the key in base_url's path -----------------------------------------------------------


def test_a_key_in_the_base_urls_path_is_masked_where_the_url_is_stored(tmp_path):
    root, first, again = _run(tmp_path, 2, _answer_ok, runs=(f"/gw/{SECRET}/v1",) * 2)
    masked = f"{root}/gw/***/v1"
    assert first.done == 2
    assert not isinstance(again, SettingsChanged) and again.pending == 0  # a resume compares the URLs as stored
    rows = [json.loads(x) for x in (tmp_path / "run" / "exchanges.jsonl").read_text().splitlines()]
    assert [r["meta"]["base_url"] for r in rows] == [masked, masked]
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    assert con.execute("SELECT DISTINCT base_url FROM responses").fetchall() == [(masked,)]
    assert [json.loads(s)["base_url"] for (s,) in con.execute("SELECT settings FROM runs")] == [masked, masked]
    assert SECRET[9:25].encode() not in _every_stored_byte(tmp_path / "run")


def test_a_folder_that_stored_the_url_unmasked_resumes(tmp_path):
    root, first = _run(tmp_path, 2, _answer_ok, f"/gw/{SECRET}/v1", limit=1)
    with sqlite3.connect(tmp_path / "run" / "state.sqlite") as con:  # as versions before the mask stored it
        con.execute("UPDATE responses SET base_url=?", (f"{root}/gw/{SECRET}/v1",))
    _, again = _run(tmp_path, 2, _answer_ok, f"/gw/{SECRET}/v1")  # another port: loopback compares without it
    assert first.done == 1 and not isinstance(again, SettingsChanged) and again.done == 1 and again.pending == 0


def test_a_refused_resume_names_the_base_urls_masked(tmp_path):
    _, first, moved = _run(tmp_path, 1, _answer_ok, runs=(f"/gw/{SECRET}/v1", f"/other/{SECRET}/v1"))
    assert first.done == 1 and isinstance(moved, SettingsChanged)
    assert "1 answered by http://127.0.0.1:" in str(moved) and SECRET[9:25] not in str(moved)
    assert "/gw/***/v1 (now http://127.0.0.1:" in str(moved) and "/other/***/v1, e.g. l-0)" in str(moved)


def test_probe_json_masks_a_key_in_the_base_url(tmp_path, kimi_dir):
    out = tmp_path / "probe.json"
    res = CliRunner().invoke(app, ["probe", "--model", "m", "--providers", "a/fp8", "--base-url",
                                   f"http://127.0.0.1:9/gw/{SECRET}/v1", "--json", str(out), "--tokenizer", str(kimi_dir)],
                             env={"OPENROUTER_API_KEY": SECRET, "COLUMNS": "200"})
    assert res.exit_code == 1, res.output  # a closed port: nothing reached
    assert json.loads(out.read_text(encoding="utf-8"))["base_url"] == "http://127.0.0.1:9/gw/***/v1"
    assert SECRET[9:25] not in out.read_text(encoding="utf-8") and SECRET[9:25] not in res.output


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)


def test_a_stored_url_from_an_older_version_shows_no_key_like_segment():
    """Versions before the mask stored the base URL as given; resumed with a rotated key, the
    refusal quoted it masked with the new key only, so the old one showed."""
    from tokenbridge.generate.run import _stored_url

    old = "sk-or-v1-5f0c2e9a8b7d6c5f4e3a2b1c0d9e8f7a"
    assert _stored_url(f"https://gw.example/k/{old}/v1", SECRET) == "https://gw.example/k/***/v1"
    assert _stored_url(f"https://gw.example/{SECRET}/api/v1", SECRET) == "https://gw.example/***/api/v1"
    assert _stored_url("https://openrouter.ai/openrouter-proxy/api/v1", None) == \
        "https://openrouter.ai/openrouter-proxy/api/v1"  # a name, no digit: shown


def test_plain_http_to_another_machine_is_refused_unless_allowed(tmp_path):
    """``http://openrouter.ai/...`` (a typo of https) sent the key in clear to the
    network, silently. Refused before anything is sent, naming the host and the way out;
    ``allow_plain_http`` (a LAN server) sends it. A resolver makes the test's "other
    machine" this one: nothing leaves 127.0.0.1."""
    import aiohttp

    from tokenbridge.generate import ConfigError

    class _Resolver(aiohttp.abc.AbstractResolver):
        async def resolve(self, host, port=0, family=0):
            return [{"hostname": host, "host": "127.0.0.1", "port": port, "family": 2, "proto": 0, "flags": 0}]

        async def close(self):
            pass

    seen: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen.append(request.headers.get("Authorization", ""))
        return _ok()

    async def main(allow: bool) -> object:
        app_ = web.Application()
        app_.router.add_route("POST", "/{tail:.*}", handle)
        runner = web.AppRunner(app_, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://lan.test:{runner.addresses[0][1]}/api/v1"
        settings = GenerateSettings(datasets=(DatasetSpec("l", write_prompts(tmp_path, 1)),), base_url=url,
                                    request=RequestSettings(model="m"), max_attempts=1, progress="none",
                                    allow_plain_http=allow)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=_Resolver())) as session:
                return await agenerate_run(settings, tmp_path / "run", key=KEY, session=session)
        except ConfigError as exc:
            return exc
        finally:
            await runner.cleanup()

    refused = asyncio.run(main(allow=False))
    assert isinstance(refused, ConfigError) and str(refused) == (
        "base_url is plain http:// to lan.test, which is not this machine: the API key would cross the network "
        "unencrypted; use https://, or set allow_plain_http = true (--allow-plain-http) for a server on a network "
        "you trust")
    assert seen == [] and not (tmp_path / "run").exists()
    assert asyncio.run(main(allow=True)).exit_code == 0 and seen == [f"Bearer {SECRET}"]


def test_the_cli_refuses_plain_http_to_another_host_before_anything_is_sent(tmp_path):
    prompts = write_prompts(tmp_path, 1)
    res = CliRunner().invoke(app, ["generate", str(prompts), "--out", str(tmp_path / "run"), "--model", "m",
                                   "--base-url", "http://openrouter.ai/api/v1", "--max-attempts", "1"],
                             env={"OPENROUTER_API_KEY": SECRET})
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        "error: base_url is plain http:// to openrouter.ai, which is not this machine: the API key would cross the "
        "network unencrypted; use https://, or set allow_plain_http = true (--allow-plain-http) for a server on a "
        "network you trust"]
    assert not (tmp_path / "run").exists()


def test_a_header_value_is_sent_and_never_stored(tmp_path):
    """A value of the user's in a header of a harmless name (``X-Title``) was written, as it
    was, into the store's run log (a cold tester's): the run log keeps its digest. (A value
    shaped as a provider's key is refused before anything is sent: test_generate_cli.)"""
    token = "acme-" + "Zq8vN2xL4mR7tY1wK9pB3sD6fH0jC5gA"
    seen: list[str] = []

    async def reply(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("X-Title", ""))
        return _ok(request)

    _, summary = _run(tmp_path, 2, reply, headers={"X-Title": token})
    assert summary.done == 2 and seen == [token, token]
    stored = _every_stored_byte(tmp_path / "run")
    assert token[4:20].encode() not in stored and b"sha256:" in stored


@pytest.mark.parametrize(("status", "case"), [(400, str), (200, str), (400, str.upper)])
def test_an_error_quoting_the_key_in_short_pieces_is_masked_where_it_is_shown_and_stored(tmp_path, capsys, status,
                                                                                          case):
    """Four 15-character slices of the key, each under the 16 scrub masks, in an error's
    message: 58 of its 73 characters were printed and stored (a cold tester's); a 200 error
    body kept them, and so did the slices upper-cased (a cold reviewer's)."""
    quoted = "bad " + "..".join(case(SECRET[a:a + 15]) for a in (0, 20, 40, 58))

    async def reply(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"code": 400, "message": quoted}}, status=status)

    _, summary = _run(tmp_path, 1, reply)
    assert summary.failed == 1
    stored = _every_stored_byte(tmp_path / "run") + capsys.readouterr().err.encode()
    assert not any(SECRET[a:a + 8].encode().lower() in stored.lower() for a in range(0, len(SECRET) - 8, 4))
    assert b"bad ***" in stored


def _answering(content: str, *, cost: float | None = None) -> Reply:
    """A server's reply with ``content`` as the answer: a chat.completion, or its SSE stream
    (content, finish, then usage) where the request asks for one."""
    usage = {"prompt_tokens": 5, "completion_tokens": 3, **({"cost": cost} if cost is not None else {})}

    async def reply(request: web.Request) -> web.StreamResponse:
        if not json.loads(await request.read()).get("stream"):
            return web.json_response({
                "id": "gen-l", "object": "chat.completion", "created": 1, "model": "m", "provider": "p",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delta, finish in (({"role": "assistant", "content": content}, None), ({}, "stop")):
            chunk = {"id": "gen-l", "object": "chat.completion.chunk", "created": 1, "model": "m", "provider": "p",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        last = {"id": "gen-l", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                "usage": usage}
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    return reply


@pytest.mark.parametrize("stream", [False, True])
def test_a_kept_answer_quoting_the_key_in_short_pieces_is_stored_masked(tmp_path, capsys, stream):
    """A 200 answer whose content lists the key in 10-character pieces was kept and stored as it
    came, in the store and exchanges.jsonl, where the same pieces in an error were masked (a
    cold tester's). Kept answers are masked so too, streamed or not, and the run says so."""
    listed = str([SECRET[a:a + 10] for a in range(0, len(SECRET), 10)])

    reply = _answering(listed, cost=0.0001)

    _, summary = _run(tmp_path, 1, reply, stream=stream)
    assert summary.done == 1
    stored = _every_stored_byte(tmp_path / "run") + capsys.readouterr().err.encode()
    assert not any(SECRET[a:a + 10].encode() in stored for a in range(0, len(SECRET) - 10, 10))
    assert b"['***', '***'" in stored
    said = [n for n in summary.notices if "API key" in n]
    assert said == (["a streamed answer carried the API key: masked, and its raw stream not kept (the key may be split "
                     "across events there)"] if stream else
                    ["a response held the API key in pieces (half of it or more): they are masked wherever it is kept"])


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_holding_words_of_a_short_chosen_key_is_kept_as_it_came(tmp_path, stream):
    """Half of a 20-character key a user chose for a local server is ten characters, a word
    or two an answer may hold: masking them changed a paid answer (a cold reviewer's doubt).
    Pieces are masked in kept answers only where half the key is 16 characters or more. A
    stream's raw bytes holding them are still not kept (they are no sample's text), and the
    notice no longer blames comment lines alone (a cold reviewer's)."""
    import sqlite3

    key = ApiKey("TB_LOCAL", "local-dev-key-2024ab")
    text = "Set it with a local-dev-key flag."

    reply = _answering(text)

    _, summary = _run(tmp_path, 1, reply, key=key, stream=stream)
    assert summary.done == 1 and text.encode() in _every_stored_byte(tmp_path / "run")
    assert [n for n in summary.notices if "API key" in n] == ([
        "a stream's raw bytes held pieces of the API key, half of it or more (comment lines, chunk ids, or the answer's "
        "own text): its raw stream is not kept"] if stream else [])
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    try:
        assert [r for (r,) in con.execute("SELECT raw_stream FROM responses")] == [None]
    finally:
        con.close()


# --- the key pasted into a prompt or into extra_body (a cold tester's) ------------------------


def _prompts_with_key(tmp_path: Path) -> Path:
    """Three prompts: a clean one, one quoting the key, one declaring a tool whose description
    holds it base64-encoded (a spelling the masks know)."""
    import base64

    rows = [{"id": "clean", "prompt": "hello"},
            {"id": "pasted", "messages": [{"role": "user", "content": f"my key is {SECRET}, why is it refused?"}]},
            {"id": "in-tool", "prompt": "hi", "tools": [{"type": "function", "function": {
                "name": "f", "description": base64.b64encode(SECRET.encode()).decode(), "parameters": {}}}]}]
    path = tmp_path / "keyed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_prompt_that_holds_the_key_is_a_bad_row_never_sent_or_stored(tmp_path):
    """Sent, the key went to a provider in the prompt, and every stored copy (the store,
    exchanges.jsonl, then reconstruct's rows and the exports) held it, though a header
    holding it is refused. Such a row is a bad row now; the rest of the run goes on."""
    bodies: list[bytes] = []

    async def reply(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.read())
        return _ok(request)

    _, summary = _run(tmp_path, 0, reply, datasets=(DatasetSpec("k", _prompts_with_key(tmp_path)),),
                      request=RequestSettings(model="m", max_tokens=16, send_tools=True))
    assert summary.done == 1 and len(bodies) == 1 and b"hello" in bodies[0]
    said = ("field '<prompt>': its request holds the API key from $TB_LEAK (not shown here): not sent, so no "
            "provider gets it and nothing stored holds it; take it out of the prompt")
    keyed = tmp_path / "keyed.jsonl"
    assert summary.bad_rows == [f"{keyed}: line 2: {said}", f"{keyed}: line 3: {said}"]
    stored = _every_stored_byte(tmp_path / "run")
    assert _leaks(stored) == [] and SECRET.encode() not in stored and b"c2stb3ItdjEt" not in stored  # base64 too


def test_a_row_whose_id_or_bad_value_holds_the_key_never_shows_or_stores_it(tmp_path):
    """A row with the key as its ``role`` was a bad row whose message quoted the value whole,
    on the terminal and in generate.json; one with the key as its ``id`` was sent and stored
    as ``k-sk-or-...`` in exchanges.jsonl (a cold tester's)."""
    rows = [{"id": "clean", "prompt": "hello"},
            {"id": "bad-role", "messages": [{"role": SECRET, "content": "hi"}]},
            {"id": SECRET, "prompt": "hi"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    bodies: list[bytes] = []

    async def reply(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.read())
        return _ok(request)

    _, summary = _run(tmp_path, 0, reply, datasets=(DatasetSpec("k", path),),
                      request=RequestSettings(model="m", max_tokens=16))
    assert summary.done == 1 and len(bodies) == 1 and b"hello" in bodies[0]
    assert [b.split(": ", 2)[1:] for b in summary.bad_rows] == [
        ["line 2", "field 'messages[0].role': unknown role '***' (expected one of ['assistant', "
                   "'developer', 'system', 'tool', 'user'])"],
        ["line 3", "field 'id': its id holds the API key from $TB_LEAK (not shown here): not sent, so no provider gets "
                   "it and nothing stored holds it; take it out of the row's id"]]
    stored = _every_stored_byte(tmp_path / "run")
    assert _leaks(stored) == [] and SECRET.encode() not in stored


def test_a_tool_declaration_that_is_not_sent_keeps_its_row(tmp_path):
    """Without ``send_tools`` a row's tools are neither sent nor stored: one whose declaration
    holds the key is sent without it, not refused (a cold reviewer's)."""
    bodies: list[bytes] = []

    async def reply(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.read())
        return _ok(request)

    _, summary = _run(tmp_path, 0, reply, datasets=(DatasetSpec("k", _prompts_with_key(tmp_path)),),
                      request=RequestSettings(model="m", max_tokens=16))
    assert summary.done == 2 and len(bodies) == 2 and [b.split(": field")[0] for b in summary.bad_rows] == [
        f"{tmp_path / 'keyed.jsonl'}: line 2"]
    stored = _every_stored_byte(tmp_path / "run")
    assert _leaks(stored) == [] and b"c2stb3ItdjEt" not in stored


def test_the_dry_run_leaves_out_a_prompt_that_holds_the_key_as_the_run_does(tmp_path, monkeypatch):
    from tokenbridge.generate.estimate import dry_run

    monkeypatch.setenv("TB_LEAK", SECRET)
    settings = GenerateSettings(datasets=(DatasetSpec("k", _prompts_with_key(tmp_path)),), api_key_env="TB_LEAK",
                                request=RequestSettings(model="m", max_tokens=16, send_tools=True))
    report = dry_run(settings)
    assert report.samples == 1
    keyed = tmp_path / "keyed.jsonl"
    assert [b.split(": field")[0] for b in report.bad_rows] == [f"{keyed}: line 2", f"{keyed}: line 3"]
    assert all(SECRET not in b for b in report.bad_rows)


def test_extra_body_that_holds_the_key_is_refused_before_anything_is_sent(tmp_path):
    seen: list[str] = []

    async def reply(request: web.Request) -> web.StreamResponse:
        seen.append(request.path)
        return _ok(request)

    from tokenbridge.generate.settings import ConfigError

    with pytest.raises(ConfigError) as info:
        _run(tmp_path, 1, reply, request=RequestSettings(model="m", max_tokens=16, extra_body={"user": SECRET}))
    assert str(info.value) == ("request.extra_body holds the API key from $TB_LEAK (not shown here): the key is sent "
                               "only as Authorization; remove it from extra_body")
    assert seen == [] and not (tmp_path / "run" / "state.sqlite").exists()


def test_a_key_in_the_request_settings_is_refused_as_a_setting_not_blamed_on_each_prompt(tmp_path, monkeypatch):
    """With the key pasted as the model, every prompt became a bad row "take it out of the
    prompt" (a cold reviewer's): what every request carries is checked once, as a setting,
    before anything is sent, in the run and its dry run alike."""
    from tokenbridge.generate.estimate import dry_run
    from tokenbridge.generate.settings import ConfigError

    seen: list[str] = []

    async def reply(request: web.Request) -> web.StreamResponse:
        seen.append(request.path)
        return _ok(request)

    said = ("request settings (model, provider, reasoning, ...) hold the API key from $TB_LEAK (not shown here): the "
            "key is sent only as Authorization; take it out of the setting")
    with pytest.raises(ConfigError) as info:
        _run(tmp_path, 1, reply, request=RequestSettings(model=SECRET, max_tokens=16))
    assert str(info.value) == said and seen == []
    monkeypatch.setenv("TB_LEAK", SECRET)
    with pytest.raises(ConfigError) as info:
        dry_run(GenerateSettings(datasets=(DatasetSpec("k", write_prompts(tmp_path, 1)),), api_key_env="TB_LEAK",
                                 request=RequestSettings(model=SECRET, max_tokens=16)))
    assert str(info.value) == said

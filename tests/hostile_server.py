"""A hostile chat-completions server for reliability tests (127.0.0.1, a background thread).

Each prompt's reply is picked by ``plan[prompt]``: a list of mode names, one per attempt
(the last repeats); prompts not in the plan get ``"ok"``. Usable from the test process
and from a ``generate`` subprocess alike (it is a real socket). ``sent[prompt]`` holds
the bytes of every whole body it answered with (what a test compares the store with). Modes:

  ok                  a valid chat.completion with usage
  slow:<s>            ``ok`` after <s> seconds
  hang                no reply at all (until the client gives up)
  gate                ``ok`` once the test sets ``server.gate``
  usage:<field>=<raw> ``usage.<field>`` set to the raw JSON text (``"12"``, ``-3``, ``true``,
                      ``1e400``, ``1e300``, ``null``...), the rest valid
  usage_not_object    ``"usage": "lots"``
  usage_only:<field>=<raw>,...  ``usage`` holding only these fields (each raw JSON text)
  error_usage:<status>  that status with an ``error`` body that counts 5 prompt tokens, no cost
  choice_error_billed:<usd>  200 with ``finish_reason: "error"`` and ``usage.cost`` <usd>
  finish:<how>        ``ok`` whose finish_reason is ``missing``, ``null`` or ``empty`` (``""``)
  bad_utf8_pretty     a pretty-printed (multi-line) body with an invalid UTF-8 byte in a string
  pretty              a pretty-printed (multi-line) valid body
  endless[:<status>]  ``application/json`` whose body never ends (64 KiB writes), status 200
                      or the one given
  keepalive_only      200 ``text/event-stream`` of ``: OPENROUTER PROCESSING`` comments forever
  echo_error:<form>   400 whose error message holds the key (from the ``Authorization``
                      header) in the given form, placed so a 500-character clip keeps all
                      of a raw key but its last character
  echo_ok:<form>      200 whose content quotes the key in the given form
  split_key_sse       an SSE stream whose content carries the key split across two events
  bad_chunk_sse:<how> an SSE stream whose one chunk quotes the key where a 200-character clip
                      keeps all of it but its last character: ``not_json`` or ``array``
  repeat_index[:<usd>]  200 with two choices that both say ``index: 0`` (``usage.cost`` <usd>)
  nan_field:<usd>     a valid body, ``usage.cost`` <usd>, plus ``"x": NaN`` (not re-emittable)
  cut_json            200 ``application/json`` cut inside its choices (not JSON at all)
  whole_then_hold[:<usd>]  a whole ``ok`` body (``usage.cost`` <usd>) under a ``Content-Length``
                      10 bytes longer, the connection then held open (``whole_then_hold_sse``: a
                      stream's finish and usage chunks, then keep-alive comments, no ``[DONE]``;
                      ``half_then_hold``: the first half of the body)
forms: raw, json_escaped (mixed ``\\uXXXX``), json_short (``\\/``, ``\\"``, ``\\\\``), url, base64,
mime_base64 (a line break every 76 characters, as ``base64.encodebytes`` writes it), starred
(its last four characters as ``****``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
import urllib.parse
from collections import Counter
from typing import Any

from aiohttp import web

__all__ = ["HostileServer", "encode_key", "key_leaks"]


def encode_key(key: str, form: str) -> str:
    """The key as it would sit inside a JSON string value, in the given form."""
    if form == "raw":
        return key
    if form == "json_escaped":  # escaped in the JSON text itself: every other character as \\uXXXX
        return "".join(f"\\u{ord(c):04x}" if i % 2 == 0 else c for i, c in enumerate(key))
    if form == "json_short":  # what PHP's json_encode writes: '/' as '\/' too
        return json.dumps(key)[1:-1].replace("/", "\\/")
    if form == "url":
        return "".join(f"%{ord(c):02X}" if i % 3 == 0 else c for i, c in enumerate(key))
    if form == "base64":
        return base64.b64encode(b"Bearer " + key.encode()).decode()
    if form == "mime_base64":  # its line breaks escaped, as in any JSON string
        return base64.encodebytes(b"Bearer " + key.encode()).decode().replace("\n", "\\n")
    if form == "starred":
        return key[:-4] + "****"
    raise ValueError(form)


def key_leaks(data: bytes, key: str) -> list[str]:
    """Every form of ``key`` (or of its first 12 characters) found in ``data`` (test oracle:
    written independently of tokenbridge's scrubber). Base64 is looked for with line breaks
    (raw or JSON-escaped) taken out and ``\\/`` read as ``/``."""
    found = []
    text = data.decode("utf-8", "replace")
    probes = {"key": key, "key prefix": key[:12], "key less its last char": key[:-1]}
    views = {"raw": text, "url-decoded": urllib.parse.unquote(text)}
    views["json-unescaped"] = _unescape_u(text)
    for name, view in views.items():
        for what, probe in probes.items():
            if probe in view:
                found.append(f"{what} ({name})")
    raw = key.encode()
    flat = re.sub(r"\r|\n|\\+r|\\+n", "", text).replace("\\/", "/")
    for shift in range(3):
        enc = base64.b64encode(b"\0" * shift + raw)
        start, end = (shift * 8 + 5) // 6, ((shift + len(raw)) * 8) // 6
        if enc[start:end] in data or enc[start:end].decode() in text or enc[start:end].decode() in flat:
            found.append(f"key (base64, shift {shift})")
    return found


def _unescape_u(text: str) -> str:
    text = re.sub(r"\\+u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)
    return re.sub(r'\\+([/"\\])', r"\1", text)


def _ok(text: str = "fine", **usage: Any) -> dict[str, Any]:
    u = {"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.0001}
    u.update(usage)
    return {
        "id": "gen-1", "object": "chat.completion", "created": 1, "model": "m", "provider": "hostile",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": u,
    }


def _sse(events: list[bytes]) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"


class HostileServer:
    """``with HostileServer() as srv: srv.plan["q1"] = ["usage:completion_tokens=\\"x\\"", "ok"]``."""

    def __init__(self) -> None:
        self.plan: dict[str, list[str]] = {}
        self.attempts: Counter[str] = Counter()
        self.sent: dict[str, list[bytes]] = {}
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.gate = threading.Event()  # opens the replies of "gate" mode
        self.whole = threading.Event()  # set once a "whole_then_hold" reply has sent its body

    def __enter__(self) -> HostileServer:
        self._thread = threading.Thread(target=self._serve, name="hostile-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("hostile server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)  # type: ignore[union-attr]
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/api/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/api/v1"
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        self.attempts[prompt] += 1
        resp = await self._reply(request, prompt)
        if isinstance(resp, web.Response) and isinstance(resp.body, bytes):
            self.sent.setdefault(prompt, []).append(resp.body)
        return resp

    async def _whole_then_hold(self, request: web.Request, cost: float, *, sse: bool, half: bool = False,
                               ) -> web.StreamResponse:
        """A whole answer (``half``: its first half), then the connection held open (see the module doc)."""
        if not sse:
            body = json.dumps(_ok(cost=cost)).encode()
            resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(len(body) + 10)})
            await resp.prepare(request)
            await resp.write(body[: len(body) // 2] if half else body)
        else:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            head = {"id": "gen-s", "object": "chat.completion.chunk", "model": "m", "provider": "hostile"}
            done = {**head, "choices": [{"index": 0, "delta": {"content": "fine"}, "finish_reason": "stop"}]}
            usage = {**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "cost": cost}}
            await resp.write(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (done, usage)))
        self.whole.set()
        for _ in range(3600):
            if sse:
                await resp.write(b": OPENROUTER PROCESSING\n\n")
            await asyncio.sleep(1)
        return resp

    async def _reply(self, request: web.Request, prompt: str) -> web.StreamResponse:  # noqa: PLR0911, PLR0912, PLR0915 - one branch per hostile behaviour
        modes = self.plan.get(prompt, ["ok"])
        mode = modes[min(self.attempts[prompt], len(modes)) - 1]
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        name, _, arg = mode.partition(":")
        if name == "ok":
            return _json_bytes(json.dumps(_ok()).encode())
        if name == "slow":
            await asyncio.sleep(float(arg))
            return _json_bytes(json.dumps(_ok()).encode())
        if name == "gate":  # held until the test opens the gate (30 s at most)
            for _ in range(3000):
                if self.gate.is_set():
                    break
                await asyncio.sleep(0.01)
            return _json_bytes(json.dumps(_ok()).encode())
        if name == "hang":
            await asyncio.sleep(3600)
        if name == "pretty":
            return _json_bytes(json.dumps(_ok(), indent=2).encode())
        if name == "usage":
            field, _, raw = arg.partition("=")
            text = json.dumps(_ok(**{field: "@@"})).replace('"@@"', raw)
            return _json_bytes(text.encode())
        if name == "choice_error_billed":  # a choice that ended in error, billed all the same
            doc = _ok(cost=float(arg))
            doc["choices"][0]["finish_reason"] = "error"
            return _json_bytes(json.dumps(doc).encode())
        if name == "finish":  # finish_reason missing, null or empty, the rest valid
            doc = _ok()
            if arg == "missing":
                del doc["choices"][0]["finish_reason"]
            else:
                doc["choices"][0]["finish_reason"] = {"null": None, "empty": ""}[arg]
            return _json_bytes(json.dumps(doc).encode())
        if name == "usage_only":
            usage = {field: json.loads(raw) for field, _, raw in (item.partition("=") for item in arg.split(","))}
            return _json_bytes(json.dumps({**_ok(), "usage": usage}).encode())
        if name == "error_usage":
            doc = {"error": {"code": int(arg), "message": "overloaded"}, "usage": {"prompt_tokens": 5, "completion_tokens": 0}}
            return web.Response(body=json.dumps(doc).encode(), status=int(arg), content_type="application/json")
        if name == "usage_not_object":
            return _json_bytes(json.dumps({**_ok(), "usage": "lots"}).encode())
        if name == "bad_utf8_pretty":
            text = json.dumps(_ok("caf@"), indent=2).encode().replace(b"@", b"\xff")
            return _json_bytes(text)
        if name == "repeat_index":
            doc = _ok(**({"cost": float(arg)} if arg else {}))
            doc["choices"].append(dict(doc["choices"][0]))
            return _json_bytes(json.dumps(doc).encode())
        if name == "nan_field":
            return _json_bytes(json.dumps(_ok(cost=float(arg)))[:-1].encode() + b', "x": NaN}')
        if name in ("whole_then_hold", "whole_then_hold_sse", "half_then_hold"):
            return await self._whole_then_hold(request, float(arg or 0.0001), sse=name.endswith("sse"),
                                               half=name.startswith("half"))
        if name == "cut_json":
            return _json_bytes(json.dumps(_ok()).encode()[:60])
        if name == "echo_error":
            msg = "x" * (501 - len(key)) + encode_key(key, arg) + "y" * 80  # a 500-char clip keeps all but its last
            text = '{"error": {"code": 400, "message": "' + msg + '"}}'
            return web.Response(body=text.encode(), status=400, content_type="application/json")
        if name == "echo_ok":
            text = json.dumps(_ok("your key is @@ ok")).replace("@@", encode_key(key, arg))
            return _json_bytes(text.encode())
        if name == "endless":  # endless:<status> for an endless error page
            resp = web.StreamResponse(status=int(arg or 200), headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            chunk = b" " * 65536
            while True:  # ends when the client goes away
                await resp.write(chunk)
        if name == "keepalive_only":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            while True:
                await resp.write(b": OPENROUTER PROCESSING\n\n")
                await asyncio.sleep(0.02)
        if name == "bad_chunk_sse":
            start = '{"echo": "' if arg == "not_json" else '["'
            chunk = start + "A" * (201 - len(start) - len(key)) + key + ('" BROKEN' if arg == "not_json" else '"]')
            return web.Response(body=_sse([chunk.encode()]), headers={"Content-Type": "text/event-stream"})
        if name == "split_key_sse":
            half = len(key) // 2

            def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
                return json.dumps({"id": "gen-s", "object": "chat.completion.chunk", "model": "m", "provider": "hostile",
                                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}).encode()

            payload = _sse([
                chunk({"role": "assistant", "content": "key: " + key[:half]}),
                chunk({"content": key[half:] + " end"}),
                chunk({}, "stop", usage={"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.0001}),
            ])
            return web.Response(body=payload, headers={"Content-Type": "text/event-stream"})
        raise AssertionError(f"unknown mode {mode!r}")


def _json_bytes(data: bytes) -> web.Response:
    return web.Response(body=data, status=200, content_type="application/json")

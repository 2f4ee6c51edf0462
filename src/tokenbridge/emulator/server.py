"""The aiohttp application: OpenRouter-compatible endpoints plus stats and admin switches.

Routes (each also under ``/api/v1`` where OpenRouter has it):

* ``POST /api/v1/chat/completions``, ``POST /v1/chat/completions``
* ``GET /models``, ``/api/v1/models``, ``/v1/models``; ``GET /api/v1/models/{author}/{slug}/endpoints``
* ``GET /api/v1/key``, ``GET /api/v1/credits`` (OpenRouter's account endpoints)
* ``GET /health``; ``GET /stats`` (request counts: total, by provider, status, fault, sample key;
  ``busy_s``, the chat requests' summed time in the server, so the mean concurrency over a
  span is its growth over the span's length; ``in_flight`` now)
* ``GET|POST /admin/credits`` (``{"credits_usd": X | null}`` sets a fresh budget),
  ``POST /admin/settings`` (``fault_rate``, ``latency_ms``), ``POST /admin/reset`` (stats, spend)

All state lives on one event loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from collections.abc import Mapping

from aiohttp import web

from ..chat import TemplateError, resolve_dialect
from ..chat.harmony import HarmonyDialect
from ..jsonl import loads_document, unencodable
from ..tokenizer import Tokenizer
from .choices import ChoiceView, LogprobsAsk, build_choice
from .config import ConfigError, EmulatorConfig, ProviderConfig
from .faults import pick_fault
from .hashing import draw, request_key, sample_key
from .responses import PROCESSING, Envelope, completion_body, dumps, error_body, sse_events, usage_body
from .routing import RoutingError, select_providers, split_model_suffix
from .synthetic import SyntheticModel

__all__ = ["build_app", "EMULATOR_KEY"]

EMULATOR_KEY = web.AppKey("tokenbridge_emulator", object)
_MAX_N = 16


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, dict(headers or {})


@dataclass
class _Request:
    """The parts of a chat request the emulator acts on."""

    body: dict[str, Any]
    model: str
    messages: list[dict[str, Any]]
    tools: list[Any] | None
    n: int
    max_tokens: int | None
    seed: int
    temperature: float | None
    stream: bool
    return_token_ids: bool
    thinking: bool
    logprobs: LogprobsAsk | None = None


class _Stats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total = 0
        self.by_provider: Counter[str] = Counter()
        self.by_status: Counter[str] = Counter()
        self.by_fault: Counter[str] = Counter()
        self.by_key: Counter[str] = Counter()
        self.ok_by_key: Counter[str] = Counter()
        self.by_request: Counter[str] = Counter()
        self.busy_s = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_provider": dict(self.by_provider),
            "by_status": dict(self.by_status),
            "by_fault": dict(self.by_fault),
            "by_key": dict(self.by_key),
            "ok_by_key": dict(self.ok_by_key),
            "by_request": dict(self.by_request),
            "busy_s": self.busy_s,
        }


#: The roles a chat request's messages may have (OpenAI's, ``developer`` and the legacy ``function``).
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _strict_json(raw: bytes) -> Any:  # Any: any JSON value
    """The body as the stdlib reads it (big integers exact, a byte order mark skipped), and
    a 400 naming the field for what a strict reader refuses: a lone surrogate escape (no
    prompt holding it can be encoded: a 500 before, which clients retry) or ``NaN``."""
    try:
        body = loads_document(raw)
    except ValueError as exc:  # JsonLineError too: nested too deeply to read
        raise _HTTPError(400, f"request body is not valid JSON: {exc}") from None
    if (why := unencodable(body)) is not None:
        raise _HTTPError(400, f"request body: {why}")
    return body


class _Emulator:
    def __init__(self, config: EmulatorConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tok = tokenizer
        self.dialect = resolve_dialect(tokenizer, config.dialect)
        self.model = SyntheticModel(
            tokenizer,
            self.dialect,
            seed=config.seed,
            tool_call_rate=config.tool_call_rate,
            tool_call_without_think_close=config.tool_call_without_think_close,
            min_tokens=config.min_tokens,
            max_tokens=config.max_tokens,
        )
        fam = self.model.family
        unserved = [p.name for p in config.providers if p.engine == "vllm" and fam.vllm_reasoning == "unmodelled"]
        if unserved:
            raise ConfigError(f"providers {', '.join(unserved)}: the emulator models no vllm engine for {fam.name} "
                              "(use engine = \"sglang\" or \"none\")")
        self.stats = _Stats()
        self.fault_rate = config.fault_rate
        self.latency_ms = config.latency_ms
        self.credits_usd = config.credits_usd
        self.spent_usd = 0.0
        self._prompts: OrderedDict[tuple[str, str, bool, str, str], tuple[list[int], bool]] = OrderedDict()
        self._ids = itertools.count(1)
        self._models = set(config.models)
        self._active: Counter[str] = Counter()  # requests each provider is serving now

    # -- chat -------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.stats.total += 1
        started = time.monotonic()
        try:
            resp = await self._chat(request)
        except _HTTPError as exc:
            resp = _json(error_body(exc.status, exc.message), exc.status, exc.headers)
        except Exception as exc:  # an emulator bug: say so in the body rather than a bare 500
            resp = _json(error_body(500, f"emulator error: {type(exc).__name__}: {exc}"), 500)
        finally:
            self.stats.busy_s += time.monotonic() - started
        self.stats.by_status[str(resp.status)] += 1
        return resp

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self._check_auth(request)
        req = self._parse(await request.read())
        skey = sample_key(req.messages)
        attempt = self.stats.by_key[skey]
        self.stats.by_key[skey] += 1
        self.stats.by_request[request_key(req.body)] += 1

        base_model, suffix_sort = split_model_suffix(req.model)
        if not self.config.accept_any_model and base_model not in self._models:
            raise _HTTPError(400, f"{req.model} is not a valid model ID (this emulator serves: "
                                  f"{', '.join(self.config.models)})")
        if self.credits_usd is not None and self.spent_usd >= self.credits_usd:
            raise _HTTPError(402, "Insufficient credits: this account's emulator budget is spent. "
                                  "Add credits (POST /admin/credits) and retry.")
        try:
            provider = select_providers(self.config.providers, req.body.get("provider"),
                                        sample_key=skey, suffix_sort=suffix_sort)[0]
        except RoutingError as exc:
            raise _HTTPError(exc.status, exc.message) from None
        self.stats.by_provider[provider.name] += 1
        cap = provider.max_concurrency
        if cap is not None and self._active[provider.name] >= cap:
            self.stats.by_fault["over_capacity"] += 1
            raise _HTTPError(429, f"{provider.name}: at capacity ({cap} requests at once), retry shortly",
                             {"Retry-After": str(self.config.retry_after_s)})
        self._active[provider.name] += 1
        try:
            return await self._serve(request, req, provider, skey, attempt, base_model)
        finally:
            self._active[provider.name] -= 1

    async def _serve(self, request: web.Request, req: _Request, provider: ProviderConfig, skey: str, attempt: int,
                     base_model: str) -> web.StreamResponse:
        fault = pick_fault(provider, self.fault_rate, seed=self.config.seed, key=skey, attempt=attempt)
        if fault:
            self.stats.by_fault[fault] += 1
        latency = (provider.latency_ms if provider.latency_ms is not None else self.latency_ms) / 1000
        if fault == "slow":
            latency += self.config.slow_s
        if fault in ("no_endpoints", "rate_limit", "server_error"):
            await asyncio.sleep(latency)
            raise self._fault_error(fault, provider, skey, attempt)

        created = int(time.time())
        prompt_ids, opens_think = self._prompt_ids(req, skey, created)
        error = None
        if fault == "choice_error" or (fault == "midstream_error" and not req.stream):
            error = {"code": 502, "message": f"{provider.name}: the upstream connection dropped mid-generation"}
        views = self._choices(req, provider, skey, error, opens_think)
        usage = usage_body(len(prompt_ids), views, provider.prompt_price, provider.completion_price)
        env = Envelope(
            id=f"gen-{int(time.time())}-{skey[:8]}{next(self._ids):06d}",
            created=created,
            model=base_model,
            provider=provider.name,
        )
        ids_out = prompt_ids if req.return_token_ids else None
        if fault != "error_body":
            self.spent_usd += usage["cost"]
        if fault in (None, "slow"):
            self.stats.ok_by_key[skey] += 1
        if req.stream:
            return await self._stream(request, env, views, usage, prompt_ids=ids_out, fault=fault, provider=provider,
                                      latency=latency)
        await asyncio.sleep(latency)
        if fault == "error_body":
            return _json(error_body(502, f"{provider.name}: provider returned an error", provider_name=provider.name))
        text = dumps(completion_body(env, views, usage, ids_out))
        if fault == "malformed_json":
            text = text[: max(1, len(text) // 2)]
        return web.Response(text=text, content_type="application/json")

    def _choices(self, req: _Request, provider: ProviderConfig, skey: str, error: dict[str, Any] | None,
                 opens_think: bool) -> list[ChoiceView]:
        views = []
        for i in range(req.n):
            index = 0 if req.temperature == 0 else i  # greedy: every choice is the same sample
            gen = self.model.generate(req.messages, req.tools, req.thinking, req.seed, index, opens_think)
            views.append(build_choice(
                gen,
                tok=self.tok,
                dialect=self.dialect,
                provider=provider,
                index=i,
                max_tokens=req.max_tokens,
                structured_tools=bool(req.tools),
                draw_key=(self.config.seed, skey, req.seed, index),
                error=error if i == 0 else None,
                logprobs=req.logprobs,
                stream=req.stream,
                thinking=req.thinking,
            ))
        return views

    def _fault_error(self, fault: str, provider: ProviderConfig, skey: str, attempt: int) -> _HTTPError:
        if fault == "no_endpoints":
            return _HTTPError(404, "No endpoints found for this model that can serve the request right now")
        if fault == "rate_limit":
            return _HTTPError(429, f"{provider.name}: rate limit exceeded, retry shortly",
                              {"Retry-After": str(self.config.retry_after_s)})
        status = 502 if draw(self.config.seed, "5xx", skey, attempt) < 0.5 else 503
        return _HTTPError(status, f"{provider.name}: provider returned error (upstream {status})")

    def _prompt_ids(self, req: _Request, skey: str, created: int) -> tuple[list[int], bool]:
        """The prompt ids, and whether the prompt text ends by opening the think block.
        A dialect whose prompt prints the serving day (gpt-oss) renders the UTC day of the
        server's clock now (``created``), as a real server does. Not the first day
        ``created`` admits: a few minutes after midnight that was yesterday, which the
        client's own timing (what the gate reads first) rules out."""
        kwargs = req.body.get("chat_template_kwargs")
        dated = isinstance(self.dialect, HarmonyDialect) and self.dialect.dated_prompt
        day = datetime.fromtimestamp(created, tz=UTC).date().isoformat() if dated else ""
        key = (skey, dumps(req.tools) if req.tools else "", req.thinking, dumps(kwargs) if kwargs else "", day)
        hit = self._prompts.get(key)
        if hit is not None:
            self._prompts.move_to_end(key)
            return hit
        try:
            if dated:
                readings = self.dialect.prompt_readings(req.body, {"created": created}, {})
                text = next(r.text for r in readings if r.name == f"date={day}")
            else:
                text = self.dialect.render_request(req.body)
        except (TemplateError, KeyError, TypeError, AttributeError, ValueError) as exc:
            raise _HTTPError(400, f"cannot render the prompt from these messages: {type(exc).__name__}: {exc}") from None
        opening = self.dialect.think_open
        entry = (self.tok.encode(text), opening is not None and text.endswith(opening))
        self._prompts[key] = entry
        if len(self._prompts) > 4096:
            self._prompts.popitem(last=False)
        return entry

    def _check_auth(self, request: web.Request) -> None:
        if self.config.api_key is None:
            return
        if request.headers.get("Authorization", "") != f"Bearer {self.config.api_key}":
            raise _HTTPError(401, "Missing or wrong API key (Authorization: Bearer ...)")

    def _parse(self, raw: bytes) -> _Request:
        body = _strict_json(raw)
        if not isinstance(body, dict):
            raise _HTTPError(400, "request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _HTTPError(400, "model: required, a model id string")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _HTTPError(400, "messages: required, a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _HTTPError(400, f"messages[{i}]: must be an object with a string 'role'")
            if m["role"] not in _ROLES:
                raise _HTTPError(400, f"messages[{i}].role: {m['role']!r} is not one of {', '.join(_ROLES)}")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _HTTPError(400, "tools: must be a list")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise _HTTPError(400, f"stream: must be true or false, got {body['stream']!r}")
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise _HTTPError(400, "stop: must be a string or a list of strings")
        n = _int(body, "n", 1, 1, _MAX_N)
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is not None:
            max_tokens = _int({"max_tokens": max_tokens}, "max_tokens", None, 1, 10**7)
        seed = _int(body, "seed", 0, -(2**63), 2**63)
        logprobs = None
        if body.get("logprobs") is True:
            logprobs = LogprobsAsk(top=_int(body, "top_logprobs", 0, 0, 20),
                                   token_ids_as_text=body.get("return_tokens_as_token_ids") is True)
        temperature = body.get("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
            raise _HTTPError(400, "temperature: must be a number")
        return _Request(
            body=body,
            model=model,
            messages=messages,
            tools=tools or None,
            n=n,
            max_tokens=max_tokens,
            seed=seed,
            temperature=temperature,
            stream=body.get("stream") is True,
            return_token_ids=body.get("return_token_ids") is True,
            thinking=self.dialect.thinking(body),
            logprobs=logprobs,
        )

    # -- streaming --------------------------------------------------------------------

    async def _stream(self, request: web.Request, env: Envelope, views: list[ChoiceView], usage: dict[str, Any], *,
                      prompt_ids: list[int] | None, fault: str | None, provider: ProviderConfig, latency: float,
                      ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await resp.write(f"{PROCESSING}\n\n".encode())
            await _wait_with_comments(resp, latency)
            if fault == "error_body":
                body = error_body(502, f"{provider.name}: provider returned an error", provider_name=provider.name)
                await resp.write(f"data: {dumps(body)}\n\n".encode())
                return resp
            events = list(sse_events(env, views, usage, prompt_ids, chunk_chars=self.config.stream_chunk_chars))[1:]
            tail = "data: [DONE]\n\n"
            if fault in ("midstream_error", "malformed_json"):
                data_at = [i for i, (kind, _, _) in enumerate(events) if kind == "data"]
                events = events[: data_at[len(data_at) // 2]]
                if fault == "midstream_error":
                    tail = "data: " + dumps({
                        "id": env.id, "provider": env.provider, "model": env.model,
                        "object": "chat.completion.chunk", "created": env.created,
                        "error": {"code": 502, "message": f"{provider.name}: upstream error mid-stream"},
                        "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error",
                                     "native_finish_reason": "error"}],
                    }) + "\n\n"
                else:
                    tail = 'data: {"id":"' + env.id + '","choices":[{"index":0,"delta":{"content":"\n\n'
            if provider.tokens_per_s > 0:
                for kind, payload, n_ids in events:
                    await resp.write(_sse(kind, payload).encode())
                    if n_ids:
                        await asyncio.sleep(n_ids / provider.tokens_per_s)
            else:
                await resp.write("".join(_sse(k, p) for k, p, _ in events).encode())
            await resp.write(tail.encode())
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away; nothing to clean up
        return resp

    # -- the rest ---------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return _json({"data": [self._model_entry(m) for m in self.config.models]})

    async def endpoints(self, request: web.Request) -> web.Response:
        model = f"{request.match_info['author']}/{request.match_info['slug']}"
        if model not in self._models and not self.config.accept_any_model:
            return _json(error_body(404, f"model {model} not found"), 404)
        return _json({"data": {**self._model_entry(model), "endpoints": [
            {
                "name": p.name,
                "provider_name": p.slug,
                "tag": p.name,
                "quantization": p.quantization,
                "context_length": p.context_length,
                "pricing": {"prompt": _per_token(p.prompt_price), "completion": _per_token(p.completion_price)},
                "supported_parameters": _SUPPORTED,
                "status": 0,
            }
            for p in self.config.providers
        ]}})

    def _model_entry(self, model: str) -> dict[str, Any]:
        cheapest = min(self.config.providers, key=lambda p: p.prompt_price + p.completion_price)
        return {
            "id": model,
            "name": f"{model} (tokenbridge emulator)",
            "created": 0,
            "context_length": max(p.context_length for p in self.config.providers),
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"], "tokenizer": "Other"},
            "pricing": {"prompt": _per_token(cheapest.prompt_price), "completion": _per_token(cheapest.completion_price)},
            "top_provider": {"context_length": cheapest.context_length, "is_moderated": False},
            "supported_parameters": _SUPPORTED,
        }

    async def key_info(self, request: web.Request) -> web.Response:
        remaining = None if self.credits_usd is None else max(0.0, self.credits_usd - self.spent_usd)
        return _json({"data": {"label": "tokenbridge-emulator", "usage": self.spent_usd, "limit": self.credits_usd,
                               "limit_remaining": remaining, "is_free_tier": False}})

    async def credits(self, request: web.Request) -> web.Response:
        return _json({"data": {"total_credits": self.credits_usd or 0.0, "total_usage": self.spent_usd}})

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def stats_view(self, request: web.Request) -> web.Response:
        return _json({**self.stats.as_json(), "spent_usd": self.spent_usd, "in_flight": sum(self._active.values())})

    async def admin_credits(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            body = await _admin_body(request)
            value = body.get("credits_usd")
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                return _json(error_body(400, "credits_usd must be a non-negative number or null"), 400)
            self.credits_usd = None if value is None else float(value)
            self.spent_usd = 0.0
        return _json({"credits_usd": self.credits_usd, "spent_usd": self.spent_usd})

    async def admin_settings(self, request: web.Request) -> web.Response:
        body = await _admin_body(request)
        for name in ("fault_rate", "latency_ms"):
            if name in body:
                value = body[name]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    name == "fault_rate" and value > 1
                ):
                    return _json(error_body(400, f"{name}: bad value {value!r}"), 400)
                setattr(self, name, float(value))
        return _json({"fault_rate": self.fault_rate, "latency_ms": self.latency_ms})

    async def admin_reset(self, request: web.Request) -> web.Response:
        self.stats.reset()
        self.spent_usd = 0.0
        return _json({"ok": True})


_SUPPORTED = ["max_tokens", "temperature", "top_p", "seed", "n", "stream", "tools", "tool_choice",
              "reasoning", "include_reasoning", "return_token_ids", "logprobs", "top_logprobs"]


def _per_token(per_million: float) -> str:
    return f"{per_million / 1e6:.10f}".rstrip("0").rstrip(".") or "0"


def _int(body: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _HTTPError(400, f"{name}: must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(text=dumps(obj), status=status, headers=headers, content_type="application/json")


def _sse(kind: str, payload: Any) -> str:
    return f"{payload}\n\n" if kind == "comment" else f"data: {dumps(payload)}\n\n"


async def _wait_with_comments(resp: web.StreamResponse, seconds: float) -> None:
    """Sleep, sending OpenRouter's keep-alive comment about once a second."""
    while seconds > 0:
        step = min(1.0, seconds)
        await asyncio.sleep(step)
        seconds -= step
        if seconds > 0:
            await resp.write(f"{PROCESSING}\n\n".encode())


async def _admin_body(request: web.Request) -> dict[str, Any]:
    try:
        body = loads_document(await request.read() or b"{}")
    except ValueError:  # JsonLineError too: nested too deeply to read
        raise web.HTTPBadRequest(text=dumps(error_body(400, "body is not JSON")), content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=dumps(error_body(400, "body must be an object")), content_type="application/json")
    return body


def build_app(config: EmulatorConfig, tokenizer: Tokenizer) -> web.Application:
    """The emulator as an aiohttp application (for embedding or aiohttp's test client)."""
    emu = _Emulator(config, tokenizer)
    app = web.Application(client_max_size=64 * 1024**2)
    app[EMULATOR_KEY] = emu
    r = app.router
    for prefix in ("/api/v1", "/v1"):
        r.add_post(f"{prefix}/chat/completions", emu.chat)
        r.add_get(f"{prefix}/models", emu.models)
    r.add_get("/models", emu.models)
    r.add_get("/api/v1/models/{author}/{slug}/endpoints", emu.endpoints)
    r.add_get("/api/v1/key", emu.key_info)
    r.add_get("/api/v1/credits", emu.credits)
    for prefix in ("", "/api/v1"):
        r.add_get(f"{prefix}/health", emu.health)
        r.add_get(f"{prefix}/stats", emu.stats_view)
        r.add_get(f"{prefix}/admin/credits", emu.admin_credits)
        r.add_post(f"{prefix}/admin/credits", emu.admin_credits)
        r.add_post(f"{prefix}/admin/settings", emu.admin_settings)
        r.add_post(f"{prefix}/admin/reset", emu.admin_reset)
    return app

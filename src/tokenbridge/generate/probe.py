"""``tokenbridge probe``: which providers serve the model in a form exact tokens survive.

Each provider is pinned (``provider: {only: [p], allow_fallbacks: false}``) and sent a
few probe prompts: a greeting, a request that should make the model call a tool that is
described only in the system text (so a call comes back as raw marker text unless the
provider parses it), and a CJK one. Each response is rebuilt with
:func:`tokenbridge.reconstruct.reconstruct_record`, and per provider we report:
available (404 "No endpoints" -> no), reasoning present, end-marker leak, think-marker
leak, tool markers (raw / parsed / none), usage parity (our token counts vs the
provider's), latency and cost. The two leak columns are the gate's findings
(``eos_in_text``, ``think_marker_in_*``), not a second detector.

Echo tests (:data:`ECHO_TESTS`) ask the model to repeat a text verbatim: decomposed
accents, compatibility characters, CRLF, edge whitespace. A provider whose pipeline
normalizes Unicode, rewrites line ends, strips edges or spaces the text around markers
(vLLM's detokenizer) gives itself away here, although no single normal response can show
it. One more call asks for ``logprobs`` and ``return_token_ids`` to see whether either
comes back. :meth:`ProviderReport.profile` is the result (``--json`` writes it).

Every field of an answer is the API's. One out of the shape reconstruct reads is refused
as generate refuses it (``bad_choices``: that call's error, after its tries), and the
fields read beside it (provider, usage counts) are taken only where they have their type,
so one provider's odd answer never costs the results already paid for from the others.

A probe is a quick look, not a run: each prompt gets ``attempts`` tries, and a wait
between them (``Retry-After`` or backoff) is capped at :data:`RETRY_WAIT_CAP_S` seconds,
so a provider that asks for longer shows as failed (the table's caption says so).
"""

from __future__ import annotations

import asyncio
import json
import time
import unicodedata
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any
from collections.abc import Coroutine, Iterable, Sequence

import aiohttp

from .. import traits
from ..content import content_text
from ..jsonl import is_count
from .body import ResponseTooLarge, read_capped
from .budget import cost_of
from .classify import TRANSPORT_FAILURES, Outcome, classify_exception, classify_response, classify_too_large
from .request import build_request
from .prompts import Sample
from .secrets import ApiKey, check_api_key, scrub, scrub_bytes
from .settings import MAX_RESPONSE_BYTES, Reasoning, RequestSettings, check_base_url

if TYPE_CHECKING:
    from rich.table import Table

    from ..chat import Dialect
    from ..tokenizer import Tokenizer

__all__ = ["ECHO_TESTS", "INVISIBLE_EDITS", "classify_echo", "PROBE_PROMPTS", "RETRY_WAIT_CAP_S", "EchoCall", "ProbeCall", "ProviderReport", "aprobe",
           "probe", "render_profiles", "render_table"]

#: Longest wait between two tries of one probe prompt, whatever ``Retry-After`` asks.
RETRY_WAIT_CAP_S = 8.0

_TOOLS_TEXT = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                    "required": ["city"],
                },
            },
        }
    ]
)

#: (name, messages) of the probe prompts.
PROBE_PROMPTS: tuple[tuple[str, list[dict[str, str]]], ...] = (
    ("greeting", [{"role": "user", "content": "Hi! Greet me back in one short sentence."}]),
    (
        "tool_call",
        [
            {
                "role": "system",
                "content": "You are a helpful assistant with access to these tools (OpenAI function format):\n"
                + _TOOLS_TEXT
                + "\nWhen a tool is needed, call it with your native tool-call format.",
            },
            {"role": "user", "content": "What's the weather in Paris right now? Use the get_weather tool."},
        ],
    ),
    ("cjk", [{"role": "user", "content": "请用两句话介绍长城，然后用日语说「ありがとうございます」。"}]),
)


#: Markers around the text an echo test asks the model to repeat (the emulator's synthetic
#: model echoes exactly what sits between them).
ECHO_BEGIN, ECHO_END = "<<<ECHO\n", "\nECHO>>>"

#: (name, text) of the echo tests.
ECHO_TESTS: tuple[tuple[str, str], ...] = (
    ("decomposed", "Cafe\u0301 cre\u0300me bru\u0302le\u0301e, an\u0303o."),  # NFC composes these
    ("compatibility", "\ufb01ne \ufb02ow \u2460 \uff21\uff22\uff23 x\u00b2"),  # NFKC folds these, NFC keeps them
    ("crlf", "one\r\ntwo\r\nthree"),
    ("edges", "\n\n  indented line  \n"),
)

#: Text edits an echo can reveal, tried in this order: (name, edit).
_EDITS = (
    ("nfc", lambda t: unicodedata.normalize("NFC", t)),
    ("nfkc", lambda t: unicodedata.normalize("NFKC", t)),
    ("crlf_to_lf", lambda t: t.replace("\r\n", "\n")),
    ("strip", str.strip),
    ("marker_spaces", lambda t: " " + t),
)

#: Edits that change the text but may keep its token count: invisible to the gate per sample
#: (``reconstruct --provider-profile`` reads them back).
INVISIBLE_EDITS = frozenset(traits.INVISIBLE_EDITS)


@dataclass
class EchoCall:
    """One echo test sent to one provider: what came back, and which edit explains it."""

    provider: str
    test: str
    ok: bool
    verdict: str  # kept | edited | unclear (the model did not echo) | failed (no response)
    edit: str | None = None
    error: str | None = None


def classify_echo(sent: str, content: str | None) -> tuple[str, str | None]:
    """(verdict, edit) for an echo of ``sent`` that came back as ``content``."""
    if content is None:
        return "unclear", None
    if content == sent:
        return "kept", None
    for name, edit in _EDITS:
        if edit(sent) != sent and content == edit(sent):
            return "edited", name
    return "unclear", None


@dataclass
class ProbeCall:
    """One probe prompt sent to one provider."""

    provider: str
    prompt: str
    available: bool
    ok: bool
    http_status: int | None = None
    error: str | None = None
    served_by: str | None = None
    latency_s: float | None = None
    cost: float | None = None
    finish_reason: str | None = None
    reasoning_present: bool | None = None
    end_marker_leak: bool | None = None
    think_marker_leak: bool | None = None
    tool_markers: str | None = None  # raw | parsed | none (tool prompt only)
    prompt_tokens: tuple[int, int | None] | None = None  # (ours, provider's)
    completion_tokens: tuple[int, int | None] | None = None
    findings: list[str] = field(default_factory=list)

    @property
    def usage_parity(self) -> bool | None:
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return all(theirs is not None and ours == theirs for ours, theirs in (self.prompt_tokens, self.completion_tokens))


@dataclass
class ProviderReport:
    provider: str
    calls: list[ProbeCall]
    echoes: list[EchoCall] = field(default_factory=list)
    #: whether ``logprobs`` / ``token_ids`` came back when asked (None: the call failed)
    logprobs: bool | None = None
    token_ids: bool | None = None

    def profile(self) -> dict[str, Any]:
        """What the echo tests and the evidence call found: the provider profile. Where no
        echo test was answered, the edits are not known (``None``), never "none"."""
        answered = any(e.verdict != "failed" for e in self.echoes)
        edits = sorted({e.edit for e in self.echoes if e.edit}) if answered else None
        return {
            "provider": self.provider,
            "text_edits": edits,
            "edits_invisibly": sorted(INVISIBLE_EDITS.intersection(edits)) if edits is not None else None,
            "echo": {e.test: e.edit or e.verdict for e in self.echoes},
            "logprobs": self.logprobs,
            "token_ids": self.token_ids,
        }

    @property
    def available(self) -> bool | None:
        """True when the provider answered (a completion, or an HTTP error other than "no
        endpoints"), False when it said it serves no such endpoint, None when no call
        reached it (a connection error says nothing about the provider)."""
        if any(c.ok or (c.available and c.http_status is not None) for c in self.calls):
            return True
        if any(not c.available for c in self.calls):
            return False
        return None

    def summary(self) -> dict[str, Any]:
        ok = [c for c in self.calls if c.ok]
        tool = next((c.tool_markers for c in ok if c.prompt == "tool_call"), None)
        lat = [c.latency_s for c in ok if c.latency_s is not None]
        costs = [c.cost for c in ok if c.cost is not None]
        parity = [c.usage_parity for c in ok]
        return {
            "provider": self.provider,
            "available": self.available,
            "ok": f"{len(ok)}/{len(self.calls)}",
            "reasoning_present": _share(c.reasoning_present for c in ok),
            "end_marker_leak": _share(c.end_marker_leak for c in ok),
            "think_marker_leak": _share(c.think_marker_leak for c in ok),
            "tool_markers": tool,
            "usage_parity": _share(parity),
            "latency_s": sum(lat) / len(lat) if lat else None,
            "cost": sum(costs) if costs else None,
            "errors": sorted({c.error for c in self.calls if c.error}),
        }

    def to_dict(self) -> dict[str, Any]:
        calls = []
        for c in self.calls:
            d = asdict(c)
            d["usage_parity"] = c.usage_parity
            calls.append(d)
        return {**self.summary(), "calls": calls, "profile": self.profile()}


def _share(values: Iterable[bool | None]) -> str | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return f"{sum(bool(v) for v in vals)}/{len(vals)}"


async def aprobe(
    *,
    model: str,
    providers: Sequence[str],
    base_url: str,
    key: ApiKey | None,
    tokenizer: Tokenizer,
    dialect: Dialect | None = None,
    max_tokens: int = 2048,
    reasoning: Reasoning | None = None,
    timeout_s: float = 300.0,
    attempts: int = 3,
    extra_body: dict[str, Any] | None = None,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
) -> list[ProviderReport]:
    """Probe every provider with every probe prompt (all concurrently). A body over
    ``max_response_bytes`` (generate's setting, its default too) is refused while it is read."""
    from ..chat import resolve_dialect

    check_base_url(base_url, "probe")
    check_api_key(key, extra_body=extra_body)
    dialect = dialect or resolve_dialect(tokenizer)
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key.value}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        sender = _Sender(session, url, headers, key, attempts, max_response_bytes)
        jobs: list[Coroutine[Any, Any, ProbeCall | EchoCall | _Evidence]] = []
        for p in providers:
            rs = RequestSettings(
                model=model,
                max_tokens=max_tokens,
                reasoning=reasoning if reasoning is not None else {"enabled": True},
                provider={"only": [p], "allow_fallbacks": False},
                extra_body=extra_body or {},
            )
            for name, messages in PROBE_PROMPTS:
                request = build_request(Sample(f"probe-{name}", "probe", messages), rs)
                jobs.append(_one(sender, provider=p, name=name, request=request, tok=tokenizer, dialect=dialect))
            for name, text in ECHO_TESTS:
                messages = [{"role": "user", "content": "Repeat the text between the markers exactly, every "
                             f"character and space, and write nothing else.\n{ECHO_BEGIN}{text}{ECHO_END}"}]
                request = build_request(Sample(f"echo-{name}", "probe", messages), rs)
                jobs.append(_echo(sender, provider=p, name=name, text=text, request=request))
            request = build_request(Sample("probe-evidence", "probe", PROBE_PROMPTS[0][1]), rs)
            request.update(logprobs=True, top_logprobs=1, return_token_ids=True)
            jobs.append(_evidence(sender, provider=p, request=request))
        results = await asyncio.gather(*jobs)
    reports = []
    for p in providers:
        rep = ProviderReport(p, [c for c in results if isinstance(c, ProbeCall) and c.provider == p],
                             [e for e in results if isinstance(e, EchoCall) and e.provider == p])
        rep.logprobs, rep.token_ids = next(ev for prov, *ev in (r for r in results if isinstance(r, tuple))
                                           if prov == p)
        reports.append(rep)
    return reports


def probe(**kwargs: Any) -> list[ProviderReport]:
    """Blocking :func:`aprobe`."""
    return asyncio.run(aprobe(**kwargs))


async def _one(sender: _Sender, *, provider: str, name: str, request: dict[str, Any], tok: Tokenizer,
               dialect: Dialect) -> ProbeCall:
    outcome, parsed, status, latency = await sender.send(request)
    call = ProbeCall(provider, name, available=outcome.kind != "unavailable", ok=outcome.kind == "ok",
                     http_status=status, latency_s=latency)
    if outcome.kind != "ok":
        call.error = scrub(f"{outcome.error_class}: {outcome.message}", sender.key)
        return call
    _inspect(call, request, parsed, tok, dialect)
    return call


async def _echo(sender: _Sender, *, provider: str, name: str, text: str, request: dict[str, Any]) -> EchoCall:
    outcome, parsed, _, _ = await sender.send(request)
    if outcome.kind != "ok":
        error = scrub(f"{outcome.error_class}: {outcome.message}", sender.key)
        return EchoCall(provider, name, False, "failed", error=error)
    message = _first(_first(parsed, "choices"), "message")
    content = message.get("content") if message is not None else None
    verdict, edit = classify_echo(text, content if isinstance(content, str) else None)
    return EchoCall(provider, name, True, verdict, edit)


def _first(parent: Any, key: str) -> dict[str, Any] | None:
    """``parent[key]`` where it is an object (``choices``: its first item), else None: the
    body is the API's, and a probe reads nothing of it on trust."""
    value = parent.get(key) if isinstance(parent, dict) else None
    if key == "choices":
        value = value[0] if isinstance(value, list) and value else None
    return value if isinstance(value, dict) else None


#: (provider, logprobs came back, token ids came back); None where the call failed.
_Evidence = tuple[str, bool | None, bool | None]


async def _evidence(sender: _Sender, *, provider: str, request: dict[str, Any]) -> _Evidence:
    """(provider, logprobs came back, token ids came back) for a call that asks for both."""
    outcome, parsed, _, _ = await sender.send(request)
    choice = _first(parsed, "choices")
    if outcome.kind != "ok" or choice is None:
        return provider, None, None
    lp = choice.get("logprobs")
    has_lp = isinstance(lp, dict) and isinstance(lp.get("content"), list) and bool(lp["content"])
    ids = choice.get("token_ids") or choice.get("response_token_ids")  # vLLM's name, SGLang's
    return provider, has_lp, isinstance(ids, list) and bool(ids)


@dataclass(frozen=True)
class _Sender:
    """How every probe call goes out: one session, the endpoint and its headers, the key
    (masked out of every body), the tries, and the size a body may reach while it is read."""

    session: aiohttp.ClientSession
    url: str
    headers: dict[str, str]
    key: ApiKey | None
    attempts: int
    max_response_bytes: int

    async def send(self, request: dict[str, Any]) -> tuple[Outcome, Any, int | None, float | None]:
        """POST ``request`` with up to ``attempts`` tries; (outcome, parsed body, status, latency)."""
        body = json.dumps(request, ensure_ascii=False).encode()
        outcome: Outcome = Outcome("retry", "not_sent")
        parsed = None
        status = None
        latency = None
        for attempt in range(self.attempts):
            t0 = time.monotonic()
            outcome, parsed, status = await self._try(body)
            latency = time.monotonic() - t0
            if not outcome.retryable:
                break
            if attempt + 1 < self.attempts:
                await asyncio.sleep(min(RETRY_WAIT_CAP_S, outcome.retry_after or 0.5 * 2**attempt))
        return outcome, parsed, status, latency

    async def _try(self, body: bytes) -> tuple[Outcome, Any, int | None]:
        """One try: (outcome, parsed body, status). A body is read only up to
        ``max_response_bytes`` (:func:`~.body.read_capped`, as generate reads it)."""
        status = None
        headers: Any = {}
        try:
            # a redirect is not followed, as generate does not (see classify's 3xx)
            async with self.session.post(self.url, data=body, headers=self.headers, allow_redirects=False) as resp:
                status, headers = resp.status, resp.headers
                raw = scrub_bytes(await read_capped(resp, self.max_response_bytes), self.key)  # masked before any clip
                outcome, parsed = classify_response(status, resp.headers, raw, key=self.key)
                return outcome, parsed, status
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except ResponseTooLarge as exc:
            return classify_too_large(status, headers, exc), None, status
        except TRANSPORT_FAILURES as exc:  # reported in the table; anything else is a bug
            return classify_exception(exc), None, None


_THINK_LEAKS = frozenset({"think_marker_in_content", "think_marker_in_reasoning"})


def _inspect(call: ProbeCall, request: dict[str, Any], response: Any, tok: Any, dialect: Any) -> None:
    """Fill ``call`` from one answer. Every field is the API's: a body out of the shape
    reconstruct reads is reported as reconstruct would report it, never read on trust."""
    from ..chat import RENDER_FAILURES, message_reasoning
    from ..exchanges import RecordError, check_response
    from ..reconstruct import reconstruct_record

    try:
        choices = check_response(response).choices
    except RecordError as exc:
        call.findings.append(f"reconstruct_failed: RecordError: {exc}")
        return
    if not choices:
        call.findings.append("reconstruct_failed: the response has no choices")
        return
    choice, message = choices[0], choices[0]["message"]
    content = content_text(message.get("content"))
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else None
    call.served_by = response.get("provider") if isinstance(response.get("provider"), str) else None
    call.cost = cost_of(usage, None)
    call.finish_reason = choice.get("finish_reason")
    call.reasoning_present = bool((message_reasoning(message) or "").strip())
    if call.prompt == "tool_call":
        markers = dialect.tool_markers.all if dialect.tool_markers is not None else ()
        if message.get("tool_calls"):
            call.tool_markers = "parsed"
        elif any(m in content for m in markers):
            call.tool_markers = "raw"
        else:
            call.tool_markers = "none"
    record = {"id": f"probe-{call.provider}-{call.prompt}", "dataset": "probe", "request": request, "response": response}
    reported: tuple[type[Exception], ...] = (RecordError, *RENDER_FAILURES)  # what the response or template broke
    try:
        rows = reconstruct_record(record, tok, dialect)
    except reported as exc:  # a probe reports, a bug keeps its traceback
        call.findings.append(f"reconstruct_failed: {type(exc).__name__}: {exc}")
        return
    row = rows[0]
    call.findings = sorted({f["code"] for r in rows for f in r["findings"]})
    call.end_marker_leak = "eos_in_text" in call.findings
    call.think_marker_leak = not _THINK_LEAKS.isdisjoint(call.findings)
    completion = sum(len(r["completion_ids"]) for r in rows)
    call.prompt_tokens = (len(row["prompt_ids"]), _count(usage, "prompt_tokens"))
    call.completion_tokens = (completion, _count(usage, "completion_tokens"))


def _count(usage: dict[str, Any] | None, name: str) -> int | None:
    """A token count of ``usage``, where it is one (a string or a negative is none)."""
    value = (usage or {}).get(name)
    return value if is_count(value) else None


def probe_caption(attempts: int) -> str:
    """What the table's columns mean; "ok" alone read as "this provider is fine"."""
    return (
        f"answered: probe prompts that got a completion back (after up to {attempts} tries each; waits, "
        f"Retry-After included, capped at {RETRY_WAIT_CAP_S:.0f} s), good or not. The columns after it judge "
        "those answers: a leak or a usage-parity miss means the exact tokens do not survive that provider."
    )


def render_table(reports: list[ProviderReport], attempts: int = 3) -> Table:
    """A rich Table: one row per provider."""
    from rich.table import Table
    from rich.text import Text

    from ..display import printable

    table = Table(title="provider probe", caption=probe_caption(attempts))
    for col in ("provider", "available", "answered", "reasoning", "end-marker leak", "think-marker leak",
                "tool markers", "usage parity", "latency s", "cost $"):
        table.add_column(col)
    for rep in reports:
        s = rep.summary()
        table.add_row(
            Text(printable(s["provider"])),  # a name the user or the API gave: never markup
            {True: "yes", False: "none", None: "unknown (not reached)"}[s["available"]],
            s["ok"],
            s["reasoning_present"] or "-",
            s["end_marker_leak"] or "-",
            s["think_marker_leak"] or "-",
            s["tool_markers"] or "-",
            s["usage_parity"] or "-",
            f"{s['latency_s']:.2f}" if s["latency_s"] is not None else "-",
            f"{s['cost']:.6f}" if s["cost"] is not None else "-",
        )
    return table


def render_profiles(reports: list[ProviderReport]) -> Table:
    """A rich Table: what each provider does to text, and which evidence it returns."""
    from rich.table import Table
    from rich.text import Text

    from ..display import printable

    table = Table(title="provider profile (echo tests)",
                  caption="edits in bold can keep the token count: the gate cannot see them per sample")
    for col in ("provider", "text edits", *(name for name, _ in ECHO_TESTS), "logprobs", "token ids"):
        table.add_column(col)
    for rep in reports:
        prof = rep.profile()
        if prof["text_edits"] is None:
            edits = "unknown (no echo answered)"
        else:
            edits = ", ".join(f"[bold]{e}[/bold]" if e in INVISIBLE_EDITS else e for e in prof["text_edits"]) or "none"
        table.add_row(Text(printable(rep.provider)), edits, *(prof["echo"].get(name, "-") for name, _ in ECHO_TESTS),
                      _yes_no(prof["logprobs"]), _yes_no(prof["token_ids"]))
    return table


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"

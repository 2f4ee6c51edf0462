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

A probe is a quick look, not a run: each prompt gets ``attempts`` tries, and a wait
between them (``Retry-After`` or backoff) is capped at :data:`RETRY_WAIT_CAP_S` seconds,
so a provider that asks for longer shows as failed (the table's caption says so).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import aiohttp

from .budget import cost_of
from .classify import Outcome, classify_exception, classify_response
from .request import build_request
from .prompts import Sample
from .secrets import ApiKey, scrub
from .settings import RequestSettings, check_base_url

__all__ = ["PROBE_PROMPTS", "RETRY_WAIT_CAP_S", "ProbeCall", "ProviderReport", "aprobe", "probe", "render_table"]

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

    @property
    def available(self) -> bool:
        return any(c.available for c in self.calls)

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
        return {**self.summary(), "calls": calls}


def _share(values) -> str | None:
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
    tokenizer: Any,
    dialect: Any = None,
    max_tokens: int = 2048,
    reasoning: dict[str, Any] | None = None,
    timeout_s: float = 300.0,
    attempts: int = 3,
    extra_body: dict[str, Any] | None = None,
) -> list[ProviderReport]:
    """Probe every provider with every probe prompt (all concurrently)."""
    from ..chat import resolve_dialect

    check_base_url(base_url, "probe")
    dialect = dialect or resolve_dialect(tokenizer)
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key.value}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        jobs = []
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
                jobs.append(_one(session, url, headers, key, p, name, request, tokenizer, dialect, attempts))
        calls = await asyncio.gather(*jobs)
    return [ProviderReport(p, [c for c in calls if c.provider == p]) for p in providers]


def probe(**kwargs: Any) -> list[ProviderReport]:
    """Blocking :func:`aprobe`."""
    return asyncio.run(aprobe(**kwargs))


async def _one(session, url, headers, key, provider, name, request, tok, dialect, attempts) -> ProbeCall:
    body = json.dumps(request, ensure_ascii=False).encode()
    outcome: Outcome = Outcome("retry", "not_sent")
    parsed = None
    status = None
    latency = None
    for attempt in range(attempts):
        t0 = time.monotonic()
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                status = resp.status
                raw = await resp.read()
                outcome, parsed = classify_response(status, resp.headers, raw)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - reported in the table
            outcome, parsed, status = classify_exception(exc), None, None
        latency = time.monotonic() - t0
        if not outcome.retryable:
            break
        if attempt + 1 < attempts:
            await asyncio.sleep(min(RETRY_WAIT_CAP_S, outcome.retry_after or 0.5 * 2**attempt))
    call = ProbeCall(provider, name, available=outcome.kind != "unavailable", ok=outcome.kind == "ok",
                     http_status=status, latency_s=latency)
    if outcome.kind != "ok":
        call.error = scrub(f"{outcome.error_class}: {outcome.message}", key)
        return call
    _inspect(call, request, parsed, tok, dialect)
    return call


_THINK_LEAKS = frozenset({"think_marker_in_content", "think_marker_in_reasoning"})


def _inspect(call: ProbeCall, request: dict, response: dict, tok: Any, dialect: Any) -> None:
    from ..reconstruct import reconstruct_record

    choice = response["choices"][0]
    message = choice.get("message") or {}
    content = message.get("content") or ""
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else None
    call.served_by = response.get("provider")
    call.cost = cost_of(usage, None)
    call.finish_reason = choice.get("finish_reason")
    call.reasoning_present = bool(reasoning.strip())
    if call.prompt == "tool_call":
        markers = dialect.tool_markers.all if dialect.tool_markers is not None else ()
        if message.get("tool_calls"):
            call.tool_markers = "parsed"
        elif any(m in content for m in markers):
            call.tool_markers = "raw"
        else:
            call.tool_markers = "none"
    record = {"id": f"probe-{call.provider}-{call.prompt}", "dataset": "probe", "request": request, "response": response}
    try:
        rows = reconstruct_record(record, tok, dialect)
    except Exception as exc:  # noqa: BLE001 - a probe reports, it does not crash
        call.findings.append(f"reconstruct_failed: {type(exc).__name__}: {exc}")
        return
    row = rows[0]
    call.findings = sorted({f["code"] for r in rows for f in r["findings"]})
    call.end_marker_leak = "eos_in_text" in call.findings
    call.think_marker_leak = not _THINK_LEAKS.isdisjoint(call.findings)
    completion = sum(len(r["completion_ids"]) for r in rows)
    call.prompt_tokens = (len(row["prompt_ids"]), (usage or {}).get("prompt_tokens"))
    call.completion_tokens = (completion, (usage or {}).get("completion_tokens"))


def probe_caption(attempts: int) -> str:
    """What the table's columns mean; "ok" alone read as "this provider is fine"."""
    return (
        f"answered: probe prompts that got a completion back (after up to {attempts} tries each; waits, "
        f"Retry-After included, capped at {RETRY_WAIT_CAP_S:.0f} s), good or not. The columns after it judge "
        "those answers: a leak or a usage-parity miss means the exact tokens do not survive that provider."
    )


def render_table(reports: list[ProviderReport], attempts: int = 3):
    """A rich Table: one row per provider."""
    from rich.table import Table

    table = Table(title="provider probe", caption=probe_caption(attempts))
    for col in ("provider", "available", "answered", "reasoning", "end-marker leak", "think-marker leak",
                "tool markers", "usage parity", "latency s", "cost $"):
        table.add_column(col)
    for rep in reports:
        s = rep.summary()
        table.add_row(
            s["provider"],
            "yes" if s["available"] else "none",
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

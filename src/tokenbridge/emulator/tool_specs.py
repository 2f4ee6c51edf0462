"""Which tools the synthetic model may call, and plausible JSON arguments for them.

Tools come either from the request's ``tools`` parameter (OpenAI format) or, when a
caller describes tools only in the system prompt (tokenbridge's default, so calls come
back as raw marker text), from that text: a JSON tool list, TypeScript-style
``type NAME = (...)`` declarations as Kimi writes them, or a Markdown list of names.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

__all__ = ["ToolSpec", "tools_from_param", "tools_from_text", "make_arguments"]

_IDENT = r"[A-Za-z_][A-Za-z0-9_\-]*"
_TS_DECL = re.compile(rf"\btype\s+({_IDENT})\s*=\s*\(")
_MD_ITEM = re.compile(
    rf"^\s*(?:[-*+]|\d+[.)]|#{{2,4}})\s+(?:\*\*)?`?(?:functions\.)?({_IDENT})`?(?:\*\*)?\s*(\(|:|—|-|$)", re.M
)
_JSON_START = re.compile(r'[\[{]\s*"|\[\s*\{')


@dataclass(frozen=True)
class ToolSpec:
    """A callable tool: its name and (when known) its JSON-schema parameters."""

    name: str
    parameters: Mapping[str, Any] | None = None


def tools_from_param(tools: Sequence[Any] | None) -> list[ToolSpec]:
    """Tools from an OpenAI-style ``tools`` list (unknown shapes are skipped)."""
    out: list[ToolSpec] = []
    for item in tools or ():
        spec = _spec(item)
        if spec is not None and spec.name not in {s.name for s in out}:
            out.append(spec)
    return out


def _spec(item: Any) -> ToolSpec | None:
    if not isinstance(item, Mapping):
        return None
    function = item.get("function")
    fn: Mapping[str, Any] = function if isinstance(function, Mapping) else item
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(_IDENT, name):
        return None
    params = fn.get("parameters", fn.get("input_schema"))
    return ToolSpec(name, params if isinstance(params, Mapping) else None)


def tools_from_text(text: str) -> list[ToolSpec]:
    """Tools offered in a system prompt; empty when the text offers none."""
    if not text or not re.search(r"tool|function", text, re.I):
        return []
    found = _json_tools(text)
    if not found:
        found = [ToolSpec(n) for n in dict.fromkeys(_TS_DECL.findall(text))]
    if not found:
        names = [m.group(1) for m in _MD_ITEM.finditer(text) if "_" in m.group(1) or m.group(2) == "("]
        found = [ToolSpec(n) for n in dict.fromkeys(names)]
    return found


def _json_tools(text: str) -> list[ToolSpec]:
    decoder = json.JSONDecoder()
    out: list[ToolSpec] = []
    pos = 0
    for _ in range(64):  # bounded: a system prompt holds a handful of JSON blocks at most
        m = _JSON_START.search(text, pos)
        if m is None:
            break
        try:
            value, end = decoder.raw_decode(text, m.start())
        except ValueError:
            pos = m.start() + 1
            continue
        items = value if isinstance(value, list) else [value]
        for spec in tools_from_param(items):
            if spec.name not in {s.name for s in out}:
                out.append(spec)
        pos = end
    return out


# --- arguments -------------------------------------------------------------------------

_CITIES = ["Paris", "Tokyo", "São Paulo", "Nairobi", "Berlin", "Toronto", "北京", "Mumbai"]
_WORDS = ["report", "summary", "latest", "status", "release", "price", "forecast", "schedule"]


def make_arguments(rng: random.Random, spec: ToolSpec, topic_phrase: str) -> dict[str, Any]:
    """JSON arguments that fit the tool's schema (or a plain query when it has none)."""
    schema = spec.parameters or {}
    props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else None
    if not props:
        return {"query": topic_phrase}
    required = [k for k in schema.get("required") or () if k in props]
    names = required or list(props)[:3]
    return {name: _value(rng, name, props[name] if isinstance(props[name], Mapping) else {}, topic_phrase)
            for name in names}


def _value(rng: random.Random, name: str, schema: Mapping[str, Any], topic: str) -> Any:  # noqa: PLR0911 - one return per JSON-schema type and name hint
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    low = name.lower()
    if kind in ("integer", "number"):
        lo = schema.get("minimum", 1)
        hi = schema.get("maximum", 100)
        numeric = isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo <= hi
        n = rng.randint(int(lo), int(hi)) if numeric else rng.randint(1, 100)
        return n if kind == "integer" else round(n + rng.random(), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        items = schema.get("items")
        item: Mapping[str, Any] = items if isinstance(items, Mapping) else {}
        return [_value(rng, name, item, topic) for _ in range(rng.randint(1, 3))]
    if kind == "object":
        return {}
    if any(k in low for k in ("city", "location", "place")):
        return rng.choice(_CITIES)
    if "url" in low:
        return f"https://example.com/{rng.choice(_WORDS)}/{rng.randint(1, 999)}"
    if "path" in low or "file" in low:
        return f"src/{rng.choice(_WORDS)}_{rng.randint(1, 9)}.py"
    if "date" in low:
        return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if "lang" in low:
        return rng.choice(["en", "zh", "fr", "ja"])
    return f"{topic} {rng.choice(_WORDS)}" if rng.random() < 0.5 else topic

"""Render a model's own Jinja chat template the way transformers does.

``apply_chat_template`` uses an immutable sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that keeps non-ASCII text, and the ``raise_exception`` / ``strftime_now`` globals; any
difference here would change the prompt bytes and so the prompt ids.

The one difference: a render is bounded in time and size (:mod:`.sandbox`), so a template
that never ends fails its record with a :class:`TemplateError` instead of the run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols

from . import sandbox
from ..jsonl import loads_document
from .dialect import Message, RenderFn


class TemplateError(Exception):
    """The chat template raised (``raise_exception``) or failed to render."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


#: What a template's own code raises on the data it is given (Jinja's errors, and the
#: Python errors of its expressions: ``message['content'] + 1``, ``x[5]``, ``1 / 0``, a
#: recursive macro); anything else is a bug of ours and keeps its traceback.
_TEMPLATE_FAILURES = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                      RecursionError, MemoryError)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = sandbox.environment({"tojson": _tojson}, {"raise_exception": _raise_exception, "strftime_now": _strftime_now},
                              trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    return env.from_string(source)


#: The keys SGLang 0.5.23's message models carry (``ChatCompletionMessageUserParam``, and
#: ``ChatCompletionMessageGenericParam`` for the other roles); pydantic drops any other key
#: before the template runs (gpt-oss's documented ``thinking`` on an assistant turn, say).
_SGLANG_USER_KEYS = frozenset({"role", "content"})
_SGLANG_MESSAGE_KEYS = frozenset({"role", "content", "tool_call_id", "name", "phase", "reasoning_content",
                                  "tool_calls", "tools", "prefix"})


def serving_messages(messages: Sequence[Message], parse_tool_arguments: bool) -> list[dict[str, Any]]:
    """The messages as SGLang 0.5.23 hands them to a chat template: only the keys its
    message models know (the rest never reach the template), ``content: null`` becomes
    ``""`` and keys whose value is null are dropped; with
    ``parse_tool_arguments``, an assistant tool call's JSON-string ``arguments`` become
    the object they encode (SGLang's ``normalize_assistant_tool_call_arguments``), as
    templates that iterate arguments (GLM) or ``tojson`` them (Qwen3) expect. A string
    that is not a JSON object stays as it is (SGLang refuses the request)."""
    out = []
    for m in messages:
        keys = _SGLANG_USER_KEYS if m.get("role") == "user" else _SGLANG_MESSAGE_KEYS
        msg = {k: v for k, v in dict(m).items() if v is not None and k in keys}
        if m.get("content") is None:
            msg["content"] = ""
        calls = msg.get("tool_calls")
        if parse_tool_arguments and msg.get("role") == "assistant" and isinstance(calls, list):
            msg["tool_calls"] = [parsed_call(c) for c in calls]
        out.append(msg)
    return out


def parsed_call(call: Any) -> Any:
    """A tool call whose JSON-string ``arguments`` encode an object, with that object in
    their place (SGLang's ``normalize_assistant_tool_call_arguments``); else the call as given."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = loads_document(fn["arguments"])
    except ValueError:  # JsonLineError: nested too deeply to read too
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**fn, "arguments": args}}


def template_renderer(source: str, special_tokens: Mapping[str, str] | None = None, *,
                      serving: bool = False, parse_tool_arguments: bool = False) -> RenderFn:
    """A render function for a dialect, backed by the Jinja ``source``.

    ``thinking`` is passed as both ``thinking`` (Kimi) and ``enable_thinking`` (Qwen3);
    explicit template kwargs win. With ``serving``, messages are first normalised as the
    serving engine does (:func:`serving_messages`); without it they reach the template
    as given, as in transformers' ``apply_chat_template``.
    """
    try:
        template = compile_template(source)
    except _TEMPLATE_FAILURES as exc:  # the folder's template: its syntax error is the user's to fix
        raise TemplateError(f"chat template does not compile: {type(exc).__name__}: {exc}") from None
    specials = dict(special_tokens or {})

    def render(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None,
               thinking: bool, kwargs: Mapping[str, Any]) -> str:
        context = {**specials, "thinking": thinking, "enable_thinking": thinking, **kwargs}
        msgs = serving_messages(messages, parse_tool_arguments) if serving else [dict(m) for m in messages]
        try:
            # dict(): a kwarg that repeats one of these is a TypeError, as in transformers' render call
            return sandbox.render(template, dict(messages=msgs, tools=list(tools) if tools else None,
                                                  add_generation_prompt=True, **context))
        except TemplateError:
            raise
        except sandbox.RenderStopped as exc:
            raise TemplateError(f"chat template stopped: {exc}") from None
        except _TEMPLATE_FAILURES as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None

    return render


def special_token_strings(config: Mapping[str, Any]) -> dict[str, str]:
    """``bos_token``/``eos_token``/... from a tokenizer_config, as templates see them."""
    out: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        value = config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out

"""Render a model's own Jinja chat template the way transformers does.

``apply_chat_template`` uses an immutable sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that keeps non-ASCII text, and the ``raise_exception`` / ``strftime_now`` globals; any
difference here would change the prompt bytes and so the prompt ids.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .dialect import Message, RenderFn


class TemplateError(Exception):
    """The chat template raised (``raise_exception``) or failed to render."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def template_renderer(source: str, special_tokens: Mapping[str, str] | None = None) -> RenderFn:
    """A render function for a dialect, backed by the Jinja ``source``.

    ``thinking`` is passed as both ``thinking`` (Kimi) and ``enable_thinking`` (Qwen3);
    explicit template kwargs win.
    """
    template = compile_template(source)
    specials = dict(special_tokens or {})

    def render(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None,
               thinking: bool, kwargs: Mapping[str, Any]) -> str:
        context = {**specials, "thinking": thinking, "enable_thinking": thinking, **kwargs}
        try:
            return template.render(
                messages=[dict(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                **context,
            )
        except TemplateError:
            raise
        except Exception as exc:
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

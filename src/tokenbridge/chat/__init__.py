"""Chat formats ("dialects"): render the prompt as the serving side does, and assemble
the completion the model wrote from an API message.

Adding a family means one small module that defines a :class:`Dialect` and one line in
``DIALECTS``.
"""

from __future__ import annotations

from ..tokenizer import Tokenizer
from .dialect import PART_KINDS, Dialect, ToolMarkers, message_reasoning, thinking_enabled
from .kimi import KIMI_K25
from .qwen3 import QWEN3
from .template import TemplateError, special_token_strings, template_renderer

__all__ = [
    "DIALECTS",
    "PART_KINDS",
    "Dialect",
    "DialectError",
    "TemplateError",
    "ToolMarkers",
    "message_reasoning",
    "resolve_dialect",
    "thinking_enabled",
]

DIALECTS: dict[str, Dialect] = {d.name: d for d in (KIMI_K25, QWEN3)}


class DialectError(Exception):
    """No dialect fits the tokenizer, or the name is unknown."""


def _family(tokenizer: Tokenizer) -> Dialect | None:
    markers = tokenizer.markers
    if "<|im_middle|>" in markers and "<|im_assistant|>" in markers:
        return KIMI_K25
    if "<|im_start|>" in markers and "<|im_end|>" in markers:
        return QWEN3
    return None


def resolve_dialect(tokenizer: Tokenizer, name: str | None = None, *, use_template: bool = True) -> Dialect:
    """The dialect for ``tokenizer``.

    ``name`` picks a built-in family; otherwise the family is recognised from the
    tokenizer's marker tokens. When the tokenizer folder ships its own chat template
    (and ``use_template``), prompts are rendered with it, exactly as transformers would,
    while the family supplies the completion markers.
    """
    if name is not None:
        try:
            family = DIALECTS[name]
        except KeyError:
            raise DialectError(f"unknown dialect {name!r}; known: {', '.join(sorted(DIALECTS))}") from None
    else:
        family = _family(tokenizer)
        if family is None:
            raise DialectError(
                f"{tokenizer.source}: cannot tell the chat format from its tokens; pass --dialect "
                f"({', '.join(sorted(DIALECTS))})"
            )
    if use_template and tokenizer.chat_template:
        render = template_renderer(tokenizer.chat_template, special_token_strings(tokenizer.config))
        return family.with_render(render, name=f"{family.name}+template")
    return family

"""Chat formats ("dialects"): render the prompt as the serving side does, and assemble
the completion the model wrote from an API message.

Adding a family means one small module that defines a :class:`Dialect`, one line in
``DIALECTS`` and its signature tokens in ``_SIGNATURES``.
"""

from __future__ import annotations

from ..tokenizer import Tokenizer
from .deepseek import DEEPSEEK_V31
from .deepseek_v32 import DEEPSEEK_V32
from .dialect import PART_KINDS, Dialect, PromptReading, ToolMarkers, message_reasoning, thinking_enabled
from .generic import generic_dialect
from .glm import GLM45
from .harmony import GPT_OSS, GPT_OSS_HARMONY, HarmonyDialect
from .kimi import KIMI_K25
from .qwen3 import QWEN3
from .parts import sglang_content_format, vllm_content_format
from .template import TemplateError, special_token_strings, template_renderer

__all__ = [
    "DIALECTS",
    "PART_KINDS",
    "Dialect",
    "RENDER_FAILURES",
    "DialectError",
    "HarmonyDialect",
    "PromptReading",
    "TemplateError",
    "ToolMarkers",
    "message_reasoning",
    "resolve_dialect",
    "thinking_enabled",
]

#: What rendering a request can raise on data it does not fit: a template's own error and
#: a built-in renderer's on a field of the wrong shape or value (tool-call arguments that
#: are not JSON, a missing key). Callers that report a bad record catch these, not Exception.
RENDER_FAILURES: tuple[type[Exception], ...] = (TemplateError, ValueError, LookupError, TypeError)

DIALECTS: dict[str, Dialect] = {d.name: d for d in (KIMI_K25, QWEN3, DEEPSEEK_V31, DEEPSEEK_V32, GLM45, GPT_OSS, GPT_OSS_HARMONY)}


class DialectError(Exception):
    """No dialect fits the tokenizer, or the name is unknown."""


#: Each family's signature tokens, in the order families are recognised (model types in the
#: tokenizers' own words: Kimi's ``<|im_middle|>``, DeepSeek's ``<｜Assistant｜>``, GLM's
#: ``[gMASK]``, harmony's ``<|channel|>`` + ``<|call|>``, ChatML's ``<|im_start|>``). A
#: tokenizer without a family's signature cannot write that family's markers as tokens.
_SIGNATURES: tuple[tuple[Dialect, tuple[str, ...]], ...] = (
    (KIMI_K25, ("<|im_middle|>", "<|im_assistant|>")),
    (DEEPSEEK_V32, ("<｜Assistant｜>", "｜DSML｜")),
    (DEEPSEEK_V31, ("<｜Assistant｜>", "<｜tool▁sep｜>")),
    (GLM45, ("[gMASK]", "<|observation|>")),
    (GPT_OSS, ("<|channel|>", "<|message|>", "<|call|>", "<|return|>")),
    (QWEN3, ("<|im_start|>", "<|im_end|>")),
)
_SIGNATURES_BY_NAME = {**{d.name: sig for d, sig in _SIGNATURES}, GPT_OSS_HARMONY.name: dict(_SIGNATURES)[GPT_OSS]}


def _family(tokenizer: Tokenizer) -> Dialect | None:
    """The first family whose signature tokens the tokenizer holds."""
    markers = tokenizer.markers
    for dialect, signature in _SIGNATURES:
        if all(m in markers for m in signature):
            return dialect
    return None


def resolve_dialect(tokenizer: Tokenizer, name: str | None = None, *, use_template: bool = True) -> Dialect:
    """The dialect for ``tokenizer``.

    ``name`` picks a built-in family; otherwise the family is recognised from the
    tokenizer's marker tokens. When the tokenizer folder ships its own chat template
    (and ``use_template``), prompts are rendered with it, exactly as transformers would,
    from the messages as SGLang hands them over (:func:`.template.serving_messages`),
    while the family supplies the completion markers. A folder whose family is unknown
    but which has a template gets the generic dialect: its prompts are the template's,
    and the gate flags every sample ``completion_unproven``.
    """
    try:
        return _resolved(tokenizer, name, use_template)
    except TemplateError as exc:  # the folder's template does not compile: the folder is the user's to fix
        raise DialectError(f"{tokenizer.source}: {exc}") from None


def _resolved(tokenizer: Tokenizer, name: str | None, use_template: bool) -> Dialect:
    family: Dialect | None
    if name is not None:
        try:
            family = DIALECTS[name]
        except KeyError:
            raise DialectError(f"unknown dialect {name!r}; known: {', '.join(sorted(DIALECTS))}") from None
        missing = [m for m in _SIGNATURES_BY_NAME.get(name, ()) if m not in tokenizer.markers]
        if missing:  # every sample would be rendered with text where the model has a token, and rejected
            found = _family(tokenizer)
            raise DialectError(
                f"{tokenizer.source}: the {name} dialect needs the token(s) {', '.join(missing)}, which this tokenizer "
                f"does not have" + (f" (it is {found.name}'s: drop the dialect or give {found.name})" if found else ""))
    else:
        family = _family(tokenizer)
        if family is None:
            if tokenizer.chat_template and use_template:
                family = generic_dialect(tokenizer)
            else:
                raise DialectError(
                    f"{tokenizer.source}: cannot tell the chat format from its tokens; pass --dialect "
                    f"({', '.join(sorted(DIALECTS))})"
                )
    if use_template and tokenizer.chat_template and not family.own_renderer:
        render = template_renderer(tokenizer.chat_template, special_token_strings(tokenizer.config), serving=True,
                                   parse_tool_arguments=family.parse_tool_arguments)
        formats = (sglang_content_format(tokenizer.chat_template), vllm_content_format(tokenizer.chat_template))
        return family.with_render(render, name=f"{family.name}+template", content_formats=formats)
    if family.render is None:
        raise DialectError(
            f"{tokenizer.source}: the {family.name} dialect renders prompts only with the folder's chat template, "
            "and this folder has none"
        )
    return family

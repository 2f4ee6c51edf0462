"""A chat message's ``content`` as APIs send it: a string, a list of typed parts, or null.

:func:`content_text` is the one reading of it as text, for the completion we rebuild,
the readings the evidence weighs, the Qwen3 prompt and the conversations export.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["content_text", "is_text_parts"]


def content_text(content: object) -> str:
    """The text of ``content``: a string as it is, a list of parts as the text of the parts
    that carry one (``{"type": "text", "text": ...}``; an image part adds nothing), joined
    with nothing between them; null (or anything else) as ``""``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def is_text_parts(content: object) -> bool:
    """A list of parts that are all ``type: text`` (so the list says nothing its text does not)."""
    return isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content)

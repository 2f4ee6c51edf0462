"""Text from outside (provider names, API error messages) made safe to show.

A provider name is data, never a command to whatever displays it: an ANSI/OSC escape
would retitle or recolour the user's terminal, a bidi override would reorder a line, and
an ESC byte is not even valid in the report's SVG figures. :func:`printable` writes every
control character as a visible escape (``\\x1b``); markup (rich ``[red]``, matplotlib
``$...$``, HTML ``<``) is the caller's to escape, or to switch off where it renders.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

#: C0 and C1 controls, DEL, the bidi marks and embedding/override/isolate controls, the
#: invisible characters that make two names look alike (zero-width space, joiners, word
#: joiner, invisible operators, byte-order mark, soft hyphen), the line and paragraph
#: separators that break a line where none shows, and lone surrogates (not text: they
#: cannot even be written as UTF-8).
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\xad\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]"
)


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    if c == 0x0A:
        return "\\n"
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str) -> str:
    """``text`` with every control, invisible or lone-surrogate character shown as an
    escape; other text unchanged."""
    return _UNSAFE.sub(_escape, text)

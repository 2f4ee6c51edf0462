"""Text from outside (provider names, API error messages) made safe to show.

A provider name is data, never a command to whatever displays it: an ANSI/OSC escape
would retitle or recolour the user's terminal, a bidi override would reorder a line, and
an ESC byte is not even valid in the report's SVG figures. :func:`printable` writes every
control character as a visible escape (``\\x1b``); markup (rich ``[red]``, matplotlib
``$...$``, HTML ``<``) is the caller's to escape, or to switch off where it renders.
"""

from __future__ import annotations

from typing import TypeVar
from collections.abc import Callable, Sequence

__all__ = ["printable", "problems_of", "several"]

E = TypeVar("E", bound=BaseException)

#: Characters ``str.isprintable`` passes that still show nothing: fillers, the combining
#: grapheme joiner, variation selectors, Mongolian free variation selectors.
_INVISIBLE = frozenset(
    "\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u3164\uffa0"
    + "".join(map(chr, range(0xFE00, 0xFE10))) + "".join(map(chr, range(0xE0100, 0xE01F0)))
)


def _escape(c: str) -> str:
    n = ord(c)
    if n == 0x0A:
        return "\\n"
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def printable(text: str) -> str:
    """``text`` with every character that is not plain visible text shown as an escape:
    controls (C0, C1, DEL), format characters (bidi controls, zero-width characters, tag
    characters, the byte-order mark, the soft hyphen), line and paragraph separators,
    spaces other than the ASCII space, lone surrogates, private-use and unassigned code
    points (everything ``str.isprintable`` refuses), and the invisible letters and marks
    in :data:`_INVISIBLE`. Other text is unchanged."""
    if text.isprintable() and _INVISIBLE.isdisjoint(text):
        return text
    return "".join(c if c.isprintable() and c not in _INVISIBLE else _escape(c) for c in text)


def several(make: Callable[[str], E], problems: Sequence[str]) -> E:
    """``make(message)``, the message the problems joined by newlines, carrying them one by
    one as ``problems``: the CLI prints an ``error:`` line each, and a line break inside one
    (a path that holds one) is data there, shown escaped, never a line of its own."""
    exc = make("\n".join(problems))
    exc.problems = tuple(problems)  # type: ignore[attr-defined]
    return exc


def problems_of(exc: BaseException) -> tuple[str, ...]:
    """The problems :func:`several` gave ``exc``, else its text as the one."""
    return tuple(getattr(exc, "problems", ())) or (str(exc),)

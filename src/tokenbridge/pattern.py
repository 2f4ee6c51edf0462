"""A pre-tokenizer pattern rewritten so tiktoken's regex engine runs most of it natively.

tiktoken compiles ``pat_str`` with ``fancy_regex``. A pattern with any look-around
(every GPT-4-style pattern ends ``\\s+(?!\\S)|\\s+``) is run by fancy_regex's backtracking
VM, which tries the top-level alternatives one by one and hands each plain one to the
``regex`` crate separately. Wrapped in one non-capturing group, a run of plain
alternatives is a single ``regex``-crate search instead: same pieces, same ids, and on
Kimi's pattern a quarter less encode time (bench/RESULTS.md).

Why the pieces cannot change: ordered alternation is associative. ``A|B|C`` and
``(?:A|B)|C`` try A, then B, then C at each position and take the first that matches;
nothing follows the group inside its alternative, so nothing can backtrack into it, and
the ``regex`` crate's leftmost-first match of ``A|B`` at a position is the one a
backtracking engine finds. A non-capturing group renumbers no capture group. The one
thing a group would change is the reach of a bare inline flag (``(?i)`` applies to the
rest of the pattern, but only to the end of an enclosing group), so a pattern with one
is returned unchanged, as is any pattern this reader does not fully understand.
"""

from __future__ import annotations

import re

__all__ = ["grouped_pattern", "top_level_alternatives"]

#: What makes an alternative something the ``regex`` crate cannot run (fancy_regex's
#: additions): look-around, atomic groups, conditionals, backreferences, ``\K``/``\G``,
#: and possessive quantifiers. Tested on the alternative's text with escapes kept, so a
#: false hit (``\\(?=`` as a literal) only leaves that alternative ungrouped: slower,
#: never wrong.
_FANCY = re.compile(r"\(\?(?:<?[=!]|>|\()|\\[1-9kKgG]|(?<!\\)[*+?}]\+")

#: A bare inline-flag group, ``(?i)`` or ``(?-u)``: its reach would end at our group.
_BARE_FLAGS = re.compile(r"\(\?[a-zA-Z-]+\)")


def top_level_alternatives(pattern: str) -> list[str] | None:
    """``pattern`` split at its top-level ``|`` (outside groups, character classes and
    escapes), or None where its brackets do not balance."""
    parts: list[str] = []
    depth = klass = 0
    start = i = 0
    n = len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a class, or one nested in a class
            klass += 1
            # a ']' first in a class (after an optional '^') is a literal
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            if pattern[j : j + 1] == "]":
                i = j
        elif klass:
            if c == "]":
                klass -= 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                return None
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    if depth or klass or i > n:  # unbalanced, or a pattern ending in a lone backslash
        return None
    parts.append(pattern[start:])
    return parts


def grouped_pattern(pattern: str) -> str:
    """``pattern`` with each run of two or more consecutive plain top-level alternatives
    in one non-capturing group; the same pattern where there is nothing to gain or it
    cannot be read with certainty."""
    parts = top_level_alternatives(pattern)
    if parts is None or _BARE_FLAGS.search(pattern) or not any(_FANCY.search(part) for part in parts):
        return pattern  # unreadable, a flag's reach at stake, or the regex crate runs it all already
    out: list[str] = []
    run: list[str] = []
    for part in [*parts, None]:
        if part is not None and not _FANCY.search(part):
            run.append(part)
            continue
        if len(run) > 1:
            out.append("(?:" + "|".join(run) + ")")
        else:
            out.extend(run)
        run = []
        if part is not None:
            out.append(part)
    grouped = "|".join(out)
    return grouped if len(out) < len(parts) else pattern

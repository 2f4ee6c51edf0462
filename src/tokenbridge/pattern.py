"""The pre-tokenizer patterns tokenbridge knows, and each one regrouped so tiktoken's regex
engine runs most of it natively.

tiktoken compiles ``pat_str`` with ``fancy_regex``. A pattern with any look-around (both
patterns here end ``\\s+(?!\\S)|\\s+``) runs in fancy_regex's backtracking VM. The VM tries
the top-level alternatives one by one and hands each plain one to the ``regex`` crate on
its own. If the plain alternatives are wrapped in one non-capturing group, they become a
single ``regex``-crate search. The pieces and ids are the same, and on Kimi's pattern the
encode costs a quarter less (bench/RESULTS.md).

**Why only proven patterns are regrouped.** For a backtracking engine, ordered alternation
is associative: ``A|B|C`` and ``(?:A|B)|C`` pick the same match. The group, however, is
run by the ``regex`` crate, and that crate rewrites alternations. For example, it lifts a
common first element out of ``P X|P Y`` to make ``P(?:X|Y)``. When ``P`` is quantified,
that changes which alternative wins: ``.*q|.*b`` matches ``xq`` in a backtracking engine
and ``xqb`` in the crate. A general rewrite would also need a full lexer for
fancy_regex's syntax (comments, free-form group names, flags split by comments).

So :func:`grouped_pattern` regroups only the patterns in :data:`PROVEN`, and returns every
other pattern unchanged. For each proven pattern:
- its grouped alternatives do not all start with one element, so nothing is lifted;
- ``tests/test_pattern.py`` holds its grouped form against the pattern itself on the model's
  real ranks, over texts built to reach every alternative, under the tiktoken installed.
"""

from __future__ import annotations

import re

__all__ = ["KIMI_PAT_STR", "O200K_PAT_STR", "PROVEN", "grouped_pattern", "top_level_alternatives"]

#: The Kimi pre-tokenizer pattern (the ``pat_str`` of ``tokenization_kimi.py``).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

#: o200k's pattern, as tiktoken's ``o200k_base`` and gpt-oss's ``tokenizer.json`` spell it.
O200K_PAT_STR = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

#: The patterns :func:`grouped_pattern` regroups (each held against itself in the tests).
PROVEN = frozenset({KIMI_PAT_STR, O200K_PAT_STR})

#: What makes an alternative something the ``regex`` crate cannot run: look-around.
#: (Enough for the proven patterns; it is no general classifier.)
_FANCY = re.compile(r"\(\?<?[=!]")


def top_level_alternatives(pattern: str) -> list[str] | None:
    """``pattern`` split at its top-level ``|`` (outside groups, character classes and
    escapes), or None where its brackets do not balance. A partial lexer: enough for the
    proven patterns, wrong for syntax it does not know (comments, free-form names)."""
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
    """``pattern`` with its leading run of plain top-level alternatives in one
    non-capturing group, where ``pattern`` is one of :data:`PROVEN`; any other pattern as
    it is (see the module's docstring for why)."""
    if pattern not in PROVEN:
        return pattern
    parts = top_level_alternatives(pattern)
    if parts is None:  # never for the proven patterns (tested); unchanged is always safe
        return pattern
    plain = next((i for i, part in enumerate(parts) if _FANCY.search(part)), len(parts))
    if plain < 2:
        return pattern
    return "|".join(["(?:" + "|".join(parts[:plain]) + ")", *parts[plain:]])

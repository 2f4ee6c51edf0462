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

__all__ = ["KIMI_PAT_STR", "O200K_PAT_STR", "CUT_PROVEN", "PROVEN", "grouped_pattern", "last_stable_cut"]

#: What both patterns end with: the look-ahead that puts them in fancy_regex's VM, and its
#: fallback. Everything before it is plain.
_WHITESPACE_TAIL = (r"""\s+(?!\S)""", r"""\s+""")

_KIMI_PLAIN = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
)
#: The Kimi pre-tokenizer pattern (the ``pat_str`` of ``tokenization_kimi.py``).
KIMI_PAT_STR = "|".join((*_KIMI_PLAIN, *_WHITESPACE_TAIL))

_O200K_PLAIN = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
)
#: o200k's pattern, as tiktoken's ``o200k_base`` and gpt-oss's ``tokenizer.json`` spell it.
O200K_PAT_STR = "|".join((*_O200K_PLAIN, *_WHITESPACE_TAIL))

#: Each proven pattern's regrouped form: its plain alternatives in one group, then the tail
#: (each held against the pattern itself in the tests).
_GROUPED = {
    pattern: "|".join(("(?:" + "|".join(plain) + ")", *_WHITESPACE_TAIL))
    for pattern, plain in ((KIMI_PAT_STR, _KIMI_PLAIN), (O200K_PAT_STR, _O200K_PLAIN))
}
#: The patterns :func:`grouped_pattern` regroups.
PROVEN = frozenset(_GROUPED)
#: Qwen2's pre-tokenizer pattern (Qwen3's ``tokenizer.json``) and GLM-4's (digits in threes).
QWEN2_PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
                 r"""\s+(?!\S)|\s+""")
GLM4_PAT_STR = QWEN2_PAT_STR.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
#: The patterns, as given or regrouped, whose pieces :func:`last_stable_cut` holds for (the
#: argument in its docstring reads the same for Qwen2's and GLM-4's: a contraction, a letter
#: run, a digit, punctuation all end before a space).
CUT_PROVEN = PROVEN | frozenset(_GROUPED.values()) | {QWEN2_PAT_STR, GLM4_PAT_STR}


def grouped_pattern(pattern: str) -> str:
    """``pattern`` with its plain alternatives in one non-capturing group, where ``pattern``
    is one of :data:`PROVEN`; any other pattern as it is (see the module's docstring for why)."""
    return _GROUPED.get(pattern, pattern)


def last_stable_cut(text: str) -> int:
    """The last index ``i > 0`` of ``text`` where a proven pattern (:data:`CUT_PROVEN`) splits
    ``text`` whatever is appended to it, else 0: a space after a character that is not
    whitespace. So ``encode(text + s) == encode(text[:i]) + encode(text[i:] + s)`` for
    every ``s``, and text that grows at its end is re-encoded from ``i`` on only.

    Why: no alternative of either pattern matches a non-whitespace character followed by
    a space (letters end a letter run or a contraction, punctuation ends ``[^\\s...]+`` and
    its trailing line breaks, digits and Han end their runs, the whitespace ones start with
    whitespace), so a piece ends at the space. Every piece before it was found looking at
    most one character past its end (the space itself), and neither pattern looks behind,
    so the pieces on either side do not depend on the other side. ``tests/test_pattern.py``
    holds this on the models' real ranks. Only valid for :data:`CUT_PROVEN` patterns, and
    for text holding no marker text (markers are split off first)."""
    i = text.rfind(" ")
    while i > 0:
        if not text[i - 1].isspace():
            return i
        i = text.rfind(" ", 0, i)
    return 0

"""What one API response says about its own token ids, beyond its text.

Each reader takes an untrusted piece of a response and returns either a usable value or
``None`` plus the reason it is unusable, never raising: a malformed optional field is a
finding at worst, never a lost sample.

* ``logprobs.content[]``: one entry per generated token. An entry names its token as
  vLLM's ``token_id:N`` (``return_tokens_as_token_ids``), by its raw ``bytes``, or, with
  neither, by its text (exact only when the text is the token's whole UTF-8). Engines
  log every generated token, the end token included (vLLM keeps the stop id in the
  output ids; its text is empty); some providers drop that last entry or log the
  content only. A character split between ids is logged by what the engine decoded: U+FFFD
  per piece (older engines), or, vLLM 0.34, no text for each piece and the whole character
  on the id that completes it. :func:`logprob_ids` maps the entries to ids (such pieces to
  placeholders that prove a count); how the gate compares them with a candidate is
  :func:`logprobs_cover`.
* ``matched_stop`` (SGLang): the stop id (or stop string) that ended the choice; vLLM's
  integer ``stop_reason`` says the same (the ``stop_token_ids`` hit, which takes the
  generation config's other end ids: Kimi K2.5's ``<|im_end|>`` beside its ``[EOS]``).
* ``usage.completion_tokens_details.reasoning_tokens`` and
  ``usage.prompt_tokens_details.cached_tokens``: integer counts, or None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from .jsonl import is_count, is_int
from .tokenizer import Tokenizer

__all__ = [
    "shown_value",
    "NATIVE_CUT",
    "NATIVE_FAILED",
    "UNKNOWN_EMPTY",
    "UNKNOWN_MARKER",
    "UNKNOWN_PARTIAL",
    "UNKNOWN_RUN",
    "LogprobIds",
    "cached_tokens",
    "is_count",
    "logprob_ids",
    "logprobs_cover",
    "malformed",
    "matched_stop",
    "native_finish",
    "no_finish",
    "reasoning_tokens",
    "served_by_vllm",
]

#: ``native_finish_reason`` (the upstream's own word, which OpenRouter passes on), lowercased:
#: values that admit a cut (vLLM and OpenAI ``length``, Anthropic ``max_tokens``, Google
#: ``MAX_TOKENS``), and values that admit a failure
NATIVE_CUT = frozenset({"length", "max_tokens"})
NATIVE_FAILED = frozenset({"abort", "error", "content_filter"})


def native_finish(choice: Mapping[str, Any]) -> str | None:
    """A choice's ``native_finish_reason``, lowercased; None where it gives none."""
    native = choice.get("native_finish_reason")
    return native.lower() if isinstance(native, str) else None


#: Finish reasons that say the model ended its turn: the end token is appended.
ENDED = frozenset({"stop", "tool_calls", "eos", "end_turn"})


def finish_reading(choice: Mapping[str, Any]) -> Any:
    """The finish reason a choice is read by: its ``finish_reason``, but ``"length"`` where
    that says the turn ended while ``native_finish_reason`` admits a cut. Read as ended, the
    ids would carry an end token the provider says never came; read as cut, they are a
    prefix of the native ids whichever is true, and the count tells (``truncated``)."""
    reason = choice.get("finish_reason")
    if reason in ENDED and native_finish(choice) in NATIVE_CUT:
        return "length"
    return reason


def no_finish(reason: object) -> bool:
    """Whether a ``finish_reason`` says the choice did not finish: absent or null, or a
    string with nothing in it (``""``, which some servers send for null). The gate
    rejects such a choice (``finish_error``) and generate sends it again (``choice_error``),
    the one rule on both sides; a stream's later chunk saying ``""`` does not undo an
    earlier ``"stop"``. Any value is taken: a finish_reason of another type is refused
    by :func:`~tokenbridge.exchanges.check_response`, not here."""
    return reason is None or (isinstance(reason, str) and not reason.strip())


#: Logged ids that are not known, by what the entry shows. An engine that builds an
#: entry's ``bytes`` from the token's decoded text (vLLM, SGLang) writes nothing for a
#: special token whose text it skips (:data:`UNKNOWN_MARKER`: one of the marker ids) and
#: U+FFFD for a token holding part of a character, a byte of an emoji or a rare CJK one
#: (:data:`UNKNOWN_PARTIAL`: one of the ids whose bytes are no whole text, or hold U+FFFD).
UNKNOWN_MARKER = -1
UNKNOWN_PARTIAL = -2
#: An entry with no bytes that may be either: a skipped special token, or a piece of a
#: character vLLM logged whole on a later id (see :func:`logprob_ids`).
UNKNOWN_EMPTY = -3
#: An id of a :class:`Run`: which one is not known, the bytes of the run's ids together are.
UNKNOWN_RUN = -4
_FFFD = "\ufffd".encode()


@dataclass(frozen=True)
class Run:
    """Logged ids ``start:end`` whose bytes together are ``spelled``: vLLM 0.34 logs the
    pieces of a character split between ids with no text and the id that finishes it with
    the bytes of them all. ``or_token``: where ``spelled`` is also one token's bytes (an
    emoji the vocabulary holds whole), that token after markers whose text was skipped."""

    start: int
    end: int
    spelled: bytes
    or_token: int | None = None


@dataclass(frozen=True)
class LogprobIds:
    """The ids a choice's ``logprobs`` name, or why they cannot be read. Where an entry
    names its token only by what the engine decoded, the id is :data:`UNKNOWN_MARKER` or
    :data:`UNKNOWN_PARTIAL` and ``may_be`` holds, for each, the ids it may stand for: such
    ids agree with those only, and prove no more than a count (``unknown``)."""

    ids: tuple[int, ...] | None
    problem: str | None = None
    may_be: Mapping[int, frozenset[int]] = field(default_factory=dict, compare=False)
    #: logged ids known only by the bytes they spell together (:data:`UNKNOWN_RUN`)
    runs: tuple[Run, ...] = ()
    #: the tokenizer's ids -> bytes, for ``runs`` to be checked
    spell: Callable[[Sequence[int]], bytes] | None = field(default=None, compare=False)
    #: a last entry with no text was left out as the end token: on a length cut, which has
    #: none, it is the id the cut hid (a skipped ``</think>``, a character's first piece)
    dropped_end: bool = False

    @property
    def markers_known(self) -> bool:
        """Whether every logged marker id is known: readings that differ by a marker alone
        are then told apart by the ids."""
        return self.ids is not None and UNKNOWN_MARKER not in self.ids and UNKNOWN_EMPTY not in self.ids

    @property
    def unknown(self) -> bool:
        """Whether some logged id is not known (the split of a character between tokens, or
        which special token it was, is then proven no better than by a count)."""
        return self.ids is not None and any(i < 0 for i in self.ids)


# One bytes -> id index per loaded tokenizer, built on first use (logprobs are rare).
_INDEX: dict[int, tuple[Tokenizer, dict[bytes, int]]] = {}
# The ids an unknown logged id may stand for, per loaded tokenizer (first needed only then).
_MAY_BE: dict[int, tuple[Tokenizer, dict[int, frozenset[int]]]] = {}


def _may_be(tok: Tokenizer) -> dict[int, frozenset[int]]:
    hit = _MAY_BE.get(id(tok))
    if hit is not None and hit[0] is tok:
        return hit[1]
    partial = set()
    for i in range(tok.vocab_size):
        if i in tok.marker_ids:
            continue
        try:
            piece = tok.token_bytes(i)
        except KeyError:
            continue
        try:
            if "\ufffd" in piece.decode("utf-8"):
                partial.add(i)
        except UnicodeDecodeError:
            partial.add(i)
    out = {UNKNOWN_MARKER: frozenset(tok.marker_ids), UNKNOWN_PARTIAL: frozenset(partial),
           UNKNOWN_EMPTY: frozenset(tok.marker_ids) | frozenset(partial), UNKNOWN_RUN: frozenset()}
    _MAY_BE[id(tok)] = (tok, out)
    return out


def _bytes_index(tok: Tokenizer) -> dict[bytes, int]:
    hit = _INDEX.get(id(tok))
    if hit is not None and hit[0] is tok:
        return hit[1]
    index: dict[bytes, int] = {}
    for i in range(tok.vocab_size):
        if i in tok.marker_ids:
            continue
        try:
            index.setdefault(tok.token_bytes(i), i)
        except KeyError:  # a hole in the id space (reserved ids without bytes)
            continue
    for i, text in tok.marker_ids.items():
        index[text.encode("utf-8")] = i
    _INDEX[id(tok)] = (tok, index)
    return index


def _logged_entries(lp: Any) -> list[Any] | str | None:
    """``logprobs.content``; None when nothing was logged (no logprobs, an empty value,
    ``{"content": null}``); else why it cannot be read."""
    if not lp:
        return None
    if not isinstance(lp, Mapping):
        return f"logprobs is not an object ({type(lp).__name__})"
    entries = lp.get("content")
    if entries is None or isinstance(entries, list):
        return entries
    return "logprobs.content is not a list"


def logprob_ids(tok: Tokenizer, choice: Mapping[str, Any]) -> LogprobIds | None:
    """The token ids in ``choice.logprobs.content``; None when the choice has none."""
    entries = _logged_entries(choice.get("logprobs"))
    if entries is None:
        return None
    if isinstance(entries, str):
        return LogprobIds(None, entries)
    index: dict[bytes, int] | None = None
    out: list[int] = []
    runs: list[Run] = []
    dropped = False  # a last entry with no text, taken for the end token
    empty = 0  # entries with no bytes just before this one (what they are, the next one says)
    has_id = tok.has_id
    for pos, entry in enumerate(entries):
        key = _entry_key(pos, entry, has_id)
        if type(key) is str:
            return LogprobIds(None, key)
        if type(key) is int:
            out += [UNKNOWN_MARKER] * empty
            empty = 0
            out.append(key)
            continue
        assert isinstance(key, bytes)
        if not key and pos == len(entries) - 1:
            dropped = True
            break  # the end token, logged with its text skipped: the ids before it still count
        if not key:  # a special token whose text the engine skipped, or part of a character (below)
            empty += 1
            continue
        if _FFFD in key:  # part of a character as the engine decoded it (or a token holding U+FFFD)
            out += [UNKNOWN_EMPTY] * empty + [UNKNOWN_PARTIAL]  # vLLM: pieces of what it decoded here
            empty = 0
            continue
        if index is None:
            index = _bytes_index(tok)
        found = index.get(key)
        if empty and not key.isascii():
            # vLLM (0.34, ``_verify_tokens``) logs each id of a character split between ids
            # with no text and the id that finishes it with all their bytes: the ids are not
            # known, what they spell is. Bytes that are also one token's may be that token
            # after skipped markers.
            run = Run(len(out), len(out) + empty + 1, key, found)
            out += [UNKNOWN_EMPTY if found is not None else UNKNOWN_RUN] * empty + [UNKNOWN_RUN]
            runs.append(run)
            empty = 0
            continue
        out += [UNKNOWN_MARKER] * empty
        empty = 0
        if found is None:
            return LogprobIds(None, f"logprobs.content[{pos}]: bytes {key[:24]!r} are no single token of this tokenizer")
        out.append(found)
    out += [UNKNOWN_MARKER] * empty
    ids = tuple(out)
    if not any(i < 0 for i in ids):
        return LogprobIds(ids, dropped_end=dropped)
    return LogprobIds(ids, may_be=_may_be(tok), runs=tuple(runs), spell=tok.decode_bytes, dropped_end=dropped)


def _entry_key(pos: int, entry: Any, has_id: Callable[[int], bool]) -> int | bytes | str:
    """A ``logprobs.content`` entry's id where it names one (vLLM's ``token_id:N``), else
    its bytes (the text's, where it gives none); a str says why it gives neither. Each test
    is the cheap one for what parsed JSON holds (a dict, a str, a list of ints) first."""
    if type(entry) is not dict and not isinstance(entry, Mapping):
        return f"logprobs.content[{pos}] is not an object"
    token = entry.get("token")
    if type(token) is str and token[:9] == "token_id:":
        tail = token[9:]
        if tail.isascii() and tail.isdigit() and len(tail) <= 12 and has_id(i := int(tail)):
            return i
        return f"logprobs.content[{pos}].token {token[:40]!r} names no id of this tokenizer"
    raw = entry.get("bytes")
    if type(raw) is list and _byte_values(raw):
        return bytes(raw)
    if raw is None and isinstance(token, str):  # text holding U+FFFD reads as unknown
        return token.encode("utf-8", errors="surrogatepass")
    return f"logprobs.content[{pos}] has no usable bytes or token text"


def _byte_values(raw: list[Any]) -> bool:
    """Whether ``raw`` holds only ints 0-255 (no bools, no floats): a token's bytes."""
    return all(type(b) is int and 0 <= b < 256 for b in raw) or all(is_int(b) and 0 <= b < 256 for b in raw)


def logprobs_cover(logged: Sequence[int], completion: Sequence[int], content_start: int, ends: bool,
                   may_be: Mapping[int, frozenset[int]] | None = None, *, runs: Sequence[Run] = (),
                   spell: Callable[[Sequence[int]], bytes] | None = None) -> str | None:
    """How ``logged`` ids account for ``completion``, or None when they contradict it.

    Accepted, in this order: every id (``"all"``); nothing, or the end token alone
    (``"none"``: no proof of anything); every id but the end token, which some providers
    leave out (``"all_but_end"``); the content only, from ``content_start``, with or
    without the end token (``"content"``), for providers that log the answer and not the
    reasoning. Anything else is a contradiction. An unknown logged id agrees
    with the ids ``may_be`` allows it; the ids of a :class:`Run` with what they spell.
    """
    n = len(logged)
    known = not may_be or all(i >= 0 for i in logged)

    def same(a: Sequence[int], b: Sequence[int]) -> bool:
        return list(a) == list(b) if known else _agree(a, b, may_be or {}, runs, spell)
    if n == len(completion) and same(logged, completion):
        return "all"
    if n == 0 or (ends and n == 1 and same(logged, completion[-1:])):
        # nothing logged, or the end token alone: it agrees with every reading that ends so and
        # proves none (taken as the content's cover, the formula's empty content beat a turn
        # that ended in its think block, which no logged id had seen: a reviewer's)
        return "none"
    body = completion[:-1] if ends else completion
    if ends and n == len(body) and same(logged, body):
        return "all_but_end"
    if 0 < content_start < len(completion):
        tail = completion[content_start:]
        if (n == len(tail) and same(logged, tail)) or (ends and n == len(tail) - 1 and same(logged, tail[:-1])):
            return "content"
    return None


def _agree(logged: Sequence[int], ids: Sequence[int], may_be: Mapping[int, frozenset[int]], runs: Sequence[Run] = (),
           spell: Callable[[Sequence[int]], bytes] | None = None) -> bool:
    """Equal where the logged id is known, one of the ids it may stand for where not, and
    each run's ids spelling its bytes (or its one token after markers)."""
    if len(logged) != len(ids):
        return False
    if not all(a == b or (a < 0 and (a == UNKNOWN_RUN or b in may_be.get(a, ()))) for a, b in zip(logged, ids)):
        return False
    markers = may_be.get(UNKNOWN_MARKER, frozenset())
    for run in runs:
        got = ids[run.start:run.end]
        if spell is not None and spell(got) == run.spelled:
            continue
        if run.or_token is None or got[-1] != run.or_token or not all(i in markers for i in got[:-1]):
            return False
    return True


def served_by_vllm(choice: Mapping[str, Any]) -> bool:
    """Whether a choice shows vLLM's OpenAI server served it: it writes ``stop_reason`` on
    every choice (null, or the stop id or string), which no other engine's chat API does."""
    return "stop_reason" in choice


def matched_stop(choice: Mapping[str, Any]) -> int | str | None:
    """SGLang's ``matched_stop``: the stop id (int) or stop string that ended the choice;
    else vLLM's ``stop_reason`` where it is an id (a stop string there is left to the
    request's ``stop``: other APIs use that key for words such as ``end_turn``)."""
    value = choice.get("matched_stop")
    if is_count(value) or (isinstance(value, str) and value):
        return value
    value = choice.get("stop_reason")
    return value if is_count(value) else None


#: Optional counts in ``usage``: (the object holding one, its key).
_DETAILS = (("completion_tokens_details", "reasoning_tokens"), ("prompt_tokens_details", "cached_tokens"))


def malformed(choice: Mapping[str, Any], usage: Mapping[str, Any] | None) -> list[str]:
    """The optional evidence fields of a choice and its usage that hold a value no engine
    writes (``reasoning_tokens: -1``, ``native_finish_reason: 5``), each in words. Such a
    value is read as absent, so the sample stands on its other evidence; this names it, so
    the reading is not silent. Absent and null are no fault."""
    out = []
    for holder, key in _DETAILS:
        details = usage.get(holder) if isinstance(usage, Mapping) else None
        if details is not None and not isinstance(details, Mapping):
            out.append(f"usage.{holder} is {shown_value(details)}, not an object")
        elif details is not None and details.get(key) is not None and not is_count(details[key]):
            out.append(f"usage.{holder}.{key} is {shown_value(details[key])}, not a count")
    for key, fits, want in (("matched_stop", _stop_value, "a stop id or string"),
                            ("stop_reason", _stop_value, "a stop id or string"),
                            ("native_finish_reason", _is_str, "a string")):
        value = choice.get(key)
        if value is not None and not fits(value):
            out.append(f"{key} is {shown_value(value)}, not {want}")
    return out


def _stop_value(value: object) -> bool:
    return is_count(value) or isinstance(value, str)


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def shown_value(value: object) -> str:
    """A value from a response, short, for a finding: its ``repr`` up to 40 characters. A
    number past 64 bits (an integer orjson could not hold reads as a float, whose digits
    would misquote the ones the response wrote) is said to be one."""
    if type(value) is float and value.is_integer() and not -(2**63) < value < 2**64:  # orjson holds the rest
        return "a number past 64 bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _detail(usage: Mapping[str, Any] | None, holder: str, key: str) -> int | None:
    details = usage.get(holder) if isinstance(usage, Mapping) else None
    value = details.get(key) if isinstance(details, Mapping) else None
    return value if is_count(value) else None


def reasoning_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """``usage.completion_tokens_details.reasoning_tokens``, when it is a count."""
    return _detail(usage, "completion_tokens_details", "reasoning_tokens")


def cached_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, when it is a count."""
    return _detail(usage, "prompt_tokens_details", "cached_tokens")

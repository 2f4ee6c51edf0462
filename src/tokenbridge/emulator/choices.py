"""One response choice as a provider shows it: the model's ids, and the text view of them
after a ``max_tokens`` cut, tool-call parsing and the provider's quirks.

The ids are the ground truth (``token_ids``, usage); the text view is always derived from
them by decoding, so a cut mid-reasoning gives no ``</think>`` and empty content, and a
non-canonical split leaves the text unchanged.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from ..chat import Dialect, ToolMarkers
from ..tokenizer import Tokenizer
from .config import ProviderConfig
from .engines import engine_text, logprob_entries, reasoning_token_count
from .families import family_profile
from .hashing import draw
from .synthetic import Generation

__all__ = ["ChoiceView", "LogprobsAsk", "build_choice", "split_one_token"]


@dataclass(frozen=True)
class LogprobsAsk:
    """A request's ``logprobs: true`` (with ``top_logprobs`` and vLLM's
    ``return_tokens_as_token_ids``)."""

    top: int = 0
    token_ids_as_text: bool = False


@dataclass(frozen=True)
class ChoiceView:
    """Everything a response says about one choice."""

    index: int
    reasoning: str | None
    content: str
    finish_reason: str
    native_ids: tuple[int, ...]
    reasoning_tokens: int
    tool_calls: tuple[dict[str, Any], ...] = ()
    has_reasoning_key: bool = True  # False: the provider dropped the field entirely
    error: dict[str, Any] | None = field(default=None)
    engine: str = "none"  # the serving stack's shape (see .engines)
    reasoning_key: str = "reasoning"  # SGLang serves ``reasoning_content``
    null_content: bool = False  # vLLM: ``content: null`` when there is none
    matched_stop: int | None = None  # SGLang: the stop id that ended the choice
    details: str = "none"  # "both" / "only": reasoning (also / only) in ``reasoning_details``
    logprobs: tuple[dict[str, Any], ...] | None = None  # ``logprobs.content`` when asked


def build_choice(
    gen: Generation,
    *,
    tok: Tokenizer,
    dialect: Dialect,
    provider: ProviderConfig,
    index: int,
    max_tokens: int | None,
    structured_tools: bool,
    draw_key: tuple[object, ...],
    error: dict[str, Any] | None = None,
    logprobs: LogprobsAsk | None = None,
    stream: bool = False,
    thinking: bool | None = None,
) -> ChoiceView:
    """The choice ``provider`` returns for ``gen``; ``error`` cuts it halfway, finish "error";
    ``stream``: the text as the engine's streamed deltas add up."""
    q = provider.quirks
    thinking = gen.reasoning is not None if thinking is None else thinking

    def hit(name: str) -> bool:
        rate: float = getattr(q, name)
        return rate > 0 and draw(provider.name, name, *draw_key) < rate

    ids = list(gen.native_ids)
    if hit("noncanonical"):
        ids = split_one_token(tok, ids, draw(provider.name, "split_at", *draw_key)) or ids
    limit = max_tokens
    if error is not None:
        limit = max(1, len(ids) // 2) if limit is None else min(limit, max(1, len(ids) // 2))
    cut = limit is not None and len(ids) > limit
    if cut:
        ids = ids[:limit]
    engine = provider.engine
    view = _spans_view(ids, gen, cut, tok, index) if gen.spans else _text_view(ids, gen, cut, tok, dialect, index)
    if engine != "none":
        shown = engine_text(tok, dialect, ids, thinking, engine, stream=stream, keep_stop=hit("no_stop_trim"))
        ended = not cut and error is None
        view = replace(view, reasoning=shown.reasoning, content=shown.content or "", engine=engine,
                       null_content=shown.content is None,
                       reasoning_key="reasoning_content" if engine == "sglang" else "reasoning",
                       matched_stop=ids[-1] if engine == "sglang" and ended else None)
    think_close = tok.token_id(dialect.think_close) if dialect.think_close else None
    if gen.spans and engine == "none":
        count = _reasoning_ids(ids, gen, tok, think_close, cut) if thinking else 0
    else:
        count = reasoning_token_count(ids, think_close, thinking, engine)
    view = replace(view, reasoning_tokens=count)

    tm = dialect.tool_markers
    if tm is not None and (structured_tools or hit("parse_tool_calls")):
        if gen.spans:
            content, calls = _parse_family_sections(view.content, dialect, gen)
        else:
            content, calls = _parse_tool_sections(view.content, dialect)
        if calls:
            view = replace(view, content=content, tool_calls=calls,
                           finish_reason="length" if cut else "tool_calls")
    if error is not None:
        view = replace(view, finish_reason="error", error=error)
    end_text = tok.marker_ids.get(ids[-1], dialect.end_token) if ids else dialect.end_token
    view = _apply_text_quirks(view, hit, dialect, ended=not cut and error is None, end_text=end_text)
    if view.reasoning:
        details = "only" if hit("reasoning_details_only") else "both" if hit("reasoning_details") else "none"
        view = replace(view, details=details, has_reasoning_key=view.has_reasoning_key and details != "only")
    if logprobs is not None:
        entries = logprob_entries(tok, ids, logprobs.top, token_ids_as_text=logprobs.token_ids_as_text and engine == "vllm",
                                  salt=draw(provider.name, "logprobs", *draw_key))
        view = replace(view, logprobs=tuple(entries))
    return view


def _text_view(ids: list[int], gen: Generation, cut: bool, tok: Tokenizer, dialect: Dialect, index: int) -> ChoiceView:
    thinking = gen.reasoning is not None
    think_close = tok.token_id(dialect.think_close) if thinking and dialect.think_close else None
    reasoning_ids: list[int] = []
    rest = ids
    if think_close is not None:
        if think_close in ids:
            p = ids.index(think_close)
            reasoning_ids, rest = ids[:p], ids[p + 1 :]
        elif not gen.think_closed and dialect.tool_markers is not None:
            # no </think>: reasoning ends where the tool section begins (as the engines split it)
            section = tok.token_id(dialect.tool_markers.section_begin)
            p = ids.index(section) if section in ids else len(ids)
            reasoning_ids, rest = ids[:p], ids[p:]
        else:
            reasoning_ids, rest = ids, []
    if cut:
        reasoning, content = (_decode(tok, reasoning_ids) if thinking else None), _decode(tok, rest)
    else:  # every id is there (maybe split differently): the text is the model's own
        reasoning, content = gen.reasoning, gen.content
    return ChoiceView(
        index=index,
        reasoning=reasoning,
        content=content,
        finish_reason="length" if cut else "stop",
        native_ids=tuple(ids),
        reasoning_tokens=len(reasoning_ids),
    )


def _spans_view(ids: list[int], gen: Generation, cut: bool, tok: Tokenizer, index: int) -> ChoiceView:
    """The text view of a family generation: its own text, or after a cut the bytes the
    kept ids decode to, handed back to the parts they came from (markers shown nowhere).
    By bytes, not ids, so a non-canonical split cannot shift a part boundary. (Its
    ``reasoning_tokens`` is the engine's count, set by the caller.)"""
    reasoning, content = gen.reasoning, gen.content
    if cut:
        left = len(tok.decode_bytes(ids))
        got: dict[str, bytearray] = {"reasoning": bytearray(), "content": bytearray()}
        for kind, text in gen.spans:
            raw = text.encode("utf-8")
            take, left = raw[:left], left - min(left, len(raw))
            if kind == "reasoning":
                got["reasoning"] += take
            elif kind in ("content", "tool_calls"):
                got["content"] += take
        reasoning = got["reasoning"].decode("utf-8", errors="ignore") if gen.reasoning is not None else None
        content = got["content"].decode("utf-8", errors="ignore")
    return ChoiceView(index=index, reasoning=reasoning, content=content, finish_reason="length" if cut else "stop",
                      native_ids=tuple(ids), reasoning_tokens=0)


def _reasoning_ids(ids: list[int], gen: Generation, tok: Tokenizer, think_close: int | None, cut: bool) -> int:
    """The ids of the reasoning part alone (no think markers, no GLM newline), as
    OpenRouter-normalised providers count ``reasoning_tokens``, within the ids kept."""
    kinds = [kind for kind, _ in gen.spans]
    if "reasoning" not in kinds:
        return 0
    start = sum(len(tok.encode_checked(text)[0]) for _, text in gen.spans[: kinds.index("reasoning")])
    if "think_end" in kinds:
        stop = ids.index(think_close, start) if think_close in ids[start:] else len(ids)
    else:  # no think block (DeepSeek after a tool result): reasoning up to the end token
        stop = len(ids) - (0 if cut else 1)
    return max(0, min(stop, len(ids)) - start)


def _decode(tok: Tokenizer, ids: list[int]) -> str:
    # A cut can end inside a UTF-8 character; like a streaming detokenizer, hold it back.
    return tok.decode_bytes(ids).decode("utf-8", errors="ignore")


def _parse_family_sections(content: str, dialect: Dialect, gen: Generation) -> tuple[str, tuple[dict[str, Any], ...]]:
    """A family's complete sections -> the calls the model made (it knows them); the text
    around the sections stays content."""
    assert dialect.tool_markers is not None
    tm = dialect.tool_markers
    if family_profile(dialect).writer == "harmony":  # the call is a whole message, from its <|start|>
        section = re.compile(re.escape("<|start|>assistant<|channel|>commentary to=") + ".*", re.S)
    else:
        section = re.compile(re.escape(tm.section_begin) + ".*?" + re.escape(tm.section_end), re.S)
    if not gen.calls or not section.search(content):
        return content, ()
    calls = tuple({"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                  for i, (name, args) in enumerate(gen.calls))
    return section.sub("", content), calls


def _parse_tool_sections(content: str, dialect: Dialect) -> tuple[str, tuple[dict[str, Any], ...]]:
    """Complete raw sections -> structured calls; the rest of the text stays content."""
    assert dialect.tool_markers is not None
    section, call = _tool_patterns(dialect.tool_markers)
    calls: list[dict[str, Any]] = []
    for m in section.finditer(content):
        for c in call.finditer(m.group(1)):
            call_id, args = c.group(1).strip(), c.group(2).strip()
            name = call_id.removeprefix("functions.").rsplit(":", 1)[0]
            calls.append({"index": len(calls), "id": call_id, "type": "function",
                          "function": {"name": name, "arguments": args}})
    if not calls:
        return content, ()
    return section.sub("", content), tuple(calls)


@lru_cache(maxsize=8)
def _tool_patterns(tm: ToolMarkers) -> tuple[re.Pattern[str], re.Pattern[str]]:
    if tm.call_begin is None or tm.argument_begin is None or tm.call_end is None:
        raise ValueError(f"{tm.section_begin}: the emulator parses only tool sections with call markers")
    section = re.compile(re.escape(tm.section_begin) + "(.*?)" + re.escape(tm.section_end), re.S)
    call = re.compile(
        re.escape(tm.call_begin) + "(.*?)" + re.escape(tm.argument_begin) + "(.*?)" + re.escape(tm.call_end), re.S
    )
    return section, call


#: Text edits a provider's pipeline may make, by quirk name.
_TEXT_EDITS = (
    ("unicode_nfc", lambda t: unicodedata.normalize("NFC", t)),
    ("unicode_nfkc", lambda t: unicodedata.normalize("NFKC", t)),
    ("crlf_to_lf", lambda t: t.replace("\r\n", "\n")),
)


def _apply_text_quirks(
    view: ChoiceView, hit: Callable[[str], bool], dialect: Dialect, *, ended: bool, end_text: str
) -> ChoiceView:
    reasoning, content, has_key = view.reasoning, view.content, True
    thinking = reasoning is not None
    if reasoning is not None and dialect.think_close and hit("reasoning_in_content"):
        content, reasoning = reasoning + dialect.think_close + content, None
        thinking = False
    if thinking and dialect.think_close and hit("think_close_in_content"):
        content = dialect.think_close + content
    if thinking and dialect.think_open and hit("think_open_in_reasoning"):
        reasoning = dialect.think_open + (reasoning or "")
    if ended and hit("end_marker_leak"):
        content = content + end_text
    for quirk, edit in _TEXT_EDITS:
        if hit(quirk):
            content = edit(content)
            reasoning = edit(reasoning) if reasoning is not None else None
    if hit("strip_whitespace"):
        content = content.strip()
        reasoning = reasoning.strip() if reasoning is not None else None
    if view.reasoning is not None and hit("drop_reasoning"):
        reasoning, has_key = None, False
    return replace(view, reasoning=reasoning, content=content, has_reasoning_key=has_key)


# --- non-canonical tokenization --------------------------------------------------------


@lru_cache(maxsize=4)
def _byte_table(tok: Tokenizer) -> dict[bytes, int]:
    """Ordinary token bytes -> id. Markers are skipped by id, not by a bound: DeepSeek's
    ``<｜begin▁of▁sentence｜>`` and friends are ids 0-2."""
    markers = tok.marker_ids
    return {tok.token_bytes(i): i for i in range(tok.vocab_size) if i not in markers}


def split_one_token(tok: Tokenizer, ids: list[int], where: float) -> list[int] | None:
    """``ids`` with one ordinary token replaced by two whose bytes concatenate to it.

    The search starts at fraction ``where`` of the sequence and wraps around; None when no
    token can be split.
    """
    table = _byte_table(tok)
    n = len(ids)
    if not n:
        return None
    begin = int(where * n) % n
    for off in range(n):
        i = (begin + off) % n
        t = ids[i]
        if t in tok.marker_ids:
            continue
        b = tok.token_bytes(t)
        for k in range(1, len(b)):
            left, right = table.get(b[:k]), table.get(b[k:])
            if left is not None and right is not None:
                return ids[:i] + [left, right] + ids[i + 1 :]
    return None

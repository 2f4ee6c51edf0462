"""What real serving stacks make of a Kimi K2 completion: the engine profiles.

Each profile turns the completion ids into the text fields the engine serves, following
the engines' own code (read, not copied):

* ``sglang`` (0.5.23; tests/test_sglang_oracle.py runs the real parsers): detokenizes with
  ``skip_special_tokens=True`` and the matched stop id trimmed, no spaces around added
  tokens (transformers 5 has no ``spaces_between_special_tokens``); a cut inside a UTF-8
  character ends in U+FFFD. ``ReasoningParser("kimi_k2", force_reasoning=True)`` splits at
  the first ``</think>`` or, when it never came, at ``<|tool_calls_section_begin|>`` (the
  section stays in the content). Serves ``reasoning_content`` (null when empty),
  ``content`` ("" when empty), ``matched_stop`` (the stop id, null on a length cut), and
  ``reasoning_tokens`` counted by the scheduler up to *and including* ``</think>`` -- every
  completion token, end token included, when ``</think>`` never came.
* ``vllm``: its detokenizer joins added tokens (``<think>``, ``</think>``, tool markers:
  ``special: false`` in Kimi's config, so not skipped) to their neighbours with one space
  (``spaces_between_special_tokens`` defaults to true; vllm-project/vllm#33457), and the
  prompt's last token puts one more space in front. ``KimiK2ReasoningParser`` splits like
  SGLang's; ``content`` is null when empty and the field is ``reasoning``. Its Kimi parser
  does not override ``count_reasoning_tokens``, whose base returns 0, so
  ``reasoning_tokens`` is 0. A cut inside a UTF-8 character is held back.
* ``none``: the emulator's own ideal text view (what OpenRouter normalizes to):
  ``reasoning_tokens`` counts the reasoning ids without ``</think>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..chat import Dialect
from ..tokenizer import Tokenizer

__all__ = ["Engine", "EngineText", "engine_text", "logprob_entries", "reasoning_token_count"]

Engine = Literal["none", "sglang", "vllm"]


@dataclass(frozen=True)
class EngineText:
    """The text fields an engine serves for one completion (before provider quirks)."""

    reasoning: str | None
    content: str | None


def _skipped(tok: Tokenizer, dialect: Dialect) -> set[int]:
    """Ids ``skip_special_tokens`` drops: every marker except the think and tool ones."""
    keep = {m for m in (dialect.think_open, dialect.think_close) if m}
    if dialect.tool_markers is not None:
        tm = dialect.tool_markers
        keep |= {m for m in (tm.section_begin, tm.section_end, tm.call_begin, tm.argument_begin, tm.call_end) if m is not None}
    return {i for i, text in tok.marker_ids.items() if text not in keep}


def _detokenize(tok: Tokenizer, dialect: Dialect, ids: list[int], engine: Engine) -> str:
    skipped = _skipped(tok, dialect)
    visible = [i for i in ids if i not in skipped]
    if engine == "sglang":
        return tok.decode_bytes(visible).decode("utf-8", errors="replace")
    # vLLM: runs of ordinary tokens, each added token on its own, joined by one space
    pieces: list[str] = []
    run: list[int] = []
    for i in visible:
        if i in tok.marker_ids:
            if run:
                pieces.append(tok.decode_bytes(run).decode("utf-8", errors="ignore"))
                run = []
            pieces.append(tok.marker_ids[i])
        else:
            run.append(i)
    if run:
        pieces.append(tok.decode_bytes(run).decode("utf-8", errors="ignore"))
    pieces = [p for p in pieces if p]
    return " " + " ".join(pieces) if pieces else ""


def engine_text(tok: Tokenizer, dialect: Dialect, ids: list[int], thinking: bool, engine: Engine) -> EngineText:
    """The (reasoning, content) an engine serves for completion ``ids`` (stop id included)."""
    text = _detokenize(tok, dialect, ids, engine)
    reasoning: str | None = None
    content = text
    if thinking and dialect.think_close:
        section = dialect.tool_markers.section_begin if dialect.tool_markers is not None else None
        at = text.find(dialect.think_close)
        if at >= 0:
            reasoning, content = text[:at], text[at + len(dialect.think_close):]
        elif section and section in text:
            at = text.index(section)
            reasoning, content = text[:at], text[at:]
        else:
            reasoning, content = text, ""
    if engine == "vllm":
        return EngineText(reasoning, content or None)
    return EngineText(reasoning or None, content)


def reasoning_token_count(ids: list[int], think_close_id: int | None, thinking: bool, engine: Engine) -> int:
    """``usage.completion_tokens_details.reasoning_tokens`` as the engine counts it."""
    if not thinking or think_close_id is None or engine == "vllm":
        return 0
    if think_close_id in ids:
        at = ids.index(think_close_id)
        return at + 1 if engine == "sglang" else at
    return len(ids)


def logprob_entries(
    tok: Tokenizer, ids: list[int], top: int, *, token_ids_as_text: bool, salt: float
) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` for ``ids``: OpenAI's form (``token``, ``bytes``,
    ``logprob``, ``top_logprobs``), or vLLM's ``token_id:N`` tokens
    (``return_tokens_as_token_ids``). Logprob values are made up but deterministic."""
    out: list[dict[str, Any]] = []
    for pos, i in enumerate(ids):
        raw = tok.token_bytes(i)
        token = f"token_id:{i}" if token_ids_as_text else raw.decode("utf-8", errors="replace")
        lp = -round(((pos * 0.6180339887 + salt) % 1.0) * 2.5, 4)
        entry: dict[str, Any] = {"token": token, "bytes": list(raw), "logprob": lp, "top_logprobs": []}
        if top:
            entry["top_logprobs"] = [{"token": token, "bytes": list(raw), "logprob": lp}]
        out.append(entry)
    return out

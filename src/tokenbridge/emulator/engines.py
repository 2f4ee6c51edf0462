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

The other families (:mod:`.families` holds each one's parser names and quirks):

* ``sglang``: the same base detector (``BaseReasoningFormatDetector``) with the family's
  ``tool_start_token`` (``<tool_call>`` for ``qwen3``, ``glm45`` and ``deepseek-v3``),
  special tokens as the folder's ``tokenizer.json`` marks them (DeepSeek V3.2's
  ``｜DSML｜`` is special, so dropped). Forced reasoning strips leading ``<think>``s
  whole (GLM's ``"\\n<think>R"`` keeps both); streamed, the parser drops the first
  ``<think>`` wherever it comes (GLM: ``"\\nR"``).
* ``vllm``: ``tokenizers``' own decode, no spaces (the join is only in the slow-tokenizer
  path); ``Qwen3ReasoningParser`` / ``Glm4MoeModelReasoningParser`` split only when both
  ``<think>`` and ``</think>`` are there, dropping what comes before ``<think>``, and
  serve the whole text as content otherwise (a cut inside the reasoning, a tool call
  opened without ``</think>``); ``DeepSeekV3ReasoningParser`` serves everything as
  content unless the request asked for thinking, then reasoning until ``</think>``
  (``DeepSeekR1ReasoningParser``). Read from vllm-project/vllm at commits 693e2a48
  (qwen3), c9e9c484 (glm4_moe), d4f465fb (deepseek_v3), d5c95556 (deepseek_r1).
  ``reasoning_tokens`` is 0: the base ``count_reasoning_tokens``.

gpt-oss (harmony), SGLang only (no vLLM profile is modelled for it):

* ``sglang``: special tokens kept (SGLang turns ``skip_special_tokens`` off for gpt-oss),
  the matched stop id trimmed unless the request set ``no_stop_trim``, then
  ``ReasoningParser("gpt-oss")`` (its ``HarmonyParser``), inverted for the messages gpt-oss
  writes: analysis texts joined are the reasoning (an unfinished one too); final text and
  commentary preambles are the content; a commentary call whose ``<|call|>`` was trimmed
  is never complete and is dropped, one with its ``<|call|>`` kept stays in the content
  raw, from its ``<|start|>``; an unfinished header shows nothing. Streamed, the parser
  holds back a tail of the content that could begin a marker (``<``, ``<|``...) and its
  end-of-stream flush does not give it back. ``reasoning_tokens`` counts up to and
  including the first ``<|end|>`` (the detector's ``think_end_token``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..chat import Dialect
from ..tokenizer import Tokenizer
from .families import FamilyProfile, family_profile, skipped_ids

__all__ = ["Engine", "EngineText", "engine_text", "logprob_entries", "reasoning_token_count"]

Engine = Literal["none", "sglang", "vllm"]


@dataclass(frozen=True)
class EngineText:
    """The text fields an engine serves for one completion (before provider quirks)."""

    reasoning: str | None
    content: str | None


def _detokenize(tok: Tokenizer, dialect: Dialect, ids: list[int], engine: Engine, fam: FamilyProfile) -> str:
    skipped = skipped_ids(tok, dialect)
    visible = [i for i in ids if i not in skipped]
    if engine == "sglang":
        return tok.decode_bytes(visible).decode("utf-8", errors="replace")
    if not fam.vllm_joins_added_tokens:  # a fast tokenizer: its own decode, a cut character held back
        return tok.decode_bytes(visible).decode("utf-8", errors="ignore")
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


def engine_text(
    tok: Tokenizer, dialect: Dialect, ids: list[int], thinking: bool, engine: Engine, *, stream: bool = False,
    keep_stop: bool = False,
) -> EngineText:
    """The (reasoning, content) an engine serves for completion ``ids`` (stop id included);
    ``stream``: as the streamed deltas add up (SGLang only; vLLM is modelled whole);
    ``keep_stop``: SGLang's ``no_stop_trim`` (gpt-oss only: elsewhere the stop is a
    special token the detokenizer skips anyway)."""
    fam = family_profile(dialect)
    if fam.writer == "harmony":
        if engine != "sglang":
            raise ValueError(f"the emulator models no {engine} profile for {fam.name} (only sglang)")
        if not keep_stop and ids and tok.marker_ids.get(ids[-1]) in dialect.eos_markers:
            ids = ids[:-1]
        said, shown = _harmony_split(tok.decode_bytes(ids).decode("utf-8", errors="replace"), stream=stream)
        return EngineText(said or None, shown)
    text = _detokenize(tok, dialect, ids, engine, fam)
    if engine == "vllm" and fam.vllm_reasoning != "kimi_k2":
        reasoning, content = _vllm_split(text, dialect, fam, thinking)
        return EngineText(reasoning, content or None)
    reasoning, content = _sglang_split(text, dialect, fam, thinking, stream=stream and engine == "sglang")
    if engine == "vllm":
        return EngineText(reasoning, content or None)
    return EngineText(reasoning or None, content)


def _sglang_split(text: str, dialect: Dialect, fam: FamilyProfile, thinking: bool, *, stream: bool) -> tuple[str | None, str]:
    """SGLang 0.5.23's ``BaseReasoningFormatDetector``, forced into reasoning in thinking
    mode: split at the first ``</think>``, else at the family's tool start (kept in the
    content), else all reasoning."""
    opening, closing = dialect.think_open, dialect.think_close
    if not closing or not (thinking or (opening and opening in text)):
        return None, text
    if opening and stream:
        text = text.replace(opening, "", 1)
    elif opening:
        while text.startswith(opening):
            text = text[len(opening):]
    at = text.find(closing)
    if at >= 0:
        return text[:at], text[at + len(closing):]
    tool = fam.sglang_tool_start
    if tool and tool in text:
        at = text.index(tool)
        return text[:at], text[at:]
    return text, ""


_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
_HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")


def _harmony_split(text: str, *, stream: bool) -> tuple[str, str]:
    """SGLang 0.5.23's gpt-oss split of ``text`` (special tokens kept), for the message
    shapes gpt-oss writes (see the module doc): walk the messages, each an optional
    ``<|start|>ROLE``, ``<|channel|>HEADER<|message|>BODY`` and an end marker or the end
    of the text."""
    reasoning: list[str] = []
    content: list[str] = []
    pos = 0
    while pos < len(text):
        head = text.find("<|channel|>", pos)
        body = text.find("<|message|>", head) if head >= 0 else -1
        if body < 0:
            break  # an unfinished ``<|start|>assistant`` or header: held back, never shown
        channel = text[head + len("<|channel|>"):body].strip().lower()
        start = body + len("<|message|>")
        ends = ("<|return|>",) if channel.startswith("final") else ("<|end|>", "<|call|>")
        at, end = min(((text.find(e, start), e) for e in ends if e in text[start:]), default=(len(text), ""))
        message = text[start:at]
        if end == "<|call|>":
            # a call whose stop was kept: raw, from the <|start|> that opened its message
            opened = text.rfind("<|start|>", pos, head)
            content.append(text[opened if opened >= 0 else head:at + len(end)])
        elif channel.startswith("analysis"):
            reasoning.append(message)  # an unfinished analysis is shown as it grows
        elif channel.startswith("final"):
            content.append(_held_back(message) if stream and not end else message)
        elif end:
            content.append(message)  # a commentary preamble
        if not end:
            break  # anything unfinished ends the text (a commentary call waits for its end)
        pos = at + len(end)
    return "".join(reasoning), "".join(content)


def _held_back(text: str) -> str:
    """``text`` without its longest tail that could begin a harmony marker (what the
    streaming parser holds back and its end-of-stream flush drops)."""
    hold = 0
    for marker in _HARMONY_MARKERS:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                hold = max(hold, k)
                break
    return text[:-hold] if hold else text


def _vllm_split(text: str, dialect: Dialect, fam: FamilyProfile, thinking: bool) -> tuple[str | None, str]:
    """vLLM's whole-response split for a tokenizer.json family (see the module doc)."""
    opening, closing = dialect.think_open or "", dialect.think_close or ""
    if not closing:
        return None, text
    if fam.vllm_reasoning == "deepseek_v3":
        if not thinking:
            return None, text  # IdentityReasoningParser
        if opening:
            before, sep, after = text.partition(opening)
            text = after if sep else before
        reasoning, sep, content = text.partition(closing)
        return (reasoning, content) if sep else (text, "")
    if not opening or opening not in text or closing not in text:
        return None, text
    text = text.partition(opening)[2]
    reasoning, _, content = text.partition(closing)
    return reasoning, content


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

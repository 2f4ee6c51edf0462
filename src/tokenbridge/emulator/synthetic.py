"""The deterministic model behind the emulator.

For a request it writes the text parts and the *native ids* the real model would have
emitted, built from the real tokenizer. For Kimi K2.5:

* thinking: ``encode(reasoning) + [</think>] + encode(content) + [<|im_end|>]``
* instant:  ``encode(content) + [<|im_end|>]``
* a tool call opened without ``</think>`` (Kimi K2 does this; ``tool_call_without_think_close``):
  ``encode(reasoning) + encode(tool section) + [<|im_end|>]``

Every other family (picked from the tokenizer, as the CLI picks it) writes its text in
its own frame (:mod:`.families`: Qwen3's ``<think>\\n R \\n</think>\\n\\n C``, GLM's ``\\n``
before the content), its tool sections as its own prompt renderer writes a tool-calling
turn, and its ids are the parts of the dialect's own completion assembly
(``Dialect.completion_parts``: think markers where the family writes them, GLM's
``<|observation|>`` after a call, DeepSeek's bare answer after a tool result), each
encoded with the real tokenizer.

gpt-oss writes harmony messages instead (``FamilyProfile.writer == "harmony"``), through
the dialect's own ``completion_parts``: ``<|channel|>analysis<|message|>R<|end|>
<|start|>assistant<|channel|>final<|message|>C<|return|>``, or after the analysis one
commentary call ``<|start|>assistant<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>ARGS<|call|>`` (a harmony call ends the turn: one per turn,
no final text); the end markers are their single ids (``Tokenizer.token_id``).

``content`` may hold a raw tool-call section (marker text, which encodes to the marker
ids). Outputs are cached per key so that serving the same sample again (retries, ``n``
splits, streamed vs not) costs no CPU and yields the same bytes.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from ..chat import Dialect
from ..tokenizer import Tokenizer
from . import prose
from .families import FamilyProfile, family_profile, tool_section_text
from .hashing import canonical_json, draw, sample_key
from .tool_specs import ToolSpec, make_arguments, tools_from_param, tools_from_text

#: A generation's cache key: (conversation key, tools JSON, thinking, seed, choice index).
_Key = tuple[str, str, bool, int, int]

__all__ = ["ECHO_BEGIN", "ECHO_END", "Generation", "SyntheticModel", "harmony_call_text"]

#: A user message holding ``ECHO_BEGIN + text + ECHO_END`` gets ``text`` back verbatim as
#: the content (what ``tokenbridge probe``'s echo tests ask a real model to do).
ECHO_BEGIN, ECHO_END = "<<<ECHO\n", "\nECHO>>>"
_ECHO = re.compile(re.escape(ECHO_BEGIN) + "(.*)" + re.escape(ECHO_END), re.S)


@dataclass(frozen=True)
class Generation:
    """What the model wrote for one choice."""

    reasoning: str | None  # None in instant mode
    content: str  # text, raw tool-call sections included
    native_ids: tuple[int, ...]  # the completion ids, end token included
    think_closed: bool = True  # False: the model went from reasoning straight to a tool section
    #: the completion parts (kind, text) in order, for families other than Kimi: where a cut falls
    spans: tuple[tuple[str, str], ...] = ()
    #: the tool calls written, as (name, JSON arguments), for families other than Kimi
    calls: tuple[tuple[str, str], ...] = ()


class SyntheticModel:
    """Writes a :class:`Generation` per (messages, tools, thinking, seed, choice index)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        dialect: Dialect,
        *,
        seed: int = 0,
        tool_call_rate: float = 0.8,
        tool_call_without_think_close: float = 0.0,
        min_tokens: int = 30,
        max_tokens: int = 3000,
        cache_size: int = 4096,
    ) -> None:
        self.tok = tokenizer
        self.dialect = dialect
        self.seed = seed
        self.tool_call_rate = tool_call_rate
        self.tool_call_without_think_close = tool_call_without_think_close
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self._cache: OrderedDict[tuple[Any, ...], Generation] = OrderedDict()
        self._cache_size = cache_size
        self.think_close_id = tokenizer.token_id(dialect.think_close) if dialect.think_close else None
        self.end_id = tokenizer.token_id(dialect.end_token)
        self.family: FamilyProfile = family_profile(dialect)
        self._kimi = self.family.name == "kimi-k2.5"

    def generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        thinking: bool,
        seed: int,
        index: int,
        prompt_opens_think: bool = True,
    ) -> Generation:
        """``prompt_opens_think``: the rendered prompt ends with the think-open marker
        (DeepSeek's prompt after a tool result does not, and its model then writes no
        think block); it keys the cache, not the draws."""
        key = (sample_key(messages), canonical_json(tools) if tools else "", thinking, seed, index)
        slot = (*key, prompt_opens_think)
        hit = self._cache.get(slot)
        if hit is not None:
            self._cache.move_to_end(slot)
            return hit
        gen = self._write(messages, tools, thinking, random.Random(canonical_json([self.seed, *key])), key,
                          prompt_opens_think)
        self._cache[slot] = gen
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return gen

    # -- writing ----------------------------------------------------------------------

    def _write(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        thinking: bool,
        rng: random.Random,
        key: tuple[Any, ...],
        prompt_opens_think: bool,
    ) -> Generation:
        """One set of choices (the same draws for every family), written in the family's
        frame and tool grammar: Kimi's own (:meth:`_assemble`), or the dialect's (:meth:`_finish`)."""
        last = messages[-1] if messages else {}
        # DeepSeek after a tool result: the prompt opens no think block and the model
        # writes none; an engine forced into reasoning serves its answer as reasoning.
        blockless = not self._kimi and thinking and not prompt_opens_think and not self.dialect.think_self_open
        echo = _ECHO.search(_text(last)) if last.get("role") == "user" else None
        if echo is not None:
            reasoning = "The user wants this text repeated exactly." if thinking and not blockless else None
            return self._finish(reasoning, echo.group(1), thinking, prompt_opens_think, blockless, framed=False)
        topic = prose.read_topic(_text(_last_user(messages)))
        specs = tools_from_param(tools) if tools else tools_from_text(_system_text(messages))
        if self.dialect.tool_markers is None or (thinking and not self.family.tools_when_thinking):
            specs = []
        budget = int(math.exp(rng.uniform(math.log(self.min_tokens), math.log(self.max_tokens))))
        share = rng.uniform(0.35, 0.7) if thinking else 0.0
        reasoning_chars = max(40, int(budget * share * 4))
        answer_chars = max(20, int(budget * (1 - share) * 4))

        wants_call = (
            specs
            and last.get("role") == "user"
            and draw(self.seed, "tool_call", *key) < self.tool_call_rate
        )
        calls: tuple[tuple[str, str], ...] = ()
        if wants_call:
            picked = self._pick_calls(rng, specs, topic)
            reasoning, content = prose.write_tool_preamble(rng, topic, [name for name, _ in picked])
            if self._kimi:
                section = self._tool_section(picked, _prior_calls(messages))
                if thinking and draw(self.seed, "no_think_close", *key) < self.tool_call_without_think_close:
                    return self._assemble(reasoning, section, think_closed=False)
            elif self.family.writer == "harmony":
                # the preamble sentence joins the analysis: the call message holds only the call
                name, args = picked[0]
                calls = ((name, json.dumps(args, ensure_ascii=False)),)
                reasoning = f"{reasoning} {content}".strip() if content else reasoning
                content = ""
                section = harmony_call_text(name, calls[0][1])
            else:
                # a sentence before the call always: the renderer's form of a call after
                # empty content differs by family, and the section is cut out after it
                content = content or f"Let me call {picked[0][0]}."
                calls = tuple((name, json.dumps(args, ensure_ascii=False)) for name, args in picked)
                section = tool_section_text(self.dialect, calls)
            content += section
        elif last.get("role") == "tool":
            reasoning, content = prose.write_after_tool(rng, topic, _text(last), answer_chars)
        else:
            reasoning = prose.write_reasoning(rng, topic, reasoning_chars)
            content = prose.write_answer(rng, topic, answer_chars)
        return self._finish(reasoning if thinking and not blockless else None, content, thinking,
                            prompt_opens_think, blockless, calls)

    def _finish(
        self,
        reasoning: str | None,
        content: str,
        thinking: bool,
        prompt_opens_think: bool,
        blockless: bool,
        calls: tuple[tuple[str, str], ...] = (),
        *,
        framed: bool = True,
    ) -> Generation:
        """Kimi's text as served (:meth:`_assemble`); any other family's framed (not an echo:
        that is the user's, verbatim), then the ids of the dialect's own completion parts."""
        if self._kimi:
            return self._assemble(reasoning, content)
        fam = self.family
        lead = fam.content_lead_thinking if thinking and not blockless else fam.content_lead_instant
        if lead and framed:
            content = lead + content.lstrip("\n")
        if blockless:
            reasoning, content = content, ""  # served as reasoning: no think block to split at
        elif reasoning is not None:
            opening, closing = fam.reasoning_frame
            reasoning = opening + reasoning + closing
        message = {"reasoning": reasoning, "content": content}
        parts = self.dialect.completion_parts(message, "stop", thinking, prompt_opens_think)
        ids: list[int] = []
        harmony = fam.writer == "harmony"
        for kind, text in parts:
            if harmony and kind in ("think_end", "end"):
                ids.append(self.tok.token_id(text))  # <|end|>, <|return|>, <|call|>: one id each
            else:
                ids += self.tok.encode_checked(text)[0]  # as the model writes it (no prompt-side run cuts)
        if not self.tok.lossless:
            # A normalising tokenizer (Qwen3's NFC) cannot emit every text: what the model
            # wrote is what its ids decode to, part by part.
            parts = [(kind, self.tok.decode(self.tok.encode(text))) for kind, text in parts]
            if reasoning is not None:
                reasoning = "".join(text for kind, text in parts if kind == "reasoning")
            content = "".join(text for kind, text in parts if kind in ("content", "tool_calls"))
        return Generation(reasoning=reasoning, content=content, native_ids=tuple(ids), spans=tuple(parts),
                          calls=calls)

    def _pick_calls(self, rng: random.Random, specs: list[ToolSpec], topic: prose.Topic) -> list[tuple[str, dict[str, Any]]]:
        count = 2 if len(specs) > 1 and rng.random() < 0.2 else 1
        chosen = rng.sample(specs, count)
        return [(s.name, make_arguments(rng, s, topic.phrase)) for s in chosen]

    def _tool_section(self, calls: list[tuple[str, dict[str, Any]]], start: int) -> str:
        tm = self.dialect.tool_markers
        assert tm is not None
        body = "".join(
            f"{tm.call_begin}functions.{name}:{start + i}{tm.argument_begin}"
            f"{json.dumps(args, ensure_ascii=False)}{tm.call_end}"
            for i, (name, args) in enumerate(calls)
        )
        return f"{tm.section_begin}{body}{tm.section_end}"

    def _assemble(self, reasoning: str | None, content: str, *, think_closed: bool = True) -> Generation:
        ids: list[int] = []
        if reasoning is not None and self.think_close_id is not None:
            ids += self.tok.encode_checked(reasoning)[0]
            if think_closed:
                ids.append(self.think_close_id)
        ids += self.tok.encode_checked(content)[0]
        ids.append(self.end_id)
        return Generation(reasoning=reasoning, content=content, native_ids=tuple(ids), think_closed=think_closed)


def harmony_call_text(name: str, arguments: str) -> str:
    """A gpt-oss tool call as its content (after an analysis message), up to the
    ``<|call|>`` the dialect appends: the header SGLang's HF template renders in history."""
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}"


def _text(message: Mapping[str, Any]) -> str:
    c = message.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return " ".join(str(p.get("text", "")) for p in c if isinstance(p, Mapping))
    return ""


def _last_user(messages: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    return next((m for m in reversed(messages) if m.get("role") == "user"), {})


def _system_text(messages: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(_text(m) for m in messages if m.get("role") in ("system", "developer"))


def _prior_calls(messages: Sequence[Mapping[str, Any]]) -> int:
    """Kimi numbers tool calls across the conversation (``functions.NAME:IDX``)."""
    return sum(len(m.get("tool_calls") or ()) for m in messages if m.get("role") == "assistant")

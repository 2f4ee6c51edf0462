"""The deterministic model behind the emulator.

For a request it writes the text parts and the *native ids* the real model would have
emitted, built from the real tokenizer:

* thinking: ``encode(reasoning) + [</think>] + encode(content) + [<|im_end|>]``
* instant:  ``encode(content) + [<|im_end|>]``
* a tool call opened without ``</think>`` (Kimi K2 does this; ``tool_call_without_think_close``):
  ``encode(reasoning) + encode(tool section) + [<|im_end|>]``

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
from .hashing import canonical_json, draw, sample_key
from .tool_specs import ToolSpec, make_arguments, tools_from_param, tools_from_text

#: A generation's cache key: (conversation key, tools JSON, thinking, seed, choice index).
_Key = tuple[str, str, bool, int, int]

__all__ = ["ECHO_BEGIN", "ECHO_END", "Generation", "SyntheticModel"]

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
        self._cache: OrderedDict[_Key, Generation] = OrderedDict()
        self._cache_size = cache_size
        self.think_close_id = tokenizer.token_id(dialect.think_close) if dialect.think_close else None
        self.end_id = tokenizer.token_id(dialect.end_token)

    def generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        thinking: bool,
        seed: int,
        index: int,
    ) -> Generation:
        key = (sample_key(messages), canonical_json(tools) if tools else "", thinking, seed, index)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        gen = self._write(messages, tools, thinking, random.Random(canonical_json([self.seed, *key])), key)
        self._cache[key] = gen
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return gen

    # -- writing ----------------------------------------------------------------------

    def _write(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, thinking: bool,
               rng: random.Random, key: _Key) -> Generation:
        last = messages[-1] if messages else {}
        echo = _ECHO.search(_text(last)) if last.get("role") == "user" else None
        if echo is not None:
            return self._assemble("The user wants this text repeated exactly." if thinking else None, echo.group(1))
        topic = prose.read_topic(_text(_last_user(messages)))
        specs = tools_from_param(tools) if tools else tools_from_text(_system_text(messages))
        if self.dialect.tool_markers is None:
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
        if wants_call:
            calls = self._pick_calls(rng, specs, topic)
            reasoning, content = prose.write_tool_preamble(rng, topic, [name for name, _ in calls])
            section = self._tool_section(calls, _prior_calls(messages))
            if thinking and draw(self.seed, "no_think_close", *key) < self.tool_call_without_think_close:
                return self._assemble(reasoning, section, think_closed=False)
            content += section
        elif last.get("role") == "tool":
            reasoning, content = prose.write_after_tool(rng, topic, _text(last), answer_chars)
        else:
            reasoning = prose.write_reasoning(rng, topic, reasoning_chars)
            content = prose.write_answer(rng, topic, answer_chars)
        return self._assemble(reasoning if thinking else None, content)

    def _pick_calls(self, rng: random.Random, specs: list[ToolSpec], topic: prose.Topic,
                    ) -> list[tuple[str, dict[str, Any]]]:
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
            ids += self.tok.encode(reasoning)
            if think_closed:
                ids.append(self.think_close_id)
        ids += self.tok.encode(content)
        ids.append(self.end_id)
        return Generation(reasoning=reasoning, content=content, native_ids=tuple(ids), think_closed=think_closed)


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

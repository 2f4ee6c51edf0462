"""Requests as SGLang 0.5.23 turns them into a prompt, against what tokenbridge renders.

The oracle: the request goes through SGLang's own ``ChatCompletionRequest`` (its
``normalize_reasoning_inputs`` sets ``thinking`` / ``enable_thinking`` from
``reasoning_effort``; its ``Tool`` model dumps the tools), then transformers'
``apply_chat_template`` with the folder's template renders what serving_chat hands it:
messages without null keys (``content: null`` is ``""``), JSON-string tool arguments
parsed, the request's ``reasoning_effort`` and ``chat_template_kwargs`` as template
kwargs, ``tools`` as ``Tool.model_dump()``; and, as ``_handle_last_assistant_message``
does without ``continue_final_message``, a last assistant message with string content
becomes a user message holding that content (serving_chat.py, 0.5.23).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest

from test_families_support import SHARED, family_tokenizer, register_sglang_namespace
from tokenbridge.chat import resolve_dialect
from tokenbridge.chat.template import special_token_strings
from tokenbridge.reconstruct import reconstruct_record


def _protocol() -> Any:
    register_sglang_namespace(pytest.fail)  # CI installs it: a missing oracle is a failure here
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    return ChatCompletionRequest


ChatCompletionRequest = _protocol()
FAMILIES = ("deepseek-v3.1", "qwen3", "glm-4.5")


@cache
def _family(name: str) -> tuple[Any, Any, Any]:
    from transformers import PreTrainedTokenizerFast

    tok = family_tokenizer(name)
    specials = special_token_strings(tok.config)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(SHARED / name / "tokenizer.json"), **specials)
    hf.chat_template = tok.chat_template
    return tok, resolve_dialect(tok), hf


def sglang_prompt(name: str, request: dict[str, Any]) -> str:
    """The prompt text SGLang 0.5.23 renders for ``request`` with the folder's template."""
    req = ChatCompletionRequest(model="m", **request)
    msgs = []
    for m in req.messages:
        msg = {k: v for k, v in m.model_dump().items() if v is not None}
        msg.setdefault("content", "")
        for call in msg.get("tool_calls") or ():
            if name != "deepseek-v3.1" and isinstance(call["function"].get("arguments"), str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        msgs.append(msg)
    if msgs[-1]["role"] == "assistant" and isinstance(msgs[-1]["content"], str) and not req.continue_final_message:
        msgs[-1] = {"role": "user", "content": msgs[-1]["content"]}
    kwargs: dict[str, Any] = {}
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    kwargs.update(req.chat_template_kwargs or {})
    tools = [t.model_dump() for t in req.tools] if req.tools else None
    return _family(name)[2].apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                                **kwargs)


USER = [{"role": "user", "content": "Say hi."}]

#: The thinking switch as clients send it to SGLang: a top-level ``reasoning_effort`` and
#: either template kwarg, alone and together.
SWITCHES: list[dict[str, Any]] = [
    {}, {"reasoning_effort": "none"}, {"reasoning_effort": "low"}, {"reasoning_effort": "high"},
    {"chat_template_kwargs": {"thinking": True}}, {"chat_template_kwargs": {"thinking": False}},
    {"chat_template_kwargs": {"enable_thinking": True}}, {"chat_template_kwargs": {"enable_thinking": False}},
    {"reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}},
    {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("switch", SWITCHES, ids=json.dumps)
def test_each_family_reads_the_thinking_switch_its_template_reads(name: str, switch: dict[str, Any]) -> None:
    """SGLang sets both ``thinking`` and ``enable_thinking`` from ``reasoning_effort``
    (an explicit kwarg wins) and each template reads only its own: V3.1 ``thinking``,
    Qwen3 and GLM ``enable_thinking``."""
    _, dialect, _ = _family(name)
    request = {"messages": USER, **switch}
    assert dialect.render_request(request) == sglang_prompt(name, request)


def test_reasoning_effort_turns_v31_thinking_on_and_the_record_is_exact() -> None:
    """The attack's ds31_reasoning_effort: ``reasoning_effort: "high"`` runs V3.1 in
    thinking mode (SGLang sets ``thinking: true``); the completion is reasoning, then
    ``</think>``, then the answer, rebuilt to the native ids."""
    tok, dialect, _ = _family("deepseek-v3.1")
    request = {"messages": USER, "reasoning_effort": "high"}
    prompt = tok.encode_prompt(sglang_prompt("deepseek-v3.1", request))
    assert tok.decode(prompt[-1:]) == "<think>"
    native = tok.encode("Greet.") + [tok.token_id("</think>")] + tok.encode("Hi!") + [tok.token_id("<｜end▁of▁sentence｜>")]
    record = {"id": "r", "request": request, "response": {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "Greet.", "content": "Hi!"}}], "usage": {
        "prompt_tokens": len(prompt), "completion_tokens": len(native)}}}
    (row,) = reconstruct_record(record, tok, dialect)
    assert (row["status"], row["prompt_ids"], row["completion_ids"]) == ("ok", prompt, native)

"""gpt-oss prompts as vLLM 0.34 renders them, held against vLLM's own conversion.

``--dialect gpt-oss-harmony`` rendered every request as ``renderers`` does, which claims
vLLM parity; vLLM's own code (``OnlineRenderer._make_request_with_harmony``: its
``extract_instructions_from_messages``, ``build_harmony_preamble``,
``parse_chat_inputs_to_harmony_messages`` and ``render_for_completion``, run here) differs:
a system message that is not first stays where it is (same tokens, another order: the same
count, so wrong prompt ids passed ``ok``), a history tool call is written after its text and
analysis with the ``json`` content type, an empty assistant turn writes nothing. Where the
two differ each is a reading (``harmony=vllm``), and the evidence picks."""

from __future__ import annotations

import copy
import json
import os
import sys
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from test_families_gptoss import NOON, harmony_conversations
from test_families_support import SHARED
from tokenbridge.chat import resolve_dialect
from tokenbridge.reconstruct import reconstruct_record
from vllm_support import register_vllm_namespace

FAMILY = "gpt-oss"  # the tok fixture (conftest)
DAY = "2025-01-01"


@pytest.fixture(scope="module")
def vllm_prompt():
    """vLLM's prompt text for a request, by its own code (the serving day pinned)."""
    register_vllm_namespace(pytest.fail)
    saved = {k: os.environ.get(k) for k in ("TIKTOKEN_ENCODINGS_BASE", "VLLM_SYSTEM_START_DATE")}
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(SHARED / "gpt-oss")
    os.environ["VLLM_SYSTEM_START_DATE"] = DAY
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.parser import harmony_utils as H

    def prompt(request: dict[str, Any]) -> str | None:
        try:
            req = ChatCompletionRequest(model="m", **copy.deepcopy(request))  # its validators edit the dicts
        except ValidationError:
            return None  # a request vLLM refuses (a 400): never served there
        instructions, rest = H.extract_instructions_from_messages(list(req.messages))
        messages = H.build_harmony_preamble(instructions=instructions, tools=req.tools,
                                            reasoning_effort=req.reasoning_effort, with_custom_tools=bool(req.tools))
        messages += H.parse_chat_inputs_to_harmony_messages(rest)
        return H.get_encoding().decode(H.render_for_completion(messages))

    yield prompt
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    sys.modules.pop("vllm.entrypoints.openai.parser.harmony_utils", None)


@pytest.fixture(scope="module")
def harmony(tok):
    return resolve_dialect(tok, "gpt-oss-harmony")


def _readings(harmony, request):
    return {r.name: r.text for r in harmony.prompt_readings(request, {"created": NOON}, {})}


@pytest.mark.parametrize("effort", ["low", "medium"])
def test_one_reading_is_vllms_prompt_for_every_request_it_serves(tok, harmony, vllm_prompt, effort):
    seen: Counter[str] = Counter()

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(harmony_conversations())
    def check(case):
        msgs, tools = case
        request = {"messages": msgs, "tools": tools, "reasoning_effort": effort}
        theirs = vllm_prompt(request)
        readings = _readings(harmony, request)
        if theirs is None:  # vLLM refuses it (arguments as an object): no vLLM reading
            assert list(readings) == [f"date={DAY}"]
            seen["refused"] += 1
            return
        ours = readings.get(f"date={DAY}+harmony=vllm", readings[f"date={DAY}"])
        assert ours == theirs
        seen["served"] += 1
        seen["differs"] += f"date={DAY}+harmony=vllm" in readings
        seen["late_system"] += any(m["role"] == "system" for m in msgs[1:])

    check()
    assert seen["served"] >= 60 and seen["differs"] >= 20 and seen["late_system"] >= 10, seen


@pytest.mark.parametrize(("messages", "same_count"), [
    # a system message after the first user turn: vLLM leaves it there, renderers moves it up
    ([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be terse."},
      {"role": "user", "content": "Again"}], True),
    # an empty assistant turn: renderers writes an empty final message, vLLM nothing
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "x"}], False),
])
def test_each_engines_prompt_is_proved_by_its_own_ids_and_a_tie_is_unproven(tok, harmony, vllm_prompt, messages,
                                                                             same_count):
    request = {"messages": messages}
    readings = _readings(harmony, request)
    ours, vllm = readings[f"date={DAY}"], readings[f"date={DAY}+harmony=vllm"]
    assert vllm == vllm_prompt(request) and ours != vllm
    assert (len(tok.encode(ours)) == len(tok.encode(vllm))) is same_count
    content = "Hello."
    completion = tok.encode("<|channel|>analysis<|message|>greet<|end|><|start|>assistant<|channel|>final<|message|>"
                            f"{content}<|return|>")

    def record(prompt_text, native):
        response = {"created": NOON, "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "reasoning_content": "greet", "content": content}}],
            "usage": {"prompt_tokens": len(tok.encode(prompt_text)), "completion_tokens": len(completion)}}
        if native:
            response["prompt_token_ids"] = tok.encode(prompt_text)
            response["choices"][0]["token_ids"] = completion
        return {"id": "h", "request": copy.deepcopy(request), "response": response}

    for text, name in ((ours, f"date={DAY}"), (vllm, f"date={DAY}+harmony=vllm")):
        row, = reconstruct_record(record(text, native=True), tok, harmony)
        assert row["prompt_ids"] == tok.encode(text) and row["status"] == "ok", row["findings"]
        assert row["reconstruction"] == name
        row, = reconstruct_record(record(text, native=False), tok, harmony)
        if same_count:  # the count cannot tell: never a guess
            assert [f["code"] for f in row["findings"]] == ["prompt_reading_unproven"] and row["status"] == "rejected"
        else:
            assert row["prompt_ids"] == tok.encode(text) and row["status"] == "ok", row["findings"]


def test_a_request_vllm_refuses_has_no_vllm_reading(harmony):
    """Arguments as an object: vLLM's request model refuses the request, so it was never
    rendered there."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}}
    request = {"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be terse."},
                            {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "c", "content": json.dumps({"t": 20})}]}
    assert list(_readings(harmony, request)) == [f"date={DAY}"]


@pytest.mark.parametrize("request_extra", [{"chat_template_kwargs": {"reasoning_effort": "high"}},
                                           {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                                           {"reasoning": {"effort": "high"}}])
def test_vllms_effort_is_the_requests_own_never_the_template_kwargs(harmony, vllm_prompt, request_extra):
    """vLLM's harmony path reads ``reasoning_effort`` alone; both readings printed the
    template kwargs' effort, ``Reasoning: high`` where vLLM wrote ``medium``, the same count:
    wrong prompt ids ``ok`` (a cold reviewer's)."""
    request = {"messages": [{"role": "user", "content": "Hi"}], **request_extra}
    readings = _readings(harmony, request)
    vllm = readings.get(f"date={DAY}+harmony=vllm", readings[f"date={DAY}"])
    served = request_extra.get("reasoning", {}).get("effort") or request_extra.get("reasoning_effort") or "medium"
    assert vllm == vllm_prompt({**request, "reasoning_effort": served} if "reasoning" in request_extra else request)

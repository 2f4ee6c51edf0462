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

import copy
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
def sglang_content_functions() -> dict[str, Any]:
    """SGLang 0.5.23's own content-format detection and processing
    (``parser/jinja_template_utils.py``) and its tool-content join (``serving_chat.py``),
    compiled from its installed files: both modules import the runtime (triton) at the top."""
    import logging

    import jinja2
    import transformers.utils.chat_template_utils as hf_chat_utils

    from vllm_support import vllm_source_functions

    namespace: dict[str, Any] = {"jinja2": jinja2, "hf_chat_utils": hf_chat_utils, "logger": logging.getLogger("sglang"),
                                 "GLM_MEDIA_CONFIG_KEYS": (), "ImageData": dict, "VideoData": dict}
    return vllm_source_functions({
        "sglang.srt.parser.jinja_template_utils": (
            ("", "_is_var_access"), ("", "_is_attr_access"), ("", "_is_var_or_elems_access"), ("", "_try_extract_ast"),
            ("", "detect_jinja_template_content_format"), ("", "process_content_for_template_format")),
        "sglang.srt.entrypoints.openai.serving_chat": (("", "normalize_tool_content"),),
    }, namespace)


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
    sg = sglang_content_functions()
    fmt = sg["detect_jinja_template_content_format"](_family(name)[2].chat_template)
    msgs = []
    for m in req.messages:
        msg = {k: v for k, v in m.model_dump().items() if v is not None}
        msg.setdefault("content", "")
        msg = sg["process_content_for_template_format"](msg, fmt, [], [], [], [])
        msg["content"] = sg["normalize_tool_content"](msg["role"], msg.get("content"))
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


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"parameters": {"type": "object", "properties": {}}, "name": "now",
                                           "x-extra": 1}}]
TRAILING = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moon"}]


def _record(name: str, request: dict[str, Any], prompt_text: str, *, usage: bool = True,
            sglang: bool = False) -> tuple[dict, list[int]]:
    """A record served from ``prompt_text``: an instant/plain answer ``Hi!`` and its end token;
    ``sglang``: the message as SGLang serves it (GLM's reasoning keeps ``"\n<think>"``)."""
    tok, dialect, _ = _family(name)
    prompt = tok.encode_prompt(prompt_text)
    thinking = dialect.thinking(request) and not prompt_text.endswith(("</think>", "<think></think>",
                                                                      "<think>\n\n</think>\n\n"))
    end = [tok.token_id(dialect.end_token)]
    lead = {"deepseek-v3.1": [], "qwen3": [tok.token_id("<think>")], "glm-4.5": tok.encode("\n") + [tok.token_id("<think>")]}
    think = lead[name] + tok.encode("ok") + [tok.token_id("</think>")] if thinking else []
    native = think + tok.encode("Hi!") + end
    reasoning = "\n<think>ok" if sglang and name == "glm-4.5" else "ok"
    message = {"role": "assistant", "content": "Hi!", **({"reasoning_content": reasoning} if think else {})}
    response: dict[str, Any] = {"choices": [{"index": 0, "finish_reason": "stop", "message": message}]}
    if usage:
        response["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": len(native)}
    return {"id": "r", "request": request, "response": response}, prompt + native


@pytest.mark.parametrize("name", ["qwen3", "glm-4.5"])
def test_tools_as_sglang_dumps_them_are_a_reading_the_count_picks(name: str) -> None:
    """SGLang's ``Tool.model_dump()`` adds ``"defer_loading": null`` (and a null
    ``description``, dropping unknown keys): the served prompt is that, and the count
    picks it; the as-sent prompt stays the reading for a count that fits it (vLLM)."""
    tok, dialect, hf = _family(name)
    request = {"messages": USER, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    served = sglang_prompt(name, request)
    assert served != dialect.render_request(request)  # the two engines differ
    record, ids = _record(name, request, served)
    (row,) = reconstruct_record(record, tok, dialect)
    assert (row["status"], row["reconstruction"], row["prompt_ids"] + row["completion_ids"]) == ("ok", "tools=sglang", ids)
    as_sent = hf.apply_chat_template(USER, tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    record, ids = _record(name, request, as_sent)
    (row,) = reconstruct_record(record, tok, dialect)
    assert (row["status"], row["reconstruction"], row["prompt_ids"] + row["completion_ids"]) == ("ok", None, ids)


@pytest.mark.parametrize("name", ["qwen3", "glm-4.5"])
def test_tools_without_prompt_evidence_are_not_ok(name: str) -> None:
    tok, dialect, _ = _family(name)
    request = {"messages": USER, "tools": TOOLS}
    record, _ = _record(name, request, sglang_prompt(name, request), usage=False)
    (row,) = reconstruct_record(record, tok, dialect)
    assert row["status"] == "rejected" and "prompt_reading_unproven" in {f["code"] for f in row["findings"]}


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("thinking", [False, True])
def test_a_last_assistant_message_is_a_reading_as_sglang_renders_it(name: str, thinking: bool) -> None:
    """SGLang turns a last assistant message into a user message and adds the generation
    prompt; where the count tells it from the as-sent prompt the row is that reading,
    where it cannot (V3.1: same count) the row is never ok."""
    tok, dialect, _ = _family(name)
    switch = {"thinking": thinking} if name == "deepseek-v3.1" else {"enable_thinking": thinking}
    request = {"messages": TRAILING, "chat_template_kwargs": switch}
    served = sglang_prompt(name, request)
    readings = dialect.prompt_readings(request)
    assert served in [r.text for r in readings]
    assert [r.name for r in readings if r.text == served] == ["last_assistant=user"]
    record, ids = _record(name, request, served, sglang=True)  # a prompt only SGLang renders: its completion too
    (row,) = reconstruct_record(record, tok, dialect)
    counts = {len(tok.encode_prompt(r.text)) for r in readings}
    if len(counts) == len(readings):
        assert (row["status"], row["reconstruction"], row["prompt_ids"] + row["completion_ids"]) == (
            "ok", "last_assistant=user", ids)
    else:
        assert row["status"] == "rejected" and "prompt_reading_unproven" in {f["code"] for f in row["findings"]}
    record["native_ids"] = {"prompt": tok.encode_prompt(served)}
    (row,) = reconstruct_record(record, tok, dialect)
    assert row["prompt_ids"] == tok.encode_prompt(served)
    assert "prompt_reading_unproven" not in {f["code"] for f in row["findings"]}


# --- gpt-oss: the effort and the history keys SGLang hands the template -----------------------

NOON = 1767268800  # 2026-01-01 12:00 UTC: the exchange's day, printed by the template


def _gpt_oss_prompt(request: dict[str, Any]) -> tuple[str, str]:
    """(SGLang's prompt, tokenbridge's) for a gpt-oss request answered at NOON."""
    from datetime import date

    theirs = sglang_prompt("gpt-oss", request).replace(date.today().isoformat(), "2026-01-01")
    dialect = _family("gpt-oss")[1]
    ours = dialect.prompt_readings(request, {"created": NOON}, {})
    assert len(ours) == 1
    return theirs, ours[0].text


@pytest.mark.parametrize("reasoning", [{"effort": "high"}, {"reasoning_effort": "high"}, {"enabled": True}])
def test_gpt_oss_reasoning_object_effort_wins_as_in_sglang(reasoning):
    """``reasoning_effort: low`` beside OpenRouter's ``reasoning`` object: SGLang's
    ``normalize_reasoning_inputs`` takes the object's effort where it gives one. The prompt
    said ``Reasoning: low`` against SGLang's ``high``, the same count: ``ok`` with wrong ids."""
    request = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "low", "reasoning": reasoning}
    theirs, ours = _gpt_oss_prompt(request)
    assert ours == theirs
    assert ("Reasoning: high" in ours) is ("enabled" not in reasoning)


def test_history_keys_sglang_drops_never_reach_the_template():
    """gpt-oss's template prints an assistant turn's ``thinking``, but SGLang's message model
    has no such key and drops it (and a user message's ``name``) before the template runs:
    rendered as sent, the prompt was 11 tokens longer and the sample rejected."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = {"messages": [{"role": "user", "content": "Hi", "name": "bob"},
                            {"role": "assistant", "content": "", "thinking": "I should call f.", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "c1", "content": "42"}]}
    theirs, ours = _gpt_oss_prompt(request)
    assert ours == theirs and "I should call f." not in ours


def vllm_prompt(name: str, request: dict[str, Any]) -> str:
    """The prompt text vLLM 0.34 renders for ``request`` with the folder's template: its own
    request model and message parsing (``parse_chat_messages``, the content format its
    ``_detect_content_format`` finds), then transformers' ``apply_chat_template``."""
    import types

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages
    from vllm.renderers.hf import _detect_content_format

    hf = _family(name)[2]
    req = VllmRequest(model="m", **copy.deepcopy(request))  # its validators pop keys from the messages given
    fmt = _detect_content_format(hf.chat_template, default="string")
    conv, _, _ = parse_chat_messages(req.messages, types.SimpleNamespace(multimodal_config=None,
                                                                          enable_prompt_embeds=False), fmt)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return hf.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True,
                                  **(req.chat_template_kwargs or {}))


@pytest.mark.parametrize("name", ["qwen3", "glm-4.5"])
def test_history_reasoning_sent_as_reasoning_is_vllms_reading(name: str) -> None:
    """An assistant turn whose reasoning is sent as ``reasoning`` (OpenRouter's response field,
    fed back as history): vLLM 0.34 hands it to the template as ``reasoning_content``, which
    Qwen3's and GLM's templates print for a tool-call chain; SGLang's message model drops the
    key. Only SGLang's prompt was a reading, so vLLM's was rejected as a count mismatch."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    request = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": "", "reasoning": "Need the tool.", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "c1", "content": "20C"}],
               "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                            "parameters": {"type": "object", "properties": {
                                                                "city": {"type": "string"}}, "required": ["city"]}}}]}
    tok, dialect, _ = _family(name)
    readings = {r.name: r.text for r in dialect.prompt_readings(request)}
    theirs = vllm_prompt(name, request)
    assert "Need the tool." in theirs and readings.get("reasoning=vllm") == theirs
    assert sglang_prompt(name, request) in readings.values() and "Need the tool." not in readings[None]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "It is mild.", "content": "20C in Paris."}}],
        "usage": {"prompt_tokens": len(tok.encode(theirs)), "completion_tokens": 0}}
    row, = reconstruct_record({"id": "v", "request": request, "response": response}, tok)
    assert (row["reconstruction"] or "").startswith("reasoning=vllm") and row["prompt_ids"] == tok.encode(theirs)


def exported_history(tmp_path: Any, name: str, request: dict[str, Any], prompt: str) -> list[dict[str, Any]]:
    """The history turns the conversations export writes for a record of ``request`` whose
    usage counts ``prompt`` (the prompt's count is the evidence), reconstructed and exported."""
    from tokenbridge.export import export_file
    from tokenbridge.reconstruct import reconstruct_file

    tok = _family(name)[0]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "It is mild.", "content": "20C in Paris."}}],
        "usage": {"prompt_tokens": len(tok.encode(prompt))}}
    src = tmp_path / "ex.jsonl"
    src.write_text(json.dumps({"id": "v", "request": request, "response": response}) + "\n")
    reconstruct_file(src, tmp_path / "rows.jsonl", tok, workers=1)
    export_file(tmp_path / "rows.jsonl", tmp_path / "conv", "conversations", include_flagged=True)
    row = json.loads(next((tmp_path / "conv").glob("*.jsonl")).read_text())
    return list(row["conversations"][:-1])


def test_conversations_export_writes_history_reasoning_vllm_rendered(tmp_path) -> None:
    """A row proved by ``reasoning=vllm``: the exported history carries that turn's reasoning as
    ``reasoning_content``, so the template re-renders the proved prompt."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    request = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": "", "reasoning": "Need the tool.", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "c1", "content": "20C"}]}
    tok, dialect, hf = _family("qwen3")
    theirs = vllm_prompt("qwen3", request)
    history = exported_history(tmp_path, "qwen3", request, theirs)
    assert history[1]["reasoning_content"] == "Need the tool."
    assert hf.apply_chat_template(history, tokenize=False, add_generation_prompt=True) == theirs


def test_vllm_takes_reasoning_over_reasoning_content() -> None:
    """Both keys on one history turn (a reviewer's): vLLM's request model drops
    ``reasoning_content`` where ``reasoning`` is given (``_normalize_messages_before``) and
    hands ``reasoning`` over under both names; its prompt is a reading, and at the same
    count as the one sent the gate says it cannot tell them apart."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    request = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": "", "reasoning": "Need the tool now.",
                             "reasoning_content": "Call it, quick.", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "c1", "content": "20C"}]}
    tok, dialect, _ = _family("qwen3")
    readings = {r.name: r.text for r in dialect.prompt_readings(request)}
    theirs = vllm_prompt("qwen3", request)
    assert readings.get("reasoning=vllm") == theirs and "Need the tool now." in theirs
    assert "Call it, quick." in readings[None]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "It is mild.", "content": "20C."}}],
        "usage": {"prompt_tokens": len(tok.encode(theirs))}}
    row, = reconstruct_record({"id": "b", "request": request, "response": response}, tok)
    same = len(tok.encode(readings[None])) == len(tok.encode(theirs))
    assert row["status"] == "rejected" if same else row["prompt_ids"] == tok.encode(theirs)


_EMPTY_ARGS = {"messages": [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[]"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
_EMPTY_CALLS = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "tool_calls": []},
                             {"role": "user", "content": "Q"}]}


@pytest.mark.parametrize(("name", "request_", "sglang_serves"), [
    ("qwen3", _EMPTY_ARGS, True), ("glm-4.5", _EMPTY_ARGS, False), ("deepseek-v3.1", _EMPTY_CALLS, True)],
    ids=["qwen3-args", "glm-args", "deepseek-empty-calls"])
def test_vllms_tool_call_postprocessing_is_a_reading(tmp_path, name: str, request_: dict[str, Any],
                                                       sglang_serves: bool) -> None:
    """vLLM 0.34 hands every template the history's tool calls post-processed
    (``_postprocess_messages``): arguments that are not a JSON object become ``{}`` (Qwen3 then
    prints ``{}`` where ``[]`` was sent, at the same count; GLM's template, which iterates
    them, raised on the string, and the record was lost) and an empty ``tool_calls`` is dropped
    (DeepSeek V3.1's template printed a tool-call turn without its content, at the same count).
    vLLM's prompt was no reading: at a tied count a wrong prompt passed ``ok`` (a cold
    reviewer's). Now ``tool_calls=vllm``; a tie says so, and the export writes it as served."""
    tok, dialect, hf = _family(name)
    readings = {r.name: r.text for r in dialect.prompt_readings(request_)}
    theirs = vllm_prompt(name, request_)
    assert readings.get("tool_calls=vllm") == theirs
    if sglang_serves:
        sglang = sglang_prompt(name, request_)
        assert sglang in readings.values() and sglang != theirs
        assert len(tok.encode(sglang)) == len(tok.encode(theirs))  # the count cannot tell them apart
        response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Done."}}],
                    "usage": {"prompt_tokens": len(tok.encode(theirs))}}
        row, = reconstruct_record({"id": "t", "request": request_, "response": response}, tok, dialect=dialect)
        assert row["status"] == "rejected" and "prompt_reading_unproven" in [f["code"] for f in row["findings"]]
    else:
        assert set(readings) == {"tool_calls=vllm"}
        history = exported_history(tmp_path, name, request_, theirs)
        assert hf.apply_chat_template(history, tokenize=False, add_generation_prompt=True) == theirs

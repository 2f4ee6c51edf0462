"""vLLM 0.34's own prompt building as the oracle for prompt readings (a cold tester's).

* Qwen3 and GLM-4.5: vLLM hands any template ``[tool.model_dump() ...]`` of its
  ``ChatCompletionToolsParam`` (its fields' order, ``description`` / ``parameters`` null
  when absent); rendered here by transformers' ``apply_chat_template`` with the folder's
  template. Tools sent in another key order kept the count and were ``ok`` with the ids of
  the order sent; a tool with no description was refused (another count).
* DeepSeek V3.2: vLLM's renderer (``DeepseekV32Renderer``) runs ``parse_chat_messages``
  with ``content_format="string"`` (text parts joined with a newline, Claude Code's
  attribution line dropped) and its encoder wrapper puts the tools on a system message of
  their own in front of the conversation's; run here as vLLM runs them.

Each request's vLLM prompt must be one of tokenbridge's readings, and a record with honest
counts is ``ok`` with exactly those ids, or rejected as a reading no count tells apart.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from test_families_support import SHARED, family_tokenizer
from tokenbridge.chat import resolve_dialect
from tokenbridge.reconstruct import reconstruct_record
from vllm_support import register_vllm_namespace

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
          "required": ["city"]}
DESC = "Get the current weather."
TOOL_FORMS = {
    "as_vllm_dumps": [{"type": "function", "function": {"name": "get_weather", "description": DESC, "parameters": PARAMS}}],
    "description_first": [{"type": "function", "function": {"description": DESC, "name": "get_weather", "parameters": PARAMS}}],
    "parameters_first": [{"type": "function", "function": {"parameters": PARAMS, "name": "get_weather", "description": DESC}}],
    "function_first": [{"function": {"name": "get_weather", "description": DESC, "parameters": PARAMS}, "type": "function"}],
    "no_description": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
    "extra_keys": [{"type": "function", "function": {"name": "get_weather", "description": DESC, "parameters": PARAMS,
                                                    "x-note": "internal"}}],
    # flags as pydantic reads booleans outside strict mode (a reviewer's: 1 is == True to Python)
    "strict_int": [{"type": "function", "function": {"name": "get_weather", "description": DESC, "parameters": PARAMS,
                                                    "strict": 1}}],
    "strict_float": [{"type": "function", "function": {"name": "get_weather", "description": DESC,
                                                      "parameters": PARAMS, "strict": 1.0}}],
    "defer_word": [{"type": "function", "function": {"name": "get_weather", "description": DESC, "parameters": PARAMS},
                    "defer_loading": "off"}],
}


@pytest.fixture(scope="module")
def vllm() -> types.SimpleNamespace:
    register_vllm_namespace(pytest.skip)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionToolsParam
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages
    from vllm.tokenizers.deepseek_v32 import get_deepseek_v32_tokenizer

    return types.SimpleNamespace(Request=ChatCompletionRequest, Tool=ChatCompletionToolsParam,
                                 parse=parse_chat_messages, v32=get_deepseek_v32_tokenizer)


def _hf(folder: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(SHARED / folder / "tokenizer.json"))


def _judged(tok: Any, request: dict[str, Any], prompt_text: str, content: str, end: str) -> dict[str, Any]:
    """The row of a record vLLM served for ``request`` (prompt ``prompt_text``), its answer
    ``content`` ended by ``end``, with honest counts."""
    prompt_ids = tok.encode_prompt(prompt_text)
    completion = tok.encode(content) + [tok.token_id(end)]
    response = {"provider": "p", "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": tok.token_id(end),
                                              "message": {"role": "assistant", "content": content}}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion)}}
    row, = reconstruct_record({"id": "v", "request": request, "response": response}, tok)
    return row


def _holds(row: dict[str, Any], tok: Any, prompt_text: str) -> bool:
    """ok with the oracle's prompt ids, or rejected because readings tie (never ok otherwise)."""
    codes = [f["code"] for f in row["findings"]]
    if row["status"] == "ok":
        return row["prompt_ids"] == tok.encode_prompt(prompt_text)
    return row["status"] == "rejected" and codes == ["prompt_reading_unproven"]


@pytest.mark.parametrize("family,end", [("qwen3", "<|im_end|>"), ("glm-4.5", "<|user|>")])
@pytest.mark.parametrize("form", list(TOOL_FORMS))
def test_tools_as_vllm_dumps_them_are_a_reading(vllm, family, end, form):
    tok = family_tokenizer(family)
    dialect = resolve_dialect(tok)
    hf = _hf(family)
    hf.chat_template = (SHARED / family / "chat_template.jinja").read_text(encoding="utf-8")
    tools = TOOL_FORMS[form]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    request = {"model": "m", "messages": messages, "tools": tools, "chat_template_kwargs": {"enable_thinking": False}}
    dumped = [vllm.Tool.model_validate(t).model_dump() for t in tools]
    oracle = hf.apply_chat_template(messages, tools=dumped, tokenize=False, add_generation_prompt=True,
                                    enable_thinking=False)
    readings = {r.text: r.name for r in dialect.prompt_readings(request)}
    assert oracle in readings  # named tools=vllm, or as an earlier reading of the same text
    content = "It is sunny." if family == "qwen3" else "\nIt is sunny."
    row = _judged(tok, request, oracle, content, end)
    assert _holds(row, tok, oracle), (row["status"], row["findings"])
    counts = {len(tok.encode_prompt(text)) for text in readings if text != oracle}
    if len(tok.encode_prompt(oracle)) not in counts:  # the count picks vLLM's
        assert row["status"] == "ok" and row["reconstruction"] == readings[oracle]


V32_TOOLS = TOOL_FORMS["as_vllm_dumps"]
V32_REQUESTS = {
    "tools_after_system": {"messages": [{"role": "system", "content": "\n# Role\nYou are a bot."},
                                        {"role": "user", "content": "Weather in Paris?"}], "tools": V32_TOOLS},
    "tools_after_braces": {"messages": [{"role": "system", "content": "{}"},
                                        {"role": "user", "content": "Weather in Paris?"}], "tools": V32_TOOLS},
    "tools_no_system": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": V32_TOOLS},
    "tools_thinking": {"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Weather in Paris?"}], "tools": V32_TOOLS,
                       "chat_template_kwargs": {"thinking": True}},
    "parts_same_count": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello."},
                                                                   {"type": "text", "text": "World"}]}]},
    "parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                        {"type": "text", "text": "there"}]}]},
    "billing_header": {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.2\n"
                                                                  "You are Claude Code, a CLI for coding."},
                                    {"role": "user", "content": "List files."}]},
    "tools_parts_system": {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be"},
                                                                      {"type": "text", "text": "brief."}]},
                                        {"role": "user", "content": "Weather in Paris?"}], "tools": TOOL_FORMS["no_description"]},
}


@pytest.mark.parametrize("name", list(V32_REQUESTS))
def test_deepseek_v32_prompts_as_vllm_builds_them_are_a_reading(vllm, name):
    tok = family_tokenizer("deepseek-v3.2")
    dialect = resolve_dialect(tok)
    request = {"model": "deepseek-ai/DeepSeek-V3.2", **V32_REQUESTS[name]}
    parsed = vllm.Request.model_validate(request)
    conversation, _, _ = vllm.parse(request["messages"], types.SimpleNamespace(multimodal_config=None,
                                                                              enable_prompt_embeds=False),
                                    content_format="string")
    tools = None if parsed.tools is None else [t.model_dump() for t in parsed.tools]
    oracle = vllm.v32(_hf("deepseek-v3.2")).apply_chat_template(
        request["messages"], tools=tools, conversation=conversation, tokenize=False, add_generation_prompt=True,
        **(parsed.chat_template_kwargs or {}))
    assert oracle in {r.text for r in dialect.prompt_readings(request)}
    thinking = dialect.thinking(request)
    served = {"role": "assistant", "content": "It is mild today.", **({"reasoning": "Short."} if thinking else {})}
    prompt_ids = tok.encode_prompt(oracle)
    completion = tok.encode(("Short.</think>" if thinking else "") + "It is mild today.") + [tok.token_id(
        "<｜end▁of▁sentence｜>")]
    response = {"provider": "p", "choices": [{"index": 0, "finish_reason": "stop", "message": served}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion)}}
    row, = reconstruct_record({"id": "v", "request": request, "response": response}, tok)
    assert _holds(row, tok, oracle), (row["status"], row["findings"])
    assert row["completion_ids"] == completion
    counts = {len(tok.encode_prompt(r.text)) for r in dialect.prompt_readings(request) if r.text != oracle}
    if len(prompt_ids) not in counts:  # the count picks vLLM's
        assert row["status"] == "ok"


def test_conversations_export_writes_the_tools_as_vllm_handed_them_to_the_template(vllm, tmp_path):
    """A row proved by ``tools=vllm``: the exported ``tools`` are vLLM's dump (its key order,
    a null description), so the template re-renders the proved prompt from them."""
    import json

    from tokenbridge.export import export_file
    from tokenbridge.reconstruct import reconstruct_file

    tok = family_tokenizer("qwen3")
    hf = _hf("qwen3")
    hf.chat_template = (SHARED / "qwen3" / "chat_template.jinja").read_text(encoding="utf-8")
    tools = TOOL_FORMS["no_description"]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    request = {"model": "m", "messages": messages, "tools": tools, "chat_template_kwargs": {"enable_thinking": False}}
    oracle = hf.apply_chat_template(messages, tools=[vllm.Tool.model_validate(t).model_dump() for t in tools],
                                    tokenize=False, add_generation_prompt=True, enable_thinking=False)
    completion = tok.encode("Sunny.") + [tok.token_id("<|im_end|>")]
    response = {"provider": "p", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Sunny."}}], "usage": {"prompt_tokens": len(tok.encode_prompt(oracle)),
                                                              "completion_tokens": len(completion)}}
    src = tmp_path / "ex.jsonl"
    src.write_text(json.dumps({"id": "v", "request": request, "response": response}) + "\n", encoding="utf-8")
    reconstruct_file(src, tmp_path / "rows.jsonl", tok, workers=1)
    row = json.loads((tmp_path / "rows.jsonl").read_text(encoding="utf-8"))
    assert (row["status"], row["reconstruction"]) == ("ok", "tools=vllm")
    export_file(tmp_path / "rows.jsonl", tmp_path / "conv", "conversations")
    exported = json.loads(next((tmp_path / "conv").glob("*.jsonl")).read_text(encoding="utf-8"))
    history = [{k: v for k, v in turn.items() if k in ("role", "content")} for turn in exported["conversations"][:-1]]
    assert hf.apply_chat_template(history, tools=json.loads(exported["tools"]), tokenize=False,
                                  add_generation_prompt=True, enable_thinking=False) == oracle


def test_no_vllm_reading_where_its_tool_model_refuses_the_request(vllm):
    """A tool of ``"type": "custom"``: vLLM's model refuses the request (it served nothing),
    SGLang's takes any type. V3.2's vLLM reading (tools on a system message of their own)
    was still offered, and where its count tied SGLang's the honest row was rejected."""
    import pydantic

    tool = {"type": "custom", "function": {"name": "get_weather", "description": DESC, "parameters": PARAMS}}
    for family in ("deepseek-v3.2", "qwen3"):
        request = {"model": "m", "tools": [tool], "messages": [{"role": "system", "content": "{}"},
                                                               {"role": "user", "content": "Weather in Paris?"}]}
        with pytest.raises(pydantic.ValidationError):
            vllm.Request.model_validate(request)
        names = {r.name or "" for r in resolve_dialect(family_tokenizer(family)).prompt_readings(request)}
        assert not any("vllm" in n or "newline" in n for n in names), names


@pytest.mark.parametrize("part", [{"type": "thinking", "thinking": None}, {"type": "input_text"},
                                  {"type": "thinking", "thinking": 5}, {"type": "refusal", "refusal": 7}],
                         ids=["thinking-null", "input_text-bare", "thinking-int", "refusal-int"])
@pytest.mark.parametrize("family,fmt", [("qwen3", "string"), ("glm-4.5", "openai")])
def test_parts_vllm_hands_on_keep_its_reading(vllm, family, fmt, part):
    """A reviewer's: a part vLLM skips (null text, ``string`` format) or hands on as it is
    (``openai`` format) lost vLLM's reading when the join was taken for a refusal; only a
    text that is not a string under ``string`` breaks vLLM's join (no prompt)."""
    import copy

    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in"}, part,
                                             {"type": "text", "text": "Paris?"}]}]
    request = {"model": "m", "messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    vllm.Request.model_validate(copy.deepcopy(request))  # its request model takes it
    hf = _hf(family)
    hf.chat_template = (SHARED / family / "chat_template.jinja").read_text(encoding="utf-8")
    config = types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False)
    texts = {r.text for r in resolve_dialect(family_tokenizer(family)).prompt_readings(request)}
    try:
        conversation, _, _ = vllm.parse(copy.deepcopy(messages), config, content_format=fmt)
    except TypeError:  # the join of a text that is not a string: vLLM served no prompt
        assert fmt == "string" and not isinstance(list(part.values())[-1], str | None)
        return
    oracle = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert oracle in texts

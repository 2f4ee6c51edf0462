"""A content sent as a list of parts, as SGLang 0.5.23 and vLLM 0.34 hand it to a folder's
chat template (:mod:`tokenbridge.chat.parts`), held against their own code: each engine's
content-format detection on every shared template and on templates written to reach each
rule, each engine's flattening, and the prompts both render."""

from __future__ import annotations

import copy
import json
import types
from typing import Any

import pytest

from test_families_sglang_requests import _family, exported_history, sglang_content_functions, sglang_prompt, vllm_prompt
from test_families_support import SHARED
from tokenbridge.chat.parts import sglang_content_format, sglang_parts, vllm_content_format, vllm_parts
from tokenbridge.reconstruct import reconstruct_record
from tokenbridge.tokenizer import load_tokenizer


def _vllm_detect(source: str) -> str:
    from vllm.renderers.hf import _detect_content_format

    _detect_content_format.cache_clear()
    return _detect_content_format(source, default="string")


LOOP = "{% for message in messages %}"
END = "{% endfor %}"

#: Templates that reach each rule of either engine's detection (name -> source).
TEMPLATES = {
    "string": LOOP + "{{ message.content }}" + END,
    "loop_item": LOOP + "{% for p in message['content'] %}{{ p.text }}" + END + END,
    "loop_msg_attr": "{% for msg in messages %}{% for p in msg.content %}{{ p.text }}" + END + END,
    "loop_m_filtered": "{% for m in messages[1:] %}{% for p in m.content | list %}{{ p.text }}" + END + END,
    "alias": "{% set msgs = messages %}{% for x in msgs %}{% for p in x.content %}{{ p }}" + END + END,
    "namespace": "{% set ns = namespace(rest=messages) %}{% for it in ns.rest %}{% for p in it['content'] %}{{ p }}"
                 + END + END,
    "ns_attr": "{% set ns = namespace(x=none) %}{% set ns.x = messages %}{% for y in ns.x %}{% for p in y.content %}"
               "{{ p }}" + END + END,
    "macro": "{% macro show(c) %}{% for p in c %}{{ p.text }}" + END + "{% endmacro %}" + LOOP
             + "{{ show(message.content) }}" + END,
    "macro_kwarg": "{% macro show(c) %}{% for p in c %}{{ p.text }}" + END + "{% endmacro %}" + LOOP
                   + "{{ show(c=message.content) }}" + END,
    "macro_other_arg": "{% macro show(content) %}{% for p in content %}{{ p }}" + END + "{% endmacro %}" + LOOP
                       + "{{ show(message.role) }}" + END,
    "content_var": LOOP + "{% set content = message.content %}{% for p in content %}{{ p }}" + END + END,
    "string_or_parts": LOOP + "{% if message.content is string %}{{ message.content }}{% else %}"
                       "{% for p in message.content %}{{ p.text }}" + END + "{% endif %}" + END,
    "media_word": "{# image #}" + LOOP + "{{ message.content }}" + END,
    "unparsable": "{% for %}",
    "break_outside_loop": "{% break %}",
    # vLLM asserts one name as a loop's target: a tuple over the messages, or over the parts
    # before any other loop over them, makes its search fail and say "string"
    "tuple_over_messages": "{% for role, turns in messages|groupby('role') %}" + END + LOOP
                           + "{% for p in message.content %}{{ p }}" + END + END,
    "tuple_over_parts": LOOP + "{% for i, p in message.content|batch(2) %}{{ p }}" + END + END,
    "tuple_after_a_found_loop": LOOP + "{% for p in message.content %}{{ p }}" + END
                                + "{% for i, p in message.content|batch(2) %}{{ p }}" + END + END,
}


def _shared_templates() -> dict[str, str]:
    out = {}
    for folder in sorted(SHARED.iterdir()):
        try:
            source = load_tokenizer(folder).chat_template
        except Exception:  # noqa: BLE001 - a folder without a template to load: nothing to compare
            continue
        if source:
            out[f"shared:{folder.name}"] = source
    return out


ALL_TEMPLATES = {**TEMPLATES, **_shared_templates()}


@pytest.mark.parametrize("name", sorted(ALL_TEMPLATES))
def test_each_engine_detects_the_content_format_as_its_own_code_does(name):
    source = ALL_TEMPLATES[name]
    assert sglang_content_format(source) == sglang_content_functions()["detect_jinja_template_content_format"](source)
    assert vllm_content_format(source) == _vllm_detect(source)


def test_the_rules_are_reached_and_the_engines_part_ways():
    """The templates above are not all one answer: each engine says ``openai`` for some and
    ``string`` for others, and they disagree on some (a medium's name alone, a macro)."""
    formats = {name: (sglang_content_format(s), vllm_content_format(s)) for name, s in TEMPLATES.items()}
    assert formats["string"] == formats["unparsable"] == ("string", "string")
    assert formats["loop_item"] == formats["string_or_parts"] == ("openai", "openai")
    assert formats["media_word"] == ("openai", "string")
    assert formats["macro"] == formats["alias"] == formats["content_var"] == ("string", "openai")
    assert formats["macro_other_arg"] == ("string", "string")
    assert formats["tuple_over_messages"] == formats["tuple_over_parts"] == ("openai", "string")
    assert formats["tuple_after_a_found_loop"] == ("openai", "openai")


#: Messages with list contents of every kind the flattening tells apart.
MESSAGES = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "input_text", "text": "2 + 2?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me"}, {"type": "text", "text": "see."}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "20C"}, {"type": "text", "text": "sunny"}]},
    {"role": "user", "content": "plain"},
    {"role": "user", "content": []},
    {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]},
    {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": ""},
                                 {"type": "text", "text": "2 + 2?", "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "4"}]},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
    {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=9f3a1;\nYou are terse."},
                                   {"type": "text", "text": "Be brief."}]},
    {"role": "system", "content": "x-anthropic-billing-header: cch=9f3a1;\nYou are terse."},
    {"role": "system", "content": "x-anthropic-billing-header: cch=9f3a1;"},
]


@pytest.mark.parametrize("fmt", ["string", "openai"])
def test_sglang_parts_are_sglangs_own(fmt):
    sg = sglang_content_functions()
    for message in MESSAGES:
        theirs = sg["process_content_for_template_format"](copy.deepcopy(message), fmt, [], [], [], [])
        theirs["content"] = sg["normalize_tool_content"](theirs["role"], theirs.get("content"))
        assert sglang_parts([message], fmt) == [theirs], message


@pytest.mark.parametrize("fmt", ["string", "openai"])
def test_vllm_parts_are_vllms_own(fmt):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages

    text_only = [m for m in MESSAGES if not any(isinstance(p, dict) and p.get("type") == "image_url"
                                                for p in m["content"])]
    req = ChatCompletionRequest(model="m", messages=copy.deepcopy(text_only))
    conv, _, _ = parse_chat_messages(req.messages, types.SimpleNamespace(multimodal_config=None,
                                                                         enable_prompt_embeds=False), fmt)
    assert [m["content"] for m in vllm_parts(text_only, fmt)] == [m["content"] for m in conv]


USER_PARTS = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                                        {"type": "text", "text": "the capital of France?"}]}]}
TOOL_PARTS = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "20C"}, {"type": "text", "text": "sunny"}]}]}


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3.1", "glm-4.5"])
@pytest.mark.parametrize("request_", [USER_PARTS, TOOL_PARTS], ids=["user", "tool"])
def test_the_prompt_readings_are_the_prompts_each_engine_renders(name, request_):
    """Qwen3's template, handed the parts as sent, wrote an empty user turn, and DeepSeek
    V3.1's raised: every such sample was lost. Now SGLang's prompt is the first reading
    and vLLM's is ``parts=vllm`` where it differs."""
    _, dialect, _ = _family(name)
    readings = {r.name: r.text for r in dialect.prompt_readings(request_)}
    string = name != "glm-4.5"  # GLM's template iterates parts (both engines: openai)
    sglang_name = "parts=space" if string else ("tool_parts=space" if request_ is TOOL_PARTS else None)
    vllm_name = "parts=newline" if string else ("tool_parts=newline" if request_ is TOOL_PARTS else "parts=vllm")
    assert readings[sglang_name] == sglang_prompt(name, request_)
    try:
        vllm = vllm_prompt(name, request_)
    except TypeError:  # vLLM parses V3.1's history arguments into objects, which its template cannot add to text
        assert (name, request_) == ("deepseek-v3.1", TOOL_PARTS)
        assert readings == {sglang_name: readings[sglang_name]}  # vLLM answers an error: it served no prompt
        return
    assert readings == ({sglang_name: readings[sglang_name]} if vllm == readings[sglang_name]
                        else {sglang_name: readings[sglang_name], vllm_name: vllm})
    if name == "qwen3" and request_ is USER_PARTS:
        assert "What is the capital of France?" in readings["parts=space"]
        assert "What is\nthe capital of France?" in readings["parts=newline"]


def test_a_prompt_vllm_cannot_build_is_no_reading_and_leaves_no_tie():
    """DeepSeek V3.1 with a tool call in its history and a tool result of two parts: vLLM hands
    the template the arguments parsed, and its template cannot add an object to text, so vLLM
    answers an error and serves no prompt. Its reading (the parts joined with a newline, the
    same count as SGLang's space) was offered anyway, and every such sample SGLang served was
    ``prompt_reading_unproven``."""
    tok, dialect, _ = _family("deepseek-v3.1")
    result = {"role": "tool", "tool_call_id": "c1", "content": [_text('{"t": 20}'), _text('{"s": 1}')]}
    request = {"messages": [*TOOL_PARTS["messages"][:2], result], "chat_template_kwargs": {"thinking": False}}
    prompt = sglang_prompt("deepseek-v3.1", request)
    newline = prompt.replace('{"t": 20} {"s": 1}', '{"t": 20}\n{"s": 1}')
    assert newline != prompt and len(tok.encode(newline)) == len(tok.encode(prompt))  # a count that ties
    with pytest.raises(TypeError):
        vllm_prompt("deepseek-v3.1", request)
    assert [r.name for r in dialect.prompt_readings(request)] == ["parts=space"]
    answer = tok.encode("Sunny.") + [tok.token_id(dialect.end_token)]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Sunny."}}],
                "usage": {"prompt_tokens": len(tok.encode(prompt)), "completion_tokens": len(answer)}}
    row, = reconstruct_record({"id": "v", "request": request, "response": response}, tok, dialect=dialect)
    assert (row["status"], row["reconstruction"], row["prompt_ids"]) == ("ok", "parts=space", tok.encode(prompt)), row["findings"]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_sample_served_by_either_engine_is_proved_by_its_prompt_count(engine):
    tok, dialect, _ = _family("qwen3")
    prompt = (sglang_prompt if engine == "sglang" else vllm_prompt)("qwen3", USER_PARTS)
    other = (vllm_prompt if engine == "sglang" else sglang_prompt)("qwen3", USER_PARTS)
    assert len(tok.encode(prompt)) != len(tok.encode(other))  # the count tells them apart here
    response: dict[str, Any] = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "Recall.", "content": "Paris."}}],
        "usage": {"prompt_tokens": len(tok.encode(prompt)), "completion_tokens": 8}}  # Recall.</think>\n\nParis.<|im_end|>
    row, = reconstruct_record({"id": "p", "request": USER_PARTS, "response": response}, tok, dialect)
    assert (row["status"], row["prompt_ids"]) == ("ok", tok.encode(prompt))
    assert (row["reconstruction"] or "").split("+")[0] == ("parts=space" if engine == "sglang" else "parts=newline")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_conversations_export_writes_the_parts_as_the_proving_engine_joined_them(tmp_path, engine):
    """A trainer re-renders the exported turns with the template: the parts are written as
    the engine that served the proved prompt joined them (written as sent, text parts were
    joined with nothing: ``What isthe capital``)."""
    hf = _family("qwen3")[2]
    prompt = (sglang_prompt if engine == "sglang" else vllm_prompt)("qwen3", USER_PARTS)
    history = exported_history(tmp_path, "qwen3", USER_PARTS, prompt)
    sep = " " if engine == "sglang" else "\n"
    assert history == [{"role": "user", "content": f"What is{sep}the capital of France?"}]
    assert hf.apply_chat_template(history, tokenize=False, add_generation_prompt=True) == prompt


def _text(t: str) -> dict[str, str]:
    return {"type": "text", "text": t}


def test_a_last_assistant_message_of_parts_is_exported_as_sglang_served_it(tmp_path):
    """SGLang joins the parts, then makes the last assistant message a user's: the export
    joined after, found a list there and left the turn an assistant's."""
    request = {"messages": [{"role": "user", "content": "q"},
                            {"role": "assistant", "content": [_text("The capital"), _text("is")]}]}
    _, dialect, hf = _family("qwen3")
    prompt = sglang_prompt("qwen3", request)
    readings = {r.name: r.text for r in dialect.prompt_readings(request)}
    assert readings["last_assistant=user+parts=space"] == prompt
    history = exported_history(tmp_path, "qwen3", request, prompt)
    assert history == [{"role": "user", "content": "q"}, {"role": "user", "content": "The capital is"}]
    assert hf.apply_chat_template(history, tokenize=False, add_generation_prompt=True) == prompt


def test_a_request_sglang_cannot_render_keeps_vllms_reading(tmp_path):
    """A template that names a medium in a comment but reads content as a string: SGLang
    hands it the list (``openai``) and its template raises; vLLM detects ``string`` and
    serves it. The SGLang render failing lost vLLM's reading too."""
    from transformers import PreTrainedTokenizerFast

    from tokenbridge.chat import resolve_dialect
    from tokenbridge.chat.template import special_token_strings

    folder = tmp_path / "ds31"
    folder.mkdir()
    shared = SHARED / "deepseek-v3.1"
    (folder / "tokenizer.json").symlink_to(shared / "tokenizer.json")
    source = "{#- no image input -#}" + (shared / "chat_template.jinja").read_text(encoding="utf-8")
    (folder / "chat_template.jinja").write_text(source, encoding="utf-8")
    config = json.loads((shared / "tokenizer_config.json").read_text(encoding="utf-8")) | {"chat_template": source}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = load_tokenizer(folder)
    dialect = resolve_dialect(tok)
    assert dialect.content_formats == ("openai", "string")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(shared / "tokenizer.json"), **special_token_strings(tok.config))
    hf.chat_template = source
    served = hf.apply_chat_template([{"role": "user", "content": "What is\nthe capital of France?"}], tokenize=False,
                                    add_generation_prompt=True)
    assert [(r.name, r.text) for r in dialect.prompt_readings(USER_PARTS)] == [("parts=newline", served)]


@pytest.mark.parametrize("name", ["qwen3", "glm-4.5"])
def test_a_system_prompt_opening_with_claude_codes_attribution_line_is_read_as_vllm_drops_it(name):
    """vLLM drops a system message's first line when it is Claude Code's billing header
    (its value changes per request); SGLang keeps it. A string content, no parts at all."""
    request = {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=9f3a1;\nYou are terse."},
                            {"role": "user", "content": "Hi"}]}
    _, dialect, _ = _family(name)
    readings = {r.name: r.text for r in dialect.prompt_readings(request)}
    assert readings == {None: sglang_prompt(name, request), "billing_header=dropped": vllm_prompt(name, request)}
    assert "billing-header" not in readings["billing_header=dropped"]


def test_one_part_is_read_as_its_text_without_naming_an_engine():
    """A list of one text part joins the same way on every engine: no reading says SGLang
    (``parts=space`` proved SGLang, and its completion forms followed, on no evidence)."""
    _, dialect, _ = _family("qwen3")
    history = [{"role": "assistant", "content": "", "reasoning": "Think.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    as_text = {"messages": [{"role": "user", "content": "Hi"}, *history]}
    as_part = {"messages": [{"role": "user", "content": [_text("Hi")]}, *history]}
    texts = [r.text for r in dialect.prompt_readings(as_text)]
    readings = dialect.prompt_readings(as_part)
    assert [r.text for r in readings] == texts and readings[0].name is None


def test_gpt_oss_template_reads_parts_as_sglang_hands_them_over():
    """SGLang serves gpt-oss through its template, which it hands the parts joined: the
    list as sent raised (a user's) or printed its Python form (a system's)."""
    from test_families_sglang_requests import _gpt_oss_prompt

    for role in ("user", "system"):
        request = {"messages": [{"role": role, "content": [_text("What is"), _text("the capital of France?")]},
                                *([{"role": "user", "content": "Go."}] if role == "system" else [])]}
        theirs, ours = _gpt_oss_prompt(request)
        assert ours == theirs and "What is the capital of France?" in ours


def test_glm_attribution_line_alone_exports_the_parts_its_template_iterates(tmp_path):
    """GLM's template iterates a list of parts (vLLM keeps them: ``openai``); a row proved by
    the reading that only drops Claude Code's attribution line was exported with its parts
    joined by newlines, and the re-render was not the proved prompt (a cold reviewer's)."""
    _, dialect, hf = _family("glm-4.5")
    request = {"messages": [{"role": "system", "content": [
        _text("x-anthropic-billing-header: cch=0;"), {**_text("You are Claude Code."), "cache_control": {"type": "ephemeral"}},
        _text("More.")]}, {"role": "user", "content": "hi"}]}
    theirs = vllm_prompt("glm-4.5", request)
    assert {r.name: r.text for r in dialect.prompt_readings(request)}.get("billing_header=dropped") == theirs
    history = exported_history(tmp_path, "glm-4.5", request, theirs)
    assert hf.apply_chat_template(history, tokenize=False, add_generation_prompt=True) == theirs


def test_a_text_part_that_is_not_a_string_gets_no_vllm_reading_and_no_type_error():
    """vLLM's request model refuses such a part (it served nothing): joining it for vLLM's
    reading was a TypeError out of ``prompt_readings``."""
    _, dialect, _ = _family("qwen3")
    for text in (5, [None], {"t": 1}):
        request = {"messages": [{"role": "system", "content": [_text("Be"), {"type": "text", "text": text}]},
                                {"role": "user", "content": "hi"}]}
        names = {r.name for r in dialect.prompt_readings(request)}
        assert not any("newline" in (n or "") or "vllm" in (n or "") for n in names), names

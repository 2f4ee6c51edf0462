"""DeepSeek V3.2 with the real shared tokenizer: a folder without a chat template.

Prompts: the built-in renderer, written from V3.2's documented format, against SGLang
0.5.23's ``encoding_dsv32`` (its copy of DeepSeek's official Python encoder, called the way
``serving_chat`` calls it: an empty system message in front, the request's tools on it,
null content as "") over generated conversations, token for token. ``renderers`` has no
V3.2 renderer, and the official encoder itself is only seen through SGLang's copy: that
is what stays unproven. Completions: native ids through SGLang's ``deepseek-v3`` reasoning
parser (whole and streamed) come back exactly, or with a finding.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_families_support import SGLangEngine, TOOLS, import_sglang_reasoning, texts, tool_lists, tool_round, words
from tokenbridge.chat import TemplateError
from tokenbridge.reconstruct import reconstruct_record

BOS, EOS, THINK, THINK_END, DSML = 0, 1, 128798, 128799, 128793


FAMILY = "deepseek-v3.2"  # the tok / dialect fixtures (conftest)


@pytest.fixture(scope="module")
def encoder():
    import_sglang_reasoning()
    from sglang.srt.entrypoints.openai import encoding_dsv32

    return encoding_dsv32


def _oracle_text(encoder, msgs, tools, thinking: bool) -> str:
    """serving_chat's dsv32 path: null content as "", an empty system message in front,
    the request's tools on it, then ``encode_messages``."""
    messages = copy.deepcopy(msgs)
    for m in messages:
        if m.get("content") is None:
            m["content"] = ""
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": ""})
    if tools:
        messages[0]["tools"] = tools
    return encoder.encode_messages(messages, thinking_mode="thinking" if thinking else "chat")


def test_folder_has_no_template_and_resolves_to_the_builtin(tok, dialect):
    assert tok.chat_template is None
    assert dialect.name == "deepseek-v3.2"
    assert tok.token_id("｜DSML｜") == DSML and tok.token_id(dialect.end_token) == EOS
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.encode(dialect.render_request({"messages": msgs})) == [BOS, 128803, 23166, 128804, THINK_END]
    assert tok.encode(dialect.render_request({"messages": msgs, "reasoning": {"enabled": True}}))[-1] == THINK


@st.composite
def conversations(draw) -> tuple[list[dict[str, Any]], Any]:
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(st.sampled_from(["You are terse.", "你是助手。", ""]))})
    for turn in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(st.one_of(texts, st.none()))})
        for r in range(draw(st.sampled_from([0, 0, 1, 2]))):
            msgs.extend(draw(tool_round(10 * turn + r, reasoning=st.one_of(st.none(), texts), string_args=draw(st.booleans()))))
        if draw(st.integers(0, 3)):
            reply: dict[str, Any] = {"role": "assistant", "content": draw(texts)}
            if draw(st.integers(0, 3)):
                reply["reasoning_content"] = draw(texts)
            msgs.append(reply)
    if msgs[-1]["role"] == "assistant" and draw(st.booleans()):
        msgs.append({"role": "user", "content": draw(texts)})
    return msgs, draw(tool_lists)


def test_generated_conversations_match_sglangs_v32_encoder(tok, dialect, encoder):
    seen = Counter()

    @settings(max_examples=500, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(conversations(), st.booleans())
    def check(case, thinking):
        msgs, tools = case
        try:
            theirs = _oracle_text(encoder, msgs, tools, thinking)
        except encoder.DS32EncodingError:
            with pytest.raises(TemplateError):
                dialect.render_prompt(msgs, tools, thinking)
            seen["refused"] += 1
            return
        ours = dialect.render_prompt(msgs, tools, thinking)
        assert ours == theirs
        assert tok.encode(ours) == tok.encode(theirs)
        seen["n"] += 1
        seen["thinking"] += thinking
        seen["tools"] += bool(tools)
        seen["tool_results"] += any(m["role"] == "tool" for m in msgs)
        seen["reasoning_history"] += any(m.get("reasoning_content") for m in msgs)
        seen["no_system"] += msgs[0]["role"] != "system"

    check()
    assert seen["n"] >= 350 and min(seen[k] for k in ("thinking", "tools", "tool_results", "reasoning_history", "no_system")) >= 50, seen
    assert seen["refused"] >= 10, seen  # the encoder's own refusals are ours too


def test_tool_results_reopen_the_think_block(dialect):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    text = dialect.render_prompt(msgs, [TOOLS[0]], True)
    assert text.endswith(
        'call it</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls><｜end▁of▁sentence｜>\n\n<function_results>\n<result>sunny</result>\n"
        "</function_results>\n\n<think>")
    assert '"name": "get_weather"' in text and "## Tools" in text


# --- completions ------------------------------------------------------------------------

PROMPT = [{"role": "user", "content": "Check the weather tool."}]


def _section(encoder, calls: list[tuple[str, dict]]) -> str:
    """A DSML tool section built with the official encoder's own templates."""
    invokes = "\n".join(encoder.tool_call_template.format(
        dsml_token=encoder.dsml_token, name=n, arguments=encoder.encode_arguments_to_dsml({"arguments": a}))
        for n, a in calls)
    return "\n\n" + encoder.tool_calls_template.format(dsml_token=encoder.dsml_token, tool_calls=invokes)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("skip_special", [False, True], ids=["specials_kept", "specials_skipped"])
def test_sglang_served_completions_rebuild_exactly_or_are_flagged(tok, dialect, encoder, stream, skip_special):
    """``｜DSML｜`` is a special token: SGLang drops it unless the request sends tools
    (then its detector parses the calls, ``structured_tool_calls``), so raw DSML sections
    survive only where the provider keeps special tokens; otherwise the gate says
    ``tool_markers_dropped``."""
    engine = SGLangEngine(tok, "deepseek-v3.2", "deepseek-v3", {EOS}, skip_special=skip_special)
    seen = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.booleans(), st.sampled_from(["plain", "plain", "tool", "cut"]), texts, texts,
           st.lists(st.tuples(st.sampled_from(["get_weather", "search"]),
                              st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(words, st.integers(0, 9)),
                                              min_size=1, max_size=2)), min_size=1, max_size=2),
           st.randoms(use_true_random=False))
    def check(thinking, kind, reasoning, content, calls, rnd):
        section = _section(encoder, calls) if kind == "tool" else ""
        text = (f"{reasoning}</think>" if thinking else "") + f"{content}{section}<｜end▁of▁sentence｜>"
        ids = tok.encode(text)
        if kind == "cut":
            ids = ids[: rnd.randint(1, len(ids))] if len(ids) > 1 else ids
        request = {"messages": PROMPT, "chat_template_kwargs": {"thinking": thinking}}
        prompt_ids = tok.encode(dialect.render_request(request))
        response = engine.serve(ids, len(prompt_ids), thinking=thinking, stream=stream)
        row, = reconstruct_record({"id": "v", "request": request, "response": response}, tok)
        seen.update(f["code"] for f in row["findings"])
        if row["status"] != "rejected":
            assert row["completion_ids"] == ids, (kind, text)
            seen["accepted"] += 1
            seen[f"accepted_{kind}"] += 1
        elif [f["code"] for f in row["findings"]] == ["reconstruction_ambiguous"]:
            # a turn ended with nothing after </think>: a token SGLang hid in its place ties the
            # count, and this engine's usage carries no reasoning_tokens to tell them apart
            assert "token_hidden" in row["findings"][0]["message"]
            seen["hidden_tie"] += 1
        if kind == "tool":
            if skip_special:
                assert "tool_markers_dropped" in {f["code"] for f in row["findings"]} and row["status"] == "rejected"
            elif row["status"] != "rejected":
                assert any(s["kind"] == "tool_calls" for s in row["segments"])

    check()
    print(dict(seen))
    assert seen["accepted"] + seen["hidden_tie"] >= 120 and min(seen["accepted_plain"], seen["accepted_cut"]) >= 20, seen
    assert seen["accepted_tool"] >= (0 if skip_special else 40), seen


def test_exact_ids_of_a_dsml_tool_call(tok, dialect, encoder):
    section = _section(encoder, [("get_weather", {"city": "Paris", "days": 2})])
    rec = {"id": "t", "request": {"messages": PROMPT, "reasoning": {"enabled": True}}, "response": {"choices": [
        {"message": {"reasoning_content": "Need it.", "content": "Checking." + section}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    ids = row["completion_ids"]
    assert ids == [*tok.encode("Need it."), THINK_END, *tok.encode("Checking." + section), EOS]
    assert ids.count(DSML) == 8 and row["prompt_ids"][-1] == THINK
    seg = next(s for s in row["segments"] if s["kind"] == "tool_calls")
    assert row["input_ids"][seg["start"]] == DSML and row["input_ids"][seg["end"]] == EOS
    assert [f["code"] for f in row["findings"]] == ["usage_missing"]


@pytest.mark.parametrize("content, code", [
    ('\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n', "tool_markers_malformed"),  # never closed
    ("x｜DSML｜y", "tool_markers_malformed"),  # the marker outside a section
    ('\n\n<｜DSML｜function_calls><｜User｜></｜DSML｜function_calls>', "special_token_text"),
    ("a</think>b", "think_marker_in_content"),
])
def test_gate_codes_for_dsml_sections(tok, content, code):
    rec = {"id": "g", "request": {"messages": PROMPT, "reasoning": {"enabled": True}},
           "response": {"choices": [{"message": {"reasoning_content": "r", "content": content}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    assert code in {f["code"] for f in row["findings"]}, row["findings"]
    assert row["status"] == "rejected"


def test_tool_arguments_nested_too_deeply_to_read_are_refused_as_not_json(dialect):
    """The stdlib reads arguments per level: ``[`` * 100,000 was a RecursionError, not the
    TemplateError every other unreadable argument string is."""
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": "[" * 100_000}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    with pytest.raises(TemplateError) as err:
        dialect.render_prompt(msgs, [TOOLS[0]], True)
    assert str(err.value) == "messages[1].tool_calls[0].function.arguments: not JSON (nested too deeply to read)"


def test_unrendered_roles_are_refused_not_guessed(dialect):
    with pytest.raises(TemplateError, match="developer"):
        dialect.render_prompt([{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}])

"""GLM-4.5 / 4.6 with the real shared tokenizer and its official chat template.

Prompts: the folder's template through our Jinja path against the independent
``renderers==0.1.12`` ``GLM45Renderer`` over generated conversations, and against
transformers' ``apply_chat_template``. Completions: native ids through SGLang 0.5.23's
``glm45`` reasoning parser (whole and streamed) must come back exactly, or with a
finding. GLM ends a turn by emitting the next role token: ``<|observation|>`` after a tool
call, ``<|user|>`` otherwise.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_families_support import (SHARED, SGLangEngine, TOOLS, OracleTokenizer, texts, tool_lists,
                                   tool_round, words)
from tokenbridge.chat import TemplateError
from tokenbridge.chat.template import template_renderer
from tokenbridge.reconstruct import reconstruct_record
from tokenbridge.traits import ProviderTrait

try:
    from renderers.configs import GLM45RendererConfig
    from renderers.glm45 import GLM45Renderer
except ImportError as e:  # pragma: no cover - CI installs it (requirements-oracles.txt)
    GLM45Renderer = None
    _WHY = f"oracle `renderers` not importable ({e})"

needs_renderers = pytest.mark.skipif(GLM45Renderer is None, reason=globals().get("_WHY", ""))

ENDOFTEXT, USER, ASSISTANT, OBSERVATION = 151329, 151336, 151337, 151338
THINK, THINK_END, CALL, CALL_END, RESPONSE, RESPONSE_END, KEY, KEY_END, VALUE, VALUE_END = range(151350, 151360)
NL = 198


FAMILY = "glm-4.5"  # the tok / dialect fixtures (conftest)


def test_folder_resolves_to_glm_with_its_template(tok, dialect):
    assert dialect.name == "glm-4.5+template"
    assert [tok.token_id(t) for t in dialect.end_tokens] == [USER, OBSERVATION]
    assert [tok.token_id(m) for m in dialect.tool_markers.all] == [CALL, CALL_END, KEY, KEY_END, VALUE, VALUE_END]
    assert dialect.tool_markers.grammar == "<tool_call> (<arg_key> </arg_key> <arg_value> </arg_value>)* </tool_call>"


def test_prompt_ids_recorded_in_provenance(tok, dialect):
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
    instant = [151331, 151333, 151335, 198, 2610, 525, 10945, 13, 151336, 198, 13041, 151360, 151337, 198, 151350, 151351]
    assert tok.encode(dialect.render_request({"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})) == instant
    assert tok.encode(dialect.render_prompt(msgs)) == [*instant[:11], ASSISTANT]  # no /nothink, prompt ends <|assistant|>


@st.composite
def conversations(draw) -> tuple[list[dict[str, Any]], Any]:
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(st.sampled_from(["You are terse.", "你是助手。", ""]))})
    reasoning = st.one_of(st.none(), texts)
    for turn in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(texts)})
        for r in range(draw(st.sampled_from([0, 0, 1, 2]))):
            msgs.extend(draw(tool_round(10 * turn + r, reasoning=reasoning, string_args=draw(st.booleans()))))
        if draw(st.integers(0, 3)):
            reply: dict[str, Any] = {"role": "assistant", "content": draw(texts)}
            if (r := draw(reasoning)) is not None:
                reply["reasoning_content"] = r
            msgs.append(reply)
    if msgs[-1]["role"] == "assistant" and draw(st.booleans()):
        msgs.append({"role": "user", "content": draw(texts)})
    return msgs, draw(tool_lists)


@needs_renderers
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "instant"])
def test_generated_conversations_match_renderers(tok, dialect, thinking):
    oracle = GLM45Renderer(OracleTokenizer(tok), GLM45RendererConfig(enable_thinking=thinking))
    seen = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(conversations())
    def check(case):
        msgs, tools = case
        text = dialect.render_prompt(msgs, tools, thinking)
        theirs = oracle.render(msgs, tools=tools, add_generation_prompt=True).token_ids
        raw = tok.decode_bytes(theirs)
        fixed = raw.replace(b"</tool_call><tool_call>", b"</tool_call>\n<tool_call>")  # see the test below
        gap = any(len(m.get("tool_calls") or ()) >= 2 and m["content"].strip() for m in msgs if m["role"] == "assistant")
        assert (fixed != raw) == gap  # exactly the turns with content and two calls
        seen["between_calls"] += gap
        assert fixed == text.encode()
        seen["piecewise"] += fixed == raw and tok.encode(text) != list(theirs)
        seen["n"] += 1
        seen["tools"] += bool(tools)
        seen["tool_results"] += any(m["role"] == "tool" for m in msgs)
        seen["reasoning_history"] += any(m.get("reasoning_content") for m in msgs)
        seen["string_arguments"] += any(isinstance(c["function"]["arguments"], str)
                                        for m in msgs for c in m.get("tool_calls") or ())

    check()
    assert seen["n"] >= 250 and min(seen[k] for k in ("tools", "tool_results", "reasoning_history", "string_arguments")) >= 30, seen
    assert seen["piecewise"] < seen["n"] // 4 and seen["between_calls"] >= 10, seen


@needs_renderers
def test_renderers_drops_the_newline_between_calls_after_content(tok, dialect):
    """The template writes ``'\\n<tool_call>' + name`` for every call; renderers 0.1.12 writes
    that newline only before the first call when the turn has content. transformers'
    apply_chat_template (test below) and SGLang render the template: we follow it."""
    from transformers import PreTrainedTokenizerFast

    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "g", "arguments": {}}} for i in range(2)]},
            {"role": "tool", "tool_call_id": "c0", "content": "1"}, {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    ours = dialect.render_prompt(msgs)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(SHARED / "glm-4.5" / "tokenizer.json"))
    assert ours == hf.apply_chat_template(msgs, chat_template=tok.chat_template, tokenize=False, add_generation_prompt=True)
    assert "\nok\n<tool_call>g\n</tool_call>\n<tool_call>g\n</tool_call><|observation|>" in ours
    theirs = tok.decode(GLM45Renderer(OracleTokenizer(tok), GLM45RendererConfig()).render(msgs, add_generation_prompt=True).token_ids)
    assert theirs == ours.replace("</tool_call>\n<tool_call>", "</tool_call><tool_call>")


def test_template_path_equals_transformers_apply_chat_template(tok, dialect):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(SHARED / "glm-4.5" / "tokenizer.json"))
    hf.chat_template = tok.chat_template
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "天气 in Paris?"},
             {"role": "assistant", "content": "", "reasoning_content": "need the tool",
              "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "巴黎", "n": [1, 2]}}}]},
             {"role": "tool", "tool_call_id": "c0", "content": '{"temp": 20}'},
             {"role": "assistant", "content": "20 degrees.", "reasoning_content": "r"},
             {"role": "user", "content": "and tomorrow"}]
    rnd = random.Random(5)
    for case in range(40):
        msgs = convo[: rnd.randint(2, len(convo))]
        thinking = bool(case % 2)
        tools = TOOLS if case % 3 else None
        theirs = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert dialect.render_prompt(msgs, tools, thinking) == theirs


def test_messages_reach_the_template_as_sglang_hands_them_over(tok, dialect):
    """OpenAI clients send ``arguments`` as a JSON string and ``content: null`` beside tool
    calls. The GLM template iterates ``arguments.items()`` and prints null content as
    ``None``; SGLang parses the string and turns null into "" first, and so do we.
    transformers, given the same messages, fails or prints ``None``."""
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    text = dialect.render_prompt(msgs)
    assert ("<|assistant|>\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call><|observation|>") in text
    raw = template_renderer(tok.chat_template)  # transformers' view: the messages as given
    with pytest.raises(TemplateError):
        raw(msgs, None, True, {})


# --- completions: SGLang's glm45 reasoning parser as the engine ------------------------------

PROMPT = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Check the weather tool."}]


def _call(name: str, args: dict[str, str]) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


@st.composite
def natives(draw) -> tuple[bool, str, str]:
    """(thinking, kind, native completion text) as GLM-4.5 writes it."""
    thinking = draw(st.booleans())
    kind = draw(st.sampled_from(["plain", "plain", "tool", "cut"]))
    content = draw(texts)
    calls = ""
    if kind == "tool":
        calls = "".join("\n" + _call(draw(st.sampled_from(["get_weather", "search"])),
                                     draw(st.dictionaries(st.sampled_from(["city", "q"]), words, max_size=2)))
                        for _ in range(draw(st.integers(1, 2))))
    end = "<|observation|>" if calls else "<|user|>"
    answer = f"\n{content}{calls}{end}"
    if thinking:
        return thinking, kind, f"\n<think>{draw(texts)}</think>{answer}"
    return thinking, kind, answer


SGLANG_RUN = {"sglang": ProviderTrait("sglang", prefix_in_reasoning=True)}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sglang_served_completions_rebuild_exactly_or_are_flagged(tok, dialect, stream):
    engine = SGLangEngine(tok, "glm-4.5", "glm45", {ENDOFTEXT, USER, OBSERVATION})
    seen = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(natives(), st.randoms(use_true_random=False))
    def check(native, rnd):
        thinking, kind, text = native
        ids = tok.encode(text)
        if kind == "cut":
            ids = ids[: rnd.randint(1, len(ids))] if len(ids) > 1 else ids
        request = {"messages": PROMPT, "chat_template_kwargs": {"enable_thinking": thinking}}
        prompt_ids = tok.encode(dialect.render_request(request))
        response = {**engine.serve(ids, len(prompt_ids), thinking=thinking, stream=stream), "provider": "sglang"}
        # the run shows SGLang's form (traits.py): alone, a streamed row also fits vLLM's
        row, = reconstruct_record({"id": "g", "request": request, "response": response}, tok, traits=SGLANG_RUN)
        seen.update(f["code"] for f in row["findings"])
        if row["status"] != "rejected":  # ok, or flagged only by warnings (truncated)
            assert row["completion_ids"] == ids, (kind, text)
            seen["accepted"] += 1
            seen[f"accepted_{kind}_{'thinking' if thinking else 'instant'}"] += 1
        else:
            seen["rejected"] += 1

    check()
    print(dict(seen))
    assert seen["accepted"] >= 150, seen
    assert min(seen[f"accepted_{k}_{m}"] for k in ("plain", "tool") for m in ("thinking", "instant")) >= 10, seen


def test_exact_ids_thinking_tool_call_and_observation_end(tok, dialect):
    """SGLang's whole-response form: reasoning ``"\\n<think>..."``, content ``"\\n..."``."""
    call = _call("get_weather", {"city": "Paris"})
    rec = {"id": "t", "request": {"messages": PROMPT}, "response": {"choices": [
        {"message": {"reasoning_content": "\n<think>Need the weather.", "content": "\nChecking.\n" + call},
         "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    ids = row["completion_ids"]
    r, c = tok.encode("Need the weather."), tok.encode("\nChecking.\n" + call)
    assert ids == [NL, THINK, *r, THINK_END, *c, OBSERVATION]
    assert [i for i in c if i >= 151329] == [CALL, KEY, KEY_END, VALUE, VALUE_END, CALL_END]
    kinds = [s["kind"] for s in row["segments"][1:]]
    assert kinds[:5] == ["format", "think_start", "reasoning", "think_end", "content"] and kinds[-2:] == ["tool_calls", "end"]
    assert [f["code"] for f in row["findings"]] == ["usage_missing"]
    # the streamed form ("\n" + reasoning) is the same native sequence
    rec["response"]["choices"][0]["message"]["reasoning_content"] = "\nNeed the weather."
    assert reconstruct_record(rec, tok)[0]["completion_ids"] == ids


def test_plain_answer_ends_with_user_and_instant_mode_has_no_think(tok, dialect):
    request = {"messages": PROMPT, "chat_template_kwargs": {"enable_thinking": False}}
    rec = {"id": "i", "request": request, "response": {"choices": [{"message": {"content": "\nSunny."}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    assert row["completion_ids"] == [*tok.encode("\nSunny."), USER]
    assert row["prompt_ids"][-3:] == [NL, THINK, THINK_END]


def test_endoftext_end_is_invisible_without_ground_truth_ids(tok, dialect):
    """GLM's third stop token: text and usage cannot tell it from ``<|user|>`` (same count);
    the rule picks ``<|user|>``; ground-truth ids or ``matched_stop`` name the real one."""
    engine = SGLangEngine(tok, "glm-4.5", "glm45", {ENDOFTEXT, USER, OBSERVATION})
    request = {"messages": PROMPT}
    ids = tok.encode("\n<think>r</think>\nDone.<|endoftext|>")
    prompt_ids = tok.encode(dialect.render_request(request))
    response = engine.serve(ids, len(prompt_ids), thinking=True, stream=False)
    row, = reconstruct_record({"id": "e", "request": request, "response": response}, tok)
    assert row["completion_ids"] == [*ids[:-1], USER] and row["status"] == "ok"
    row, = reconstruct_record({"id": "e", "request": request, "response": response,
                               "native_ids": {"prompt": prompt_ids, "choices": [ids]}}, tok)
    # the ground-truth ids name the other end token, and that reading is kept
    assert row["completion_ids"] == ids and row["status"] == "ok"
    assert row["reconstruction"] == "end=<|endoftext|>"
    # as does SGLang's matched_stop, without ground-truth ids
    stopped = {**response, "choices": [{**response["choices"][0], "matched_stop": ENDOFTEXT}]}
    row, = reconstruct_record({"id": "e", "request": request, "response": stopped}, tok)
    assert row["completion_ids"] == ids and row["reconstruction"] == "end=<|endoftext|>"


@pytest.mark.parametrize("evidence", ["matched_stop", "native_ids"])
def test_a_tool_call_ended_by_user_is_read_where_the_evidence_names_it(tok, dialect, evidence):
    """A cold tester's: after a call the formula ends with ``<|observation|>``; a model that
    ended it with ``<|user|>`` (GLM's other end token), named by SGLang's ``matched_stop`` or
    by ground-truth ids, had no reading: rejected (``end_token_mismatch``, whose message
    called ``<|user|>`` an id the dialect does not end turns with)."""
    engine = SGLangEngine(tok, "glm-4.5", "glm45", {ENDOFTEXT, USER, OBSERVATION})
    request = {"messages": PROMPT}
    ids = tok.encode("\n<think>Call it.</think>\n" + _call("get_weather", {"city": "Paris"}) + "<|user|>")
    prompt_ids = tok.encode(dialect.render_request(request))
    response = engine.serve(ids, len(prompt_ids), thinking=True, stream=False)
    choice = response["choices"][0]
    rec = {"id": "u", "request": request, "response": response}
    if evidence == "matched_stop":
        choice["matched_stop"] = USER
    else:
        rec["native_ids"] = {"prompt": prompt_ids, "choices": [ids]}
    row, = reconstruct_record(rec, tok)
    assert (row["status"], row["completion_ids"], row["reconstruction"]) == ("ok", ids, "end=<|user|>"), row["findings"]


@pytest.mark.parametrize("content, code", [
    ("<tool_call>f\n<arg_value>v</arg_value>\n</tool_call>", "tool_markers_malformed"),  # value without key
    ("<tool_call>f\n<arg_key>k</arg_key>\n", "tool_markers_malformed"),  # unclosed
    ("a</arg_key>", "tool_markers_malformed"),  # outside a section
    ("done<|observation|>more", "eos_in_text"),
    ("a<|assistant|>b", "special_token_text"),
    ("a<think>b", "think_marker_in_content"),
])
def test_gate_codes_for_glm_markers(tok, content, code):
    rec = {"id": "g", "request": {"messages": PROMPT},
           "response": {"choices": [{"message": {"reasoning_content": "r", "content": content}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    assert code in {f["code"] for f in row["findings"]}, row["findings"]
    assert row["status"] == "rejected"


def test_well_formed_glm_call_passes_the_grammar(tok):
    rec = {"id": "g", "request": {"messages": PROMPT}, "response": {"choices": [
        {"message": {"reasoning_content": "\n<think>r", "content": "\n" + _call("f", {"a": "1", "b": "2"}) + "\n" + _call("g", {})},
         "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    assert [f["code"] for f in row["findings"]] == ["usage_missing"]
    assert row["completion_ids"][-1] == OBSERVATION


def test_logprobs_of_the_content_read_a_section_opened_without_think_close(tok, dialect):
    """A reviewer's: GLM's readings start with the newline before ``<think>``, so the content
    start of a reading with no ``</think>`` was never found, and logprobs of the section and the
    end alone refused the true reading. Where the run showed how the end is counted, they
    agree with it and the count picks it; where it did not, they still prove nothing of
    ``</think>``."""
    request = {"messages": [{"role": "user", "content": "Check the weather tool."}]}
    reasoning = "Need the weather."
    call = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    short = [*tok.encode("\n<think>" + reasoning), *tok.encode(call), OBSERVATION]
    logged = {"content": [{"token": f"token_id:{i}", "logprob": -0.1, "bytes": list(tok.token_bytes(i)),
                           "top_logprobs": []} for i in [*tok.encode(call), OBSERVATION]]}
    prompt = len(tok.encode(dialect.render_request(request)))

    def row(usage: int, trait: ProviderTrait | None) -> dict[str, Any]:
        choice = {"index": 0, "finish_reason": "stop", "logprobs": logged,
                  "message": {"reasoning_content": "\n<think>" + reasoning, "content": call}}
        response = {"provider": "P", "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": usage}}
        return reconstruct_record({"id": "g", "request": request, "response": response}, tok,
                                  traits={"P": trait} if trait else None)[0]

    for trait, usage in ((ProviderTrait("P", end_counted=True, prefix_in_reasoning=True), len(short)),
                         (ProviderTrait("P", end_uncounted=True, prefix_in_reasoning=True), len(short) - 1)):
        got = row(usage, trait)
        assert (got["status"], got["completion_ids"], got["reconstruction"]) == ("ok", short, "no_think_close"), got
    assert row(len(short), ProviderTrait("P", prefix_in_reasoning=True))["status"] == "rejected"

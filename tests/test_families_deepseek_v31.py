"""DeepSeek V3.1 with the real shared tokenizer and its official chat template.

Prompts: the folder's template through our Jinja path, against transformers'
``apply_chat_template`` and -- for tool-free conversations -- against the independent
``renderers==0.1.12`` ``DeepSeekV3Renderer``. renderers has no V3.1 renderer: its V3 one
prints the same turns without V3.1's think switch, so the comparison adds V3.1's
``</think>`` after every ``<｜Assistant｜>`` (``<think>`` on the generation prompt in
thinking mode) explicitly; the tool-call and tool-output formats differ between V3 and
V3.1 and are pinned against the template text and SGLang's ``deepseekv31`` detector
instead. Completions: native ids through SGLang 0.5.23's ``deepseek-v3`` reasoning
parser (whole and streamed) must come back exactly, or with a finding.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_families_support import SHARED, SGLangEngine, OracleTokenizer, import_sglang_reasoning, texts, words
from tokenbridge.chat import DialectError, resolve_dialect
from tokenbridge.exchanges import parse_exchange
from tokenbridge.reconstruct import _reconstruct, reconstruct_record

try:
    from renderers.configs import DeepSeekV3RendererConfig
    from renderers.deepseek_v3 import DeepSeekV3Renderer
except ImportError as e:  # pragma: no cover - CI installs it (requirements-oracles.txt)
    DeepSeekV3Renderer = None
    _WHY = f"oracle `renderers` not importable ({e})"

needs_renderers = pytest.mark.skipif(DeepSeekV3Renderer is None, reason=globals().get("_WHY", ""))

BOS, EOS, THINK, THINK_END, ASSISTANT = 0, 1, 128798, 128799, 128804
CALLS, CALLS_END, CALL, CALL_END, SEP, OUT_END = 128806, 128807, 128808, 128809, 128814, 128813
ASSISTANT_TEXT = "<｜Assistant｜>"


FAMILY = "deepseek-v3.1"  # the tok / dialect fixtures (conftest)


def test_folder_resolves_to_v31_with_its_template(tok, dialect):
    assert dialect.name == "deepseek-v3.1+template"
    assert tok.token_id(dialect.end_token) == EOS
    assert [tok.token_id(m) for m in dialect.tool_markers.all] == [CALLS, CALLS_END, CALL, SEP, CALL_END]
    # the V3.1 family renders only with a template: a folder without one is refused up front
    with pytest.raises(DialectError, match="only with the folder's chat template"):
        resolve_dialect(tok, use_template=False)


def test_thinking_is_off_unless_asked(tok, dialect):
    """The template defaults ``thinking`` to false and SGLang's deepseek-v3 parser
    (``explicit_thinking``) reasons only when asked: unlike Kimi and Qwen3."""
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
    plain = [0, 3476, 477, 11502, 16, 128803, 23166, 128804]  # PROVENANCE.md
    assert tok.encode(dialect.render_request({"messages": msgs})) == [*plain, THINK_END]
    assert not dialect.thinking({"messages": msgs})
    for on in ({"reasoning": {"enabled": True}}, {"reasoning": {"effort": "high"}}, {"chat_template_kwargs": {"thinking": True}}):
        assert dialect.thinking(on), on
        assert tok.encode(dialect.render_request({"messages": msgs, **on})) == [*plain, THINK]
    assert not dialect.thinking({"reasoning": {"enabled": True}, "chat_template_kwargs": {"thinking": False}})


@st.composite
def chats(draw) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(st.sampled_from(["You are terse.", "你是助手。", ""]))})
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(texts)})
        if draw(st.integers(0, 3)):
            reply: dict[str, Any] = {"role": "assistant", "content": draw(texts)}
            if draw(st.booleans()):
                reply["reasoning_content"] = draw(texts)  # the V3.1 template never prints it
            msgs.append(reply)
    if msgs[-1]["role"] == "assistant" and draw(st.booleans()):
        msgs.append({"role": "user", "content": draw(texts)})
    return msgs


def _v31_from_v3(text: str, thinking: bool, ends_with_user: bool) -> str:
    """renderers' V3 text with V3.1's think switch added (see the module docstring)."""
    text = text.replace(ASSISTANT_TEXT, ASSISTANT_TEXT + "</think>")
    if thinking and ends_with_user:
        text = text[: -len("</think>")] + "<think>"
    return text


@needs_renderers
def test_generated_chats_match_renderers_v3_plus_the_v31_think_switch(tok, dialect):
    oracle = DeepSeekV3Renderer(OracleTokenizer(tok), DeepSeekV3RendererConfig())
    seen = {"n": 0, "thinking": 0, "system": 0, "history": 0}

    @settings(max_examples=400, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(chats(), st.booleans())
    def check(msgs, thinking):
        ours = dialect.render_prompt(msgs, thinking=thinking)
        theirs = oracle.render(msgs, add_generation_prompt=True).token_ids
        ends_with_user = msgs[-1]["role"] == "user"
        expected = _v31_from_v3(tok.decode(theirs), thinking, ends_with_user)
        if not ends_with_user:  # V3.1 adds no generation prompt after an assistant turn; V3 does
            expected = expected[: expected.rindex(ASSISTANT_TEXT)]
        assert ours == expected
        seen["n"] += 1
        seen["thinking"] += thinking
        seen["system"] += msgs[0]["role"] == "system"
        seen["history"] += any(m["role"] == "assistant" for m in msgs)

    check()
    assert seen["n"] >= 350 and min(seen["thinking"], seen["system"], seen["history"]) >= 100, seen


def test_template_path_equals_transformers_apply_chat_template(tok, dialect):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(SHARED / "deepseek-v3.1" / "tokenizer.json"),
                                 bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>")
    hf.chat_template = tok.chat_template
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "天气 in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "巴黎"}'}},
                 {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]},
             {"role": "tool", "tool_call_id": "c0", "content": '{"temp": 20}'},
             {"role": "tool", "tool_call_id": "c1", "content": "none"},
             {"role": "assistant", "content": "20 degrees."}, {"role": "user", "content": "and tomorrow"}]
    rnd = random.Random(3)
    for case in range(40):
        msgs = convo[: rnd.randint(2, len(convo))]
        thinking = bool(case % 2)
        theirs = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, thinking=thinking)
        assert dialect.render_prompt(msgs, thinking=thinking) == theirs


def test_tool_history_and_the_prompt_after_a_tool_result(tok, dialect):
    """V3.1's own tool format (no V3 ``function`` / json fence), and no generation prompt
    after a tool result: the model answers straight after ``<｜tool▁output▁end｜>``."""
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    text = dialect.render_prompt(msgs, thinking=True)
    assert text == ("<｜begin▁of▁sentence｜><｜User｜>Weather?<｜Assistant｜></think>Checking.<｜tool▁calls▁begin｜>"
                    '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
                    "<｜end▁of▁sentence｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>")
    assert tok.encode(text)[-1] == OUT_END


# --- completions: SGLang's deepseek-v3 reasoning parser as the engine ---------------------

PROMPT = [{"role": "user", "content": "Check the weather tool."}]
AFTER_TOOL = [*PROMPT, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c0", "content": "sunny, 20 C"}]


def _calls(names_args: list[tuple[str, dict]]) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a, ensure_ascii=False)}<｜tool▁call▁end｜>"
                   for n, a in names_args)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


@st.composite
def natives(draw) -> tuple[bool, str, str]:
    """(thinking, where, native completion text) as V3.1 writes it."""
    thinking = draw(st.booleans())
    where = draw(st.sampled_from(["user", "user", "after_tool", "cut"]))
    content = draw(texts)
    calls = ""
    if where != "after_tool" and draw(st.integers(0, 2)) == 0:
        calls = _calls([(draw(st.sampled_from(["get_weather", "search"])),
                         draw(st.dictionaries(st.sampled_from(["city", "q"]), words, max_size=2)))
                        for _ in range(draw(st.integers(1, 2)))])
    if thinking and where != "after_tool":
        text = f"{draw(texts)}</think>{content}{calls}<｜end▁of▁sentence｜>"
    else:
        text = f"{content}{calls}<｜end▁of▁sentence｜>"
    return thinking, where, text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sglang_served_completions_rebuild_exactly_or_are_flagged(tok, dialect, stream):
    engine = SGLangEngine(tok, "deepseek-v3.1", "deepseek-v3", {EOS})
    seen = {"accepted": 0, "rejected": 0, "accepted_after_tool_thinking": 0, "accepted_calls": 0, "accepted_cut": 0}

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(natives(), st.randoms(use_true_random=False))
    def check(native, rnd):
        thinking, where, text = native
        ids = tok.encode(text)
        if where == "cut":
            ids = ids[: rnd.randint(1, len(ids))] if len(ids) > 1 else ids
        request = {"messages": AFTER_TOOL if where == "after_tool" else PROMPT,
                   "chat_template_kwargs": {"thinking": thinking}}
        prompt_ids = tok.encode(dialect.render_request(request))
        response = engine.serve(ids, len(prompt_ids), thinking=thinking, stream=stream)
        row, = reconstruct_record({"id": "d", "request": request, "response": response}, tok)
        codes = [c["code"] for c in row["findings"]]
        seen.setdefault("codes", Counter()).update(codes)
        if row["status"] != "rejected":  # ok, or flagged only by warnings (truncated)
            assert row["completion_ids"] == ids, (where, text)
            seen["accepted"] += 1
            seen["accepted_after_tool_thinking"] += where == "after_tool" and thinking
            seen["accepted_calls"] += CALLS in ids
            seen["accepted_cut"] += where == "cut"
        else:
            assert row["findings"]
            seen["rejected"] += 1

    check()
    print(seen)
    assert seen["accepted"] >= 150 and min(seen["accepted_after_tool_thinking"], seen["accepted_calls"], seen["accepted_cut"]) >= 10, seen


def test_after_a_tool_result_thinking_mode_answers_without_think_markers(tok, dialect):
    """SGLang (thinking: true) returns the whole answer as reasoning_content, since no
    </think> ever comes; the native completion is the answer and the end token."""
    request = {"messages": AFTER_TOOL, "chat_template_kwargs": {"thinking": True}}
    answer = "It is sunny in Paris."
    ids = tok.encode(answer) + [EOS]
    prompt_ids = tok.encode(dialect.render_request(request))
    response = SGLangEngine(tok, "deepseek-v3.1", "deepseek-v3", {EOS}).serve(ids, len(prompt_ids), thinking=True, stream=False)
    assert response["choices"][0]["message"] == {"role": "assistant", "content": "", "reasoning_content": answer}
    row, = reconstruct_record({"id": "a", "request": request, "response": response}, tok)
    assert row["status"] == "ok" and row["completion_ids"] == ids
    assert THINK not in row["completion_ids"] and THINK_END not in row["completion_ids"]


def test_exact_ids_thinking_tool_call_and_end(tok, dialect):
    reasoning, content = "Need the weather.", "Let me check."
    calls = _calls([("get_weather", {"city": "Paris"}), ("search", {"q": "天气"})])
    request = {"messages": PROMPT, "reasoning": {"enabled": True}}
    rec = {"id": "t", "request": request, "response": {"choices": [
        {"message": {"reasoning": reasoning, "content": content + calls}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    ids = row["completion_ids"]
    r, c, k = tok.encode(reasoning), tok.encode(content), tok.encode(calls)
    assert row["prompt_ids"][-2:] == [ASSISTANT, THINK]
    assert ids == [*r, THINK_END, *c, *k, EOS]
    assert [i for i in k if i >= 128000] == [CALLS, CALL, SEP, CALL_END, CALL, SEP, CALL_END, CALLS_END]
    assert [s["kind"] for s in row["segments"]] == ["prompt", "reasoning", "think_end", "content", "tool_calls", "end"]
    assert [f["code"] for f in row["findings"]] == ["usage_missing"]


def test_our_tool_section_is_what_sglangs_deepseekv31_detector_parses(tok):
    import_sglang_reasoning()
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.deepseekv31_detector import DeepSeekV31Detector

    tools = [Tool(type="function", function={"name": n, "parameters": {"type": "object"}}) for n in ("get_weather", "search")]
    text = "Let me check." + _calls([("get_weather", {"city": "Paris"}), ("search", {"q": "天气"})])
    res = DeepSeekV31Detector().detect_and_parse(text, tools)
    assert res.normal_text == "Let me check."
    assert [(c.name, json.loads(c.parameters)) for c in res.calls] == [("get_weather", {"city": "Paris"}), ("search", {"q": "天气"})]


@pytest.mark.parametrize("content, code", [
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "tool_markers_malformed"),  # no sep
    ("<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>", "tool_markers_malformed"),  # no call
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>", "tool_markers_malformed"),  # unclosed
    ("done<｜end▁of▁sentence｜>more", "eos_in_text"),
    ("a<｜User｜>b", "special_token_text"),
    ("a</think>b", "think_marker_in_content"),
])
def test_gate_codes_for_deepseek_markers(tok, content, code):
    rec = {"id": "g", "request": {"messages": PROMPT, "reasoning": {"enabled": True}},
           "response": {"choices": [{"message": {"reasoning": "r", "content": content}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    assert code in {f["code"] for f in row["findings"]}, row["findings"]
    assert row["status"] == "rejected"


def test_tool_markers_in_reasoning(tok):
    rec = {"id": "g", "request": {"messages": PROMPT, "reasoning": {"enabled": True}},
           "response": {"choices": [{"message": {"reasoning": "r<｜tool▁calls▁begin｜>", "content": "ok"}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    assert "tool_section_in_reasoning" in {f["code"] for f in row["findings"]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("reasoning", ["I could write <tool_call> here but no.", "Plan:\n<tool_call>\nnot yet",
                                       "Maybe <tool_call> then </tool_call> more"])
def test_reasoning_with_tool_call_text_is_read_as_sglang_splits_it(tok, dialect, stream, reasoning):
    """SGLang's ``deepseek-v3`` reasoning parser (Qwen3's) ends a reasoning the model never
    closed at ``<tool_call>`` text, plain text to DeepSeek's tokenizer, and serves the rest as
    content. Read with the formula's ``</think>`` between them, a cut there was rejected (a
    cold tester's lost sample); the ``no_think_close`` reading joins them. A turn that ended
    there is one token from the formula, an uncounted end token's gap: read where ids say."""
    engine = SGLangEngine(tok, "deepseek-v3.1", "deepseek-v3", {EOS})
    request = {"messages": PROMPT, "chat_template_kwargs": {"thinking": True}}
    prompt_ids = tok.encode(dialect.render_request(request))
    for ended in (False, True):
        ids = tok.encode(reasoning) + ([EOS] if ended else [])
        response = engine.serve(ids, len(prompt_ids), thinking=True, stream=stream)
        assert response["choices"][0]["message"]["content"].startswith("<tool_call>")  # the premise
        (row,) = reconstruct_record({"id": "d", "request": request, "response": response}, tok)
        if not ended:
            assert (row["status"], row["completion_ids"]) == ("flagged", ids)  # truncated: exact up to the cut
            assert row["reconstruction"] == "no_think_close"
            continue
        # from the count alone: one short of the formula, as the formula with an uncounted end
        # token is, it is rejected (a mismatch; joined after a tab, a tie); any other gap (joined
        # text can merge tokens across the split) the count tells apart from both
        served = response["choices"][0]["message"]
        split = len(tok.encode(served["reasoning_content"])) + 1 + len(tok.encode(served["content"]))
        gap = split - len(tok.encode(reasoning))
        if gap in (0, 1):
            assert ((row["status"], [f["code"] for f in row["findings"]])
                    == ("rejected", ["reconstruction_ambiguous" if gap == 0 else "usage_completion_mismatch"]))
            # and its count teaches the run nothing
            exchange = parse_exchange({"id": "d", "request": request, "response": response})
            assert _reconstruct(exchange, tok, dialect, None, None)[1].delta is None
        else:
            assert (row["status"], row["completion_ids"], row["reconstruction"]) == ("ok", ids, "no_think_close"), row
        response["choices"][0]["logprobs"] = {"content": [
            {"token": f"token_id:{t}", "logprob": -0.1, "bytes": None, "top_logprobs": []} for t in ids]}
        (row,) = reconstruct_record({"id": "d", "request": request, "response": response}, tok)
        assert (row["status"], row["completion_ids"]) == ("ok", ids), row["findings"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_ended_reasoning_whose_joined_reading_ties_the_formula_is_ambiguous(tok, dialect, stream):
    """A cold tester's case: after a tab, ``"\\t<tool_call>..."`` joined takes one token more
    than its halves apart, so the formula (``</think>`` between them) has the model's count
    exactly and passed ``ok`` with wrong ids. The joined reading, not offered from the count
    for an ended turn, still vetoes: a tie is ``reconstruction_ambiguous``; logprobs read it."""
    reasoning = "Plan \t<tool_call>x"
    assert len(tok.encode(reasoning)) == len(tok.encode("Plan \t")) + len(tok.encode("<tool_call>x")) + 1
    request = {"messages": PROMPT, "chat_template_kwargs": {"thinking": True}}
    prompt_ids = tok.encode(dialect.render_request(request))
    ids = tok.encode(reasoning) + [EOS]
    response = SGLangEngine(tok, "deepseek-v3.1", "deepseek-v3", {EOS}).serve(ids, len(prompt_ids), thinking=True,
                                                                             stream=stream)
    (row,) = reconstruct_record({"id": "d", "request": request, "response": response}, tok)
    assert (row["status"], [f["code"] for f in row["findings"]]) == ("rejected", ["reconstruction_ambiguous"])
    response["choices"][0]["logprobs"] = {"content": [
        {"token": f"token_id:{t}", "logprob": -0.1, "bytes": None, "top_logprobs": []} for t in ids]}
    (row,) = reconstruct_record({"id": "d", "request": request, "response": response}, tok)
    assert (row["status"], row["completion_ids"]) == ("ok", ids)


def test_a_joined_reading_two_ids_short_beside_a_length_cut_is_still_proven(tok, dialect):
    """A reviewer's: the plain-text reading that joins reasoning and ``<tool_call>`` text can be
    two ids short of the formula ("." and "<" merge), which no uncounted end token nor a cut that
    hides one id can stand in for; it was marked ``choices_unattributable``."""
    from tokenbridge.traits import ProviderTrait

    request = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "chat_template_kwargs": {"thinking": True}}
    reasoning, call = "I should call the tool.", '<tool_call>{"name": "get_weather"}</tool_call>'
    end = tok.token_id(dialect.end_token)
    formula = [*tok.encode(reasoning), tok.token_id("</think>"), *tok.encode(call), end]
    assert len(formula) - len([*tok.encode(reasoning + call), end]) == 2
    cut_text = "Let me think about the weather in Paris carefully"
    cut = tok.encode(cut_text)
    response = {"provider": "P", "choices": [
        {"index": 0, "message": {"reasoning_content": reasoning, "content": call}, "finish_reason": "stop"},
        {"index": 1, "message": {"reasoning_content": cut_text, "content": ""}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": len(tok.encode(dialect.render_request(request))),
                  "completion_tokens": len(formula) + len(cut)}}
    rows = reconstruct_record({"id": "r", "request": request, "response": response}, tok,
                              traits={"P": ProviderTrait("P", end_counted=True)})
    assert [(r["status"], r["completion_ids"]) for r in rows] == [("ok", formula), ("flagged", cut)], rows


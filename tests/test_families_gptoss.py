"""gpt-oss (harmony) with the real shared tokenizer and its HF chat template.

Prompts: the folder's template through our Jinja path against transformers'
``apply_chat_template``, and against the independent ``renderers==0.1.12``
``GptOssRenderer`` (which renders with ``openai_harmony``, as vLLM does) over generated
conversations, every byte equal but for the differences between the two stacks, each
pinned to the messages that cause it. The template prints the serving day: one prompt
per day the exchange's timing admits. Completions: native ids through SGLang 0.5.23's
``gpt-oss`` reasoning parser (special tokens kept, the stop id trimmed), whole and
streamed, must come back exactly, or with a finding.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import replace
from datetime import datetime, UTC
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_families_support import (SHARED, SGLangEngine, TOOLS, OracleTokenizer, texts, tool_lists,
                                   words)
from tokenbridge.chat import resolve_dialect
from tokenbridge.chat.harmony import serving_days
from tokenbridge.reconstruct import reconstruct_record

try:
    from renderers.configs import GptOssRendererConfig
    from renderers.gpt_oss import GptOssRenderer
except ImportError as e:  # pragma: no cover - CI installs it (requirements-oracles.txt)
    GptOssRenderer = None
    _WHY = f"oracle `renderers` not importable ({e})"

needs_renderers = pytest.mark.skipif(GptOssRenderer is None, reason=globals().get("_WHY", ""))

ENDOFTEXT, RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL = 199999, 200002, 200003, 200005, 200006, 200007, 200008, 200012
ASSISTANT, ANALYSIS = 173781, 35644
DAY = "2025-01-01"
NOON = 1735732800  # 2025-01-01 12:00 UTC


FAMILY = "gpt-oss"  # the tok / dialect fixtures (conftest)


def _word(tok, text: str) -> int:
    ids = tok.encode(text)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_folder_resolves_to_gpt_oss_with_its_template(tok, dialect):
    assert dialect.name == "gpt-oss+template"
    assert [tok.token_id(t) for t in dialect.end_tokens] == [RETURN, CALL]
    assert [tok.token_id(m) for m in dialect.tool_markers.all] == [CHANNEL, MESSAGE, CONSTRAIN]
    assert (_word(tok, "assistant"), _word(tok, "analysis")) == (ASSISTANT, ANALYSIS)
    assert resolve_dialect(tok, "gpt-oss").name == "gpt-oss+template"


def test_folder_encodes_through_tiktoken_with_the_ids_of_its_tokenizer_json(tok):
    """The folder's ``o200k_base.tiktoken`` with the tokenizer.json's split regex and added
    tokens: the ids and bytes of the HF tokenizer SGLang serves with, over generated text
    with harmony markers, digits, long whitespace runs and partial UTF-8 tokens."""
    from tokenizers import Tokenizer as HFTokenizer

    from test_families_support import RawBytes

    assert tok.kind == "tiktoken" and tok.lossless and tok.vocab_size == 200019 and len(tok.marker_ids) == 21
    hf = HFTokenizer.from_file(str(SHARED / "gpt-oss" / "tokenizer.json"))
    raw = RawBytes("gpt-oss")
    markers = st.sampled_from(["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                               "<|constrain|>", "<|endoftext|>", "<|reserved_200017|>", "<|endofprompt|>", "<|chan"])
    pieces = st.one_of(texts, markers, markers, st.integers(0, 10 ** 12).map(str),
                       st.sampled_from(["   \n\n  ", "\t" * 40, "'s 'LL"]))
    seen = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(pieces, max_size=8).map("".join))
    def check(text):
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert tok.decode_bytes(ids) == b"".join(raw(i) for i in ids) == text.encode()
        seen["markers"] += any(i in tok.marker_ids for i in ids)
        seen["n"] += 1

    check()
    print(dict(seen))
    assert seen["n"] == 300 and seen["markers"] >= 90, seen


def test_a_tiktoken_file_that_does_not_fit_the_tokenizer_json_is_not_used(tmp_path):
    """A ``.tiktoken`` file beside a tokenizer.json that is not a whole-word byte-level BPE
    over exactly its ranks: the folder loads through ``tokenizers``, as before."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    from tokenbridge.tokenizer import load_tokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "ranks.tiktoken").write_text("aGVsbG8= 0\n")
    assert load_tokenizer(tmp_path).kind == "tokenizers"


def test_prompt_recorded_in_provenance(tok, dialect):
    """PROVENANCE.md's rendering (system "You are helpful.", user "Hi", the day fixed to
    2025-01-01): the system turn is the model's preamble, the system message becomes
    developer instructions, and the prompt ends ``<|start|>assistant``."""
    request = {"messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]}
    reading, = dialect.prompt_readings(request, {"created": NOON}, {})
    assert reading.name == f"date={DAY}"
    assert reading.text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
        "2024-06\nCurrent date: 2025-01-01\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. "
        "Channel must be included for every message.<|end|><|start|>developer<|message|># Instructions\n\nYou are "
        "helpful.\n\n<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert tok.encode("<|start|>user<|message|>Hello<|end|><|start|>assistant") == [
        200006, 1428, 200008, 13225, 200007, 200006, 173781]
    assert tok.encode(reading.text)[-7:] == [START, 1428, MESSAGE, *tok.encode("Hi"), END, START, ASSISTANT]
    # reasoning_effort reaches the template as SGLang passes it (top level or reasoning.effort)
    for req in ({**request, "reasoning_effort": "high"}, {**request, "reasoning": {"effort": "high"}}):
        assert "\nReasoning: high\n" in dialect.prompt_readings(req, {"created": NOON}, {})[0].text


def test_serving_days_from_the_exchange_timing():
    """The client's own timing brackets the render; else the server's ``created``, up to
    an hour after it. Near UTC midnight both days are readings; junk is no timing."""
    assert serving_days({"created": NOON}, {}) == [DAY]
    assert serving_days({"created": NOON - 12 * 3600 + 600}, {}) == ["2024-12-31", DAY]  # 00:10 UTC
    assert serving_days({"created": NOON - 12 * 3600 - 600}, {}) == ["2024-12-31"]  # 23:50 UTC, before midnight
    assert serving_days({}, {"started_at": NOON, "latency_s": 30.0}) == [DAY]
    # the client's timing wins over created (which is the server's clock)
    assert serving_days({"created": NOON - 12 * 3600 + 60}, {"started_at": NOON - 12 * 3600 - 3000}) == ["2024-12-31"]
    for junk in ({}, {"created": "yesterday"}, {"created": True}, {"created": float("nan")}, {"created": 10 ** 30}):
        assert serving_days(junk, {}) is None, junk


def _record(tok, dialect, message: dict[str, Any], *, finish: str = "stop", created: int = NOON,
            completion_tokens: int | None = None, **choice: Any) -> dict[str, Any]:
    request = {"messages": PROMPT}
    response: dict[str, Any] = {"created": created, "choices": [{"message": message, "finish_reason": finish, **choice}]}
    if completion_tokens is not None:
        prompt = tok.encode(dialect.prompt_readings(request, response, {})[0].text)
        response["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens}
    return {"id": "g", "request": request, "response": response}


def test_prompt_day_ambiguity_is_flagged_and_ground_truth_ids_pick_the_day(tok, dialect):
    near_midnight = NOON - 12 * 3600 + 600
    rec = _record(tok, dialect, {"reasoning_content": "r", "content": "Hi."}, created=near_midnight)
    row, = reconstruct_record(rec, tok)
    assert "prompt_date_unproven" in {f["code"] for f in row["findings"]} and row["status"] == "rejected"
    prompts = [tok.encode(r.text) for r in dialect.prompt_readings(rec["request"], rec["response"], {})]
    assert len(prompts) == 2 and prompts[0] != prompts[1]
    rec["native_ids"] = {"prompt": prompts[1]}
    row, = reconstruct_record(rec, tok)
    assert row["prompt_ids"] == prompts[1] and row["reconstruction"] == f"date={DAY}"
    assert "prompt_date_unproven" not in {f["code"] for f in row["findings"]}
    del rec["response"]["created"], rec["native_ids"]
    row, = reconstruct_record(rec, tok)
    assert any(f["code"] == "prompt_date_unproven" and "no timing" in f["message"] for f in row["findings"])


def test_template_path_equals_transformers_apply_chat_template(tok, dialect):
    """transformers prints today's date (``strftime_now``): the reading for a response
    created now is the same prompt, byte for byte."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(SHARED / "gpt-oss" / "tokenizer.json"))
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "天气 in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "巴黎"}}}]},
             {"role": "tool", "tool_call_id": "c0", "content": '{"temp": 20}'},
             {"role": "assistant", "content": "20 degrees."}, {"role": "user", "content": "and tomorrow"}]
    for n in range(2, len(convo) + 1):
        for tools in (None, TOOLS):
            for effort in (None, "low"):
                kwargs = {} if effort is None else {"reasoning_effort": effort}
                now = time.time()
                theirs = hf.apply_chat_template(convo[:n], tools=tools, chat_template=tok.chat_template, tokenize=False,
                                                add_generation_prompt=True, **kwargs)
                request = {"messages": convo[:n], "tools": tools, **kwargs}
                ours = dialect.prompt_readings(request, {}, {"started_at": now, "latency_s": 0})
                local = datetime.now().date().isoformat()
                assert theirs in [r.text for r in ours] or local != datetime.now(UTC).date().isoformat()


# --- the HF template (SGLang) against openai_harmony (renderers, vLLM) -----------------------


@st.composite
def conversations(draw) -> tuple[list[dict[str, Any]], Any]:
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(st.sampled_from(["You are terse.", "你是助手。", "Be\nkind."]))})
    for turn in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(texts)})
        if draw(st.integers(0, 2)) == 0:
            name = draw(st.sampled_from(["get_weather", "search"]))
            args = draw(st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(words, st.integers(-9, 99)),
                                        max_size=2))
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{turn}", "type": "function", "function": {"name": name, "arguments": args}}]})
            msgs.append({"role": "tool", "tool_call_id": f"c{turn}", "name": name, "content": draw(words)})
        if draw(st.integers(0, 3)):
            msgs.append({"role": "assistant", "content": draw(texts.filter(bool))})
    if msgs[-1]["role"] == "assistant" and draw(st.booleans()):
        msgs.append({"role": "user", "content": draw(texts)})
    return msgs, draw(tool_lists)


def _to_harmony_stack(template_text: str, msgs: list[dict[str, Any]]) -> str:
    """The template's prompt with the three differences the openai_harmony stack makes,
    each where the messages put it: developer instructions that no tool declaration
    follows, without the template's trailing ``\\n\\n``; a tool call's header without
    the template's `` json`` content type; a tool result as its text, where the template
    prints ``|tojson``."""
    out = template_text
    if msgs and msgs[0]["role"] == "system" and msgs[0]["content"]:
        text = msgs[0]["content"]
        out = out.replace(f"# Instructions\n\n{text}\n\n<|end|>", f"# Instructions\n\n{text}<|end|>", 1)
    out = out.replace("<|channel|>commentary json<|message|>", "<|channel|>commentary<|message|>")
    for m in msgs:
        if m["role"] == "tool":
            out = out.replace(f"<|message|>{json.dumps(m['content'], ensure_ascii=False)}<|end|>",
                              f"<|message|>{m['content']}<|end|>", 1)
    return out


@needs_renderers
def test_generated_conversations_match_openai_harmony_up_to_the_pinned_stack_differences(tok, dialect, monkeypatch):
    # openai_harmony loads o200k_base from this folder, offline (the file is OpenAI's, byte for byte)
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(SHARED / "gpt-oss"))
    oracle = GptOssRenderer(OracleTokenizer(tok), GptOssRendererConfig(conversation_start_date=DAY))
    seen = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(conversations())
    def check(case):
        msgs, tools = case
        reading, = dialect.prompt_readings({"messages": msgs, "tools": tools}, {"created": NOON}, {})
        theirs = tok.decode_bytes(oracle.render(msgs, tools=tools, add_generation_prompt=True).token_ids).decode()
        # renderers prefills the analysis header; SGLang's and vLLM's generation prompt end <|start|>assistant
        assert theirs.endswith("<|start|>assistant<|channel|>analysis<|message|>")
        theirs = theirs[: -len("<|channel|>analysis<|message|>")]
        harmony = _to_harmony_stack(reading.text, msgs)
        assert harmony == theirs
        seen["n"] += 1
        seen["differs"] += harmony != reading.text
        seen["tools"] += bool(tools)
        seen["tool_calls"] += any(m.get("tool_calls") for m in msgs)
        seen["system"] += msgs[0]["role"] == "system"
        seen["history"] += sum(m["role"] == "assistant" for m in msgs) > 0

    check()
    assert seen["n"] >= 300 and min(seen[k] for k in ("tools", "tool_calls", "system", "history")) >= 40, seen
    assert seen["differs"] >= 100, seen


_TYPED_TOOL = {"type": "function", "function": {"name": "lookup", "description": "", "parameters": {
    "type": "object", "required": ["k"], "properties": {
        "k": {"type": "integer", "description": "which"}, "tags": {"type": "array", "items": {"type": "string"}},
        "mode": {"type": "string", "enum": ["a", "b"]}, "on": {"type": "boolean", "default": True},
        "x": {"type": "number", "default": 1.5}}}}}
_NO_PARAMS = {"type": "function", "function": {"name": "ping", "description": "Ping.", "parameters": {}}}


@st.composite
def harmony_conversations(draw) -> tuple[list[dict[str, Any]], Any]:
    """Conversations for the openai_harmony stack: a system message first, later or
    twice; tool-call turns with and without reasoning and text, results by name."""
    msgs: list[dict[str, Any]] = []
    system = st.sampled_from(["You are terse.", "你是助手。", "Be\nkind."])
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(system)})
    for turn in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(texts)})
        if draw(st.integers(0, 5)) == 0:
            msgs.append({"role": "system", "content": draw(system)})
        if draw(st.integers(0, 2)) == 0:
            calls = []
            for k in range(draw(st.integers(1, 2))):
                name = draw(st.sampled_from(["get_weather", "search"]))
                args = draw(st.dictionaries(st.sampled_from(["city", "q"]), words, max_size=2))
                calls.append({"id": f"c{turn}{k}", "type": "function", "function": {
                    "name": name, "arguments": json.dumps(args, ensure_ascii=False) if draw(st.booleans()) else args}})
            turn_msg: dict[str, Any] = {"role": "assistant", "content": draw(st.one_of(st.just(""), words)),
                                        "tool_calls": calls}
            if draw(st.booleans()):
                turn_msg["reasoning_content"] = draw(words)
            msgs.append(turn_msg)
            msgs.extend({"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": draw(words)}
                        for c in calls)
        if draw(st.integers(0, 3)):
            msgs.append({"role": "assistant", "content": draw(texts)})
    if msgs[-1]["role"] == "assistant" and draw(st.booleans()):
        msgs.append({"role": "user", "content": draw(texts)})
    tools = draw(st.one_of(st.none(), st.just(TOOLS), st.just([*TOOLS[:1], _TYPED_TOOL, _NO_PARAMS])))
    return msgs, tools


@needs_renderers
@pytest.mark.parametrize("effort", ["low", "high"])
def test_harmony_stack_dialect_matches_openai_harmony(tok, monkeypatch, effort):
    """``--dialect gpt-oss-harmony``: the openai_harmony stack's bytes, with the folder's
    template ignored, over generated conversations (150 per effort); the same token ids
    as renderers (which renders message by message) but for its analysis prefill."""
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(SHARED / "gpt-oss"))
    harmony = resolve_dialect(tok, "gpt-oss-harmony")
    assert harmony.name == "gpt-oss-harmony"
    harmony = replace(harmony, vllm_render=None)  # renderers' reading alone (vLLM's own: test_harmony_vllm)
    oracle = GptOssRenderer(OracleTokenizer(tok), GptOssRendererConfig(conversation_start_date=DAY, reasoning_effort=effort))
    prefill = [CHANNEL, ANALYSIS, MESSAGE]
    seen = Counter()

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(harmony_conversations())
    def check(case):
        msgs, tools = case
        reading, = harmony.prompt_readings({"messages": msgs, "tools": tools, "reasoning_effort": effort},
                                           {"created": NOON}, {})
        theirs = oracle.render(msgs, tools=tools, add_generation_prompt=True).token_ids
        assert theirs[-3:] == prefill
        assert tok.decode_bytes(theirs[:-3]).decode() == reading.text
        assert f"\nReasoning: {effort}\n" in reading.text
        seen["same_ids"] += tok.encode(reading.text) == theirs[:-3]
        seen["n"] += 1
        seen["typed_tools"] += bool(tools) and len(tools) == 3
        seen["late_system"] += any(m["role"] == "system" for m in msgs[1:])
        seen["analysis_kept"] += "<|channel|>analysis" in reading.text
        seen["string_args"] += any(isinstance(c["function"]["arguments"], str)
                                   for m in msgs for c in m.get("tool_calls") or ())

    check()
    print(dict(seen))
    assert seen["n"] == 150 and seen["same_ids"] == 150, seen
    assert min(seen[k] for k in ("typed_tools", "late_system", "analysis_kept", "string_args")) >= 10, seen


def test_harmony_stack_dialect_flags_what_it_does_not_reproduce(tok):
    harmony = resolve_dialect(tok, "gpt-oss-harmony")
    nested = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"o": {"type": "object", "properties": {"h": {"type": "string"}}}}}}}
    rec = {"id": "h", "request": {"messages": PROMPT, "tools": [nested], "chat_template_kwargs": {"x": 1}},
           "response": {"created": NOON, "choices": [{"message": {"reasoning_content": "r", "content": "c"},
                                                      "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok, harmony)
    codes = {f["code"] for f in row["findings"]}
    assert {"tools_declared", "template_kwarg_unknown"} <= codes, row["findings"]
    assert any("f.o: a parameter type outside" in f["message"] for f in row["findings"])


# --- completions -------------------------------------------------------------------------------

PROMPT = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Check the weather tool."}]
A = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"


def test_exact_ids_final_answer(tok, dialect):
    row, = reconstruct_record(_record(tok, dialect, {"reasoning_content": "Need the weather.", "content": "Sunny."}), tok)
    r, c = tok.encode("Need the weather."), tok.encode("Sunny.")
    assert row["completion_ids"] == [CHANNEL, ANALYSIS, MESSAGE, *r, END, START, ASSISTANT, CHANNEL,
                                     _word(tok, "final"), MESSAGE, *c, RETURN]
    kinds = [s["kind"] for s in row["segments"][1:]]
    assert kinds == ["format", "reasoning", "think_end", "format", "content", "end"]
    assert [f["code"] for f in row["findings"]] == ["usage_missing"]
    assert row["reconstruction"] == f"date={DAY}"


def test_exact_ids_raw_tool_call_with_its_stop_kept(tok, dialect):
    """A provider that keeps the stop (SGLang's ``no_stop_trim``) serves the commentary
    call raw after the analysis; it is rebuilt as written, ended by ``<|call|>``."""
    call = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"P"}'
    row, = reconstruct_record(_record(tok, dialect, {"reasoning_content": "Tool.", "content": call + "<|call|>"}), tok)
    ids = row["completion_ids"]
    assert ids == [CHANNEL, ANALYSIS, MESSAGE, *tok.encode("Tool."), END, *tok.encode(call), CALL]
    assert [i for i in ids if i >= 199998] == [CHANNEL, MESSAGE, END, START, CHANNEL, CONSTRAIN, MESSAGE, CALL]
    assert [s["kind"] for s in row["segments"][-3:]] == ["format", "tool_calls", "end"]
    assert "tool_markers_malformed" not in {f["code"] for f in row["findings"]}
    assert row["status"] == "rejected"  # eos_in_text: the served <|call|> text, taken as the end token
    assert {f["code"] for f in row["findings"]} == {"usage_missing", "eos_in_text"}


def test_only_a_message_with_a_recipient_is_read_as_a_raw_call(tok, dialect):
    """Served raw text of a final message is not a tool call (same count, another end
    token): it stays content, and its markers are findings."""
    row, = reconstruct_record(_record(tok, dialect, {"reasoning_content": "r",
                                                     "content": "<|start|>assistant<|channel|>final<|message|>C"}), tok)
    assert row["completion_ids"][-1] == RETURN and "tool_calls" not in [s["kind"] for s in row["segments"]]
    assert row["status"] == "rejected" and "special_token_text" in {f["code"] for f in row["findings"]}
    first = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}'  # the first message, no analysis
    row, = reconstruct_record(_record(tok, dialect, {"content": first + "<|call|>"}), tok)
    assert row["completion_ids"] == tok.encode(first + "<|call|>")


def test_sglang_drops_the_tool_call_whose_stop_it_trimmed(tok, dialect):
    """SGLang trims ``<|call|>`` and its harmony parser then drops the call: reasoning,
    empty content. ``matched_stop`` (or the count) says a message is lost."""
    native = tok.encode(A + "Tool." + NEXT + '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>')
    msg = {"reasoning_content": "Tool.", "content": ""}
    for extra in ({"matched_stop": CALL}, {"completion_tokens": len(native)}):
        row, = reconstruct_record(_record(tok, dialect, msg, **extra), tok)
        assert "harmony_message_lost" in {f["code"] for f in row["findings"]} and row["status"] == "rejected", extra


def test_preamble_merged_into_content_is_caught_by_the_count(tok, dialect):
    native = tok.encode(A + "T." + NEXT + "<|channel|>commentary<|message|>Pre." + NEXT +
                        "<|channel|>final<|message|>Ans.<|return|>")
    row, = reconstruct_record(_record(tok, dialect, {"reasoning_content": "T.", "content": "Pre.Ans."},
                                      completion_tokens=len(native)), tok)
    codes = {f["code"] for f in row["findings"]}
    assert {"harmony_message_lost", "usage_completion_mismatch"} <= codes and row["status"] == "rejected"


def test_empty_analysis_and_no_analysis_are_told_apart_by_the_count(tok, dialect):
    none = tok.encode("<|channel|>final<|message|>Ans.<|return|>")
    empty = tok.encode(A + NEXT + "<|channel|>final<|message|>Ans.<|return|>")
    for native, name in ((none, f"date={DAY}"), (empty, f"date={DAY}+empty_analysis")):
        row, = reconstruct_record(_record(tok, dialect, {"content": "Ans."}, completion_tokens=len(native)), tok)
        assert row["completion_ids"] == native and row["reconstruction"] == name
        # no analysis message at all: reasoning_missing; an empty one the count proves is not lost
        assert {f["code"] for f in row["findings"]} == ({"reasoning_missing"} if native == none else set())
    row, = reconstruct_record(_record(tok, dialect, {"content": "Ans."}), tok)
    assert "reconstruction_ambiguous" in {f["code"] for f in row["findings"]}


def test_no_analysis_proven_by_logprobs_and_the_count_is_not_lost(tok, dialect):
    """Logprobs that spell every id, with an exact count, prove the model wrote no analysis
    message (a cold tester saw such rows rejected as ``reasoning_missing``); logprobs alone do
    not: a provider that withheld the analysis would log the final text only."""
    native = tok.encode("<|channel|>final<|message|>Ans.<|return|>")
    logprobs = {"content": [{"token": f"token_id:{t}", "logprob": -0.1, "bytes": None, "top_logprobs": []}
                            for t in native]}
    for count, codes in ((len(native), []), (None, ["reasoning_missing", "usage_missing"])):
        record = _record(tok, dialect, {"content": "Ans."}, completion_tokens=count)
        record["response"]["choices"][0]["logprobs"] = logprobs
        row, = reconstruct_record(record, tok)
        assert (row["completion_ids"], sorted(f["code"] for f in row["findings"])) == (native, codes)


def test_cut_inside_the_next_header_is_read_from_the_count(tok, dialect):
    base = A + "Thinking"
    for k, tail in enumerate(["", "<|end|>", "<|end|><|start|>", NEXT]):
        native = tok.encode(base + tail)
        row, = reconstruct_record(_record(tok, dialect, {"reasoning_content": "Thinking", "content": ""}, finish="length",
                                          completion_tokens=len(native)), tok)
        assert row["completion_ids"] == native, k
        assert row["status"] == "flagged" and {f["code"] for f in row["findings"]} == {"truncated"}, row["findings"]
    # 'final' or 'commentary': same count; <|channel|> or a recipient-first header's ' to' likewise;
    # so are a cut inside 'commentary' (comment+ary) and in a channel-first call's recipient
    # ('commentary to' ties 'commentary<|message|>': it was read as that, ok-able with wrong ids)
    for tail in ("<|channel|>final", "<|channel|>", " to", "<|channel|>comment", "<|channel|>commentary to",
                 "<|channel|>commentary to=", "<|channel|>analysis to=python"):
        native = tok.encode(base + NEXT + tail)
        row, = reconstruct_record(_record(tok, dialect, {"reasoning_content": "Thinking", "content": ""},
                                          finish="length", completion_tokens=len(native)), tok)
        assert "reconstruction_ambiguous" in {f["code"] for f in row["findings"]}, tail


@pytest.mark.parametrize("content, code", [
    ("a<|channel|>final<|message|>b", "tool_markers_malformed"),
    ("done<|return|>more", "eos_in_text"),
    ("a<|start|>b", "special_token_text"),
    ("a<|end|>b", "think_marker_in_content"),
])
def test_gate_codes_for_harmony_markers_in_text(tok, dialect, content, code):
    row, = reconstruct_record(_record(tok, dialect, {"reasoning_content": "r", "content": content}), tok)
    assert code in {f["code"] for f in row["findings"]}, row["findings"]
    assert row["status"] == "rejected"


# --- SGLang's gpt-oss reasoning parser as the engine -----------------------------------------------


@st.composite
def natives(draw) -> tuple[str, str]:
    """(kind, native completion text) as gpt-oss writes it after ``<|start|>assistant``."""
    kind = draw(st.sampled_from(["final", "final", "final", "no_analysis", "empty_analysis", "preamble",
                                 "two_analysis", "tool", "cut", "cut", "cut"]))
    reasoning = draw(texts.filter(bool))
    final = "<|channel|>final<|message|>" + draw(texts) + "<|return|>"
    if kind == "no_analysis":
        return kind, final
    if kind == "empty_analysis":
        return kind, A + NEXT + final
    head = A + reasoning + NEXT
    if kind == "preamble":
        return kind, head + "<|channel|>commentary<|message|>" + draw(texts.filter(bool)) + NEXT + final
    if kind == "two_analysis":
        return kind, head + "<|channel|>analysis<|message|>" + draw(texts.filter(bool)) + NEXT + final
    if kind == "tool":
        args = json.dumps(draw(st.dictionaries(st.sampled_from(["city", "q"]), words, max_size=2)), ensure_ascii=False)
        return kind, head + f"<|channel|>commentary to=functions.{draw(st.sampled_from(['get_weather', 'search']))} " \
                            f"<|constrain|>json<|message|>{args}<|call|>"
    return kind, head + final


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sglang_served_completions_rebuild_exactly_or_are_flagged(tok, dialect, stream):
    engine = SGLangEngine(tok, "gpt-oss", "gpt-oss", {ENDOFTEXT, RETURN, CALL}, skip_special=False)
    request = {"messages": PROMPT}
    prompt_ids = tok.encode(dialect.prompt_readings(request, {"created": NOON}, {})[0].text)
    seen = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(natives(), st.randoms(use_true_random=False), st.booleans())
    def check(native, rnd, with_stop):
        kind, text = native
        ids = tok.encode(text)
        if kind == "cut":
            ids = ids[: rnd.randint(1, len(ids) - 1)]
        response = engine.serve(ids, len(prompt_ids), thinking=True, stream=stream)
        response["created"] = NOON
        if with_stop and response["choices"][0]["finish_reason"] == "stop":
            response["choices"][0]["matched_stop"] = ids[-1]  # SGLang names the stop id it trimmed
        row, = reconstruct_record({"id": "g", "request": request, "response": response}, tok)
        seen.update(f["code"] for f in row["findings"])
        seen["n"] += 1
        if row["status"] != "rejected":  # ok, or flagged only by warnings (truncated)
            assert row["completion_ids"] == ids, (kind, text)
            assert row["prompt_ids"] == prompt_ids
            seen["accepted"] += 1
            seen[f"accepted_{kind}"] += 1
        else:
            seen[f"rejected_{kind}"] += 1

    check()
    print(dict(seen))
    # coverage floors, not results: generation order varies between a lone run and the suite
    # (accepted 123-134 and accepted cuts 25-35 of 300 seen)
    assert seen["n"] == 300 and seen["accepted"] >= 100, seen
    assert seen["accepted_final"] >= 60 and seen["accepted_cut"] >= 15, seen
    # what SGLang's parser loses never passes
    assert all(seen[f"accepted_{k}"] == 0 for k in ("preamble", "two_analysis", "tool", "no_analysis")), seen


def test_a_negative_or_non_finite_time_is_no_timing():
    """A negative latency_s made the client's bracket end before it began: no day, and
    reconstruct indexed the empty list (IndexError, exit 8, the whole file lost)."""
    assert serving_days({}, {"started_at": NOON, "latency_s": -1000000}) is None
    assert serving_days({"created": NOON}, {"started_at": NOON, "latency_s": -1}) == [DAY]  # created instead
    assert serving_days({"created": NOON}, {"started_at": NOON, "latency_s": float("inf")}) == [DAY]
    for junk in ({"created": -5}, {"created": float("-inf")}):
        assert serving_days(junk, {}) is None, junk
    assert serving_days({}, {"started_at": -NOON}) is None


def test_a_negative_latency_reconstructs_with_the_no_timing_finding(tok, dialect):
    rec = _record(tok, dialect, {"reasoning_content": "r", "content": "Hi."})
    del rec["response"]["created"]
    rec["meta"] = {"started_at": NOON, "latency_s": -1000000}
    row, = reconstruct_record(rec, tok)
    assert row["reconstruction"] == "date=unknown"
    assert "prompt_date_unproven" in {f["code"] for f in row["findings"]}

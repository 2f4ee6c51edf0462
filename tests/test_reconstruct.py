"""Reconstruction and the gate on the real Kimi K2.5 tokenizer: exact ids, every
finding code, and a property test over arbitrary Unicode."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenbridge.checks import CODES, Policy
from tokenbridge.exchanges import RecordError
from tokenbridge.reconstruct import reconstruct_file, reconstruct_record
from tokenbridge.traits import ProviderTrait

TS, TE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TOOL_CALL = f"{TS}{CB}functions.get_weather:0{AB}{{\"city\": \"Paris\"}}{CE}{TE}"
PROMPT = [{"role": "system", "content": "Tools: get_weather(city)."}, {"role": "user", "content": "Weather in Paris?"}]


def _count(kimi, reasoning, content, finish="stop", thinking=True):
    """Completion token count the engine would report, computed independently of reconstruct."""
    # a provider that leaks the end token as text still counted it once, as the end token
    content = content.removesuffix("<|im_end|>") if content else content
    n = len(kimi.encode(reasoning)) if reasoning else 0
    if finish == "length" and not content:
        return n
    n += int(thinking) + (len(kimi.encode(content)) if content else 0)
    return n if finish == "length" else n + 1


def make(kimi, reasoning="Check the weather tool.", content="Sure." + TOOL_CALL, finish="tool_calls",
         request=None, usage=True, **message):
    request = copy.deepcopy(request or {"model": "moonshotai/kimi-k2.5", "messages": PROMPT})
    msg = {"role": "assistant", "content": content, **message}
    if reasoning is not None:
        msg["reasoning"] = reasoning
    response = {"id": "gen-1", "provider": "Test", "model": "moonshotai/kimi-k2.5",
                "choices": [{"index": 0, "message": msg, "finish_reason": finish}]}
    if usage:
        from tokenbridge.chat import DIALECTS, thinking_enabled

        prompt = DIALECTS["kimi-k2.5"].render_request(request)
        response["usage"] = {"prompt_tokens": len(kimi.encode(prompt)),
                             "completion_tokens": _count(kimi, reasoning, content, finish, thinking_enabled(request))}
    return {"id": "s1", "dataset": "b3", "request": request, "response": response}


def codes(row):
    return sorted(f["code"] for f in row["findings"])


def test_clean_tool_call_sample_exact_ids(kimi):
    row, = reconstruct_record(make(kimi), kimi)
    assert row["status"] == "ok" and row["findings"] == []
    ids = row["completion_ids"]
    n_reason = len(kimi.encode("Check the weather tool."))
    n_sure = len(kimi.encode("Sure."))
    assert ids[n_reason] == 163607                      # </think> right after the reasoning
    sec = n_reason + 1 + n_sure
    assert ids[sec] == 163595 and ids[sec + 1] == 163597  # section begin, call begin
    assert ids[-2] == 163596 and ids[-1] == 163586        # section end, <|im_end|>
    assert [i for i in ids if 163595 <= i <= 163599] == [163595, 163597, 163598, 163599, 163596]
    assert row["prompt_ids"][-4:] == [163588, 69702, 163601, 163606]
    assert row["input_ids"] == row["prompt_ids"] + ids
    assert row["loss_mask"] == [0] * len(row["prompt_ids"]) + [1] * len(ids)
    kinds = [(s["kind"], s["end"] - s["start"]) for s in row["segments"]]
    assert kinds == [("prompt", len(row["prompt_ids"])), ("reasoning", n_reason), ("think_end", 1),
                     ("content", n_sure), ("tool_calls", len(ids) - n_reason - 1 - n_sure - 1), ("end", 1)]
    assert (row["provider"], row["dataset"], row["finish_reason"]) == ("Test", "b3", "tool_calls")


def _mut(kimi, **kw):
    return make(kimi, **kw)


CASES = {
    "eos_in_text (trailing leak)": (dict(content="Hello!<|im_end|>", finish="stop"), ["eos_in_text"]),
    "eos_in_text (middle)": (dict(content="a<|im_end|>b", finish="stop"), ["eos_in_text"]),
    "eos_in_text (reasoning)": (dict(reasoning="x [EOS] y", content="ok", finish="stop"), ["eos_in_text"]),
    "think_marker_in_content": (dict(content="a</think>b", finish="stop"), ["think_marker_in_content"]),
    "think_marker_in_reasoning": (dict(reasoning="<think>hmm", content="ok", finish="stop"), ["think_marker_in_reasoning"]),
    # without usage nothing proves the empty think block: the reasoning may have been withheld
    "reasoning_missing": (dict(reasoning=None, content="ok", finish="stop", usage=False), ["reasoning_missing", "usage_missing"]),
    "tool_section_in_reasoning": (dict(reasoning=f"plan {CB}x", content="ok", finish="stop"), ["tool_section_in_reasoning"]),
    "tool_markers_malformed (unclosed)": (dict(content=f"x{TS}{CB}f:0{AB}{{}}{CE}"), ["tool_markers_malformed"]),
    "tool_markers_malformed (order)": (dict(content=f"{TS}{AB}f:0{CB}{{}}{CE}{TE}"), ["tool_markers_malformed"]),
    "tool_markers_malformed (outside)": (dict(content=f"x{CB}f{CE}", finish="stop"), ["tool_markers_malformed"]),
    "tool_markers_malformed (empty)": (dict(content=f"x{TS}{TE}"), ["tool_markers_malformed"]),
    "special_token_text": (dict(content="hi <|im_user|> there", finish="stop"), ["special_token_text"]),
    "special_token_text (reserved)": (dict(reasoning="<|reserved_token_163600|>", content="ok", finish="stop"), ["special_token_text"]),
    "replacement_char": (dict(content="caf\ufffd", finish="stop"), ["replacement_char"]),
    "truncated": (dict(content="partial ans", finish="length"), ["truncated"]),
    "truncated inside reasoning": (dict(reasoning="long thought", content="", finish="length"), ["truncated"]),
    # an empty turn also reads as <think><|im_end|>, a <think> the parser deleted (token_hidden)
    "empty_completion": (dict(reasoning="", content="", finish="stop"), ["empty_completion", "reconstruction_ambiguous"]),
    "finish_error": (dict(content="ok", finish="error"), ["finish_error"]),
    "finish_error (content_filter)": (dict(content="ok", finish="content_filter"), ["finish_error"]),
    "finish_error (null)": (dict(content="ok", finish=None), ["finish_error"]),
    # an empty finish_reason is no finish, as null: it was a finish_unknown warning, the row kept
    "finish_error (empty)": (dict(content="ok", finish=""), ["finish_error"]),
    "finish_error (blank)": (dict(content="ok", finish=" \n"), ["finish_error"]),
    "finish_unknown": (dict(content="ok", finish="weird"), ["finish_unknown"]),
    "usage_missing": (dict(content="ok", finish="stop", usage=False), ["usage_missing"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_finding_code(kimi, name):
    kwargs, expected = CASES[name]
    row, = reconstruct_record(make(kimi, **kwargs), kimi)
    assert codes(row) == expected
    severity = {CODES[c][0] for c in expected}
    assert row["status"] == ("rejected" if "error" in severity else "flagged")


@pytest.mark.parametrize("finish", [5, 1.5, True, ["stop"], {"a": 1}])
def test_a_finish_reason_that_is_no_string_is_a_bad_record_not_a_crash(kimi, finish):
    with pytest.raises(RecordError) as err:
        reconstruct_record(make(kimi, content="ok", finish=finish), kimi)
    assert (err.value.field, err.value.detail) == (
        "response.choices[0].finish_reason", f"must be a string or null, got {type(finish).__name__}")


def test_an_empty_finish_reason_is_rejected_as_null_is(kimi):
    """The same finding, the same words but the value: "" is no finish, as null is."""
    empty, = reconstruct_record(make(kimi, content="ok", finish=""), kimi)
    null, = reconstruct_record(make(kimi, content="ok", finish=None), kimi)
    assert [(f["code"], f["message"]) for f in empty["findings"]] == [
        ("finish_error", "finish_reason='': the choice did not finish normally")]
    assert [(f["code"], f["message"]) for f in null["findings"]] == [
        ("finish_error", "finish_reason=None: the choice did not finish normally")]
    assert (empty["status"], empty["finish_reason"], empty["completion_ids"]) == ("rejected", "", null["completion_ids"])


def _native(kimi, native, counted_as="length", content="The capital of France is"):
    """finish_reason "stop" beside the provider's own word ``native``; usage counts the
    completion as ``counted_as`` reads it."""
    rec = make(kimi, content=content, finish=counted_as)
    rec["response"]["choices"][0].update(finish_reason="stop", native_finish_reason=native)
    return rec


@pytest.mark.parametrize("native", ["length", "MAX_TOKENS", "max_tokens"])
def test_a_cut_the_provider_admits_natively_is_read_as_a_cut(kimi, native):
    """Read as ended, the ids would carry an end token the provider says never came; read
    as cut they are a prefix of the native ids whichever is true, and the count tells."""
    row, = reconstruct_record(_native(kimi, native), kimi)
    cut, = reconstruct_record(make(kimi, content="The capital of France is", finish="length"), kimi)
    assert (codes(row), row["status"], row["finish_reason"]) == (["truncated"], "flagged", "length")
    assert row["completion_ids"] == cut["completion_ids"] and row["segments"] == cut["segments"]
    assert row["findings"][0]["message"] == (f"finish_reason='stop' but native_finish_reason={native!r}: the provider "
                                             "says it cut the answer, so no end token appended")
    ended, = reconstruct_record(_native(kimi, native, counted_as="stop"), kimi)  # a count with the end token
    assert codes(ended) == ["truncated", "usage_completion_mismatch"] and ended["status"] == "rejected"


@pytest.mark.parametrize("native", ["abort", "error", "ERROR", "content_filter"])
def test_a_failure_the_provider_admits_natively_is_a_finish_error(kimi, native):
    row, = reconstruct_record(_native(kimi, native, counted_as="stop"), kimi)
    assert (codes(row), row["status"], row["finish_reason"]) == (["finish_error"], "rejected", "stop")
    assert f"native_finish_reason={native!r}" in row["findings"][0]["message"]


@pytest.mark.parametrize("native", ["stop", "end_turn", "STOP", 5, None, ["length"]])
def test_a_native_finish_reason_that_admits_nothing_changes_nothing(kimi, native):
    """Nothing but the note that a value no engine writes was set aside (``evidence_malformed``)."""
    row, = reconstruct_record(_native(kimi, native, counted_as="stop"), kimi)
    said = [] if native is None or isinstance(native, str) else ["evidence_malformed"]
    assert (codes(row), row["finish_reason"]) == (said, "stop")


def test_leaked_end_marker_is_never_doubled(kimi):
    row, = reconstruct_record(make(kimi, content="Hello!<|im_end|>", finish="stop"), kimi)
    assert row["completion_ids"].count(163586) == 1 and row["completion_ids"][-1] == 163586


def test_structured_tool_calls(kimi):
    rec = make(kimi, content="", finish="tool_calls", usage=False,
               tool_calls=[{"id": "functions.get_weather:0", "type": "function",
                            "function": {"name": "get_weather", "arguments": "{}"}}])
    row, = reconstruct_record(rec, kimi)
    # no usage: nothing tells R</think><|im_end|> from R<think><|im_end|> (a <think> the parser deleted)
    assert codes(row) == ["reconstruction_ambiguous", "structured_tool_calls", "usage_missing"]


def test_reasoning_unexpected_in_instant_mode(kimi):
    req = {"messages": PROMPT, "reasoning": {"enabled": False}}
    row, = reconstruct_record(make(kimi, reasoning="should not be here", content="ok", finish="stop", request=req, usage=False), kimi)
    assert codes(row) == ["reasoning_unexpected", "usage_missing"]
    clean, = reconstruct_record(make(kimi, reasoning=None, content="ok", finish="stop", request=req), kimi)
    assert clean["status"] == "ok"
    assert clean["prompt_ids"][-2:] == [163606, 163607] and clean["completion_ids"] == kimi.encode("ok") + [163586]


def test_stop_sequence(kimi):
    req = {"messages": PROMPT, "stop": ["\n\n"]}
    row, = reconstruct_record(make(kimi, content="ok", finish="stop", request=req), kimi)
    assert codes(row) == ["stop_sequence"]


def test_usage_mismatches_report_delta_and_tolerance(kimi):
    rec = make(kimi, content="ok", finish="stop")
    rec["response"]["usage"]["prompt_tokens"] += 1
    rec["response"]["usage"]["completion_tokens"] -= 2
    row, = reconstruct_record(rec, kimi)
    assert codes(row) == ["usage_completion_mismatch", "usage_prompt_mismatch"]
    msgs = {f["code"]: f["message"] for f in row["findings"]}
    assert "delta +2" in msgs["usage_completion_mismatch"] and "delta -1" in msgs["usage_prompt_mismatch"]
    row, = reconstruct_record(rec, kimi, policy=Policy(usage_tolerance=2))
    assert row["status"] == "ok"


def test_roundtrip_mismatch_on_lone_surrogate(kimi):
    row, = reconstruct_record(make(kimi, content="bad \ud800 text", finish="stop", usage=False), kimi)
    assert "roundtrip_mismatch" in codes(row)


def test_native_ids_match_and_mismatch(kimi):
    rec = make(kimi, content="Hello", finish="stop")
    row, = reconstruct_record(rec, kimi)
    good = copy.deepcopy(rec)
    good["response"]["prompt_token_ids"] = row["prompt_ids"]
    good["response"]["choices"][0]["token_ids"] = row["completion_ids"]
    assert reconstruct_record(good, kimi)[0]["status"] == "ok"
    # the model emitted "Hel" + "lo" instead of the canonical "Hello": same text, other ids
    hel, lo = kimi.encode("Hel"), kimi.encode("lo")
    assert len(hel) == len(lo) == 1
    pos = row["completion_ids"].index(19180)
    noncanon = row["completion_ids"][:pos] + hel + lo + row["completion_ids"][pos + 1:]
    bad = copy.deepcopy(rec)
    bad["native_ids"] = noncanon
    r, = reconstruct_record(bad, kimi)
    assert codes(r) == ["native_mismatch"]
    assert f"first divergence at {pos}" in r["findings"][0]["message"]
    assert "same text, non-canonical" in r["findings"][0]["message"]
    other = copy.deepcopy(rec)
    other["native_ids"] = {"prompt": row["prompt_ids"][:-1] + [163607], "choices": [row["completion_ids"]]}
    r, = reconstruct_record(other, kimi)
    assert codes(r) == ["native_mismatch"] and "text differs" in r["findings"][0]["message"]


def test_error_body_without_choices(kimi):
    rec = make(kimi)
    rec["response"] = {"error": {"code": 502, "message": "upstream died"}}
    row, = reconstruct_record(rec, kimi)
    assert codes(row) == ["finish_error"] and "upstream died" in row["findings"][0]["message"]
    assert row["status"] == "rejected" and row["completion_ids"] == []


def test_an_error_body_beside_its_choices_rejects_every_row(kimi):
    """The upstream died mid-answer: the text is cut mid-word under finish_reason "stop", and
    the usage counts what was sent, so only the error object says the body is no answer."""
    rec = make(kimi, content="The capital of France is Par", finish="stop")
    second = copy.deepcopy(rec["response"]["choices"][0])
    second["index"] = 1
    rec["response"]["choices"].append(second)
    rec["response"]["usage"]["completion_tokens"] *= 2
    clean = reconstruct_record(rec, kimi)
    assert [r["status"] for r in clean] == ["ok", "ok"]
    rec["response"]["error"] = {"code": 502, "message": "Upstream connection reset mid-generation"}
    rows = reconstruct_record(rec, kimi)
    assert [codes(r) for r in rows] == [["finish_error"], ["finish_error"]]
    assert [r["status"] for r in rows] == ["rejected", "rejected"]
    assert rows[0]["findings"][0]["message"] == ("the body is an error beside its choices: "
                                                 "Upstream connection reset mid-generation")
    assert [r["completion_ids"] for r in rows] == [r["completion_ids"] for r in clean]  # read as before, only judged
    rec["response"]["error"] = "gone"  # an error in any shape
    assert codes(reconstruct_record(rec, kimi)[0]) == ["finish_error"]
    off = reconstruct_record(rec, kimi, policy=Policy({"finish_error": "off"}))
    assert [r["status"] for r in off] == ["ok", "ok"]


def test_two_choices_sum_usage(kimi):
    rec = make(kimi, content="A", finish="stop")
    second = copy.deepcopy(rec["response"]["choices"][0])
    second["index"] = 1
    second["message"]["content"] = "B b"
    rec["response"]["choices"].append(second)
    rec["response"]["usage"]["completion_tokens"] += _count(kimi, "Check the weather tool.", "B b")
    rows = reconstruct_record(rec, kimi)
    assert [r["choice"] for r in rows] == [0, 1] and all(r["status"] == "ok" for r in rows)
    assert rows[1]["completion_ids"][-3:-1] == kimi.encode("B b")


def test_policy_maps_codes():
    with pytest.raises(ValueError, match="unknown finding code"):
        Policy(severities={"nope": "error"})


def test_policy_warning_and_off(kimi):
    rec = make(kimi, content="a</think>b", finish="stop")
    row, = reconstruct_record(rec, kimi, policy=Policy(severities={"think_marker_in_content": "warning"}))
    assert row["status"] == "flagged"
    row, = reconstruct_record(rec, kimi, policy=Policy(severities={"think_marker_in_content": "off"}))
    assert row["status"] == "ok"


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r.pop("id"), "id"),
        (lambda r: r.pop("request"), "request"),
        (lambda r: r["request"].pop("messages"), "request.messages"),
        (lambda r: r["request"]["messages"][1].pop("role"), "request.messages[1].role"),
        (lambda r: r.pop("response"), "response"),
        (lambda r: r["response"].pop("choices"), "response.choices"),
        (lambda r: r["response"]["choices"][0].pop("message"), "response.choices[0].message"),
        (lambda r: r["response"]["choices"][0]["message"].update(reasoning=5), "response.choices[0].message.reasoning"),
        (lambda r: r.update(native_ids=["x"]), "native_ids"),
    ],
)
def test_malformed_records_name_the_field(kimi, mutate, field):
    rec = make(kimi)
    mutate(rec)
    with pytest.raises(RecordError) as err:
        reconstruct_record(rec, kimi)
    assert err.value.field == field


MARKER_SNIPPETS = ["<|im_end|>", "</think>", "<think>", TS, CB, "[EOS]", "<|im_user|>", "\ufffd"]
free_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
model_text = st.lists(st.one_of(free_text, st.sampled_from(MARKER_SNIPPETS)), max_size=4).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reasoning=model_text, content=model_text)
def test_property_no_findings_means_exact_roundtrip(kimi, reasoning, content):
    rec = make(kimi, reasoning=reasoning, content=content, finish="stop", usage=False)
    row, = reconstruct_record(rec, kimi, policy=Policy(severities={"usage_missing": "off"}))
    has_marker = any(m in reasoning + content for m in MARKER_SNIPPETS)
    if row["status"] != "ok":
        assert row["findings"]
        return
    assert not has_marker, "marker text passed the gate"
    ids = row["completion_ids"]
    assert kimi.decode_bytes(ids) == (reasoning + "</think>" + content + "<|im_end|>").encode()
    assert [i for i in ids if i >= 163584] == [163607, 163586]
    assert ids.index(163607) == len(kimi.encode(reasoning))
    assert row["input_ids"] == row["prompt_ids"] + ids
    assert sum(row["loss_mask"]) == len(ids) and len(row["loss_mask"]) == len(row["input_ids"])
    json.dumps(row)  # serialisable as it stands


def _lossy(kimi):
    """A stray continuation byte the ground-truth ids hold, served as U+FFFD."""
    stray = next(i for i in range(kimi.vocab_size) if kimi.decode_bytes([i]) == b"\x84")
    rec = make(kimi, content="ab \ufffd cd", finish="stop")
    rec["native_ids"] = (kimi.encode("Check the weather tool.") + [163607] + kimi.encode("ab ") + [stray]
                         + kimi.encode(" cd") + [163586])
    rec["response"]["usage"]["completion_tokens"] = len(rec["native_ids"])
    return rec


def _trigger(kimi, code):  # noqa: PLR0911, PLR0912 - one record per finding code
    """A record that must raise ``code`` (and nothing a clean sample raises)."""
    if code in {c for _, expected in CASES.values() for c in expected}:
        kwargs = next(kw for kw, expected in CASES.values() if code in expected)
        return make(kimi, **kwargs)
    if code == "structured_tool_calls":
        return make(kimi, content="", tool_calls=[{"id": "functions.f:0", "type": "function",
                                                   "function": {"name": "f", "arguments": "{}"}}])
    if code == "reasoning_unexpected":
        return make(kimi, reasoning="r", content="ok", finish="stop",
                    request={"messages": PROMPT, "reasoning": {"effort": "none"}})
    if code == "stop_sequence":
        return make(kimi, content="ok", finish="stop", request={"messages": PROMPT, "stop": "END"})
    if code == "boundary_unproven":
        return make(kimi, reasoning="thinking...", content=None, finish="stop", usage=False)
    if code == "tools_declared":  # an unresolvable $ref: K2.5 falls back to a JSON declaration
        return make(kimi, content="ok", finish="stop", request={"messages": PROMPT, "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}}}}]})
    if code == "template_kwarg_unknown":
        return make(kimi, content="ok", finish="stop",
                    request={"messages": PROMPT, "chat_template_kwargs": {"reasoning_effort": "high"}})
    if code in ("media_in_prompt", "media_counted"):
        image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
        rec = make(kimi, content="A cat.", finish="stop", request={"messages": [{"role": "user", "content": image}]})
        if code == "media_in_prompt":  # the serving side counted the image's real token expansion
            rec["response"]["usage"]["prompt_tokens"] += 143
        return rec
    if code == "tool_calls_missing":
        return make(kimi, content="I will call the tool.", finish="tool_calls")
    if code == "text_lossy":
        return _lossy(kimi)
    if code == "reasoning_redacted":  # OpenAI-style: a summary stands where the reasoning was
        return make(kimi, content="ok", finish="stop",
                    reasoning_details=[{"type": "reasoning.summary", "summary": "Check the weather tool."}])
    if code in ("logprobs_mismatch", "logprobs_unreadable"):
        rec = make(kimi, content="Plain answer.", finish="stop")
        if code == "logprobs_mismatch":
            ids = kimi.encode("Check the weather tool.</think>Plain answer!<|im_end|>")
            entries = [{"token": f"token_id:{i}", "logprob": -0.1} for i in ids]
        else:
            entries = [{"token": 7, "bytes": None, "logprob": -0.1}]
        rec["response"]["choices"][0]["logprobs"] = {"content": entries}
        return rec
    if code == "end_token_mismatch":  # a stop id the user asked for, e.g. stop_token_ids=[13]
        rec = make(kimi, content="Plain answer.", finish="stop")
        rec["response"]["choices"][0]["matched_stop"] = 13
        return rec
    if code == "evidence_malformed":  # a value no engine writes: set aside, and said
        rec = make(kimi, content="Plain answer.", finish="stop")
        rec["response"]["choices"][0]["native_finish_reason"] = 5
        return rec
    if code == "usage_reasoning_mismatch":
        rec = make(kimi, content="Plain answer.", finish="stop")
        rec["response"]["usage"]["completion_tokens_details"] = {"reasoning_tokens": 2}
        return rec
    if code == "held_tail_unproven":  # streamed with tools, an answer ending in a space: " <|" held back ties it
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        return make(kimi, content="It starts like this: ", finish="stop",
                    request={"messages": PROMPT, "tools": [tool], "stream": True})
    if code == "tool_text_unproven":  # streamed with tools: kimi_k2's detector deletes stray end markers unseen
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        return make(kimi, content="Plain answer.", finish="stop",
                    request={"messages": PROMPT, "tools": [tool], "stream": True})
    if code == "reconstruction_ambiguous":  # a tool section right after the reasoning, and no usage
        return make(kimi, content=TOOL_CALL, usage=False)
    if code in _TRAIT_TRIGGERS:
        return make(kimi, content="Plain answer.", finish="stop")
    if code == "reasoning_conflict":
        return make(kimi, content="ok", finish="stop", reasoning_content="something else")
    rec = make(kimi, content="Hello", finish="stop")
    if code == "choices_unattributable":
        second = copy.deepcopy(rec["response"]["choices"][0])
        second["index"] = 1
        second["message"]["content"] = "Hi</think>"
        rec["response"]["choices"].append(second)
        rec["response"]["usage"]["completion_tokens"] += _count(kimi, "Check the weather tool.", "Hi</think>")
    elif code == "usage_prompt_mismatch":
        rec["response"]["usage"]["prompt_tokens"] += 3
    elif code == "usage_completion_mismatch":
        rec["response"]["usage"]["completion_tokens"] += 3
    elif code == "roundtrip_mismatch":
        rec["response"]["choices"][0]["message"]["content"] = "x\udfff"
        rec["response"].pop("usage")
    elif code == "native_mismatch":
        rec["native_ids"] = [1, 2, 3]
    else:
        raise AssertionError(f"no trigger written for {code}")
    return rec


#: Codes that come from what a whole run (or a probe) showed about the provider.
_TRAIT_TRIGGERS = {
    "provider_strips_whitespace": {"Test": ProviderTrait("Test", edits=("strip",), edit_sources=("run",))},
    "provider_edits_text": {"Test": ProviderTrait("Test", edits=("nfkc",), edit_sources=("probe",))},
}
#: Codes only a non-Kimi tokenizer can raise; tests/test_families_*.py trigger them (common, deepseek_v32, gptoss).
_FAMILY_ONLY = {"completion_unproven", "tool_markers_dropped", "harmony_message_lost", "prompt_date_unproven",
               "prompt_reading_unproven"}


@pytest.mark.parametrize("code", sorted(set(CODES) - _FAMILY_ONLY))
def test_every_code_is_triggered_and_absent_on_clean_samples(kimi, code):
    row = reconstruct_record(_trigger(kimi, code), kimi, traits=_TRAIT_TRIGGERS.get(code))[0]
    assert code in codes(row)
    for clean in (make(kimi), make(kimi, content="Plain answer.", finish="stop"),
                  make(kimi, reasoning=None, content="ok", finish="stop", request={"messages": PROMPT, "reasoning": {"enabled": False}})):
        assert code not in codes(reconstruct_record(clean, kimi)[0])


def test_marker_text_inside_a_long_run_is_still_caught(kimi):
    # A run cut at 25,000 characters must never split marker text into ordinary tokens.
    for content, code in (("Q" * 24995 + "</think>tail", "think_marker_in_content"),
                          ("Q" * 24993 + "<|im_end|>Z", "eos_in_text"),
                          ("Q" * 24996 + "<|tool_call_begin|>x", "tool_markers_malformed")):
        row, = reconstruct_record(make(kimi, content=content, finish="stop"), kimi)
        assert code in codes(row), content[-20:]


@pytest.mark.parametrize("where", ["content", "reasoning"])
def test_a_completion_run_past_the_cut_is_encoded_whole_as_the_model_wrote_it(kimi_dir, kimi, where):
    """Kimi's tokenizer cuts runs past 25,000 characters before encoding, and the prompt is
    encoded that way (the server tokenizes it). A completion is sampled: the model never
    cut it. Minified JSON past the cut: the cut moved a token boundary at the same count,
    so the count could not catch it. Ids from tiktoken on the folder's own files, whole."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from tokenbridge.tokenizer import KIMI_PAT_STR

    raw = tiktoken.Encoding("raw", pat_str=KIMI_PAT_STR, special_tokens={},
                            mergeable_ranks=load_tiktoken_bpe(str(kimi_dir / "tiktoken.model")))
    rows = json.dumps([{"id": i, "ok": True, "v": "x" * (i % 7)} for i in range(1200)], separators=(",", ":"))
    # shift the run until the cut at character 25,000 falls inside a token the model would write
    blob = next(b for k in range(1, 12) if kimi.encode(b := '{"k":"' + "z" * k + '","rows":' + rows + "}")
                != raw.encode_ordinary(b))
    assert " " not in blob and len(blob) > 25_000
    text = {"reasoning": "Fine.", "content": "Done."} | {where: blob}
    rec = make(kimi, reasoning=text["reasoning"], content=text["content"], finish="stop")
    truth = [*raw.encode_ordinary(text["reasoning"]), kimi.token_id("</think>"), *raw.encode_ordinary(text["content"]),
             kimi.token_id("<|im_end|>")]
    rec["response"]["usage"]["completion_tokens"] = len(truth)
    row, = reconstruct_record(rec, kimi)
    assert row["completion_ids"] == truth and row["status"] == "ok", row["findings"]


def test_prompt_run_before_a_marker_is_encoded_as_the_serving_side_does(kimi):
    run = "Q" * 24990  # shorter than the 25,000 cut on its own, longer together with <|im_end|>
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": run}]
    row, = reconstruct_record(make(kimi, request={"messages": msgs}, content="ok", finish="stop"), kimi)
    expected = (kimi.encode("<|im_system|>system<|im_middle|>s<|im_end|><|im_user|>user<|im_middle|>")
                + kimi.encode(run) + kimi.encode("<|im_end|><|im_assistant|>assistant<|im_middle|><think>"))
    assert row["prompt_ids"] == expected


@pytest.mark.parametrize("value", [999.0, "999", None, True, "missing"])
def test_partial_or_non_integer_usage_is_reported(kimi, value):
    rec = make(kimi, content="ok", finish="stop")
    if value == "missing":
        rec["response"]["usage"].pop("completion_tokens")
    else:
        rec["response"]["usage"]["completion_tokens"] = value
    row, = reconstruct_record(rec, kimi)
    assert codes(row) == ["usage_missing"] and "completion_tokens" in row["findings"][0]["message"]


def test_sibling_choice_with_findings_blocks_ok(kimi):
    rec = make(kimi, content="A", finish="stop")
    bad = copy.deepcopy(rec["response"]["choices"][0])
    bad["index"] = 1
    bad["message"]["content"] = ""
    bad["message"]["tool_calls"] = [{"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    rec["response"]["choices"].append(bad)
    # make the summed usage agree, so only the sibling rule can reject choice 0
    rec["response"]["usage"]["completion_tokens"] = sum(len(r["completion_ids"]) for r in reconstruct_record(rec, kimi))
    rows = reconstruct_record(rec, kimi)
    assert "structured_tool_calls" in codes(rows[1])
    assert codes(rows[0]) == ["choices_unattributable"] and rows[0]["status"] == "rejected"


def test_response_content_as_list_of_parts(kimi):
    rec = make(kimi, content="Hello there", finish="stop")
    rec["response"]["choices"][0]["message"]["content"] = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]
    row, = reconstruct_record(rec, kimi)
    assert row["status"] == "ok" and kimi.decode(row["completion_ids"]).endswith("</think>Hello there<|im_end|>")


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r["request"]["messages"].insert(1, {"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}),
         "request.messages[1].tool_calls[0].function"),
        (lambda r: r["request"]["messages"].insert(1, {"role": "assistant", "content": "", "tool_calls": [{"id": "x", "function": {"name": "f"}}]}),
         "request.messages[1].tool_calls[0].function.arguments"),
        (lambda r: r["request"]["messages"][1].update(content=["hello"]), "request.messages[1].content[0]"),
        (lambda r: r["request"].update(chat_template_kwargs="x"), "request.chat_template_kwargs"),
        (lambda r: r["response"]["choices"][0]["message"].update(tool_calls=5), "response.choices[0].message.tool_calls"),
    ],
)
def test_odd_shapes_are_named_errors_not_crashes(kimi, mutate, field):
    rec = make(kimi)
    mutate(rec)
    with pytest.raises(RecordError) as err:
        reconstruct_record(rec, kimi)
    assert err.value.field == field


def test_history_tool_call_without_id_renders_like_the_template(kimi):
    msgs = PROMPT + [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "content": "42"}]
    row, = reconstruct_record(make(kimi, request={"messages": msgs}, content="ok", finish="stop"), kimi)
    assert "<|tool_call_begin|><|tool_call_argument_begin|>{}" in kimi.decode(row["prompt_ids"])


def test_roundtrip_is_decoded_for_a_normalising_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from tokenbridge.tokenizer import load_tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world answer"] * 20, trainer)
    (tmp_path / "t").mkdir()
    tok.save(str(tmp_path / "t" / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path / "t")
    assert not loaded.lossless
    rec = {"id": 1, "request": {"messages": [{"role": "user", "content": "hi"}]},
           "response": {"choices": [{"message": {"reasoning": "think", "content": "Hello"}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, loaded)
    assert "roundtrip_mismatch" in codes(row)  # the normaliser lowercased "Hello"


@pytest.mark.parametrize("indexes, why", [
    ([0, 0], "0 is also the index of choices[0]"),
    ([None, 0], "0 is also the index of choices[0]"),
    ([1, 2**31], "1 is also the index of choices[0]"),  # 2**31 is no index: its place, 1
])
def test_a_repeated_choice_index_is_a_bad_line(kimi, tmp_path, indexes, why):
    """A row is named by (id, choice): two choices one index made a file export refused
    later (JSONL). A bad line naming the field, in both outputs."""
    rec = make(kimi, content="ok", finish="stop")
    choice = rec["response"]["choices"][0]
    rec["response"]["choices"] = [{**copy.deepcopy(choice), "index": i} for i in indexes]
    for name in ("out.jsonl", "out.parquet"):
        src = tmp_path / "ex.jsonl"
        src.write_text(json.dumps(rec) + "\n" + json.dumps({**make(kimi, content="ok", finish="stop"), "id": "s2"}) + "\n")
        summary = reconstruct_file(src, tmp_path / name, kimi, workers=1)
        assert [(b.line, b.field, b.message) for b in summary.bad_lines] == [(1, "response.choices[1].index", why)]
        assert summary.rows == 1


@pytest.mark.parametrize("index", [2**31, 2**63, -1, "0", 1.0])
def test_a_choice_index_that_is_no_count_is_its_place_in_every_output(kimi, tmp_path, index):
    """Parquet holds the choice as int32: an index past it crashed the writer (exit 8)."""
    rec = make(kimi, content="ok", finish="stop")
    rec["response"]["choices"][0]["index"] = index
    src = tmp_path / "ex.jsonl"
    src.write_text(json.dumps(rec) + "\n")
    for name in ("out.jsonl", "out.parquet"):
        summary = reconstruct_file(src, tmp_path / name, kimi, workers=1)
        assert summary.bad_lines == [] and summary.rows == 1
    assert json.loads((tmp_path / "out.jsonl").read_text())["choice"] == 0


def test_list_content_is_read_as_its_text_by_the_gate_and_the_row(kimi, tmp_path):
    """``content`` as a list of text parts: the row holds the text (a string, as every
    reader and Parquet expect) and the gate reads that text (a U+FFFD in it is found)."""
    rec = make(kimi, content="Sure \ufffd", finish="stop")
    rec["response"]["choices"][0]["message"]["content"] = [{"type": "text", "text": "Sure \ufffd"}]
    row, = reconstruct_record(rec, kimi)
    assert row["content"] == "Sure \ufffd" and "replacement_char" in codes(row)
    src = tmp_path / "ex.jsonl"
    src.write_text(json.dumps(rec) + "\n")
    summary = reconstruct_file(src, tmp_path / "out.parquet", kimi, workers=1)
    assert summary.rows == 1 and summary.bad_lines == []


def test_a_finding_quoting_a_lone_surrogate_writes_its_escape_in_every_output(kimi, tmp_path):
    """A request part whose ``type`` holds a lone surrogate (valid JSON, not text) is named
    in the media finding: the Parquet writer died on it (exit 8)."""
    import pyarrow.parquet as pq

    rec = make(kimi, content="ok", finish="stop")
    rec["request"]["messages"] = [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "\ud800", "image_url": {"url": "x"}}]}]
    src = tmp_path / "ex.jsonl"
    src.write_text(json.dumps(rec) + "\n", encoding="utf-8")  # ensure_ascii: "\ud800" as an escape
    for name in ("out.jsonl", "out.parquet"):
        summary = reconstruct_file(src, tmp_path / name, kimi, workers=1)
        assert summary.bad_lines == [] and summary.rows == 1
    row, = pq.read_table(tmp_path / "out.parquet").to_pylist()
    media = [f for f in row["findings"] if "\\ud800" in f["message"]]
    assert media and media[0]["code"].startswith("media")


def test_ground_truth_ids_prove_the_boundary_of_an_empty_content(kimi):
    """Content empty, no usage: the boundary (was there a ``</think>``?) is unproven by the
    text, but ids that cover the completion prove it as an exact count does; it was still
    ``boundary_unproven``, an error, with the ids the record itself carried."""
    native = [*kimi.encode("thinking..."), kimi.token_id("</think>"), kimi.token_id("<|im_end|>")]
    rec = make(kimi, reasoning="thinking...", content=None, finish="stop", usage=False)
    row, = reconstruct_record(rec, kimi)
    assert "boundary_unproven" in codes(row)
    row, = reconstruct_record({**rec, "native_ids": native}, kimi)
    assert (codes(row), row["completion_ids"]) == (["usage_missing"], native)

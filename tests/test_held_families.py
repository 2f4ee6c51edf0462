"""Text SGLang 0.5.23's streaming parsers hold back at the end and never send, beyond Kimi
(tests/test_held_tool_start.py), and GLM's completion forms when the prompt proves the engine.

A cold tester, serving true ids through SGLang's own parsers: Qwen3's ``qwen25`` detector
(tools sent) holds what may begin ``</tool_call>``, gpt-oss's harmony parser (always) what may
begin a structural token; ``"Hello </"`` was served ``"Hello "``, ``"Sunny. <"`` ``"Sunny. "``,
at the same count, and passed ``ok``. And a GLM prompt only SGLang renders (proven by the count)
beside a completion read in vLLM's streamed form made up for a token SGLang's detector dropped.
"""

from __future__ import annotations

from typing import Any

import pytest

from test_families_sglang_requests import sglang_prompt
from test_families_support import TOOLS, family_tokenizer, register_sglang_namespace
from tokenbridge.chat import DIALECTS, resolve_dialect
from tokenbridge.hypotheses import held_tails
from tokenbridge.reconstruct import reconstruct_record


def _qwen_detector():
    register_sglang_namespace(pytest.skip)
    from sglang.srt.function_call.qwen25_detector import Qwen25Detector

    return Qwen25Detector()


def _codes(row: dict[str, Any]) -> list[str]:
    return [f["code"] for f in row["findings"]]


def _qwen_record(content_ids: list[int], *, logprobs: bool) -> tuple[dict[str, Any], list[int]]:
    """Qwen3, thinking off, tools sent, streamed: the content served through the real
    detector token by token, then its end of stream (it releases nothing)."""
    tok = family_tokenizer("qwen3")
    end = tok.token_id("<|im_end|>")
    native = [*content_ids, end]
    detector = _qwen_detector()
    served = "".join(detector.parse_streaming_increment(tok.decode_bytes([t]).decode("utf-8"), []).normal_text or ""
                     for t in content_ids)
    served += detector.finish([]).normal_text or ""
    request = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "stream": True,
               "chat_template_kwargs": {"enable_thinking": False}}
    prompt = len(tok.encode_prompt(sglang_prompt("qwen3", request)))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "matched_stop": end,
                              "message": {"role": "assistant", "content": served}}
    if logprobs:
        choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": -0.1, "bytes": None,
                                           "top_logprobs": []} for t in native]}
    return {"id": "q", "request": request, "response": {
        "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": len(native)}}}, native


def test_qwen3s_detector_holds_a_close_tag_beginning_and_the_row_says_so():
    tok = family_tokenizer("qwen3")
    content = tok.encode("Hello </")
    assert tok.decode_bytes(content[-1:]) == b" </"  # one token
    record, native = _qwen_record(content, logprobs=False)
    assert record["response"]["choices"][0]["message"]["content"] == "Hello "  # the premise, from the detector
    (row,) = reconstruct_record(record, tok)
    assert row["completion_ids"] != native  # the count cannot tell: it is said, not passed
    assert (row["status"], _codes(row)) == ("flagged", ["held_tail_unproven", "tool_text_unproven"])
    assert "tool_start_held=</" in row["findings"][0]["message"]
    record, native = _qwen_record(content, logprobs=True)
    (row,) = reconstruct_record(record, tok)
    assert (row["status"], row["completion_ids"], row["content"]) == ("ok", native, "Hello </")


def test_a_qwen3_answer_ending_as_served_is_flagged_only_where_a_tail_ties_it():
    tok = family_tokenizer("qwen3")
    for text, flagged in (("The answer is 4.", True), ("The answer is 4", False)):
        record, native = _qwen_record(tok.encode(text), logprobs=False)
        (row,) = reconstruct_record(record, tok)
        assert row["completion_ids"] == native
        held = ["held_tail_unproven"] if flagged else []
        assert (row["status"], _codes(row)) == ("flagged", [*held, "tool_text_unproven"])


def test_the_held_texts_are_what_each_parser_holds():
    """Each family's held texts against SGLang's own: qwen25 holds a suffix that begins
    ``</tool_call>`` from one character; the harmony parser's ``prefix_hold`` any that begins
    one of its guard tokens."""
    register_sglang_namespace(pytest.skip)
    from sglang.srt.parser.harmony_parser import CanonicalStrategy, prefix_hold

    qwen = held_tails(DIALECTS["qwen3"].stream_held_starts, DIALECTS["qwen3"].stream_held_min)
    assert set(qwen) == {"</tool_call>"[:n] for n in range(1, 12)}
    for tail in qwen:  # streamed as two deltas: what reaches the client, then what it holds
        detector = _qwen_detector()
        sent = [detector.parse_streaming_increment(delta, []).normal_text or "" for delta in ("Hi", tail)]
        assert "".join(sent) + (detector.finish([]).normal_text or "") == "Hi"
    guard = CanonicalStrategy().guard_tokens
    oss = held_tails(DIALECTS["gpt-oss"].stream_held_starts, DIALECTS["gpt-oss"].stream_held_min)
    assert set(oss) == {g[:n] for g in guard for n in range(1, len(g))}
    assert all(prefix_hold("Sunny." + tail, guard) == ("Sunny.", tail) for tail in oss)
    assert DIALECTS["gpt-oss-harmony"].stream_held_starts == ()  # vLLM's stack


def test_a_glm_prompt_only_sglang_renders_keeps_the_completion_to_sglangs_forms():
    """The tester's record: SGLang's streamed GLM turn, its detector holding back a last
    ``" <"`` (one token) for a ``<tool_call>`` that never came. Read in vLLM's streamed form
    (the content's leading newline taken as the think prefix) the count fitted: ``ok``, wrong
    ids. The prompt's count proves SGLang's rendering (its tool dump), so only its forms count."""
    tok = family_tokenizer("glm-4.5")
    request = {"messages": [{"role": "user", "content": "Check the weather tool."}],
               "stream": True, "chat_template_kwargs": {"enable_thinking": True}, "tools": TOOLS}
    prompt = len(tok.encode_prompt(sglang_prompt("glm-4.5", request)))
    dialect = resolve_dialect(tok)
    assert prompt != len(tok.encode_prompt(dialect.render_request(request)))  # the engines differ
    truth = [*tok.encode("\n"), tok.token_id("<think>"), *tok.encode("Look."), tok.token_id("</think>"),
             *tok.encode("\n\nSee a <"), tok.token_id("<|user|>")]
    record = {"id": "g", "request": request, "response": {"choices": [{
        "index": 0, "finish_reason": "stop", "matched_stop": tok.token_id("<|user|>"),
        "message": {"role": "assistant", "reasoning_content": "\nLook.", "content": "\n\nSee a"}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": len(truth)}}}
    (row,) = reconstruct_record(record, tok, dialect)
    assert row["status"] != "ok" and "usage_completion_mismatch" in _codes(row)
    assert "think_prefix_in_content" not in (row["reconstruction"] or "")


def test_a_qwen3_call_the_detector_did_not_parse_is_not_read_from_the_count():
    """A cold tester's record: Qwen3 thinking, tools sent, streamed, cut inside a call written
    in its reasoning. SGLang's qwen3 reasoning parser ends the reasoning at ``<tool_call>``
    (no ``</think>``) and the ``qwen25`` detector, which cannot parse the call, deletes the
    ``</tool_call>`` text it passes on: the formula's ``</think>`` made up for it, and the row
    was flagged ``truncated`` (exact up to the cut, by that warning's word) with wrong ids."""
    import codecs

    from test_families_support import RawBytes, import_sglang_reasoning

    parser = import_sglang_reasoning()("qwen3", stream_reasoning=True, force_reasoning=True)
    detector = _qwen_detector()
    tok = family_tokenizer("qwen3")
    raw = RawBytes("qwen3")
    native = tok.encode("<think>\nPlan: <tool_call> then </tool_call> done")
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    reasoning, content = [], []
    for k, i in enumerate(native):
        r, normal = parser.parse_stream_chunk(decoder.decode(raw(i)))
        if k == len(native) - 1:
            r2, n2 = parser.parse_stream_end()
            r, normal = (r or "") + (r2 or ""), (normal or "") + (n2 or "")
        reasoning.append(r or "")
        content.append(detector.parse_streaming_increment(normal or "", []).normal_text or "")
    content.append(detector.finish([]).normal_text or "")
    served = {"reasoning_content": "".join(reasoning), "content": "".join(content)}
    assert served == {"reasoning_content": "\nPlan: ", "content": "<tool_call> then  done"}  # the premise
    request = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "stream": True,
               "chat_template_kwargs": {"enable_thinking": True}}
    prompt = len(tok.encode_prompt(sglang_prompt("qwen3", request)))
    for logprobs in (False, True):
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "message": {"role": "assistant", **served}}
        if logprobs:
            choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": -0.1, "bytes": None,
                                               "top_logprobs": []} for t in native]}
        record = {"id": "q", "request": request, "response": {
            "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": len(native)}}}
        (row,) = reconstruct_record(record, tok)
        assert row["status"] == "rejected" and row["completion_ids"] != native
        assert ("tool_markers_dropped" in _codes(row)) is not logprobs, row["findings"]  # logprobs say it themselves


def test_a_call_whose_end_marker_survived_was_not_through_the_detector():
    """``</tool_call>`` still in the content: no streaming detector deleted it (none ran over
    this text), so a call left in it is not ``tool_markers_dropped`` (a cold reviewer)."""
    tok = family_tokenizer("qwen3")
    native = tok.encode("<think>\nPlan.</think>\n\n<tool_call>\nnot json\n</tool_call><|im_end|>")
    request = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
               "chat_template_kwargs": {"enable_thinking": True}}
    prompt = len(tok.encode_prompt(sglang_prompt("qwen3", request)))
    record = {"id": "q", "request": request, "response": {"choices": [{
        "index": 0, "finish_reason": "stop", "matched_stop": native[-1],
        "message": {"role": "assistant", "reasoning_content": "\nPlan.",
                    "content": "\n\n<tool_call>\nnot json\n</tool_call>"}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": len(native)}}}
    (row,) = reconstruct_record(record, tok)
    assert "tool_markers_dropped" not in _codes(row)
    record["response"]["choices"][0]["message"]["content"] = "\n\n<tool_call>\nnot json\n"  # the end deleted
    (row,) = reconstruct_record(record, tok)
    assert "tool_markers_dropped" in _codes(row)

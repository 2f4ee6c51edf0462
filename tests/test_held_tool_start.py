"""Kimi K2.5 streamed with ``tools`` sent: text SGLang's tool parser holds back and never sends.

SGLang 0.5.23's ``kimi_k2`` detector (the real one, below) holds back the end of the content
while it may still become ``<|tool_calls_section_begin|>`` or ``<|tool_call_begin|>``, and its
``finish`` (the base class's) releases nothing. A turn whose content ends ``" <|"`` (one token)
is served ending ``" "`` (one token): the same count, other ids. Every such tail is a reading
(``tool_start_held=...``) where the request sent tools and may have streamed; ids or logprobs
pick them, and without those a tail that ties the served count is reported (a warning).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from test_families_support import family_tokenizer, import_sglang_reasoning, register_sglang_namespace
from tokenbridge.chat import DIALECTS
from tokenbridge.hypotheses import held_tails
from tokenbridge.reconstruct import reconstruct_file

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
BASE = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Show me how it starts."}]}


def _detector():
    register_sglang_namespace(pytest.skip)
    try:
        from sglang.srt.function_call.kimik2_detector import KimiK2Detector
    except ImportError as e:  # pragma: no cover - CI installs it
        pytest.skip(f"sglang's kimi_k2 detector does not import ({e})")
    return KimiK2Detector()


def _served(kimi, native: list[int], *, stream: bool) -> tuple[dict[str, Any], str]:
    """What SGLang 0.5.23 returns for ``native`` with tools sent: the stop token trimmed, the
    reasoning split by the real ``kimi_k2`` reasoning parser, and the content passed through
    the real ``kimi_k2`` tool detector (token by token, then ``finish``, when streamed)."""
    end, close = kimi.token_id("<|im_end|>"), kimi.token_id("</think>")
    body, finish = (native[:-1], "stop") if native[-1] == end else (native, "length")
    at = body.index(close)
    reasoning = kimi.decode_bytes(body[:at]).decode("utf-8")
    parser = import_sglang_reasoning()("kimi_k2", stream_reasoning=False, force_reasoning=True)
    assert parser.parse_non_stream(reasoning + "</think>") == (reasoning, "")
    detector = _detector()
    if stream:
        pieces = [detector.parse_streaming_increment(kimi.decode_bytes([t]).decode("utf-8"), []).normal_text
                  for t in body[at + 1:]]
        content = "".join(pieces) + detector.finish([]).normal_text
    else:
        content = detector.detect_and_parse(kimi.decode_bytes(body[at + 1:]).decode("utf-8"), []).normal_text
    return {"role": "assistant", "reasoning_content": reasoning, "content": content}, finish


def _record(kimi, i: int, native: list[int], *, stream: bool, tools: bool = True, logprobs: bool = False,
            stream_known: bool = True) -> dict[str, Any]:
    message, finish = _served(kimi, native, stream=stream)
    request: dict[str, Any] = {**BASE, **({"tools": TOOLS} if tools else {}), **({"stream": stream} if stream_known else {})}
    prompt = len(kimi.encode(DIALECTS["kimi-k2.5"].render_request(request)))
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if logprobs:
        choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": -0.1, "bytes": None,
                                           "top_logprobs": []} for t in native]}
    return {"id": f"r{i}", "request": request, "response": {
        "provider": "p", "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": len(native)}}}


def _native(kimi, content: str, reasoning: str = "The user wants the prefix.") -> list[int]:
    return [*kimi.encode(reasoning), kimi.token_id("</think>"), *kimi.encode(content), kimi.token_id("<|im_end|>")]


def _rows(tmp_path, kimi, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    reconstruct_file(src, dst, kimi, workers=1)
    return [json.loads(line) for line in dst.read_text(encoding="utf-8").splitlines()]


def _codes(row: dict[str, Any]) -> list[str]:
    return [f["code"] for f in row["findings"]]


def test_the_held_tails_are_every_beginning_of_the_two_start_markers():
    tails = held_tails(DIALECTS["kimi-k2.5"].stream_held_starts)
    assert tails[:3] == ("<|", "<|t", "<|to")
    assert "<|tool_calls_section_begin|" in tails and "<|tool_call_begin|" in tails
    assert "<|tool_calls_section_begin|>" not in tails and "<" not in tails
    assert len(tails) == len(set(tails)) == 26 + 7  # the two share "<|tool_call"'s 11 first characters


def test_sglang_drops_the_held_text_streamed_and_keeps_it_whole(kimi):
    """The premise, from the real detector: streamed, ``" <|"`` comes back as ``" "``."""
    native = _native(kimi, "It starts like this: <|")
    assert kimi.encode("It starts like this: <|")[-1] == kimi.encode(" <|")[0]  # one token, " <|"
    streamed, _ = _served(kimi, native, stream=True)
    whole, _ = _served(kimi, native, stream=False)
    assert streamed["content"] == "It starts like this: "
    assert whole["content"] == "It starts like this: <|"
    assert len(kimi.encode(streamed["content"])) == len(kimi.encode(whole["content"]))  # the count cannot tell


@pytest.mark.parametrize("stream_known", [True, False])
def test_a_tail_that_ties_the_count_is_flagged_where_the_record_streamed(tmp_path, kimi, stream_known):
    """Before: ``ok`` with ``" "`` (220) where the model wrote ``" <|"``. The count cannot tell,
    and a held tail is far rarer than a content that ends as served, so the row is flagged (a
    warning: out of the exports unless --include-flagged), not rejected. A record that does
    not say it streamed (``generate`` always says) is read as served."""
    native = _native(kimi, "It starts like this: <|")
    [row] = _rows(tmp_path, kimi, [_record(kimi, 0, native, stream=True, stream_known=stream_known)])
    if not stream_known:
        assert (row["status"], row["findings"]) == ("ok", [])
        return
    assert row["status"] == "flagged"
    assert _codes(row) == ["held_tail_unproven", "tool_text_unproven"]  # the detector's deletions: said too
    assert "tool_start_held=<|" in row["findings"][0]["message"]


@pytest.mark.parametrize("content", ["It starts like this: <|", "Call <|tool", "Use <|tool_calls_section_begin|",
                                     "x <|tool_call_begin|", "<|to", "Done."])
def test_logprobs_pick_the_held_reading_exactly(tmp_path, kimi, content):
    native = _native(kimi, content)
    [row] = _rows(tmp_path, kimi, [_record(kimi, 0, native, stream=True, logprobs=True)])
    assert row["status"] == "ok", row["findings"]
    assert row["completion_ids"] == native
    assert row["content"] == content  # the model's text, as a conversation re-renders it


def test_a_tail_that_adds_tokens_is_not_read_from_the_count_alone(tmp_path, kimi):
    """``"Call <|tool"`` served as ``"Call "``: usage is two tokens over the served reading. A
    held reading fits that count, but so might any unexplained offset: it stays a mismatch."""
    native = _native(kimi, "Call <|tool")
    [row] = _rows(tmp_path, kimi, [_record(kimi, 0, native, stream=True)])
    assert row["status"] == "rejected"
    assert "usage_completion_mismatch" in _codes(row)
    assert "reconstruction_ambiguous" not in _codes(row)


@pytest.mark.parametrize(("stream", "tools"), [(False, True), (True, False)])
def test_no_held_reading_where_no_tool_parser_streamed(tmp_path, kimi, stream, tools):
    """Whole responses, and requests without tools, keep the served text: a content that ends
    in a space is proven by its count as before."""
    native = _native(kimi, "It starts like this: ")
    rec = _record(kimi, 0, native, stream=stream, tools=tools)
    assert rec["response"]["choices"][0]["message"]["content"] == "It starts like this: "
    [row] = _rows(tmp_path, kimi, [rec])
    assert row["status"] == "ok", row["findings"]
    assert row["completion_ids"] == native


def test_a_streamed_content_ending_in_a_space_without_a_held_text_is_the_tie_too(tmp_path, kimi):
    """The model really wrote ``"...: "``: served the same as above, so it is the same tie,
    and logprobs settle it the other way."""
    native = _native(kimi, "It starts like this: ")
    [row] = _rows(tmp_path, kimi, [_record(kimi, 0, native, stream=True)])
    assert row["status"] == "flagged" and _codes(row) == ["held_tail_unproven", "tool_text_unproven"]
    [row] = _rows(tmp_path, kimi, [_record(kimi, 0, native, stream=True, logprobs=True)])
    assert row["status"] == "ok" and row["completion_ids"] == native


@pytest.mark.parametrize("text", ["", "a", "It starts like this: ", "two  spaces  ", "x y z", "字 字 ", "a\n b",
                                  "end.\n\n", "long " * 400 + "tail",
                                  # marker text: cut after the last marker, never where a suffix completes one
                                  "a <|im_end|> b c " * 30 + "tail <|", "x <|end|> and more words here ok " * 3,
                                  "<|im_end|>", "y <|im_end|>", "words <|end|> w <|", "q <|im_end|>" + " z" * 40])
def test_encode_appended_is_encode_of_the_whole(kimi, text):
    tails = [*held_tails(DIALECTS["kimi-k2.5"].stream_held_starts), " ", "\n", "x", "字", "end|>", "im_end|>", "|>"]
    for tok in (kimi, family_tokenizer("gpt-oss"), family_tokenizer("qwen3")):
        ids, _ = tok.encode_checked(text)
        got, want = tok.encode_appended(text, ids, tails), [tok.encode_checked(text + s) for s in tails]
        assert [g[0] for g in got] == [w[0] for w in want]
        assert all(w[1] or not g[1] for g, w in zip(got, want))  # never marker-free where the text is not


def _logprobs(native: list[int]) -> dict[str, Any]:
    return {"content": [{"token": f"token_id:{t}", "logprob": -0.1, "bytes": None, "top_logprobs": []} for t in native]}


def test_held_readings_the_evidence_did_not_pick_still_teach_the_count_traits(tmp_path, kimi):
    """A provider that leaves its end token uncounted, streamed with tools, logprobs on: the
    33 held readings (kept, since logprobs can tell) stopped every choice from teaching the
    trait, and all 30 rows were rejected (a cold review)."""
    records = []
    for i in range(30):
        native = _native(kimi, f"Answer number {i}.")
        rec = _record(kimi, i, native, stream=True, logprobs=True)
        rec["response"]["usage"]["completion_tokens"] = len(native) - 1
        records.append(rec)
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    summary = reconstruct_file(src, dst, kimi, workers=1)
    assert summary.status == {"ok": 30}
    assert summary.traits["p"].end_uncounted


def test_an_end_token_named_by_matched_stop_does_not_let_the_count_pick_a_held_tail(tmp_path, kimi):
    """``matched_stop`` naming ``[EOS]`` made ``end=[EOS]`` copies of the held readings that
    escaped the tie filter: a +1 offset passed as a held ``<|`` (a cold review)."""
    native = _native(kimi, "Done.")
    rec = _record(kimi, 0, native, stream=True)
    choice = rec["response"]["choices"][0]
    choice["matched_stop"] = kimi.token_id("[EOS]")
    rec["response"]["usage"]["completion_tokens"] = len(native) + 1
    [row] = _rows(tmp_path, kimi, [rec])
    assert row["status"] == "rejected" and "usage_completion_mismatch" in _codes(row)
    assert row["content"] == "Done."


def test_n_choices_with_many_readings_are_still_proven_by_their_summed_count(tmp_path, kimi):
    """Three choices ended by ``[EOS]``, streamed with tools: held tails and their ``end=[EOS]``
    copies made 67 readings a choice, over the bound on combinations, and every choice was
    ambiguous (a cold review). Only ties are kept without logprobs, and readings alike in
    count are one option of the product: the sum proves all three (as exact as the count
    goes: the detector's unseen deletions are said, ``tool_text_unproven``)."""
    native = [*kimi.encode("R."), kimi.token_id("</think>"), *kimi.encode("Done."), kimi.token_id("[EOS]")]
    rec = _record(kimi, 0, native, stream=True)
    first = rec["response"]["choices"][0]
    first["matched_stop"] = kimi.token_id("[EOS]")
    first["message"] = {"role": "assistant", "reasoning_content": "R.", "content": "Done."}
    first["finish_reason"] = "stop"
    rec["response"]["choices"] = [{**first, "index": k} for k in range(3)]
    rec["response"]["usage"]["completion_tokens"] = 3 * len(native)
    rows = _rows(tmp_path, kimi, [rec])
    assert [(r["status"], _codes(r), r["reconstruction"]) for r in rows] == [
        ("flagged", ["tool_text_unproven"], "end=[EOS]")] * 3
    assert all(r["completion_ids"] == native for r in rows)


def test_a_stray_end_marker_the_detector_deletes_is_said_not_passed(tmp_path, kimi):
    """A cold tester's row: the model wrote a stray ``<|tool_calls_section_end|>`` between two
    words; streamed with tools, the real detector deletes it, and ``"Helloworld"`` takes one
    token more than ``"Hello"`` and ``"world"``: the same count, ``ok`` with wrong ids. Nothing in
    the text shows it, so every such row says it (``tool_text_unproven``); logprobs decide."""
    native = [*kimi.encode("Need the weather."), kimi.token_id("</think>"), *kimi.encode("Sure. Hello"),
              kimi.token_id("<|tool_calls_section_end|>"), *kimi.encode("world."), kimi.token_id("<|im_end|>")]
    message, _ = _served(kimi, native, stream=True)
    assert message["content"] == "Sure. Helloworld."  # the premise, from the real detector
    [row] = _rows(tmp_path, kimi, [_record(kimi, 0, native, stream=True)])
    assert len(row["completion_ids"]) == len(native) and row["completion_ids"] != native  # the count cannot tell
    assert (row["status"], _codes(row)) == ("flagged", ["tool_text_unproven"])
    [row] = _rows(tmp_path, kimi, [_record(kimi, 0, native, stream=True, logprobs=True)])
    assert row["status"] == "rejected" and "logprobs_mismatch" in _codes(row)
    [row] = _rows(tmp_path, kimi, [_record(kimi, 0, native, stream=False)])  # whole: the marker stays in the text
    assert row["status"] == "rejected"

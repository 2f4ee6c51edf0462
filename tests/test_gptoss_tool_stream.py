"""gpt-oss streamed with ``tools`` sent, through SGLang 0.5.23's own parsers.

SGLang's gpt-oss tool detector runs the final text through a harmony parser of its own,
which keeps everything until a channel word (``analysis``, ``commentary``) shows after a
space, while the detector passes each delta on. When the word comes, that parser sends its
whole buffer: ``"# Analysis"`` is served ``"## Analysis"``, the same count, and passed
``ok`` with wrong ids (a cold tester's finding). It also holds back ends, drops text after a
later header word and strips whitespace after a leading one, in combinations that keep the
count (a second cold tester found six). So without ids or logprobs a served text with a
channel word is ``harmony_message_lost``; with them, each resent start is a reading
(``prefix_resent=J``, with its held-back ends) and the evidence picks.

The oracle is SGLang's code (``ReasoningParser("gpt-oss")`` then ``GptOssDetector``, as its
``serving_chat`` calls them per token delta, and the detector's end of stream), never ours.
"""

from __future__ import annotations

import codecs
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_families_support import TOOLS, RawBytes, family_tokenizer, import_sglang_reasoning, register_sglang_namespace
from tokenbridge.chat import resolve_dialect
from tokenbridge.chat.harmony import resent_prefixes
from tokenbridge.reconstruct import reconstruct_record

NOON = 1735732800  # 2025-01-01 12:00 UTC
PROMPT = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Check the weather tool."}]
HEAD = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def tok():
    return family_tokenizer("gpt-oss")


@pytest.fixture(scope="module")
def sglang() -> tuple[Any, Any, list[Any], RawBytes]:
    """SGLang's reasoning parser class, its gpt-oss tool detector class, the tools as
    its protocol holds them, and each id's bytes."""
    parser = import_sglang_reasoning()
    register_sglang_namespace(pytest.skip)
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.gpt_oss_detector import GptOssDetector

    return parser, GptOssDetector, [Tool(**t) for t in TOOLS], RawBytes("gpt-oss")


def _serve(tok, sglang, ids: list[int], *, cut: bool = False) -> tuple[str, str]:
    """(reasoning, content) SGLang streams for completion ids ending in the trimmed
    ``<|return|>`` (or ``cut`` short, all sent): special tokens kept, one text delta per
    token through the reasoning parser, its normal text through the tool detector; the last
    step also ends both."""
    parser_cls, detector_cls, tools, raw = sglang
    parser = parser_cls("gpt-oss", stream_reasoning=True, force_reasoning=True)
    detector = detector_cls()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    body = ids if cut else ids[:-1]
    reasoning, content = [], []
    for k, i in enumerate(body):
        r, normal = parser.parse_stream_chunk(decoder.decode(raw(i)))
        last = k == len(body) - 1
        if last:
            r2, n2 = parser.parse_stream_end()
            r, normal = (r or "") + (r2 or ""), (normal or "") + (n2 or "")
        reasoning.append(r or "")
        out = detector.parse_streaming_increment(normal or "", tools).normal_text or ""
        if last:
            out += detector.finish(tools).normal_text or ""
        content.append(out)
    return "".join(reasoning), "".join(content)


def _row(tok, ids: list[int], reasoning: str, content: str, *, logprobs: bool, stream: bool | None = True,
         tools: bool = True, dialect: str | None = None, cut: bool = False,
         logged: dict[str, Any] | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"model": "gpt-oss", "messages": PROMPT}
    if stream is not None:
        request["stream"] = stream
    if tools:
        request["tools"] = TOOLS
    dialect = resolve_dialect(tok, dialect)
    prompt = len(tok.encode_prompt(dialect.prompt_readings(request, {"created": NOON}, {})[0].text))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if cut else "stop",
                              "message": {"role": "assistant", "reasoning_content": reasoning, "content": content}}
    if not cut:
        choice["matched_stop"] = ids[-1]
    if logprobs:
        choice["logprobs"] = logged or {"content": [{"token": f"token_id:{t}", "logprob": -0.1, "bytes": None,
                                                     "top_logprobs": []} for t in ids]}
    record = {"id": "g", "request": request, "response": {
        "created": NOON, "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": len(ids)}}}
    (row,) = reconstruct_record(record, tok, dialect)
    return row


def _codes(row: dict[str, Any]) -> list[str]:
    return [f["code"] for f in row["findings"]]


def test_the_resent_start_is_what_sglang_serves_and_the_evidence_reads_it(tok, sglang):
    ids = tok.encode(HEAD + "# Analysis\nGrowth is 5%.<|return|>")
    reasoning, content = _serve(tok, sglang, ids)
    assert (reasoning, content) == ("Think.", "## Analysis\nGrowth is 5%.")  # the premise, from SGLang
    assert len(tok.encode("##")) == len(tok.encode("#")) == 1  # so the count cannot tell
    row = _row(tok, ids, reasoning, content, logprobs=False)
    assert (row["status"], _codes(row)) == ("rejected", ["harmony_message_lost"])
    assert "channel word" in row["findings"][0]["message"]
    row = _row(tok, ids, reasoning, content, logprobs=True)
    assert (row["status"], row["completion_ids"], row["content"]) == ("ok", ids, "# Analysis\nGrowth is 5%.")
    assert row["reconstruction"].endswith("+prefix_resent=1")


def test_the_count_alone_never_reads_what_the_detector_changed(tok, sglang):
    """Even where only the resent reading fits the count, the count does not pick it: the
    detector's other changes can fit it too."""
    ids = tok.encode(HEAD + "1. Analysis<|return|>")
    reasoning, content = _serve(tok, sglang, ids)
    assert content == "1.1. Analysis"
    row = _row(tok, ids, reasoning, content, logprobs=False)
    assert (row["status"], _codes(row)) == ("rejected", ["usage_completion_mismatch", "harmony_message_lost"])
    row = _row(tok, ids, reasoning, content, logprobs=True)
    assert (row["status"], row["completion_ids"], _codes(row)) == ("ok", ids, [])


def test_a_text_served_as_written_is_not_read_as_resent(tok):
    """Whole, without tools, or by vLLM's stack: nothing was resent, whatever the text."""
    ids = tok.encode(HEAD + "## Analysis\nGrowth is 5%.<|return|>")
    for kwargs in ({"stream": False}, {"tools": False}, {"dialect": "gpt-oss-harmony"}):
        row = _row(tok, ids, "Think.", "## Analysis\nGrowth is 5%.", logprobs=False, **kwargs)
        assert (row["status"], row["completion_ids"]) == ("ok", ids), kwargs
        assert "prefix_resent" not in (row["reconstruction"] or "")


def test_logprobs_pick_among_the_resent_starts(tok, sglang):
    ids = tok.encode(HEAD + "## Analysis\nGrowth.<|return|>")
    reasoning, content = _serve(tok, sglang, ids)
    assert content == "#### Analysis\nGrowth."
    assert resent_prefixes(content) == [1, 2]  # the text alone admits both
    row = _row(tok, ids, reasoning, content, logprobs=True)
    assert (row["status"], row["completion_ids"]) == ("ok", ids)
    assert row["reconstruction"].endswith("+prefix_resent=2")


def test_logprobs_with_a_split_character_still_pick_the_resent_start(tok, sglang):
    """vLLM 0.34 logs the pieces of a split character with no text and the whole character on
    the last: readings were pruned by the bytes of the known ids alone, which lack it, and the
    true one went with them."""
    from test_evidence import _vllm_034_logprobs

    ids = tok.encode(HEAD + "# Analysis \u9f98.<|return|>")
    reasoning, content = _serve(tok, sglang, ids)
    assert content == "## Analysis \u9f98."
    logged = _vllm_034_logprobs(tok, ids)
    assert sum(not e["bytes"] for e in logged["content"]) >= 2  # the character's pieces
    row = _row(tok, ids, reasoning, content, logprobs=True, logged=logged)
    assert (row["status"], row["completion_ids"]) == ("ok", ids), _codes(row)


@pytest.mark.parametrize("final, stream, cut", [
    # a cold tester's false accepts (served by SGLang's own parsers; the count fitted)
    ("commentaryana", True, False),  # served 'commentan': the word itself cut
    (" ok Analysis assistantfinal", True, False),  # ' ok ok Analysis final'
    ("，\nAnalysis  assistant", True, False),  # held back at the end
    ("te Analysisat\t comment", True, False),
    ("ntr Analysisnttor<|", True, False),
    ("s commentarystinalaana jon", True, False),  # a letter sent twice mid-text too
    ("Hi Analysis an", None, False),  # the record does not say it streamed
    ("\n## Analysis\n<", True, True),  # a length cut
])
def test_the_detectors_same_count_changes_are_never_ok_from_the_count(tok, sglang, final, stream, cut):
    ids = tok.encode(HEAD + final + ("" if cut else "<|return|>"))
    reasoning, content = _serve(tok, sglang, ids, cut=cut)
    assert content != final  # the premise: the detector changed it
    row = _row(tok, ids, reasoning, content, logprobs=False, stream=stream, cut=cut)
    assert (row["status"], "harmony_message_lost" in _codes(row)) == ("rejected", True), row["findings"]
    row = _row(tok, ids, reasoning, content, logprobs=True, stream=stream, cut=cut)
    assert row["status"] == "rejected" or row["completion_ids"] == ids


@pytest.mark.parametrize("final, served", [
    # a leading channel word: the detector's parser takes it for a header in text and strips what follows
    (" commentary ##", " commentary##"),
    # a header word after the switch: " assistant Analysis" dropped, a " " of the same count left
    ("#- Analysis assistant Analysis", "#-#- Analysis  Analysis"),
])
def test_what_the_detector_drops_is_shown_by_the_logprobs(tok, sglang, final, served):
    ids = tok.encode(HEAD + final + "<|return|>")
    reasoning, content = _serve(tok, sglang, ids)
    assert content == served  # the premise, from SGLang
    row = _row(tok, ids, reasoning, content, logprobs=False)
    assert row["status"] == "rejected" and "harmony_message_lost" in _codes(row), row["findings"]
    row = _row(tok, ids, reasoning, content, logprobs=True)  # the logprobs show the text differs
    assert row["status"] == "rejected" and "harmony_message_lost" not in _codes(row)
    assert "logprobs_mismatch" in _codes(row)


@pytest.mark.parametrize("final", ["Growth is 5%, see the chart", "Community centers are open",
                                   "Analytics show growth", "Commit the change", "Assignment done"])
def test_a_text_without_a_channel_word_is_served_as_written_and_read_from_the_count(tok, sglang, final):
    ids = tok.encode(HEAD + final + "<|return|>")
    reasoning, content = _serve(tok, sglang, ids)
    assert content == final
    row = _row(tok, ids, reasoning, content, logprobs=False)
    assert (row["status"], row["completion_ids"]) == ("ok", ids)


def test_words_that_hold_a_channel_word_do_not_hide_the_one_that_switched(tok, sglang):
    """A cold reviewer's case: three words before the channel word contain "analysis" without
    a space before it; the parser switched on the fourth, and the logprobs read it."""
    ids = tok.encode(HEAD + "Psychoanalysis, reanalysis, metaanalysis. Analysis: ok<|return|>")
    reasoning, content = _serve(tok, sglang, ids)
    assert content.startswith("Psychoanalysis, reanalysis, metaanalysis.Psychoanalysis")  # resent
    row = _row(tok, ids, reasoning, content, logprobs=True)
    assert (row["status"], row["completion_ids"]) == ("ok", ids)


_PIECES = st.sampled_from(["#", "##", "-", "*", "1.", " ", "\n", "Growth", " is", " 5%.", "x", " data", " a", " an",
                           " Analysis", " analysis", " commentary", " Commentary", "Analysis", " the", " fan",
                           ":", " ok", "\n\n", "中文", " co", " assistant", "...", ".\n", " assistantfinal", "<",
                           " <|", "ana", "lysis", " ANALYSIS"])


@pytest.mark.parametrize("logprobs", [False, True], ids=["text", "logprobs"])
def test_sglang_streamed_with_tools_is_never_ok_with_wrong_ids(tok, sglang, logprobs):
    seen: Counter[str] = Counter()

    @settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(_PIECES, min_size=1, max_size=8).map("".join))
    def check(final: str) -> None:
        ids = tok.encode(HEAD + final + "<|return|>")
        reasoning, content = _serve(tok, sglang, ids)
        row = _row(tok, ids, reasoning, content, logprobs=logprobs)
        resent = content != final and content.endswith(final)
        seen["n"] += 1
        seen["resent"] += resent
        if row["status"] == "ok":
            assert row["completion_ids"] == ids, (final, content)
            seen["ok"] += 1
            seen["ok_resent"] += resent
        elif row["status"] == "flagged":
            assert row["completion_ids"] == ids or "held_tail_unproven" in _codes(row), (final, content)
        # the shape read: the model's text with its start sent twice, and none of the parser's
        # other paths (structural-token text; its detector's own wait for "assistantfinal")
        start = content[: len(content) - len(final)]
        if logprobs and resent and final.startswith(start) and "assistantfin" not in final.lower() and "<|" not in final:
            assert (row["status"], row["completion_ids"]) == ("ok", ids), (final, content)

    check()
    print(dict(seen))
    assert seen["n"] == 400 and seen["resent"] >= 40, seen
    # with logprobs every resent text is read but those with structural-token text or "assistantfinal";
    # without, none (the count cannot see the detector's other changes)
    assert seen["ok_resent"] >= seen["resent"] // 2 if logprobs else seen["ok_resent"] == 0, seen

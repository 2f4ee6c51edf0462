"""Every piece of evidence a response carries decides its ids: reasoning_details,
logprobs, matched_stop, reasoning_tokens; and where one response fits several native
sequences, the evidence picks one or the gate says it cannot. Native ids are built here
from the real Kimi K2.5 tokenizer, independently of reconstruct."""

from __future__ import annotations

import copy

import pytest

from tokenbridge.chat import DIALECTS
from tokenbridge.reconstruct import reconstruct_record

TS, TE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
SECTION = f"{TS}{CB}functions.get_weather:0{AB}{{\"city\": \"Paris\"}}{CE}{TE}"
PROMPT = [{"role": "user", "content": "Weather in Paris?"}]
REQUEST = {"model": "moonshotai/kimi-k2.5", "messages": PROMPT}
REASONING = "The user wants the weather. I will call the tool."


def native(kimi, *pieces: str | int) -> list[int]:
    """Ids of a native completion: strings are encoded, ints are token ids."""
    out: list[int] = []
    for p in pieces:
        out.extend([p] if isinstance(p, int) else kimi.encode(p))
    return out


def record(kimi, message: dict, finish: str = "stop", usage: int | None = None, request: dict | None = None,
           **choice) -> dict:
    request = copy.deepcopy(request or REQUEST)
    response = {"id": "gen", "provider": "P", "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}]}
    if usage is not None:
        prompt = DIALECTS["kimi-k2.5"].render_request(request)
        response["usage"] = {"prompt_tokens": len(kimi.encode(prompt)), "completion_tokens": usage}
    return {"id": "r1", "request": request, "response": response}


def codes(row) -> list[str]:
    return sorted(f["code"] for f in row["findings"])


@pytest.fixture(scope="module")
def ids(kimi):
    return {"close": kimi.token_id("</think>"), "end": kimi.token_id("<|im_end|>"), "eos": kimi.token_id("[EOS]")}


# --- reasoning_details --------------------------------------------------------------------


def test_reasoning_only_in_reasoning_details_is_recovered_in_index_order(kimi, ids):
    truth = native(kimi, REASONING, ids["close"], "Sunny.", ids["end"])
    details = [{"type": "reasoning.text", "text": "I will call the tool.", "index": 1},
               {"type": "reasoning.text", "text": "The user wants the weather. ", "index": 0}]
    row, = reconstruct_record(record(kimi, {"content": "Sunny.", "reasoning_details": details}, usage=len(truth)), kimi)
    assert row["status"] == "ok", row["findings"]
    assert row["completion_ids"] == truth
    assert row["reasoning"] == REASONING


def test_reasoning_and_details_disagreeing_is_a_conflict(kimi, ids):
    details = [{"type": "reasoning.text", "text": "Something else entirely."}]
    msg = {"reasoning": REASONING, "content": "Sunny.", "reasoning_details": details}
    row, = reconstruct_record(record(kimi, msg, usage=len(native(kimi, REASONING, ids["close"], "Sunny.", ids["end"]))), kimi)
    assert "reasoning_conflict" in codes(row) and row["status"] == "rejected"


@pytest.mark.parametrize("entry", [{"type": "reasoning.summary", "summary": REASONING},
                                   {"type": "reasoning.encrypted", "data": "gAAAAB..."}])
def test_summary_or_encrypted_reasoning_is_not_the_models_text(kimi, ids, entry):
    truth = native(kimi, REASONING, ids["close"], "Sunny.", ids["end"])
    msg = {"reasoning": REASONING, "content": "Sunny.", "reasoning_details": [entry]}
    row, = reconstruct_record(record(kimi, msg, usage=len(truth)), kimi)
    assert codes(row) == ["reasoning_redacted"] and row["status"] == "rejected"


def test_a_malformed_reasoning_details_names_its_field(kimi):
    from tokenbridge.exchanges import RecordError

    msg = {"content": "x", "reasoning_details": [{"type": "reasoning.text", "text": 5}]}
    with pytest.raises(RecordError) as err:
        reconstruct_record(record(kimi, msg), kimi)
    assert err.value.field == "response.choices[0].message.reasoning_details[0].text"


# --- logprobs -----------------------------------------------------------------------------


def _logprobs(kimi, seq, form="bytes"):
    if form == "token_id":
        return {"content": [{"token": f"token_id:{i}", "logprob": -0.5} for i in seq]}
    return {"content": [{"token": kimi.token_bytes(i).decode("utf-8", "replace"), "bytes": list(kimi.token_bytes(i)),
                         "logprob": -0.5} for i in seq]}


@pytest.mark.parametrize("form", ["bytes", "token_id"])
@pytest.mark.parametrize("cover", ["all", "all_but_end", "content"])
def test_logprobs_that_agree_prove_the_sample_without_usage(kimi, ids, form, cover):
    truth = native(kimi, REASONING, ids["close"], "Sunny, 21 °C.", ids["end"])
    logged = {"all": truth, "all_but_end": truth[:-1], "content": truth[truth.index(ids["close"]) + 1:]}[cover]
    msg = {"reasoning": REASONING, "content": "Sunny, 21 °C."}
    row, = reconstruct_record(record(kimi, msg, logprobs=_logprobs(kimi, logged, form)), kimi)
    assert row["completion_ids"] == truth
    assert codes(row) == ["usage_missing"]  # logprobs agree; only the missing usage is reported


def test_an_end_token_logged_without_text_still_agrees(kimi, ids):
    truth = native(kimi, REASONING, ids["close"], "Sunny.", ids["end"])
    logged = _logprobs(kimi, truth[:-1])
    logged["content"].append({"token": "", "bytes": [], "logprob": 0.0})  # vLLM skips the special token's text
    row, = reconstruct_record(record(kimi, {"reasoning": REASONING, "content": "Sunny."}, logprobs=logged), kimi)
    assert row["completion_ids"] == truth and codes(row) == ["usage_missing"]


def test_logprobs_showing_another_tokenization_are_a_mismatch(kimi, ids):
    text = "Sunny."
    canonical = native(kimi, REASONING, ids["close"], text, ids["end"])
    split = kimi.encode("Sun") + kimi.encode("ny.")  # same text, a split the canonical encoding never makes
    assert split != kimi.encode(text)
    emitted = native(kimi, REASONING, ids["close"]) + split + [ids["end"]]
    msg = {"reasoning": REASONING, "content": text}
    row, = reconstruct_record(record(kimi, msg, usage=len(canonical), logprobs=_logprobs(kimi, emitted)), kimi)
    assert codes(row) == ["logprobs_mismatch"]
    assert "same text, another tokenization" in row["findings"][0]["message"]


def test_logprobs_of_edited_text_are_a_mismatch_that_says_the_text_differs(kimi, ids):
    emitted = native(kimi, REASONING, ids["close"], "Sunny.\n", ids["end"])
    msg = {"reasoning": REASONING, "content": "Sunny."}  # the provider stripped the newline
    row, = reconstruct_record(record(kimi, msg, logprobs=_logprobs(kimi, emitted)), kimi)
    assert "logprobs_mismatch" in codes(row) and "text differs" in row["findings"][-1]["message"]


@pytest.mark.parametrize("entries,why", [
    ([{"token": "token_id:99999999"}], "names no id"),
    ([{"token": None, "bytes": "abc"}], "no usable bytes"),
    ([{"token": 7, "bytes": None}], "no usable bytes"),
    ([{"token": "x", "bytes": [255, 254, 253, 252, 251]}], "no single token"),
    ("not a list", "not a list"),
])
def test_unreadable_logprobs_are_a_warning_and_not_evidence(kimi, ids, entries, why):
    truth = native(kimi, REASONING, ids["close"], "Sunny.", ids["end"])
    msg = {"reasoning": REASONING, "content": "Sunny."}
    row, = reconstruct_record(record(kimi, msg, usage=len(truth), logprobs={"content": entries}), kimi)
    assert codes(row) == ["logprobs_unreadable"] and why in row["findings"][0]["message"]
    assert row["completion_ids"] == truth and row["status"] == "flagged"


def _decoded_text_logprobs(kimi, seq):
    """vLLM's and SGLang's entries: ``bytes`` built from the token's decoded text, so a
    token holding part of a character reads U+FFFD and a skipped special token nothing."""
    out = []
    for i in seq:
        text = "" if i in kimi.marker_ids else kimi.token_bytes(i).decode("utf-8", "replace")
        out.append({"token": text, "bytes": list(text.encode("utf-8")), "logprob": -0.1})
    return {"content": out}


def test_engine_logprobs_of_partial_characters_and_skipped_markers_still_prove_the_sample(kimi, ids):
    content = "Hello! \U0001F600 Nice \u982b."  # an emoji and a rare CJK character, each split over tokens
    truth = native(kimi, REASONING, ids["close"], content, ids["end"])
    partial = [i for i in truth if i not in kimi.marker_ids and "\ufffd" in kimi.token_bytes(i).decode("utf-8", "replace")]
    assert len(partial) >= 2  # the text really holds tokens that are parts of characters
    msg = {"reasoning": REASONING, "content": content}
    row, = reconstruct_record(record(kimi, msg, logprobs=_decoded_text_logprobs(kimi, truth)), kimi)
    assert row["completion_ids"] == truth and codes(row) == ["usage_missing"]  # proven by the logprobs, as before
    # the known ids still decide: another text at a known place is a mismatch
    other = native(kimi, REASONING, ids["close"], content.replace("Nice", "Fine"), ids["end"])
    row, = reconstruct_record(record(kimi, msg, logprobs=_decoded_text_logprobs(kimi, other)), kimi)
    assert "logprobs_mismatch" in codes(row)


def _vllm_034_logprobs(kimi, seq: list[int]) -> dict:
    """Logprobs as vLLM 0.34 logs them (``LogprobsProcessor._verify_tokens``): each id that
    leaves a character unfinished with no text, the id that finishes it with the bytes of
    all of them (tests/test_vllm_oracle.py holds this form against vLLM's own code)."""
    out, pending = [], b""
    for i in seq:
        pending += kimi.token_bytes(i)
        if pending.decode("utf-8", "replace").endswith("\ufffd"):
            out.append({"token": "", "bytes": [], "logprob": -0.1})
            continue
        text = pending.decode("utf-8")
        pending = b""
        out.append({"token": text, "bytes": list(text.encode("utf-8")), "logprob": -0.1})
    return {"content": out}


def test_vllm_034_logprobs_of_split_characters_prove_the_sample(kimi, ids):
    content = "Hello! \U0001F600 Nice \u982b."  # an emoji and a rare CJK character, each split over tokens
    truth = native(kimi, REASONING, ids["close"], content, ids["end"])
    logged = _vllm_034_logprobs(kimi, truth)
    assert sum(not e["bytes"] for e in logged["content"]) >= 2  # pieces logged with no text
    msg = {"reasoning": REASONING, "content": content}
    row, = reconstruct_record(record(kimi, msg, logprobs=logged), kimi)
    # was: logprobs_unreadable ("bytes ... are no single token"), the evidence lost
    assert row["completion_ids"] == truth and codes(row) == ["usage_missing"]
    other = native(kimi, REASONING, ids["close"], content.replace("Nice", "Fine"), ids["end"])
    row, = reconstruct_record(record(kimi, msg, logprobs=_vllm_034_logprobs(kimi, other)), kimi)
    assert "logprobs_mismatch" in codes(row)


def test_a_split_character_logged_whole_is_checked_by_its_bytes(kimi, ids):
    """A run of pieces is known by what it spells: another character served in its place
    (the wrong ids) is a mismatch, not an agreement (a cold reviewer's case)."""
    for truth_c, served_c in (("I like \U0001F600.", "I like \U0001F601."), ("Ok \u9f98 yes", "Ok \u982b yes")):
        truth = native(kimi, REASONING, ids["close"], truth_c, ids["end"])
        msg = {"reasoning": REASONING, "content": served_c}
        row, = reconstruct_record(record(kimi, msg, usage=len(truth), logprobs=_vllm_034_logprobs(kimi, truth)), kimi)
        assert row["status"] == "rejected" and "logprobs_mismatch" in codes(row)


def test_a_character_logged_whole_after_empty_entries_may_be_pieces_or_a_marker_and_a_token(kimi):
    from tokenbridge.evidence import UNKNOWN_EMPTY, UNKNOWN_RUN, logprob_ids, logprobs_cover

    whole = kimi.encode("中")
    assert len(whole) == 1
    entry = {"token": "中", "bytes": list("中".encode()), "logprob": -0.1}
    logged = logprob_ids(kimi, {"logprobs": {"content": [{"token": "", "bytes": []}, entry]}})
    assert logged is not None and logged.ids == (UNKNOWN_EMPTY, UNKNOWN_RUN) and not logged.markers_known

    def cover(seq: list[int]) -> str | None:
        return logprobs_cover(logged.ids, seq, 0, False, logged.may_be, runs=logged.runs, spell=logged.spell)
    # a skipped marker then the whole token, or the character's bytes in two pieces: both agree
    marker = kimi.token_id("<|im_end|>")
    assert cover([marker, whole[0]]) == "all"
    lead = next(i for i in range(kimi.max_ordinary_id + 1) if kimi.token_bytes(i) == "中".encode()[:1])
    rest = [i for i in range(kimi.max_ordinary_id + 1) if kimi.token_bytes(i) == "中".encode()[1:]]
    if rest:
        assert cover([lead, rest[0]]) == "all"
    # anything else does not: another character, or a marker before another token
    other = kimi.encode("文")
    assert cover([marker, other[0]]) is None and cover([lead, other[0]]) is None
    # ASCII after an empty entry is no character's end: the empty one is a skipped marker
    logged = logprob_ids(kimi, {"logprobs": {"content": [{"token": "", "bytes": []},
                                                         {"token": "Hi", "bytes": list(b"Hi")}]}})
    assert logged is not None and logged.ids == (-1, *kimi.encode("Hi"))


#: What vLLM 0.34 logs for Kimi's ids of this Burmese text (tests/test_vllm_oracle.py checks
#: it against vLLM's own LogprobsProcessor): ids that span two characters come out as empty
#: entries, then U+FFFD and the rest, as its _correct_decoded_token decodes them.
BURMESE = "\u101e\u1004\u103a\u1000 \u1019\u1004\u103a\u1039\u1002\u101c\u102c\u1015\u102b"
BURMESE_LOGGED = ["", "", "\ufffd\u103a\u1000", "", "", "\ufffd\u103a\u1039", "\u1002", "\u101c", "",
                  "\ufffd\u102b"]


def test_vllm_034_logprobs_of_ids_spanning_two_characters_still_prove_the_sample(kimi, ids):
    """Empty entries before one holding U+FFFD were read as skipped markers: the provable
    Burmese sample was rejected (logprobs_mismatch)."""
    truth = native(kimi, BURMESE, ids["close"], "ok", ids["end"])
    logged = [*({"token": t, "bytes": list(t.encode())} for t in BURMESE_LOGGED),
              {"token": "</think>", "bytes": list(b"</think>")}, {"token": "ok", "bytes": list(b"ok")},
              {"token": "<|im_end|>", "bytes": list(b"<|im_end|>")}]
    assert len(logged) == len(truth)
    row, = reconstruct_record(record(kimi, {"reasoning": BURMESE, "content": "ok"}, usage=len(truth),
                                     logprobs={"content": logged}), kimi)
    assert row["status"] == "ok" and row["completion_ids"] == truth, codes(row)


def test_vllm_streamed_reasoning_count_needs_vllm_to_have_served_the_choice(kimi, ids):
    """vLLM's streamed reasoning_tokens leaves out each id that finishes no character; for a
    choice with no sign of vLLM (its ``stop_reason`` key), that count is not read: one short
    per split, it fits a reading whose boundary is off by as many ids (a reviewer's case)."""
    reasoning = "Hi \U0001F600"
    truth = native(kimi, reasoning, ids["close"], "Ok.", ids["end"])
    n_reasoning = len(kimi.encode(reasoning))
    request = {**REQUEST, "stream": True}

    def row_of(message: dict, reasoning_tokens: int, **choice) -> dict:
        rec = record(kimi, message, usage=len(truth), request=request, **choice)
        rec["response"]["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return reconstruct_record(rec, kimi)[0]

    # the '.' served on the reasoning's side: wrong ids whose count, less the split, fits
    wrong = row_of({"reasoning": reasoning + ".", "content": "Ok"}, n_reasoning)
    assert wrong["status"] == "rejected" and "usage_reasoning_mismatch" in codes(wrong)
    # the right text with vLLM's streamed count (one id of the emoji uncounted): read so where
    # vLLM served it (its other readings may still leave the row ambiguous), else not
    right = {"reasoning": reasoning, "content": "Ok."}
    assert "usage_reasoning_mismatch" not in codes(row_of(right, n_reasoning - 1, stop_reason=None))
    assert "usage_reasoning_mismatch" in codes(row_of(right, n_reasoning - 1))


# --- matched_stop and the end token --------------------------------------------------------


def test_matched_stop_names_the_end_token(kimi, ids):
    truth = native(kimi, REASONING, ids["close"], "Sunny.", ids["eos"])
    msg = {"reasoning": REASONING, "content": "Sunny."}
    row, = reconstruct_record(record(kimi, msg, usage=len(truth), matched_stop=ids["eos"]), kimi)
    assert row["status"] == "ok", row["findings"]
    assert row["completion_ids"] == truth and row["reconstruction"] == "end=[EOS]"


def test_matched_stop_of_the_usual_end_token_changes_nothing(kimi, ids):
    truth = native(kimi, REASONING, ids["close"], "Sunny.", ids["end"])
    row, = reconstruct_record(record(kimi, {"reasoning": REASONING, "content": "Sunny."}, usage=len(truth),
                                     matched_stop=ids["end"]), kimi)
    assert row["status"] == "ok" and row["completion_ids"] == truth and row["reconstruction"] is None


def test_a_stop_string_is_not_the_models_end_token(kimi, ids):
    msg = {"reasoning": REASONING, "content": "Sunny."}
    row, = reconstruct_record(record(kimi, msg, usage=99, matched_stop="END"), kimi)
    assert "stop_sequence" in codes(row)


# --- reasoning_tokens ---------------------------------------------------------------------


@pytest.mark.parametrize("convention", ["reasoning_only", "sglang", "vllm_zero"])
def test_reasoning_tokens_in_any_engine_convention_pass(kimi, ids, convention):
    truth = native(kimi, REASONING, ids["close"], "Sunny.", ids["end"])
    n = len(kimi.encode(REASONING))
    rec = record(kimi, {"reasoning": REASONING, "content": "Sunny."}, usage=len(truth))
    rec["response"]["usage"]["completion_tokens_details"] = {
        "reasoning_tokens": {"reasoning_only": n, "sglang": n + 1, "vllm_zero": 0}[convention]}
    row, = reconstruct_record(rec, kimi)
    assert row["status"] == "ok", row["findings"]


def test_reasoning_tokens_localize_a_boundary_the_total_cannot_see(kimi, ids):
    """The provider moved the reasoning's last sentence into the content: the total count
    is unchanged, the reasoning count is not."""
    head, tail = "The user wants the weather.", " I will call the tool."
    truth = native(kimi, head + tail, ids["close"], " Sunny.", ids["end"])
    rec = record(kimi, {"reasoning": head, "content": tail + " Sunny."}, usage=len(truth))
    rec["response"]["usage"]["completion_tokens_details"] = {"reasoning_tokens": len(kimi.encode(head + tail)) + 1}
    row, = reconstruct_record(rec, kimi)
    assert len(row["completion_ids"]) == len(truth)  # the total alone would pass
    assert codes(row) == ["usage_reasoning_mismatch"]


# --- several native sequences: the evidence picks ------------------------------------------


def test_sglang_tool_call_without_think_close_is_proven_by_usage_where_the_run_counts_the_end(kimi, ids):
    """A section opened without ``</think>`` is the formula's count less one: the formula's
    own count where the provider leaves the end token out (a run-level trait). A cold tester's
    record had exactly that, and its row was ``ok`` one boundary token short. So the count
    alone picks it only where the run proved the end token counted."""
    from tokenbridge.traits import ProviderTrait

    truth = native(kimi, REASONING, SECTION, ids["end"])  # the model never emitted </think>
    msg = {"reasoning_content": REASONING, "content": SECTION}  # as SGLang's KimiK2Detector serves it
    rec = record(kimi, msg, finish="tool_calls", usage=len(truth))
    row, = reconstruct_record(rec, kimi)
    assert row["status"] == "rejected" and codes(row) == ["usage_completion_mismatch"]
    # the formula with its end token left out: the very same count
    formula = native(kimi, REASONING, ids["close"], SECTION, ids["end"])
    assert len(formula) - 1 == len(truth)
    row, = reconstruct_record(rec, kimi, traits={"P": ProviderTrait("P", end_counted=True)})
    assert row["status"] == "ok", row["findings"]
    assert row["completion_ids"] == truth and row["reconstruction"] == "no_think_close"
    assert ids["close"] not in row["completion_ids"]
    assert [s["kind"] for s in row["segments"]] == ["prompt", "reasoning", "tool_calls", "end"]
    row, = reconstruct_record(rec, kimi, traits={"P": ProviderTrait("P", end_uncounted=True)})
    assert row["status"] == "ok" and row["completion_ids"] == formula and row["reconstruction"] is None
    # and where the run proved the end uncounted, the count one less picks the section opened without it
    rec["response"]["usage"]["completion_tokens"] = len(truth) - 1
    row, = reconstruct_record(rec, kimi, traits={"P": ProviderTrait("P", end_uncounted=True)})
    assert row["status"] == "ok" and row["completion_ids"] == truth and row["reconstruction"] == "no_think_close"


@pytest.mark.parametrize("closed", [False, True])
def test_with_a_usage_tolerance_a_section_with_or_without_think_close_is_ambiguous(kimi, ids, closed):
    """A tolerance of a token lets the count fit both readings: they are said, not one kept.
    (Vetoed, the reading without ``</think>`` was dropped, and the formula's ids passed as
    ``ok`` where the model had written none.)"""
    from tokenbridge.checks import Policy

    truth = native(kimi, REASONING, *([ids["close"]] if closed else []), SECTION, ids["end"])
    rec = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="tool_calls", usage=len(truth))
    row, = reconstruct_record(rec, kimi, policy=Policy(usage_tolerance=1))
    assert row["status"] == "rejected" and codes(row) == ["reconstruction_ambiguous"], row["findings"]


def _tool_choice(index: int) -> dict:
    return {"index": index, "message": {"reasoning": REASONING, "content": SECTION}, "finish_reason": "tool_calls"}


def test_logprobs_of_the_content_alone_never_see_whether_think_close_was_written(kimi, ids):
    """A reviewer's: logprobs over the section and the end only were taken as ids that tell
    the readings apart, which lifted the veto of a sibling read from the count, and both rows
    were ``ok`` with ids swapped. They agree with both readings and say nothing of ``</think>``;
    where the run showed how the end is counted, the count picks (they were read from the
    first id on, and the true reading was refused)."""
    from tokenbridge.traits import ProviderTrait

    short = native(kimi, REASONING, SECTION, ids["end"])
    closed = native(kimi, REASONING, ids["close"], SECTION, ids["end"])
    content = _logprobs(kimi, native(kimi, SECTION, ids["end"]))
    rec = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="tool_calls", usage=len(short),
                 logprobs=content)
    row, = reconstruct_record(rec, kimi)
    assert row["status"] == "rejected", row  # the formula with an uncounted end has this count too
    for trait, usage in ((ProviderTrait("P", end_counted=True), len(short)),
                         (ProviderTrait("P", end_uncounted=True), len(short) - 1)):
        rec["response"]["usage"]["completion_tokens"] = usage
        row, = reconstruct_record(rec, kimi, traits={"P": trait})
        assert (row["status"], row["completion_ids"], row["reconstruction"]) == ("ok", short, "no_think_close"), row
    # n = 2: the short one with content logprobs, the other closed and bare: the sum cannot say which
    two = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="tool_calls",
                 usage=len(short) + len(closed), logprobs=content)
    two["response"]["choices"].append(_tool_choice(1))
    assert [r["status"] for r in reconstruct_record(two, kimi)] == ["rejected", "rejected"]


def test_logprobs_of_every_id_pick_the_section_opened_without_think_close(kimi, ids):
    short = native(kimi, REASONING, SECTION, ids["end"])
    rec = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="tool_calls", usage=len(short),
                 logprobs=_logprobs(kimi, short))
    row, = reconstruct_record(rec, kimi)
    assert (row["status"], row["completion_ids"], row["reconstruction"]) == ("ok", short, "no_think_close"), row


def test_logprobs_of_a_section_with_no_reasoning_before_it_are_also_the_formulas_content(kimi, ids):
    """No reasoning served: the ids of the section opened without ``</think>`` are the
    formula's content ids too, so logprobs of every id of the one are what a provider that
    logs the content only writes for the other; with an uncounted end the count ties as
    well. They were read as covering the short reading whole, and the row was ``ok``."""
    from tokenbridge.traits import ProviderTrait

    short = native(kimi, SECTION, ids["end"])
    for logged in (short, short[:-1]):
        rec = record(kimi, {"reasoning": "", "content": SECTION}, finish="tool_calls", usage=len(short),
                     logprobs=_logprobs(kimi, logged))
        row, = reconstruct_record(rec, kimi)
        assert row["status"] == "rejected", row
        # where the run showed its end is counted, the count picks the short reading
        row, = reconstruct_record(rec, kimi, traits={"P": ProviderTrait("P", end_counted=True)})
        assert (row["status"], row["completion_ids"], row["reconstruction"]) == ("ok", short, "no_think_close"), row


@pytest.mark.parametrize("end_uncounted", [False, True])
def test_a_section_beside_a_length_cut_that_may_hide_an_id_is_unattributable(kimi, ids, end_uncounted):
    """A reviewer's: one id fewer here (no ``</think>``), one more there (a ``</think>`` the cut
    did not serve) keeps the sum, so neither choice is proven by it; was ``ok`` with a
    ``</think>`` the model never wrote (and, under an uncounted end, with the short reading)."""
    from tokenbridge.traits import ProviderTrait

    tool = native(kimi, REASONING, *([ids["close"]] if end_uncounted else []), SECTION, ids["end"])
    cut = native(kimi, "Let me think about the weather in Paris carefully", ids["close"])
    rec = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="tool_calls",
                 usage=len(tool) - end_uncounted + len(cut))
    rec["response"]["choices"].append({"index": 1, "finish_reason": "length", "message": {
        "reasoning": "Let me think about the weather in Paris carefully", "content": ""}})
    traits = {"P": ProviderTrait("P", end_uncounted=True)} if end_uncounted else None
    rows = reconstruct_record(rec, kimi, traits=traits)
    assert [r["status"] for r in rows] == ["rejected", "rejected"], [r["findings"] for r in rows]
    assert all("choices_unattributable" in codes(r) for r in rows)


@pytest.mark.parametrize("logged", ["empty on the cut", "content on the section", "content on both"])
def test_logprobs_that_prove_no_choice_whole_leave_a_cancelling_pair_unattributable(kimi, ids, logged):
    """A cold tester's: a section opened without ``</think>`` (one id fewer than the formula)
    beside a cut right after ``</think>`` (one more than served) keep the sum. Logprobs that
    prove neither choice whole (an empty list; the content's alone, which never see a
    ``</think>``) were taken as pinning the choice: the section was ``ok`` with a
    ``</think>`` the model never wrote, and the cut lost its own."""
    tool = native(kimi, REASONING, SECTION, ids["end"])
    cut_text = "The user greets. Reply briefly"
    cut = native(kimi, cut_text, ids["close"])
    rec = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="stop", usage=len(tool) + len(cut))
    rec["response"]["choices"].append({"index": 1, "finish_reason": "length",
                                       "message": {"reasoning": cut_text, "content": ""}})
    choices = rec["response"]["choices"]
    if logged == "empty on the cut":
        choices[1]["logprobs"] = {"content": []}
    if logged in ("content on the section", "content on both"):
        choices[0]["logprobs"] = _logprobs(kimi, native(kimi, SECTION, ids["end"]))
    if logged == "content on both":
        choices[1]["logprobs"] = {"content": []}
    rows = reconstruct_record(rec, kimi)
    assert [r["status"] for r in rows] == ["rejected", "rejected"], [r["findings"] for r in rows]
    assert all("choices_unattributable" in codes(r) for r in rows)
    # logprobs of every id of the section pin it (its own ids, right): the sum then shows the cut's missing id
    choices[0]["logprobs"] = _logprobs(kimi, tool)
    choices[1].pop("logprobs", None)
    a, b = reconstruct_record(rec, kimi)
    assert (a["completion_ids"], a["reconstruction"]) == (tool, "no_think_close")
    assert [codes(r) for r in (a, b)] == [["usage_completion_mismatch"], ["truncated", "usage_completion_mismatch"]]


@pytest.mark.parametrize("shape", ["engine logprobs of every id", "content logprobs of a cut in its content"])
def test_logprobs_that_fix_a_choices_count_pin_it_against_a_cancelling_sibling(kimi, ids, shape):
    """A reviewer's: logprobs that fix a choice's count pin it, though they may not spell it:
    an engine's of every id (a marker logged as an empty entry, unknown but one entry), and
    a length cut's of its content (the id a cut may hide is at the cut, in them). Taken as
    pinning nothing, both rows were rejected ``choices_unattributable``."""
    closed = native(kimi, REASONING, ids["close"], SECTION, ids["end"])
    if shape == "engine logprobs of every id":
        reasoning, content, cut = "The user greets. Reply briefly", "", native(kimi, "The user greets. Reply briefly")
        first, second = _decoded_text_logprobs(kimi, closed), None
    else:
        reasoning, content = REASONING, "It is sunny in Par"
        cut = native(kimi, REASONING, ids["close"], content)
        first, second = None, _logprobs(kimi, native(kimi, content))
    rec = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="tool_calls", usage=len(closed) + len(cut))
    rec["response"]["choices"].append({"index": 1, "finish_reason": "length",
                                       "message": {"reasoning": reasoning, "content": content}})
    for choice, logged in zip(rec["response"]["choices"], (first, second)):
        if logged is not None:
            choice["logprobs"] = logged
    a, b = reconstruct_record(rec, kimi)
    assert (a["status"], a["completion_ids"], codes(a)) == ("ok", closed, [])
    assert (b["status"], b["completion_ids"], codes(b)) == ("flagged", cut, ["truncated"])


def test_a_cuts_last_logged_entry_with_no_text_is_the_id_the_cut_may_hide_not_an_end_token(kimi, ids):
    """A reviewer's: an engine logs a skipped special token as an entry with no text, and a
    last such entry was dropped as the end token whatever the finish reason. A length cut
    has none: it was the ``</think>`` the cut hid, so the cut's logprobs read as covering its
    served ids whole, pinned it, and the section beside it was ``ok`` with a ``</think>`` the
    model never wrote."""
    tool = native(kimi, REASONING, SECTION, ids["end"])
    cut_text = "The user greets. Reply briefly"
    cut = native(kimi, cut_text, ids["close"])
    rec = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="stop", usage=len(tool) + len(cut))
    rec["response"]["choices"].append({"index": 1, "finish_reason": "length", "logprobs": _decoded_text_logprobs(kimi, cut),
                                       "message": {"reasoning": cut_text, "content": ""}})
    rows = reconstruct_record(rec, kimi)
    assert [r["status"] for r in rows] == ["rejected", "rejected"], [r["findings"] for r in rows]
    assert all("choices_unattributable" in codes(r) for r in rows)
    # a finished turn's last empty entry is still its end token, as before
    row, = reconstruct_record(record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="stop", usage=len(tool),
                                     logprobs=_decoded_text_logprobs(kimi, tool)), kimi)
    assert (row["status"], row["completion_ids"]) == ("ok", tool)
    # and a cut alone keeps its served ids, flagged (they are the native ids as far as they go)
    # where no count says one is missing
    alone = record(kimi, {"reasoning": cut_text, "content": ""}, finish="length",
                   logprobs=_decoded_text_logprobs(kimi, cut))
    row, = reconstruct_record(alone, kimi)
    assert (row["status"], row["completion_ids"], codes(row)) == ("flagged", cut[:-1], ["truncated", "usage_missing"])


@pytest.mark.parametrize("trait", ["end_counted", "end_uncounted"])
def test_a_section_read_short_beside_a_length_cut_is_proven_where_the_run_knows_the_end(kimi, ids, trait):
    """A reviewer's: a cut can only hide an id (one more), so beside the reading one id short
    nothing cancels; both rows were marked ``choices_unattributable``."""
    from tokenbridge.traits import ProviderTrait

    short = native(kimi, REASONING, SECTION, ids["end"])
    cut_text = "Let me think about the weather in Paris carefully"
    cut = native(kimi, cut_text)
    rec = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="tool_calls",
                 usage=len(short) + len(cut) - (trait == "end_uncounted"))
    rec["response"]["choices"].append({"index": 1, "finish_reason": "length",
                                       "message": {"reasoning": cut_text, "content": ""}})
    a, b = reconstruct_record(rec, kimi, traits={"P": ProviderTrait("P", **{trait: True})})
    assert (a["status"], a["completion_ids"], a["reconstruction"]) == ("ok", short, "no_think_close"), a
    assert (b["status"], b["completion_ids"], codes(b)) == ("flagged", cut, ["truncated"])


def test_a_tool_call_after_a_real_think_close_keeps_it(kimi, ids):
    truth = native(kimi, REASONING, ids["close"], SECTION, ids["end"])
    msg = {"reasoning": REASONING, "content": SECTION}
    row, = reconstruct_record(record(kimi, msg, finish="tool_calls", usage=len(truth)), kimi)
    assert row["status"] == "ok" and row["completion_ids"] == truth and row["reconstruction"] is None


def test_without_evidence_the_two_readings_are_reported_not_guessed(kimi):
    msg = {"reasoning": REASONING, "content": SECTION}
    row, = reconstruct_record(record(kimi, msg, finish="tool_calls"), kimi)
    assert "reconstruction_ambiguous" in codes(row) and row["status"] == "rejected"
    assert "no_think_close" in next(f["message"] for f in row["findings"] if f["code"] == "reconstruction_ambiguous")


def test_logprobs_pick_the_reading_when_usage_is_missing(kimi, ids):
    truth = native(kimi, REASONING, SECTION, ids["end"])
    msg = {"reasoning": REASONING, "content": SECTION}
    row, = reconstruct_record(record(kimi, msg, finish="tool_calls", logprobs=_logprobs(kimi, truth)), kimi)
    assert row["completion_ids"] == truth and codes(row) == ["usage_missing"]


def _vllm_text(kimi, seq: list[int]) -> str:
    """vLLM's detokenizer: added tokens joined to their neighbours by one space, one more in
    front (the prompt's last token is <think>), <|im_end|> skipped."""
    pieces, run = [], []
    for i in seq:
        if i == kimi.token_id("<|im_end|>"):
            continue
        if i in kimi.marker_ids:
            if run:
                pieces.append(kimi.decode(run))
                run = []
            pieces.append(kimi.marker_ids[i])
        else:
            run.append(i)
    if run:
        pieces.append(kimi.decode(run))
    return " " + " ".join(p for p in pieces if p)


VLLM_CONTENTS = ["Sunny.", "Sunny, 21 °C.\n", SECTION, "Let me check." + SECTION, "\n" + SECTION]


@pytest.mark.parametrize("content", VLLM_CONTENTS)
def test_vllm_spaces_around_markers_are_removed_or_reported(kimi, ids, content):
    """Alone, a joined response is proven when usage tells the readings apart, and
    reported when it cannot (a space can merge into its neighbour's token): never wrong."""
    truth = native(kimi, REASONING, ids["close"], content, ids["end"])
    reasoning, served = _vllm_text(kimi, truth).split("</think>", 1)
    finish = "tool_calls" if TS in content else "stop"
    row, = reconstruct_record(record(kimi, {"reasoning": reasoning, "content": served}, finish=finish,
                                     usage=len(truth)), kimi)
    if row["status"] == "ok":
        assert row["completion_ids"] == truth and row["reconstruction"].startswith("marker_spaces")
    else:
        assert codes(row) == ["reconstruction_ambiguous"]
        assert "marker_spaces" in row["findings"][0]["message"]


@pytest.mark.parametrize("content", VLLM_CONTENTS)
def test_a_provider_known_to_join_markers_is_unjoined(kimi, ids, content):
    from tokenbridge.traits import ProviderTrait

    truth = native(kimi, REASONING, ids["close"], content, ids["end"])
    reasoning, served = _vllm_text(kimi, truth).split("</think>", 1)
    finish = "tool_calls" if TS in content else "stop"
    row, = reconstruct_record(record(kimi, {"reasoning": reasoning, "content": served}, finish=finish,
                                     usage=len(truth)), kimi, traits={"P": ProviderTrait("P", joins_markers=True)})
    assert row["status"] == "ok", row["findings"]
    assert row["completion_ids"] == truth and row["reconstruction"].startswith("marker_spaces")


def test_a_known_joiner_loses_the_leading_space_of_a_cut_reasoning(kimi):
    from tokenbridge.traits import ProviderTrait

    truth = native(kimi, "The user asks")
    served = _vllm_text(kimi, truth)
    assert served == " The user asks"
    row, = reconstruct_record(record(kimi, {"reasoning": served, "content": None}, finish="length",
                                     usage=len(truth)), kimi, traits={"P": ProviderTrait("P", joins_markers=True)})
    assert row["completion_ids"] == truth and codes(row) == ["truncated"]


def test_vllm_spaces_and_no_think_close_together(kimi, ids):
    truth = native(kimi, REASONING, SECTION, ids["end"])
    text = _vllm_text(kimi, truth)
    at = text.index(TS)
    row, = reconstruct_record(record(kimi, {"reasoning": text[:at], "content": text[at:]}, finish="tool_calls",
                                     usage=len(truth)), kimi)
    assert row["status"] == "ok", row["findings"]
    assert row["completion_ids"] == truth and row["reconstruction"] == "marker_spaces+no_think_close"


def test_text_with_real_spaces_and_exact_usage_keeps_them(kimi, ids):
    """A model that wrote the spaces itself: usage proves the plain reading."""
    truth = native(kimi, " " + REASONING + " ", ids["close"], " Sunny.", ids["end"])
    row, = reconstruct_record(record(kimi, {"reasoning": " " + REASONING + " ", "content": " Sunny."},
                                     usage=len(truth)), kimi)
    if row["reconstruction"] is None and row["status"] == "ok":
        assert row["completion_ids"] == truth
    else:  # both readings have the same count: reported, never a silent pick
        assert "reconstruction_ambiguous" in codes(row)


# --- n > 1 ----------------------------------------------------------------------------------


def test_a_truncated_sibling_does_not_hide_the_others_when_the_sum_matches(kimi, ids):
    first = native(kimi, REASONING, ids["close"], "Sunny.", ids["end"])
    cut = native(kimi, "The user asks about")
    rec = record(kimi, {"reasoning": REASONING, "content": "Sunny."}, usage=len(first) + len(cut))
    rec["response"]["choices"].append({"index": 1, "message": {"reasoning": "The user asks about", "content": ""},
                                       "finish_reason": "length"})
    a, b = reconstruct_record(rec, kimi)
    assert a["status"] == "ok" and a["completion_ids"] == first
    assert codes(b) == ["truncated"] and b["completion_ids"] == cut


def test_summed_usage_picks_the_reading_of_one_choice_among_several(kimi, ids):
    """An uncounted end token takes one off each choice that ended (two here), so it cannot tie
    one section opened without ``</think>``: the summed count picks, with no run-level proof."""
    plain = native(kimi, REASONING, ids["close"], "Sunny.", ids["end"])
    tool = native(kimi, REASONING, SECTION, ids["end"])
    rec = record(kimi, {"reasoning": REASONING, "content": "Sunny."}, usage=len(plain) + len(tool))
    rec["response"]["choices"].append(_tool_choice(1))
    a, b = reconstruct_record(rec, kimi)
    assert (a["status"], b["status"]) == ("ok", "ok"), (a["findings"], b["findings"])
    assert a["completion_ids"] == plain and b["completion_ids"] == tool and b["reconstruction"] == "no_think_close"


def test_summed_usage_of_choices_that_all_opened_their_section_without_think_close_is_no_proof(kimi, ids):
    """Both read short (one off each) or both with ``</think>`` and their end tokens uncounted
    (one off each): the same sum, so neither row is taken from it."""
    tool = native(kimi, REASONING, SECTION, ids["end"])
    rec = record(kimi, {"reasoning": REASONING, "content": SECTION}, finish="tool_calls", usage=2 * len(tool))
    rec["response"]["choices"].append(_tool_choice(1))
    rows = reconstruct_record(rec, kimi)
    assert [r["status"] for r in rows] == ["rejected", "rejected"], [r["findings"] for r in rows]


@pytest.mark.parametrize("cut_at", [len(TS), len(TS + CB) + 5, SECTION.index(AB) + len(AB) + 3, SECTION.index(CE) + len(CE)])
def test_a_tool_call_cut_by_length_is_exact_not_malformed(kimi, ids, cut_at):
    served = "Calling." + SECTION[:cut_at]
    truth = native(kimi, REASONING, ids["close"], served)
    row, = reconstruct_record(record(kimi, {"reasoning": REASONING, "content": served}, finish="length",
                                     usage=len(truth)), kimi)
    assert codes(row) == ["truncated"] and row["completion_ids"] == truth


def test_a_cut_section_out_of_order_is_still_malformed(kimi, ids):
    served = "Calling." + TS + AB + "{"
    truth = native(kimi, REASONING, ids["close"], served)
    row, = reconstruct_record(record(kimi, {"reasoning": REASONING, "content": served}, finish="length",
                                     usage=len(truth)), kimi)
    assert "tool_markers_malformed" in codes(row)


def _tiny_tokenizer(piece):
    from tokenbridge.tokenizer import Tokenizer

    return Tokenizer(name="tiny", source="tiny", kind="test", vocab_size=4, marker_ids={3: "<|end|>"},
                     chat_template=None, config={}, lossless=True, _encode=lambda text: [],
                     _decode_bytes=lambda ids: b"", _piece=piece)


def _logged(*tokens: str) -> dict:
    return {"logprobs": {"content": [{"token": t, "logprob": 0.0} for t in tokens]}}


def test_logprob_ids_skip_ids_without_bytes():
    """An id with no bytes (KeyError from token_bytes) is a hole in the id space, not an error."""
    from tokenbridge.evidence import logprob_ids

    pieces = {0: b"a", 2: b"c"}  # 1 is a hole
    tok = _tiny_tokenizer(lambda i: pieces[i])
    assert logprob_ids(tok, _logged("c", "a", "<|end|>")).ids == (2, 0, 3)


def test_logprob_ids_do_not_hide_a_tokenizer_bug():
    from tokenbridge.evidence import logprob_ids

    def piece(i: int) -> bytes:
        raise RuntimeError("broken tokenizer")

    with pytest.raises(RuntimeError, match="broken tokenizer"):
        logprob_ids(_tiny_tokenizer(piece), _logged("a"))

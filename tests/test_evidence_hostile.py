"""Hostile values in the evidence fields never crash reconstruction: each sample still
gets its row, with a finding or the evidence ignored, and `ok` only with exact ids."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenbridge.exchanges import RecordError
from tokenbridge.reconstruct import reconstruct_record

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
entries = st.lists(st.fixed_dictionaries({}, optional={"token": json_values, "bytes": json_values,
                                                       "logprob": json_values}), max_size=6)


def _base(kimi):
    from tokenbridge.chat import DIALECTS

    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ids = kimi.encode("Thinking.") + [kimi.token_id("</think>")] + kimi.encode("Hello.") + [kimi.token_id("<|im_end|>")]
    prompt = len(kimi.encode(DIALECTS["kimi-k2.5"].render_request(request)))
    return ids, {"id": "h", "request": request, "response": {
        "provider": "P", "usage": {"prompt_tokens": prompt, "completion_tokens": len(ids)},
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "reasoning": "Thinking.", "content": "Hello."}}]}}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(logprobs=json_values | st.fixed_dictionaries({"content": entries | json_values}),
       matched_stop=json_values, details=json_values, usage_details=json_values, cached=json_values)
def test_hostile_evidence_is_a_finding_or_ignored_never_a_crash(kimi, logprobs, matched_stop, details,
                                                                 usage_details, cached):
    truth, rec = _base(kimi)
    rec = copy.deepcopy(rec)
    choice = rec["response"]["choices"][0]
    choice["logprobs"] = logprobs
    choice["matched_stop"] = matched_stop
    choice["message"]["reasoning_details"] = details
    rec["response"]["usage"]["completion_tokens_details"] = usage_details
    rec["response"]["usage"]["prompt_tokens_details"] = cached
    try:
        rows = reconstruct_record(rec, kimi)
    except RecordError as exc:  # a malformed reasoning_details is a bad record that names its field
        assert exc.field.startswith("response.choices[0].message.reasoning_details")
        return
    row, = rows
    if row["status"] == "ok":
        assert row["completion_ids"] == truth


def test_logprobs_that_are_not_an_object_are_unreadable_not_taken_for_none(kimi):
    """``logprobs: 5`` read as no logprobs at all; a 5000-digit ``token_id:`` raised int()'s
    digit limit. Both are evidence that cannot be read, and say so."""
    from tokenbridge.evidence import LogprobIds, logprob_ids

    for value, problem in [(5, "logprobs is not an object (int)"), ("x", "logprobs is not an object (str)"),
                           ([{"token": "a"}], "logprobs is not an object (list)"),
                           ({"content": 5}, "logprobs.content is not a list")]:
        assert logprob_ids(kimi, {"logprobs": value}) == LogprobIds(None, problem)
    for value in (None, {}, {"content": None}, False, []):
        assert logprob_ids(kimi, {"logprobs": value}) is None  # nothing was logged
    for tail in ("9" * 5000, "²", "１２", "-5", str(kimi.vocab_size), str(2**32)):
        found = logprob_ids(kimi, {"logprobs": {"content": [{"token": "token_id:" + tail}]}})
        assert found is not None and found.ids is None and "names no id of this tokenizer" in (found.problem or "")
    _, rec = _base(kimi)
    rec["response"]["choices"][0]["logprobs"] = 5
    (row,) = reconstruct_record(rec, kimi)
    assert [f["code"] for f in row["findings"]] == ["logprobs_unreadable"] and row["status"] == "flagged"


def test_an_optional_evidence_field_no_engine_writes_is_named_not_read_as_absent_in_silence(kimi):
    """``reasoning_tokens: -1`` or ``native_finish_reason: 5`` were read as absent with no
    word: the ids still stand on the rest (exact here), and the row says what was set aside."""
    truth, base = _base(kimi)
    cases = [
        (("usage", "completion_tokens_details"), {"reasoning_tokens": -1},
         "usage.completion_tokens_details.reasoning_tokens is -1, not a count: read as absent"),
        (("usage", "completion_tokens_details"), "3", "usage.completion_tokens_details is '3', not an object: read as absent"),
        (("usage", "prompt_tokens_details"), {"cached_tokens": 2.5},
         "usage.prompt_tokens_details.cached_tokens is 2.5, not a count: read as absent"),
        (("choice", "matched_stop"), True, "matched_stop is True, not a stop id or string: read as absent"),
        (("choice", "stop_reason"), [163586], "stop_reason is [163586], not a stop id or string: read as absent"),
        (("choice", "native_finish_reason"), 5, "native_finish_reason is 5, not a string: read as absent"),
        (("choice", "native_finish_reason"), {"x": "y" * 80},
         "native_finish_reason is {'x': '" + "y" * 30 + "..., not a string: read as absent"),  # 40 characters shown
    ]
    for (where, key), value, message in cases:
        rec = copy.deepcopy(base)
        holder = rec["response"]["usage"] if where == "usage" else rec["response"]["choices"][0]
        holder[key] = value
        (row,) = reconstruct_record(rec, kimi)
        assert (row["status"], row["completion_ids"]) == ("flagged", truth)
        assert [(f["code"], f["message"]) for f in row["findings"]] == [("evidence_malformed", message)]
    for (where, key), value in [(("usage", "completion_tokens_details"), {"reasoning_tokens": None}),
                                (("usage", "prompt_tokens_details"), None), (("choice", "matched_stop"), None),
                                (("choice", "native_finish_reason"), "stop"),
                                (("choice", "matched_stop"), kimi.token_id("<|im_end|>"))]:
        rec = copy.deepcopy(base)
        (rec["response"]["usage"] if where == "usage" else rec["response"]["choices"][0])[key] = value
        (row,) = reconstruct_record(rec, kimi)
        assert (row["status"], row["findings"]) == ("ok", []), (key, value)


def test_a_usage_count_no_engine_writes_is_said_as_it_was_written(kimi, tmp_path):
    """A count past 64 bits (orjson reads it as a float: ``1e+25`` misquotes the digits), a
    string or a negative count is said as what it is, beside the counts that are absent."""
    import json

    from tokenbridge.reconstruct import reconstruct_file

    _, base = _base(kimi)
    cases = [
        ({"completion_tokens": 10**25}, "usage.completion_tokens is a number past 64 bits, not a count"),
        ({"prompt_tokens": "39"}, "usage.prompt_tokens is '39', not a count"),
        ({"prompt_tokens": None, "completion_tokens": -1},
         "usage has no integer prompt_tokens; usage.completion_tokens is -1, not a count"),
        ({"completion_tokens": -(2**63) - 1}, "usage.completion_tokens is a number past 64 bits, not a count"),
        ({"completion_tokens_details": {"reasoning_tokens": 2**64}},
         "usage.completion_tokens_details.reasoning_tokens is a number past 64 bits, not a count: read as absent"),
    ]
    lines = []
    for k, (change, _) in enumerate(cases):
        rec = copy.deepcopy(base)
        rec["id"] = f"h{k}"
        rec["response"]["usage"].update(change)
        lines.append(json.dumps(rec))
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    reconstruct_file(src, tmp_path / "out.jsonl", kimi, workers=1)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    said = [[f["message"] for f in row["findings"]] for row in rows]
    assert said == [[cases[0][1] + ": that count is not checked"], [cases[1][1] + ": that count is not checked"],
                    [cases[2][1] + ": that count is not checked"], [cases[3][1] + ": that count is not checked"],
                    [cases[4][1]]]

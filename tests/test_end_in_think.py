"""A Kimi K2.5 turn that ended inside its think block (``R<|im_end|>``, no ``</think>``).

SGLang's ``kimi_k2`` reasoning parser (the real one, sglang 0.5.23, force_reasoning)
serves that turn exactly as it serves ``R</think><|im_end|>``: reasoning ``R``, empty
content. The two are one token apart, the same gap as a provider that leaves its end
token uncounted, so the ``end_in_think`` reading is offered only where something tells
them apart: ground-truth ids, logprobs, or a run that proved the provider counts its end
token. Without that, the count rejects the sample, as before.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from test_families_support import import_sglang_reasoning
from tokenbridge.chat import DIALECTS
from tokenbridge.reconstruct import reconstruct_file, reconstruct_record

REQUEST = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Say something."}]}


def _served(kimi, kimi_dir, native: list[int]) -> dict[str, Any]:
    """What SGLang returns for ``native``: the matched stop trimmed, special tokens skipped
    in the decode, the reasoning split by the real ``kimi_k2`` parser."""
    parser_cls = import_sglang_reasoning()
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    skipped = {int(k) for k, v in config["added_tokens_decoder"].items() if v.get("special")}
    end = kimi.token_id("<|im_end|>")
    body, finish = (native[:-1], "stop") if native[-1] == end else (native, "length")
    text = kimi.decode_bytes([i for i in body if i not in skipped]).decode("utf-8")
    reasoning, content = parser_cls("kimi_k2", stream_reasoning=False, force_reasoning=True).parse_non_stream(text)
    return {"role": "assistant", "reasoning_content": reasoning or None, "content": content or ""}, finish


def _record(kimi, kimi_dir, i: int, provider: str, native: list[int], *, counted: int | None = None,
            with_native: bool = False, logprobs: bool = False) -> dict[str, Any]:
    message, finish = _served(kimi, kimi_dir, native)
    prompt = len(kimi.encode(DIALECTS["kimi-k2.5"].render_request(REQUEST)))
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if logprobs:
        choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": -0.1, "bytes": None,
                                           "top_logprobs": []} for t in native]}
    rec: dict[str, Any] = {"id": f"{provider}-{i}", "request": REQUEST, "response": {
        "provider": provider, "choices": [choice],
        "usage": {"prompt_tokens": prompt, "completion_tokens": len(native) if counted is None else counted}}}
    if with_native:
        rec["native_ids"] = native
    return rec


def _closed(kimi, reasoning: str, content: str = "") -> list[int]:
    """``reasoning</think>content<|im_end|>``: the formula."""
    return [*kimi.encode(reasoning), kimi.token_id("</think>"), *kimi.encode(content), kimi.token_id("<|im_end|>")]


def _in_think(kimi, reasoning: str) -> list[int]:
    """``reasoning<|im_end|>``: the turn ended inside its think block."""
    return [*kimi.encode(reasoning), kimi.token_id("<|im_end|>")]


def _run(tmp_path, records: list[dict[str, Any]], kimi) -> tuple[dict[str, dict[str, Any]], Any]:
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    summary = reconstruct_file(src, dst, kimi, workers=1)
    return {r["id"]: r for r in map(json.loads, dst.read_text(encoding="utf-8").splitlines())}, summary


def test_sglang_serves_both_turns_alike(kimi, kimi_dir):
    """The premise, from the real parser: nothing in the text tells the two apart."""
    a = _served(kimi, kimi_dir, _closed(kimi, "Let me think about it."))
    b = _served(kimi, kimi_dir, _in_think(kimi, "Let me think about it."))
    assert a == b == ({"role": "assistant", "reasoning_content": "Let me think about it.", "content": ""}, "stop")


@pytest.mark.parametrize("evidence", ["native", "logprobs"])
@pytest.mark.parametrize("ended_in_think", [True, False])
def test_ids_prove_which_turn_it_was(kimi, kimi_dir, evidence, ended_in_think):
    native = (_in_think if ended_in_think else _closed)(kimi, "Hmm, nothing more to say.")
    rec = _record(kimi, kimi_dir, 0, "p", native, with_native=evidence == "native", logprobs=evidence == "logprobs")
    row, = reconstruct_record(rec, kimi)
    assert row["completion_ids"] == native
    reading, kinds = ("end_in_think", ["reasoning", "end"]) if ended_in_think else (None, ["reasoning", "think_end", "end"])
    assert (row["status"], row["findings"], row["reconstruction"]) == ("ok", [], reading)
    assert [s["kind"] for s in row["segments"]] == ["prompt", *kinds]


def test_the_count_alone_does_not_offer_the_reading(kimi, kimi_dir):
    """One sample, usage only: one short of the formula is also what a provider that
    leaves its end token uncounted shows. Rejected, never read as ended in think."""
    native = _in_think(kimi, "Hmm, nothing more to say.")
    row, = reconstruct_record(_record(kimi, kimi_dir, 0, "p", native), kimi)
    assert row["status"] == "rejected" and row["reconstruction"] is None
    assert [f["code"] for f in row["findings"]] == ["usage_completion_mismatch"]


def _normal(kimi, kimi_dir, provider: str, n: int, *, delta: int = 0) -> list[dict[str, Any]]:
    return [_record(kimi, kimi_dir, i, provider, native := _closed(kimi, f"Thinking about {i}.", f"Answer {i}."),
                    counted=len(native) + delta) for i in range(n)]


def test_a_run_that_proves_the_end_is_counted_lets_the_count_read_it(tmp_path, kimi, kimi_dir):
    in_think, closed = _in_think(kimi, "I will stop here."), _closed(kimi, "I will stop there.")
    records = [*_normal(kimi, kimi_dir, "p", 20), _record(kimi, kimi_dir, 100, "p", in_think),
               _record(kimi, kimi_dir, 101, "p", closed)]
    rows, summary = _run(tmp_path, records, kimi)
    assert rows["p-100"]["completion_ids"] == in_think
    assert (rows["p-100"]["status"], rows["p-100"]["reconstruction"]) == ("ok", "end_in_think")
    # the closed block: a token the engine hid in place of </think> (a <think> its parser deletes,
    # a special skipped) is served the same at the same count; no ids, logprobs or reasoning_tokens
    assert rows["p-101"]["completion_ids"] == closed
    assert (rows["p-101"]["status"], rows["p-101"]["reconstruction"]) == ("rejected", None)
    assert [f["code"] for f in rows["p-101"]["findings"]] == ["reconstruction_ambiguous"]
    assert "token_hidden" in rows["p-101"]["findings"][0]["message"]
    assert summary.status == {"ok": 21, "rejected": 1}
    trait = summary.traits["p"]
    assert trait.end_counted and not trait.end_uncounted
    assert trait.describe() == "completion_tokens counts the end token"


def test_too_few_samples_prove_nothing(tmp_path, kimi, kimi_dir):
    in_think = _in_think(kimi, "I will stop here.")
    rows, summary = _run(tmp_path, [*_normal(kimi, kimi_dir, "p", 19), _record(kimi, kimi_dir, 100, "p", in_think)], kimi)
    assert rows["p-100"]["status"] == "rejected" and rows["p-100"]["reconstruction"] is None
    assert summary.traits == {}


def test_an_uncounted_end_is_never_read_as_ended_in_think(tmp_path, kimi, kimi_dir):
    """A provider that never counts its end token: a closed empty block is one short of
    the formula, as a turn ended inside its block would be under a counted end. The run
    calibrates the count, and the closed block is read as what it is."""
    closed = _closed(kimi, "I will stop there.")
    records = [*_normal(kimi, kimi_dir, "lazy", 20, delta=-1),
               _record(kimi, kimi_dir, 100, "lazy", closed, counted=len(closed) - 1)]
    rows, summary = _run(tmp_path, records, kimi)
    assert rows["lazy-100"]["completion_ids"] == closed  # read as closed, not as ended in think
    assert [f["code"] for f in rows["lazy-100"]["findings"]] == ["reconstruction_ambiguous"]  # a hidden token ties it
    assert "end_in_think" not in rows["lazy-100"]["findings"][0]["message"]
    trait = summary.traits["lazy"]
    assert trait.end_uncounted and not trait.end_counted


def test_no_trait_and_no_second_pass_without_a_sample_that_needs_it(tmp_path, kimi, kimi_dir):
    """Proving the end is counted matters only where a sample could have ended in think:
    a run without one gets no trait (so no second pass)."""
    rows, summary = _run(tmp_path, _normal(kimi, kimi_dir, "p", 25), kimi)
    assert summary.status == {"ok": 25} and summary.traits == {}


def test_a_provider_that_sometimes_leaves_its_end_uncounted_proves_nothing(tmp_path, kimi, kimi_dir):
    """20 of 22 ended samples counted with the end token (91%) and two without it (a second
    deployment): a closed empty block from the second kind is one short of the formula, as
    a turn ended in think would be. The run must not read it so."""
    closed = _closed(kimi, "I will stop there.")
    records = [*_normal(kimi, kimi_dir, "p", 20), *_normal(kimi, kimi_dir, "p", 2, delta=-1)[:2],
               _record(kimi, kimi_dir, 100, "p", closed, counted=len(closed) - 1)]
    for k, rec in enumerate(records[20:22]):
        rec["id"] = f"p-lazy-{k}"
    rows, summary = _run(tmp_path, records, kimi)
    assert rows["p-100"]["status"] == "rejected" and rows["p-100"]["reconstruction"] is None
    assert "p" not in summary.traits or not summary.traits["p"].end_counted


def _vllm_logprobs(kimi, native: list[int]) -> dict[str, Any]:
    """vLLM's entries: bytes from each token's decoded text, a special token's skipped."""
    out = []
    for t in native:
        text = "" if t in kimi.marker_ids else kimi.token_bytes(t).decode("utf-8", "replace")
        out.append({"token": text, "bytes": list(text.encode("utf-8")), "logprob": -0.1, "top_logprobs": []})
    return {"content": out}


def test_logprobs_that_skip_the_markers_do_not_offer_the_reading(kimi, kimi_dir):
    """With the markers' texts skipped, either turn's logprobs fit either reading (an
    unknown logged id stands for a marker): they prove no more than the count, so the
    reading waits for a run that proved the end counted, as with the count alone."""
    closed = _closed(kimi, "Hmm, nothing more to say.")
    rec = _record(kimi, kimi_dir, 0, "p", closed, counted=len(closed) - 1)  # a provider leaving its end uncounted
    rec["response"]["choices"][0]["logprobs"] = _vllm_logprobs(kimi, closed)
    row, = reconstruct_record(rec, kimi)
    assert row["status"] == "rejected" and row["reconstruction"] is None


@pytest.mark.parametrize("ended_in_think", [True, False])
def test_logprobs_with_partial_characters_but_known_markers_still_tell_the_turns_apart(kimi, kimi_dir,
                                                                                     ended_in_think):
    """A part of a character logged as U+FFFD is no marker: where every marker is logged by
    its text (SGLang with special tokens kept), the logprobs still tell R<|im_end|> from
    R</think><|im_end|> (a review found every sample with an emoji in its reasoning rejected)."""
    reasoning = "Hmm \U00013000 nothing."
    native = (_in_think if ended_in_think else _closed)(kimi, reasoning)
    entries = []
    for t in native:
        text = kimi.token_bytes(t).decode("utf-8", "replace")
        entries.append({"token": text, "bytes": list(text.encode("utf-8")), "logprob": -0.1, "top_logprobs": []})
    assert any("\ufffd" in e["token"] for e in entries)  # the reasoning holds a partial-character token
    rec = _record(kimi, kimi_dir, 0, "p", native)
    rec["response"]["choices"][0]["logprobs"] = {"content": entries}
    row, = reconstruct_record(rec, kimi)
    assert row["completion_ids"] == native
    assert (row["status"], row["reconstruction"]) == ("ok", "end_in_think" if ended_in_think else None), row["findings"]


def _two(kimi, kimi_dir, first: list[int], second: list[int], *, logprobs: bool = False) -> dict[str, Any]:
    """One record, n = 2: each choice served by the real parser, usage summed over both."""
    a = _record(kimi, kimi_dir, 0, "p", first, logprobs=logprobs)
    b = _record(kimi, kimi_dir, 1, "p", second, logprobs=logprobs)
    choice_b = {**b["response"]["choices"][0], "index": 1}
    a["response"]["choices"].append(choice_b)
    a["response"]["usage"]["completion_tokens"] = len(first) + len(second)
    return a


def _cut_after_close(kimi, reasoning: str) -> list[int]:
    """``reasoning</think>``, cut by length right after the close: served as reasoning alone."""
    return [*kimi.encode(reasoning), kimi.token_id("</think>")]


def test_two_choices_whose_count_errors_cancel_prove_neither(kimi, kimi_dir):
    """A cold tester's record: choice 0 ended inside its think block (the formula adds a
    ``</think>``: one id too many), choice 1 was cut right after ``</think>`` (the formula
    leaves it out: one too few). The summed usage fits; before, choice 0 was ``ok``."""
    first, second = _in_think(kimi, "Nothing to add."), _cut_after_close(kimi, "Let me think more")
    rows = reconstruct_record(_two(kimi, kimi_dir, first, second), kimi)
    assert [r["completion_ids"] == n for r, n in zip(rows, (first, second))] == [False, False]  # the premise
    assert [r["status"] for r in rows] == ["rejected", "rejected"]
    assert [[f["code"] for f in r["findings"]] for r in rows] == [["reconstruction_ambiguous", "choices_unattributable"],
                                                                   ["truncated", "choices_unattributable"]]


def test_the_same_shapes_are_unproven_even_when_the_formula_was_right(kimi, kimi_dir):
    """The same served text from the formula's turns: the sum fits as well, and nothing
    tells the two records apart, so this one is unproven too (the price of the first)."""
    first, second = _closed(kimi, "Nothing to add."), kimi.encode("Let me think more")
    rows = reconstruct_record(_two(kimi, kimi_dir, first, second), kimi)
    assert [r["completion_ids"] == n for r, n in zip(rows, (first, second))] == [True, True]
    assert [r["status"] for r in rows] == ["rejected", "rejected"]


def test_logprobs_on_both_choices_read_each_exactly(kimi, kimi_dir):
    first, second = _in_think(kimi, "Nothing to add."), _cut_after_close(kimi, "Let me think more")
    rows = reconstruct_record(_two(kimi, kimi_dir, first, second, logprobs=True), kimi)
    assert [r["completion_ids"] for r in rows] == [first, second]
    assert [(r["status"], r["reconstruction"]) for r in rows] == [("ok", "end_in_think"),
                                                                  ("flagged", "cut_after_think_close")]


def test_a_cut_beside_a_choice_with_content_is_not_marked(kimi, kimi_dir):
    """Only a turn that may have ended inside its think block can cancel a cut's missing id."""
    first, second = _closed(kimi, "Thinking.", "The answer."), kimi.encode("Let me think more")
    rows = reconstruct_record(_two(kimi, kimi_dir, first, second), kimi)
    assert [r["completion_ids"] for r in rows] == [first, second]
    assert [(r["status"], [f["code"] for f in r["findings"]]) for r in rows] == [("ok", []), ("flagged", ["truncated"])]


@pytest.mark.parametrize("logged", [[], ["<|im_end|>"]])
def test_logprobs_of_the_end_token_alone_prove_no_reading(kimi, logged):
    """A turn with reasoning, no content and an exact count: logprobs that log nothing, or
    the end token alone, were taken as the formula's content cover, which a turn that ended
    in its think block (or held a token the engine hid) cannot have, so the formula passed
    ``ok``. They see nothing of the think block: the row is as ambiguous as with no
    logprobs (a reviewer's)."""
    from tokenbridge.evidence import logprobs_cover

    end = kimi.token_id("<|im_end|>")
    closed = _closed(kimi, "Nothing more to say.")
    assert logprobs_cover([], closed, len(closed) - 1, True) == "none"
    assert logprobs_cover([end], closed, len(closed) - 1, True) == "none"
    assert logprobs_cover([end], [end], 0, True) == "all"
    request = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Say something."}]}
    prompt = kimi.encode(DIALECTS["kimi-k2.5"].render_request(request))
    entries = [{"token": t, "logprob": -0.1, "bytes": list(t.encode()), "top_logprobs": []} for t in logged]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "logprobs": {"content": entries},
                             "message": {"role": "assistant", "reasoning": "Nothing more to say.", "content": ""}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(closed)}}
    row, = reconstruct_record({"id": "e", "request": request, "response": response}, kimi)
    assert row["status"] == "rejected" and [f["code"] for f in row["findings"]] == ["reconstruction_ambiguous"]


@pytest.mark.parametrize("logprobs", [None, {"content": []}])
def test_a_hidden_token_picked_by_its_count_is_never_placed_ok(kimi, logprobs):
    """SGLang's ``reasoning_tokens`` counts every id of a turn that never closed its block,
    so it can pick the ``token_hidden`` reading; but which place the hidden ``<think>`` had
    only ids or logprobs over the think block say. Empty logprobs placed it: ``ok`` with a
    guessed place (a self-review's)."""
    request = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Say something."}]}
    prompt = kimi.encode(DIALECTS["kimi-k2.5"].render_request(request))
    reasoning = "Nothing more to say."
    truth = [kimi.token_id("<think>"), *kimi.encode(reasoning), kimi.token_id("<|im_end|>")]
    choice = {"index": 0, "finish_reason": "stop", "matched_stop": kimi.token_id("<|im_end|>"),
              "message": {"role": "assistant", "reasoning_content": reasoning, "content": ""}}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    response = {"choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(truth),
                                               "completion_tokens_details": {"reasoning_tokens": len(truth)}}}
    row, = reconstruct_record({"id": "u", "request": request, "response": response}, kimi)
    assert (row["status"], row["reconstruction"]) == ("rejected", "token_hidden")
    assert [f["code"] for f in row["findings"]] == ["reconstruction_ambiguous"]

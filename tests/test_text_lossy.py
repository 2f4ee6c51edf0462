"""U+FFFD in served text where ground-truth ids hold the bytes it stands for.

A length cut inside a character is served as U+FFFD (SGLang decodes the cut bytes with
``errors="replace"``), while its ``response_token_ids`` (or vLLM's ``token_ids``) and its
byte-level logprobs carry the bytes the model emitted: the sample is provable, and was
rejected (``replacement_char``, ``native_mismatch`` / ``logprobs_mismatch``) with ids that
spelled the replacement character instead of the model's bytes."""

from __future__ import annotations

import pytest

from tokenbridge.export.writers import ConversationsWriter
from tokenbridge.reconstruct import reconstruct_record

MESSAGES = [{"role": "user", "content": "Say something in Chinese."}]
REASONING = "The user wants Chinese."
#: U+1D11E is no token of Kimi's: its four bytes are three byte-level tokens (F0 9D, 84, 9E)
CONTENT = "好的，这是一个测试\U0001d11e"


def _record(kimi, completion_ids, content, finish, evidence):
    from tokenbridge.chat import DIALECTS

    prompt_ids = kimi.encode_prompt(DIALECTS["kimi-k2.5"].render_request({"messages": MESSAGES}))
    choice = {"index": 0, "finish_reason": finish,
              "message": {"role": "assistant", "reasoning": REASONING, "content": content}}
    if evidence == "sglang_ids":
        choice.update(prompt_token_ids=prompt_ids, response_token_ids=completion_ids)
    elif evidence == "vllm_ids":
        choice["token_ids"] = completion_ids
    elif evidence == "sglang_logprobs":  # a byte-level tokenizer's true bytes, the decoded text as token
        choice["logprobs"] = {"content": [
            {"token": kimi.decode_bytes([i]).decode("utf-8", "replace"), "bytes": list(kimi.decode_bytes([i])),
             "logprob": -0.5, "top_logprobs": []} for i in completion_ids]}
    response = {"id": "gen-1", "provider": "Test", "model": "moonshotai/kimi-k2.5", "choices": [choice],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids)}}
    if evidence == "vllm_ids":
        response["prompt_token_ids"] = prompt_ids
    return {"id": "s1", "request": {"model": "moonshotai/kimi-k2.5", "messages": MESSAGES}, "response": response}


def _full(kimi):
    return kimi.encode(REASONING) + [kimi.token_id("</think>")] + kimi.encode(CONTENT)


def codes(row):
    return sorted(f["code"] for f in row["findings"])


@pytest.mark.parametrize("evidence", ["sglang_ids", "vllm_ids", "sglang_logprobs"])
@pytest.mark.parametrize("short", [1, 2])
def test_a_cut_inside_a_character_takes_the_truths_bytes(kimi, evidence, short):
    full = _full(kimi)
    assert [kimi.decode_bytes([i]) for i in full[-3:]] == [b"\xf0\x9d", b"\x84", b"\x9e"]
    ids = full[:-short]
    served = kimi.decode_bytes(kimi.encode(CONTENT)[:-short]).decode("utf-8", "replace")
    assert served == "好的，这是一个测试\ufffd"
    row, = reconstruct_record(_record(kimi, ids, served, "length", evidence), kimi)
    assert row["completion_ids"] == ids
    assert codes(row) == ["text_lossy", "truncated"] and row["status"] == "flagged"
    assert row["reconstruction"] == "bytes=ids"
    assert row["content"] == served  # the text as served: it cannot spell the ids
    assert ConversationsWriter().skip(row)  # cut anyway; a lossy text is never a chat turn


def test_without_ground_truth_the_replacement_character_is_still_an_error(kimi):
    ids = _full(kimi)[:-1]
    served = kimi.decode_bytes(kimi.encode(CONTENT)[:-1]).decode("utf-8", "replace")
    row, = reconstruct_record(_record(kimi, ids, served, "length", None), kimi)
    assert codes(row) == ["replacement_char", "truncated", "usage_completion_mismatch"] and row["status"] == "rejected"
    assert row["completion_ids"] != ids and row["reconstruction"] is None


def test_bytes_that_are_no_character_mid_text_are_read_from_the_ids(kimi):
    """A stray continuation byte the model wrote between two words, the turn then ended:
    the ids are exact and the row is flagged, and a text export leaves it out."""
    stray = next(i for i in range(kimi.vocab_size) if kimi.decode_bytes([i]) == b"\x84")
    body = kimi.encode("ab ") + [stray] + kimi.encode(" cd")
    ids = kimi.encode(REASONING) + [kimi.token_id("</think>")] + body + [kimi.token_id("<|im_end|>")]
    served = kimi.decode_bytes(body).decode("utf-8", "replace")
    assert served == "ab \ufffd cd"
    row, = reconstruct_record(_record(kimi, ids, served, "stop", "sglang_ids"), kimi)
    assert row["completion_ids"] == ids and codes(row) == ["text_lossy"] and row["status"] == "flagged"
    assert ConversationsWriter().skip(row)


def test_logprobs_without_the_end_token_still_place_the_bytes(kimi):
    stray = next(i for i in range(kimi.vocab_size) if kimi.decode_bytes([i]) == b"\x84")
    body = kimi.encode("ab ") + [stray] + kimi.encode(" cd")
    ids = kimi.encode(REASONING) + [kimi.token_id("</think>")] + body + [kimi.token_id("<|im_end|>")]
    rec = _record(kimi, ids[:-1], kimi.decode_bytes(body).decode("utf-8", "replace"), "stop", "sglang_logprobs")
    rec["response"]["usage"]["completion_tokens"] = len(ids)
    row, = reconstruct_record(rec, kimi)
    assert row["completion_ids"] == ids and codes(row) == ["text_lossy"]


def test_a_replacement_character_the_ids_spell_is_the_models_own(kimi):
    """The model wrote U+FFFD itself (its ids spell EF BF BD): nothing was lost."""
    content = "Broken input shows as \ufffd here."
    ids = kimi.encode(REASONING) + [kimi.token_id("</think>")] + kimi.encode(content) + [kimi.token_id("<|im_end|>")]
    row, = reconstruct_record(_record(kimi, ids, content, "stop", "vllm_ids"), kimi)
    assert row["completion_ids"] == ids and row["findings"] == [] and row["status"] == "ok"
    assert row["reconstruction"] is None


def _byte(kimi, b):
    return next(i for i in range(kimi.vocab_size) if kimi.decode_bytes([i]) == b)


def test_another_broken_character_is_what_the_truth_says(kimi):
    """The served U+FFFD cannot say which bytes it replaced; the ids can."""
    ids = _full(kimi)[:-3] + [_byte(kimi, b"\xe4"), _byte(kimi, b"\xb8")]
    row, = reconstruct_record(_record(kimi, ids, "好的，这是一个测试\ufffd", "length", "sglang_ids"), kimi)
    assert row["completion_ids"] == ids and codes(row) == ["text_lossy", "truncated"]


def test_truth_that_spells_a_whole_character_is_not_taken(kimi):
    """Ids whose bytes decode to another text than the served one prove nothing here: the
    text says a broken character, the ids spell a whole one."""
    ids = _full(kimi)
    row, = reconstruct_record(_record(kimi, ids, "好的，这是一个测试\ufffd", "length", "sglang_ids"), kimi)
    assert codes(row) == ["native_mismatch", "replacement_char", "truncated", "usage_completion_mismatch"]
    assert row["status"] == "rejected"
    assert row["completion_ids"] != ids


def test_two_lossy_parts_are_not_split_by_guess(kimi):
    """U+FFFD in the reasoning and in the content: where one part's ids end is not known
    from the text, so nothing is taken (the row stays rejected)."""
    stray = _byte(kimi, b"\x84")
    reasoning = kimi.encode("x ") + [stray]
    body = kimi.encode("ab ") + [stray]
    ids = reasoning + [kimi.token_id("</think>")] + body + [kimi.token_id("<|im_end|>")]
    rec = _record(kimi, ids, "ab \ufffd", "stop", "sglang_ids")
    rec["response"]["choices"][0]["message"]["reasoning"] = "x \ufffd"
    row, = reconstruct_record(rec, kimi)
    assert "replacement_char" in codes(row) and row["status"] == "rejected" and row["reconstruction"] is None


def test_a_broken_character_before_the_end_token_is_placed_by_logprobs_without_it(kimi):
    """The model wrote two of a character's three byte tokens, then ended its turn; the
    logprobs leave out the end token. One id short also decodes to one U+FFFD, so the first
    place tried was the wrong one and the sample was rejected (a cold reviewer's): each place
    is a reading now, and the logprobs pick."""
    body = kimi.encode("ab ") + kimi.encode(CONTENT)[-3:-1]
    ids = kimi.encode(REASONING) + [kimi.token_id("</think>")] + body + [kimi.token_id("<|im_end|>")]
    served = kimi.decode_bytes(body).decode("utf-8", "replace")
    assert served == "ab \ufffd"
    for logged in (ids, ids[:-1]):
        rec = _record(kimi, logged, served, "stop", "sglang_logprobs")
        rec["response"]["usage"]["completion_tokens"] = len(ids)
        row, = reconstruct_record(rec, kimi)
        assert row["completion_ids"] == ids and codes(row) == ["text_lossy"] and row["reconstruction"] == "bytes=ids"

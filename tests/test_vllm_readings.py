"""What vLLM 0.34 serves, read back: the records its own code served for these model texts
(tests/test_vllm_oracle.py runs each case through vLLM and checks the served fields are
these), pinned here so that they run without vLLM installed.

vLLM 0.34's parser engine strips the whitespace at the end of the reasoning (Kimi, GLM), its
slow-tokenizer detokenizer joins Kimi's added tokens to their neighbours with a space (the
first text after the prompt's ``<think>`` too), its streaming lexer holds back a text that
may begin a marker and then drops the whitespace before it, its ``kimi_k2`` tool parser
swallows a tool section with no ``tools`` sent, GLM's newline before ``<think>`` stays in
the reasoning whole and streamed, it names a ``stop_token_ids`` hit in ``stop_reason`` and
leaves the tokenizer's own eos unnamed, and its ``reasoning_tokens`` counts what it reads as
reasoning (streamed, less). Each case passed ``ok`` (or flagged ``truncated`` alone) with
wrong ids before the gate knew this, or was rejected with the ids provable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from conftest import KIMI_DIR
from test_families_support import SHARED
from tokenbridge.chat import resolve_dialect
from tokenbridge.reconstruct import reconstruct_record
from tokenbridge.tokenizer import load_tokenizer
from tokenbridge.traits import ProviderTrait

ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"
CALL_HEADER = "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
#: The dialect that renders a family's prompt as vLLM does (the folder's template where absent).
VLLM_DIALECTS = {"gpt-oss": "gpt-oss-harmony"}
#: When the pinned records were served (2025-01-01 12:00 UTC): gpt-oss's prompt prints the day.
CREATED = 1735732800
SECTION = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}"
           "<|tool_call_end|><|tool_calls_section_end|>")


@dataclass(frozen=True)
class Served:
    """A model text and what vLLM 0.34 served for it (the oracle checks the served part)."""

    name: str
    family: str
    text: str
    end: str
    message: dict[str, Any]
    finish: str
    stop_reason: int | None
    reasoning_tokens: int
    stream: bool = False
    thinking: bool = True
    cut: int | None = None
    #: the gate's verdict alone, and with the run trait a vLLM Kimi run shows (``joins_markers``):
    #: "ok" (exact ids) or the error codes of a rejection
    alone: tuple[str, ...] = ("reconstruction_ambiguous",)
    joined: tuple[str, ...] | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)


CASES = [
    # the parser strips the join space before </think> (and any whitespace the model wrote
    # there), so the joined reading no longer fitted and the formula's join spaces passed
    Served("kimi_stripped_join", "kimi-k2.5", "The user asks.</think>Sure.", "<|im_end|>",
           {"reasoning": " The user asks.", "content": " Sure."}, "stop", 163586, 4,
           joined=("reconstruction_ambiguous",)),  # "asks.\n" is as many tokens as "asks."
    Served("kimi_stripped_join_word", "kimi-k2.5", "Think</think>Answer", "<|im_end|>",
           {"reasoning": " Think", "content": " Answer"}, "stop", 163586, 1, joined=("ok",)),
    # instant mode: the first text carries the join space to the prompt's </think>, no marker shows
    Served("kimi_instant_leading_join", "kimi-k2.5", "Hi there", "<|im_end|>",
           {"reasoning": None, "content": " Hi there"}, "stop", 163586, 0, thinking=False, joined=("ok",)),
    # [EOS] is the tokenizer's eos: stop_reason null; <|im_end|> is named 163586
    Served("kimi_eos_unnamed", "kimi-k2.5", "Think</think>Answer", "[EOS]",
           {"reasoning": " Think", "content": " Answer"}, "stop", None, 1, joined=("reconstruction_ambiguous",)),
    # streamed, reasoning_tokens leaves out an id that completes no character: it ruled out the
    # true reading (a space the parser stripped) and kept a wrong one
    Served("kimi_streamed_count_undercounts", "kimi-k2.5", "😀 ", "<|im_end|>",
           {"reasoning": " 😀", "content": ""}, "stop", 163586, 2, stream=True,
           joined=("reconstruction_ambiguous",)),
    # streamed, each id that completes no character of its own (a split emoji, a rare Han
    # character) goes uncounted: the provable sample was rejected on reasoning_tokens
    Served("qwen3_streamed_split_chars", "qwen3", "<think>\nThe user likes 龘 and 😀\n</think>\n\nOk.", "<|im_end|>",
           {"reasoning": "\nThe user likes 龘 and 😀\n", "content": "\n\nOk."}, "stop", None, 8, stream=True,
           alone=("ok",)),
    Served("kimi_streamed_split_char", "kimi-k2.5", "用户喜欢😀和龘</think>好的😀", "<|im_end|>",
           {"reasoning": " 用户喜欢😀和龘", "content": " 好的😀"}, "stop", 163586, 5, stream=True,
           alone=("ok",), joined=("ok",)),
    Served("kimi_streamed_split_char_cut", "kimi-k2.5", "用户喜欢😀和龘。好</think>好的😀", "<|im_end|>",
           {"reasoning": " 用户喜欢😀和龘", "content": ""}, "length", None, 5, stream=True, cut=7,
           alone=("ok",), joined=("ok",)),
    # streamed, the lexer held " <" to the end and sent "<" without its spaces
    Served("kimi_streamed_held_start", "kimi-k2.5", " <</think>", "<|im_end|>",
           {"reasoning": "<", "content": ""}, "length", None, 1, stream=True, cut=1,
           alone=("reconstruction_ambiguous",), joined=("reconstruction_ambiguous",)),
    # no tools sent, yet the tool parser swallowed the section's start; its join space stayed
    Served("kimi_cut_section_swallowed", "kimi-k2.5", "Done</think>Ok" + SECTION, "<|im_end|>",
           {"reasoning": " Done", "content": " Ok "}, "length", None, 1, cut=4,
           joined=("reconstruction_ambiguous",)),
    Served("kimi_cut_section_swallowed_alone", "kimi-k2.5", "</think>" + SECTION, "<|im_end|>",
           {"reasoning": None, "content": " "}, "length", None, 0, stream=True, cut=2,
           joined=("reconstruction_ambiguous",)),
    Served("kimi_instant_cut_section_swallowed", "kimi-k2.5", "用户在问天气" + SECTION, "<|im_end|>",
           {"reasoning": None, "content": " 用户在问天气 "}, "length", None, 0, stream=True, thinking=False, cut=4,
           joined=("reconstruction_ambiguous",)),
    # GLM: the newline before <think> stays in the reasoning (whole and streamed), the
    # reasoning's end is stripped, reasoning_tokens counts that newline
    Served("glm_stripped_tail", "glm-4.5", "\n<think>The user asks.\n</think>\nSure.", "<|user|>",
           {"reasoning": "\nThe user asks.", "content": "\nSure."}, "stop", 151336, 5),
    Served("glm_prefix_in_reasoning", "glm-4.5", "\n<think>The user asks</think>\nSure.", "<|user|>",
           {"reasoning": "\nThe user asks", "content": "\nSure."}, "stop", 151336, 4, alone=("ok",)),
    Served("glm_streamed_prefix", "glm-4.5", "\n<think>R.</think>\nC", "<|user|>",
           {"reasoning": "\nR.", "content": "\nC"}, "stop", 151336, 3, stream=True),
    # streamed, an empty block: the prefix is the whole reasoning and the strip takes it, so
    # nothing says where the newline went; "\n\n" (one id) read as the prefix then "\n" passed
    Served("glm_streamed_empty_block_stripped", "glm-4.5", "\n<think></think>\n\nHello!", "<|user|>",
           {"reasoning": None, "content": "\n\nHello!"}, "stop", 151336, 1, stream=True),
    Served("glm_endoftext_unnamed", "glm-4.5", "\n<think></think>\n", "<|endoftext|>",
           {"reasoning": None, "content": "\n"}, "stop", None, 1),
    Served("glm_ended_in_think_stripped", "glm-4.5", "\n<think></ ", "<|user|>",
           {"reasoning": "\n</", "content": None}, "stop", 151336, 4),
    # the parser strips any whitespace before </think>, not only the runs the readings try
    # (hypotheses.STRIPPED_TAILS): a count cannot read these back; ids can (see below)
    Served("kimi_stripped_markdown_break", "kimi-k2.5", "The user asks.  \n</think>Sure.", "<|im_end|>",
           {"reasoning": " The user asks.", "content": " Sure."}, "stop", 163586, 5,
           alone=("usage_completion_mismatch",), tags=("stripped_any",)),
    Served("kimi_stripped_ideographic_space", "kimi-k2.5", "The user asks.\u3000</think>Sure.", "<|im_end|>",
           {"reasoning": " The user asks.", "content": " Sure."}, "stop", 163586, 5,
           alone=("usage_completion_mismatch",), tags=("stripped_any",)),
    Served("kimi_stripped_four_newlines", "kimi-k2.5", "The user asks.\n\n\n\n</think>Sure.", "<|im_end|>",
           {"reasoning": " The user asks.", "content": " Sure."}, "stop", 163586, 4, tags=("stripped_any",)),
    # cut before its </think>: no close in the ids, the reasoning is all they spell
    Served("kimi_stripped_markdown_break_cut", "kimi-k2.5", "The user asks.  \n</think>Sure.", "<|im_end|>",
           {"reasoning": " The user asks.", "content": None}, "length", None, 5, cut=5,
           alone=("usage_completion_mismatch", "usage_reasoning_mismatch"), tags=("stripped_any",)),
    Served("glm_stripped_space_newline", "glm-4.5", "\n<think>The user asks. \n</think>\nSure.", "<|user|>",
           {"reasoning": "\nThe user asks.", "content": "\nSure."}, "stop", 151336, 6,
           alone=("usage_completion_mismatch", "usage_reasoning_mismatch", "reconstruction_ambiguous"),
           tags=("stripped_any",)),
    Served("glm_stripped_no_break_space", "glm-4.5", "\n<think>The user asks.\xa0</think>\nSure.", "<|user|>",
           {"reasoning": "\nThe user asks.", "content": "\nSure."}, "stop", 151336, 6,
           alone=("usage_completion_mismatch", "usage_reasoning_mismatch", "reconstruction_ambiguous"),
           tags=("stripped_any",)),
    # gpt-oss (HarmonyParser over the ids): an analysis ended by <|return|> itself is served as
    # the formula's empty final message would be; the count tells them apart (was rejected)
    Served("gptoss_ended_in_analysis", "gpt-oss", ANALYSIS + "The user asks.", "<|return|>",
           {"reasoning": "The user asks.", "content": None}, "stop", None, 4, alone=("ok",)),
    Served("gptoss_ended_in_analysis_streamed", "gpt-oss", ANALYSIS + "The user asks.", "<|return|>",
           {"reasoning": "The user asks.", "content": ""}, "stop", None, 4, stream=True, alone=("ok",)),
    # cut inside the next message's header, the parser serves the unfinished header's ids
    # decoded as content, special tokens and all (was rejected as marker text)
    Served("gptoss_cut_in_header", "gpt-oss", ANALYSIS + "The user asks." + FINAL + "Sure.", "<|return|>",
           {"reasoning": "The user asks.", "content": "<|start|>assistant<|channel|>"}, "length", None, 4,
           cut=11, alone=("ok",)),
    Served("gptoss_cut_in_call_header", "gpt-oss", ANALYSIS + "Call it." + CALL_HEADER + '{"city": "Paris"}',
           "<|call|>", {"reasoning": "Call it.",
                        "content": "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"},
           "length", None, 3, stream=True, cut=20, alone=("ok",)),
    # <|endoftext|> (a generation-config stop) is no harmony stop: the parser keeps it as the
    # message's text. With the answer in the commentary channel (a token more than "final")
    # the leak's reading has the model's count exactly: only eos_in_text rejects it
    Served("gptoss_endoftext_kept_commentary", "gpt-oss",
           ANALYSIS + "The user asks.<|end|><|start|>assistant<|channel|>commentary<|message|>Sure.", "<|endoftext|>",
           {"reasoning": "The user asks.", "content": "Sure.<|endoftext|>"}, "stop", 199999, 4, alone=("eos_in_text",)),
]

_TOKS: dict[str, Any] = {}


def _tok(family: str) -> Any:
    if family not in _TOKS:
        _TOKS[family] = load_tokenizer(KIMI_DIR if family == "kimi-k2.5" else SHARED / family)
    return _TOKS[family]


def native_ids(case: Served) -> list[int]:
    """The true completion ids: the model text and its end token, cut where the case says."""
    tok = _tok(case.family)
    ids = tok.encode(case.text) + [tok.token_id(case.end)]
    return ids[: case.cut] if case.cut else ids


def request_of(case: Served) -> dict[str, Any]:
    request: dict[str, Any] = {"model": case.family, "messages": [{"role": "user", "content": "Hi there"}]}
    if case.family != "gpt-oss":  # gpt-oss has no thinking switch
        switch = "thinking" if case.family == "kimi-k2.5" else "enable_thinking"
        request["chat_template_kwargs"] = {switch: case.thinking}
    if case.stream:
        request |= {"stream": True, "stream_options": {"include_usage": True}}
    return request


def _row(case: Served, traits: dict[str, ProviderTrait] | None = None, *, native: bool = False) -> dict[str, Any]:
    tok = _tok(case.family)
    request = request_of(case)
    dialect = resolve_dialect(tok, VLLM_DIALECTS.get(case.family))
    prompt = tok.encode(dialect.prompt_readings(request, {"created": CREATED})[0].text)
    n = len(native_ids(case))
    response = {"provider": "vllm", "model": case.family, "created": CREATED, "choices": [{
        "index": 0, "message": {"role": "assistant", **case.message}, "finish_reason": case.finish,
        "stop_reason": case.stop_reason}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                  "completion_tokens_details": {"reasoning_tokens": case.reasoning_tokens}}}
    record = {"id": case.name, "request": request, "response": response, "meta": {"stream": case.stream}}
    if native:  # the ground-truth ids beside it, as a self-hosted engine can return them
        record["native_ids"] = {"prompt": prompt, "choices": [native_ids(case)]}
    (row,) = reconstruct_record(record, tok, dialect, traits=traits)
    return row


def _verdict(row: dict[str, Any], truth: list[int]) -> tuple[str, ...]:
    codes = [f["code"] for f in row["findings"]]
    if row["status"] == "rejected":
        return tuple(c for c in codes if c != "truncated")
    assert row["completion_ids"] == truth, (row["completion_ids"], truth)
    return ("ok",)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_vllm_034_records_are_never_passed_with_wrong_ids(case: Served) -> None:
    truth = native_ids(case)
    assert _verdict(_row(case), truth) == case.alone
    if case.joined is not None:
        trait = {"vllm": ProviderTrait("vllm", joins_markers=True)}
        assert _verdict(_row(case, trait), truth) == case.joined


STRIPPED_ANY = [c for c in CASES if "stripped_any" in c.tags]


@pytest.mark.parametrize("case", STRIPPED_ANY, ids=[c.name for c in STRIPPED_ANY])
def test_whitespace_the_parser_stripped_is_read_back_from_the_ids(case: Served) -> None:
    """Any whitespace run vLLM 0.34 stripped before ``</think>`` is a reading where ground-truth
    ids spell it: the ids pick it, and the provable sample passes with them (it was rejected:
    only a fixed list of runs was tried)."""
    truth = native_ids(case)
    passed = ("flagged", ["truncated"]) if case.cut else ("ok", [])  # truncated: exact up to the cut
    for traits in (None, {"vllm": ProviderTrait("vllm", joins_markers=True)}):
        row = _row(case, traits, native=True)
        assert (row["status"], [f["code"] for f in row["findings"]], row["completion_ids"]) == (*passed, truth)
        tail = case.text.split("</think>")[0].removeprefix("\n<think>")[len("The user asks."):]
        assert row["reconstruction"].endswith("reasoning_tail=" + tail.replace("\n", "\\n"))


def test_vllm_stop_reason_names_the_end_token(kimi) -> None:
    """vLLM's integer ``stop_reason`` is the stop id, as SGLang's ``matched_stop``: a run known
    to join proves ``<|im_end|>`` where it is named, and the ``[EOS]`` reading where that is."""
    case = CASES[1]
    trait = {"vllm": ProviderTrait("vllm", joins_markers=True)}
    row = _row(case, trait)
    assert row["status"] == "ok" and row["completion_ids"][-1] == kimi.token_id("<|im_end|>")
    named = Served("eos_named", "kimi-k2.5", case.text, "[EOS]", case.message, "stop", kimi.token_id("[EOS]"),
                   case.reasoning_tokens)
    row = _row(named, trait)
    assert row["status"] == "ok" and row["completion_ids"] == native_ids(named)
    assert row["reconstruction"] == "marker_spaces+end=[EOS]"


def test_sglang_records_keep_their_readings(kimi) -> None:
    """SGLang (and vLLM before 0.34) send ``reasoning_content`` and strip nothing: a text that
    starts with a space is read as written there, not as 0.34's joined text."""
    truth = kimi.encode("  \nwe start.") + [kimi.token_id("</think>")] + kimi.encode(" Sure.") + [kimi.token_id("<|im_end|>")]
    request = {"model": "k", "messages": [{"role": "user", "content": "Hi there"}]}
    prompt = kimi.encode(resolve_dialect(kimi).render_request(request))
    response = {"choices": [{"index": 0, "finish_reason": "stop", "matched_stop": kimi.token_id("<|im_end|>"),
                             "message": {"role": "assistant", "reasoning_content": "  \nwe start.", "content": " Sure."}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(truth)}}
    (row,) = reconstruct_record({"id": "s", "request": request, "response": response}, kimi)
    assert row["status"] == "ok" and row["completion_ids"] == truth


def test_vllm_streamed_count_summed_over_n_choices() -> None:
    """n > 1 streamed from vLLM: usage sums each choice's streamed count, which leaves out
    each id that completes no character. The sum was held to the three whole-text ways only,
    and the provable samples rejected; a sum one short more still is."""
    case = next(c for c in CASES if c.name == "kimi_streamed_split_char")
    tok = _tok(case.family)
    request = request_of(case)
    dialect = resolve_dialect(tok)
    prompt = tok.encode(dialect.prompt_readings(request, {"created": CREATED})[0].text)
    truth = native_ids(case)
    choice = {"message": {"role": "assistant", **case.message}, "finish_reason": "stop", "stop_reason": 163586}

    def rows(reasoning: int, *, vllm: bool = True, stream: bool = True) -> list[dict[str, Any]]:
        choices = [{"index": i, **choice} for i in range(2)]
        if not vllm:
            for c in choices:
                c.pop("stop_reason")
        response = {"provider": "vllm", "model": case.family, "created": CREATED, "choices": choices,
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": 2 * len(truth),
                              "completion_tokens_details": {"reasoning_tokens": reasoning}}}
        sent = {k: v for k, v in request.items() if stream or k not in ("stream", "stream_options")} | {"n": 2}
        record = {"id": "n2", "request": sent, "response": response, "meta": {"stream": stream}}
        return reconstruct_record(record, tok, dialect)

    summed = 2 * case.reasoning_tokens  # each choice's streamed count
    assert [(r["status"], r["completion_ids"]) for r in rows(summed)] == [("ok", truth)] * 2
    for got, vllm, stream in [(summed - 1, True, True), (summed, False, True), (summed, True, False)]:
        rejected = rows(got, vllm=vllm, stream=stream)
        assert [r["status"] for r in rejected] == ["rejected"] * 2, (got, vllm, stream)
        assert all("usage_reasoning_mismatch" in {f["code"] for f in r["findings"]} for r in rejected)


def test_a_cut_and_a_turn_ended_in_its_think_block_cancel_in_the_sum_with_the_join_trait() -> None:
    """n = 2 from vLLM 0.34 (a cold tester's, served by its own code): ``Ok</think>`` cut right
    after ``</think>`` and ``Hmm<|im_end|>`` ended inside its think block sum to the count of
    the formula's readings (the cut's ``</think>`` lost, an extra one in the other). With the
    join trait the only ended-inside readings built were vetoes, which the cancellation test
    took for readings the count had weighed: both rows passed with wrong ids."""
    tok = _tok("kimi-k2.5")
    choices = [{"index": 0, "message": {"role": "assistant", "content": None, "reasoning": " Ok"},
                "finish_reason": "length", "stop_reason": None},
               {"index": 1, "message": {"role": "assistant", "content": None, "reasoning": " Hmm"},
                "finish_reason": "stop", "stop_reason": 163586}]
    request = {"model": "kimi-k2.5", "messages": [{"role": "user", "content": "Hi there"}],
               "chat_template_kwargs": {"thinking": True}, "n": 2}
    prompt = tok.encode(resolve_dialect(tok).render_request(request))
    record = {"id": "n2", "meta": {"stream": False}, "request": request, "response": {
        "provider": "vllm", "model": "kimi-k2.5", "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": 4, "completion_tokens_details": {"reasoning_tokens": 2}}}}
    truth = [tok.encode("Ok") + [tok.token_id("</think>")], tok.encode("Hmm") + [tok.token_id("<|im_end|>")]]
    for traits in (None, {"vllm": ProviderTrait("vllm", joins_markers=True)}):
        rows = reconstruct_record(record, tok, traits=traits)
        assert all(r["status"] == "rejected" or r["completion_ids"] == t for r, t in zip(rows, truth)), traits
        assert all("choices_unattributable" in {f["code"] for f in r["findings"]} for r in rows), traits


def test_a_glm_turn_ended_in_its_think_block_served_whole_counts_its_end_token() -> None:
    """vLLM 0.34 served whole reads every output id, the end token too, while still in the
    reasoning: ``\\n<think>R<|user|>`` counts lead + R + end (7 here; streamed, 6). The logprobs
    proved the ended-in-think reading and the count threw it out; with n = 2 both rows went."""
    tok = _tok("glm-4.5")
    text = "\n<think>The user asks about Paris"
    truth = tok.encode(text) + [tok.token_id("<|user|>")]
    entries = [{"token": tok.decode([i]), "logprob": -0.25, "bytes": list(tok.token_bytes(i))} for i in truth]
    choice = {"message": {"role": "assistant", "content": None, "reasoning": "\nThe user asks about Paris"},
              "logprobs": {"content": entries}, "finish_reason": "stop", "stop_reason": 151336}
    request = {"model": "glm-4.5", "messages": [{"role": "user", "content": "Hi there"}],
               "chat_template_kwargs": {"enable_thinking": True}, "logprobs": True}
    prompt = len(tok.encode(resolve_dialect(tok).render_request(request)))

    def rows(n: int, reasoning: int) -> list[dict[str, Any]]:
        response = {"provider": "vllm", "model": "glm-4.5", "choices": [{"index": i, **choice} for i in range(n)],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": n * len(truth),
                              "completion_tokens_details": {"reasoning_tokens": reasoning}}}
        return reconstruct_record({"id": "g", "meta": {"stream": False}, "request": request | {"n": n},
                                   "response": response}, tok)

    assert len(truth) - 1 == 7
    for n in (1, 2):
        assert [(r["status"], r["completion_ids"]) for r in rows(n, 7 * n)] == [("ok", truth)] * n
        assert {r["status"] for r in rows(n, 7 * n - 3)} == {"rejected"}  # no way counts that


def test_the_cancelling_pair_stays_unproven_where_the_run_proved_the_end_token_counted() -> None:
    """GLM streamed from vLLM 0.34, n = 2 (a cold reviewer's, served by its own code): a cut
    right after ``</think>`` and a turn ended in its think block. The run's ``end_counted``
    trait makes the ended-in-think reading one the count weighs, which exempted the choice:
    but it was weighed against the cut sibling as served, never against the id the cut may
    hide, so the formula pair passed (an extra ``</think>`` in one row, one lost in the other)."""
    tok = _tok("glm-4.5")
    request = {"model": "glm-4.5", "messages": [{"role": "user", "content": "Hi there"}],
               "chat_template_kwargs": {"enable_thinking": True}, "stream": True,
               "stream_options": {"include_usage": True}, "n": 2}
    choices = [{"index": 0, "message": {"role": "assistant", "content": "", "reasoning": "\nOk"},
                "finish_reason": "length", "stop_reason": None},
               {"index": 1, "message": {"role": "assistant", "content": "", "reasoning": "\nHmm"},
                "finish_reason": "stop", "stop_reason": 151336}]
    prompt = len(tok.encode(resolve_dialect(tok).render_request(request)))
    record = {"id": "n2", "meta": {"stream": True}, "request": request, "response": {
        "provider": "vllm", "model": "glm-4.5", "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": 8, "completion_tokens_details": {"reasoning_tokens": 4}}}}
    for traits in (None, {"vllm": ProviderTrait("vllm", end_counted=True)}):
        rows = reconstruct_record(record, tok, traits=traits)
        assert [r["status"] for r in rows] == ["rejected"] * 2, traits
        assert all("choices_unattributable" in {f["code"] for f in r["findings"]} for r in rows), traits

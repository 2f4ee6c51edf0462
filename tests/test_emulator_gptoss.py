"""The emulator for gpt-oss (harmony), with the real shared tokenizer.

* The synthetic model's native ids: ``<|channel|>analysis<|message|>R<|end|><|start|>
  assistant<|channel|>final<|message|>C<|return|>``, or after the analysis one commentary
  call ended by ``<|call|>``, each marker its single id at its exact position, and the
  call parsed back by SGLang 0.5.23's own ``GptOssDetector`` into exactly the call made.
* The SGLang profile (our inversion of its gpt-oss ``HarmonyParser``, which imports no
  sglang) against SGLang's real ``ReasoningParser("gpt-oss")``, whole and streamed, over
  whole and cut completions, stop trimmed and (``no_stop_trim``) kept.
* The oracle run: >= 500 emulator completions served by SGLang's real parser and
  reconstructed, no accepted row with ids other than the native ones.
* ``examples/gpt-oss.toml``: emulator run -> reconstruct -> export, with exactly the ``ok``
  rows each provider's behaviour allows, every ``ok`` row's ids the emulator's own.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from test_families_support import SGLangEngine, import_sglang_reasoning, run_example
from tokenbridge.emulator.config import ConfigError, EmulatorConfig, ProviderConfig
from tokenbridge.emulator.engines import engine_text
from tokenbridge.emulator.families import family_profile
from tokenbridge.emulator.synthetic import SyntheticModel
from tokenbridge.reconstruct import reconstruct_record

ROOT = Path(__file__).resolve().parents[1]
ENDOFTEXT, RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL = 199999, 200002, 200003, 200005, 200006, 200007, 200008, 200012
ASSISTANT = 173781
NOON = 1735732800  # 2025-01-01 12:00 UTC


FAMILY = "gpt-oss"  # the tok / dialect fixtures (conftest)


def _prompts(limit: int) -> list[list[dict[str, Any]]]:
    path = ROOT / "src" / "tokenbridge" / "data" / "prompts" / "chat.jsonl"
    return [json.loads(line)["messages"] for line in path.read_text(encoding="utf-8").splitlines()[:limit]]


def _generations(tok, dialect, limit: int, *, seeds=(0,), tool_call_rate: float = 0.8):
    """(request, generation) over the first ``limit`` bundled chat prompts, as the server
    drives the model (gpt-oss always thinks; its prompt opens no think block)."""
    model = SyntheticModel(tok, dialect, tool_call_rate=tool_call_rate, max_tokens=400)
    for seed in seeds:
        for messages in _prompts(limit):
            yield {"messages": messages}, model.generate(messages, None, True, seed, 0, False)


def _engine(tok, dialect) -> SGLangEngine:
    stops = {tok.token_id(t) for t in dialect.eos_markers}
    assert stops == {ENDOFTEXT, RETURN, CALL}
    return SGLangEngine(tok, "gpt-oss", family_profile(dialect).sglang_parser, stops, skip_special=False)


# --- the synthetic model ----------------------------------------------------------------


def test_native_ids_are_harmony_messages_with_single_id_markers(tok, dialect):
    assert family_profile(dialect).name == "gpt-oss" and dialect.name.startswith("gpt-oss")
    final, analysis = tok.encode("final"), tok.encode("analysis")
    seen = Counter()
    for _request, gen in _generations(tok, dialect, 80):
        ids = list(gen.native_ids)
        assert [i for k, t in gen.spans for i in (tok.encode(t) if k not in ("think_end", "end") else [tok.token_id(t)])] == ids
        assert ids[:2 + len(analysis)] == [CHANNEL, *analysis, MESSAGE] and ids.count(END) == 1
        assert ids[-1] in (RETURN, CALL) and not {RETURN, CALL, ENDOFTEXT} & set(ids[:-1])
        at = ids.index(END)
        assert tok.decode(ids[2 + len(analysis):at]) == gen.reasoning
        if gen.calls:
            (name, args), = gen.calls
            assert ids[-1] == CALL and gen.content.startswith("<|start|>assistant<|channel|>commentary to=functions.")
            head = [START, ASSISTANT, CHANNEL, *tok.encode(f"commentary to=functions.{name} "), CONSTRAIN,
                    *tok.encode("json"), MESSAGE]
            assert ids[at + 1:at + 1 + len(head)] == head and tok.decode(ids[at + 1 + len(head):-1]) == args
            seen["calls"] += 1
        else:
            assert ids[at + 1:at + 5 + len(final)] == [START, ASSISTANT, CHANNEL, *final, MESSAGE]
            assert ids[-1] == RETURN and tok.decode(ids[at + 5 + len(final):-1]) == gen.content
            seen["final"] += 1
    assert seen["final"] >= 40 and seen["calls"] >= 10, seen


def test_tool_calls_are_what_sglangs_gpt_oss_detector_parses(tok, dialect):
    """The call with its ``<|call|>`` (as SGLang's function-call path sees it) parses into
    exactly the call the model made."""
    import_sglang_reasoning()
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.gpt_oss_detector import GptOssDetector

    checked = 0
    for _request, gen in _generations(tok, dialect, 60, tool_call_rate=1.0):
        if not gen.calls:
            continue
        tools = [Tool(type="function", function={"name": n, "parameters": {"type": "object"}}) for n, _ in gen.calls]
        result = GptOssDetector().detect_and_parse(gen.content + "<|call|>", tools)
        assert [(c.name, json.loads(c.parameters)) for c in result.calls] == \
            [(n, json.loads(a)) for n, a in gen.calls], gen.content
        checked += 1
    assert checked >= 10


# --- the SGLang profile against SGLang ----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sglang_profile_serves_what_sglangs_gpt_oss_parser_serves(tok, dialect, stream):
    engine = _engine(tok, dialect)
    keeping = _engine(tok, dialect)
    keeping.stop_ids = set()  # no_stop_trim: the stop's text reaches the parser
    rnd = random.Random(13)
    compared = Counter()
    for _request, gen in _generations(tok, dialect, 100):
        ids = list(gen.native_ids)
        for cut in (len(ids), rnd.randint(1, len(ids))):
            for keep, eng in ((False, engine), (True, keeping)):
                theirs = eng.serve(ids[:cut], 0, thinking=True, stream=stream)["choices"][0]["message"]
                ours = engine_text(tok, dialect, ids[:cut], True, "sglang", stream=stream, keep_stop=keep)
                assert (ours.reasoning, ours.content) == (theirs["reasoning_content"], theirs["content"]), (cut, keep)
                whole = cut == len(ids)
                compared["whole" if whole else "cut"] += 1
                if whole and gen.calls:
                    # trimmed: the call is dropped; kept: it stays raw with its <|call|>
                    assert ours.content == ("" if not keep else gen.content + "<|call|>")
                    compared["calls"] += 1
                elif whole:
                    assert (ours.reasoning, ours.content) == (gen.reasoning, gen.content)
    assert compared["whole"] >= 190 and compared["cut"] >= 150 and compared["calls"] >= 20, compared


_A, _NEXT = "<|channel|>analysis<|message|>", "<|end|><|start|>assistant"
_SHAPES = {
    "preamble": _A + "R1" + _NEXT + "<|channel|>commentary<|message|>Pre." + _NEXT + "<|channel|>final<|message|>Ans.<|return|>",
    "two_analysis": _A + "R1" + _NEXT + "<|channel|>analysis<|message|>R2" + _NEXT + "<|channel|>final<|message|>A.<|return|>",
    "call": _A + "R1" + _NEXT + "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
    "no_analysis": "<|channel|>final<|message|>Only.<|return|>",
    "empty_analysis": _A + _NEXT + "<|channel|>final<|message|>E.<|return|>",
}


@pytest.mark.parametrize("shape", sorted(_SHAPES))
def test_sglang_profile_at_every_cut_of_every_harmony_shape(tok, dialect, shape):
    """The shapes the emulator's model does not write (preambles, two analyses, no or an
    empty analysis) too: every prefix, whole and streamed, stop trimmed and kept."""
    ids = tok.encode(_SHAPES[shape])
    for keep in (False, True):
        engine = _engine(tok, dialect)
        if keep:
            engine.stop_ids = set()
        for stream in (False, True):
            for cut in range(1, len(ids) + 1):
                theirs = engine.serve(ids[:cut], 0, thinking=True, stream=stream)["choices"][0]["message"]
                ours = engine_text(tok, dialect, ids[:cut], True, "sglang", stream=stream, keep_stop=keep)
                assert (ours.reasoning, ours.content) == (theirs["reasoning_content"], theirs["content"]), (keep, stream, cut)
    whole = engine_text(tok, dialect, ids, True, "sglang")
    assert (whole.reasoning, whole.content) == {
        "preamble": ("R1", "Pre.Ans."), "two_analysis": ("R1R2", "A."), "call": ("R1", ""),
        "no_analysis": (None, "Only."), "empty_analysis": (None, "E.")}[shape]


@pytest.mark.parametrize("tail", ["a < b <", "x <|", "y<|ret", "plain"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sglang_profile_on_content_ending_like_a_marker(tok, dialect, tail, stream):
    """A final answer cut where its text could begin a marker: the streaming parser holds
    that tail back and never flushes it; whole, it is served. Our profile, like SGLang's."""
    ids = tok.encode("<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>final<|message|>" + tail)
    theirs = _engine(tok, dialect).serve(ids, 0, thinking=True, stream=stream)["choices"][0]["message"]
    ours = engine_text(tok, dialect, ids, True, "sglang", stream=stream)
    assert (ours.reasoning, ours.content) == (theirs["reasoning_content"], theirs["content"])
    held = stream and tail != "plain"
    assert ours.reasoning == "R" and (ours.content != tail) == held, ours


def test_a_vllm_provider_for_gpt_oss_is_a_config_error_not_a_500(tok, dialect):
    from tokenbridge.emulator.server import _Emulator

    config = EmulatorConfig(providers=(ProviderConfig(name="v/bf16", engine="vllm"),))
    with pytest.raises(ConfigError, match="no vllm engine for gpt-oss"):
        _Emulator(config, tok)
    with pytest.raises(ValueError, match="no vllm profile for gpt-oss"):
        engine_text(tok, dialect, [CHANNEL], True, "vllm")


def test_the_served_prompt_is_dated_by_the_created_it_serves(tok, dialect):
    """The prompt prints the serving day: the server renders its own clock's UTC day (its
    ``created``), each day cached apart. Not the first day ``created`` admits: at 00:30
    that was yesterday, which the client's own timing rules out (every gpt-oss sample of
    a run made in the half hour after midnight was rejected, native ids differing)."""
    from tokenbridge.emulator.server import _Emulator

    em = _Emulator(EmulatorConfig(models=("openai/gpt-oss-120b",)), tok)
    req = em._parse(json.dumps({"model": "openai/gpt-oss-120b", "messages": [{"role": "user", "content": "Hi"}]}).encode())
    seen = {}
    # noon; 00:30 the next day (created - 1 h is still Jan 1); 02:00 the next day
    for created, day in ((NOON, "2025-01-01"), (NOON + 45000, "2025-01-02"), (NOON + 50400, "2025-01-02")):
        ids, opens = em._prompt_ids(req, "k", created)
        text = tok.decode(ids)
        readings = {r.name: r.text for r in dialect.prompt_readings(req.body, {"created": created}, {})}
        assert text == readings[f"date={day}"] and not opens
        assert f"Current date: {day}\n" in text and text.endswith("<|start|>assistant")
        seen[day] = ids
    assert seen["2025-01-01"] != seen["2025-01-02"]


# --- the oracle run ----------------------------------------------------------------------


def test_sglang_oracle_over_500_emulator_completions_passes_no_wrong_ids(tok, dialect):
    """The emulator model's native completions (bundled prompts, two seeds, whole and cut
    at a random token) served by SGLang's real parser, streamed or whole, with or without
    ``matched_stop``, then reconstructed: no accepted sample has ids other than the native ones."""
    engine = _engine(tok, dialect)
    rnd = random.Random(5)
    seen = Counter()
    for request, gen in _generations(tok, dialect, 140, seeds=(0, 1)):
        ids = list(gen.native_ids)
        prompt_ids = tok.encode(dialect.prompt_readings(request, {"created": NOON}, {})[0].text)
        for cut in (len(ids), rnd.randint(1, len(ids))):
            response = engine.serve(ids[:cut], len(prompt_ids), thinking=True, stream=rnd.random() < 0.5)
            response["created"] = NOON
            choice = response["choices"][0]
            if choice["finish_reason"] == "stop" and rnd.random() < 0.5:
                choice["matched_stop"] = ids[-1]
            row, = reconstruct_record({"id": "o", "request": request, "response": response}, tok)
            seen["completions"] += 1
            whole = cut == len(ids)
            if whole:
                seen["whole"] += 1
                seen["whole_calls"] += bool(gen.calls)
            if row["status"] != "rejected":
                assert row["completion_ids"] == ids[:cut] and row["prompt_ids"] == prompt_ids, (cut, row["findings"])
                seen["accepted_" + ("whole" if whole else "cut")] += 1
                seen["accepted_call"] += whole and bool(gen.calls)
            else:
                seen.update(f["code"] for f in row["findings"] if f["severity"] == "error")
    print(dict(seen))
    assert seen["completions"] >= 500, seen
    # every whole final answer is rebuilt exactly; every call SGLang dropped is rejected
    assert seen["accepted_whole"] == seen["whole"] - seen["whole_calls"] and seen["accepted_call"] == 0, seen
    assert seen["whole_calls"] >= 20 and seen["harmony_message_lost"] >= seen["whole_calls"], seen
    assert seen["accepted_cut"] >= seen["whole"] // 3, seen


# --- the example config, end to end --------------------------------------------------------


def _expected_ok(provider: str, native: list[int]) -> bool:
    """What each provider of examples/gpt-oss.toml allows (its comment)."""
    call = native[-1] == CALL
    if provider == "leaky/int4":
        return False  # <|return|> / <|call|> text in content: eos_in_text
    if provider == "sglang/fp8":
        return not call  # <|call|> trimmed, the call dropped: harmony_message_lost
    if provider == "raw-call/fp8":
        return not call  # the call kept raw with its <|call|> text: eos_in_text
    return True


def test_example_config_runs_end_to_end(tmp_path, tok, dialect):
    run = run_example(tmp_path, "gpt-oss")
    native, rows = run.native, run.rows
    assert len(rows) == len(native) == 70
    expected = sum(_expected_ok(p, ids) for _, ids, p in native.values())
    ok = run.ok_rows()
    assert len(ok) == expected, Counter((r["provider"], r["status"], tuple(f["code"] for f in r["findings"])) for r in rows)
    for r in ok:
        prompt_ids, completion_ids, _ = native[r["id"]]
        assert r["prompt_ids"] == prompt_ids and r["completion_ids"] == completion_ids
    # the rejections are for the reason each provider's behaviour gives
    for r in rows:
        _, ids, provider = native[r["id"]]
        codes = {f["code"] for f in r["findings"]}
        if provider == "sglang/fp8" and ids[-1] == CALL:
            assert "harmony_message_lost" in codes, codes
        elif provider in ("leaky/int4", "raw-call/fp8") and not _expected_ok(provider, ids):
            assert "eos_in_text" in codes, codes
    by_provider = Counter(p for _, _, p in native.values())
    assert len(by_provider) == 4 and min(by_provider.values()) >= 5, by_provider
    calls = Counter(p for _, ids, p in native.values() if ids[-1] == CALL)
    assert sum(calls.values()) >= 5, calls
    assert sorted(run.train_input_ids()) == sorted(r["prompt_ids"] + r["completion_ids"] for r in ok)

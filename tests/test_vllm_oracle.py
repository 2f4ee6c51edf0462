"""vLLM's own serving code as the oracle for the gate (vllm 0.34.0, see vllm_support.py).

A model text is drawn (reasoning and content rich in whitespace runs, newlines, ``<``,
``|``, marker-like text and its prefixes, CJK, code, or plain prose; sometimes a tool call,
sometimes no ``</think>``), written in the family's own frame and encoded with its
tokenizer: those are the true ids. vLLM's detokenizer and parsers serve them, whole and
streamed, with and without ``tools`` in the request, ended (with either end token) or cut
(``finish_reason: length``); tokenbridge reconstructs the record, alone and with the run
trait ``joins_markers`` a Kimi run served by vLLM shows (as reconstruct_file's second pass
applies it). The contract: a row the gate accepts (``ok``, or flagged only ``truncated``,
which promises ids exact up to the cut) has exactly the true ids. Outcomes are tallied per
mode and rejections per finding code: ``VLLM_ORACLE_REPORT=1`` prints them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_support import FAMILIES, VllmEngine, import_vllm
from tokenbridge.chat import resolve_dialect
from tokenbridge.reconstruct import reconstruct_record
from tokenbridge.traits import ProviderTrait

#: Warnings that promise exact ids (``truncated``: exact up to the cut).
EXACT_WARNINGS = frozenset({"truncated"})
EXAMPLES = int(os.environ.get("VLLM_ORACLE_EXAMPLES", "150"))

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]


@pytest.fixture(scope="module")
def vllm() -> Any:
    return import_vllm(pytest.skip)


# --- model texts ----------------------------------------------------------------------

_CHARS = list("abcXYZ <>|/{}[]\":,.!?_-=\\`'#*0123456789éß中文字你好😀\u3000")
_PIECES = [" ", "  ", "   ", "\n", "\n\n", " \n", "\n ", "\t", "\r\n", "<", "<|", "|>", "</", "<think", "</think",
           "<|tool", "<|tool_call", "<|tool_calls_section_begin|", "<tool", "<tool_call", "</tool_call", "<|im_end",
           "<｜", "|", "```python\nx = 1\n```", "def f():\n    return 2\n", "<b>bold</b>", "a < b | c", "思考中。",
           "好的，", "The user", " asks", "Let me", "answer"]
_PROSE = ["The user asks about the weather in Paris.", "Let me think step by step", "First, list the constraints",
          "用户在问天气", "So the answer is 42", "Check the edge case where n = 0", "Sure! Here it is:",
          "```python\nprint(1)\n```", "Paris is sunny today", "東京タワーは333メートルです",
          "\u101e\u1004\u103a\u1000 \u1019\u1004\u103a\u1039\u1002\u101c\u102c\u1015\u102b",  # Burmese: ids span characters
          "I like \U0001F600 and \u9f98"]
_words = st.text(st.sampled_from(_CHARS), min_size=1, max_size=8)
_noisy = st.lists(st.one_of(st.sampled_from(_PIECES), _words), max_size=8).map("".join)
_prose = st.lists(st.sampled_from(_PROSE), min_size=1, max_size=3).map(" ".join)
texts = st.one_of(_noisy, _prose)


def _clean(tok: Any) -> Callable[[str], bool]:
    """No whole marker text in the model's own words (the true ids are built from them)."""
    return lambda text: not any(m in text for m in tok.marker_ids.values())


#: How each family writes a completion: (thinking frame around R and before C, instant lead,
#: its tool section, its end token after a tool call, the thinking switch its template reads,
#: what opens a second message after the reasoning where the format has messages).
FRAMES: dict[str, dict[str, Any]] = {
    "kimi-k2.5": {"open": "", "close": "</think>", "lead": "", "instant": "", "switch": "thinking",
                  "section": ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                              '<|tool_call_argument_begin|>{"city": "%s"}<|tool_call_end|><|tool_calls_section_end|>')},
    "qwen3": {"open": "<think>\n", "close": "\n</think>\n\n", "lead": "", "instant": "", "switch": "enable_thinking",
              "section": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'},
    "glm-4.5": {"open": "\n<think>", "close": "</think>\n", "lead": "", "instant": "\n", "switch": "enable_thinking",
                "section": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>%s</arg_value>\n</tool_call>",
                "tool_end": "<|observation|>"},
    "deepseek-v3.1": {"open": "", "close": "</think>", "lead": "", "instant": "", "switch": "thinking",
                      "section": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                                  '{"city": "%s"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')},
    # harmony: the analysis channel, then the final one (or a tool call, as the commentary
    # channel addressed to the function); no switch, the request's reasoning_effort instead.
    # "second" opens another message after the first analysis: a second analysis or a
    # commentary preamble, which vLLM joins to the first with a newline. A tool call is
    # written channel first (with or without its json content type) or recipient first.
    "gpt-oss": {"open": "<|channel|>analysis<|message|>", "close": "<|end|><|start|>assistant<|channel|>final<|message|>",
                "lead": "", "instant": "<|channel|>final<|message|>", "switch": None,
                "section": ['<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                            '<|message|>{"city": "%s"}',
                            '<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json'
                            '<|message|>{"city": "%s"}',
                            '<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "%s"}'],
                "tool_end": "<|call|>",
                # the answer in the commentary channel (no recipient): vLLM serves it as content too
                "close_other": "<|end|><|start|>assistant<|channel|>commentary<|message|>",
                "second": ["<|end|><|start|>assistant<|channel|>analysis<|message|>",
                           "<|end|><|start|>assistant<|channel|>commentary<|message|>"]},
}


@st.composite
def completions(draw: Any, family: str, tok: Any) -> dict[str, Any]:
    """One completion of ``family``: its model text, true ids, the request, and how it is served."""
    frame, fam = FRAMES[family], FAMILIES[family]
    thinking = draw(st.booleans()) if draw(st.integers(0, 3)) == 0 else True
    reasoning = draw(texts.filter(_clean(tok)))
    content = draw(texts.filter(_clean(tok)))
    shapes = ["plain", "plain", "plain", "tool", "tool_no_close", "end_in_think"] + ["second"] * bool(frame.get("second"))
    shape = draw(st.sampled_from(shapes))
    section = ""
    if shape in ("tool", "tool_no_close"):
        form = frame["section"] if isinstance(frame["section"], str) else draw(st.sampled_from(frame["section"]))
        section = form % draw(st.sampled_from(["Paris", "東京", "a b"]))
    if not thinking:
        text = frame["instant"] + content + section
    elif shape == "tool_no_close":
        text = frame["open"] + reasoning + section
    elif shape == "end_in_think":
        text = frame["open"] + reasoning
    elif shape == "second":
        text = frame["open"] + reasoning + draw(st.sampled_from(frame["second"])) + draw(texts.filter(_clean(tok))) + \
            frame["close"] + content
    else:
        close = frame["close"]
        if frame.get("close_other") and draw(st.integers(0, 7)) == 0:
            close = frame["close_other"]
        text = frame["open"] + reasoning + close + content + section
    # the template's end token mostly, the tokenizer's or the generation config's other one sometimes
    usual = resolve_dialect(tok).end_token
    others = [e for e in (fam.eos, *fam.stop) if e != usual][:1]
    end = frame["tool_end"] if section and frame.get("tool_end") else draw(st.sampled_from([usual] * 3 + others))
    ids = tok.encode(text) + [tok.token_id(end)]
    cut = draw(st.integers(0, 3)) == 0 and len(ids) > 1
    if cut:
        ids = ids[: draw(st.integers(1, len(ids) - 1))]
    request: dict[str, Any] = {"model": family, "messages": [{"role": "user", "content": "Hi there"}]}
    if frame["switch"]:
        request["chat_template_kwargs"] = {frame["switch"]: thinking}
    else:  # gpt-oss: the effort its prompt states
        effort = draw(st.sampled_from([None, "low", "medium", "high"]))
        request |= {"reasoning_effort": effort} if effort else {}
    if draw(st.booleans()):
        request["tools"] = TOOLS
    stream = draw(st.booleans())
    if stream:
        request = {**request, "stream": True, "stream_options": {"include_usage": True}}
    if draw(st.integers(0, 3)) == 0:  # logprobs as vLLM logs them (split characters too)
        request = {**request, "logprobs": True, "top_logprobs": draw(st.integers(0, 2))}
    return {"request": request, "ids": ids, "text": text, "shape": f"{shape}/cut" if cut else shape,
            "stream": stream, "end": end, "thinking": thinking}


# --- the run --------------------------------------------------------------------------


class Tally:
    """Every drawn sample's outcome, per mode."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.rejected: Counter[tuple[str, str]] = Counter()
        self.wrong: list[dict[str, Any]] = []
        #: rejected rows whose ids are the true ids, per error code (with one example each)
        self.provable: Counter[str] = Counter()
        self.provable_example: dict[str, dict[str, Any]] = {}

    @staticmethod
    def mode(s: dict[str, Any]) -> str:
        return (f"{'stream' if s['stream'] else 'whole'}{'+tools' if s['request'].get('tools') else ''}"
                f"{'+logprobs' if s['request'].get('logprobs') else ''}")

    def add(self, s: dict[str, Any], row: dict[str, Any], served: dict[str, Any], prompt: list[int]) -> bool:
        """Tally one row; False where the gate accepted wrong ids."""
        mode = self.mode(s)
        codes = [f["code"] for f in row["findings"]]
        accepted = row["status"] == "ok" or (row["status"] == "flagged" and set(codes) <= EXACT_WARNINGS)
        self.counts[(mode, "accepted" if accepted else row["status"])] += 1
        if row["status"] == "rejected":
            for code in sorted({f["code"] for f in row["findings"] if f["severity"] == "error"}):
                self.rejected[(mode, code)] += 1
        right = row["completion_ids"] == s["ids"] and row["prompt_ids"] == prompt
        if row["status"] == "rejected" and right:
            for code in sorted({f["code"] for f in row["findings"] if f["severity"] == "error"}):
                self.provable[code] += 1
                self.provable_example.setdefault(code, {"text": s["text"], "shape": s["shape"], "mode": mode,
                                                        "served": served["choices"][0], "usage": served.get("usage")})
        misread = {"logprobs_unreadable"} | (set() if not right else {"logprobs_mismatch"})
        if s["request"].get("logprobs") and misread & set(codes):  # what vLLM logs is read, and agrees with the truth
            self.wrong.append({"sample": s, "served": served["choices"][0], "misread": codes})
            return False
        if accepted and not right:
            self.wrong.append({"sample": s, "served": served["choices"][0], "usage": served.get("usage"),
                               "ours": row["completion_ids"], "reconstruction": row["reconstruction"],
                               "findings": codes})
            return False
        return True

    def report(self, name: str) -> str:
        lines = [f"== {name}: {sum(self.counts.values())} samples"]
        lines += [f"  {m:<13} {what:<9} {n}" for (m, what), n in sorted(self.counts.items())]
        lines += [f"  rejected {m:<13} {code:<28} {n}" for (m, code), n in sorted(self.rejected.items())]
        lines += [f"  rejected with the true ids {code:<28} {n}" for code, n in sorted(self.provable.items())]
        if os.environ.get("VLLM_ORACLE_REPORT") == "2":
            lines += [f"    e.g. {code}: {json.dumps(ex, ensure_ascii=False)}" for code, ex in
                      sorted(self.provable_example.items())]
        lines.append(f"  accepted with wrong ids: {len(self.wrong)}")
        return "\n".join(lines)


TALLIES: dict[str, Tally] = {}


def _serve_and_check(engine: VllmEngine, tok: Any, s: dict[str, Any], tally: str,
                     traits: dict[str, ProviderTrait] | None = None) -> None:
    dialect = resolve_dialect(tok, engine.family.dialect)
    prompt = tok.encode(dialect.render_request(s["request"]))
    served = engine.serve(s["request"], prompt, s["ids"], stream=s["stream"])
    served["provider"] = "vllm"
    record = {"id": "v", "request": s["request"], "response": served, "meta": {"stream": s["stream"]}}
    row = reconstruct_record(record, tok, dialect, traits=traits)[0]
    t = TALLIES.setdefault(tally, Tally())
    assert t.add(s, row, served, prompt), json.dumps(t.wrong[-1], ensure_ascii=False, default=str)


# VLLM_ORACLE_RANDOM=1 draws afresh each run (a longer search); the suite's draws are fixed.
_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("VLLM_ORACLE_RANDOM"),
                     database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                            HealthCheck.filter_too_much])
_TOKENIZERS: dict[str, Any] = {}
_ENGINES: dict[str, VllmEngine] = {}


def _family(name: str, vllm: Any) -> tuple[Any, VllmEngine]:
    from test_families_support import family_tokenizer

    if name not in _ENGINES:
        if name == "kimi-k2.5":
            from tokenbridge.tokenizer import load_tokenizer
            from vllm_support import SHARED

            tok = load_tokenizer(SHARED / name)
        else:
            tok = family_tokenizer(name)
        _TOKENIZERS[name] = tok
        _ENGINES[name] = VllmEngine(tok, FAMILIES[name], vllm)
    return _TOKENIZERS[name], _ENGINES[name]


@pytest.mark.parametrize("family", sorted(FRAMES))
@_SETTINGS
@given(data=st.data())
def test_never_accepts_wrong_ids(vllm, family, data) -> None:
    tok, engine = _family(family, vllm)
    _serve_and_check(engine, tok, data.draw(completions(family, tok)), family)


@_SETTINGS
@given(data=st.data())
def test_kimi_run_known_to_join_never_accepts_wrong_ids(vllm, data) -> None:
    """As reconstruct_file's second pass reads a Kimi run vLLM served: ``joins_markers``."""
    tok, engine = _family("kimi-k2.5", vllm)
    _serve_and_check(engine, tok, data.draw(completions("kimi-k2.5", tok)), "kimi-k2.5 (joins_markers)",
                     {"vllm": ProviderTrait("vllm", joins_markers=True)})


def test_pinned_records_are_what_vllm_serves(vllm) -> None:
    """Every record tests/test_vllm_readings.py pins (and checks the gate on) is what vLLM
    serves for its model text, field for field."""
    from test_vllm_readings import CASES, native_ids, request_of

    for case in CASES:
        tok, engine = _family(case.family, vllm)
        request = request_of(case)
        prompt = tok.encode(resolve_dialect(tok, engine.family.dialect).render_request(request))
        ids = native_ids(case)
        served = engine.serve(request, prompt, ids, stream=case.stream)
        choice = served["choices"][0]
        got = ({k: choice["message"].get(k) for k in case.message}, choice["finish_reason"], choice.get("stop_reason"),
               served["usage"]["completion_tokens"], served["usage"]["completion_tokens_details"]["reasoning_tokens"])
        assert got == (case.message, case.finish, case.stop_reason, len(ids), case.reasoning_tokens), case.name


def test_stripped_whitespace_is_read_back_from_vllms_logprobs(vllm) -> None:
    """Whitespace the parser stripped before ``</think>`` outside the runs the readings try
    (a markdown break, U+3000, four newlines, GLM's " \\n" and U+00A0): vLLM's own logprobs
    spell it, so the provable sample passes with the true ids (it was rejected, its logprobs
    said to differ)."""
    from test_vllm_readings import STRIPPED_ANY, native_ids, request_of

    for case in STRIPPED_ANY:
        tok, engine = _family(case.family, vllm)
        request = {**request_of(case), "logprobs": True}
        dialect = resolve_dialect(tok, engine.family.dialect)
        ids = native_ids(case)
        served = engine.serve(request, tok.encode(dialect.render_request(request)), ids, stream=False)
        assert served["choices"][0]["message"]["reasoning"] == case.message["reasoning"], case.name  # stripped
        (row,) = reconstruct_record({"id": case.name, "request": request, "response": served}, tok, dialect)
        passed = ("flagged", ["truncated"]) if case.cut else ("ok", [])  # truncated: exact up to the cut
        assert (row["status"], [f["code"] for f in row["findings"]], row["completion_ids"]) == (*passed, ids), case.name


def test_pinned_logprobs_are_what_vllm_logs(vllm) -> None:
    """tests/test_evidence.py's Burmese entries are what vLLM 0.34 logs for Kimi's ids."""
    from test_evidence import BURMESE, BURMESE_LOGGED

    tok, engine = _family("kimi-k2.5", vllm)
    req = engine.v.ChatCompletionRequest(model="kimi-k2.5", messages=[{"role": "user", "content": "Hi"}], logprobs=True)
    logged = engine._logprobs(req, engine._logprobs_processor(), tok.encode(BURMESE))
    assert [e.token for e in logged.content] == BURMESE_LOGGED


def test_zz_report() -> None:
    if os.environ.get("VLLM_ORACLE_REPORT"):
        print("\n" + "\n".join(TALLIES[name].report(name) for name in sorted(TALLIES)))

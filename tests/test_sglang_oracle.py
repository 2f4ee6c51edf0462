"""SGLang's own Kimi K2 parsers as the oracle for the gate.

Native completions (ids the model wrote) go through what an SGLang 0.5.23 server does
with them: detokenize with ``skip_special_tokens=True`` unless the request sends ``tools``
(``serving_chat`` then keeps them for the tool parser; the matched stop id trimmed),
split reasoning with the real ``ReasoningParser("kimi_k2", force_reasoning=True)`` and,
when the request sends ``tools``, parse calls with the real ``KimiK2Detector`` -- both
non-streaming (``parse_non_stream`` / ``detect_and_parse``) and streaming (one text delta
per token, as the incremental detokenizer emits them, through ``parse_stream_chunk`` /
``parse_streaming_increment``). The resulting chat.completion carries exact usage as the
engine counts it (completion ids include the stop token), ``matched_stop`` and
``reasoning_tokens`` (SGLang counts up to and including ``</think>``, or every token when
``</think>`` never comes). The gate must return the native ids or a finding: never ``ok``
with wrong ids.

sglang is imported without running ``sglang/__init__.py``: that file pulls the whole
runtime (``sglang.srt.utils.common`` -> triton, 285 MB). The parser modules themselves
need only the pins in requirements-oracles.txt. The package is registered as a plain
namespace (its real ``__path__``) and the parser modules are then imported normally;
nothing inside sglang is replaced.
"""

from __future__ import annotations

import codecs
import copy
import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from test_families_support import register_sglang_namespace
from tokenbridge.chat import resolve_dialect
from tokenbridge.emulator.synthetic import SyntheticModel
from tokenbridge.reconstruct import reconstruct_record


def _import_sglang() -> tuple[Any, Any, Any]:
    register_sglang_namespace(pytest.fail)  # CI installs it: a missing oracle is a failure here
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.kimik2_detector import KimiK2Detector
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    return ReasoningParser, KimiK2Detector, Tool


ReasoningParser, KimiK2Detector, SglTool = _import_sglang()

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                                                      "limit": {"type": "integer"}}}}},
]


@dataclass
class Native:
    """One native completion and what it exercises."""

    request: dict[str, Any]
    ids: list[int]
    kind: str  # "plain", "tool_call", "tool_no_think_close", ...
    cut: bool = False
    tags: set[str] = field(default_factory=set)


# --- the engine ------------------------------------------------------------------------


class SGLangServer:
    """What SGLang's OpenAI server returns for native ids (Kimi K2 parsers, no spaces:
    transformers 5 decodes added tokens without ``spaces_between_special_tokens``)."""

    def __init__(self, tok: Any, kimi_dir: Any) -> None:
        self.tok = tok
        config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
        self.skipped = {int(k) for k, v in config["added_tokens_decoder"].items() if v.get("special")}
        self.end_id = tok.token_id("<|im_end|>")
        self.think_close_id = tok.token_id("</think>")
        self.tools = [SglTool(**t) for t in TOOLS]

    def _skipped(self, with_tools: bool) -> set[int]:
        """The ids detokenizing leaves out: special tokens, unless the request sends tools
        (``serving_chat`` then sets ``skip_special_tokens = False`` for the tool parser)."""
        return set() if with_tools else self.skipped

    def _finish(self, ids: list[int]) -> tuple[list[int], str, int | None]:
        if ids and ids[-1] == self.end_id:  # trim_matched_stop: the stop id is never detokenized
            return ids[:-1], "stop", self.end_id
        return ids, "length", None

    def _reasoning_tokens(self, ids: list[int]) -> int:
        if self.think_close_id in ids:
            return ids.index(self.think_close_id) + 1
        return len(ids)

    def serve(self, native: Native, prompt_tokens: int, *, stream: bool,
              prompt_ids: list[int] | None = None) -> dict[str, Any]:
        """The chat.completion; ``prompt_ids`` given: ``return_token_ids`` was asked (served whole
        only: SGLang refuses it streamed), and each choice carries them and its ``output_ids``."""
        body, finish, matched = self._finish(native.ids)
        with_tools = bool(native.request.get("tools"))
        if stream:
            reasoning, content, calls = self._stream(body, with_tools)
        else:
            reasoning, content, calls = self._whole(body, with_tools)
        message: dict[str, Any] = {"role": "assistant", "content": content or "",
                                   "reasoning_content": reasoning or None}
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        if prompt_ids is not None:  # serving_chat: ret_item["output_ids"], through the stop id
            choice.update(prompt_token_ids=list(prompt_ids), response_token_ids=list(native.ids))
        n = len(native.ids)
        return {
            "id": "sgl", "object": "chat.completion", "created": 0, "model": "kimi-k2.5", "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                      "completion_tokens_details": {"reasoning_tokens": self._reasoning_tokens(native.ids)}},
        }

    def _whole(self, body: list[int], with_tools: bool) -> tuple[str | None, str, list[dict[str, Any]]]:
        skipped = self._skipped(with_tools)
        text = self.tok.decode_bytes([i for i in body if i not in skipped]).decode("utf-8", errors="replace")
        parser = ReasoningParser("kimi_k2", stream_reasoning=False, force_reasoning=True)
        reasoning, content = parser.parse_non_stream(text)
        calls: list[dict[str, Any]] = []
        if with_tools:
            det = KimiK2Detector()
            if det.has_tool_call(content or ""):
                res = det.detect_and_parse(content, self.tools)
                if res.calls:
                    content = res.normal_text
                    calls = [_call(i, c.name, c.parameters) for i, c in enumerate(res.calls)]
        return reasoning, content or "", calls

    def _stream(self, body: list[int], with_tools: bool) -> tuple[str | None, str, list[dict[str, Any]]]:
        parser = ReasoningParser("kimi_k2", stream_reasoning=True, force_reasoning=True)
        det = KimiK2Detector() if with_tools else None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        reasoning: list[str] = []
        content: list[str] = []
        names: dict[int, str] = {}
        args: dict[int, list[str]] = {}

        def take(r: str | None, normal: str | None) -> None:
            if r:
                reasoning.append(r)
            if not normal:
                return
            if det is None:
                content.append(normal)
                return
            res = det.parse_streaming_increment(normal, self.tools)
            if res.normal_text:
                content.append(res.normal_text)
            for item in res.calls:
                if item.name:
                    names[item.tool_index] = item.name
                if item.parameters:
                    args.setdefault(item.tool_index, []).append(item.parameters)

        skipped = self._skipped(with_tools)
        for i in body:
            delta = decoder.decode(b"" if i in skipped else self.tok.token_bytes(i))
            if delta:
                take(*parser.parse_stream_chunk(delta))
        tail = decoder.decode(b"", final=True)
        if tail:
            take(*parser.parse_stream_chunk(tail))
        take(*parser.parse_stream_end())
        calls = [_call(k, names[k], "".join(args.get(k, []))) for k in sorted(names)]
        return ("".join(reasoning) or None), "".join(content), calls


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": f"functions.{name}:{index}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# --- native completions -----------------------------------------------------------------

PROSE = [
    "The bridge opened in 1932 and carried trams until 1958.",
    "First, list the constraints. Second, check each one against the data.\n\nThird, decide.",
    "  Leading spaces matter here, and so do trailing ones.  ",
    "\n\nA reply that starts with blank lines.\n",
    "Markdown:\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n- item one\n- item two\n",
]
CODE = [
    "```python\ndef fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n```\n",
    "```js\nconst xs = [1, 2, 3].map((x) => x * 2);\nconsole.log(xs.join(\"\\t\"));\n```",
    "Use `grep -rn \"TODO\" src/` and then\n\n\tindent with a tab.",
]
CJK = [
    "北京是中国的首都，有三千多年的历史。",
    "東京タワーは1958年に完成しました。高さは333メートルです。",
    "서울은 한국의 수도입니다. 😀 Emoji and 中文 mixed.",
    "数学：∑ᵢ xᵢ² ≥ 0，且 √2 ≈ 1.414。",
]
REASONING = [
    "The user asks something simple. I should answer directly.",
    "Let me think step by step.\n1. Parse the question.\n2. Answer it.\n",
    "用户在问天气。我需要调用工具。",
    "Check the edge case where n = 0.\n\n",
]


def _tool_section(calls: list[tuple[str, dict[str, Any]]]) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
                   f"{json.dumps(a, ensure_ascii=False)}<|tool_call_end|>" for i, (name, a) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def _request(rng: random.Random, with_tools: bool) -> dict[str, Any]:
    q = rng.choice(["What is the weather in Paris?", "Explain recursion.", "写一首关于春天的诗。",
                    "Find news about tokenizers.", "Fix my code."])
    req: dict[str, Any] = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": q}]}
    if with_tools:
        req["tools"] = TOOLS
    return req


def _handwritten(tok: Any, rng: random.Random, count: int) -> list[Native]:
    end, close = tok.token_id("<|im_end|>"), tok.token_id("</think>")
    out: list[Native] = []
    for n in range(count):
        reasoning = " ".join(rng.sample(REASONING, rng.randint(1, 2)))
        answer = "\n\n".join(rng.sample(PROSE + CODE + CJK, rng.randint(1, 3)))
        shape = n % 4
        if shape == 0:  # plain answer
            ids, kind = tok.encode(reasoning) + [close] + tok.encode(answer) + [end], "plain"
        elif shape == 1:  # preamble, then a tool call after </think>
            calls = [("get_weather", {"city": rng.choice(["Paris", "東京", "São Paulo"])})]
            text = rng.choice(["", "Let me check.", "我来查一下。\n"]) + _tool_section(calls)
            ids, kind = tok.encode(reasoning) + [close] + tok.encode(text) + [end], "tool_call"
        elif shape == 2:  # the tool section opens without </think>
            calls = [("search_web", {"query": rng.choice(["tokenizers", "分词器", "a \"quoted\" term"]), "limit": 3})]
            ids, kind = tok.encode(reasoning) + tok.encode(_tool_section(calls)) + [end], "tool_no_think_close"
        else:  # a reasoning-only answer that was still thinking
            ids, kind = tok.encode(reasoning + "\n" + answer) + [close] + [end], "empty_content"
        out.append(Native(_request(rng, with_tools=rng.random() < 0.3), ids, kind))
    return out


def _synthetic(tok: Any, rng: random.Random, count: int) -> list[Native]:
    dialect = resolve_dialect(tok)
    model = SyntheticModel(tok, dialect, seed=11, tool_call_rate=0.6, min_tokens=20, max_tokens=400)
    end = tok.token_id("<|im_end|>")
    out: list[Native] = []
    for n in range(count):
        req = _request(rng, with_tools=n % 3 == 0)
        gen = model.generate(req["messages"], req.get("tools"), True, n, 0)
        kind = "tool_call" if "<|tool_calls_section_begin|>" in gen.content else "plain"
        out.append(Native(req, list(gen.native_ids), kind))
        if kind == "tool_call" and n % 2 == 0:  # the same call, opened without </think>
            section = gen.content[gen.content.index("<|tool_calls_section_begin|>"):]
            ids = tok.encode(gen.reasoning or "") + tok.encode(section) + [end]
            out.append(Native(req, ids, "tool_no_think_close"))
    return out


def _with_cuts(natives: list[Native], rng: random.Random) -> list[Native]:
    """Every fifth completion also served cut at a random ``max_tokens``."""
    cuts = []
    for i, nat in enumerate(natives):
        if i % 5 == 0 and len(nat.ids) > 2:
            at = rng.randint(1, len(nat.ids) - 1)
            cuts.append(Native(nat.request, nat.ids[:at], nat.kind, cut=True))
    return natives + cuts


@pytest.fixture(scope="module")
def corpus(kimi, kimi_dir, tmp_path_factory) -> dict[str, Any]:
    """Every native completion served by SGLang's parsers, whole and streamed, reconstructed
    as one run: the run's traits (SGLang counts the end token, which the plain answers show)
    are what let the count read a tool section opened without ``</think>``."""
    from tokenbridge.reconstruct import reconstruct_file

    rng = random.Random(20261202)
    natives = _with_cuts(_synthetic(kimi, rng, 520) + _handwritten(kimi, rng, 360), rng)
    server = SGLangServer(kimi, kimi_dir)
    dialect = resolve_dialect(kimi)
    served = []
    for idx, nat in enumerate(natives):
        prompt_ids = kimi.encode(dialect.render_request(nat.request))
        for stream in (False, True):
            record = {"id": f"o{idx}-{int(stream)}", "request": nat.request,
                      "response": server.serve(nat, len(prompt_ids), stream=stream)}
            served.append((nat, stream, prompt_ids, record))
    folder = tmp_path_factory.mktemp("sglang_run")
    (folder / "in.jsonl").write_text("".join(json.dumps(rec) + "\n" for *_, rec in served), encoding="utf-8")
    traits = reconstruct_file(folder / "in.jsonl", folder / "out.jsonl", kimi, workers=1).traits
    results = [(nat, stream, prompt_ids, rec, reconstruct_record(rec, kimi, traits=traits)[0])
               for nat, stream, prompt_ids, rec in served]
    return {"natives": natives, "results": results, "tok": kimi, "dialect": dialect, "traits": traits}


def test_oracle_covers_enough_native_completions(corpus):
    natives = corpus["natives"]
    kinds = {k: sum(1 for n in natives if n.kind == k) for k in ("plain", "tool_call", "tool_no_think_close")}
    assert len(natives) >= 1000, len(natives)
    assert min(kinds.values()) >= 100, kinds
    assert sum(n.cut for n in natives) >= 150


def test_never_ok_with_wrong_ids(corpus):
    wrong = [(r["id"], nat.kind, nat.cut) for nat, _, prompt_ids, _, r in corpus["results"]
             if r["status"] == "ok" and (r["completion_ids"] != nat.ids or r["prompt_ids"] != prompt_ids)]
    assert wrong == []
    assert sum(r["status"] == "ok" for *_, r in corpus["results"]) >= 1000  # the gate is not just rejecting


def test_plain_stopped_answers_are_recovered(corpus):
    """No tools sent, ``</think>`` written, stopped: the formula inverts SGLang exactly."""
    lost = [(r["id"], [f["code"] for f in r["findings"]]) for nat, _, _, rec, r in corpus["results"]
            if nat.kind in ("plain", "tool_call") and not nat.cut and not rec["request"].get("tools")
            and r["status"] != "ok"]
    assert lost == []


def test_structured_tool_calls_are_a_finding(corpus):
    """Tools sent: SGLang's detector turns the section into ``tool_calls``; the raw
    marker tokens are gone from the text, so the sample is never ``ok``."""
    parsed = [r for _, _, _, rec, r in corpus["results"] if rec["response"]["choices"][0]["message"].get("tool_calls")]
    assert len(parsed) >= 50
    assert all(r["status"] != "ok" for r in parsed)
    assert all("structured_tool_calls" in [f["code"] for f in r["findings"]] for r in parsed)


def test_streamed_and_whole_responses_agree_unless_a_call_is_cut(corpus):
    """SGLang's streaming parsers give the one-shot split, except one known difference:
    with ``tools`` sent, the streaming tool detector holds back a call cut by ``length``
    (it never completes), while the one-shot path leaves its text in ``content``."""
    pairs: dict[str, list[tuple[Native, dict[str, Any]]]] = {}
    for nat, _, _, rec, _ in corpus["results"]:
        pairs.setdefault(rec["id"].rsplit("-", 1)[0], []).append((nat, rec["response"]["choices"][0]["message"]))
    fields = ("reasoning_content", "content", "tool_calls")
    differ = [(nat.cut, bool(nat.request.get("tools"))) for (nat, a), (_, b) in pairs.values()
              if tuple(a.get(f) for f in fields) != tuple(b.get(f) for f in fields)]
    assert set(differ) <= {(True, True)}, differ

def test_tool_call_without_think_close_is_recovered(corpus):
    """SGLang ends reasoning at the tool section when ``</think>`` never came: with exact
    usage the gate must prove the no-``</think>`` candidate and keep the sample, in a run
    that showed the end token counted."""
    assert [t.end_counted for t in corpus["traits"].values()] == [True]
    cases = [(nat, r) for nat, _, _, rec, r in corpus["results"]
             if nat.kind == "tool_no_think_close" and not nat.cut and not rec["request"].get("tools")]
    assert len(cases) >= 100
    lost = [(r["id"], [f["code"] for f in r["findings"]]) for nat, r in cases
            if r["status"] != "ok" or r["completion_ids"] != nat.ids]
    assert lost == []


def test_emulator_sglang_profile_matches_the_real_parsers(corpus):
    """The emulator's ``engine = "sglang"`` text view is what SGLang's parsers serve."""
    from tokenbridge.emulator.engines import engine_text

    checked = 0
    for nat, stream, _, rec, _ in corpus["results"]:
        if stream or rec["request"].get("tools"):
            continue
        served = rec["response"]["choices"][0]["message"]
        ours = engine_text(corpus["tok"], corpus["dialect"], nat.ids, True, "sglang")
        assert (ours.reasoning, ours.content) == (served["reasoning_content"], served["content"]), rec["id"]
        checked += 1
    assert checked >= 600


def _serve_n(server: SGLangServer, natives: list[Native], prompt_tokens: int, *, stream: bool) -> dict[str, Any]:
    """SGLang's response with n > 1: one choice per native completion, ``completion_tokens``
    and ``reasoning_tokens`` summed over the choices (``usage_processor`` in 0.5.23)."""
    served = [server.serve(nat, prompt_tokens, stream=stream) for nat in natives]
    choices = [dict(r["choices"][0], index=k) for k, r in enumerate(served)]
    completion = sum(r["usage"]["completion_tokens"] for r in served)
    reasoning = sum(r["usage"]["completion_tokens_details"]["reasoning_tokens"] for r in served)
    return {"id": "sgl", "object": "chat.completion", "created": 0, "model": "kimi-k2.5", "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion,
                      "completion_tokens_details": {"reasoning_tokens": reasoning}}}


def test_n_choices_are_never_ok_with_wrong_ids(corpus, kimi_dir):
    """With n > 1 an engine sums usage over the choices, so a reading one id too long in one
    choice can hide one id too short in another: the summed ``reasoning_tokens`` must be
    checked as well. Pairs from the corpus, and the shapes a cold attack found passing."""
    tok, dialect = corpus["tok"], corpus["dialect"]
    end, close, think = tok.token_id("<|im_end|>"), tok.token_id("</think>"), tok.token_id("<think>")
    req = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    e = tok.encode
    section = _tool_section([("get_weather", {"city": "Paris"})])
    shapes = [
        # the turn ends still thinking, after a repeated <think> the parser strips; then an ordinary answer
        [[think, *e("The user asks something simple. I should answer directly."), end],
         [*e("Simple question. Answer it."), close, *e("Paris is sunny today."), end]],
        # a tool call after </think>; an answer that ended while still thinking
        [[*e("I need the weather."), close, *e(section), end], [*e("Simple question, I think the answer is"), end]],
    ]
    plain = [n for n in corpus["natives"] if n.kind == "plain" and not n.cut and not n.request.get("tools")]
    pairs = shapes + [[a.ids, b.ids] for a, b in zip(plain[0:80:2], plain[1:80:2])]
    server = SGLangServer(tok, kimi_dir)
    prompt_ids = tok.encode(dialect.render_request(req))
    wrong, ok_plain = [], 0
    for k, ids in enumerate(pairs):
        natives = [Native(req, list(i), "n2") for i in ids]
        for stream in (False, True):
            record = {"id": f"n{k}-{int(stream)}", "request": req,
                      "response": _serve_n(server, natives, len(prompt_ids), stream=stream)}
            rows = reconstruct_record(record, tok)
            wrong += [(record["id"], c) for c, (row, nat) in enumerate(zip(rows, natives))
                      if row["status"] == "ok" and row["completion_ids"] != nat.ids]
            ok_plain += k >= len(shapes) and all(r["status"] == "ok" for r in rows)
    assert wrong == []
    assert ok_plain >= 70  # pairs of plain answers are still proven (2 x 40 served)


def test_sglang_returned_ids_prove_what_the_text_cannot(kimi, kimi_dir):
    """A turn that ended inside its think block (``R<|im_end|>``, no ``</think>``) is served
    as the formula's ``R</think><|im_end|>`` would be, one id apart: without ids the count
    rejects it; with ``return_token_ids`` SGLang hands over each choice's
    ``response_token_ids``, which prove it (only vLLM's ``token_ids`` were read)."""
    server = SGLangServer(kimi, kimi_dir)
    request = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Hi"}]}
    ids = [*kimi.encode("The user says hi. I reply hello"), kimi.token_id("<|im_end|>")]
    native = Native(request, ids, "end_in_think")
    prompt_ids = kimi.encode(resolve_dialect(kimi).render_request(request))
    plain = reconstruct_record({"id": "a", "request": request,
                                "response": server.serve(native, len(prompt_ids), stream=False)}, kimi)[0]
    assert plain["status"] == "rejected" and plain["completion_ids"] != ids
    with_ids = {"id": "b", "request": {**request, "return_token_ids": True},
                "response": server.serve(native, len(prompt_ids), stream=False, prompt_ids=prompt_ids)}
    row = reconstruct_record(with_ids, kimi)[0]
    assert (row["status"], row["findings"], row["completion_ids"], row["prompt_ids"]) == ("ok", [], ids, prompt_ids)


def test_a_token_the_engine_hid_in_an_unclosed_block_is_never_read_as_the_close(kimi, kimi_dir):
    """A turn that ended inside its think block after a token the engine hid: a ``<think>``
    SGLang's parsers delete (streamed, the first anywhere; whole, a leading one) or any
    special token skipped in detokenizing. Served as ``R`` with no content, exactly as the
    formula's ``R</think><|im_end|>``, at the formula's count: without ``reasoning_tokens``,
    ids or logprobs these were ``ok`` with a ``</think>`` in the hidden token's place (a cold
    tester's). The closed turn itself is proved by SGLang's ``reasoning_tokens``."""
    server = SGLangServer(kimi, kimi_dir)
    request = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "What does the <think> tag do?"}]}
    prompt_ids = kimi.encode(resolve_dialect(kimi).render_request(request))
    think, close, end = kimi.token_id("<think>"), kimi.token_id("</think>"), kimi.token_id("<|im_end|>")
    e = kimi.encode
    hidden = [
        [think, *e("The user says hi. I reply hello"), end],  # a leading <think>: both ways
        [*e("The user typed the tag"), think, *e(" literally, so I answer"), end],  # streamed: the first one anywhere
        [*e("#é"), kimi.token_id("<|im_user|>"), end],  # a special token skipped
    ]
    closed = [*e("Nothing to add."), close, end]
    for k, ids in enumerate([*hidden, closed]):
        for stream in (False, True):
            response = server.serve(Native(request, ids, "end_in_think"), len(prompt_ids), stream=stream)
            message = response["choices"][0]["message"]
            if ids is not closed and (message["content"] or think in ids[1:-2] and not stream):
                continue  # not served as an empty-content turn this way (a <think> left in the text)
            row = reconstruct_record({"id": f"h{k}", "request": request, "response": response}, kimi)[0]
            if ids is closed:  # SGLang counts up to and including </think>: only the closed reading fits
                assert (row["status"], row["completion_ids"]) == ("ok", ids), row["findings"]
            without = copy.deepcopy(response)
            del without["usage"]["completion_tokens_details"]
            row = reconstruct_record({"id": f"h{k}", "request": request, "response": without}, kimi)[0]
            assert row["status"] != "ok" or row["completion_ids"] == ids, (k, stream, row["completion_ids"])
            assert row["status"] == "rejected" and "reconstruction_ambiguous" in [f["code"] for f in row["findings"]]
        if ids is not closed:
            with_ids = server.serve(Native(request, ids, "end_in_think"), len(prompt_ids), stream=False,
                                    prompt_ids=prompt_ids)
            row = reconstruct_record({"id": f"i{k}", "request": request, "response": with_ids}, kimi)[0]
            assert row["completion_ids"] == ids or row["status"] != "ok"


def test_a_tool_section_opened_before_any_reasoning_is_proven_by_the_count(kimi, kimi_dir, corpus):
    """The model went straight into a tool section, never closing its think block: SGLang's
    kimi_k2 parser ends the (empty) reasoning at the section and serves none. In a run that
    showed SGLang counting the end token, the count proves there was none (the formula's
    ``</think>`` would count one more), so it is not ``reasoning_missing`` (was: rejected
    with the right ids); reasoning a provider withheld would be counted, and is still said.
    Alone, the record's count is also the formula's with an uncounted end: not proof."""
    server = SGLangServer(kimi, kimi_dir)
    request = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    prompt_ids = kimi.encode(resolve_dialect(kimi).render_request(request))
    ids = [*kimi.encode(_tool_section([("get_weather", {"city": "Paris"})])), kimi.token_id("<|im_end|>")]
    traits = corpus["traits"]
    for stream in (False, True):
        response = server.serve(Native(request, ids, "tool_no_think_close"), len(prompt_ids), stream=stream)
        assert not response["choices"][0]["message"]["reasoning_content"]
        row = reconstruct_record({"id": "t", "request": request, "response": response}, kimi)[0]
        assert row["status"] == "rejected", row
        row = reconstruct_record({"id": "t", "request": request, "response": response}, kimi, traits=traits)[0]
        assert (row["status"], row["completion_ids"], row["reconstruction"]) == ("ok", ids, "no_think_close"), row
        response["usage"]["completion_tokens"] += 40  # reasoning the provider withheld: counted, not served
        del response["usage"]["completion_tokens_details"]
        row = reconstruct_record({"id": "t", "request": request, "response": response}, kimi, traits=traits)[0]
        assert row["status"] == "rejected" and "reasoning_missing" in [f["code"] for f in row["findings"]]

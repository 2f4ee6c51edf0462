"""Qwen3 (hybrid thinking) with the real shared tokenizer, proven like Kimi.

Prompts: the folder's official chat template through our Jinja path, cross-checked
token for token against the independent ``renderers==0.1.12`` ``Qwen3Renderer`` over
generated conversations, and against transformers' ``apply_chat_template``. Completions:
native ids go through SGLang 0.5.23's real ``qwen3`` reasoning parser (whole and
streamed) and must come back exactly, or with a finding.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_families_support import SGLangEngine, TOOLS, OracleTokenizer, nonempty, texts, tool_lists, tool_round, words
from tokenbridge.chat import DIALECTS, resolve_dialect
from tokenbridge.reconstruct import reconstruct_record
from tokenbridge.traits import ProviderTrait

try:
    from renderers.configs import Qwen3RendererConfig
    from renderers.qwen3 import Qwen3Renderer
except ImportError as e:  # pragma: no cover - CI installs it (requirements-oracles.txt)
    Qwen3Renderer = None
    _WHY = f"oracle `renderers` not importable ({e})"

needs_renderers = pytest.mark.skipif(Qwen3Renderer is None, reason=globals().get("_WHY", ""))

END, THINK, THINK_END, CALL, CALL_END = 151645, 151667, 151668, 151657, 151658


FAMILY = "qwen3"  # the tok / dialect fixtures (conftest)


@pytest.fixture(scope="module")
def oracles(tok):
    adapter = OracleTokenizer(tok)
    return {t: Qwen3Renderer(adapter, Qwen3RendererConfig(enable_thinking=t)) for t in (True, False)}


def test_folder_resolves_to_qwen3_with_its_template(tok, dialect):
    assert dialect.name == "qwen3+template"
    assert (dialect.end_token, dialect.think_open, dialect.think_close) == ("<|im_end|>", "<think>", "</think>")
    assert [tok.token_id(m) for m in ("<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")] == \
        [END, THINK, THINK_END, CALL, CALL_END]
    assert resolve_dialect(tok, "qwen3", use_template=False).name == "qwen3"


def test_prompt_ids_recorded_in_provenance(tok, dialect):
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
    instant = [151644, 8948, 198, 2610, 525, 10950, 13, 151645, 198, 151644, 872, 198, 13048, 151645, 198,
               151644, 77091, 198, 151667, 271, 151668, 271]
    assert tok.encode(dialect.render_prompt(msgs, thinking=False)) == instant
    assert tok.encode(dialect.render_prompt(msgs)) == instant[:-4]
    assert tok.encode(dialect.render_request({"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})) == instant


# --- prompts: renderers and transformers as oracles --------------------------------------


@st.composite
def conversations(draw, thinking: bool) -> tuple[list[dict[str, Any]], Any]:
    """System or not; 1-3 user turns; tool rounds; replies with or without reasoning.
    Instant mode gives every assistant turn non-empty reasoning: renderers re-emits an
    empty think wrapper on reasoning-less history there (its documented deviation,
    pinned in test_renderers_keeps_the_empty_think_wrapper_in_instant_history)."""
    reasoning = st.one_of(st.none(), texts) if thinking else nonempty
    msgs: list[dict[str, Any]] = []
    system = draw(st.sampled_from(["none", "plain", "cjk", "empty"]))
    if system != "none":
        msgs.append({"role": "system", "content": {"plain": "You are terse.", "cjk": "你是一个乐于助人的助手。", "empty": ""}[system]})
    for turn in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(texts)})
        for r in range(draw(st.sampled_from([0, 0, 1, 2]))):
            msgs.extend(draw(tool_round(10 * turn + r, reasoning=reasoning, string_args=draw(st.booleans()))))
        if draw(st.integers(0, 3)):
            reply: dict[str, Any] = {"role": "assistant", "content": draw(texts)}
            if (r := draw(reasoning)) is not None:
                reply["reasoning_content"] = r
            msgs.append(reply)
    if msgs[-1]["role"] == "assistant" and draw(st.booleans()):
        msgs.append({"role": "user", "content": draw(texts)})
    return msgs, draw(tool_lists)


def _compare(tok, dialect, oracles, msgs, tools, thinking, *, seen):
    text = dialect.render_prompt(msgs, tools, thinking)
    assert DIALECTS["qwen3"].render_prompt(msgs, tools, thinking) == text  # the built-in follows the template
    theirs = oracles[thinking].render(msgs, tools=tools, add_generation_prompt=True).token_ids
    assert tok.decode_bytes(theirs) == text.encode()  # the same prompt, byte for byte
    ours = tok.encode(text)  # one pass, as apply_chat_template(tokenize=True)
    seen["piecewise"] += ours != list(theirs)
    seen["conversations"] += 1
    seen["tools"] += bool(tools)
    seen["tool_results"] += any(m["role"] == "tool" for m in msgs)
    seen["reasoning_history"] += any(m.get("reasoning_content") for m in msgs)
    seen["multi_turn"] += sum(m["role"] == "user" for m in msgs) > 1


@needs_renderers
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "instant"])
def test_generated_conversations_match_renderers(tok, dialect, oracles, thinking):
    seen = dict.fromkeys(("conversations", "tools", "tool_results", "reasoning_history", "multi_turn", "piecewise"), 0)

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(conversations(thinking))
    def check(case):
        _compare(tok, dialect, oracles, *case, thinking, seen=seen)

    check()
    assert seen["conversations"] >= 250, seen
    assert min(seen[k] for k in ("tools", "tool_results", "reasoning_history", "multi_turn")) >= 40, seen
    # renderers encodes piece by piece; where that splits a merge, the bytes still agree (above)
    assert seen["piecewise"] < seen["conversations"] // 4, seen


def test_template_path_equals_transformers_apply_chat_template(tok, dialect):
    from transformers import PreTrainedTokenizerFast

    from test_families_support import SHARED

    hf = PreTrainedTokenizerFast(tokenizer_file=str(SHARED / "qwen3" / "tokenizer.json"))
    hf.chat_template = tok.chat_template
    rnd = random.Random(7)
    for case in range(40):
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "天气 in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "\nneed the tool\n",
                 "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "巴黎"}}}]},
                {"role": "tool", "tool_call_id": "c0", "content": '{"temp": 20}'},
                {"role": "assistant", "content": "20 degrees.", "reasoning_content": "r"},
                {"role": "user", "content": "and tomorrow" * rnd.randint(0, 3)}][: rnd.randint(2, 6)]
        thinking = bool(case % 2)
        tools = TOOLS if case % 3 else None
        theirs = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                        enable_thinking=thinking)
        assert dialect.render_prompt(msgs, tools, thinking) == theirs


@needs_renderers
def test_renderers_keeps_the_empty_think_wrapper_in_instant_history(tok, dialect, oracles):
    """renderers (its module docstring) re-emits ``<think>\\n\\n</think>\\n\\n`` on earlier
    assistant turns without reasoning when thinking is disabled; the official template,
    which SGLang and vLLM render, strips it. We follow the template."""
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    ours = dialect.render_prompt(msgs, thinking=False)
    theirs = tok.decode(oracles[False].render(msgs, add_generation_prompt=True).token_ids)
    assert ours == ("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
                    "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert theirs == ours.replace("assistant\nb", "assistant\n<think>\n\n</think>\n\nb")


def test_list_content_renders_empty_in_the_template_but_joined_in_the_builtin(dialect):
    """The official template prints non-string content as ''; engines flatten text parts
    before the template (SGLang joins them with ' ', vLLM with '\\n'), so a list-content
    request is one the template path cannot pin to one engine: documented, not hidden."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert dialect.render_prompt(msgs) == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    assert DIALECTS["qwen3"].render_prompt(msgs) == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"


# --- completions: SGLang's qwen3 reasoning parser as the engine --------------------------


def _call_text(name: str, args: dict[str, Any]) -> str:
    import json

    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'


@st.composite
def natives(draw) -> tuple[bool, str, str]:
    """(thinking, kind, native completion text) as Qwen3 writes it."""
    thinking = draw(st.booleans())
    content = draw(texts)
    kind = draw(st.sampled_from(["plain", "plain", "tool", "tool_no_think_close", "cut"]))
    calls = ""
    if kind.startswith("tool"):
        n = draw(st.integers(1, 2))
        calls = "\n".join(_call_text(draw(st.sampled_from(["get_weather", "search"])),
                                     draw(st.dictionaries(st.sampled_from(["city", "q"]), words, max_size=2))) for _ in range(n))
        calls = ("\n" if content else "") + calls
    if thinking:
        reasoning = draw(texts)
        close = "" if kind == "tool_no_think_close" else "</think>\n\n"
        text = f"<think>\n{reasoning}\n{close}{content}{calls}<|im_end|>"
    else:
        if kind == "tool_no_think_close":
            kind = "tool"
        text = f"{content}{calls}<|im_end|>"
    return thinking, kind, text


PROMPT = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Check the weather tool."}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sglang_served_completions_rebuild_exactly_or_are_flagged(tok, dialect, stream):
    engine = SGLangEngine(tok, "qwen3", "qwen3", {END})
    seen = {"accepted": 0, "rejected": 0, "kinds": set()}

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(natives(), st.randoms(use_true_random=False))
    def check(native, rnd):
        thinking, kind, text = native
        ids = tok.encode(text)
        if kind == "cut":
            ids = ids[: rnd.randint(1, len(ids))] if len(ids) > 1 else ids
        request = {"messages": PROMPT, "chat_template_kwargs": {"enable_thinking": thinking}}
        prompt_ids = tok.encode(dialect.render_request(request))
        response = engine.serve(ids, len(prompt_ids), thinking=thinking, stream=stream)
        row, = reconstruct_record({"id": "q", "request": request, "response": response}, tok)
        codes = [c["code"] for c in row["findings"]]
        seen.setdefault("codes", Counter()).update(codes)
        if row["status"] != "rejected":  # ok, or flagged only by warnings (truncated)
            assert row["completion_ids"] == ids, (kind, text)
            seen["accepted"] += 1
            seen["kinds"].add(kind)
        else:
            assert row["findings"]
            seen["rejected"] += 1
        if kind == "tool_no_think_close":  # SGLang ends the reasoning at <tool_call>: usage proves no </think>,
            # where the run proved the end token counted (else the formula with it uncounted ties)
            assert row["status"] == "rejected" and codes == ["usage_completion_mismatch"], row["findings"]
            traits = {str(response.get("provider")): ProviderTrait(str(response.get("provider")), end_counted=True)}
            row, = reconstruct_record({"id": "q", "request": request, "response": response}, tok, traits=traits)
            assert row["status"] == "ok" and row["reconstruction"] == "no_think_close", row["findings"]
            assert row["completion_ids"] == ids

    check()
    print(seen)
    assert seen["accepted"] >= 150 and {"plain", "tool", "cut"} <= seen["kinds"], seen


def test_exact_ids_thinking_tool_call_and_end(tok, dialect):
    """Think markers, the tool-call section and the end token at their exact positions."""
    reasoning, content = "\nLook it up.\n", "\n\nCalling."
    call = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    rec = {"id": "t", "request": {"messages": PROMPT},
           "response": {"choices": [{"message": {"reasoning_content": reasoning, "content": content + call},
                                     "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    ids = row["completion_ids"]
    r, body = tok.encode(reasoning), tok.encode(content + call)  # "Calling." + "\n" merge into ".\n"
    assert ids == [THINK, *r, THINK_END, *body, END]
    at = body.index(CALL)
    assert body[at - 1] == 624 and body[-1] == CALL_END and body.count(CALL) == 1  # ".\n" then <tool_call>
    kinds = [(s["kind"], s["end"] - s["start"]) for s in row["segments"][1:]]
    assert kinds == [("think_start", 1), ("reasoning", len(r)), ("think_end", 1), ("content", at),
                     ("tool_calls", len(body) - at), ("end", 1)]
    assert [f["code"] for f in row["findings"]] == ["usage_missing"]


def test_instant_mode_has_no_think_markers_in_the_completion(tok, dialect):
    request = {"messages": PROMPT, "chat_template_kwargs": {"enable_thinking": False}}
    rec = {"id": "i", "request": request, "response": {"choices": [{"message": {"content": "Sunny."}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    assert row["completion_ids"] == [*tok.encode("Sunny."), END]
    assert row["prompt_ids"][-4:] == [THINK, 271, THINK_END, 271]
    assert not row["thinking"]


@pytest.mark.parametrize("content, code", [
    ("x<tool_call>\n{}\n", "tool_markers_malformed"),  # never closed
    ("x</tool_call>", "tool_markers_malformed"),  # closed, never opened
    ('<tool_call>\n{"name": "f"}<tool_call></tool_call>', "tool_markers_malformed"),  # nested
    ("done<|endoftext|>", "eos_in_text"),
    ("a<|im_start|>user", "special_token_text"),
    ("a<think>b", "think_marker_in_content"),
])
def test_gate_codes_for_qwen3_markers(tok, content, code):
    rec = {"id": "g", "request": {"messages": PROMPT},
           "response": {"choices": [{"message": {"reasoning_content": "r", "content": content}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    assert code in {f["code"] for f in row["findings"]}, row["findings"]
    assert row["status"] == "rejected"


def test_tool_marker_in_reasoning_is_its_own_code(tok):
    rec = {"id": "g", "request": {"messages": PROMPT},
           "response": {"choices": [{"message": {"reasoning_content": "r <tool_call>", "content": "ok"}, "finish_reason": "stop"}]}}
    row, = reconstruct_record(rec, tok)
    assert "tool_section_in_reasoning" in {f["code"] for f in row["findings"]}

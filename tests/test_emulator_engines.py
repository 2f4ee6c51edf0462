"""Engine profiles (sglang / vllm) and the response shapes real providers send:
``reasoning_details``, ``logprobs``, SGLang's ``matched_stop``, ``reasoning_tokens``;
non-streamed and streamed (folded with generate's own StreamAssembler), over HTTP on
127.0.0.1 against the real Kimi tokenizer."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tokenbridge.emulator import EmulatorConfig, ProviderConfig, ProviderQuirks, running_emulator
from tokenbridge.generate.sse import SSEDecoder, StreamAssembler

MODEL = "moonshotai/kimi-k2.5"
THINK_END, IM_END, SECTION_BEGIN = 163607, 163586, 163595
TOOLS_IN_SYSTEM = "You may call these tools:\n- get_weather: current weather for a city\n"

PROVIDERS = (
    ProviderConfig(name="clean/fp8"),
    ProviderConfig(name="sgl/fp8", engine="sglang"),
    ProviderConfig(name="vll/fp8", engine="vllm"),
    ProviderConfig(name="details/fp8", quirks=ProviderQuirks(reasoning_details=1.0)),
    ProviderConfig(name="detailsonly/fp8", quirks=ProviderQuirks(reasoning_details_only=1.0)),
)


@pytest.fixture(scope="module")
def base(kimi):
    cfg = EmulatorConfig(providers=PROVIDERS, tool_call_rate=1.0, tool_call_without_think_close=0.5, max_tokens=400)
    with running_emulator(cfg, tokenizer=kimi) as url:
        yield url


def _post(base: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(f"{base}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        return r.read()


def _chat(base: str, only: str, *, stream: bool = False, topic: str = "hash maps", **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Explain {topic}."}],
            "provider": {"only": [only]}, "return_token_ids": True, **extra}
    if not stream:
        return json.loads(_post(base, body))
    asm, dec = StreamAssembler(), SSEDecoder()
    for ev in [*dec.feed(_post(base, {**body, "stream": True})), *dec.close()]:
        if ev.data != "[DONE]":
            asm.add_event(ev)
    return asm.result()


def _tool_chat(base: str, only: str, seed: int, **kw: Any) -> dict[str, Any]:
    msgs = [{"role": "system", "content": TOOLS_IN_SYSTEM}, {"role": "user", "content": f"Weather in city {seed}?"}]
    return _chat(base, only, messages=msgs, **kw)


def _first_no_close(base: str, only: str, **kw: Any) -> tuple[dict[str, Any], list[int]]:
    """A response whose native ids open the tool section without ``</think>``."""
    for seed in range(40):
        body = _tool_chat(base, only, seed, **kw)
        ids = body["choices"][0]["token_ids"]
        if SECTION_BEGIN in ids and THINK_END not in ids:
            return body, ids
    raise AssertionError("no tool call without </think> in 40 tries at rate 0.5")


# --- the synthetic model ----------------------------------------------------------------


def test_tool_call_without_think_close_ids(base, kimi):
    body, ids = _first_no_close(base, "clean")
    msg = body["choices"][0]["message"]
    at = ids.index(SECTION_BEGIN)
    assert ids[-1] == IM_END and kimi.encode(msg["reasoning"]) == ids[:at]
    assert msg["content"].startswith("<|tool_calls_section_begin|>") and kimi.encode(msg["content"]) == ids[at:-1]


# --- sglang -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_shape(base, kimi, stream):
    body = _chat(base, "sgl", stream=stream)
    choice, usage = body["choices"][0], body["usage"]
    ids, msg = choice["token_ids"], choice["message"]
    assert "reasoning" not in msg and msg["reasoning_content"]
    close = ids.index(THINK_END)
    assert kimi.encode(msg["reasoning_content"]) == ids[:close]
    assert kimi.encode(msg["content"]) == ids[close + 1 : -1]
    assert choice["matched_stop"] == IM_END and choice["finish_reason"] == "stop"
    # SGLang's scheduler counts reasoning up to and including </think>
    assert usage["completion_tokens_details"]["reasoning_tokens"] == close + 1
    assert usage["completion_tokens"] == len(ids)


def test_sglang_length_cut_has_no_matched_stop(base):
    choice = _chat(base, "sgl", max_tokens=5)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None


def test_sglang_ends_reasoning_at_the_tool_section(base, kimi):
    body, ids = _first_no_close(base, "sgl")
    msg = body["choices"][0]["message"]
    at = ids.index(SECTION_BEGIN)
    assert kimi.encode(msg["reasoning_content"]) == ids[:at]
    assert msg["content"].startswith("<|tool_calls_section_begin|>")
    # no </think>: every completion token counts as reasoning, the end token included
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(ids)


# --- vllm -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_spaces_around_added_tokens(base, kimi, stream):
    body = _chat(base, "vll", stream=stream)
    ids, msg = body["choices"][0]["token_ids"], body["choices"][0]["message"]
    close = ids.index(THINK_END)
    reasoning, content = kimi.decode(ids[:close]), kimi.decode(ids[close + 1 : -1])
    assert msg["reasoning"] == f" {reasoning} " and msg["content"] == f" {content}"
    assert "matched_stop" not in body["choices"][0] and "reasoning_content" not in msg
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0  # Kimi parser: base count, 0


def test_vllm_spaces_inside_the_tool_section(base):
    body, _ = _first_no_close(base, "vll")
    content = body["choices"][0]["message"]["content"]
    assert content.startswith("<|tool_calls_section_begin|> <|tool_call_begin|> functions.get_weather:")
    assert content.endswith(" <|tool_call_end|> <|tool_calls_section_end|>")


def test_vllm_content_is_null_when_cut_in_reasoning(base):
    msg = _chat(base, "vll", max_tokens=5)["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning"]


def test_vllm_tools_param_parses_spaced_calls(base):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    for seed in range(10):
        choice = _tool_chat(base, "vll", seed, tools=[tool])["choices"][0]
        if choice["message"].get("tool_calls"):
            args = choice["message"]["tool_calls"][0]["function"]["arguments"]
            assert json.loads(args) and args == args.strip()
            return
    raise AssertionError("no structured call in 10 tries")


# --- reasoning_details ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_details_alongside_reasoning(base, stream):
    msg = _chat(base, "details", stream=stream)["choices"][0]["message"]
    details = msg["reasoning_details"]
    assert [d["type"] for d in details] == ["reasoning.text"] and details[0]["index"] == 0
    assert details[0]["text"] == msg["reasoning"]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_only_in_details(base, stream):
    clean = _chat(base, "clean")["choices"][0]["message"]
    msg = _chat(base, "detailsonly", stream=stream)["choices"][0]["message"]
    assert msg.get("reasoning") is None
    assert "".join(d["text"] for d in msg["reasoning_details"]) == clean["reasoning"]
    assert msg["content"] == clean["content"]


def test_no_details_by_default(base):
    assert "reasoning_details" not in _chat(base, "clean")["choices"][0]["message"]


# --- logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_cover_every_completion_id(base, kimi, stream):
    choice = _chat(base, "clean", stream=stream, logprobs=True, top_logprobs=1)["choices"][0]
    entries = choice["logprobs"]["content"]
    ids = choice["token_ids"]
    assert [bytes(e["bytes"]) for e in entries] == [kimi.token_bytes(i) for i in ids]
    assert entries[-1]["token"] == "<|im_end|>" and all(e["logprob"] <= 0 for e in entries)
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries)


def test_no_logprobs_unless_asked(base):
    assert _chat(base, "clean")["choices"][0]["logprobs"] is None


def test_vllm_tokens_as_token_ids(base):
    choice = _chat(base, "vll", logprobs=True, return_tokens_as_token_ids=True)["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in choice["token_ids"]]


def test_reasoning_tokens_default_excludes_think_close(base):
    body = _chat(base, "clean")
    ids = body["choices"][0]["token_ids"]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == ids.index(THINK_END)

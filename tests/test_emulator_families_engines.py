"""The emulator's engine profiles for the tokenizer.json families, over HTTP on 127.0.0.1.

vLLM is not installed, so its profile is pinned to the shapes its parsers' code gives
(``Qwen3ReasoningParser`` / ``Glm4MoeModelReasoningParser``: a split only when both think
markers are in the text, what precedes ``<think>`` dropped; ``DeepSeekV3ReasoningParser``:
all content unless thinking was asked; ``tokenizers``' decode: no join spaces), and each
shape is held to what reconstruct makes of it. SGLang's streamed form (GLM: the first
``<think>`` dropped wherever it is) is served when the request streams, and the scheduler's
``reasoning_tokens`` and ``matched_stop`` follow its code.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from test_families_support import family_tokenizer
from tokenbridge.chat import resolve_dialect
from tokenbridge.emulator import EmulatorConfig, ProviderConfig, ProviderQuirks, running_emulator
from tokenbridge.generate.sse import SSEDecoder, StreamAssembler
from tokenbridge.reconstruct import reconstruct_record

TOOLS_IN_SYSTEM = "You may call these tools:\n- get_weather: current weather for a city\n"
PROVIDERS = (ProviderConfig(name="clean/fp8"), ProviderConfig(name="sgl/fp8", engine="sglang"),
             ProviderConfig(name="vll/fp8", engine="vllm"),
             ProviderConfig(name="split/fp8", quirks=ProviderQuirks(noncanonical=1.0)))


@pytest.fixture(scope="module", params=["qwen3", "deepseek-v3.1", "deepseek-v3.2", "glm-4.5"])
def served(request):
    tok = family_tokenizer(request.param)
    cfg = EmulatorConfig(providers=PROVIDERS, accept_any_model=True, tool_call_rate=1.0, max_tokens=300)
    with running_emulator(cfg, tokenizer=tok) as url:
        yield request.param, tok, resolve_dialect(tok), url


def _post(url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return r.read()


def _chat(url: str, only: str, *, thinking: bool = True, stream: bool = False, tools: bool = False,
          after_tool: bool = False, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Explain hash maps in python."}]
    if tools:
        messages.insert(0, {"role": "system", "content": TOOLS_IN_SYSTEM})
    if after_tool:
        messages += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny, 20 C"}]
    body = {"model": "m", "messages": messages, "provider": {"only": [only]}, "return_token_ids": True,
            "chat_template_kwargs": {"thinking": thinking, "enable_thinking": thinking}, **extra}
    if not stream:
        response = json.loads(_post(url, body))
    else:
        asm, dec = StreamAssembler(), SSEDecoder()
        for ev in [*dec.feed(_post(url, {**body, "stream": True})), *dec.close()]:
            if ev.data != "[DONE]":
                asm.add_event(ev)
        response = asm.result()
    return body, response


def _rebuild(tok: Any, body: dict[str, Any], response: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    response = json.loads(json.dumps(response))
    native = response["choices"][0].pop("token_ids")
    response.pop("prompt_token_ids", None)
    row, = reconstruct_record({"id": "r", "request": body, "response": response}, tok)
    return row, native


def test_vllm_serves_the_fast_tokenizer_decode_and_its_parser_split(served):
    name, tok, dialect, url = served
    body, response = _chat(url, "vll")
    ids, msg = response["choices"][0]["token_ids"], response["choices"][0]["message"]
    close = ids.index(tok.token_id("</think>"))
    assert "reasoning_content" not in msg and "matched_stop" not in response["choices"][0]
    start = {"qwen3": 1, "glm-4.5": 2}.get(name, 0)  # after <think> (and GLM's "\n", which vLLM drops)
    assert msg["reasoning"] == tok.decode(ids[start:close])  # no join spaces around the markers
    assert msg["content"] == tok.decode(ids[close + 1 : -1])
    assert response["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0  # base count_reasoning_tokens
    row, native = _rebuild(tok, body, response)
    assert row["status"] == "ok" and row["completion_ids"] == native


def test_vllm_cut_inside_the_reasoning(served):
    """Qwen3 and GLM: no </think> yet, so no split: the whole text, <think> included, is
    content (the gate rejects it); DeepSeek (R1 parser): all reasoning, content null."""
    name, tok, dialect, url = served
    body, response = _chat(url, "vll", max_tokens=8)
    msg = response["choices"][0]["message"]
    row, native = _rebuild(tok, body, response)
    if name in ("qwen3", "glm-4.5"):
        assert msg.get("reasoning") is None and "<think>" in msg["content"]
        assert row["status"] == "rejected" and "think_marker_in_content" in {f["code"] for f in row["findings"]}
    else:
        assert msg["content"] is None and msg["reasoning"] == tok.decode(native)
        assert row["status"] == "flagged" and row["completion_ids"] == native  # truncated: a warning


def test_deepseek_instant_mode_is_all_content_and_after_a_tool_result_all_reasoning(served):
    name, tok, dialect, url = served
    if not name.startswith("deepseek"):
        pytest.skip("DeepSeek's thinking switch")
    for engine in ("vll", "sgl", "clean"):
        body, response = _chat(url, engine, thinking=False)
        msg = response["choices"][0]["message"]
        assert not msg.get("reasoning") and not msg.get("reasoning_content") and msg["content"]
        row, native = _rebuild(tok, body, response)
        assert row["status"] == "ok" and row["completion_ids"] == native
    if name == "deepseek-v3.2":
        return  # V3.2's prompt reopens the think block after a tool result
    for engine in ("vll", "sgl", "clean"):
        body, response = _chat(url, engine, after_tool=True)
        msg = response["choices"][0]["message"]
        native = response["choices"][0]["token_ids"]
        assert tok.token_id("</think>") not in native and tok.token_id("<think>") not in native
        assert (msg.get("reasoning") or msg.get("reasoning_content")) == tok.decode(native[:-1]) and not msg["content"]
        row, native = _rebuild(tok, body, response)
        assert row["status"] == "ok" and row["completion_ids"] == native


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sglang_shape_and_counts(served, stream):
    name, tok, dialect, url = served
    body, response = _chat(url, "sgl", stream=stream, tools=True)
    choice = response["choices"][0]
    ids, msg = choice["token_ids"], choice["message"]
    close = ids.index(tok.token_id("</think>"))
    assert choice["matched_stop"] == ids[-1] and tok.marker_ids[ids[-1]] in dialect.end_tokens
    if name == "glm-4.5":  # a tool call ends the turn with <|observation|>
        assert tok.marker_ids[ids[-1]] == "<|observation|>"
        # whole: "\n<think>" + reasoning; streamed: the first <think> dropped
        assert msg["reasoning_content"] == ("\n" if stream else "\n<think>") + tok.decode(ids[2:close])
    elif name == "qwen3":
        assert msg["reasoning_content"] == tok.decode(ids[1:close])
    # the scheduler counts every token up to and including </think> (<think> too, when written)
    assert response["usage"]["completion_tokens_details"]["reasoning_tokens"] == close + 1
    row, native = _rebuild(tok, body, response)
    if name == "deepseek-v3.2":  # ｜DSML｜ is special: skip_special_tokens drops it
        assert row["status"] == "rejected" and "tool_markers_dropped" in {f["code"] for f in row["findings"]}
    else:
        assert row["status"] == "ok" and row["completion_ids"] == native, row["findings"]


def test_clean_provider_counts_the_reasoning_alone_and_cuts_by_the_ids(served):
    name, tok, dialect, url = served
    body, response = _chat(url, "clean")
    ids = response["choices"][0]["token_ids"]
    close = ids.index(tok.token_id("</think>"))
    start = {"qwen3": 1, "glm-4.5": 2}.get(name, 0)
    assert response["usage"]["completion_tokens_details"]["reasoning_tokens"] == close - start
    cuts = 0
    for limit in (3, 9, close, close + 1, close + 4):
        body, response = _chat(url, "clean", max_tokens=limit)
        row, native = _rebuild(tok, body, response)
        assert native == ids[:limit] and response["choices"][0]["finish_reason"] == "length"
        if row["status"] != "rejected":
            assert row["completion_ids"] == native and [f["code"] for f in row["findings"]] == ["truncated"]
            cuts += 1
    assert cuts >= 3


def test_noncanonical_quirk_splits_one_token_in_every_family(served):
    """DeepSeek's markers include ids 0-2, so ordinary tokens are not "ids below the first
    marker": the split must still find one (it did not, and the quirk was silently off)."""
    name, tok, dialect, url = served
    body, clean = _chat(url, "clean")
    _, split = _chat(url, "split")
    a, b = clean["choices"][0]["token_ids"], split["choices"][0]["token_ids"]
    assert len(b) == len(a) + 1 and tok.decode_bytes(b) == tok.decode_bytes(a)
    assert split["choices"][0]["message"] == clean["choices"][0]["message"]
    row, native = _rebuild(tok, body, split)
    assert row["status"] == "rejected" and row["completion_ids"] != native
    assert "usage_completion_mismatch" in {f["code"] for f in row["findings"]}

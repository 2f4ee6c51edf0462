"""A request that carries ``tools``, end to end through the loopback emulator: the
emulator renders its prompt with the same dialect code, so the exchange reconstructs
``ok`` with the emulator's own prompt ids, the TypeScript declaration included."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tokenbridge.emulator import EmulatorConfig, ProviderConfig, running_emulator
from tokenbridge.reconstruct import reconstruct_record

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"enum": ["c", "f"], "default": "c"},
            "days": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 7},
        }}}},
    {"type": "function", "function": {"name": "search_web", "parameters": {"type": "object", "properties": {
        "q": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}},
]
MESSAGES = [
    {"role": "user", "content": "Weather in Paris today?"},
    {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "Sunny, 21 C"},
]


@pytest.fixture(scope="module")
def emulator(kimi):
    cfg = EmulatorConfig(providers=(ProviderConfig(name="clean/fp8", quantization="fp8"),), tool_call_rate=0.0,
                         min_tokens=10, max_tokens=60)
    with running_emulator(cfg, tokenizer=kimi) as url:
        yield url


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("kwargs", [{}, {"chat_template_kwargs": {"preserve_thinking": True}},
                                    {"chat_template_kwargs": {"thinking": False}}],
                         ids=["default", "preserve_thinking", "instant"])
def test_request_with_tools_reconstructs_ok_with_the_emulators_prompt_ids(emulator, kimi, kwargs):
    request = {"model": "moonshotai/kimi-k2.5", "messages": MESSAGES, "tools": TOOLS, "return_token_ids": True, **kwargs}
    response = _post(emulator, request)
    row, = reconstruct_record({"id": "t1", "request": request, "response": response}, kimi)
    assert row["findings"] == [] and row["status"] == "ok"
    assert row["prompt_ids"] == response["prompt_token_ids"]
    assert row["completion_ids"] == response["choices"][0]["token_ids"]
    prompt = kimi.decode(row["prompt_ids"])
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n")
    assert "type get_weather = (_: {\n  // City name\n  city: string," in prompt
    assert "type search_web = (_: {\n  q?: string | null\n}) => any;\n}\n<|im_end|>" in prompt


def test_request_with_tools_matches_the_renderers_oracle(emulator, kimi):
    """The same prompt from an implementation no one here wrote (text identical; ids as the
    serving side encodes that text in one pass)."""
    kimi_k25 = pytest.importorskip("renderers.kimi_k25", reason="oracle `renderers` not installed")
    from renderers.configs import KimiK25RendererConfig

    from tokenbridge.chat.kimi import DEFAULT_SYSTEM

    class Adapter:
        unk_token_id = -1

        def convert_tokens_to_ids(self, token: str) -> int:
            return kimi.markers.get(token, -1)

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return kimi.encode(text)

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return kimi.decode(ids)

    request = {"model": "moonshotai/kimi-k2.5", "messages": MESSAGES, "tools": TOOLS, "return_token_ids": True}
    response = _post(emulator, request)
    oracle = kimi_k25.KimiK25Renderer(Adapter(), KimiK25RendererConfig(thinking=True))
    theirs = oracle.render([{"role": "system", "content": DEFAULT_SYSTEM}, *MESSAGES], tools=TOOLS,
                           add_generation_prompt=True, process_multimodal=False).token_ids
    assert response["prompt_token_ids"] == kimi.encode(kimi.decode(list(theirs)))

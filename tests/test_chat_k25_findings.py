"""What the gate says about prompts the built-in K2.5 dialect cannot prove: template
kwargs it does not render, media parts, and tools outside the reproduced subset."""

from __future__ import annotations

from typing import Any

import pytest

from tokenbridge.chat import DIALECTS
from tokenbridge.chat.template import template_renderer
from tokenbridge.checks import media_parts
from tokenbridge.reconstruct import reconstruct_record

KIMI = DIALECTS["kimi-k2.5"]
HISTORY = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1", "reasoning_content": "EARLIER REASONING"},
    {"role": "user", "content": "q2"},
]


def _record(kimi, request: dict[str, Any], *, dialect=KIMI, usage_delta: int = 0) -> dict[str, Any]:
    thinking = KIMI.render_request(request).endswith("<think>")
    reasoning = "Think." if thinking else None
    prompt = len(kimi.encode(dialect.render_request(request))) + usage_delta
    completion = (len(kimi.encode("Think.")) + 1 if thinking else 0) + len(kimi.encode("Done.")) + 1
    msg: dict[str, Any] = {"role": "assistant", "content": "Done."}
    if reasoning:
        msg["reasoning"] = reasoning
    return {"id": "r1", "request": request, "response": {
        "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}}


def _codes(kimi, request, **kw) -> list[str]:
    row, = reconstruct_record(_record(kimi, request, **kw), kimi, dialect=kw.get("dialect", KIMI))
    return sorted(f["code"] for f in row["findings"])


def test_preserve_thinking_is_rendered_not_flagged(kimi):
    request = {"messages": HISTORY, "chat_template_kwargs": {"preserve_thinking": True}}
    row, = reconstruct_record(_record(kimi, request), kimi, dialect=KIMI)
    assert row["status"] == "ok"
    assert "<think>EARLIER REASONING</think>a1" in kimi.decode(row["prompt_ids"])
    plain, = reconstruct_record(_record(kimi, {"messages": HISTORY}), kimi, dialect=KIMI)
    assert "EARLIER REASONING" not in kimi.decode(plain["prompt_ids"])


@pytest.mark.parametrize("request_extra, needle", [
    ({"chat_template_kwargs": {"reasoning_effort": "high"}}, "chat_template_kwargs.reasoning_effort"),
    ({"chat_template_kwargs": {"preserve_thinking": "yes"}}, "is not a boolean"),
    ({"extra_body": {"chat_template_kwargs": {"preserve_thinking": True}}}, "never reaches the prompt renderer"),
])
def test_template_kwargs_the_dialect_does_not_render_are_errors(kimi, request_extra, needle):
    request = {"messages": HISTORY, **request_extra}
    row, = reconstruct_record(_record(kimi, request), kimi, dialect=KIMI)
    assert row["status"] == "rejected"
    (finding,) = row["findings"]
    assert finding["code"] == "template_kwarg_unknown" and needle in finding["message"]


def test_qwen3_builtin_flags_kwargs_it_ignores(kimi):
    request = {"messages": HISTORY, "chat_template_kwargs": {"preserve_thinking": True}}
    codes = _codes(kimi, request, dialect=DIALECTS["qwen3"])
    assert "template_kwarg_unknown" in codes


def test_a_real_template_receives_every_kwarg_so_none_is_flagged(kimi, kimi_dir):
    template = (kimi_dir / "chat_template.kimi-k2-thinking.jinja").read_text(encoding="utf-8")
    dialect = KIMI.with_render(template_renderer(template), name="kimi-k2.5+template")
    request = {"messages": HISTORY, "chat_template_kwargs": {"reasoning_effort": "high"}}
    assert "template_kwarg_unknown" not in _codes(kimi, request, dialect=dialect)


def test_media_parts_are_counted_by_kind():
    request = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
                                     {"image": "raw"}, {"type": "input_audio", "input_audio": {"data": ""}}]},
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v"}}, {"text": "plain"}]},
    ]}
    assert media_parts(request) == {"image": 1, "image_url": 1, "input_audio": 1, "video_url": 1}
    assert media_parts({"messages": HISTORY}) == {}


def test_image_prompt_is_an_error_unless_usage_confirms_the_count(kimi):
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    expanded = _codes(kimi, image, usage_delta=1024)
    assert expanded == ["media_in_prompt", "usage_prompt_mismatch"]
    counted, = reconstruct_record(_record(kimi, image), kimi, dialect=KIMI)
    assert [f["code"] for f in counted["findings"]] == ["media_counted"] and counted["status"] == "flagged"
    no_usage = _record(kimi, image)
    no_usage["response"].pop("usage")
    row, = reconstruct_record(no_usage, kimi, dialect=KIMI)
    assert "media_in_prompt" in [f["code"] for f in row["findings"]] and row["status"] == "rejected"


def test_tools_outside_the_reproduced_subset_say_why(kimi):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "description": 7}}}}}]
    row, = reconstruct_record(_record(kimi, {"messages": HISTORY, "tools": tools}), kimi, dialect=KIMI)
    (finding,) = row["findings"]
    assert finding["code"] == "tools_declared" and finding["severity"] == "warning"
    assert "outside the subset reproduced exactly (description is int" in finding["message"]
    assert '<|im_system|>tool_declare<|im_middle|>[{"function":' in kimi.decode(row["prompt_ids"])

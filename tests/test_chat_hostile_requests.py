"""Every built-in renderer refuses a request it cannot render with TemplateError, never
another exception: ``reconstruct`` refuses such a record by name and goes on, while any
other exception is an internal error that stops the whole file (exit 8). A cold attack
found KeyError/TypeError/JSONDecodeError/AttributeError from the deepseek-v3.2 and
gpt-oss-harmony renderers on tools and history tool calls of the wrong shape."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenbridge.chat import DIALECTS, TemplateError

BUILT_IN = sorted(name for name, d in DIALECTS.items() if d.render is not None)

_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, width=16),
                    st.sampled_from(["", "x", "{}", "[1]", "{bad", '{"a": 1}', "functions.f", "user", "assistant"]))
_keys = st.sampled_from(["role", "content", "tool_calls", "function", "name", "arguments", "parameters",
                         "properties", "description", "type", "text", "id", "tool_call_id", "reasoning_content",
                         "required", "items", "enum", "anyOf", "$ref", "$defs", "default"])
_any: st.SearchStrategy[Any] = st.recursive(
    _scalar, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_keys, inner, max_size=4)),
    max_leaves=8)
_role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), _any)
_args = st.one_of(_any, st.sampled_from(['{"city": "Paris"}', "{bad", "[1]", "5", "null"]))
_function = st.fixed_dictionaries({}, optional={"name": st.one_of(st.just("f"), _any), "arguments": _args,
                                                "description": _any, "parameters": _any})
_call = st.one_of(_any, st.fixed_dictionaries({}, optional={"id": _any, "type": _any, "function": st.one_of(_function, _any)}))
_message = st.one_of(_any, st.fixed_dictionaries(
    {"role": _role},
    optional={"content": st.one_of(_any, st.just("hi"), st.lists(st.one_of(_any, st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": _any})), max_size=2)),
              "tool_calls": st.one_of(st.lists(_call, max_size=2), _any), "name": _any, "tool_call_id": _any,
              "reasoning_content": _any}))
_params = st.one_of(_any, st.fixed_dictionaries({}, optional={
    "type": _any, "properties": st.one_of(_any, st.dictionaries(st.sampled_from(["a", "b"]), _any, max_size=2)),
    "required": _any}))
_tool = st.one_of(_any, st.fixed_dictionaries({}, optional={
    "type": st.one_of(st.just("function"), _any),
    "function": st.one_of(_any, st.fixed_dictionaries({}, optional={"name": st.one_of(st.just("f"), _any),
                                                                    "description": _any, "parameters": _params}))}))
_requests = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(_message, min_size=1, max_size=4), _any)},
    optional={"tools": st.one_of(st.lists(_tool, max_size=2), _any),
              "chat_template_kwargs": st.one_of(_any, st.dictionaries(
                  st.sampled_from(["thinking", "enable_thinking", "preserve_thinking", "reasoning_effort"]), _any)),
              "reasoning_effort": _any, "reasoning": _any})


@pytest.mark.parametrize("name", BUILT_IN)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=_requests)
def test_built_in_renderers_refuse_hostile_requests_with_template_error_only(name: str, request: dict) -> None:
    dialect = DIALECTS[name]
    with contextlib.suppress(TemplateError):
        dialect.prompt_readings(request, {"created": 1750000000}, {})


@pytest.mark.parametrize(("name", "request_", "where"), [
    ("deepseek-v3.2", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "name": "f"}]},
     "tools[0].function"),
    ("deepseek-v3.2", {"messages": [{"role": "user", "content": "Hi"}], "tools": ["f"]}, "tools[0]"),
    ("deepseek-v3.2", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None,
                       "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}, {"role": "tool", "content": "x"}]},
     "messages[1].tool_calls[0].function.name"),
    ("deepseek-v3.2", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None,
                       "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{bad"}}]},
                                    {"role": "tool", "content": "x"}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("gpt-oss-harmony", {"messages": [{"role": "user", "content": "Hi"}],
                         "tools": [{"type": "function", "function": {"description": "d"}}]}, "tools[0].function.name"),
    ("gpt-oss-harmony", {"messages": [{"role": "user", "content": "Hi"}],
                         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": [1]}}}]},
     "tools[0].function.parameters.properties"),
])
def test_the_attacks_shapes_are_refused_naming_the_field(name: str, request_: dict, where: str) -> None:
    with pytest.raises(TemplateError, match=where.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        DIALECTS[name].render_request(request_)

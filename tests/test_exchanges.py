"""parse_exchange: each check names its field and says what is wrong; native ids in their order of precedence."""

from __future__ import annotations

import copy

import pytest

from tokenbridge.content import ROLES
from tokenbridge.exchanges import RecordError, parse_exchange

GOOD = {
    "id": "r1", "dataset": "d",
    "request": {"messages": [{"role": "user", "content": "hi"}]},
    "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop"}]},
}


def _bad(path: str, value):
    rec = copy.deepcopy(GOOD)
    *head, last = path.split(".")
    node = rec
    for key in head:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is KeyError:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return rec


CASES = [
    (_bad("id", KeyError), "id", "missing"),
    (_bad("id", True), "id", "must be a string or an integer"),
    (_bad("request", KeyError), "request", "missing"),
    (_bad("request.messages", []), "request.messages", "must be a non-empty list"),
    (_bad("request.messages.0", "hi"), "request.messages[0]", "must be an object"),
    (_bad("request.messages.0.role", KeyError), "request.messages[0].role", "missing"),
    (_bad("request.messages.0.role", 3), "request.messages[0].role", f"unknown role 3 (expected one of {sorted(ROLES)})"),
    # the roles and content parts an export would refuse: a bad line here, not an ok row that stops every export
    (_bad("request.messages.0.role", "human"), "request.messages[0].role",
     f"unknown role 'human' (expected one of {sorted(ROLES)})"),
    (_bad("request.messages.0.role", "function"), "request.messages[0].role",
     f"unknown role 'function' (expected one of {sorted(ROLES)})"),
    (_bad("request.messages.0.content", 3), "request.messages[0].content",
     "must be a string, null or a list of content parts, got int"),
    (_bad("request.messages.0.content", [{"text": "x"}]), "request.messages[0].content[0]",
     "must be a content part object with a string 'type'"),
    (_bad("request.messages.0.tool_calls", {}), "request.messages[0].tool_calls", "must be a list or null, got dict"),
    (_bad("request.messages.0.tool_calls", [7]), "request.messages[0].tool_calls[0]", "must be a tool call object, got int"),
    (_bad("request.tools", {}), "request.tools", "must be a list"),
    (_bad("response", []), "response", "must be an object"),
    (_bad("response.choices", KeyError), "response.choices", "missing (and the response carries no error)"),
    (_bad("response.choices", {}), "response.choices", "must be a list"),
    (_bad("response.choices.0", 1), "response.choices[0]", "must be an object"),
    (_bad("response.choices.0.message", None), "response.choices[0].message", "missing or not an object"),
    (_bad("response.choices.0.message.reasoning", 1), "response.choices[0].message.reasoning", "must be a string or null"),
    (_bad("response.choices.0.message.reasoning_details", {}), "response.choices[0].message.reasoning_details",
     "must be a list or null"),
    (_bad("response.prompt_token_ids", [1, True]), "response.prompt_token_ids", "must be a list of integers"),
    (_bad("response.choices.0.token_ids", "1 2"), "response.choices[0].token_ids", "must be a list of integers"),
    (_bad("response.choices.0.response_token_ids", [True]), "response.choices[0].response_token_ids",
     "must be a list of integers"),
    (_bad("response.choices.0.prompt_token_ids", {}), "response.choices[0].prompt_token_ids", "must be a list of integers"),
    (_bad("native_ids", "x"), "native_ids", "must be a list of ids or {prompt, choices}"),
    # what the row check refuses to export is refused here, not written as an ok row (a reviewer's)
    (_bad("request.messages.0.reasoning", {"type": "prompt_embeds"}), "request.messages[0].reasoning",
     "must be a string or null, got dict"),
    (_bad("request.messages.0.reasoning_content", 7), "request.messages[0].reasoning_content",
     "must be a string or null, got int"),
    (_bad("request.tools", ["x"]), "request.tools[0]", "must be a tool object, got str"),
    (_bad("native_ids", {"choices": [[1.5]]}), "native_ids.choices[0]", "must be a list of integers"),
    # read by the renderers and the gate: a wrong type was a traceback or taken silently
    (_bad("id", ""), "id", "must not be empty (every row is named by it)"),
    (_bad("request.extra_body", "x"), "request.extra_body", "must be an object or null, got str"),
    (_bad("request.reasoning", ["high"]), "request.reasoning", "must be an object or null, got list"),
    (_bad("request.chat_template_kwargs", 1), "request.chat_template_kwargs", "must be an object or null, got int"),
    (_bad("request.n", "2"), "request.n", "must be a positive integer or null, got '2'"),
    (_bad("request.n", 0), "request.n", "must be a positive integer or null, got 0"),
    (_bad("request.n", True), "request.n", "must be a positive integer or null, got True"),
    (_bad("response.choices.0.finish_reason", ["stop"]), "response.choices[0].finish_reason",
     "must be a string or null, got list"),
    (_bad("response.choices.0.finish_reason", {"type": "stop"}), "response.choices[0].finish_reason",
     "must be a string or null, got dict"),
    (_bad("dataset", {"name": "d"}), "dataset", "must be a string or null, got dict"),
    (_bad("native_ids", {"a": 1}), "native_ids.a", "unknown key: native_ids holds prompt and choices"),
    (_bad("native_ids", {"choices": {"0": [1]}}), "native_ids.choices",
     "must be a list (one id list or null per choice)"),
    # ids no tokenizer can have: tiktoken raised OverflowError on them (exit 8, nothing written)
    (_bad("response.prompt_token_ids", [1, -5]), "response.prompt_token_ids",
     "item 1 is -5: a token id is an integer from 0 to 4294967295"),
    (_bad("response.choices.0.token_ids", [2**32]), "response.choices[0].token_ids",
     "item 0 is 4294967296: a token id is an integer from 0 to 4294967295"),
    (_bad("native_ids", [3, 10**30]), "native_ids", "item 1 is a 100-bit integer: a token id is an integer from 0 to 4294967295"),
    (_bad("native_ids", {"prompt": [-2**70]}), "native_ids.prompt",
     "item 0 is a negative 71-bit integer: a token id is an integer from 0 to 4294967295"),
    (_bad("native_ids", {"choices": [[7, -1]]}), "native_ids.choices[0]",
     "item 1 is -1: a token id is an integer from 0 to 4294967295"),
]


@pytest.mark.parametrize(("record", "field", "detail"), CASES, ids=[c[1] + ":" + c[2][:20] for c in CASES])
def test_a_bad_record_names_its_field(record, field, detail):
    with pytest.raises(RecordError) as err:
        parse_exchange(record)
    assert (err.value.field, err.value.detail) == (field, detail)


def test_an_error_body_has_no_choices():
    ex = parse_exchange({"id": 7, "request": GOOD["request"], "response": {"error": {"message": "boom"}}})
    assert (ex.id, ex.native_choices, ex.native_prompt, ex.meta, ex.dataset) == ("7", [], None, {}, None)


def test_native_ids_of_the_record_win_over_the_response():
    rec = copy.deepcopy(GOOD)
    rec["response"]["prompt_token_ids"] = [1, 2]
    rec["response"]["choices"][0]["token_ids"] = [3]
    assert (parse_exchange(rec).native_prompt, parse_exchange(rec).native_choices) == ([1, 2], [[3]])
    rec["native_ids"] = [9, 9]
    assert parse_exchange(rec).native_choices == [[9, 9]]
    rec["native_ids"] = {"prompt": [5], "choices": [[6], [7]]}  # a second choice the response lacks is ignored
    ex = parse_exchange(rec)
    assert (ex.native_prompt, ex.native_choices) == ([5], [[6]])
    assert parse_exchange({**rec, "meta": None}).meta == {}
    with pytest.raises(RecordError, match="must be an object or null, got str") as caught:
        parse_exchange({**rec, "meta": "not an object"})  # said, not taken for no meta
    assert caught.value.field == "meta"


def test_every_id_a_tokenizer_could_hold_is_taken():
    """The range is what an id can be (0 to 2**32 - 1); whether this tokenizer has it is the gate's question."""
    rec = copy.deepcopy(GOOD)
    rec["native_ids"] = {"prompt": [0, 2**32 - 1], "choices": [[200000]]}
    ex = parse_exchange(rec)
    assert (ex.native_prompt, ex.native_choices) == ([0, 2**32 - 1], [[200000]])


def test_sglang_ids_are_read_where_sglang_puts_them():
    """SGLang (0.5.23, ``return_token_ids``) writes each choice's ``prompt_token_ids`` and
    ``response_token_ids`` (its ``output_ids``, through the stop id); only vLLM's names were
    read, so SGLang's ground truth was thrown away and a provable sample rejected."""
    rec = copy.deepcopy(GOOD)
    rec["response"]["choices"] = [
        {"index": i, "message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop",
         "prompt_token_ids": [1, 2], "response_token_ids": [3 + i, 9]} for i in range(2)]
    ex = parse_exchange(rec)
    assert (ex.native_prompt, ex.native_choices) == ([1, 2], [[3, 9], [4, 9]])
    rec["response"]["prompt_token_ids"] = [1, 2]  # both engines' names, the same ids: one evidence
    rec["response"]["choices"][0]["token_ids"] = [3, 9]
    assert parse_exchange(rec).native_choices == [[3, 9], [4, 9]]


@pytest.mark.parametrize(("where", "value", "field", "detail"), [
    ("choices.0.response_token_ids", [3, 8], "response.choices[0].response_token_ids",
     "differs from response.choices[0].token_ids: the engine gave two different id lists for the same text"),
    ("choices.1.prompt_token_ids", [1, 5], "response.choices[1].prompt_token_ids",
     "differs from the prompt ids before it: the engine gave two different id lists for the same text"),
    ("prompt_token_ids", [1], "response.choices[0].prompt_token_ids",
     "differs from the prompt ids before it: the engine gave two different id lists for the same text"),
])
def test_two_id_lists_for_the_same_text_are_a_bad_record(where, value, field, detail):
    rec = copy.deepcopy(GOOD)
    rec["response"]["choices"] = [
        {"index": i, "message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop",
         "prompt_token_ids": [1, 2], "response_token_ids": [3, 9], "token_ids": [3, 9]} for i in range(2)]
    node = rec["response"]
    *head, last = where.split(".")
    for key in head:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = value
    with pytest.raises(RecordError) as err:
        parse_exchange(rec)
    assert (err.value.field, err.value.detail) == (field, detail)

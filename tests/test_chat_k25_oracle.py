"""The built-in ``kimi-k2.5`` dialect against two independent K2.5 renderers, token for token.

Oracles (pinned in requirements-oracles.txt, used here only; nothing of theirs is in src/):

* ``renderers==0.1.12`` (``renderers.kimi_k25.KimiK25Renderer``): renders whole
  conversations to token ids. It is given our tokenizer, so its ids and ours come from the
  same BPE; every generated conversation must give the same ids.
* ``tinker-cookbook==0.6.1``: its ``kimi_k2_5_tool_declaration_ts.py`` says it is copied
  from the K2.5 HF tokenizer's ``tool_declaration_ts.py``, i.e. it *is* the official tool
  encoder. It imports only the standard library, so it is loaded from its file; the rest
  of tinker-cookbook needs the ``tinker`` SDK and is skipped (see the last test).

Where the oracles disagree, each difference has its own test below saying which side the
official template follows and the evidence; the hypothesis tests keep to inputs on which
both agree with the official behaviour, except for the one systematic difference
(renderers adds no default system message), which the comparison applies explicitly.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import importlib.util
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_families_support import OracleTokenizer
from tokenbridge.chat import DIALECTS
from tokenbridge.chat.kimi import DEFAULT_SYSTEM
from tokenbridge.chat.kimi_tools import declare_tools, sort_keys_deep

KIMI = DIALECTS["kimi-k2.5"]
N_CONVERSATIONS = 600
N_DECLARATIONS = 250

try:
    from renderers.configs import KimiK25RendererConfig
    from renderers.kimi_k25 import KimiK25Renderer, _encode_tools_typescript
except ImportError as e:  # pragma: no cover - CI installs it (Makefile, requirements-oracles.txt)
    pytest.skip(f"oracle `renderers` not importable ({e}); pip install --no-deps -r requirements-oracles.txt",
                allow_module_level=True)


def _official_tool_encoder() -> ModuleType | None:
    """tinker-cookbook's copy of the K2.5 tokenizer's tool encoder, loaded from its file
    (importing the package would pull in the tinker SDK)."""
    try:
        dist = importlib.metadata.distribution("tinker-cookbook")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = dist.locate_file("tinker_cookbook/renderers/kimi_k2_5_tool_declaration_ts.py")
    spec = importlib.util.spec_from_file_location("_k25_official_tool_declaration", str(path))
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OFFICIAL = _official_tool_encoder()
needs_official = pytest.mark.skipif(OFFICIAL is None, reason="tinker-cookbook==0.6.1 not installed "
                                    "(pip install --no-deps -r requirements-oracles.txt)")


@pytest.fixture(scope="module")
def oracles(kimi) -> dict[bool, KimiK25Renderer]:
    adapter = OracleTokenizer(kimi)
    return {thinking: KimiK25Renderer(adapter, KimiK25RendererConfig(thinking=thinking)) for thinking in (True, False)}


def _with_default_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the K2.5 template renders: a default system turn when none leads (see
    test_renderers_omits_the_default_system_message)."""
    if messages and messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]


def _oracle_ids(oracles, messages, tools, thinking: bool) -> list[int]:
    rendered = oracles[thinking].render(_with_default_system(messages), tools=sort_keys_deep(tools) if tools else None,
                                        add_generation_prompt=True, process_multimodal=False)
    return list(rendered.token_ids)


def _our_ids(kimi, messages, tools, thinking: bool) -> list[int]:
    return kimi.encode(KIMI.render_prompt(messages, tools, thinking))


# --- strategies ------------------------------------------------------------------

# A fixed alphabet (letters, digits, punctuation, accents, CJK, emoji, quotes, backslash):
# cheap to draw, and it reaches every BPE pre-token class. Its letters cannot spell
# "think", so no text forms "</think>" (renderers treats that specially, see below).
_ALPHABET = st.sampled_from(list("abcdeXYZ<> 0123456789.,;:!?'\"-_()[]{}/\\#*+=&%$@~`|^ éüßñ中文字的你好😀🚀…–“”\u3000"))
words = st.text(_ALPHABET, max_size=24)
identifiers = st.builds(lambda head, tail: head + tail, st.sampled_from("abcdefghxyz"),
                        st.text(st.sampled_from("abcxyz_019"), max_size=8))
cjk = st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF), min_size=1, max_size=12)
texts = st.one_of(
    words,
    cjk,
    st.just(""),
    st.lists(st.one_of(words, cjk, st.sampled_from(["\n", "\n\n", " ", "  \n", "\t", "\r\n"])), max_size=5).map("".join),
)
text_part = texts.map(lambda t: {"type": "text", "text": t})
image_part = st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
user_content = st.one_of(texts, st.lists(st.one_of(text_part, text_part, image_part), max_size=3), st.none(),
                         st.tuples(text_part, image_part).map(list))
plain_content = st.one_of(texts, st.lists(text_part, max_size=3))
names = st.one_of(st.none(), st.sampled_from(["alice", "ops-bot", "用户"]))

scalars = st.one_of(
    st.fixed_dictionaries({"type": st.just("string")},
                          optional={"description": texts, "maxLength": st.integers(1, 99),
                                    "pattern": st.sampled_from(["^[a-z]+$", "\\d+"]), "default": words}),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])},
                          optional={"description": texts, "minimum": st.integers(-5, 5), "maximum": st.integers(6, 99),
                                    "default": st.integers(-3, 3)}),
    st.fixed_dictionaries({"type": st.just("boolean")}, optional={"description": texts}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(words, st.integers(0, 9)), min_size=1, max_size=4, unique=True)},
                          optional={"description": texts}),
    st.fixed_dictionaries({"type": st.lists(st.sampled_from(["string", "integer", "null", "array", "object"]),
                                            min_size=2, max_size=3, unique=True)}),
    st.just({}),
)


def _extend(children):
    props = st.dictionaries(identifiers, children, max_size=4)
    return st.one_of(
        st.builds(lambda p, r, d: {"type": "object", "properties": p, "required": sorted(k for k in p if r),
                                   **({"description": d} if d else {})}, props, st.booleans(), texts),
        st.fixed_dictionaries({"type": st.just("array"), "items": children},
                              optional={"description": texts, "maxItems": st.integers(1, 9)}),
        st.fixed_dictionaries({"anyOf": st.lists(children, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"type": st.just("object"), "additionalProperties": st.one_of(st.booleans(), children)}),
    )


schemas = st.recursive(scalars, _extend, max_leaves=8)


@st.composite
def functions(draw) -> dict[str, Any]:
    props = draw(st.dictionaries(identifiers, schemas, max_size=5))
    params: dict[str, Any] = {"type": "object", "properties": props,
                              "required": sorted(k for k in props if draw(st.booleans()))}
    if props and draw(st.integers(0, 4)) == 0:  # a $defs entry referred to by a field
        params["$defs"] = {"Item": {"type": "object", "description": draw(texts),
                                    "properties": {"id": {"type": "integer"}}, "required": ["id"]}}
        params["properties"]["item"] = {"$ref": "#/$defs/Item"}
    if props and draw(st.integers(0, 6)) == 0:  # a recursive schema: interface parameters
        params["properties"]["children"] = {"type": "array", "items": {"$ref": "#"}}
    fn: dict[str, Any] = {"name": draw(identifiers), "parameters": params}
    if draw(st.booleans()):
        fn["description"] = draw(texts)
    return {"type": "function", "function": fn}


tool_lists = st.one_of(st.none(), st.lists(functions(), min_size=1, max_size=3))


@st.composite
def tool_call_round(draw, idx: int) -> list[dict[str, Any]]:
    """An assistant turn with tool calls, then one tool result per call."""
    n = draw(st.integers(1, 2))
    calls = []
    for k in range(n):
        name = draw(st.sampled_from(["get_weather", "search", "run_code"]))
        args = draw(st.one_of(st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(words, st.integers()), max_size=2),
                              words.map(lambda w: '{"q": "' + w.replace('"', "") + '"}')))
        calls.append({"id": f"functions.{name}:{idx + k}", "type": "function", "function": {"name": name, "arguments": args}})
    assistant: dict[str, Any] = {"role": "assistant", "content": draw(st.one_of(st.none(), texts)), "tool_calls": calls}
    if draw(st.booleans()):
        assistant["reasoning_content"] = draw(texts)
    out = [assistant]
    for call in calls:
        result: dict[str, Any] = {"role": "tool", "tool_call_id": call["id"], "content": draw(plain_content)}
        if draw(st.booleans()):
            result["name"] = call["function"]["name"]
        out.append(result)
    return out


@st.composite
def conversations(draw) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    system = draw(st.sampled_from(["none", "plain", "cjk", "empty"]))
    if system != "none":
        msgs.append({"role": "system", "content": {"plain": "You are terse.", "cjk": "你是一个乐于助人的助手。", "empty": ""}[system]})
        if draw(st.integers(0, 4)) == 0:
            msgs[0]["name"] = "policy"
    calls = 0
    for _ in range(draw(st.integers(1, 4))):
        user: dict[str, Any] = {"role": "user", "content": draw(user_content)}
        if (name := draw(names)) is not None:
            user["name"] = name
        msgs.append(user)
        if draw(st.integers(0, 2)) == 0:
            rounds = draw(st.integers(1, 2))
            for _ in range(rounds):
                msgs.extend(draw(tool_call_round(calls)))
                calls += 2
            if draw(st.booleans()):
                continue  # the conversation may end inside a tool-call chain
        if draw(st.integers(0, 3)):
            reply: dict[str, Any] = {"role": "assistant", "content": draw(plain_content)}
            if draw(st.booleans()):
                reply["reasoning_content"] = draw(texts)
            if draw(st.integers(0, 5)) == 0:
                reply["name"] = "kimi"
            msgs.append(reply)
    if msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": draw(texts)})
    return msgs


# --- the cross-check -------------------------------------------------------------


def test_generated_conversations_match_renderers_token_for_token(kimi, oracles):
    seen = {"conversations": 0, "with_tools": 0, "instant": 0, "tool_results": 0, "reasoning": 0, "images": 0}

    @settings(max_examples=N_CONVERSATIONS, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(conversations(), tool_lists, st.booleans())
    def check(msgs, tools, thinking):
        ours = _our_ids(kimi, msgs, tools, thinking)
        theirs = _oracle_ids(oracles, msgs, tools, thinking)
        text = kimi.decode_bytes(theirs)
        assert kimi.decode_bytes(ours) == text  # the same prompt, byte for byte
        # ...encoded in one pass as apply_chat_template(tokenize=True) does; renderers encodes
        # piece by piece, which splits a merge across a piece boundary (documented below)
        assert ours == kimi.encode(text.decode("utf-8"))
        if ours != theirs:
            split["piecewise"] += 1
        seen["conversations"] += 1
        seen["with_tools"] += bool(tools)
        seen["instant"] += not thinking
        seen["tool_results"] += any(m["role"] == "tool" for m in msgs)
        seen["reasoning"] += any(m.get("reasoning_content") for m in msgs)
        seen["images"] += any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
                              for m in msgs)

    split = {"piecewise": 0}
    check()
    assert seen["conversations"] >= 500, seen
    # every dimension the issue names was exercised, many times
    assert min(seen.values()) >= 25, seen
    # id-level differences are the piecewise-encoding artefact only (asserted above), a minority
    assert split["piecewise"] < seen["conversations"] // 4, (split, seen)
    print(f"compared {seen}, piecewise-encoding id differences: {split['piecewise']}")


@needs_official
def test_generated_tool_declarations_match_the_official_encoder():
    seen = {"typescript": 0}

    @settings(max_examples=N_DECLARATIONS, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(functions(), min_size=1, max_size=3))
    def check(tools):
        ordered = sort_keys_deep(tools)
        decl = declare_tools(tools)
        assert decl.form == "typescript"
        assert decl.text == OFFICIAL.encode_tools_to_typescript_style(ordered)
        assert decl.text == _encode_tools_typescript(ordered)
        seen["typescript"] += 1

    check()
    assert seen["typescript"] >= 200


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-9, 9), st.floats(-1e3, 1e3, allow_nan=False), words)
wild_leaves = st.one_of(
    scalars,
    st.booleans(),  # true/false as a whole schema
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", ["string", "null"],
                                                    ["integer", "boolean"], ["string", "number", "null"], []]),
                           "enum": st.lists(json_scalars, min_size=1, max_size=3)}),  # may mismatch: fallback
    st.fixed_dictionaries({"type": st.sampled_from(["string", "boolean", "number"]), "default": json_scalars}),
    st.fixed_dictionaries({"type": st.just("object"), "default": st.dictionaries(words, json_scalars, max_size=2)}),
    st.fixed_dictionaries({"type": st.lists(st.sampled_from(["string", "null", "date"]), min_size=1, max_size=2)}),
    st.just({"description": "typeless"}),  # no $ref/anyOf/enum/type: fallback
    st.sampled_from([{"$ref": "#"}, {"$ref": "#/$defs/Known"}, {"$ref": "#/$defs/Unknown"}, {"$ref": "other.json"}]),
    st.fixed_dictionaries({"type": st.just("array"), "items": st.sampled_from([True, False, {}, None])}),
    st.sampled_from([{"type": "string", "enum": ["a", 1]}, {"$ref": "#/$defs/Unknown"}, {"title": "no type"}]),
)


def _wild_extend(children):
    props = st.dictionaries(st.one_of(identifiers, st.sampled_from(["Zed", "Alpha", "B"])), children, max_size=4)
    return st.one_of(
        _extend(children),
        st.builds(lambda p, d: {"type": "object", "properties": p, "$defs": d}, props,
                  st.dictionaries(st.sampled_from(["Known", "Other", "Zed"]), children, max_size=2)),
    )


@needs_official
def test_generated_wild_schemas_fall_back_exactly_where_the_official_encoder_does():
    """Schemas that exercise the encoder's edges: mismatched enum types, bool schemas,
    typeless nodes, local/self/missing/non-local ``$ref``, nested ``$defs``, Python-repr
    defaults. Either both print the same TypeScript, or the official encoder fails (or
    yields nothing) and we print the JSON fallback."""
    seen = {"typescript": 0, "json": 0}

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
                              st.sampled_from(["f", "g"]), st.recursive(wild_leaves, _wild_extend, max_leaves=6)
                              .filter(lambda x: isinstance(x, dict))), min_size=1, max_size=2))
    def check(tools):
        ordered = sort_keys_deep(tools)
        try:
            official = OFFICIAL.encode_tools_to_typescript_style(ordered)
        except Exception:
            official = ""
        decl = declare_tools(tools)
        if official:
            assert (decl.form, decl.text) == ("typescript", official)
        else:
            assert decl.form == "json" and decl.certain, decl
        seen[decl.form] += 1

    check()
    assert seen["typescript"] >= 50 and seen["json"] >= 25, seen
    print(f"wild tool declarations: {seen}")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather.\n\nUse metric units.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 1},
        "units": {"enum": ["metric", "imperial"]},
    }}}}


def test_tool_request_prompt_ids_exactly(kimi, oracles):
    """A known request with tools: the exact declaration text, and ids equal to the oracle's."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    text = KIMI.render_prompt(msgs, [WEATHER])
    assert text.startswith(
        "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
        "// Current weather.\n\n// Use metric units.\ntype get_weather = (_: {\n"
        "  // City name\n  city: string,\n  // maximum: 7, minimum: 1\n  // Default: 1\n  days?: number,\n"
        '  units?: "metric" | "imperial"\n}) => any;\n}\n<|im_end|>'
        f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>"
    )
    assert kimi.encode(text) == _oracle_ids(oracles, msgs, [WEATHER], True)


# --- documented differences between the oracles ----------------------------------


@pytest.mark.parametrize("msgs", [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "\n"}]}],
    [{"role": "user", "content": "q"},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.f:0", "function": {"name": "f", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "functions.f:0", "content": "\n\nresult"}],
], ids=["image-then-newline", "tool-result-starting-with-newlines"])
def test_renderers_encodes_piece_by_piece(kimi, oracles, msgs):
    """renderers tokenizes each template piece on its own (the image wrapper's trailing
    newline, the ``## Return of ...`` header), so newlines on both sides of a piece boundary
    do not merge. The serving side renders the whole prompt text and tokenizes it in one
    pass (transformers' ``apply_chat_template(tokenize=True)``), which is what we do: same
    bytes, our ids are the one-pass ids."""
    ours = _our_ids(kimi, msgs, None, True)
    theirs = _oracle_ids(oracles, msgs, None, True)
    assert kimi.decode_bytes(ours) == kimi.decode_bytes(theirs)
    assert ours != theirs and len(theirs) > len(ours)
    assert ours == kimi.encode(kimi.decode(theirs))


def test_renderers_omits_the_default_system_message(kimi, oracles):
    """renderers 0.1.12 adds no system turn; the K2/K2-Thinking templates, and tinker-cookbook's
    K2.5 renderer (whose tests compare against the K2.5 HF template) add
    ``You are Kimi, ...`` when the first message is not a system one; a K2.7 renderer notes
    "no default system message" as a K2.7 change relative to K2.6. We add it."""
    msgs = [{"role": "user", "content": "hi"}]
    bare = list(oracles[True].render(msgs, add_generation_prompt=True, process_multimodal=False).token_ids)
    ours = _our_ids(kimi, msgs, None, True)
    assert DEFAULT_SYSTEM not in kimi.decode(bare)
    assert ours != bare and ours == _oracle_ids(oracles, msgs, None, True)
    assert kimi.decode(ours).startswith(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>")


BOOL_DEFAULT = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"safe": {"type": "boolean", "default": True}, "mode": {"enum": ["a", 1, True, None]}}}}}


@needs_official
def test_python_reprs_in_defaults_and_enums_follow_the_official_encoder():
    """The official encoder prints a bool/number default with ``repr`` and a non-string enum
    member with ``str`` (``True``, ``None``); renderers prints JSON (``true``, ``null``)."""
    ours = declare_tools([BOOL_DEFAULT]).text
    assert ours == OFFICIAL.encode_tools_to_typescript_style(sort_keys_deep([BOOL_DEFAULT]))
    assert '// Default: True\n' in ours and 'mode?: "a" | 1 | True | None' in ours
    theirs = _encode_tools_typescript(sort_keys_deep([BOOL_DEFAULT]))
    assert '// Default: true\n' in theirs and '"a" | 1 | true | null' in theirs


UNSORTED_DEFS = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "$defs": {"Zeta": {"type": "string"}, "Alpha": {"type": "integer"}},
    "properties": {"z": {"$ref": "#/$defs/Zeta"}, "a": {"$ref": "#/$defs/Alpha"}, "self": {"$ref": "#"}}}}}


def test_keys_are_sorted_before_encoding_as_the_official_tokenizer_does():
    """K2.5's ``tokenization_kimi.py`` deep-sorts the tool dicts before encoding, so ``$defs``
    interfaces and a recursive schema's ``interface parameters`` fields come out in key order.
    renderers encodes the dicts as given (the cross-check hands it sorted tools)."""
    ours = declare_tools([UNSORTED_DEFS]).text
    assert ours.index("interface Alpha") < ours.index("interface Zeta")
    assert "interface parameters {\n  a?: Alpha,\n  self?: parameters,\n  z?: Zeta\n}" in ours
    unsorted = _encode_tools_typescript([UNSORTED_DEFS])
    assert unsorted.index("interface Zeta") < unsorted.index("interface Alpha")
    assert ours == _encode_tools_typescript(sort_keys_deep([UNSORTED_DEFS]))


@pytest.mark.parametrize("tools, why", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/Missing"}}}}}], "names no $defs entry"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "enum": ["a", 2]}}}}}], "is not of type string"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"description": "no type"}}}}}], "without $ref/anyOf/enum/type"),
    ([{"name": "f", "parameters": {"type": "object"}}], 'no tool of type "function"'),
])
def test_json_fallback_exactly_where_the_official_encoder_fails(tools, why):
    """The official code catches any exception from its encoder (or an empty result) and the
    template then prints the tools as JSON. renderers has no fallback: it accepts a flat
    (unwrapped) tool and renders mismatched enums, or raises."""
    decl = declare_tools(tools)
    assert decl.form == "json" and decl.certain and why in (decl.reason or "")
    assert decl.text == __import__("json").dumps(sort_keys_deep(tools), ensure_ascii=False, separators=(",", ":"))
    if OFFICIAL is not None:
        try:
            official = OFFICIAL.encode_tools_to_typescript_style(sort_keys_deep(tools))
        except Exception:
            official = ""
        assert official == ""
    unproven = KIMI.tools_unproven
    assert unproven is not None and "fallback" in (unproven(tools) or "")


def test_typescript_declaration_is_proven_and_raises_no_finding():
    assert KIMI.tools_unproven is not None and KIMI.tools_unproven([WEATHER]) is None


def test_thinking_content_split_is_a_renderers_extension(kimi, oracles):
    """renderers splits ``</think>`` out of an assistant's string ``content`` when it has no
    ``reasoning_content``; the K2/K2-Thinking templates print ``content`` as it is (and the
    K2.5 notes describe the same history rules). We print it as it is."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>answer"},
            {"role": "user", "content": "q2"}]
    ours = KIMI.render_prompt(msgs, None, True)
    assert "<think></think><think>r</think>answer<|im_end|>" in ours
    theirs = kimi.decode(_oracle_ids(oracles, msgs, None, True))
    assert "<think></think>answer<|im_end|>" in theirs


def test_preserve_thinking_keeps_every_turns_reasoning():
    """``preserve_thinking`` (an argument of the K2.5/K2.6 tokenizer's ``apply_chat_template``,
    default false; tinker-cookbook documents K2.6's ``preserve_thinking=true`` as "every
    historical assistant turn keeps its full <think>...</think> block"): history turns keep
    their reasoning. Neither installed oracle renders this switch, so this pins the rule."""
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"}]
    default = KIMI.render_prompt(msgs, None, True)
    kept = KIMI.render_prompt(msgs, None, True, preserve_thinking=True)
    assert "<think></think>a1" in default and "<think>r1</think>a1" in kept
    assert KIMI.render_prompt(msgs, None, True, preserve_thinking=False) == default
    assert kept.replace("<think>r1</think>", "<think></think>") == default


def test_tinker_cookbook_full_renderer_is_skipped_with_reason():
    """The whole-conversation renderer in tinker-cookbook imports the ``tinker`` SDK (and
    torch, PIL, tml-renderers) at module level; only its dependency-free tool encoder is
    used above."""
    pytest.importorskip("tinker", reason="tinker-cookbook's renderers import the `tinker` SDK, not installed: "
                        "its tool encoder is checked standalone, whole conversations against `renderers`")
    from tinker_cookbook.renderers.kimi_k25 import KimiK25Renderer as TinkerK25  # pragma: no cover

    assert TinkerK25 is not None  # pragma: no cover


def _with_default(value):
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number", "default": value, "description": "d"}}}}}


def test_declarations_are_cached_by_value_and_never_confused():
    """A dataset sends one tool list with every request: its declaration is built once. The
    cache is keyed by the value (keys sorted), so a fresh parse of the same tools hits it,
    and values a plain dump would merge (True / 1 / 1.0, NaN / None) keep their own."""
    from tokenbridge.chat import kimi_tools

    kimi_tools._DECLARED.clear()
    defaults = [True, 1, 1.0, None, float("nan"), float("inf"), "1", 0, False, -0.0, 0.0]
    decls = [declare_tools([_with_default(v)]) for v in defaults]
    assert decls == [kimi_tools._declare([_with_default(v)]) for v in defaults]  # as built uncached
    assert len({d.text for d in decls}) == len(defaults) == len(kimi_tools._DECLARED)
    assert "// Default: True\n" in decls[0].text and "// Default: 1\n" in decls[1].text
    assert "// Default: 1.0\n" in decls[2].text and "// Default" not in decls[3].text
    assert "// Default: nan\n" in decls[4].text
    reparsed = json.loads(json.dumps(UNSORTED_DEFS))  # another object, keys in another order
    reparsed["function"] = dict(reversed(list(reparsed["function"].items())))
    first = declare_tools([UNSORTED_DEFS])
    assert declare_tools([reparsed]) is first
    with_enum = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"m": {"enum": ["a", "b"]}}, "required": ["m"]}}}
    listed = declare_tools([with_enum])
    tupled = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"m": {"enum": ("a", "b")}}, "required": ("m",)}}}
    assert declare_tools((tupled,)) is listed  # a tuple is the array it is sent as
    assert kimi_tools._declare([tupled]) == listed and 'm: "a" | "b"' in listed.text
    assert kimi_tools._declare([reparsed]) == first


def test_declaration_cache_stays_bounded():
    from tokenbridge.chat import kimi_tools

    kimi_tools._DECLARED.clear()
    for k in range(kimi_tools._DECLARED_MAX + 10):
        declare_tools([_with_default(k)])
    assert len(kimi_tools._DECLARED) <= kimi_tools._DECLARED_MAX
    assert declare_tools([{1: "not JSON"}]).form == "json" and len(kimi_tools._DECLARED) <= kimi_tools._DECLARED_MAX


# --- the history's tool-call arguments as SGLang re-writes them ------------------------------

_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny, 21 C."},
    {"role": "user", "content": "And tomorrow?"},
]


def test_parsed_tool_arguments_are_a_prompt_reading_the_count_picks(kimi, oracles):
    """SGLang 0.5.23 parses an assistant call's JSON-string arguments into an object before
    the template ``tojson``s it (``normalize_assistant_tool_call_arguments``): compact
    ``{"city":"Paris"}`` reaches the model spaced, a token more. Both readings are built
    (a stack may render them as sent); the oracle, given the object, renders the parsed one."""
    from tokenbridge.reconstruct import reconstruct_record

    request = {"model": "moonshotai/kimi-k2.5", "messages": _HISTORY, "tools": [WEATHER]}
    readings = {r.name: r.text for r in KIMI.prompt_readings(request)}
    assert set(readings) == {None, "tool_args=parsed"}
    assert '<|tool_call_argument_begin|>{"city":"Paris","days":2}<|tool_call_end|>' in readings[None]
    assert '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>' in readings["tool_args=parsed"]
    parsed = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in _HISTORY]
    assert kimi.encode(readings["tool_args=parsed"]) == _oracle_ids(oracles, parsed, [WEATHER], True)
    answer = kimi.encode("Still sunny.") + [kimi.token_id("</think>")] + kimi.encode("Yes.") + [kimi.token_id("<|im_end|>")]
    for name, text in readings.items():
        response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "reasoning": "Still sunny.", "content": "Yes."}}],
            "usage": {"prompt_tokens": len(kimi.encode(text)), "completion_tokens": len(answer)}}
        row, = reconstruct_record({"id": "h", "request": request, "response": response}, kimi)
        assert (row["status"], row["reconstruction"]) == ("ok", name), row["findings"]
        assert row["prompt_ids"] == kimi.encode(text)
    # no count: the two readings' ids differ and nothing tells them apart
    del response["usage"]
    row, = reconstruct_record({"id": "h", "request": request, "response": response}, kimi)
    assert "prompt_reading_unproven" in [f["code"] for f in row["findings"]]


def test_arguments_already_as_the_engine_writes_them_add_no_reading():
    spaced = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": '{"city": "Paris", "days": 2}'}}
                                   for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in _HISTORY]
    assert [r.name for r in KIMI.prompt_readings({"messages": spaced})] == [None]
    assert [r.name for r in KIMI.prompt_readings({"messages": _HISTORY[:1]})] == [None]


def test_a_users_name_is_a_reading_sglang_drops(kimi):
    """Kimi's header prints a message's ``name`` (``<|im_user|>Alexandra Smith<|im_middle|>``);
    SGLang's user message model has no ``name`` and drops it before the template runs, so
    SGLang serves ``<|im_user|>user<|im_middle|>``: a reading of its own, picked by the count."""
    import pytest

    from test_families_support import register_sglang_namespace
    from tokenbridge.reconstruct import reconstruct_record

    register_sglang_namespace(pytest.fail)
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    named = [{"role": "user", "content": "Hi there.", "name": "Alexandra Smith"}]
    dumped = ChatCompletionRequest(model="m", messages=named).messages[0].model_dump()
    assert {k: v for k, v in dumped.items() if v is not None} == {"role": "user", "content": "Hi there."}
    readings = {r.name: r.text for r in KIMI.prompt_readings({"messages": named})}
    assert set(readings) == {None, "user_name=dropped"}
    assert "<|im_user|>Alexandra Smith<|im_middle|>" in readings[None]
    assert readings["user_name=dropped"] == KIMI.render_request({"messages": [{"role": "user", "content": "Hi there."}]})
    answer = kimi.encode("Hm.") + [kimi.token_id("</think>")] + kimi.encode("Hello.") + [kimi.token_id("<|im_end|>")]
    for name, text in readings.items():
        response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "reasoning": "Hm.", "content": "Hello."}}],
            "usage": {"prompt_tokens": len(kimi.encode(text)), "completion_tokens": len(answer)}}
        row, = reconstruct_record({"id": "n", "request": {"messages": named}, "response": response}, kimi)
        assert (row["status"], row["reconstruction"], row["prompt_ids"]) == ("ok", name, kimi.encode(text))
    both = [*_HISTORY[:3], {"role": "user", "content": "And tomorrow?", "name": "Alexandra Smith"}]
    # vLLM 0.34 parses the arguments too but keeps the name: a reading of its own
    assert [r.name for r in KIMI.prompt_readings({"messages": both})] == [
        None, "tool_args=parsed+user_name=dropped", "history=vllm+tool_args=parsed"]


def _parsed_history_row(kimi, history: list) -> dict:
    """The row of an answer to ``history`` whose count proves SGLang's parsed-arguments prompt."""
    from tokenbridge.reconstruct import reconstruct_record

    request = {"model": "moonshotai/kimi-k2.5", "messages": history, "tools": [WEATHER]}
    parsed = {r.name: r.text for r in KIMI.prompt_readings(request)}["tool_args=parsed"]
    answer = kimi.encode("Still sunny.") + [kimi.token_id("</think>")] + kimi.encode("Yes.") + [kimi.token_id("<|im_end|>")]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning": "Still sunny.", "content": "Yes."}}],
        "usage": {"prompt_tokens": len(kimi.encode(parsed)), "completion_tokens": len(answer)}}
    row, = reconstruct_record({"id": "h", "request": request, "response": response}, kimi)
    assert (row["status"], row["reconstruction"]) == ("ok", "tool_args=parsed")
    return row


def test_conversations_export_writes_the_history_as_the_proved_reading_served_it(kimi, tmp_path):
    """A row proved by ``tool_args=parsed`` (SGLang parsed the history's arguments): the
    conversations export hands a trainer those messages, whose re-rendered prompt is the
    row's; as sent, they rendered the prompt a token shorter."""
    import json

    from test_export_support import read_jsonl, write_jsonl
    from tokenbridge.export import export_file

    row = _parsed_history_row(kimi, _HISTORY)
    export_file(write_jsonl(tmp_path / "rows.jsonl", [row]), tmp_path / "conv", "conversations")
    conv, = read_jsonl(tmp_path / "conv" / "conversations.jsonl")
    history = conv["conversations"][:-1]
    assert history[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    again = KIMI.render_request({"messages": history, "tools": json.loads(conv["tools"])})
    assert kimi.encode(again) == row["prompt_ids"]


def test_conversations_export_leaves_out_a_history_whose_parsed_arguments_json_cannot_hold(kimi, tmp_path):
    """Arguments ``{"days":NaN}``: SGLang's json reads NaN and writes it back into the
    prompt, so the row is proved by ``tool_args=parsed``; the export wrote ``null`` there,
    a history that re-renders another prompt. It is left out; the id formats keep it."""
    import copy

    from test_export_support import write_jsonl
    from tokenbridge.export import export_file
    from tokenbridge.rows import RowError

    history = copy.deepcopy(_HISTORY)
    history[1]["tool_calls"][0]["function"]["arguments"] = '{"city":"Paris","days":NaN}'
    row = _parsed_history_row(kimi, history)
    assert '{"city": "Paris", "days": NaN}' in kimi.decode(row["prompt_ids"])
    rows = write_jsonl(tmp_path / "rows.jsonl", [row])
    with pytest.raises(RowError, match="no row to export: 1 read, .* 1 not a chat turn"):
        export_file(rows, tmp_path / "conv", "conversations")
    assert export_file(rows, tmp_path / "sf", "specforge").rows_exported == 1


_LIST_HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "20C"}, {"type": "text", "text": "sunny"}]},
]


def test_content_parts_are_joined_as_each_engine_joins_them(kimi, kimi_dir):
    """Kimi's template joins a list of text parts with nothing (``20Csunny``). SGLang 0.5.23
    joins a tool result's parts with a space (``serving_chat.normalize_tool_content``; the
    template's content format detects as ``openai``, so a user's list stays a list), the
    same count here: ids no count could tell from the as-sent reading's. vLLM 0.34 detects
    the format as ``string`` and joins every list with a newline, and parses the arguments
    (``parse_chat_messages``, run here as the oracle). Each is a reading; with no count that
    tells them apart the gate says so."""
    import types

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages
    from vllm.renderers.hf import _detect_content_format

    from tokenbridge.reconstruct import reconstruct_record

    template = (kimi_dir / "chat_template.kimi-k2-thinking.jinja").read_text()
    assert _detect_content_format(template, default="string") == "string"
    request = {"model": "moonshotai/kimi-k2.5", "messages": _LIST_HISTORY}
    readings = {r.name: r.text for r in KIMI.prompt_readings(request)}
    assert set(readings) == {None, "tool_args=parsed+tool_parts=space", "history=vllm+parts=newline+tool_args=parsed"}
    assert "<|im_user|>user<|im_middle|>Weatherin Paris?<|im_end|>" in readings[None]
    assert "## Return of c1\n20Csunny<|im_end|>" in readings[None]
    sglang = readings["tool_args=parsed+tool_parts=space"]
    assert "Weatherin Paris?" in sglang and "## Return of c1\n20C sunny<|im_end|>" in sglang
    assert len(kimi.encode(sglang)) == len(kimi.encode(readings[None]))  # the count cannot tell these two apart
    conv, _, _ = parse_chat_messages(ChatCompletionRequest(model="m", messages=copy.deepcopy(_LIST_HISTORY)).messages,
                                     types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False), "string")
    assert readings["history=vllm+parts=newline+tool_args=parsed"] == KIMI.render_request({"messages": conv})
    answer = kimi.encode("Mild.") + [kimi.token_id("</think>")] + kimi.encode("20C.") + [kimi.token_id("<|im_end|>")]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning": "Mild.", "content": "20C."}}],
        "usage": {"prompt_tokens": len(kimi.encode(sglang)), "completion_tokens": len(answer)}}
    row, = reconstruct_record({"id": "l", "request": request, "response": response}, kimi)
    assert row["status"] == "rejected" and "prompt_reading_unproven" in [f["code"] for f in row["findings"]]
    vllm = readings["history=vllm+parts=newline+tool_args=parsed"]
    response["usage"]["prompt_tokens"] = len(kimi.encode(vllm))
    row, = reconstruct_record({"id": "l", "request": request, "response": response}, kimi)
    assert (row["status"], row["reconstruction"], row["prompt_ids"]) == (
        "ok", "history=vllm+parts=newline+tool_args=parsed", kimi.encode(vllm))


def test_conversations_export_writes_each_engines_joined_parts(kimi, tmp_path):
    """A row proved by a reading that joined list parts: the conversations export hands a
    trainer the history as that engine served it, so re-rendering spells the proved prompt ids."""
    request = {"model": "moonshotai/kimi-k2.5", "messages": _LIST_HISTORY}
    vllm = {r.name: r.text for r in KIMI.prompt_readings(request)}["history=vllm+parts=newline+tool_args=parsed"]
    history = _exported_history(kimi, tmp_path, request, vllm)
    assert KIMI.render_request({"messages": history}) == vllm


_ATTRIBUTION = "x-anthropic-billing-header: cch=9f3a1;"


@pytest.mark.parametrize("system", [
    f"{_ATTRIBUTION}\nYou are terse.",
    [{"type": "text", "text": _ATTRIBUTION}, {"type": "text", "text": "You are terse."}],
    _ATTRIBUTION,  # the whole system text: vLLM serves an empty one
])
def test_claude_codes_attribution_line_is_read_as_vllm_drops_it(kimi, kimi_dir, tmp_path, system):
    """vLLM 0.34 drops a system message's first line when it is Claude Code's billing header
    (``_strip_claude_code_billing_header``: its value changes per request), for Kimi as for any
    model; SGLang keeps it. The vLLM reading drops it (run through vLLM's own
    ``parse_chat_messages`` as the oracle), its count proves it, and the export writes the
    system message as served."""
    import types

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages

    from tokenbridge.reconstruct import reconstruct_record

    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    request = {"model": "moonshotai/kimi-k2.5", "messages": messages}
    readings = {r.name: r.text for r in KIMI.prompt_readings(request)}
    assert set(readings) == {None, "history=vllm+billing_header=dropped"}
    vllm = readings["history=vllm+billing_header=dropped"]
    conv, _, _ = parse_chat_messages(ChatCompletionRequest(model="m", messages=copy.deepcopy(messages)).messages,
                                     types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False), "string")
    assert vllm == KIMI.render_request({"messages": conv}) and "billing-header" not in vllm
    assert _ATTRIBUTION in readings[None]
    answer = kimi.encode("Ok.") + [kimi.token_id("</think>")] + kimi.encode("Hi.") + [kimi.token_id("<|im_end|>")]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning": "Ok.", "content": "Hi."}}],
        "usage": {"prompt_tokens": len(kimi.encode(vllm)), "completion_tokens": len(answer)}}
    row, = reconstruct_record({"id": "b", "request": request, "response": response}, kimi)
    assert (row["status"], row["reconstruction"], row["prompt_ids"]) == (
        "ok", "history=vllm+billing_header=dropped", kimi.encode(vllm))
    assert KIMI.render_request({"messages": _exported_history(kimi, tmp_path, request, vllm)}) == vllm


def _exported_history(kimi, tmp_path, request: dict, prompt: str) -> list:
    """The history the conversations export writes for an answer to ``request`` whose
    ``usage.prompt_tokens`` proves ``prompt``."""
    from tokenbridge.export import export_file
    from tokenbridge.reconstruct import reconstruct_file

    answer = kimi.encode("Mild.") + [kimi.token_id("</think>")] + kimi.encode("20C.") + [kimi.token_id("<|im_end|>")]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning": "Mild.", "content": "20C."}}],
        "usage": {"prompt_tokens": len(kimi.encode(prompt)), "completion_tokens": len(answer)}}
    src = tmp_path / "ex.jsonl"
    src.write_text(json.dumps({"id": "l", "request": request, "response": response}) + "\n")
    reconstruct_file(src, tmp_path / "rows.jsonl", kimi, workers=1)
    export_file(tmp_path / "rows.jsonl", tmp_path / "conv", "conversations")
    return json.loads(next((tmp_path / "conv").glob("*.jsonl")).read_text())["conversations"][:-1]


def test_conversations_export_leaves_out_history_reasoning_no_template_read(kimi, tmp_path):
    """A history turn carrying its reasoning as ``reasoning`` (OpenRouter's field): Kimi's
    template reads ``reasoning_content`` only, so the proved prompt has ``<think></think>``
    there; the export wrote the text as ``reasoning_content``, and a trainer re-rendering
    the history got a prompt the model never saw."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "reasoning": "Need the tool.", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "20C"}]
    request = {"model": "moonshotai/kimi-k2.5", "messages": history}
    prompt = KIMI.render_request(request)
    assert "<think></think><|tool_calls_section_begin|>" in prompt and "Need the tool." not in prompt
    assert KIMI.render_request({"messages": _exported_history(kimi, tmp_path, request, prompt)}) == prompt


def test_a_last_assistant_message_is_sglangs_user_message(kimi, oracles):
    """SGLang 0.5.23 (``_handle_last_assistant_message``, without ``continue_final_message``)
    turns a last assistant message of text into a user message before any template runs,
    Kimi's too: only the family templates had that reading, so a Kimi prefill SGLang served
    was rejected. ``renderers``' K2.5 renderer on the converted messages is the oracle text."""
    from tokenbridge.reconstruct import reconstruct_record

    request = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "hi"},
                                                              {"role": "assistant", "content": "Sure, "}]}
    readings = {r.name: r.text for r in KIMI.prompt_readings(request)}
    assert set(readings) == {None, "last_assistant=user"}
    converted = [{"role": "user", "content": "hi"}, {"role": "user", "content": "Sure, "}]
    assert kimi.encode(readings["last_assistant=user"]) == _oracle_ids(oracles, converted, None, True)
    assert "<|im_user|>user<|im_middle|>Sure, <|im_end|><|im_assistant|>assistant<|im_middle|><think>" in readings[
        "last_assistant=user"]
    assert [r.name for r in KIMI.prompt_readings({**request, "continue_final_message": True})] == [None]
    answer = kimi.encode("Ok.") + [kimi.token_id("</think>")] + kimi.encode("Sure, here.") + [kimi.token_id("<|im_end|>")]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning": "Ok.", "content": "Sure, here."}}],
        "usage": {"prompt_tokens": len(kimi.encode(readings["last_assistant=user"])), "completion_tokens": len(answer)}}
    row, = reconstruct_record({"id": "p", "request": request, "response": response}, kimi)
    assert (row["status"], row["reconstruction"]) == ("ok", "last_assistant=user")


def test_history_reasoning_sent_as_reasoning_is_in_vllms_kimi_reading(kimi):
    """Kimi's template prints a tool-call chain's ``reasoning_content``; vLLM 0.34 hands a
    history turn's ``reasoning`` to it under that name (``parse_chat_messages``, run here as
    the oracle), so vLLM's prompt holds it: no reading did, and the row was rejected even
    with vLLM's own prompt ids (a reviewer's)."""
    import types

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages

    from tokenbridge.reconstruct import reconstruct_record

    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "reasoning": "Need the tool.", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "20C"}]
    conv, _, _ = parse_chat_messages(ChatCompletionRequest(model="m", messages=copy.deepcopy(history)).messages,
                                     types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False), "string")
    theirs = KIMI.render_request({"messages": conv})
    assert "<think>Need the tool.</think><|tool_calls_section_begin|>" in theirs
    request = {"model": "moonshotai/kimi-k2.5", "messages": history}
    readings = {r.name: r.text for r in KIMI.prompt_readings(request)}
    assert readings["history=vllm+reasoning=vllm+tool_args=parsed"] == theirs
    answer = kimi.encode("Mild.") + [kimi.token_id("</think>")] + kimi.encode("20C.") + [kimi.token_id("<|im_end|>")]
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning": "Mild.", "content": "20C."}}],
        "usage": {"prompt_tokens": len(kimi.encode(theirs)), "completion_tokens": len(answer)}}
    row, = reconstruct_record({"id": "k", "request": request, "response": response}, kimi)
    assert (row["status"], row["prompt_ids"]) == ("ok", kimi.encode(theirs))


@pytest.mark.parametrize("arguments", ["[]", "42", "null", "not json", ""])
def test_vllms_kimi_reading_coerces_arguments_as_vllm_does(kimi, arguments):
    """vLLM 0.34 hands a template ``{}`` for history arguments that are not a JSON object
    (``_postprocess_messages``, run here through ``parse_chat_messages`` as the oracle);
    its reading kept them as sent, so vLLM's prompt was never built and, at the same
    count, the as-sent one passed with ids vLLM never served (a reviewer's)."""
    import types

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages

    history = [{"role": "user", "content": "Time?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "now", "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    conv, _, _ = parse_chat_messages(ChatCompletionRequest(model="m", messages=copy.deepcopy(history)).messages,
                                     types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False), "string")
    theirs = KIMI.render_request({"messages": conv})
    readings = {r.name: r.text for r in KIMI.prompt_readings({"messages": history})}
    assert readings.get("history=vllm+tool_args=parsed") == theirs

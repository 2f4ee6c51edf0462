"""Dialects: the built-in Kimi K2.5 renderer against the real K2-Thinking template,
our Jinja rendering against transformers, completion assembly, and a second family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbridge.chat import DIALECTS, DialectError, resolve_dialect, thinking_enabled
from tokenbridge.chat.kimi_tools import declare_tools
from tokenbridge.chat.template import template_renderer

KIMI = DIALECTS["kimi-k2.5"]
GEN = "<|im_assistant|>assistant<|im_middle|>"


@pytest.fixture(scope="module")
def k2_thinking(kimi_dir) -> str:
    return (kimi_dir / "chat_template.kimi-k2-thinking.jinja").read_text(encoding="utf-8")


def _as_k25(k2_text: str, thinking: bool) -> str:
    """What K2.5 changes relative to K2-Thinking: the media tag and the think opener."""
    assert k2_text.endswith(GEN)
    return k2_text.replace("<|media_start|>", "<|media_begin|>") + ("<think>" if thinking else "<think></think>")


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
tool_call = st.builds(
    lambda name, i, args: {"id": f"functions.{name}:{i}", "type": "function",
                           "function": {"name": name, "arguments": args}},
    st.sampled_from(["get_weather", "search", "run_code"]),
    st.integers(0, 3),
    st.one_of(texts, st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(texts, st.integers()), max_size=2)),
)
content = st.one_of(
    st.none(),
    texts,
    st.lists(st.one_of(st.builds(lambda t: {"type": "text", "text": t}, texts),
                       st.just({"type": "image_url", "image_url": {"url": "data:x"}}),
                       # a bare string part (engines take it as text; the template tests it as a string)
                       st.sampled_from(["", "text", "an image", "image_url"]), texts), max_size=3),
)


@st.composite
def conversations(draw):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(texts)})
    for _ in range(draw(st.integers(1, 6))):
        role = draw(st.sampled_from(["user", "assistant", "tool"]))
        m = {"role": role, "content": draw(content)}
        if role == "assistant":
            if draw(st.booleans()):
                m["tool_calls"] = draw(st.lists(tool_call, min_size=1, max_size=2))
            if draw(st.booleans()):
                m["reasoning_content"] = draw(texts)
        if role == "tool":
            m["tool_call_id"] = draw(st.sampled_from(["functions.search:0", "functions.run_code:1"]))
        if draw(st.integers(0, 5)) == 0:
            m["name"] = draw(st.sampled_from(["alice", "bot"]))
        msgs.append(m)
    msgs.append({"role": "user", "content": draw(texts)})
    return msgs


tool_lists = st.one_of(st.none(), st.just([{"type": "function", "function": {"name": "get_weather", "description": "天气",
                                                                             "parameters": {"type": "object"}}}]))


@settings(max_examples=300, deadline=None)
@given(conversations(), tool_lists, st.booleans())
def test_builtin_kimi_matches_k2_thinking_template_byte_for_byte(k2_thinking, msgs, tools, thinking):
    # K2.5 declares tools in TypeScript (checked against the oracles in test_chat_k25_oracle.py);
    # everything after the declaration is K2-Thinking's.
    reference = _as_k25(template_renderer(k2_thinking)(msgs, None, thinking, {}), thinking)
    if tools:
        reference = f"<|im_system|>tool_declare<|im_middle|>{declare_tools(tools).text}<|im_end|>" + reference
    assert KIMI.render_prompt(msgs, tools, thinking) == reference


def test_known_prompt_exactly(kimi):
    text = KIMI.render_prompt([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )
    ids = kimi.encode(text)
    assert ids[-4:] == [163588, 69702, 163601, 163606]
    instant = KIMI.render_prompt([{"role": "user", "content": "hi"}], thinking=False)
    assert kimi.encode(instant)[-2:] == [163606, 163607]


def test_history_drops_reasoning_but_tool_chain_keeps_it():
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "OLD"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "", "reasoning_content": "KEEP",
         "tool_calls": [{"id": "functions.f:0", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"},
    ]
    text = KIMI.render_prompt(msgs)
    assert "OLD" not in text and "<think></think>a1" in text
    assert ("<think>KEEP</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
            '<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|><|tool_calls_section_end|>') in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.f:0\n42<|im_end|>" in text


@pytest.mark.parametrize(
    "request_, expected",
    [
        ({}, True),
        ({"reasoning": {"enabled": True}}, True),
        ({"reasoning": {"effort": "high"}}, True),
        ({"reasoning": {"enabled": False}}, False),
        ({"reasoning": {"effort": "none"}}, False),
        ({"chat_template_kwargs": {"thinking": False}}, False),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, False),
    ],
)
def test_thinking_mode_from_request(request_, expected):
    assert thinking_enabled(request_) is expected


def test_completion_parts_rules():
    msg = {"reasoning": "R", "content": "C"}
    assert KIMI.completion_parts(msg, "stop", True) == [
        ("reasoning", "R"), ("think_end", "</think>"), ("content", "C"), ("end", "<|im_end|>")]
    # a length cut appends no end token; a cut inside the reasoning has no </think>
    assert KIMI.completion_parts(msg, "length", True) == [("reasoning", "R"), ("think_end", "</think>"), ("content", "C")]
    assert KIMI.completion_parts({"reasoning": "R", "content": ""}, "length", True) == [("reasoning", "R")]
    assert KIMI.completion_parts({"content": "C"}, "stop", False) == [("content", "C"), ("end", "<|im_end|>")]
    # a leaked end marker is the end token, never doubled
    assert KIMI.completion_parts({"reasoning": "R", "content": "C<|im_end|>"}, "stop", True)[-2:] == [
        ("content", "C"), ("end", "<|im_end|>")]
    # a prompt that does not open the think block: the model writes <think> itself
    assert KIMI.completion_parts(msg, "stop", True, prompt_opens_think=False)[0] == ("think_start", "<think>")


def _tiny_chatml(folder: Path, template: str | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["user assistant system hello world think step answer 42"] * 50, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_jinja_rendering_equals_transformers_apply_chat_template(tmp_path, k2_thinking):
    from transformers import PreTrainedTokenizerFast

    folder = _tiny_chatml(tmp_path / "t", k2_thinking)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>")
    msgs = [
        {"role": "user", "content": "Wetter in 東京?"},
        {"role": "assistant", "content": "", "reasoning_content": "call it",
         "tool_calls": [{"id": "functions.get_weather:0", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": [{"type": "text", "text": "晴れ"}]},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    ours = template_renderer(k2_thinking)(msgs, tools, True, {})
    theirs = hf.apply_chat_template(msgs, tools=tools, chat_template=k2_thinking, tokenize=False, add_generation_prompt=True)
    assert ours == theirs


def test_second_family_qwen3(tmp_path):
    from tokenbridge.reconstruct import reconstruct_record
    from tokenbridge.tokenizer import load_tokenizer

    tok = load_tokenizer(_tiny_chatml(tmp_path / "qwen"))
    dialect = resolve_dialect(tok)
    assert dialect.name == "qwen3"
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
    assert dialect.render_prompt(msgs) == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert dialect.render_prompt(msgs, thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    rec = {"id": 1, "request": {"messages": msgs},
           "response": {"choices": [{"message": {"reasoning": "\nthink\n", "content": "\n\nanswer 42"}, "finish_reason": "stop"}]}}
    row = reconstruct_record(rec, tok)[0]
    ids = row["completion_ids"]
    # Qwen3's prompt does not open the think block, so the model's first token is <think>
    assert ids[0] == tok.token_id("<think>") and ids[-1] == tok.token_id("<|im_end|>")
    assert tok.token_id("</think>") in ids
    assert tok.decode(ids) == "<think>\nthink\n</think>\n\nanswer 42<|im_end|>"
    assert [f["code"] for f in row["findings"]] == ["usage_missing"]


def test_folder_template_is_used_and_unknown_dialect_is_an_error(tmp_path, kimi):
    tok_folder = _tiny_chatml(tmp_path / "tpl", "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    from tokenbridge.tokenizer import load_tokenizer

    d = resolve_dialect(load_tokenizer(tok_folder))
    assert d.name == "qwen3+template"
    # Jinja (as transformers configures it) drops the template's single trailing newline
    assert d.render_prompt([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant"
    with pytest.raises(DialectError, match="unknown dialect 'llama9'"):
        resolve_dialect(kimi, "llama9")


def test_render_request_passes_template_kwargs_and_thinking(tmp_path):
    from tokenbridge.tokenizer import load_tokenizer

    folder = _tiny_chatml(tmp_path / "kw", "{{ greeting }}|{{ enable_thinking }}|{% for m in messages %}{{ m.content }}{% endfor %}")
    d = resolve_dialect(load_tokenizer(folder))
    req = {"messages": [{"role": "user", "content": "x"}],
           "chat_template_kwargs": {"greeting": "hej", "enable_thinking": False}}
    assert d.render_request(req) == "hej|False|x"
    assert KIMI.render_request({"messages": [{"role": "user", "content": "x"}], "reasoning": {"effort": "none"}}).endswith(
        "<think></think>")


@pytest.mark.parametrize(("source", "why"), [
    ("{{ messages[0]['content'] + 1 }}", "chat template failed: TypeError: "),
    ("{{ messages[0].nope.deeper }}", "chat template failed: UndefinedError: "),
    ("{{ 1 // 0 }}", "chat template failed: ZeroDivisionError: "),
    ("{{ raise_exception('no system role') }}", "no system role"),
])
def test_a_template_failing_on_its_data_is_a_template_error(source, why):
    """What the template's own code raises is the template's failure, one TemplateError per case."""
    from tokenbridge.chat import TemplateError
    from tokenbridge.chat.template import template_renderer

    render = template_renderer(source)
    with pytest.raises(TemplateError) as info:
        render([{"role": "user", "content": "hi"}], None, True, {})
    assert str(info.value).startswith(why)


def test_a_bug_in_our_template_helpers_keeps_its_traceback(monkeypatch):
    """A failure of tokenbridge's own code inside rendering is not passed off as a template error."""
    from tokenbridge.chat import template

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in tojson")

    monkeypatch.setattr(template, "_tojson", broken)
    render = template.template_renderer("{{ messages | tojson }}  {# unique source: not from the compile cache #}")
    with pytest.raises(RuntimeError, match="a bug in tojson"):
        render([{"role": "user", "content": "hi"}], None, True, {})


def test_a_dialect_whose_tokens_the_tokenizer_lacks_is_refused(kimi):
    """``dialect = "qwen3"`` on Kimi's tokenizer rendered ChatML's markers as text: every
    sample went to the API, was paid for, then rejected. Refused before anything is sent."""
    from conftest import KIMI_DIR
    from tokenbridge.tokenizer import load_tokenizer

    with pytest.raises(DialectError) as caught:
        resolve_dialect(kimi, "qwen3")
    assert str(caught.value) == (f"{kimi.source}: the qwen3 dialect needs the token(s) <|im_start|>, which this "
                                 "tokenizer does not have (it is kimi-k2.5's: drop the dialect or give kimi-k2.5)")
    qwen = load_tokenizer(KIMI_DIR.parent / "qwen3")
    with pytest.raises(DialectError, match="the kimi-k2.5 dialect needs the token.s. <.im_middle.>, <.im_assistant.>"):
        resolve_dialect(qwen, "kimi-k2.5")
    assert resolve_dialect(qwen, "qwen3").name.startswith("qwen3")
    assert resolve_dialect(kimi, "kimi-k2.5").name == "kimi-k2.5"


def test_tool_arguments_nested_too_deeply_to_read_stay_the_string_they_are():
    """SGLang's argument normalisation keeps a string that is not a JSON object as it is;
    one nested deeper than the stdlib reads was a RecursionError instead."""
    from tokenbridge.chat.template import serving_messages

    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert serving_messages(msgs, parse_tool_arguments=True)[1] == {"role": "assistant", "content": "", "tool_calls": [call]}

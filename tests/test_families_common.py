"""What every family shares: detection from the tokenizer folder, ``--dialect``, the
generic dialect for unknown families, the tool grammar as data, and the thinking default."""

from __future__ import annotations

import json

import pytest

from test_families_support import family_tokenizer
from tokenbridge.chat import DIALECTS, DialectError, ToolMarkers, resolve_dialect, thinking_enabled
from tokenbridge.chat.kimi import TOOL_MARKERS as KIMI_TOOLS
from tokenbridge.reconstruct import reconstruct_record


@pytest.mark.parametrize("folder, name", [
    ("qwen3", "qwen3+template"), ("deepseek-v3.1", "deepseek-v3.1+template"), ("deepseek-v3.2", "deepseek-v3.2"),
    ("glm-4.5", "glm-4.5+template"), ("gpt-oss", "gpt-oss+template"),
])
def test_each_shared_folder_resolves_to_its_family(folder, name):
    assert resolve_dialect(family_tokenizer(folder)).name == name


def test_kimi_folder_still_resolves_to_kimi(kimi):
    assert resolve_dialect(kimi).name == "kimi-k2.5"


def test_dialect_flag_overrides_detection():
    tok = family_tokenizer("deepseek-v3.2")  # no template: V3.1 renders only with one
    with pytest.raises(DialectError, match="only with the folder's chat template"):
        resolve_dialect(tok, "deepseek-v3.1")
    qwen = family_tokenizer("qwen3")
    assert resolve_dialect(qwen, "qwen3", use_template=False).name == "qwen3"
    assert set(DIALECTS) == {"kimi-k2.5", "qwen3", "deepseek-v3.1", "deepseek-v3.2", "glm-4.5", "gpt-oss",
                             "gpt-oss-harmony"}
    gptoss = family_tokenizer("gpt-oss")  # the openai_harmony stack keeps its own renderer over the template
    assert resolve_dialect(gptoss, "gpt-oss-harmony").name == "gpt-oss-harmony"


def _unknown_folder(path, template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "</s>", "<|user|>", "<|bot|>", "<think>", "</think>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world answer think step"] * 20, trainer)
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "</s>", "bos_token": "<s>"}
    if template:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_unknown_family_with_a_template_gets_the_generic_dialect_and_a_finding(tmp_path):
    from tokenbridge.tokenizer import load_tokenizer

    template = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|bot|>"
    tok = load_tokenizer(_unknown_folder(tmp_path / "u", template))
    d = resolve_dialect(tok)
    assert d.name == "generic+template" and not d.completion_proven
    assert (d.end_token, d.think_open, d.think_close) == ("</s>", "<think>", "</think>")
    rec = {"id": "u", "request": {"messages": [{"role": "user", "content": "hello"}]},
           "response": {"choices": [{"message": {"reasoning": "step", "content": "answer"}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 0, "completion_tokens": 0}}}
    row, = reconstruct_record(rec, tok)
    assert row["prompt_ids"] == tok.encode("<s><|user|>hello<|bot|>")
    assert "completion_unproven" in {f["code"] for f in row["findings"]} and row["status"] == "rejected"


def test_a_generic_template_reads_parts_as_each_engine_hands_them_over_and_nothing_more(tmp_path):
    """A family no engine is known to serve with SGLang's other changes (its tool dump, its
    last-assistant turn, vLLM's history reasoning): only the two engines' handling of the
    parts are readings."""
    from tokenbridge.tokenizer import load_tokenizer

    template = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|bot|>"
    d = resolve_dialect(load_tokenizer(_unknown_folder(tmp_path / "u", template)))
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    request = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "hi"}],
               "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    readings = [(r.name, r.text) for r in d.prompt_readings(request)]
    assert readings == [("parts=space", "<s><|user|>hello there<|assistant|>hi<|bot|>"),
                        ("parts=newline", "<s><|user|>hello\nthere<|assistant|>hi<|bot|>")]


def test_unknown_family_without_a_template_is_an_error(tmp_path):
    from tokenbridge.tokenizer import load_tokenizer

    tok = load_tokenizer(_unknown_folder(tmp_path / "n", None))
    with pytest.raises(DialectError, match="cannot tell the chat format"):
        resolve_dialect(tok)


def test_kimi_tool_grammar_is_the_default_shape():
    assert KIMI_TOOLS.all == ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                              "<|tool_call_argument_begin|>", "<|tool_call_end|>")
    assert KIMI_TOOLS.repeated == ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
    assert KIMI_TOOLS.grammar == ("<|tool_calls_section_begin|> (<|tool_call_begin|> <|tool_call_argument_begin|> "
                                  "<|tool_call_end|>)+ <|tool_calls_section_end|>")
    one_call = ToolMarkers(section_begin="<a>", section_end="</a>", unit=(), min_units=0)
    assert one_call.all == ("<a>", "</a>") and one_call.grammar == "<a> ... </a>"


@pytest.mark.parametrize("request_, default, expected", [
    ({}, True, True), ({}, False, False),
    ({"reasoning": {"enabled": True}}, False, True), ({"reasoning": {"effort": "low"}}, False, True),
    ({"reasoning": {"enabled": False}}, True, False), ({"reasoning": {"effort": "none"}}, True, False),
    ({"chat_template_kwargs": {"thinking": True}}, False, True),
    ({"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}, False, True),
    ({"reasoning": {"enabled": True}, "chat_template_kwargs": {"thinking": False}}, False, False),  # off wins
    ({"reasoning": {}}, False, False),
])
def test_thinking_enabled_with_a_family_default(request_, default, expected):
    assert thinking_enabled(request_, default=default) is expected

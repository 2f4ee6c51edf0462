"""A tokenizer folder is the user's own input: each damaged file in it is one clear error
naming the file (and line or field), never a hang, a Rust panic, a traceback (exit 8), an
id past the vocabulary in an ``ok`` row, or a template silently replaced by the built-in one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from test_families_support import SHARED
from tokenbridge.chat import DialectError, TemplateError, resolve_dialect
from tokenbridge.tokenizer import TokenizerError, load_tokenizer


def _copy(tmp_path: Path, family: str, **changed: bytes | str) -> Path:
    """The shared ``family`` folder, its files linked, with ``changed`` files written anew."""
    folder = tmp_path / family
    folder.mkdir()
    files = {name.replace("__", "."): data for name, data in changed.items()}
    for src in (SHARED / family).iterdir():
        if src.name not in files:
            (folder / src.name).symlink_to(src)
    for name, data in files.items():
        with open(folder / name, "xb") as fh:  # a new file: never through a link into the shared folder
            fh.write(data.encode() if isinstance(data, str) else data)
    return folder


def _config(family: str, edit: Any) -> str:
    data = json.loads((SHARED / family / "tokenizer_config.json").read_text(encoding="utf-8"))
    edit(data)
    return json.dumps(data)


def _ranks(edit: Any) -> bytes:
    lines = (SHARED / "kimi-k2.5" / "tiktoken.model").read_bytes().splitlines(keepends=True)
    edit(lines)
    return b"".join(lines)


def _set(lines: list[bytes], at: int, line: bytes) -> None:
    lines[at] = line


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["added_tokens_decoder"]["163587"].update(content=""),
     r'added_tokens_decoder\["163587"\]\.content must be a non-empty string'),  # was: every encode looped, unkillable
    (lambda d: d["added_tokens_decoder"]["163587"].update(content=5),
     r'added_tokens_decoder\["163587"\]\.content must be a non-empty string'),
    (lambda d: d["added_tokens_decoder"]["163587"].update(content="<|im_end|>"),
     r"content '<\|im_end\|>' is also id 163586's"),
    (lambda d: d.update(added_tokens_decoder=[1, 2]), "added_tokens_decoder must be an object, not an array"),
    # a null entry loaded as a reserved name: <|im_user|> became text and every row a usage mismatch
    (lambda d: d["added_tokens_decoder"].update({"163587": None}), r'added_tokens_decoder\["163587"\] must be an object, '
                                                                    "not null"),
    (lambda d: d["added_tokens_decoder"].update(abc={"content": "x"}), "added_tokens_decoder: key 'abc' is not a token id"),
    (lambda d: d["added_tokens_decoder"].update({"+163587": {"content": "x"}}),
     r"added_tokens_decoder: keys for id 163587 are given twice \('\+163587'\)"),
    (lambda d: d.update(chat_template=5), "chat_template must be a string or a list"),  # was: dropped silently
    (lambda d: d.update(chat_template=[{"name": "default", "template": 5}]), "the \"default\" entry's template"),
])
def test_bad_added_tokens_and_templates_in_the_config_are_named(tmp_path, edit, message):
    folder = _copy(tmp_path, "kimi-k2.5", tokenizer_config__json=_config("kimi-k2.5", edit))
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(folder)


@pytest.mark.parametrize("text", ["[]", "5", '"x"', "[" * 100_000 + "]" * 100_000])
@pytest.mark.parametrize("family", ["kimi-k2.5", "qwen3", "gpt-oss"])
def test_a_config_that_is_no_object_is_named(tmp_path, family, text):
    folder = _copy(tmp_path, family, tokenizer_config__json=text)
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: (must hold a JSON object|cannot read JSON)"):
        load_tokenizer(folder)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda ls: _set(ls, 4, b"JQ== 200000\n"), r"tiktoken\.model: ranks must run 0\.\.\d+ with none missing; 4 is"),
    (lambda ls: _set(ls, 4, b"!!!! 4\n"), r"tiktoken\.model:5: expected 'base64token rank'"),
    (lambda ls: _set(ls, 4, b"JA== 4\n"), r"tiktoken\.model:5: token b'\$' is listed twice"),
    (lambda ls: _set(ls, 4, b"JQ== 3\n"), r"tiktoken\.model:5: rank 3 is also the rank of line 4"),
    (lambda ls: _set(ls, 4, b"JQ== -1\n"), r"tiktoken\.model:5: rank -1 is out of range"),
    (lambda ls: ls.pop(4), r"tiktoken\.model: ranks must run"),
])
def test_a_damaged_ranks_file_is_refused_at_its_line(tmp_path, edit, message):
    # was: loaded silently; ids past the vocabulary in `ok` rows, marker ids shifted, panics later
    folder = _copy(tmp_path, "kimi-k2.5", tiktoken__model=_ranks(edit))
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(folder)


def test_a_byte_without_a_rank_is_refused(tmp_path):
    def drop_percent(lines: list[bytes]) -> None:  # "%" is rank 4: the last rank takes its place
        last = lines.pop()
        lines[4] = last.split()[0] + b" 4\n"
    folder = _copy(tmp_path, "kimi-k2.5", tiktoken__model=_ranks(drop_percent))
    with pytest.raises(TokenizerError, match=r"single byte\(s\) have no rank \(first b'%'\)"):
        load_tokenizer(folder)


@pytest.mark.parametrize(("source", "message"), [
    ('pat_str = ""\n', r"tokenization_kimi\.py:1: pat_str is empty"),  # was: a Rust panic on the first encode
    ('pat_str = "x*"\n', "tiktoken rejected the data"),  # matches empty text: the same panic
    ("pat_str = " + " + ".join(['"a"'] * 5000) + "\n", "cannot parse|not a string literal"),  # was: RecursionError
    (b"pat_str = '\xe9'\n", r"tokenization_kimi\.py: cannot read"),  # not UTF-8
])
def test_a_bad_pre_tokenizer_pattern_is_named(tmp_path, source, message):
    folder = _copy(tmp_path, "kimi-k2.5", tokenization_kimi__py=source)
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(folder)


@pytest.mark.parametrize(("family", "files", "error", "message"), [
    ("qwen3", {"chat_template__jinja": "{% for %}"}, DialectError, "chat template does not compile"),  # was: exit 8
    ("qwen3", {"chat_template__jinja": b"{{ '\xe9' }}"}, TokenizerError, r"chat_template\.jinja: cannot read"),
    ("kimi-k2.5", {"chat_template__json": "[1]"}, TokenizerError, r"chat_template\.json: must hold a JSON object"),
    ("kimi-k2.5", {"chat_template__json": '{"chat_template": 5}'}, TokenizerError,
     r"chat_template\.json: chat_template must be a string"),
])
def test_a_bad_chat_template_file_is_named(tmp_path, family, files, error, message):
    def load() -> None:
        resolve_dialect(load_tokenizer(_copy(tmp_path, family, **files)))
    with pytest.raises(error, match=message):
        load()


def test_a_template_that_runs_out_of_memory_fails_its_render_not_the_run(tmp_path):
    from tokenbridge.chat.template import template_renderer

    render = template_renderer("{{ raise_memory() }}")
    with pytest.raises(TemplateError):
        render([{"role": "user", "content": "hi"}], None, True, {"raise_memory": _no_memory})


def _no_memory() -> str:
    raise MemoryError


@pytest.mark.parametrize("tokenizer_json", [
    lambda d: d.update(model=[1]), lambda d: d.update(added_tokens=5)])
def test_a_tokenizer_json_of_odd_shape_is_an_error_not_a_crash(tmp_path, tokenizer_json):
    data = json.loads((SHARED / "gpt-oss" / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer_json(data)
    folder = _copy(tmp_path, "gpt-oss", tokenizer__json=json.dumps(data))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(folder)


def test_the_cli_says_one_line_and_exits_2_for_a_damaged_folder(tmp_path):
    folder = _copy(tmp_path, "kimi-k2.5", tokenizer_config__json=_config(
        "kimi-k2.5", lambda d: d["added_tokens_decoder"]["163587"].update(content="")))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "request": {"messages": [{"role": "user", "content": "hi"}]},
                               "response": {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}}) + "\n")
    cli = str(Path(sys.executable).with_name("tokenbridge"))  # a process of its own: a hang is killed, not waited on
    out = subprocess.run([cli, "reconstruct", str(src), "-o", str(tmp_path / "o.jsonl"),
                          "--tokenizer", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and 'added_tokens_decoder["163587"].content' in out.stderr
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("command", [
    ["reconstruct", "{src}", "-o", "{tmp}/o.jsonl"], ["inspect", "{src}", "--id", "a"],
    ["generate", "p={src}", "--out", "{tmp}/run", "--dry-run", "-m", "m"],
    ["probe", "--base-url", "http://127.0.0.1:9/v1", "-m", "m", "--providers", "a"], ["emulator", "--port", "0"]])
def test_a_chat_template_that_does_not_compile_is_one_line_in_every_command(tmp_path, command):
    """Only ``run`` said so; reconstruct, inspect, generate --dry-run, probe and the emulator
    died with a traceback (exit 8) in resolving the dialect (a cold tester's)."""
    folder = _copy(tmp_path, "kimi-k2.5", tokenizer_config__json=_config(
        "kimi-k2.5", lambda d: d.update(chat_template="{% if %}")))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "hi", "request": {"messages": [{"role": "user", "content": "hi"}]},
                               "response": {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}}) + "\n")
    cli = str(Path(sys.executable).with_name("tokenbridge"))
    args = [a.format(src=src, tmp=tmp_path) for a in command]
    out = subprocess.run([cli, *args, "--tokenizer", str(folder)], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert out.stderr.splitlines() == [f"error: {folder}: chat template does not compile: TemplateSyntaxError: "
                                       "Expected an expression, got 'end of statement block'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "kimi-k2.5"]


def test_an_id_key_spelled_as_int_reads_it_is_that_id(tmp_path):
    """``"+163587"`` names id 163587 for the model's own loader (``int(key)``); it was read as
    absent and the id named ``<|reserved_token_163587|>`` (a cold reviewer's)."""
    def respell(d: dict[str, Any]) -> None:
        d["added_tokens_decoder"]["+163587"] = d["added_tokens_decoder"].pop("163587")
    tok = load_tokenizer(_copy(tmp_path, "kimi-k2.5", tokenizer_config__json=_config("kimi-k2.5", respell)))
    assert tok.marker_ids[163587] == "<|im_user|>"

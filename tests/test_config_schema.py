"""One schema for every config: run TOML, generate TOML/YAML, emulator TOML/YAML, CLI flags.

Each test is one bad value (or one rule): the exact one-line message (file:line:
section.key, did you mean), exit code 2, and, for ``run``, that nothing was sent.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import write_run_config
from tokenbridge.cli import app
from tokenbridge.emulator import ConfigError as EmulatorConfigError
from tokenbridge.emulator import EmulatorConfig, ProviderConfig, load_emulator_config, running_emulator
from tokenbridge.exit_codes import ExitCode
from tokenbridge.generate import ConfigError, GenerateSettings, load_config
from tokenbridge.jsonl import path_step
from tokenbridge.pipeline import PipelineError, RunConfig, load_run_config
from tokenbridge.schema import read_mapping


def _run_toml(kimi_dir: Path, base_url: str = "http://127.0.0.1:9/api/v1") -> str:
    return f"""[run]
out = "out"
tokenizer = "{kimi_dir}"

[generate]
base_url = "{base_url}"
model = "moonshotai/kimi-k2.5"
concurrency = 2
max_tokens = 64
progress = "none"
datasets = [
  {{ name = "chat", path = "builtin:prompts/chat.jsonl", limit = 1 }},
]

[reconstruct]
usage_tolerance = 0

[export]
formats = ["conversations"]
include_flagged = false

[vocab]
draft_vocab_size = 64

[report]
enabled = false
"""


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _line(text: str, needle: str) -> int:
    """1-based line of the first line containing ``needle`` (independent of the loader)."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def _run_errors(path: Path) -> list[str]:
    """``tokenbridge run`` on ``path``: exit 2 with only ``error:`` lines; returns them."""
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == ExitCode.CONFIG == 2, res.output
    assert "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), res.output
    return [line.removeprefix("error: ") for line in lines]


def _replace(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


# --- run: the bad value names file:line: section.key, exit 2, and nothing is sent -----------


def test_run_bad_export_format_exits_2_before_any_request(tmp_path, kimi, kimi_dir):
    with running_emulator(EmulatorConfig(min_tokens=5, max_tokens=20), tokenizer=kimi) as url:
        good = _run_toml(kimi_dir, url)
        text = _replace(good, 'formats = ["conversations"]', 'formats = ["specforg"]')
        path = _write(tmp_path, text)
        assert _run_errors(path) == [
            f"{path}:{_line(text, 'formats')}: export.formats[0]: unknown value 'specforg'; did you mean 'specforge'?"
        ]
        stats = json.loads(urllib.request.urlopen(url.removesuffix("/api/v1") + "/stats", timeout=30).read())
        assert stats["total"] == 0
        assert not (tmp_path / "out" / "state.sqlite").exists()
        # the control: the same config with a known format does reach the API
        res = CliRunner().invoke(app, ["run", str(_write(tmp_path, good))])
        assert res.exit_code == 0, res.output
        stats = json.loads(urllib.request.urlopen(url.removesuffix("/api/v1") + "/stats", timeout=30).read())
        assert stats["total"] >= 1 and (tmp_path / "out" / "state.sqlite").is_file()


def test_run_formats_as_a_string_is_an_error(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), 'formats = ["conversations"]', 'formats = "specforge"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'formats')}: export.formats: must be a list, got 'specforge' (write [\"specforge\"])"
    ]


def test_run_format_named_twice_is_an_error(tmp_path, kimi_dir):
    """Exported twice into one folder, the second over the first: refused before any work."""
    text = _replace(_run_toml(kimi_dir), 'formats = ["conversations"]', 'formats = ["conversations", "parquet", "conversations"]')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [f"{path}:{_line(text, 'formats')}: export.formats: conversations named more than once"]


def test_run_provider_profile_that_is_no_file_is_an_error_not_a_wait(tmp_path, kimi_dir):
    """A FIFO blocked the config check until something wrote to it."""
    import os

    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    text = _replace(_run_toml(kimi_dir), "usage_tolerance = 0", f'usage_tolerance = 0\nprovider_profile = "{fifo}"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [f"{path}:{_line(text, 'provider_profile')}: reconstruct.provider_profile: {fifo}: "
                                 "not a regular file"]


def test_run_negative_draft_vocab_size(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "draft_vocab_size = 64", "draft_vocab_size = -5")
    path = _write(tmp_path, text)
    assert _run_errors(path) == [f"{path}:{_line(text, 'draft_vocab_size')}: vocab.draft_vocab_size: must be >= 1, got -5"]


def test_run_draft_vocab_larger_than_the_tokenizer_is_refused_before_generation(tmp_path, kimi, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "draft_vocab_size = 64", "draft_vocab_size = 10000000")
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'draft_vocab_size')}: vocab.draft_vocab_size: must be <= the target vocabulary size "
        f"{kimi.vocab_size}, got 10000000"
    ]
    assert not (tmp_path / "out" / "state.sqlite").exists()
    # the model's size given in the config is the bound (and itself bounded, naming its key)
    text = _replace(text, "draft_vocab_size = 10000000", "draft_vocab_size = 10000000\ntarget_vocab_size = 9000000")
    path = _write(tmp_path, text)
    assert _run_errors(path) == [f"{path}:{_line(text, 'draft_vocab_size')}: vocab.draft_vocab_size: must be <= the "
                                 "target vocabulary size 9000000, got 10000000"]
    text = _replace(text, "target_vocab_size = 9000000", "target_vocab_size = 99999999")
    path = _write(tmp_path, text)
    errors = _run_errors(path)
    assert len(errors) == 1 and errors[0].startswith(f"{path}:{_line(text, 'target_vocab_size')}: "
                                                     "vocab.target_vocab_size: "), errors


def test_run_target_vocab_smaller_than_the_tokenizer_is_refused_before_generation(tmp_path, kimi, kimi_dir):
    """``target_vocab_size = 100000`` under Kimi's 163,840 ids was found only after the paid
    generation, as a row's fault (``reconstructed.jsonl:1: input_ids: holds id 163599``),
    and blocked every export: the tokenizer's own ids already exceed it."""
    text = _replace(_run_toml(kimi_dir), "draft_vocab_size = 64", "draft_vocab_size = 64\ntarget_vocab_size = 100000")
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'target_vocab_size')}: vocab.target_vocab_size: must be >= the tokenizer's "
        f"{kimi.vocab_size} ids (0 to {kimi.vocab_size - 1}; every row's ids must fit the target vocabulary), got 100000"
    ]
    assert not (tmp_path / "out").exists()
    text = _replace(text, "target_vocab_size = 100000", f"target_vocab_size = {kimi.vocab_size}")  # the bound itself
    from tokenbridge.runconfig import check_before_generate

    check_before_generate(load_run_config(_write(tmp_path, text)), kimi)


def test_run_dialect_typo_gets_did_you_mean(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), 'out = "out"', 'out = "out"\ndialect = "kimi-k25"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'dialect')}: run.dialect: unknown value 'kimi-k25'; did you mean 'kimi-k2.5'?"
    ]


def test_run_include_flagged_string_is_not_a_boolean(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "include_flagged = false", 'include_flagged = "false"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'include_flagged')}: export.include_flagged: must be true or false, got 'false' "
        "(a quoted string is not a boolean: write true or false without quotes)"
    ]


def test_run_generate_string_is_not_an_integer(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "concurrency = 2", 'concurrency = "2"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [f"{path}:{_line(text, 'concurrency')}: generate.concurrency: must be an integer, got '2'"]


def test_run_unknown_finding_code_in_severities(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "usage_tolerance = 0", 'usage_tolerance = 0\nseverity = { truncatd = "off" }')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'severity')}: reconstruct.severity: unknown finding code 'truncatd'; did you mean 'truncated'?"
    ]


def test_run_unknown_severity_level(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "usage_tolerance = 0", 'usage_tolerance = 0\nseverity = { truncated = "eror" }')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'severity')}: reconstruct.severity.truncated: unknown value 'eror'; did you mean 'error'?"
    ]


def test_run_missing_tokenizer_folder(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), f'tokenizer = "{kimi_dir}"', 'tokenizer = "./no-such-tok"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'tokenizer')}: run.tokenizer: no such tokenizer folder: {tmp_path / 'no-such-tok'}"
    ]


def test_run_tokenizer_that_is_neither_folder_nor_hub_id(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), f'tokenizer = "{kimi_dir}"', 'tokenizer = "kimi k2.5"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'tokenizer')}: run.tokenizer: 'kimi k2.5' is neither a tokenizer folder nor a Hub repo id "
        "(owner/name)"
    ]


def test_run_missing_dataset_file(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), '"builtin:prompts/chat.jsonl"', '"prompts/missing.jsonl"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'missing.jsonl')}: generate.datasets[0].path: no such file or folder: "
        f"{tmp_path / 'prompts' / 'missing.jsonl'}"
    ]


def test_run_dataset_behind_a_folder_without_search_permission(tmp_path, kimi_dir, monkeypatch):
    """``exists()`` raised the PermissionError of a mode-000 folder on the way: exit 8."""
    text = _replace(_run_toml(kimi_dir), '"builtin:prompts/chat.jsonl"', '"locked/p.jsonl"')
    path = _write(tmp_path, text)
    target = tmp_path / "locked" / "p.jsonl"
    real_stat = Path.stat

    def stat(self, *args, **kwargs):  # what a user (not root) gets under a mode-000 folder
        if self == target:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'locked/p.jsonl')}: generate.datasets[0].path: cannot be read: {target} (Permission denied)"
    ]


def test_run_builtin_dataset_typo_gets_did_you_mean(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), '"builtin:prompts/chat.jsonl"', '"builtin:prompts/chat.jsnl"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'chat.jsnl')}: generate.datasets[0].path: no such built-in data "
        "'builtin:prompts/chat.jsnl'; did you mean 'builtin:prompts/chat.jsonl'?"
    ]


def test_run_unknown_section_gets_did_you_mean(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "[report]", "[reprot]")
    path = _write(tmp_path, text)
    assert _run_errors(path) == [f"{path}:{_line(text, '[reprot]')}: reprot: unknown key; did you mean 'report'?"]


def test_run_bad_emulator_file_names_that_file(tmp_path, kimi_dir):
    emu = _write(tmp_path, '[[providers]]\nname = "a/fp8"\n[providers.quirks]\nend_marker_leek = 0.5\n', "emu.toml")
    text = _replace(_run_toml(kimi_dir), "[generate]", f'[emulator]\nconfig = "{emu.name}"\nlatency_ms = 0\n\n[generate]')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{emu}:4: providers[0].quirks.end_marker_leek: unknown key; did you mean 'end_marker_leak'?"
    ]


def test_run_bad_emulator_override(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "[generate]", "[emulator]\nfault_rate = 1.5\n\n[generate]")
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'fault_rate')}: emulator.fault_rate: must be a rate between 0 and 1, got 1.5"
    ]


def test_run_reports_every_problem_at_once_in_file_order(tmp_path, kimi_dir):
    text = _run_toml(kimi_dir)
    for old, new in (('formats = ["conversations"]', 'formats = ["specforg"]'), ("draft_vocab_size = 64", "draft_vocab_size = -5"),
                     ("max_tokens = 64", "max_tokens = 0"), ('out = "out"', 'out = "out"\nmode = "fast"')):
        text = _replace(text, old, new)
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'mode')}: run.mode: unknown key (known: tokenizer, out, dialect)",
        f"{path}:{_line(text, 'max_tokens')}: generate.max_tokens: must be >= 1, got 0",
        f"{path}:{_line(text, 'formats')}: export.formats[0]: unknown value 'specforg'; did you mean 'specforge'?",
        f"{path}:{_line(text, 'draft_vocab_size')}: vocab.draft_vocab_size: must be >= 1, got -5",
    ]


def test_load_run_config_error_carries_exit_code_2(tmp_path, kimi_dir):
    path = _write(tmp_path, _replace(_run_toml(kimi_dir), "include_flagged = false", "include_flagged = 0"))
    with pytest.raises(PipelineError) as err:
        load_run_config(path)
    assert err.value.code == ExitCode.CONFIG and "export.include_flagged: must be true or false, got 0" in str(err.value)


def test_valid_run_config_keeps_its_values(tmp_path, kimi_dir):
    cfg = load_run_config(_write(tmp_path, _run_toml(kimi_dir)))
    assert isinstance(cfg, RunConfig)
    assert cfg.export_formats == ("conversations",) and cfg.include_flagged is False and cfg.draft_vocab_size == 64
    assert cfg.report is False and cfg.out == tmp_path / "out" and cfg.tokenizer == str(kimi_dir)
    assert cfg.generate["datasets"][0]["name"] == "chat" and Path(cfg.generate["datasets"][0]["path"]).is_file()


# --- generate config and flags ---------------------------------------------------------------


def test_generate_config_reports_every_problem(tmp_path):
    text = 'model = "m"\nstream = "false"\nconcurency = 3\n[request]\ntop_p = 2\n'
    path = _write(tmp_path, text, "gen.toml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).splitlines() == [
        f"{path}:2: stream: must be true or false, got 'false' (a quoted string is not a boolean: "
        "write true or false without quotes)",
        f"{path}:3: concurency: unknown key; did you mean 'concurrency'?",
        f"{path}:5: request.top_p: must be <= 1.0, got 2",
    ]
    assert err.value.exit_code == ExitCode.CONFIG


def test_generate_yaml_dataset_key_typo(tmp_path):
    path = _write(tmp_path, "model: m\ndatasets:\n  - path: a.jsonl\n  - path: b.jsonl\n    limt: 3\n", "gen.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:5: datasets[1].limt: unknown key; did you mean 'limit'?"


def test_a_yaml_key_given_twice_is_refused_naming_both_lines(tmp_path):
    # PyYAML keeps the last value silently: the run would have gone out with 256 in flight
    path = _write(tmp_path, "model: m\nconcurrency: 8\nmax_tokens: 64\nconcurrency: 256\n", "gen.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}:4: concurrency: given twice in one mapping (first on line 2): which value is "
                              "meant is unclear (YAML readers keep the last, silently)")
    assert err.value.exit_code == ExitCode.CONFIG
    # nested: a list entry's mapping, named by its path; a quoted spelling is the same key
    path = _write(tmp_path, "providers:\n  - name: a/fp8\n  - name: b/fp8\n    engine: sglang\n    'engine': vllm\n",
                  "emu.yaml")
    with pytest.raises(EmulatorConfigError) as emu:
        load_emulator_config(path)
    assert str(emu.value).startswith(f"{path}:5: providers[1].engine: given twice in one mapping (first on line 4)")


@pytest.mark.parametrize(("text", "message"), [
    ("max_tokens: 010", "max_tokens: must be an integer, got '010'"),
    ("max_tokens: 1:20", "max_tokens: must be an integer, got '1:20'"),
    ("max_tokens: 1_0_0", "max_tokens: must be an integer, got '1_0_0'"),
    ("max_tokens: 0x10", "max_tokens: must be an integer, got '0x10'"),
    ("stream: on", "stream: must be true or false, got 'on'"),
    ("stream: yes", "stream: must be true or false, got 'yes'"),
])
def test_yaml_scalars_are_read_as_toml_reads_them_not_coerced(tmp_path, text, message):
    """PyYAML's YAML 1.1 rules sent ``max_tokens: 010`` as 8, ``1:20`` as 80, ``1_0_0`` as 100
    and ``stream: on`` as true, exit 0 (a cold tester's); TOML refuses ``010``. Such a scalar
    is text now, which the schema refuses where a number or a boolean belongs."""
    path = _write(tmp_path, f"model: m\n{text}\n", "gen.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:2: {message}" in str(err.value)
    assert load_config(_write(tmp_path, "model: m\nmax_tokens: 64\ntemperature: 1e-1\nstream: True\n", "ok.yaml")
                       ).request.max_tokens == 64


@pytest.mark.parametrize(("first", "again"), [("false", "False"), ("1", "1.0"), ("true", "TRUE"), ("~", "null"),
                                           ("1", "+1")])
def test_yaml_keys_equal_as_data_are_one_key_given_twice(tmp_path, first, again):
    """Spelled apart, read as one: PyYAML's dict kept the last value (the last note's "left")."""
    path = _write(tmp_path, f"x:\n  {first}: 1\n  {again}: 2\n", "c.yaml")
    with pytest.raises(ConfigError) as err:
        read_mapping(path, ConfigError)
    where = "x" + path_step(again)
    assert str(err.value).startswith(f"{path}:3: {where}: given twice in one mapping (first on line 2 as {first!r})")
    # a date and a time of that day are two keys, as PyYAML reads them
    assert read_mapping(_write(tmp_path, "2026-12-07: 1\n2026-12-07 00:00:00: 2\n", "d.yaml"), ConfigError)[0] == {
        datetime.date(2026, 12, 7): 1, datetime.datetime(2026, 12, 7): 2}


def test_a_yaml_key_repeated_through_an_alias_is_refused(tmp_path):
    # the alias is the anchored key itself: an identity check saw no repeat, and 4096 was sent
    path = _write(tmp_path, "model: m\nrequest:\n  &k max_tokens: 8\n  *k : 4096\n", "gen.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:4: request: an alias (*name) as a key: write the key itself"


def test_a_yaml_repeat_names_odd_keys_as_json_paths_name_them(tmp_path):
    text = "a:\n  - 'b.c': 1\n    'b.c': 2\n'': 1\n'': 2\n"
    with pytest.raises(ConfigError) as err:
        read_mapping(_write(tmp_path, text, "c.yaml"), ConfigError)
    assert str(err.value).startswith(f"{tmp_path / 'c.yaml'}:3: a[0][\"b.c\"]: given twice in one mapping (first on line 2)")
    with pytest.raises(ConfigError) as err:
        read_mapping(_write(tmp_path, "x: 1\n'': 1\n'': 2\n", "c.yaml"), ConfigError)
    assert str(err.value).startswith(f"{tmp_path / 'c.yaml'}:3: [\"\"]: given twice")


def test_a_yaml_merge_key_overridden_is_no_repeat(tmp_path):
    # YAML's override: the mapping sets what the merge brought in (and two merged sources share a key)
    text = ("x-base: &base\n  max_tokens: 64\n  stream: true\nx-more: &more\n  max_tokens: 32\n"
            "gen:\n  <<: [*base, *more]\n  max_tokens: 128\n")
    path = _write(tmp_path, text, "c.yaml")
    data, _ = read_mapping(path, ConfigError)
    assert data["gen"] == {"max_tokens": 128, "stream": True}
    assert read_mapping(_write(tmp_path, "a: 1\n'1': 2\n1: 3\n", "k.yaml"), ConfigError)[0] == {"a": 1, "1": 2, 1: 3}


def _laughs(levels: int) -> str:
    """A few lines of YAML whose aliases expand to 9**levels strings."""
    lines = ['x0: &x0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines)


def test_a_yaml_config_whose_aliases_expand_past_a_million_values_is_refused(tmp_path):
    # 4.8 million strings from eight lines: PyYAML shares them, checking the config walked each one
    text = "model: m\nrequest:\n  extra_body:\n    " + _laughs(7).replace("\n", "\n    ") + "\n"
    path = _write(tmp_path, text, "gen.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: holds more than 1,000,000 values or 64 MiB of text once its aliases are "
                              "expanded (a config holds hundreds of values): refused before reading it")
    # few values, each a long text: 100 x 100 copies of 100,000 characters (a gigabyte in every request body)
    text = ('model: m\nrequest:\n  extra_body:\n    s: &s "' + "\u00e9" * 100_000 + '"\n    l1: &l1 ['
            + ", ".join(["*s"] * 100) + "]\n    l2: [" + ", ".join(["*l1"] * 100) + "]\n")
    with pytest.raises(ConfigError, match="or 64 MiB of text once its aliases are expanded"):
        load_config(_write(tmp_path, text, "gen.yaml"))
    # under the bound the same shape reads, shared values and all
    path = _write(tmp_path, "model: m\nrequest:\n  extra_body:\n    " + _laughs(3).replace("\n", "\n    ") + "\n",
                  "gen.yaml")
    assert load_config(path).request.extra_body["x2"] == [[["lol"] * 9] * 9] * 9


@pytest.mark.parametrize("text", ["model: m\nrequest:\n  extra_body: &e {self: *e}\n", "datasets: &d [*d]\n"])
def test_a_yaml_value_that_contains_itself_is_refused(tmp_path, text):
    path = _write(tmp_path, text, "gen.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    line = text.count("\n", 0, text.index("&")) + 1
    assert str(err.value) == f"{path}:{line}: a value that contains itself through an alias"


def test_a_toml_key_given_twice_is_refused_too(tmp_path):
    path = _write(tmp_path, 'model = "m"\nconcurrency = 8\nconcurrency = 256\n', "gen.toml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: invalid TOML: Cannot overwrite a value (at line 3")


def test_generate_new_fields_have_the_agreed_defaults_and_ranges(tmp_path):
    s = GenerateSettings()
    assert s.max_response_bytes == 67108864 and s.attempt_timeout_s == 900.0
    path = _write(tmp_path, "max_response_bytes = 0\nattempt_timeout_s = 0\n", "gen.toml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).splitlines() == [
        f"{path}:1: max_response_bytes: must be >= 1024, got 0",
        f"{path}:2: attempt_timeout_s: must be > 0.0, got 0",
    ]


def test_generate_config_reads_builtin_datasets_like_run(tmp_path):
    path = _write(tmp_path, '[generate]\nmodel = "m"\n[[generate.datasets]]\npath = "builtin:prompts/plain.jsonl"\n',
                  "gen.toml")
    (spec,) = load_config(path).datasets
    assert spec.name == "plain" and spec.path.is_file() and spec.path.name == "plain.jsonl"


def test_generate_key_outside_the_generate_table_is_an_error(tmp_path):
    path = _write(tmp_path, 'concurrency = 4\n[run]\ntokenizer = "x/y"\n[generate]\nmodel = "m"\n', "gen.toml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:1: concurrency: outside [generate], where it would be ignored; move it under [generate]"


def test_generate_flag_out_of_range_names_the_flag(tmp_path):
    prompts = _write(tmp_path, json.dumps({"prompt": "hi"}) + "\n", "p.jsonl")
    res = CliRunner().invoke(app, ["generate", str(prompts), "--out", str(tmp_path / "run"), "--model", "m",
                                   "--temperature", "-1", "--top-p", "1.5", "--dry-run"])
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        "error: --temperature: must be >= 0.0, got -1.0",
        "error: --top-p: must be <= 1.0, got 1.5",
    ]
    assert not (tmp_path / "run").exists()


def test_generate_flag_choice_typo_gets_did_you_mean(tmp_path):
    prompts = _write(tmp_path, json.dumps({"prompt": "hi"}) + "\n", "p.jsonl")
    res = CliRunner().invoke(app, ["generate", str(prompts), "--out", str(tmp_path / "run"), "--model", "m",
                                   "--progress", "rih", "--dry-run"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == "error: --progress: unknown value 'rih'; did you mean 'rich'?"


def test_generate_flags_override_the_file(tmp_path):
    path = _write(tmp_path, 'model = "m"\nconcurrency = 3\nmax_tokens = 10\n', "gen.toml")
    from tokenbridge.generate.settings import override_settings

    s = override_settings(load_config(path), {"concurrency": 7, "request": {"max_tokens": None}})
    assert s.concurrency == 7 and s.request.max_tokens == 10 and s.request.model == "m"


@pytest.mark.parametrize(("text", "message"), [
    # nan was sent as "x":NaN and written into exchanges.jsonl, which is then not JSON
    ("extra_body = {x = nan}", "1: extra_body: x: must be a finite number, got nan (a request holding it is not JSON)"),
    ("[request]\nextra_body = {a = {b = [1, -inf]}}",
     "3: request.extra_body: a.b[1]: must be a finite number, got -inf (a request holding it is not JSON)"),
    ("[request]\nextra_body = {when = 2024-01-01}", "3: request.extra_body: when: a date is not a JSON value"),
    # each replaced what tokenbridge builds, for every sample and silently
    ("extra_body = {messages = 'hijack'}", "1: extra_body: messages: tokenbridge sets this itself (from each prompt row)"),
    ("extra_body = {model = 5, n = 9}", "1: extra_body: model: tokenbridge sets this itself (from model); "
     "n: tokenbridge sets this itself (from request.n, which is checked)"),
    ("extra_body = {stream = true}",
     "1: extra_body: stream: tokenbridge sets this itself (with stream = true (--stream), when sending)"),
    ("extra_body = {reasoning = 'high'}", "1: extra_body: reasoning: must be a table (it is merged into the request's reasoning)"),
    # a run setting in the body: sent to the provider, no cap on the run (a cold tester's)
    ("extra_body = {max_cost = 0.5}", "1: extra_body: max_cost: a tokenbridge setting, not a request field: set it "
     "outside extra_body; there it would go to the provider as it is and do nothing here"),
    # another provider's key, sent with every request and stored in every exchange (a cold tester's)
    ("extra_body = {provider_credentials = 'sk-ant-api03-Xq3vT9LmN2pR8sK4wY7zB1cD5fG6hJ0k'}",
     "1: extra_body: provider_credentials: looks like a credential (not shown here): extra_body goes into every "
     "request and is stored with every exchange (the store, exchanges.jsonl, the exports); the key comes only from "
     "api_key_env"),
    # or named as one, in any shape (a cold reviewer's)
    ("extra_body = {api_key = '9f8e7d6c5b4a39281706f5e4d3c2b1a0'}",
     "1: extra_body: api_key: looks like a credential (not shown here): extra_body goes into every request and is "
     "stored with every exchange (the store, exchanges.jsonl, the exports); the key comes only from api_key_env"),
    ("[request]\nextra_body = {a = [{auth = 'Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0'}]}",
     "3: request.extra_body: a[0].auth: looks like a credential (not shown here): extra_body goes into every "
     "request and is stored with every exchange (the store, exchanges.jsonl, the exports); the key comes only from "
     "api_key_env"),
    # the budget reserves it as the completion's cap (beside max_tokens, the larger): "lots" was sent as is
    ("extra_body = {max_completion_tokens = 'lots'}", "1: extra_body: max_completion_tokens: must be a whole number of "
     "tokens, 1 or more (the budget reserves it as the completion's cap), got 'lots'"),
    ("extra_body = {max_completion_tokens = 0}", "1: extra_body: max_completion_tokens: must be a whole number of "
     "tokens, 1 or more (the budget reserves it as the completion's cap), got 0"),
    # refused by aiohttp only when sending: every sample failed its attempts one by one
    ('[headers]\n"X-Title" = "a\\r\\nX-Injected: 1"',
     "2: headers: header X-Title: value holds a control character (U+000D at character 1): it cannot be sent in an HTTP header"),
    ('headers = {"X Title" = "ab"}', "1: headers: header name 'X Title' is not an HTTP field name "
     "(letters, digits and !#$%&'*+-.^_`|~; no space, colon or control character)"),
    # the top-level model lost to [request]'s without a word
    ('[request]\nmodel = "other"', "1: model: also set as request.model; set it in one place"),
    # extra_body is merged last: it replaced these settings in every body (instant-mode answers, another provider)
    ("[request]\nreasoning = {enabled = true}\nextra_body = {reasoning = {enabled = false}}",
     "4: request.extra_body.reasoning.enabled: also set by request.reasoning.enabled; set it in one place "
     "(extra_body is merged last and would silently replace it)"),
    ('[request]\nextra_body = {provider = {order = ["b"], sort = "price"}}\n[request.provider]\norder = ["a"]',
     "3: request.extra_body.provider.order: also set by request.provider.order; set it in one place "
     "(extra_body is merged last and would silently replace it)"),
    ("reasoning = 'low'\nextra_body = {reasoning = {effort = 'high'}}",
     "2: extra_body.reasoning.effort: also set by reasoning.effort; set it in one place "
     "(extra_body is merged last and would silently replace it)"),
], ids=["nan", "nested-inf", "date", "messages", "model-and-n", "stream", "reasoning-string", "setting-in-body", "credential", "credential-named", "credential-nested", "cap-word", "cap-zero",
        "header-crlf",
        "header-name", "model-twice", "extra-reasoning-leaf", "extra-provider-leaf", "extra-over-top-level"])
def test_generate_config_refuses_what_could_not_be_sent_as_meant(tmp_path, text, message):
    path = _write(tmp_path, 'model = "m"\n' + text + "\n" if text.startswith("[") else text + '\nmodel = "m"\n', "gen.toml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:{message}"


@pytest.mark.parametrize(("body", "where"), [
    ({"token": "9f8e7d6c5b4a39281706f5e4d3c2b1a0"}, "token"),
    ({"secretKey": "9f8e7d6c5b4a39281706f5e4d3c2b1a0"}, "secretKey"),
    ({"private_key": "9f8e7d6c5b4a39281706f5e4d3c2b1a0"}, "private_key"),
    ({"metadata": {"sk-or-v1-" + "9f8e7d6c5b4a39281706f5e4d3c2b1a0" * 2: True}}, "metadata.<a key>"),
    ({"x": "AIza" + "SyD-9f_Ke7c" * 3}, "x"),  # Google's: a provider's own prefix, dashes in its body
])
def test_extra_body_credentials_in_close_variants_are_refused(body, where):
    """Names the first version missed (``token``, ``secretKey``), a key used as a field's
    name, and a Google key whose dashes broke its random run (a cold reviewer's)."""
    from tokenbridge.generate.settings import _valid_extra_body

    with pytest.raises(ValueError, match=rf"^{re.escape(where)}: looks like a credential \(not shown here\)"):
        _valid_extra_body(body)


def test_extra_body_free_text_that_only_looks_like_a_key_prefix_is_sent(tmp_path):
    """The header check's shapes, applied to free text, refused run names, user ids and
    prose (a cold reviewer's): a body value is a key only with a key's random body."""
    text = ("model = 'm'\n[request.extra_body]\nuser = 'pk_user_0042_team7_batch19'\nmetadata = {run = "
            "'rk-2024-11-05-ablation-v2-seed3'}\nprediction = {content = 'Use basic 2024-05-01T12-00-00Z_v3 format'}\n"
            "prompt_cache_key = '3f2a9c1e8b7d6f5a4e3c2b1a0f9e8d7c6b5a4e3d2c1b0a9f8e7d6c5b4a3e2d1c'\n"
            "session_id = 'a3f9c2e1b7d4a3f9c2e1b7d4a3f9c2e1'\n")
    settings = load_config(_write(tmp_path, text, "gen.toml"))
    assert settings.request.extra_body["user"] == "pk_user_0042_team7_batch19"
    assert set(settings.request.extra_body) == {"user", "metadata", "prediction", "prompt_cache_key", "session_id"}


def test_extra_body_keys_tokenbridge_does_not_own_still_pass_and_merge(tmp_path):
    path = _write(tmp_path, 'model = "m"\nheaders = {"X-Title" = "caf\u00e9"}\n[request]\nextra_body = { '
                  'return_token_ids = true, provider = { sort = "price" }, reasoning = { max_tokens = 50 }, x = 1.5 }\n',
                  "gen.toml")
    s = load_config(path)
    assert dict(s.request.extra_body) == {"return_token_ids": True, "provider": {"sort": "price"},
                                          "reasoning": {"max_tokens": 50}, "x": 1.5}
    assert s.headers == {"X-Title": "caf\u00e9"}  # sent as UTF-8 (obs-text): not refused


def test_extra_body_may_not_replace_what_a_flag_sets(tmp_path):
    """Flags override the file, but extra_body was merged over them: ``--reasoning on
    --provider-only good`` sent ``reasoning.enabled: false`` and the file's provider,
    paid for, without a word. One line per clash, naming the flag and the extra_body key."""
    cfg = _write(tmp_path, 'model = "m"\n[request]\nextra_body = { provider = { only = ["cheap"] }, '
                 'reasoning = { enabled = false }, return_token_ids = true }\n', "gen.toml")
    prompts = _write(tmp_path, json.dumps({"prompt": "hi"}) + "\n", "p.jsonl")
    res = CliRunner().invoke(app, ["generate", str(prompts), "--config", str(cfg), "--out", str(tmp_path / "run"),
                                   "--base-url", "http://127.0.0.1:9/v1", "--reasoning", "on",
                                   "--provider-only", "good"], env={})
    assert res.exit_code == ExitCode.CONFIG, res.output
    assert res.output.strip().splitlines() == [
        "error: --provider-only: also set by extra_body.provider.only in the config; set it in one place "
        "(extra_body is merged last and would silently replace this value)",
        "error: --reasoning: enabled: also set by extra_body.reasoning.enabled in the config; set it in one place "
        "(extra_body is merged last and would silently replace this value)"]
    assert not (tmp_path / "run").exists()
    # keys of its own (and other leaves of the tables it shares) still merge
    s = GenerateSettings().with_overrides(request={"extra_body": {"reasoning": {"max_tokens": 9}}, "reasoning": "high"})
    from tokenbridge.generate.prompts import Sample
    from tokenbridge.generate.request import build_request

    assert build_request(Sample("a", "d", [{"role": "user", "content": "x"}]), s.request)["reasoning"] == {
        "effort": "high", "max_tokens": 9}


def test_settings_built_in_python_whose_extra_body_replaces_one_are_refused_when_built_into_a_request():
    from tokenbridge.generate.prompts import Sample
    from tokenbridge.generate.request import build_request
    from tokenbridge.generate.settings import RequestSettings

    rs = RequestSettings(model="m", seed=1, provider={"only": ["a"]}, extra_body={"provider": {"only": ["b"]}})
    with pytest.raises(ConfigError) as err:
        build_request(Sample("a", "d", [{"role": "user", "content": "x"}]), rs)
    assert str(err.value) == ("request.extra_body.provider.only: also set by request.provider.only; set it in one "
                              "place (extra_body would silently replace it)")


_INT64 = "must be a 64-bit integer, -9223372036854775808 to 9223372036854775807 (what the API takes and a stored " \
    "request reads back as an integer), got "


def test_request_integers_are_64_bit(tmp_path):
    """``--seed 99999999999999999999999`` was sent, stored, and read back by orjson as the
    float ``1e+23``: every integer a request carries is checked against 64 bits."""
    prompts = _write(tmp_path, json.dumps({"prompt": "hi"}) + "\n", "p.jsonl")
    args = ["generate", str(prompts), "--out", str(tmp_path / "run"), "--model", "m", "--base-url", "http://127.0.0.1:9/v1"]
    res = CliRunner().invoke(app, [*args, "--seed", "99999999999999999999999", "--max-tokens", str(2**63)], env={})
    assert res.exit_code == ExitCode.CONFIG, res.output
    assert res.output.strip().splitlines() == [f"error: --max-tokens: {_INT64}{2**63}",
                                               f"error: --seed: {_INT64}99999999999999999999999"]
    assert not (tmp_path / "run").exists()
    path = _write(tmp_path, 'model = "m"\n[request]\nseed = -9223372036854775808\nreasoning = { max_tokens = '
                  '9223372036854775808 }\n', "gen.toml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:4: request.reasoning.max_tokens: {_INT64}9223372036854775808"
    assert GenerateSettings().with_overrides(request={"seed": -(2**63), "n": 2**63 - 1}).request.seed == -(2**63)


def test_a_header_built_in_python_is_checked_too():
    with pytest.raises(ConfigError, match="header X-T: value holds a control character"):
        GenerateSettings(headers={"X-T": "a\nb"})
    with pytest.raises(ConfigError, match=r"extra_body: messages: tokenbridge sets this itself"):
        GenerateSettings().with_overrides(request={"extra_body": {"messages": []}})


def test_run_config_refuses_a_non_finite_extra_body_value(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "max_tokens = 64", "max_tokens = 64\nextra_body = { x = nan }")
    assert _run_errors(_write(tmp_path, text)) == [
        f"{tmp_path / 'run.toml'}:{_line(text, 'extra_body')}: generate.extra_body: x: must be a finite number, got nan "
        "(a request holding it is not JSON)"]
    assert not (tmp_path / "out").exists()


def test_run_config_refuses_extra_body_over_a_generate_setting(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), "max_tokens = 64",
                    "max_tokens = 64\nreasoning = { enabled = true }\nextra_body = { reasoning = { enabled = false } }")
    assert _run_errors(_write(tmp_path, text)) == [
        f"{tmp_path / 'run.toml'}:{_line(text, 'extra_body')}: generate.extra_body.reasoning.enabled: also set by "
        "generate.reasoning.enabled; set it in one place (extra_body is merged last and would silently replace it)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["sk-or-v1-0123456789\r\nX-Injected: 1", "sk-or-v1-01234\x01" + "ab" * 10])
def test_an_api_key_with_a_control_character_is_refused_before_anything_is_sent(tmp_path, key):
    """aiohttp refused it per request (each sample failed its attempts); now one line,
    exit 2, naming the variable and never the key."""
    prompts = _write(tmp_path, json.dumps({"prompt": "hi"}) + "\n", "p.jsonl")
    res = CliRunner().invoke(app, ["generate", str(prompts), "--out", str(tmp_path / "run"), "--model", "m",
                                   "--base-url", "http://127.0.0.1:9/v1", "--api-key-env", "TB_TEST_KEY", "--max-attempts", "1"],
                             env={"TB_TEST_KEY": key})
    assert res.exit_code == ExitCode.CONFIG, res.output
    code = ord(key.strip()[key.strip().index(next(c for c in key.strip() if ord(c) < 32))])
    at = key.strip().index(chr(code))
    assert res.output.strip().splitlines() == [f"error: the API key in $TB_TEST_KEY holds a control character "
                                               f"(U+{code:04X} at character {at}): it cannot be sent in an HTTP header"]
    assert key.strip()[:12] not in res.output
    assert not (tmp_path / "run").exists()


def test_generate_refuses_a_run_config_with_an_emulator_unless_the_base_url_is_given(tmp_path):
    """``run`` starts the [emulator] and sends to it; ``generate`` starts none, so the demo
    config sent (paid, with a key) to OpenRouter without a word. One line, exit 2, nothing
    made; with --base-url the user says where to send."""
    cfg = Path(__file__).resolve().parents[1] / "examples" / "demo.toml"
    args = ["generate", "--config", str(cfg), "--out", str(tmp_path / "run"), "--max-attempts", "1", "--progress", "none"]
    res = CliRunner().invoke(app, args, env={"OPENROUTER_API_KEY": "sk-or-v1-" + "0" * 64})
    assert res.exit_code == ExitCode.CONFIG, res.output
    line = res.output.strip().splitlines()
    assert len(line) == 1 and line[0].startswith(f"error: {cfg}:") and ": emulator: generate starts no emulator, so " \
        "this config's requests would go to https://openrouter.ai/api/v1: run it with `tokenbridge run" in line[0]
    assert not (tmp_path / "run").exists()
    res = CliRunner().invoke(app, [*args, "--base-url", "http://127.0.0.1:9/v1", "--dry-run"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, [*args, "--dry-run"])  # sends nothing: not refused
    assert res.exit_code == 0 and "samples: 216" in res.output, res.output


# --- emulator config and flags ---------------------------------------------------------------


def test_emulator_engine_field_defaults_and_typo(tmp_path):
    assert ProviderConfig("a").engine == "none"
    path = _write(tmp_path, '[[providers]]\nname = "a/fp8"\nengine = "sglang"\n[[providers]]\nname = "b/fp8"\n'
                  'engine = "vlm"\n', "emu.toml")
    with pytest.raises(EmulatorConfigError) as err:
        load_emulator_config(path)
    assert str(err.value) == f"{path}:6: providers[1].engine: unknown value 'vlm'; did you mean 'vllm'?"
    path.write_text('[[providers]]\nname = "a/fp8"\nengine = "sglang"\n', encoding="utf-8")
    assert load_emulator_config(path).providers[0].engine == "sglang"


def test_missing_key_points_at_its_own_entry_not_the_next(tmp_path):
    path = _write(tmp_path, '[[providers]]\nquantization = "fp8"\n[[providers]]\nname = "b/fp8"\n', "emu.toml")
    with pytest.raises(EmulatorConfigError) as err:
        load_emulator_config(path)
    assert str(err.value) == f"{path}:1: providers[0].name: missing (required)"


def test_emulator_config_reports_every_problem(tmp_path):
    path = _write(tmp_path, 'seed = "1"\nmin_tokens = 0\naccept_any_model = "yes"\n', "emu.toml")
    with pytest.raises(EmulatorConfigError) as err:
        load_emulator_config(path)
    assert str(err.value).splitlines() == [
        f"{path}:1: seed: must be an integer, got '1'",
        f"{path}:2: min_tokens: must be >= 1, got 0",
        f"{path}:3: accept_any_model: must be true or false, got 'yes' (a quoted string is not a boolean: "
        "write true or false without quotes)",
    ]
    assert err.value.exit_code == ExitCode.CONFIG


def test_emulator_flag_out_of_range_names_the_flag(tmp_path, kimi_dir):
    res = CliRunner().invoke(app, ["emulator", "--tokenizer", str(kimi_dir), "--fault-rate", "2", "--port", "0"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == "error: --fault-rate: must be a rate between 0 and 1, got 2.0"


# --- the other commands' flags ---------------------------------------------------------------


def test_export_format_typo_gets_did_you_mean(tmp_path):
    src = _write(tmp_path, "", "rows.jsonl")
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "x"), "--format", "specforg"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == "error: --format: unknown value 'specforg'; did you mean 'specforge'?"
    assert not (tmp_path / "x").exists()


def test_reconstruct_dialect_typo_gets_did_you_mean(tmp_path, kimi_dir):
    src = _write(tmp_path, "", "ex.jsonl")
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(tmp_path / "r.jsonl"), "-t", str(kimi_dir),
                                   "--dialect", "kimi-k25"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == "error: --dialect: unknown value 'kimi-k25'; did you mean 'kimi-k2.5'?"


def test_reconstruct_severity_flag_typo(tmp_path, kimi_dir):
    src = _write(tmp_path, "", "ex.jsonl")
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(tmp_path / "r.jsonl"), "-t", str(kimi_dir),
                                   "--off", "truncatd"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == "error: --warn/--error/--off: unknown finding code 'truncatd'; did you mean 'truncated'?"


def test_exit_codes_are_the_documented_ones():
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0, "INCOMPLETE": 1, "USAGE": 2, "PAYMENT": 3, "BUDGET": 4, "UNAUTHORIZED": 5, "STORE": 6,
        "BUSY": 7, "INTERNAL": 8, "INTERRUPTED": 130,
    }
    assert ExitCode.CONFIG is ExitCode.USAGE


def test_run_a_nul_in_a_path_is_a_config_error(tmp_path, kimi_dir):
    """A NUL in a TOML string (``\\u0000``) reached os.stat as ValueError: embedded null byte."""
    text = _replace(_run_toml(kimi_dir), 'out = "out"', 'out = "o\\u0000ut"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [f"{path}:{_line(text, 'out = ')}: run.out: must not contain a NUL character"]


@pytest.mark.parametrize(("old", "new", "line", "field"), [
    ('path = "builtin:prompts/chat.jsonl"', 'path = "a\\u0000b.jsonl"', "path = ", "generate.datasets[0].path"),
    ("[reconstruct]", '[emulator]\nconfig = "emu\\u0000.toml"\n\n[reconstruct]', "config = ", "emulator.config"),
])
def test_run_a_nul_in_a_dataset_or_emulator_path_is_a_config_error(tmp_path, kimi_dir, old, new, line, field):
    """These two reached os.stat / Path.resolve: a traceback, exit 8 (a cold tester's)."""
    text = _replace(_run_toml(kimi_dir), old, new)
    path = _write(tmp_path, text)
    assert _run_errors(path) == [f"{path}:{_line(text, line)}: {field}: must not contain a NUL character"]


def test_run_a_dialect_the_tokenizer_cannot_write_is_refused_before_generation(tmp_path, kimi_dir):
    text = _replace(_run_toml(kimi_dir), 'out = "out"', 'out = "out"\ndialect = "qwen3"')
    path = _write(tmp_path, text)
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'dialect')}: run.dialect: {kimi_dir}: the qwen3 dialect needs the token(s) <|im_start|>, "
        "which this tokenizer does not have (it is kimi-k2.5's: drop the dialect or give kimi-k2.5)"]
    assert not (tmp_path / "out" / "state.sqlite").exists()


def test_run_concurrency_past_the_bound_is_a_config_error(tmp_path, kimi_dir):
    """10**8 slots took the limiter's per-slot history to 24 GB and an OOM kill."""
    text = _replace(_run_toml(kimi_dir), "concurrency = 2", "concurrency = 100000000")
    path = _write(tmp_path, text)
    assert _run_errors(path) == [f"{path}:{_line(text, 'concurrency')}: generate.concurrency: must be <= 10000, got 100000000"]


def test_run_with_a_missing_emulator_config_names_its_line(tmp_path, kimi_dir):
    """README: every problem of a run config is ``file:line: section.key: ...``; a missing
    [emulator] config file was ``error: PATH: no such config file`` alone."""
    missing = tmp_path / "nope.toml"
    cfg = write_run_config(tmp_path, kimi_dir, emulator=missing)
    res = CliRunner().invoke(app, ["run", str(cfg)])
    assert res.exit_code == 2, res.output
    line = next(n for n, text in enumerate(cfg.read_text().splitlines(), 1) if text.startswith("config = "))
    assert res.output.strip().splitlines() == [f"error: {cfg}:{line}: emulator.config: {missing}: no such config file"]
    assert not (tmp_path / "out").exists()


def test_a_config_starting_with_a_byte_order_mark_reads_as_without_one(tmp_path, kimi, kimi_dir):
    """What Windows editors write first: TOML's parser took it for "Invalid statement (at
    line 1, column 1)". It is not part of the text: the file reads as it does without it,
    and a problem further down names its own line (the check that needs the tokenizer too)."""
    text = _replace(_run_toml(kimi_dir), "draft_vocab_size = 64", "draft_vocab_size = 10000000")
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert _run_errors(path) == [
        f"{path}:{_line(text, 'draft_vocab_size')}: vocab.draft_vocab_size: must be <= the target vocabulary size "
        f"{kimi.vocab_size}, got 10000000"]
    path.write_bytes(b"\xef\xbb\xbf" + _run_toml(kimi_dir).encode("utf-8"))
    plain = load_run_config(_write(tmp_path, _run_toml(kimi_dir), "plain.toml"))
    assert load_run_config(path) == dataclasses.replace(plain, source=path)
    emulator = tmp_path / "emulator.toml"
    emulator.write_bytes(b'\xef\xbb\xbfmodels = ["m"]\nseed = 7\n')
    assert load_emulator_config(emulator).seed == 7


def test_an_empty_run_out_says_it_must_not_be_empty(tmp_path):
    """``out = ""`` read "Value should have at least 1 item after validation, not 0": pydantic's
    length words for a string whose bound comes after its validator."""
    from tokenbridge.pipeline import PipelineError, load_run_config

    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\nout = ""\n', encoding="utf-8")
    with pytest.raises(PipelineError) as err:
        load_run_config(cfg)
    assert f"{cfg}:2: run.out: must not be empty" in str(err.value)

"""Where a command's tokenizer comes from: the flag, the config, ``$TOKENBRIDGE_TOKENIZER``,
and otherwise one error line naming those ways (exit 2), never a path guessed from the cwd."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import ROOT, write_run_config
from conftest import EXAMPLE_EXCHANGES as EXCHANGES
from tokenbridge.cli import app
from tokenbridge.emulator import EmulatorConfig, running_emulator
from tokenbridge.tokenizer_source import TOKENIZER_ENV, NoTokenizerError

TWO_WAYS = ("error: no tokenizer given: pass --tokenizer (a tokenizer folder or Hub repo id) or set the "
            f"environment variable {TOKENIZER_ENV}")
THREE_WAYS = ("error: no tokenizer given: pass --tokenizer (a tokenizer folder or Hub repo id), set tokenizer in "
              f"the --config file, or set the environment variable {TOKENIZER_ENV}")


def test_library_code_names_no_shared_folder():
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "src" / "tokenbridge").rglob("*.py"))
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if "../shared" in line or "shared/tokenizers" in line]
    assert hits == []


@pytest.mark.parametrize(("args", "want"), [
    (["reconstruct", str(EXCHANGES), "-o", "{tmp}/r.jsonl"], TWO_WAYS),
    (["inspect", str(EXCHANGES)], TWO_WAYS),
    (["probe", "--model", "m", "--providers", "a", "--base-url", "http://127.0.0.1:9/api/v1"], TWO_WAYS),
    (["emulator", "--port", "0"], THREE_WAYS),
], ids=["reconstruct", "inspect", "probe", "emulator"])
def test_no_tokenizer_anywhere_is_one_line_naming_the_ways(tmp_path, monkeypatch, args, want):
    monkeypatch.chdir(ROOT)  # ../shared/tokenizers/kimi-k2.5 exists from here: it must not be guessed
    res = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert res.exit_code == 2, res.output
    assert res.output.splitlines() == [want]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_vocab_without_a_size_or_tokenizer_names_the_env_variable(tmp_path):
    res = CliRunner().invoke(app, ["vocab", str(EXCHANGES), "-n", "8", "-o", str(tmp_path / "v")])
    assert res.exit_code == 2 and f"give --target-vocab-size or --tokenizer (or set {TOKENIZER_ENV})" in res.output


def _reconstruct(tmp_path: Path, name: str, *flags: str, env: dict[str, str] | None = None) -> bytes:
    out = tmp_path / name
    res = CliRunner().invoke(app, ["reconstruct", str(EXCHANGES), "-o", str(out), *flags], env=env)
    assert res.exit_code == 1, res.output  # examples/exchanges.jsonl has one broken line on purpose
    return out.read_bytes()


def test_the_env_variable_names_the_tokenizer(tmp_path, kimi_dir):
    by_flag = _reconstruct(tmp_path, "flag.jsonl", "-t", str(kimi_dir))
    assert _reconstruct(tmp_path, "env.jsonl", env={TOKENIZER_ENV: str(kimi_dir)}) == by_flag
    assert len(by_flag.splitlines()) == 7


def test_the_flag_wins_over_the_env_variable(tmp_path, kimi_dir):
    by_flag = _reconstruct(tmp_path, "flag.jsonl", "-t", str(kimi_dir))
    both = _reconstruct(tmp_path, "both.jsonl", "-t", str(kimi_dir), env={TOKENIZER_ENV: str(tmp_path / "nope")})
    assert both == by_flag


def test_a_bad_env_variable_is_one_line_naming_its_folder(tmp_path):
    res = CliRunner().invoke(app, ["inspect", str(EXCHANGES)], env={TOKENIZER_ENV: str(tmp_path / "nope")})
    assert res.exit_code == 2, res.output
    assert len(res.output.splitlines()) == 1 and str(tmp_path / "nope") in res.output
    assert "Traceback" not in res.output


def test_dry_run_counts_exactly_with_the_env_variable(tmp_path, kimi_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi there"}) + "\n", encoding="utf-8")
    args = ["generate", str(prompts), "--out", str(tmp_path / "run"), "--model", "m", "--dry-run"]
    approx = CliRunner().invoke(app, args)
    exact = CliRunner().invoke(app, args, env={TOKENIZER_ENV: str(kimi_dir)})
    by_flag = CliRunner().invoke(app, [*args, "-t", str(kimi_dir)])
    assert approx.exit_code == exact.exit_code == by_flag.exit_code == 0, (approx.output, exact.output)
    assert "approx." in approx.output and "approx." not in exact.output
    assert exact.output == by_flag.output


def _health(url: str) -> int:
    with urllib.request.urlopen(url.removesuffix("/api/v1") + "/health", timeout=10) as resp:
        return int(resp.status)


def test_emulator_takes_its_tokenizer_from_the_env_variable(kimi_dir, monkeypatch):
    monkeypatch.setenv(TOKENIZER_ENV, str(kimi_dir))
    with running_emulator(EmulatorConfig()) as url:
        assert _health(url) == 200


def test_emulator_config_tokenizer_wins_over_the_env_variable(kimi_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path / "nope"))
    with running_emulator(EmulatorConfig(tokenizer=str(kimi_dir))) as url:
        assert _health(url) == 200


def test_emulator_without_any_tokenizer_names_the_ways(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(NoTokenizerError) as err, running_emulator(EmulatorConfig()):
        pass
    assert str(err.value) == ("no tokenizer given: pass tokenizer= (a tokenizer folder or Hub repo id), set tokenizer "
                              f"in the emulator config, or set the environment variable {TOKENIZER_ENV}")


def _run_config_without_tokenizer(tmp_path: Path) -> Path:
    """The suite's whole-pipeline config with its ``[run] tokenizer`` line taken out."""
    cfg = write_run_config(tmp_path, tmp_path)
    text = cfg.read_text(encoding="utf-8")
    cfg.write_text(text.replace(f'tokenizer = "{tmp_path}"\n', ""), encoding="utf-8")
    assert "tokenizer" not in cfg.read_text(encoding="utf-8")
    return cfg


def test_a_run_config_without_tokenizer_takes_the_env_variable(tmp_path, kimi_dir, monkeypatch):
    from tokenbridge.runconfig import load_run_config

    monkeypatch.setenv(TOKENIZER_ENV, str(kimi_dir))
    assert load_run_config(_run_config_without_tokenizer(tmp_path)).tokenizer == str(kimi_dir)


def test_a_run_config_without_tokenizer_or_env_variable_names_both(tmp_path, monkeypatch):
    from tokenbridge.pipeline import PipelineError
    from tokenbridge.runconfig import load_run_config

    monkeypatch.delenv(TOKENIZER_ENV, raising=False)
    cfg = _run_config_without_tokenizer(tmp_path)
    with pytest.raises(PipelineError) as err:
        load_run_config(cfg)
    assert str(err.value) == (f"{cfg}:2: run.tokenizer: missing: name a tokenizer folder or Hub repo id here, "
                              f"or set {TOKENIZER_ENV}")


def test_a_run_config_with_a_bad_env_variable_names_the_variable(tmp_path, monkeypatch):
    from tokenbridge.pipeline import PipelineError
    from tokenbridge.runconfig import load_run_config

    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path / "nope"))
    with pytest.raises(PipelineError, match=rf"run.tokenizer: no such tokenizer folder: .*nope \({TOKENIZER_ENV}\)$"):
        load_run_config(_run_config_without_tokenizer(tmp_path))


def test_the_config_tokenizer_wins_over_the_env_variable(tmp_path, kimi_dir, monkeypatch):
    from tokenbridge.runconfig import load_run_config

    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path / "nope"))
    assert load_run_config(write_run_config(tmp_path, kimi_dir)).tokenizer == str(kimi_dir)


@pytest.mark.parametrize("from_env", [False, True])
def test_a_run_config_tokenizer_folder_that_holds_no_tokenizer_is_named_where_the_config_names_it(
        tmp_path, monkeypatch, from_env):
    """A cold tester's: ``tokenizer = "/etc"`` (a folder, so the config check passed) stopped
    ``run`` with ``error: TokenizerError: /etc: has neither ...``: no file, line or key, and
    the class name shown; from the environment, nothing said where the path came from."""
    from typer.testing import CliRunner

    from tokenbridge.cli import app

    empty = tmp_path / "notatokenizer"
    empty.mkdir()
    cfg = _run_config_without_tokenizer(tmp_path)
    if from_env:
        monkeypatch.setenv(TOKENIZER_ENV, str(empty))
    else:
        text = cfg.read_text(encoding="utf-8").replace("[run]\n", f'[run]\ntokenizer = "{empty}"\n', 1)
        cfg.write_text(text, encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(cfg)])
    assert res.exit_code == 2, res.output
    tail = f" ({TOKENIZER_ENV})" if from_env else ""
    assert re.fullmatch(rf"error: {re.escape(str(cfg))}:\d+: run\.tokenizer: {re.escape(str(empty))}: has neither "
                        rf"tiktoken\.model nor tokenizer\.json{re.escape(tail)}", res.output.strip()), res.output

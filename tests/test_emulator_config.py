"""Emulator config files (TOML/YAML, errors that point at the line) and the CLI command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tokenbridge.emulator import ConfigError, EmulatorConfig, ProviderConfig, load_emulator_config

ROOT = Path(__file__).resolve().parents[1]


def test_example_config_loads_with_its_quirks():
    cfg = load_emulator_config(ROOT / "examples" / "emulator.toml")
    names = [p.name for p in cfg.providers]
    assert names == ["clean/fp8", "leaky/int4", "stripper/int4", "parser/fp8", "sglang/fp8", "vllm/bf16"]
    by = {p.name: p for p in cfg.providers}
    assert by["stripper/int4"].quirks.strip_whitespace == 1.0
    assert by["parser/fp8"].quirks.parse_tool_calls == 1.0
    assert by["leaky/int4"].quirks.end_marker_leak == 0.3 and by["leaky/int4"].quantization == "int4"
    assert by["clean/fp8"].quirks == ProviderConfig("x").quirks  # all zero
    assert cfg.latency_ms == 50 and cfg.credits_usd is None
    assert (by["sglang/fp8"].engine, by["vllm/bf16"].engine, by["clean/fp8"].engine) == ("sglang", "vllm", "none")
    assert cfg.tool_call_without_think_close == 0.15


def test_yaml_config(tmp_path):
    path = tmp_path / "emu.yaml"
    path.write_text(
        "seed: 4\ncredits_usd: 0.25\nproviders:\n"
        "  - name: a/fp8\n    prompt_price: 1\n    quirks:\n      noncanonical: 1\n"
        "  - name: b/int4\n    quantization: int4\n    faults:\n      rate_limit: 0.5\n"
    )
    cfg = load_emulator_config(path)
    assert cfg.seed == 4 and cfg.credits_usd == 0.25
    assert cfg.providers[0].prompt_price == 1.0 and cfg.providers[0].quirks.noncanonical == 1.0
    assert cfg.providers[1].faults.rate_limit == 0.5 and cfg.providers[1].quantization == "int4"


def test_unknown_key_names_file_line_and_field(tmp_path):
    path = tmp_path / "emu.toml"
    path.write_text('seed = 1\n\n[[providers]]\nname = "a/fp8"\n\n[[providers]]\nname = "b/fp8"\n'
                    "[providers.quirks]\nend_marker_leek = 1.0\n")
    with pytest.raises(ConfigError) as err:
        load_emulator_config(path)
    assert str(err.value).startswith(f"{path}:9: providers[1].quirks.end_marker_leek: unknown key")


def test_bad_rate_and_type_are_errors(tmp_path):
    path = tmp_path / "emu.toml"
    path.write_text('[[providers]]\nname = "a/fp8"\n[providers.faults]\nrate_limit = 1.5\n')
    with pytest.raises(ConfigError, match=r":4: providers\[0\]\.faults\.rate_limit: must be a rate between 0 and 1"):
        load_emulator_config(path)
    path.write_text('latency_ms = "fast"\n')
    with pytest.raises(ConfigError, match=r":1: latency_ms: must be a number, got .fast.$"):
        load_emulator_config(path)
    path.write_text("seed = [\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_emulator_config(path)
    with pytest.raises(ConfigError, match="unique"):
        EmulatorConfig(providers=(ProviderConfig("a"), ProviderConfig("a")))


def test_unknown_engine_is_an_error(tmp_path):
    path = tmp_path / "emu.toml"
    path.write_text('[[providers]]\nname = "a/fp8"\nengine = "tgi"\n')
    with pytest.raises(ConfigError, match=r":3: providers\[0\]\.engine: unknown value 'tgi' \(choose from: none, sglang, vllm\)"):
        load_emulator_config(path)


def test_cli_serves_until_stopped(kimi_dir, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenbridge.cli", "emulator", "--port", "0", "--tokenizer", str(kimi_dir),
         "--config", str(ROOT / "examples" / "emulator.toml"), "--latency-ms", "0", "--seed", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        base = line.split("listening on ")[1].split()[0]
        body = json.dumps({"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "hi"}],
                           "provider": {"only": ["clean"]}}).encode()
        req = urllib.request.Request(f"{base}/chat/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as r:
            answer = json.loads(r.read())
        assert answer["provider"] == "clean/fp8" and answer["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_cli_rejects_a_bad_config(kimi_dir, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("fault_rate = 2.0\n")
    out = subprocess.run(
        [sys.executable, "-m", "tokenbridge.cli", "emulator", "--config", str(bad), "--tokenizer", str(kimi_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and f"{bad}" in out.stderr and "fault_rate" in out.stderr


def test_emulator_on_a_port_in_use_or_a_bad_host_is_one_line(kimi_dir):
    """Each was a traceback and exit 8 (an internal error) for an ordinary bad flag."""
    import socket

    from typer.testing import CliRunner

    from tokenbridge.cli import app

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = CliRunner().invoke(app, ["emulator", "--port", str(port), "-t", str(kimi_dir)])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert f"error: --host 127.0.0.1 --port {port}: cannot listen there (" in res.output and "address already in use" in res.output
    res = CliRunner().invoke(app, ["emulator", "--port", "0", "--host", "not a host", "-t", str(kimi_dir)])
    assert res.exit_code == 2 and "error: --host not a host --port 0: cannot listen there (" in res.output
    assert CliRunner().invoke(app, ["emulator", "--port", "70000", "-t", str(kimi_dir)]).exit_code == 2


def test_infinite_numbers_are_config_errors(tmp_path, kimi_dir):
    """latency_ms = inf hung every request; prompt_price = inf wrote "cost": Infinity, not JSON."""
    from typer.testing import CliRunner

    from tokenbridge.cli import app

    cfg = tmp_path / "emu.toml"
    cfg.write_text('[[providers]]\nname = "a"\nprompt_price = inf\n', encoding="utf-8")
    res = CliRunner().invoke(app, ["emulator", "--port", "0", "-t", str(kimi_dir), "-c", str(cfg)])
    assert res.exit_code == 2 and f"error: {cfg}:3: providers[0].prompt_price: must be a finite number, got inf" in res.output
    res = CliRunner().invoke(app, ["emulator", "--port", "0", "-t", str(kimi_dir), "--latency-ms", "inf"])
    assert res.exit_code == 2 and "error: --latency-ms: must be a finite number, got inf" in res.output

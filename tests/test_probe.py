"""``tokenbridge probe`` against emulator providers with known quirks."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from tokenbridge.cli import app
from tokenbridge.emulator import EmulatorConfig, ProviderConfig, ProviderQuirks, running_emulator
from tokenbridge.generate import probe

MODEL = "moonshotai/kimi-k2.5"
FAKE_KEY = "sk-or-v1-PROBE-FAKE-KEY-9d8c7b6a"


def _config(**kw) -> EmulatorConfig:
    return EmulatorConfig(
        tool_call_rate=1.0,
        min_tokens=20,
        max_tokens=200,
        providers=(
            ProviderConfig("siliconflow/int4", quantization="int4"),
            ProviderConfig("chutes/int4", quantization="int4",
                           quirks=ProviderQuirks(end_marker_leak=1.0, think_close_in_content=1.0)),
            ProviderConfig("atlas-cloud/int4", quantization="int4",
                           quirks=ProviderQuirks(parse_tool_calls=1.0, drop_reasoning=1.0)),
        ),
        **kw,
    )


def test_probe_reports_each_providers_quirks(kimi):
    names = ["siliconflow/int4", "chutes/int4", "atlas-cloud/int4", "gone/fp8"]
    with running_emulator(_config(), tokenizer=kimi) as url:
        reports = probe(model=MODEL, providers=names, base_url=url, key=None, tokenizer=kimi)
    got = {r.provider: r.summary() for r in reports}
    keys = ("available", "ok", "reasoning_present", "end_marker_leak", "think_marker_leak", "tool_markers",
            "usage_parity")
    assert {p: tuple(s[k] for k in keys) for p, s in got.items()} == {
        "siliconflow/int4": (True, "3/3", "3/3", "0/3", "0/3", "raw", "3/3"),
        "chutes/int4": (True, "3/3", "3/3", "3/3", "3/3", "raw", "0/3"),
        "atlas-cloud/int4": (True, "3/3", "0/3", "0/3", "0/3", "parsed", "0/3"),
        "gone/fp8": (False, "0/3", None, None, None, None, None),
    }
    assert got["gone/fp8"]["errors"] == ["no_endpoints: No endpoints found matching your data policy and provider "
                                         "preferences"]
    by_prompt = {c.prompt: c for c in reports[1].calls}
    assert {"eos_in_text", "think_marker_in_content"} <= set(by_prompt["greeting"].findings)
    ours, theirs = by_prompt["greeting"].completion_tokens
    assert ours == theirs + 1  # the leaked "<|im_end|>" text encodes to one extra end token
    clean = {c.prompt: c for c in reports[0].calls}
    assert all(c.served_by == "siliconflow/int4" and c.findings == [] for c in clean.values())
    assert clean["cjk"].prompt_tokens[0] == clean["cjk"].prompt_tokens[1]
    assert all(c.cost and c.cost > 0 and c.latency_s > 0 for c in clean.values())


def test_probe_cli_prints_the_table_and_writes_json(tmp_path, kimi, kimi_dir):
    with running_emulator(_config(api_key=FAKE_KEY), tokenizer=kimi) as url:
        out = tmp_path / "probe.json"
        res = CliRunner().invoke(
            app,
            ["probe", "--model", MODEL, "--providers", "siliconflow/int4,gone", "--base-url", url,
             "--json", str(out), "--tokenizer", str(kimi_dir)],
            env={"OPENROUTER_API_KEY": FAKE_KEY, "COLUMNS": "200"},
        )
    assert res.exit_code == 0, res.output
    assert "siliconflow/int4" in res.output and "none" in res.output
    text = " ".join(res.output.split())  # rich wraps the caption
    assert "answered: probe prompts that got a completion back (after up to 3 tries each; waits, Retry-After " \
           "included, capped at 8 s), good or not." in text
    assert re.search(r"│ siliconflow/int4 +│ yes +│ 3/3 +│", res.output) and "answered" in res.output
    data = json.loads(out.read_text(encoding="utf-8"))
    assert [p["provider"] for p in data["providers"]] == ["siliconflow/int4", "gone"]
    assert data["providers"][0]["usage_parity"] == "3/3" and data["providers"][1]["available"] is False
    assert len(data["providers"][0]["calls"]) == 3
    assert FAKE_KEY not in res.output and FAKE_KEY not in out.read_text(encoding="utf-8")


def test_probe_refuses_a_base_url_without_scheme(kimi_dir):
    res = CliRunner().invoke(app, ["probe", "--model", MODEL, "--providers", "a", "--base-url", "openrouter.ai/api/v1",
                                   "--tokenizer", str(kimi_dir)], env={"OPENROUTER_API_KEY": FAKE_KEY})
    assert res.exit_code == 2 and "needs http:// or https://" in res.output and "Traceback" not in res.output

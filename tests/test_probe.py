"""``tokenbridge probe`` against emulator providers with known quirks."""

from __future__ import annotations

import contextlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from tokenbridge.cli import app
from tokenbridge.emulator import EmulatorConfig, ProviderConfig, ProviderQuirks, running_emulator
from tokenbridge.generate import probe
from tokenbridge.traits import load_provider_profile

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


def test_probe_refuses_a_key_that_cannot_be_sent_before_any_probe(kimi_dir):
    """As generate does: one line naming the variable, never the key, exit 2, and no
    request (the base URL is a closed loopback port: a sent probe would fail differently)."""
    key = "sk-or-v1-0123456789abcdef\r\nX-Injected: 1"
    res = CliRunner().invoke(app, ["probe", "--model", MODEL, "--providers", "a", "--base-url", "http://127.0.0.1:9/v1",
                                   "--tokenizer", str(kimi_dir), "--api-key-env", "TB_PROBE_KEY"],
                             env={"TB_PROBE_KEY": key})
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == ["error: the API key in $TB_PROBE_KEY holds a control character "
                                               "(U+000D at character 25): it cannot be sent in an HTTP header"]
    assert "0123456789" not in res.output


def test_probe_refuses_a_key_given_as_api_key_env_without_showing_it(kimi_dir):
    key = "sk-or-v1-" + "5f0c" * 16
    res = CliRunner().invoke(app, ["probe", "--model", MODEL, "--providers", "a", "--base-url", "http://127.0.0.1:9/v1",
                                   "--tokenizer", str(kimi_dir), "--api-key-env", key], env={})
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        "error: --api-key-env: looks like an API key (not shown here): give the NAME of the environment variable that "
        "holds the key (letters, digits and '_', not starting with a digit, e.g. OPENROUTER_API_KEY), never the key "
        "itself, and put the key in that variable"]
    assert "5f0c5f0c" not in res.output


def test_probe_refuses_plain_http_to_another_host_before_any_probe(kimi_dir):
    res = CliRunner().invoke(app, ["probe", "--model", MODEL, "--providers", "a", "--base-url",
                                   "http://openrouter.ai/api/v1", "--tokenizer", str(kimi_dir)],
                             env={"OPENROUTER_API_KEY": FAKE_KEY})
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        "error: --base-url is plain http:// to openrouter.ai, which is not this machine: the API key would cross the "
        "network unencrypted; use https://, or set allow_plain_http = true (--allow-plain-http) for a server on a "
        "network you trust"]


def test_a_probe_that_reaches_no_provider_says_so_and_knows_no_edits(tmp_path, kimi_dir):
    """A closed port: every call a connection error. The table said "available yes" and
    "text edits none", the JSON the same (a profile then read as "no edits"), exit 0."""
    out = tmp_path / "probe.json"
    res = CliRunner().invoke(app, ["probe", "--model", MODEL, "--providers", "a/fp8", "--base-url",
                                   "http://127.0.0.1:9/v1", "--json", str(out), "--tokenizer", str(kimi_dir)],
                             env={"OPENROUTER_API_KEY": FAKE_KEY, "COLUMNS": "200"})
    assert res.exit_code == 1, res.output
    assert re.search(r"│ a/fp8 +│ unknown \(not reached\) +│ 0/3 +│", res.output), res.output
    assert "unknown (no echo answered)" in res.output
    assert res.output.strip().splitlines()[-1] == ("probe: 1 of 1 provider(s) answered no probe prompt, so nothing "
                                                   "is known of them: a/fp8 (their errors are in --json)")
    data = json.loads(out.read_text(encoding="utf-8"))["providers"][0]
    assert data["available"] is None and data["profile"]["text_edits"] is None
    assert data["calls"][0]["error"]
    assert load_provider_profile(out) == {"a/fp8": ()}  # read back: no edit known, as without a profile


# --- echo tests: the provider profile ---------------------------------------------------


def _echo_config() -> EmulatorConfig:
    return EmulatorConfig(
        min_tokens=20,
        max_tokens=200,
        providers=(
            ProviderConfig("exact/fp8"),
            ProviderConfig("nfc/fp8", quirks=ProviderQuirks(unicode_nfc=1.0)),
            ProviderConfig("nfkc/fp8", quirks=ProviderQuirks(unicode_nfkc=1.0)),
            ProviderConfig("crlf/fp8", quirks=ProviderQuirks(crlf_to_lf=1.0)),
            ProviderConfig("strip/fp8", quirks=ProviderQuirks(strip_whitespace=1.0)),
            ProviderConfig("vllm/fp8", engine="vllm"),
        ),
    )


def test_echo_tests_reveal_each_text_edit(kimi):
    names = ["exact/fp8", "nfc/fp8", "nfkc/fp8", "crlf/fp8", "strip/fp8", "vllm/fp8"]
    with running_emulator(_echo_config(), tokenizer=kimi) as url:
        reports = probe(model=MODEL, providers=names, base_url=url, key=None, tokenizer=kimi)
    got = {r.provider: r.profile() for r in reports}
    assert {p: g["text_edits"] for p, g in got.items()} == {
        "exact/fp8": [],
        "nfc/fp8": ["nfc"],
        "nfkc/fp8": ["nfc", "nfkc"],  # NFKC composes the decomposed accents too
        "crlf/fp8": ["crlf_to_lf"],
        "strip/fp8": ["strip"],
        "vllm/fp8": ["marker_spaces"],
    }
    assert got["exact/fp8"]["echo"] == {"decomposed": "kept", "compatibility": "kept", "crlf": "kept",
                                        "edges": "kept"}
    assert got["nfkc/fp8"]["echo"]["compatibility"] == "nfkc" and got["nfc/fp8"]["echo"]["compatibility"] == "kept"
    assert got["vllm/fp8"]["edits_invisibly"] == [] and got["crlf/fp8"]["edits_invisibly"] == ["crlf_to_lf"]
    # the emulator honours logprobs and return_token_ids on every provider
    assert all(g["logprobs"] is True and g["token_ids"] is True for g in got.values())


def test_classify_echo_says_unclear_when_the_model_paraphrases():
    from tokenbridge.generate.probe import classify_echo

    assert classify_echo("one\r\ntwo", "one\ntwo") == ("edited", "crlf_to_lf")
    assert classify_echo("one\r\ntwo", "Sure! one two") == ("unclear", None)
    assert classify_echo("x", None) == ("unclear", None)


def test_probe_markers_match_the_emulator_echo():
    import importlib

    from tokenbridge.emulator import synthetic

    probe_mod = importlib.import_module("tokenbridge.generate.probe")

    assert (probe_mod.ECHO_BEGIN, probe_mod.ECHO_END) == (synthetic.ECHO_BEGIN, synthetic.ECHO_END)


def test_probe_json_holds_the_profile(tmp_path, kimi, kimi_dir):
    with running_emulator(_echo_config(), tokenizer=kimi) as url:
        out = tmp_path / "probe.json"
        res = CliRunner().invoke(app, ["probe", "--model", MODEL, "--providers", "crlf/fp8", "--base-url", url,
                                       "--json", str(out), "--tokenizer", str(kimi_dir)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "provider profile (echo tests)" in res.output and "crlf_to_lf" in res.output
    prof = json.loads(out.read_text(encoding="utf-8"))["providers"][0]["profile"]
    assert prof["text_edits"] == ["crlf_to_lf"] and prof["echo"]["crlf"] == "crlf_to_lf"


def _inspected(kimi, response: dict, prompt: str = "plain"):
    import importlib

    from tokenbridge.chat import resolve_dialect

    module = importlib.import_module("tokenbridge.generate.probe")  # the package exports the function as `probe`
    call = module.ProbeCall("P", prompt, available=True, ok=True)
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    module._inspect(call, request, response, kimi, resolve_dialect(kimi))
    return call


def test_a_response_reconstruct_refuses_is_a_probe_finding(kimi):
    """A malformed choice is reported in the table (the record error's field and message), not raised."""
    call = _inspected(kimi, {"choices": [{"index": 0, "message": {"role": "assistant", "content": 5}}]})
    assert call.findings == ["reconstruct_failed: RecordError: response.choices[0].message.content: "
                             "must be a string, a list of parts or null"]


def test_a_bug_under_the_probe_is_not_reported_as_a_finding(kimi, monkeypatch):
    from tokenbridge import reconstruct

    def broken(*args, **kwargs):
        raise AttributeError("a bug in reconstruct")

    monkeypatch.setattr(reconstruct, "reconstruct_record", broken)
    with pytest.raises(AttributeError, match="a bug in reconstruct"):
        _inspected(kimi, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"}}]})


# --- every field of an answer is the API's: a bad one is that call's result, not a crash -------

_ODD_MESSAGES = {  # what a cold tester's server sent: each crashed the probe (exit 8), losing every result
    "reasoning_object": ({"role": "assistant", "content": "hi", "reasoning": {"text": "thinking"}},
                         "response.choices[0].message.reasoning: must be a string or null"),
    "content_number": ({"role": "assistant", "content": 5},
                       "response.choices[0].message.content: must be a string, a list of parts or null"),
    "message_string": ("hello", "response.choices[0].message: missing or not an object"),
}


def _answer(message, provider: str = "P") -> dict:
    return {"id": "gen-1", "provider": provider, "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


@pytest.mark.parametrize("odd", sorted(_ODD_MESSAGES))
@pytest.mark.parametrize("prompt", ["greeting", "tool_call"])
def test_an_answer_out_of_shape_is_reported_as_reconstruct_would(kimi, odd, prompt):
    message, why = _ODD_MESSAGES[odd]
    call = _inspected(kimi, _answer(message), prompt)
    assert call.findings == [f"reconstruct_failed: RecordError: {why}"]
    assert (call.reasoning_present, call.tool_markers, call.prompt_tokens) == (None, None, None)


def test_fields_of_another_type_are_read_as_absent_and_list_content_as_its_text(kimi):
    body = _answer({"role": "assistant", "content": [{"type": "text", "text": "Sure. <|tool_calls_section_begin|>"}],
                    "reasoning_details": [{"type": "reasoning.text", "text": "Use the tool.", "index": 0}]})
    body.update(provider={"name": "X"}, usage={"prompt_tokens": "7", "completion_tokens": -1, "cost": "free"})
    call = _inspected(kimi, body, "tool_call")
    assert (call.served_by, call.cost, call.prompt_tokens[1], call.completion_tokens[1]) == (None, None, None, None)
    assert (call.tool_markers, call.reasoning_present) == ("raw", True)  # what reconstruct reads, markers and all


@contextlib.contextmanager
def _server(reply):
    """A chat-completions server on a loopback port: ``reply(provider)`` -> (headers, body bytes)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            headers, body = reply(request["provider"]["only"][0])
            self.send_response(200)
            for name, value in {"Content-Type": "application/json", "Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            with contextlib.suppress(OSError):  # a client that stopped reading
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _probe_cli(url: str, providers: str, out, kimi_dir, *extra: str):
    return CliRunner().invoke(app, ["probe", "--model", MODEL, "--providers", providers, "--base-url", url,
                                    "--json", str(out), "--tokenizer", str(kimi_dir), *extra],
                              env={"OPENROUTER_API_KEY": FAKE_KEY, "COLUMNS": "200"})


@pytest.mark.parametrize("odd", sorted(_ODD_MESSAGES))
def test_one_providers_odd_answers_leave_the_others_results_printed_and_saved(tmp_path, kimi_dir, odd):
    def reply(provider):
        message = _ODD_MESSAGES[odd][0] if provider == "odd/fp8" else {"role": "assistant", "content": "Hello!",
                                                                         "reasoning": "Greet back."}
        return {}, json.dumps(_answer(message, provider)).encode()

    out = tmp_path / "probe.json"
    with _server(reply) as url:
        res = _probe_cli(url, "good/fp8,odd/fp8", out, kimi_dir)
    assert res.exit_code == 1, res.output  # the odd one answered nothing understood: said, as for a silent one
    assert "Traceback" not in res.output and re.search(r"│ good/fp8 +│ yes +│ 3/3 +│", res.output)
    assert re.search(r"│ odd/fp8 +│ yes +│ 0/3 +│", res.output)
    good, bad = json.loads(out.read_text(encoding="utf-8"))["providers"]
    assert good["ok"] == "3/3" and good["reasoning_present"] == "3/3"
    assert bad["errors"] == [f"bad_choices: {_ODD_MESSAGES[odd][1]}"]


# --- a body is read only up to max_response_bytes, as generate reads it ---------------------


def _gzip_bomb(mib: int) -> bytes:
    """A gzip body of a few KiB per MiB it inflates to: ``{"a": "000…``, never closed."""
    import zlib

    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    return z.compress(b'{"a": "') + b"".join(z.compress(b"0" * (1 << 20)) for _ in range(mib)) + z.flush()


def test_a_body_past_max_response_bytes_is_refused_while_read_in_bounded_memory(kimi):
    import tracemalloc

    from tokenbridge.generate.settings import MAX_RESPONSE_BYTES, GenerateSettings

    bomb = _gzip_bomb(48)
    with _server(lambda provider: ({"Content-Encoding": "gzip"}, bomb)) as url:
        tracemalloc.start()
        try:
            reports = probe(model=MODEL, providers=["bomb/fp8"], base_url=url, key=None, tokenizer=kimi,
                            max_response_bytes=1 << 20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 40 << 20, f"peak {peak >> 20} MiB: the bodies were read whole"  # 8 calls at once, 48 MiB each
    (rep,) = reports
    assert rep.summary()["errors"] == ["response_too_large: response passed max_response_bytes=1048576 while being read"]
    assert [c.http_status for c in rep.calls] == [200] * 3 and all(e.verdict == "failed" for e in rep.echoes)
    assert GenerateSettings.__dataclass_fields__["max_response_bytes"].default == MAX_RESPONSE_BYTES  # one default


def test_probe_cli_takes_max_response_bytes(tmp_path, kimi_dir):
    body = json.dumps(_answer({"role": "assistant", "content": "x" * 4000, "reasoning": "Greet."})).encode()
    out = tmp_path / "probe.json"
    with _server(lambda provider: ({}, body)) as url:
        res = _probe_cli(url, "big/fp8", out, kimi_dir, "--max-response-bytes", "2048")
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    (big,) = json.loads(out.read_text(encoding="utf-8"))["providers"]
    assert big["errors"] == [f"response_too_large: response of {len(body)} bytes is over max_response_bytes=2048"]


@pytest.mark.parametrize(("choice", "has_ids"), [
    ({"token_ids": [1, 2]}, True),  # vLLM's name
    ({"response_token_ids": [1, 2], "prompt_token_ids": [5]}, True),  # SGLang's (return_token_ids, served whole)
    ({"prompt_token_ids": [5]}, False),
    ({}, False),
])
def test_probe_sees_token_ids_under_either_engines_name(choice, has_ids):
    import asyncio
    import importlib
    from types import SimpleNamespace

    probe_module = importlib.import_module("tokenbridge.generate.probe")  # the package exports the function `probe`

    class _Sends:
        async def send(self, request):
            return SimpleNamespace(kind="ok"), {"choices": [{"index": 0, "logprobs": None, **choice}]}, None, None

    got = asyncio.run(probe_module._evidence(_Sends(), provider="p", request={}))
    assert got == ("p", False, has_ids)

"""tokenbridge run: every stage on the built-in emulator, offline; reruns skip what is done.

The first run's emulator has three providers whose quirks fire always or never, so what
the gate must say about each sample follows from the provider that served it and how
the sample ended (:func:`_expected`), and every row's ids are held against the
emulator's native ids.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    EXAMPLE_EMULATOR,
    LEAKY_EMULATOR,
    MODEL,
    read_jsonl,
    write_run_config,
)
from typer.testing import CliRunner

from tokenbridge.cli import app
from tokenbridge.pipeline import PipelineError, load_run_config, run_pipeline

#: Rates of 1.0 or 0, so each provider's effect is certain. Routing spreads the samples
#: over the three by their sample key (seed 0), the way OpenRouter load-balances.
PINNED_EMULATOR = f"""
seed = 0
models = ["{MODEL}"]

[[providers]]            # exact text: ok, or flagged `truncated` when max_tokens cut it
name = "clean/fp8"
quantization = "fp8"

[[providers]]            # "<|im_end|>" after every completed answer: rejected `eos_in_text`
name = "leaky/int4"
quantization = "int4"
[providers.quirks]
end_marker_leak = 1.0

[[providers]]            # drops the reasoning field: rejected `reasoning_missing`, its tokens lost
name = "dropper/int4"
quantization = "int4"
[providers.quirks]
drop_reasoning = 1.0
"""
#: What the gate also finds on a dropped-reasoning sample: the ids it can rebuild fall
#: short of the native ones and of usage's counts.
_DROPPED = ["reasoning_missing", "usage_completion_mismatch", "native_mismatch", "usage_reasoning_mismatch"]
THINK_END = 163607  # "</think>" in the Kimi K2.5 vocabulary
STAGES = {"generate": "ran", "reconstruct": "ran", "export:specforge": "ran", "export:speculators": "ran",
          "export:parquet": "ran", "export:conversations": "ran", "vocab": "ran", "report": "ran"}


def _expected(provider: str, finish_reason: str) -> tuple[str, list[str]]:
    """(status, finding codes) the gate owes a sample, from its provider's pinned quirk."""
    cut = finish_reason == "length"
    if provider == "dropper/int4":
        return "rejected", (["truncated"] if cut else []) + _DROPPED
    if cut:  # nothing is leaked after a cut: the ids are exact up to it
        return "flagged", ["truncated"]
    return ("rejected", ["eos_in_text"]) if provider == "leaky/int4" else ("ok", [])


@dataclass(frozen=True)
class FirstRun:
    cfg: Path
    out: Path
    statuses: dict[str, str]
    lines: list[str]
    exchanges: list[dict[str, Any]]
    rows: list[dict[str, Any]]


@pytest.fixture(scope="module")
def first(kimi_dir, tmp_path_factory) -> FirstRun:
    """One run of every stage from nothing on the pinned emulator (the tests after it may
    rerun it, and leave it complete)."""
    root = tmp_path_factory.mktemp("pipeline")
    emulator = root / "pinned.toml"
    emulator.write_text(PINNED_EMULATOR, encoding="utf-8")
    cfg = write_run_config(root, kimi_dir, emulator=emulator)
    lines: list[str] = []
    statuses = {r.name: r.status for r in run_pipeline(load_run_config(cfg), echo=lines.append)}
    out = root / "out"
    return FirstRun(cfg, out, statuses, lines, read_jsonl(out / "exchanges.jsonl"),
                    read_jsonl(out / "reconstructed.jsonl"))


def test_the_first_run_runs_every_stage(first):
    assert first.statuses == STAGES
    assert (first.out / "report" / "report.html").is_file() and (first.out / "vocab" / "d2t.npy").is_file()


def test_the_first_run_keeps_every_sample_once_in_order(first):
    ids = [f"chat-{i:03d}" for i in range(1, 13)] + [f"plain-{i:03d}" for i in range(1, 5)]
    assert [e["id"] for e in first.exchanges] == ids
    assert [r["id"] for r in first.rows] == ids


def test_each_row_gets_the_status_and_findings_its_provider_implies(first):
    got = [(r["id"], r["status"], [f["code"] for f in r["findings"]]) for r in first.rows]
    want = [(r["id"], *_expected(r["provider"], r["finish_reason"])) for r in first.rows]
    assert got == want
    assert {r["provider"] for r in first.rows} == {"clean/fp8", "leaky/int4", "dropper/int4"}


def test_exactly_the_clean_providers_completed_samples_are_ok(first):
    ok = [r["id"] for r in first.rows if r["status"] == "ok"]
    assert ok == [r["id"] for r in first.rows if r["provider"] == "clean/fp8" and r["finish_reason"] == "stop"]
    # seed 0 routes chat-004, -005, -006 and -012 to clean/fp8; max_tokens 1024 cuts chat-006
    assert ok == ["chat-004", "chat-005", "chat-012"]


def test_every_prompt_is_the_emulators_own(first):
    assert [r["prompt_ids"] for r in first.rows] == [e["response"]["prompt_token_ids"] for e in first.exchanges]


def test_every_completion_is_the_native_ids_or_exactly_what_the_provider_dropped(first):
    for row, ex in zip(first.rows, first.exchanges, strict=True):
        native = ex["response"]["choices"][0]["token_ids"]
        if row["provider"] == "dropper/int4":  # the reasoning is gone; "</think>" onwards is rebuilt exactly
            assert row["completion_ids"] == native[native.index(THINK_END):], row["id"]
        else:  # a trailing leak is taken as the end token, never doubled
            assert row["completion_ids"] == native, row["id"]
        assert row["input_ids"] == row["prompt_ids"] + row["completion_ids"], row["id"]


def test_the_first_run_says_what_each_stage_did(first):
    summary = json.loads((first.out / "generate.json").read_text())
    spent, requests = summary["spent_total"], summary["requests"]
    assert requests == 16  # no provider has faults: one request a sample
    assert [x for x in first.lines if x.startswith("generate: 16")] == [
        f"generate: 16 samples: 16 done now; {requests} requests, ${spent:.4f} this run, ${spent:.4f} in all."]
    assert f"reconstruct: ran → {first.out / 'reconstructed.jsonl'}: 3 ok, 3 flagged, 10 rejected" in first.lines


def test_a_rerun_skips_every_stage_and_keeps_the_bytes(first):
    before = (first.out / "reconstructed.jsonl").read_bytes()
    lines: list[str] = []
    again = {r.name: r.status for r in run_pipeline(load_run_config(first.cfg), echo=lines.append)}
    assert again == {**{name: "skipped" for name in STAGES}, "generate": "ran"}  # generate runs: it sends nothing
    assert (first.out / "reconstructed.jsonl").read_bytes() == before
    spent = json.loads((first.out / "generate.json").read_text())["spent_total"]
    assert [x for x in lines if x.startswith("generate: 16")] == [
        f"generate: 16 samples: 16 already done; nothing sent, ${spent:.4f} spent in all."]


def test_a_removed_export_is_the_only_stage_rerun(first):
    shutil.rmtree(first.out / "export" / "parquet")
    again = {r.name: r.status for r in run_pipeline(load_run_config(first.cfg), echo=lambda _: None)}
    assert {k for k, v in again.items() if v == "ran"} == {"generate", "export:parquet"}
    assert (first.out / "export" / "parquet").is_dir()


def test_a_policy_change_reruns_reconstruct(tmp_path, kimi_dir):
    cfg = load_run_config(write_run_config(tmp_path, kimi_dir))
    run_pipeline(cfg, echo=lambda _: None)
    strict = load_run_config(write_run_config(tmp_path, kimi_dir, '[reconstruct]\nseverity = { truncated = "error" }\n'))
    res = {r.name: r.status for r in run_pipeline(strict, echo=lambda _: None)}
    assert res["reconstruct"] == "ran"
    cut = [r for r in read_jsonl(tmp_path / "out" / "reconstructed.jsonl") if r["finish_reason"] == "length"]
    assert cut and all(r["status"] == "rejected" for r in cut)


@pytest.mark.parametrize(("text", "message"), [
    ("[run]\ntokenizer = 'x'\n[exprot]\n", r"bad.toml:3: exprot: unknown key; did you mean 'export'\?"),
    ("[run]\nout = 'o'\n", r"bad.toml:1: run.tokenizer: missing"),
], ids=["misspelt-section", "no-tokenizer"])
def test_config_errors_name_the_key(tmp_path, monkeypatch, text, message):
    monkeypatch.delenv("TOKENBRIDGE_TOKENIZER", raising=False)
    bad = tmp_path / "bad.toml"
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(PipelineError, match=message):
        load_run_config(bad)


def test_an_unknown_builtin_dataset_names_its_entry(tmp_path, kimi_dir):
    text = write_run_config(tmp_path, kimi_dir).read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("builtin:prompts/plain.jsonl", "builtin:prompts/nope.jsonl"), encoding="utf-8")
    with pytest.raises(PipelineError, match=r"generate.datasets\[1\].path: no such built-in data 'builtin:prompts/nope.jsonl'"):
        load_run_config(bad)


def test_cli_run_prints_where_results_are(tmp_path, kimi_dir):
    res = CliRunner().invoke(app, ["run", str(write_run_config(tmp_path, kimi_dir))])
    assert res.exit_code == 0, res.output
    assert f"results in {tmp_path / 'out'}" in res.output and "report.html" in res.output


def _without_emulator_config(tmp_path: Path, kimi_dir: Path, more: str = "") -> Path:
    text = write_run_config(tmp_path, kimi_dir).read_text()
    path = tmp_path / "nocfg.toml"
    path.write_text(text.replace(f'config = "{EXAMPLE_EMULATOR}"\n', "").replace("latency_ms = 0", "latency_ms = 0" + more),
                    encoding="utf-8")
    return path


def test_an_emulator_section_without_config_uses_the_defaults(tmp_path, kimi_dir):
    results = {r.name: r.status for r in run_pipeline(load_run_config(_without_emulator_config(tmp_path, kimi_dir)),
                                                      echo=lambda _: None)}
    assert results == STAGES


def test_an_emulator_section_checks_its_keys(tmp_path, kimi_dir):
    path = _without_emulator_config(tmp_path, kimi_dir, "\nlatencyms = 3")
    with pytest.raises(PipelineError, match=r"nocfg.toml:8: emulator.latencyms: unknown key; did you mean 'latency_ms'\?"):
        run_pipeline(load_run_config(path), echo=lambda _: None)
    assert not (tmp_path / "out").exists()  # refused before anything was sent or written


def test_no_usable_rows_skips_exports_but_still_reports(tmp_path, kimi_dir):
    emu = tmp_path / "leaky.toml"
    emu.write_text(LEAKY_EMULATOR, encoding="utf-8")
    path = write_run_config(tmp_path, kimi_dir, emulator=emu)
    results = {r.name: r.status for r in run_pipeline(load_run_config(path), echo=lambda _: None)}
    rows = read_jsonl(tmp_path / "out" / "reconstructed.jsonl")
    # every completed sample leaked its end marker; the others were cut by max_tokens (flagged, not exported)
    assert [(r["status"], [f["code"] for f in r["findings"]]) for r in rows] == [
        ("flagged", ["truncated"]) if r["finish_reason"] == "length" else ("rejected", ["eos_in_text"]) for r in rows]
    assert len(rows) == 16
    assert results["export:specforge"] == "empty" and results["vocab"] == "empty" and results["report"] == "ran"


def test_cli_run_bad_generate_key_is_one_line(tmp_path, kimi_dir):
    text = write_run_config(tmp_path, kimi_dir).read_text().replace("concurrency = 8", "concurency = 8")
    path = tmp_path / "typo.toml"
    path.write_text(text, encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 2
    assert res.output.splitlines() == [f"error: {path}:12: generate.concurency: unknown key; did you mean 'concurrency'?"]


def test_tokenizer_files_are_part_of_the_fingerprint(tmp_path, kimi_dir):
    from tokenbridge.pipeline import _tokenizer_identity

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tiktoken.model").symlink_to(kimi_dir / "tiktoken.model")
    (folder / "tokenizer_config.json").write_text((kimi_dir / "tokenizer_config.json").read_text())
    before = _tokenizer_identity(str(folder))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert _tokenizer_identity(str(folder)) != before


def test_every_file_the_loader_reads_is_part_of_the_fingerprint_and_no_other(tmp_path):
    """gpt-oss's ranks are ``o200k_base.tiktoken``: a changed rank file kept a stale
    reconstructed.jsonl (a tester swapped two ranks; the rerun skipped reconstruct). Files the
    loader never reads (weights, a README) change nothing."""
    from tokenbridge.pipeline import _tokenizer_identity
    from tokenbridge.tokenizer import FOLDER_FILES

    folder = tmp_path / "tok"
    folder.mkdir()
    names = ["o200k_base.tiktoken", "tokenizer.json", "tokenizer_config.json", "tiktoken.model", "config.json",
             "chat_template.jinja", "chat_template.json", "tokenization_kimi.py"]
    assert len(FOLDER_FILES) == len(names)
    for name in names:
        (folder / name).write_text("a")
    seen = {_tokenizer_identity(str(folder))}
    for name in names:
        (folder / name).write_text("b")
        seen.add(_tokenizer_identity(str(folder)))
    assert len(seen) == len(names) + 1
    for other in ("model-00001-of-00002.safetensors", "README.md", "special_tokens_map.json"):
        (folder / other).write_text("x")
    assert _tokenizer_identity(str(folder)) in seen


def test_a_config_in_a_subfolder_reads_its_own_dataset_not_a_double_joined_one(tmp_path, kimi_dir, monkeypatch):
    """``run sub/run.toml`` from ``sub``'s parent with ``path = "data.jsonl"``: the path is
    ``sub/data.jsonl``, joined once. Joined twice it was ``sub/sub/data.jsonl``: "does not
    exist", or, as here, a decoy sitting there was sent instead, silently."""
    sub = tmp_path / "sub"
    (sub / "sub").mkdir(parents=True)
    (sub / "data.jsonl").write_text('{"id": "real", "prompt": "q-real"}\n', encoding="utf-8")
    (sub / "sub" / "data.jsonl").write_text('{"id": "decoy", "prompt": "q-decoy"}\n', encoding="utf-8")
    (sub / "run.toml").write_text(
        f'[run]\nout = "out"\ntokenizer = "{kimi_dir}"\n[emulator]\nlatency_ms = 0\n'
        f'[generate]\nmodel = "{MODEL}"\nmax_tokens = 32\nprogress = "none"\n'
        'datasets = [{ name = "p", path = "data.jsonl" }]\n[export]\nformats = ["parquet"]\n[report]\nenabled = false\n',
        encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["run", "sub/run.toml"])
    assert res.exit_code == 0, res.output
    assert [e["id"] for e in read_jsonl(sub / "out" / "exchanges.jsonl")] == ["p-real"]
    assert read_jsonl(sub / "out" / "exchanges.jsonl")[0]["request"]["messages"][-1]["content"] == "q-real"

"""What reconstruct does with what goes wrong: bad input is a bad line (file, line, field)
and every other record is still written; a bug is an internal error with its traceback.
Counts from the API are counts only when they are non-negative integers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenbridge.checks import Policy
from tokenbridge.exit_codes import ExitCode
from tokenbridge.reconstruct import reconstruct_file, reconstruct_record

from conftest import KIMI_DIR, ROOT

TOKENIZERS = KIMI_DIR.parent
USER = {"role": "user", "content": "What is 2 + 2?"}


def _record(rid: str, messages: list[dict], **response: object) -> dict:
    message = {"role": "assistant", "reasoning_content": "Add them.", "content": "4"}
    body = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}], **response}
    return {"id": rid, "request": {"messages": messages, "reasoning": {"enabled": True}}, "response": body}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_record_the_chat_template_refuses_is_a_bad_line(tmp_path):
    """DeepSeek V3.2's renderer refuses a role it does not render (TemplateError): that
    record is a bad line naming the error, the others are written and gated."""
    src = _write(tmp_path / "in.jsonl", [
        _record("a", [USER]),
        _record("b", [{"role": "developer", "content": "x"}, USER]),
        _record("c", [USER]),
    ])
    summary = reconstruct_file(src, tmp_path / "out.jsonl", TOKENIZERS / "deepseek-v3.2", workers=1)
    assert [(b.line, b.field) for b in summary.bad_lines] == [(2, "<record>")]
    assert summary.bad_lines[0].message.startswith("TemplateError: ") and "developer" in summary.bad_lines[0].message
    rows = _rows(tmp_path / "out.jsonl")
    assert [r["id"] for r in rows] == ["a", "c"]
    assert [r["status"] for r in rows] == ["flagged", "flagged"]  # usage_missing only: the ids are exact
    assert [[f["code"] for f in r["findings"]] for r in rows] == [["usage_missing"], ["usage_missing"]]


def test_text_a_tokenizers_folder_cannot_encode_is_a_bad_line(tmp_path):
    """``tokenizers`` refuses lone surrogates (tiktoken replaces them and the gate flags the
    round trip): EncodeError, a bad line, not a crash and not a silent row."""
    lone = '{"id": "s", "request": {"messages": [{"role": "user", "content": "a\\ud800b"}]}, ' \
           '"response": {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}}\n'
    good = json.dumps(_record("g", [USER])) + "\n"
    src = tmp_path / "in.jsonl"
    src.write_text(good + lone + good.replace('"g"', '"h"'), encoding="utf-8")
    summary = reconstruct_file(src, tmp_path / "out.jsonl", TOKENIZERS / "qwen3", workers=1)
    assert [(b.line, b.field) for b in summary.bad_lines] == [(2, "<record>")]
    assert summary.bad_lines[0].message.startswith("EncodeError: text holds a lone surrogate (U+D800 at char ")
    assert [r["id"] for r in _rows(tmp_path / "out.jsonl")] == ["g", "h"]


class _BuggyPolicy(Policy):
    """A policy whose lookup fails: a bug inside the gate, not bad input. It travels to
    pool workers with the rest of their setup, under fork and spawn alike."""

    def severity(self, code: str) -> str:
        raise ZeroDivisionError("a bug in a check")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bug_is_an_internal_error_with_its_traceback_not_a_bad_line(tmp_path, workers):
    """Anything but bad input surfaces: the exception itself (through the pool, with the
    worker's traceback), a note naming the line, nothing published, no spool left."""
    src = _write(tmp_path / "in.jsonl", [_record(f"r{i}", [USER]) for i in range(3)])
    dst = tmp_path / "out.jsonl"
    with pytest.raises(ZeroDivisionError, match="a bug in a check") as info:
        reconstruct_file(src, dst, KIMI_DIR, policy=_BuggyPolicy(), workers=workers)
    assert info.value.__notes__ == [
        "while reconstructing the record on line 1 (an internal error, not bad input)"]
    if workers > 1:  # the worker's own frames come back with it
        assert "in severity" in str(info.value.__cause__) and "run_checks" in str(info.value.__cause__)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def _reconstruct_cli_with_a_bug(tmp_path, raise_stmt: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``tokenbridge reconstruct`` in a fresh interpreter, its gate patched to run
    ``raise_stmt`` (a bug, not bad input)."""
    src = _write(tmp_path / "in.jsonl", [_record("r", [USER])])
    code = (
        "import os, sys\n"
        "import tokenbridge.reconstruct as r\n"
        "def boom(*a, **k):\n"
        f"    {raise_stmt}\n"
        "r.run_checks = boom\n"
        "from tokenbridge.cli import main\n"
        f"sys.argv = ['tokenbridge', 'reconstruct', {str(src)!r}, '-o', {str(tmp_path / 'out.jsonl')!r}, "
        f"'--tokenizer', {str(KIMI_DIR)!r}]\n"
        "main()\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", **env})


def test_cli_exits_non_zero_with_the_traceback_on_a_bug(tmp_path):
    proc = _reconstruct_cli_with_a_bug(tmp_path, "raise ZeroDivisionError('a bug in a check')", {"COLUMNS": "200"})
    assert proc.returncode == ExitCode.INTERNAL == 8
    assert "ZeroDivisionError" in proc.stderr and "a bug in a check" in proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().endswith("error: internal error (a bug in tokenbridge, not in your data): the traceback is above")
    assert "bad record" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("bad", [-1, -4096, True, 3.0, "12"])
def test_usage_counts_must_be_non_negative_integers(kimi, bad):
    """A negative (or non-integer) usage count is no count: ``usage_missing`` says it was
    not checked, never a mismatch against a number the API could not have meant."""
    rec = _record("u", [USER], usage={"prompt_tokens": bad, "completion_tokens": bad})
    rec["request"]["model"] = "moonshotai/kimi-k2.5"
    row, = reconstruct_record(rec, kimi)
    assert [f["code"] for f in row["findings"]] == ["usage_missing"]
    shown = repr(bad)
    assert row["findings"][0]["message"] == (f"usage.prompt_tokens is {shown}, not a count; usage.completion_tokens "
                                             f"is {shown}, not a count: that count is not checked")
    assert row["status"] == "flagged"


def test_a_negative_choice_index_is_not_an_index(kimi):
    rec = _record("i", [USER])
    rec["response"]["choices"].append(dict(rec["response"]["choices"][0], index=-1))
    rec["response"]["choices"][0]["index"] = 5
    rows = reconstruct_record(rec, kimi)
    assert [r["choice"] for r in rows] == [5, 1]  # -1 falls back to the position


def test_a_bugs_traceback_never_shows_a_secret_from_the_environment(tmp_path):
    """The traceback main() prints is scrubbed: a bug whose message carries the API key
    shows *** instead."""
    key = "sk-or-v1-" + "5e" * 16
    proc = _reconstruct_cli_with_a_bug(tmp_path, "raise RuntimeError('bug holding ' + os.environ['OPENROUTER_API_KEY'])",
                                       {"OPENROUTER_API_KEY": key})
    assert proc.returncode == ExitCode.INTERNAL
    assert "bug holding ***" in proc.stderr
    assert key not in proc.stderr + proc.stdout and key[9:] not in proc.stderr


def test_a_bugs_traceback_masks_secrets_from_min_masked_characters_as_scrub_does(tmp_path):
    """The traceback's scrubber and scrub() share one threshold: a secret is masked whole and
    where a bug's message kept MIN_MASKED of its characters; a value shorter than that is a
    placeholder to both (the scrubber once asked for 8 characters, which scrub ignored)."""
    from tokenbridge.generate.secrets import MIN_MASKED

    secret, short = "s3cr3t-" + "9" * (MIN_MASKED - 3), "p" * (MIN_MASKED - 1)
    raise_stmt = ("s = os.environ['TB_SECRET']; "
                  f"raise RuntimeError(' | '.join([s, 'cut ' + s[:{MIN_MASKED}], os.environ['TB_SHORT_TOKEN']]))")
    proc = _reconstruct_cli_with_a_bug(tmp_path, raise_stmt, {"TB_SECRET": secret, "TB_SHORT_TOKEN": short})
    assert proc.returncode == ExitCode.INTERNAL
    assert f"RuntimeError: *** | cut *** | {short}" in proc.stderr


def test_a_bugs_traceback_never_shows_a_key_read_under_a_name_of_the_users(tmp_path):
    """``--api-key-env`` names the variable: one that says neither KEY nor TOKEN is still
    scrubbed, because the key was read (``read_api_key``) in this process."""
    key = "sk-or-v1-" + "7a" * 16
    raise_stmt = ("from tokenbridge.generate.secrets import read_api_key; "
                  "raise RuntimeError('bug holding ' + read_api_key('ROUTER_CRED').value)")
    proc = _reconstruct_cli_with_a_bug(tmp_path, raise_stmt, {"ROUTER_CRED": key})
    assert proc.returncode == ExitCode.INTERNAL
    assert "bug holding ***" in proc.stderr
    assert key not in proc.stderr + proc.stdout and key[9:] not in proc.stderr


def test_ground_truth_ids_no_tokenizer_has_are_a_bad_line_and_one_this_tokenizer_lacks_rejects_the_row(tmp_path, kimi):
    """A negative or >= 2**32 id (tiktoken's OverflowError: exit 8, nothing written) is a
    malformed id list, a bad line naming the field. An id outside Kimi's vocabulary
    (tiktoken's KeyError) is evidence against the tokenizer: the row is rejected, by
    ``native_mismatch``. The file's other records are written either way."""
    good = _record("a", [USER])
    neg = _record("b", [USER], prompt_token_ids=[-5])
    big = _record("c", [USER])
    big["response"]["choices"][0]["token_ids"] = [2**40]
    oov = _record("d", [USER])
    oov["native_ids"] = {"choices": [[12, kimi.vocab_size]]}
    src = _write(tmp_path / "in.jsonl", [good, neg, big, oov, _record("e", [USER])])
    summary = reconstruct_file(src, tmp_path / "out.jsonl", KIMI_DIR, workers=1)
    assert [(b.line, b.field, b.message) for b in summary.bad_lines] == [
        (2, "response.prompt_token_ids", "item 0 is -5: a token id is an integer from 0 to 4294967295"),
        (3, "response.choices[0].token_ids", "item 0 is 1099511627776: a token id is an integer from 0 to 4294967295"),
    ]
    rows = {r["id"]: r for r in _rows(tmp_path / "out.jsonl")}
    assert list(rows) == ["a", "d", "e"]
    assert rows["d"]["status"] == "rejected"
    assert [(f["code"], f["message"]) for f in rows["d"]["findings"] if f["code"] != "usage_missing"] == [(
        "native_mismatch", "completion: native id 163840 at 1 is no token of this tokenizer (kimi-k2.5, ids 0 to 163839): "
        "the ground truth contradicts the tokenizer")]


def test_cli_names_a_malformed_id_list_and_exits_1_not_8(tmp_path):
    from typer.testing import CliRunner

    from tokenbridge.cli import app

    src = _write(tmp_path / "in.jsonl", [_record("a", [USER]), {**_record("b", [USER]), "native_ids": [1, -1]}])
    result = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(tmp_path / "out.jsonl"), "--tokenizer", str(KIMI_DIR)])
    assert result.exit_code == ExitCode.INCOMPLETE == 1, result.output
    assert f"bad record: {src}:2: native_ids: item 1 is -1: a token id is an integer from 0 to 4294967295" in result.output
    assert [r["id"] for r in _rows(tmp_path / "out.jsonl")] == ["a"]


def test_a_number_longer_than_python_reads_is_a_bad_line(tmp_path):
    """Past 4300 digits ``json.loads`` raises a plain ValueError (orjson refuses it first):
    it was an internal error (exit 8) with nothing written; it is the line's fault."""
    src = tmp_path / "in.jsonl"
    good = json.dumps(_record("a", [USER]))
    src.write_text(good + "\n" + good.replace('"a"', '"b"').replace("{", '{"x": ' + "9" * 5000 + ", ", 1) + "\n",
                   encoding="utf-8")
    summary = reconstruct_file(src, tmp_path / "out.jsonl", KIMI_DIR, workers=1)
    assert [(b.line, b.field, b.message) for b in summary.bad_lines] == [
        (2, "<line>", "not valid JSON (a number of more than 4300 digits)")]
    assert [r["id"] for r in _rows(tmp_path / "out.jsonl")] == ["a"]


def test_a_record_too_large_for_memory_is_a_bad_line_and_the_rest_go_on(tmp_path, monkeypatch):
    """A MemoryError on one record (a 300 MB line under a memory limit) printed a traceback,
    "a bug in tokenbridge", and stopped the run (a cold tester's): the record is a bad line,
    named with its size, and every other record is written."""
    import tokenbridge.reconstruct as R
    from conftest import EXAMPLE_EXCHANGES

    real = R._reconstruct

    def starved(ex, *args, **kwargs):
        if ex.id == "ex-clean":
            raise MemoryError
        return real(ex, *args, **kwargs)

    monkeypatch.setattr(R, "_reconstruct", starved)
    summary = reconstruct_file(EXAMPLE_EXCHANGES, tmp_path / "out.jsonl", KIMI_DIR, workers=1)
    size = len(EXAMPLE_EXCHANGES.read_bytes().splitlines(keepends=True)[0]) / 1e6
    assert [(b.line, b.field, b.message) for b in summary.bad_lines if b.line == 1] == [
        (1, "<record>", f"too large to reconstruct in this process's memory (a line of {size:,.1f} MB: MemoryError)")]
    assert summary.records == 6  # the other six well-formed records; the example's broken line stays bad


def test_out_of_memory_outside_a_record_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import tokenbridge.reconstruct as R
    from conftest import EXAMPLE_EXCHANGES
    from tokenbridge.cli import app

    def starved(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(R, "reconstruct_file", starved)
    res = CliRunner().invoke(app, ["reconstruct", str(EXAMPLE_EXCHANGES), "-o", str(tmp_path / "o.jsonl"),
                                   "-t", str(KIMI_DIR)])
    assert res.exit_code == ExitCode.INCOMPLETE and res.output.splitlines() == [
        "error: out of memory; nothing partial was kept: give the command more memory, or fewer --workers (a single "
        "record too large for it is a bad line instead)"]


def test_bad_lines_are_all_counted_and_the_first_ones_kept(tmp_path, monkeypatch):
    """Every bad line was held in memory (566 MB for a file of 2M of them: the wrong file
    given, a cold tester's): they are all counted, the first KEPT_BAD_LINES kept, shown and
    listed as such."""
    from typer.testing import CliRunner

    import tokenbridge.reconstruct as R
    from conftest import EXAMPLE_EXCHANGES
    from tokenbridge.cli import app

    monkeypatch.setattr(R, "KEPT_BAD_LINES", 25)
    src = tmp_path / "in.jsonl"
    src.write_bytes(EXAMPLE_EXCHANGES.read_bytes() + b"[]\n" * 40)
    summary = reconstruct_file(src, tmp_path / "out.jsonl", KIMI_DIR, workers=1)
    assert (summary.records, summary.bad_line_count, len(summary.bad_lines)) == (7, 41, 25)
    assert [b.line for b in summary.bad_lines] == [8, *range(9, 33)]
    assert summary.to_dict()["bad_lines_total"] == 41 and len(summary.to_dict()["bad_lines"]) == 25
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(tmp_path / "o.jsonl"), "-t", str(KIMI_DIR),
                                   "--summary-json", str(tmp_path / "s.json")])
    lines = res.output.splitlines()
    assert "... and 21 more bad lines (the first 25 in --summary-json)" in lines
    assert "41 bad record(s) skipped; the others were written." in lines
    assert json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))["bad_lines_total"] == 41

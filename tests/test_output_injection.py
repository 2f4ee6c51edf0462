"""Text from outside (API bodies, prompt rows, rows on disk, paths) reaching an output is
shown, never obeyed: no escape sequence reaches the terminal raw, no name is read as rich
markup or Markdown, and a name that is not text is refused where it enters, by field."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from conftest import EXAMPLE_EXCHANGES
from tokenbridge.cli import app
from tokenbridge.display import printable
from tokenbridge.exit_codes import ExitCode
from tokenbridge.exchanges import RecordError, parse_exchange
from tokenbridge.export import export_file
from tokenbridge.emulator import EmulatorConfig, running_emulator
from tokenbridge.generate import GenerateSettings, RequestSettings, generate_run
from tokenbridge.generate.progress import Reporter
from tokenbridge.generate.secrets import ApiKey
from tokenbridge.generate.settings import DatasetSpec
from tokenbridge.reconstruct import reconstruct_file
from tokenbridge.rows import RowError, check_row

#: What a hostile name carries: screen clear, terminal title (BEL and ST ends), a
#: hyperlink, carriage return, cursor-up-and-erase, a bidi override, a zero-width space.
HOSTILE = ("\x1b[2J\x1b[H\x1b]0;PWNED\x07\r\x1b[32mall good\x1b[0m"
           "\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\\x1b[1A\x1b[2K\u202eevil\u200b")

#: What a terminal obeys or hides: ESC, BEL, CR, BS, VT, FF, NEL, the C1 CSI, bidi controls,
#: zero-width characters, line separators, tag characters.
_OBEYED = re.compile("[\x1b\x07\r\x08\x0b\x0c\x85\x9b\u202e\u2066\u200b\u2028\U000e0000-\U000e007f]")


def _first_record() -> dict:
    return json.loads(EXAMPLE_EXCHANGES.read_text(encoding="utf-8").splitlines()[0])


def _write(path, *records: dict) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_printable_escapes_every_control_invisible_and_surrogate_character():
    assert printable("a\x1b[2Jb\x07\r\n\x9b") == "a\\x1b[2Jb\\x07\\x0d\\n\\x9b"
    # look-alike names, a hidden line break, a character no UTF-8 output can hold
    assert printable("fp8\u200b \u200d\u2060\ufeff\u00ad") == "fp8\\u200b \\u200d\\u2060\\ufeff\\xad"
    assert printable("a\u2028b\u2029c\u202ed") == "a\\u2028b\\u2029c\\u202ed"
    assert printable("x\ud800y") == "x\\ud800y"
    # what str.isprintable refuses, and invisible letters and marks it passes
    assert printable("fp8\U000e0041\u00a0\u3164\ufe0f\u034f\u0600") == "fp8\\U000e0041\\xa0\\u3164\\ufe0f\\u034f\\u0600"
    assert printable("é 字 😀 ok [bold]") == "é 字 😀 ok [bold]"  # text is left as it is


def test_inspect_shows_hostile_ids_providers_and_findings_escaped(tmp_path, kimi, kimi_dir):
    rec = _first_record()
    rec["id"] = "x" + HOSTILE
    rec["response"]["provider"] = "p" + HOSTILE
    rec["response"]["choices"][0]["finish_reason"] = "stop\n  ok: forged line"
    rec["request"]["chat_template_kwargs"] = {"k" + HOSTILE: True}
    src, out = tmp_path / "ex.jsonl", tmp_path / "rec.jsonl"
    _write(src, rec)
    reconstruct_file(src, out, kimi, workers=1)
    res = CliRunner().invoke(app, ["inspect", str(out), "-t", str(kimi_dir), "--tokens", "0:5"])
    assert res.exit_code == 0, res.output
    assert not _OBEYED.search(res.output)
    assert "provider=p\\x1b[2J\\x1b[H\\x1b]0;PWNED\\x07\\x0d" in res.output
    assert "chat_template_kwargs.k\\x1b[2J" in res.output  # a finding quoting the key
    assert "\n  ok: forged line" not in res.output  # a line break in data forges no line


def test_bad_record_and_error_lines_show_a_hostile_key_escaped(tmp_path, kimi_dir):
    rec = _first_record()
    rec["native_ids"] = {"k" + HOSTILE: 1}
    src = tmp_path / "ex.jsonl"
    _write(src, rec, _first_record() | {"id": "fine"})
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(tmp_path / "out.jsonl"), "-t", str(kimi_dir)])
    assert res.exit_code == ExitCode.INCOMPLETE, res.output
    bad = [line for line in res.output.splitlines() if line.startswith("bad record:")]
    assert len(bad) == 1 and not _OBEYED.search(res.output)
    assert f"{src}:1: native_ids.k\\x1b[2J\\x1b[H\\x1b]0;PWNED\\x07\\x0d" in bad[0]


def test_a_file_name_with_a_newline_forges_no_error_line(tmp_path, kimi):
    """``_fail`` split every message on its newlines, so a file named ``bad\\nerror: forged``
    printed an ``error:`` line of its own making (a cold tester's): a line break inside one
    problem is data now, shown escaped; a config's several problems are still a line each."""
    from test_export_support import make_run

    _, rows = make_run(kimi, 1)
    row = rows[0] | {"status": "OK"}
    src = tmp_path / "bad\nerror: forged.jsonl:1: id: fake.jsonl"
    _write(src, row)
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "out"), "-f", "specforge"])
    assert res.exit_code == 1, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {tmp_path}/bad\\nerror: forged.jsonl:1: id: fake.jsonl:1: status: must be one of ok, "
                      "flagged, rejected, got 'OK'"]
    config = tmp_path / "run.toml"
    config.write_text('[run]\nout = 1\nbogus = 2\n', encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(config)])
    errors = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert res.exit_code == ExitCode.CONFIG and len(errors) == 5 and all(x.startswith(f"error: {config}") for x in errors)


def test_a_path_that_looks_like_markup_is_a_file_name(tmp_path, kimi_dir):
    folder = tmp_path / "[link=http:" / "x["
    folder.mkdir(parents=True)
    src = folder / "nope][bold red]me.jsonl"  # the path reads "[link=http:/x[/nope][bold red]me.jsonl"
    src.write_text(EXAMPLE_EXCHANGES.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(tmp_path / "o.jsonl"), "-t", str(kimi_dir)],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output  # was rich's MarkupError, after the output was written
    assert "[link=http:/x[/nope][bold red]me.jsonl →" in res.output


def test_generate_notices_show_api_text_escaped(capsys):
    reporter = Reporter("plain")
    reporter.log(f"stopping: HTTP 402 payment required (Insufficient credits {HOSTILE})")
    err = capsys.readouterr().err
    assert not _OBEYED.search(err.rstrip("\n"))
    assert err.startswith("stopping: HTTP 402 payment required (Insufficient credits \\x1b[2J")


def test_the_dataset_card_shows_hostile_names_as_table_cells(tmp_path, kimi):
    recs = []
    for i, line in enumerate(EXAMPLE_EXCHANGES.read_text(encoding="utf-8").splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        rec["dataset"] = "d\n| forged | 999 |"
        rec["response"]["provider"] = f"<img src=x onerror=alert(1)>|x`y`*z*[l](http://e)&amp;{HOSTILE}-{i}"
        if i == 0:
            rec["response"]["provider"] = "https://evil.example/login www.evil.example me@evil.example \u202e"
        recs.append(rec)
    src, rows = tmp_path / "ex.jsonl", tmp_path / "rec.jsonl"
    _write(src, *recs)
    summary = reconstruct_file(src, rows, kimi, workers=1)
    assert summary.status["ok"] >= 1
    export_file(rows, tmp_path / "sf", "specforge")
    card = (tmp_path / "sf" / "README.md").read_text(encoding="utf-8")
    body = card.split("\n---\n", 1)[1]  # after the YAML front matter
    datasets = body.split("| dataset | rows |\n| --- | ---: |\n")[1].split("\n\n")[0].splitlines()
    assert datasets == [f"| d\\\\n\\| forged \\| 999 \\| | {summary.status['ok']} |"]  # one row, one cell of data
    providers = body.split("| provider | rows |\n| --- | ---: |\n")[1].split("\n\n")[0].splitlines()
    assert len(providers) == summary.status["ok"]
    links = [row for row in providers if "login" in row]
    assert links == ["| https\\://evil\\.example/login www\\.evil\\.example me\\@evil\\.example \\\\u202e | 1 |"]
    providers.remove(links[0])
    front = card.split("\n---\n", 1)[0]
    assert not _OBEYED.search(front) and "\\u202e" in front  # the YAML front matter (GitHub renders it) too
    for row in providers:
        cells = re.split(r"(?<!\\)\|", row)
        assert len(cells) == 4, row  # "", name, count, "": no column added
        assert not re.search(r"(?<!\\)[<>`*\[\]&]", row), row  # no Markdown or HTML syntax left bare
        assert "\\<img src=x onerror=alert(1)\\>\\|x\\`y\\`\\*z\\*\\[l\\](http\\://e)\\&amp;" in row
        assert not _OBEYED.search(row)


@pytest.mark.parametrize(("where", "field"), [
    (("id",), "id"),
    (("dataset",), "dataset"),
    (("response", "provider"), "response.provider"),
    (("response", "model"), "response.model"),
    (("request", "model"), "request.model"),
    (("meta", "provider"), "meta.provider"),
])
def test_a_name_that_is_not_text_is_refused_by_field(where, field):
    """A lone surrogate (JSON can spell one) in a name every row carries could be written by
    no output: refused where the record enters, naming the field, not crashing export,
    report and inspect later."""
    rec = _first_record()
    node = rec
    for key in where[:-1]:
        node = node.setdefault(key, {})
    node[where[-1]] = "name\ud800"
    with pytest.raises(RecordError) as err:
        parse_exchange(rec)
    assert err.value.field == field and "lone surrogate (U+D800 at character 4)" in str(err.value)


def test_a_row_on_disk_whose_name_is_not_text_is_refused(tmp_path, kimi):
    out = tmp_path / "rec.jsonl"
    reconstruct_file(EXAMPLE_EXCHANGES, out, kimi, workers=1)
    row = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    for col in ("id", "dataset", "provider", "model"):
        with pytest.raises(RowError) as err:
            check_row(dict(row, **{col: "x\udfff"}), out, 1)
        assert f"{out}:1: {col}: holds a lone surrogate (U+DFFF at character 1)" in str(err.value)


def test_a_hostile_finding_code_from_disk_leaves_the_report_figures_valid(tmp_path, kimi):
    """Codes in rows on disk are data: the findings chart shows them escaped, so its SVG
    stays XML (an ESC byte is not allowed there) and the image still renders."""
    import base64
    import warnings
    from xml.etree import ElementTree

    from tokenbridge.report import build_report

    reconstruct_file(EXAMPLE_EXCHANGES, tmp_path / "reconstructed.jsonl", kimi, workers=1)
    lines = (tmp_path / "reconstructed.jsonl").read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[0])
    row["findings"] = [{"code": "odd" + HOSTILE, "severity": "warning", "message": "m"}]
    row["status"] = "flagged"
    (tmp_path / "reconstructed.jsonl").write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n", encoding="utf-8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        html = build_report(tmp_path).read_text(encoding="utf-8")
    figures = re.findall(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", html)
    assert figures
    for b64 in figures:
        svg = base64.b64decode(b64)
        assert b"\x1b" not in svg and b"\x07" not in svg
        ElementTree.fromstring(svg)  # well-formed
    assert not any(_OBEYED.search(str(w.message)) for w in caught)  # matplotlib's glyph warnings echo the text


def test_api_words_quoted_in_findings_and_errors_are_text(tmp_path, kimi):
    """A lone surrogate an API or a request quotes (a template key, an error message) is
    kept as its escape in the finding or error, so Parquet, the store and the report can
    write it; a row on disk whose finding holds one is refused by field."""
    from tokenbridge.generate.classify import _error_message

    assert _error_message({"error": {"message": "upstream \ud800 failed"}}, "", None) == "upstream \\ud800 failed"
    rec = _first_record()
    rec["request"]["chat_template_kwargs"] = {"k\ud800": True}
    broken = _first_record() | {"id": "no-choices"}
    broken["response"] = dict(broken["response"], choices=[], error={"message": "upstream \ud800 failed", "code": 502})
    src = tmp_path / "ex.jsonl"
    src.write_text(json.dumps(rec) + "\n" + json.dumps(broken) + "\n", encoding="utf-8")
    summary = reconstruct_file(src, tmp_path / "rec.parquet", kimi, workers=1)  # was UnicodeEncodeError
    assert summary.rows == 2 and not summary.bad_lines
    reconstruct_file(src, tmp_path / "rec.jsonl", kimi, workers=1)
    rows = [json.loads(line) for line in (tmp_path / "rec.jsonl").read_text(encoding="utf-8").splitlines()]
    messages = [f["message"] for r in rows for f in r["findings"]]
    assert any("chat_template_kwargs.k\\ud800 is not rendered" in m for m in messages)
    assert "response has no choices: upstream \\ud800 failed" in messages
    for part in ("code", "message"):
        row = dict(rows[0], findings=[{"code": "c", "severity": "warning", "message": "m", part: "x\udc80"}])
        with pytest.raises(RowError) as err:
            check_row(row, src, 1)
        assert f"findings[0].{part}: holds a lone surrogate (U+DC80 at character 1)" in str(err.value)


def test_file_names_that_are_not_utf8_are_shown_escaped(tmp_path, kimi):
    """A path's bytes need not be UTF-8 (Python holds the others as lone surrogates): the
    dataset card, report.json, report.html and generate's dry-run name such a file escaped
    instead of crashing with an internal error."""
    import os

    from tokenbridge.report import build_report

    odd = os.fsdecode(b"rec\xff")
    run = tmp_path / (odd + "-run")
    run.mkdir()
    reconstruct_file(EXAMPLE_EXCHANGES, run / "reconstructed.jsonl", kimi, workers=1)
    rows = tmp_path / (odd + ".jsonl")
    rows.write_bytes((run / "reconstructed.jsonl").read_bytes())
    export_file(rows, tmp_path / "sf", "specforge")
    card = (tmp_path / "sf" / "README.md").read_text(encoding="utf-8")
    assert f"source: {tmp_path}/rec\\udcff.jsonl" in card and f"- Source: `{tmp_path}/rec\\udcff.jsonl`" in card
    html = build_report(run)
    assert json.loads((html.parent / "report.json").read_text(encoding="utf-8"))["run_dir"] == str(run)
    shown = str(run).replace(odd, "rec\\udcff")
    assert f"<title>tokenbridge report: {shown}</title>" in html.read_text(encoding="utf-8")
    prompts = tmp_path / (odd + "-prompts.jsonl")
    prompts.write_text('{"id": "a", "prompt": "hello"}\n', encoding="utf-8")
    with running_emulator(EmulatorConfig(min_tokens=5, max_tokens=20, slow_s=0.0), tokenizer=kimi) as url:
        settings = GenerateSettings(datasets=(DatasetSpec("demo", prompts),),
                                    request=RequestSettings(model="moonshotai/kimi-k2.5", max_tokens=50),
                                    base_url=url, progress="none")
        summary = generate_run(settings, tmp_path / "gen", key=ApiKey("X", "sk-test"))
    assert summary.done == 1 and summary.exit_code == ExitCode.OK  # the store keeps the source's name escaped

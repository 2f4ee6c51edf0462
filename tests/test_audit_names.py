"""Names from the API (provider, model, dataset ids on rows) are text everywhere (issue 7, item 9):
``$\\foo{$`` must not reach matplotlib's math parser, ``[/red]`` must not reach rich's markup
parser, ``<script>`` is escaped in HTML, and ANSI/OSC escapes never reach a terminal or the
SVG figures (an ESC byte is not even valid XML)."""

from __future__ import annotations

import base64
import io
import re
import xml.dom.minidom
from pathlib import Path

import pytest
from rich.console import Console

from outputs_support import cli
from test_export_support import make_run, write_jsonl
from tokenbridge.display import printable
from tokenbridge.report import build_report, collect_run, print_summary

MATH = "$\\foo{$"
MARKUP = "[/red]bold[red"
OSC = "\x1b]0;pwned\x07\x1b[31mRED\x1b[0m<script>alert(1)</script>"
NAMES = (MATH, MARKUP, OSC)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # every C0/C1 control but tab and newline


@pytest.fixture(scope="module")
def run(kimi, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("names") / "run"
    exchanges, rows = make_run(kimi, 6)
    for i, row in enumerate(rows):
        row["provider"] = NAMES[i % 3]
    for i, ex in enumerate(exchanges):
        ex["response"]["provider"] = ex["meta"]["provider"] = NAMES[i % 3]
    write_jsonl(root / "reconstructed.jsonl", rows)
    write_jsonl(root / "exchanges.jsonl", exchanges)
    return root


def test_printable_escapes_controls_and_keeps_text():
    assert printable(OSC) == "\\x1b]0;pwned\\x07\\x1b[31mRED\\x1b[0m<script>alert(1)</script>"
    assert printable("a\u202eb\nc\x9bd") == "a\\u202eb\\nc\\x9bd"  # bidi override, newline, C1 CSI
    assert printable("naïve 東京 🙂 $x$ [b]") == "naïve 東京 🙂 $x$ [b]"


def test_report_with_hostile_provider_names_renders_them_as_text(run):
    html = build_report(run, force=True).read_text(encoding="utf-8")
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "\x1b" not in html and "\\x1b]0;pwned" in html  # shown, escaped
    assert html.count(MARKUP) >= 1 and html.count("$\\foo{$") >= 1  # the names themselves, not rendered math
    svgs = [base64.b64decode(m) for m in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', html)]
    assert svgs
    for svg in svgs:
        xml.dom.minidom.parseString(svg)  # well-formed: no control bytes from a name
    # no math text: matplotlib would draw \foo as a glyph path, never as the text "$\foo{$"
    assert any(b"$\\foo{$" in svg for svg in svgs)


def test_terminal_summary_prints_names_verbatim_and_no_escape_sequences(run):
    buf = io.StringIO()
    print_summary(collect_run(run), Console(file=buf, width=400, color_system=None))
    out = buf.getvalue()
    assert MARKUP in out and MATH in out and "\\x1b]0;pwned\\x07" in out
    assert not _CONTROL.search(out), repr(_CONTROL.search(out))


def test_report_command_in_a_terminal_exits_0_and_sends_no_escape_from_a_name(run):
    res = cli("report", str(run), "--force", env={"COLUMNS": "300"})
    assert res.returncode == 0, res.stderr
    assert not _CONTROL.search(res.stdout) and "pwned" in res.stdout
    assert "Traceback" not in res.stderr

"""scrub over generated keys, each spelled the ways a server can echo it: JSON escapes
(``\\uXXXX`` in either case, ``\\/``, ``\\"``, ``\\\\``, nested), URL-encoding, base64
in either alphabet at any alignment, wrapped with line breaks (raw or JSON-escaped) as
MIME does, hex in either case, and HTML numeric character references. The oracles here
decode with the standard library, apart from secrets.py."""

from __future__ import annotations

import base64
import html
import json
import re
import string
import urllib.parse

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from tokenbridge.generate.secrets import MIN_MASKED, scrub, scrub_bytes

#: What a key may hold: no space, '<' or '>', which frame it in the texts below.
KEY_CHARS = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./+=~%\"\\'é中😀")
KEYS = st.text(KEY_CHARS, min_size=MIN_MASKED, max_size=80)
_SHORT = {"/": "\\/", '"': '\\"', "\\": "\\\\"}


def _json_spelled(key: str, picks: list[int]) -> str:
    """``key`` as it sits in a JSON string, each character in one of its spellings."""
    out = []
    for ch, pick in zip(key, picks * len(key)):
        forms = [json.dumps(ch, ensure_ascii=False)[1:-1], _escaped(ch, "{:04x}"), _escaped(ch, "{:04X}")]
        if ch in _SHORT:
            forms.append(_SHORT[ch])
        out.append(forms[pick % len(forms)])
    return "".join(out)


def _escaped(ch: str, digits: str) -> str:
    units = ch.encode("utf-16-be")
    return "".join("\\u" + digits.format(int.from_bytes(units[i : i + 2], "big")) for i in range(0, len(units), 2))


@settings(max_examples=150, deadline=None)
@given(KEYS, st.lists(st.integers(0, 3), min_size=1, max_size=8), st.integers(1, 3))
@example(key="00000%0D00000000", picks=[0], levels=1)  # %0D reads as a line break: the key was not masked at all
def test_every_json_spelling_of_a_key_is_masked_whole(key, picks, levels):
    if "\\" in key:
        levels = 1  # a key holding a backslash is read through one level of JSON (see _readings)
    text = _json_spelled(key, picks)
    doc = '{"m": "<< ' + text + ' >>"}'
    for _ in range(levels - 1):
        doc = json.dumps(doc)
    masked = scrub(doc, key)
    for _ in range(levels - 1):
        masked = json.loads(masked)
    assert json.loads(masked) == {"m": "<< *** >>"}  # still JSON, the key gone and nothing else


@settings(max_examples=100, deadline=None)
@given(KEYS, st.lists(st.booleans(), min_size=1, max_size=8), st.booleans())
def test_every_url_encoding_of_a_key_is_masked_whole(key, picks, upper):
    hexes = "%{:02X}" if upper else "%{:02x}"
    text = "".join("".join(hexes.format(b) for b in ch.encode()) if pick or ch == "%" else ch  # a '%' is always encoded
                   for ch, pick in zip(key, picks * len(key)))
    assert scrub(f"<< {text} >>", key) == "<< *** >>"


def _base64_readings(text: str) -> list[bytes]:
    """Every run of base64 in ``text`` decoded at each of its four offsets, line breaks
    (raw or JSON-escaped) and ``\\/`` read as a decoder reads them."""
    flat = re.sub(r"\r|\n|\\r|\\n", "", text).replace("\\/", "/").replace("-", "+").replace("_", "/")
    out = []
    for run in re.findall(r"[A-Za-z0-9+/]+", flat):
        for off in range(4):
            body = run[off:]
            body = body[: len(body) - (len(body) % 4 == 1)]  # a lone sixth of a byte decodes to nothing
            out.append(base64.b64decode(body + "=" * (-len(body) % 4)))
    return out


@settings(max_examples=150, deadline=None)
@given(KEYS, st.sampled_from(["", "x", "Bearer ", "Basic: "]), st.booleans(), st.integers(4, 80),
       st.sampled_from(["\n", "\r\n", "\\n", "\\r\\n"]), st.booleans())
def test_base64_of_a_key_wrapped_with_line_breaks_is_masked(key, lead, urlsafe, width, brk, slash_escaped):
    blob = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)((lead + key).encode()).decode()
    text = brk.join(blob[i : i + width] for i in range(0, len(blob), width))
    if slash_escaped:
        text = text.replace("/", "\\/")
    readings = _base64_readings(text)
    assert any(key.encode() in r for r in readings)  # the oracle finds it unmasked
    masked = scrub(f"<< {text} >>", key)
    assert masked.startswith("<< ") and masked.endswith(" >>") and "***" in masked
    assert not any(key.encode()[:12] in r or key.encode()[-12:] in r for r in _base64_readings(masked))


def test_the_attackers_spellings_are_masked():
    """Found by a cold attack: MIME base64 of the header (a line break every 76 characters,
    JSON-escaped in an error body) and a key's '/' echoed as JSON's ``\\/``."""
    key = "sk-test/abcdefghijklmnopqrstuvwxyz0123"
    mime = base64.encodebytes(f"Bearer {key}".encode()).decode()
    body = json.dumps({"error": {"message": "bad credentials, header was " + mime, "code": 401}}).encode()
    assert json.loads(scrub_bytes(body, key))["error"]["message"] == "bad credentials, header was QmVhcmVyIH***\n"
    body = ('{"error":{"message":"' + "x" * 480 + key.replace("/", "\\/") + '","code":401}}').encode()
    assert scrub_bytes(body, key) == ('{"error":{"message":"' + "x" * 480 + '***","code":401}}').encode()
    crlf = base64.encodebytes(f"Bearer {key}".encode()).replace(b"\n", b"\r\n")
    assert scrub_bytes(crlf, key) == b"QmVhcmVyIH***\r\n"


def test_a_json_body_stays_json_and_other_text_is_kept():
    key = "sk-or-v1-" + "0123456789abcdef" * 4
    doc = {"choices": [{"message": {"content": f"a\nb {key} \\ c/d \u00e9 %41 QmVhcmVy"}}], "n": [1, 2]}
    masked = json.loads(scrub_bytes(json.dumps(doc).encode(), key))
    assert masked == {"choices": [{"message": {"content": "a\nb *** \\ c/d \u00e9 %41 QmVhcmVy"}}], "n": [1, 2]}


@settings(max_examples=150, deadline=None)
@given(KEYS, st.data(), st.sampled_from(["raw", "json", "url"]))
def test_a_run_of_min_masked_characters_of_a_key_is_masked_and_a_shorter_one_kept(key, data, spelling):
    """A server that starred the key's tail (``sk-...abcd****``) kept 33 of its 37 characters;
    any MIN_MASKED in a row are masked, fewer are how keys are named in prose."""
    start = data.draw(st.integers(0, len(key) - MIN_MASKED))
    end = data.draw(st.integers(start + MIN_MASKED, len(key)))
    run = key[start:end]
    spelled = {"raw": run, "json": json.dumps(run)[1:-1].replace("/", "\\/"),
               "url": "".join(f"%{b:02X}" for b in run.encode())}[spelling]
    assert scrub(f"<< {spelled}<****> >>", key) == "<< ***<****> >>"
    short = key[start : start + MIN_MASKED - 1]
    while len(short.encode()) >= MIN_MASKED:  # runs are counted in UTF-8 bytes
        short = short[:-1]
    assert scrub(f"<< {short} >>", key) == f"<< {short} >>"


def test_a_starred_key_is_masked_where_it_holds_min_masked_characters():
    key = "sk-test/abcdefghijklmnopqrstuvwxyz0123"
    assert scrub(f"invalid key {key[:-4]}****", key) == "invalid key *******"
    assert scrub(f"{key[:8]}...{key[-4:]}", key) == f"{key[:8]}...{key[-4:]}"  # how providers show a key: kept
    wrapped = base64.encodebytes(f"Bearer {key[:-4]}".encode()).decode()
    assert not any(key.encode()[:12] in r for r in _base64_readings(scrub(wrapped, key)))


def test_runs_of_backslashes_are_scrubbed_in_linear_time():
    """A model stuck repeating ``\\\\`` (LaTeX, a regex) sends a body that is mostly
    backslashes. Each escape pattern once tried every start of such a run and backtracked
    through the rest of it: 32 kB took 8.6 s, an 80 kB body a minute, in the event loop
    every request in flight waits on. A megabyte of each shape now takes well under a
    second (the old cost would be hours), and what the run escapes is still read."""
    import time

    key = "sk-test/abcdefghijklmnopqrstuvwxyz0123"
    for tail in (b"", b"n", b"u0041", b"/", b"x"):
        body = b'{"content": "' + b"\\" * (1 << 20) + tail + b'"}'
        started = time.perf_counter()
        assert scrub_bytes(body, key) == body
        assert time.perf_counter() - started < 5.0, tail
    hidden = json.dumps({"content": "\\" * 5000 + key}).replace("/", "\\/").encode()
    assert key.encode() not in scrub_bytes(hidden, key) and b"sk-test\\/abcdefghijk" not in scrub_bytes(hidden, key)


@settings(max_examples=100, deadline=None)
@given(KEYS, st.booleans())
def test_the_hex_of_a_key_is_masked_in_either_case(key, upper):
    """A server that dumps the request's headers as bytes (an echoing error page did)."""
    text = key.encode("utf-8").hex()
    text = text.upper() if upper else text
    assert bytes.fromhex(text).decode("utf-8") == key
    assert scrub(f"<< {text} >>", key) == "<< *** >>"


_DUMPS = {  # a byte -> its place in a dump, and what stands between bytes
    "spaced": ("{:02x}", " "), "colons": ("{:02X}", ":"), "dashes": ("{:02x}", "-"), "commas": ("{:02x}", ","),
    "python": ("\\x{:02x}", ""), "c": ("0x{:02x}", ", "), "c-packed": ("0X{:02X}", ""), "comma-space": ("{:02x}", ", "),
    "python-spaced": ("\\x{:02x}", ", "),
    # a cold tester's: quoted-printable (=73=6B...) and other separators went unmasked
    "quoted-printable": ("={:02X}", ""), "dots": ("{:02x}", "."), "underscores": ("{:02x}", "_"),
    "bars": ("{:02X}", "|"), "semicolons": ("{:02x}", ";"), "slashes": ("{:02x}", "/"),
}


@settings(max_examples=200, deadline=None)
@given(KEYS, st.sampled_from(sorted(_DUMPS)), st.sampled_from(["", "Bearer ", "Authorization: Bearer "]),
       st.integers(0, 2), st.data())
def test_a_hex_dump_of_a_key_written_a_byte_at_a_time_is_masked(key, form, lead, levels, data):
    """An error page that dumps the request's header bytes with a space between them
    (``42 65 61 72 ...``) put the key on stderr, in generate.json and in the store (a cold
    tester's); so would ``\\x73\\x6b`` or ``0x73, 0x6b``. At MIN_MASKED key bytes it is masked,
    below that it is kept."""
    spell, sep = _DUMPS[form]
    raw = (lead + key).encode("utf-8")
    dump = sep.join(spell.format(b) for b in raw)
    text = f"<< {dump} >>"
    for _ in range(levels):  # inside JSON, or JSON inside JSON
        text = json.dumps({"error": text})
    out = scrub(text, key)
    assert out != text
    own = key.encode("utf-8")
    for n in range(len(own) - MIN_MASKED + 1):  # no MIN_MASKED bytes of the key are left in the dump
        assert sep.join(spell.format(b) for b in own[n : n + MIN_MASKED]).lower() not in out.lower()
    short = sep.join(spell.format(b) for b in own[: MIN_MASKED - 1])
    assert scrub(f"<< {short} >>", key) == f"<< {short} >>"


def _hexdump_c(data: bytes) -> str:
    """``hexdump -C``'s layout: an offset, 16 bytes a line in two groups of 8, the text."""
    lines = []
    for at in range(0, len(data), 16):
        row = data[at : at + 16]
        cells = " ".join(f"{b:02x}" for b in row[:8]) + "  " + " ".join(f"{b:02x}" for b in row[8:])
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in row)
        lines.append(f"{at:08x}  {cells:<48}  |{text}|")
    return "\n".join(lines) + "\n"


def _xxd(data: bytes) -> str:
    """``xxd``'s layout: an offset, 16 bytes a line in groups of 2, the text."""
    lines = []
    for at in range(0, len(data), 16):
        row = data[at : at + 16]
        cells = " ".join(row[i : i + 2].hex() for i in range(0, len(row), 2))
        lines.append(f"{at:08x}: {cells:<39}  " + "".join(chr(b) if 32 <= b < 127 else "." for b in row))
    return "\n".join(lines) + "\n"


@settings(max_examples=100, deadline=None)
@given(KEYS.filter(str.isascii), st.sampled_from([_hexdump_c, _xxd]), st.integers(0, 15))
def test_a_line_dump_of_a_key_keeps_no_line_of_it(key, dump, lead):
    """``hexdump -C`` (two spaces after the eighth byte) and ``xxd`` (two-byte groups) put at
    most 8 bytes in a row with one separator, so no dump was found (a cold reviewer's): each
    line of 16 key bytes is masked, as its text column is."""
    raw = ("x" * lead + "Bearer " + key).encode()
    out = scrub(dump(raw), key)
    for n in range(0, len(key) - MIN_MASKED + 1):
        piece = key.encode()[n : n + MIN_MASKED]
        assert piece.decode() not in out and piece.hex() not in "".join(out.split()).replace(":", "")


def test_a_long_run_of_backslashes_beside_a_dump_is_scrubbed_in_linear_time():
    """The dump pattern's prefix took any run of backslashes: 32,000 of them beside a real
    dump cost 0.7 s, a megabyte minutes, in the event loop (a cold reviewer's)."""
    import time

    key = "sk-or-v1-" + "0123456789abcdef" * 4
    dump = "".join(f"\\x{b:02x}" for b in key.encode())
    for n in (20_000, 80_000):
        text = "\\" * n + " " + dump
        started = time.perf_counter()
        assert scrub(text, key).endswith("\\x***")
        took = time.perf_counter() - started
        assert took < 2.0, (n, took)  # quadratic, 80,000 took about 4.5 s


def test_a_dump_behind_three_backslashes_is_masked():
    key = "sk-or-v1-" + "0123456789abcdef" * 4
    dump = " ".join("\\\\\\x" + f"{b:02x}" for b in key.encode())
    assert scrub(dump, key) == "\\\\\\x***"  # the whole key, from its first byte's digits on


def test_hex_dumps_of_other_bytes_and_prose_are_kept():
    key = "sk-or-v1-" + "0123456789abcdef" * 4
    for text in ("de ad be ef " * 20, " ".join(f"{b:02x}" for b in b"sk-or-v1-012345"), "0x1f, " * 40,
                 "\\x00" * 40, "a bed de ad fa ce " * 10):
        assert scrub(text, key) == text


@settings(max_examples=100, deadline=None)
@given(KEYS, st.sampled_from([bytes.upper, bytes.lower]), st.sampled_from(["raw", "json", "url"]))
def test_the_key_in_the_other_case_is_masked(key, case, spelling):
    """A server that upper-cases its error text echoed ``SK-OR-V1-3F9A...``: printed and
    stored as it was, and for a hex key (OpenRouter's after the prefix) that is the key."""
    cased = case(key.encode("utf-8")).decode("utf-8")
    text = {"raw": cased, "json": _json_spelled(cased, [1]), "url": urllib.parse.quote(cased, safe="")}[spelling]
    assert scrub(f"<< {text} >>", key) == "<< *** >>"


def test_an_upper_cased_openrouter_key_is_masked_and_prose_kept():
    key = "sk-or-v1-" + "3f9a1c0b7e2d4a6f8b1c3e5d7a9f0b2c4d6e8f1a3b5c7d9e0f2a4b6c8d0e1f2a"
    assert scrub(f"bad {key.upper()} here", key) == "bad *** here"
    assert scrub(f"{{\"error\": \"bad {key.upper()[:20]}\"}}", key) == '{"error": "bad ***"}'
    assert scrub("SK-OR-V1-3F9A is how keys look", key) == "SK-OR-V1-3F9A is how keys look"  # under 16: prose


@settings(max_examples=100, deadline=None)
@given(KEYS, st.lists(st.integers(0, 2), min_size=1, max_size=8))
@example("0" * 33 + "\\'", [1, 0, 0, 0])  # a key's backslash-quote left as it is: no JSON reading has it
@example("0" * 14 + "%20", [0, 1, 0, 0])  # a key's %20 left as it is: no URL reading has it
def test_html_character_references_of_a_key_are_masked(key, picks):
    """An HTML error page quoting the header entity by entity (``&#115;&#107;...``),
    decimal or hex, mixed with plain characters; other characters stay as they are (a key's
    own ``\\'`` or ``%20`` too: once in a few thousand draws this test failed on them)."""
    def spelled(ch: str, pick: int) -> str:
        if not (" " <= ch <= "~") or pick == 0:
            return ch
        return f"&#{ord(ch)};" if pick == 1 else f"&#x{ord(ch):x};"

    text = "".join(spelled(ch, pick) for ch, pick in zip(key, picks * len(key)))
    assert html.unescape(text) == key or "&" in key
    assert scrub(f"<< {text} >>", key) == "<< *** >>"


_WIDE_CODECS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]


@settings(max_examples=150, deadline=None)
@given(KEYS, st.sampled_from(_WIDE_CODECS), st.sampled_from(["raw", "json", "url", "hex"]), st.lists(
    st.integers(0, 3), min_size=1, max_size=8), st.sampled_from([b"", b"x", b"xyz"]))
def test_a_key_in_a_wide_charset_is_masked_in_it(key, codec, spelling, picks, lead):
    """An error page sent ``charset=utf-16`` (or UTF-32) quoting the header: a NUL beside
    every ASCII character hid the key from every spelling. Each spelling is found in the
    wide text, at any byte offset, and the mask is written in that charset (the text decodes)."""
    spelled = {"raw": key, "json": _json_spelled(key, picks), "url": "".join(f"%{b:02X}" for b in key.encode()),
               "hex": key.encode().hex()}[spelling]
    data = lead + f"<< {spelled} >>".encode(codec)
    masked = scrub_bytes(data, key)
    assert masked[: len(lead)] == lead and masked[len(lead) :].decode(codec) == "<< *** >>"


def test_a_key_in_a_utf16_json_error_body_is_masked_and_the_body_stays_json():
    key = "sk-or-v1-" + "0123456789abcdef" * 4
    for codec in _WIDE_CODECS:
        body = json.dumps({"error": {"code": 400, "message": f"bad key Bearer {key}"}}).encode(codec)
        assert json.loads(scrub_bytes(body, key).decode(codec)) == {"error": {"code": 400, "message": "bad key Bearer ***"}}
    nul_interleaved = "bad key " + "\x00".join(key) + "\x00 end"  # UTF-16 read as UTF-8: what a message held
    assert scrub(nul_interleaved, key) == "bad key *\x00*\x00*\x00 end"
    prose = "short ones stay: " + "\x00".join(key[:MIN_MASKED - 1]) + "\x00"
    assert scrub(prose, key) == prose


def test_the_hex_or_base64_of_the_public_prefix_and_a_few_characters_is_not_a_key():
    """``736b2d6f722d76312d`` is the hex of ``sk-or-v1-``, the prefix every OpenRouter key
    shares: 18 hex digits, zero secret characters, and a stored answer quoting it was
    altered. An encoded run counts the key characters it spells, as the raw one does."""
    key = "sk-or-v1-" + "0123456789abcdef" * 4
    for text in ("prefix 736b2d6f722d76312d ok", "prefix c2stb3ItdjEtMDEy ok",  # sk-or-v1-, base64 of sk-or-v1-012
                 "x " + key[:15] + " y", "x " + key[:15].encode().hex() + " y",
                 "x " + base64.b64encode(key[:15].encode()).decode() + " y"):
        assert scrub(text, key) == text
    for text in (key[:16], key[:16].encode().hex(), key[:16].encode().hex().upper()):
        assert scrub(f"x {text} y", key) == "x *** y"
    b64 = base64.b64encode(key[:16].encode()).decode()  # its 22nd character holds 2 bits of the key, 4 of padding
    assert scrub(f"x {b64} y", key) == f"x ***{b64[21:]} y"


@settings(max_examples=200, deadline=None)
@given(KEYS, st.data(), st.sampled_from(["", " ", "  ", "<< Bearer "]), st.booleans(), st.booleans())
@example(key="sk-or-v1-" + "0" * 16, data=None, lead="Bearer ", urlsafe=False, upper=False)
def test_an_encoded_run_is_masked_at_min_masked_key_characters_and_kept_below(key, data, lead, urlsafe, upper):
    """The boundary, at every byte and base64 alignment: MIN_MASKED bytes of the key in a
    row, hex or base64 (behind any lead: their first and last bytes share characters with
    it), are masked; one fewer (hex: and half of the next) is text like any other."""
    raw = key.encode()
    start = data.draw(st.integers(0, len(raw) - MIN_MASKED)) if data is not None else 0
    whole, short = raw[start : start + MIN_MASKED], raw[start : start + MIN_MASKED - 1]
    hexed = whole.hex().upper() if upper else whole.hex()
    assert scrub_bytes(f"<< {hexed} >>".encode(), key) == b"<< *** >>"
    less = f"<< {hexed[:-1]} >>".encode()  # 15 bytes and a nibble
    assume(not any(raw[j : j + MIN_MASKED] in less for j in range(len(raw) - MIN_MASKED + 1)))
    assert scrub_bytes(less, key) == less
    encode = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    masked = scrub_bytes(b"<< " + encode(lead.encode() + whole) + b" >>", key)
    assert b"***" in masked
    assert not any(whole in r for r in _base64_readings(masked.decode("ascii")))
    text = b"<< " + encode(lead.encode() + short) + b" >>"
    assert scrub_bytes(text, key) == text


def _base32_readings(text: str) -> list[bytes]:
    """Every run of base32 in ``text`` decoded at each of its eight offsets, either case."""
    out = []
    for run in re.findall(r"[A-Za-z2-7]+", text):
        for off in range(8):
            body = run[off:].upper()
            while len(body) % 8 not in (0, 2, 4, 5, 7):  # a length no encoder writes: its last character is partial
                body = body[:-1]
            out.append(base64.b32decode(body + "=" * (-len(body) % 8)))
    return out


@settings(max_examples=150, deadline=None)
@given(KEYS, st.sampled_from(["", "x", "ab", "abc", "Bearer "]), st.sampled_from(["", "#", "####", "=="]),
       st.booleans(), st.booleans())
def test_base32_of_a_key_is_masked_at_every_alignment(key, lead, trail, lower, padded):
    """A server that echoed the key in base32 had it stored and printed (a cold tester's).
    A key's first and last bytes may share a character with what is beside them: they count
    where that character agrees, as in base64."""
    blob = base64.b32encode((lead + key + trail).encode()).decode()
    blob = blob if padded else blob.rstrip("=")
    blob = blob.lower() if lower else blob
    assert any(key.encode() in r for r in _base32_readings(blob))  # the oracle finds it unmasked
    masked = scrub(f"<< {blob} >>", key)
    assert masked.startswith("<< ") and masked.endswith(" >>") and "***" in masked
    assert not any(key.encode()[:12] in r or key.encode()[-12:] in r for r in _base32_readings(masked))


@settings(max_examples=100, deadline=None)
@given(KEYS, st.data(), st.sampled_from(["", "x", "ab", "abc", "Bearer "]), st.sampled_from(["", "#", "####"]),
       st.booleans())
def test_base32_is_masked_at_min_masked_key_characters_and_kept_below(key, data, lead, trail, lower):
    """The boundary, at every alignment: MIN_MASKED key bytes in a row are masked in base32
    as in raw text, hex and base64 (a cold reviewer's: 16 bytes sharing their edge
    characters were left), and one fewer is text like any other."""
    raw = key.encode()
    start = data.draw(st.integers(0, len(raw) - MIN_MASKED))
    whole, short = raw[start : start + MIN_MASKED], raw[start : start + MIN_MASKED - 1]
    case = str.lower if lower else str
    masked = scrub_bytes(b"<< " + case(base64.b32encode(lead.encode() + whole + trail.encode()).decode()).encode()
                         + b" >>", key)
    assert b"***" in masked
    assert not any(whole in r for r in _base32_readings(masked.decode("ascii")))
    plain = lead.encode() + short + trail.encode()
    assume(not any(raw[j : j + MIN_MASKED] in plain for j in range(len(raw) - MIN_MASKED + 1)))  # the lead's bytes
    text = b"<< " + case(base64.b32encode(plain).decode()).encode() + b" >>"
    assert scrub_bytes(text, key) == text


def test_the_base32_of_the_public_prefix_and_a_few_characters_is_kept():
    key = "sk-or-v1-" + "0123456789abcdef" * 4
    for n in (MIN_MASKED - 1, 9):  # fewer than MIN_MASKED, and the public prefix alone
        text = "x " + base64.b32encode(key[:n].encode()).decode() + " y"
        assert scrub(text, key) == text


@given(key=st.text(st.sampled_from(string.ascii_letters + string.digits + "-_"), min_size=MIN_MASKED, max_size=80),
       sep=st.sampled_from([",", ", ", " ", ",\n  ", ";", " ,\t", ",\n" + " " * 12, ",\\n    "]),
       lead=st.sampled_from(["", "Bearer ", "{\"x\": 1} "]))
@settings(max_examples=60, deadline=None)
def test_a_key_as_decimal_byte_values_is_masked(key, sep, lead):
    """A cold tester's: Node serializes a ``Buffer`` to JSON as its byte values
    (``{"type": "Buffer", "data": [115, 107, ...]}``); an error body echoing the header so kept
    the key whole in the store and on the terminal."""
    spelled = sep.join(str(b) for b in (lead + key).encode())
    body = json.dumps({"error": {"message": "bad auth"}}).encode()[:-1] + (
        ', "data": {"type": "Buffer", "data": [' + spelled + "]}}").encode()
    out = scrub_bytes(body, key)
    assert sep.join(str(b) for b in key.encode()).encode() not in out
    # each of the key's numbers a 0: the body stays what it was (JSON, where it was), its shape kept
    assert out.startswith(b'{"error": {"message": "bad auth"}') and sep.join(["0"] * len(key)).encode() in out
    if "," in sep and "\\" not in sep:
        assert json.loads(out)["data"]["type"] == "Buffer"


def test_a_key_after_a_number_past_a_byte_is_masked():
    key = "sk-or-v1-" + "0123456789abcdef" * 4
    out = scrub_bytes(b"[999, " + b", ".join(str(b).encode() for b in key.encode()) + b", 1000]", key)
    assert out == b"[999, " + b", ".join([b"0"] * len(key)) + b", 1000]"
    padded = b" ".join(b"%03d" % b for b in key.encode())  # C's %03d
    assert scrub_bytes(b"bytes: " + padded + b" end", key) == b"bytes: " + b" ".join([b"0"] * len(key)) + b" end"


def test_decimal_numbers_that_spell_no_key_are_kept():
    key = "sk-or-v1-" + "0123456789abcdef" * 4
    for text in (b"[115, 107, 45, 111, 114, 45, 118, 49]", b"scores: 10, 20, 30, 40, 50, 60, 70, 80, 90, 100",
                 b"[" + b", ".join(str(b).encode() for b in b"hello world, not a key") + b"]"):
        assert scrub_bytes(text, key) == text


def test_a_long_list_of_small_numbers_is_scrubbed_in_linear_time():
    """A cold reviewer's: a model answer (or a hostile body) of ``10, 10, ..., 1]`` looks like a
    hex dump; each byte of it copied the whole run again, 7.7 s for a MB, 30 for two (the
    event loop every request in flight waits on). Each such body now takes well under a
    second a MB, and a decimal list too."""
    import time

    key = "sk-or-v1-" + "0123456789abcdef" * 4
    for unit in (b"10, ", b"ab:", b"115, "):
        body = b'{"content": "[' + unit * (2_000_000 // len(unit)) + b'1]"}'
        started = time.perf_counter()
        assert scrub_bytes(body, key) == body
        assert time.perf_counter() - started < 8.0, unit


def test_a_pretty_printed_byte_array_at_any_depth_stays_json_and_holds_no_key():
    """A cold reviewer's: a line break and the indentation of an item nested a few levels deep
    is more than eight spaces, and a pretty body quoted inside a JSON string (OpenRouter's
    ``error.metadata.raw``) has its line breaks as ``\\n``: both kept the key. And the mask
    ``***`` in an array made the answer's JSON invalid, so a good 200 was sent again."""
    key = "sk-or-v1-" + "0123456789abcdef" * 4
    data = {"type": "Buffer", "data": list(key.encode())}
    nested = {"a": {"b": {"c": {"d": data}}}, "usage": {"cost": 0.5}}
    for indent in (2, 4, 8):
        body = json.dumps(nested, indent=indent).encode()
        out = scrub_bytes(body, key)
        assert json.loads(out)["a"]["b"]["c"]["d"]["data"] == [0] * len(key) and json.loads(out)["usage"]["cost"] == 0.5
    raw = json.dumps({"error": {"metadata": {"raw": json.dumps(nested, indent=2)}}}).encode()
    out = scrub_bytes(raw, key)
    assert json.loads(json.loads(out)["error"]["metadata"]["raw"])["a"]["b"]["c"]["d"]["data"] == [0] * len(key)


@pytest.mark.parametrize("lead", range(0, 76, 3))
@pytest.mark.parametrize("newline", ["\r\n", "\n"])
@pytest.mark.parametrize("key", ["sk-or-v1-canary7f3e9a1b2c4d6e8f0a1b2c3d4e5f6a7b8c9d", "sk-canary-0123456789abcdef01"])
def test_a_quoted_printable_key_wrapped_by_soft_line_breaks_is_masked(lead, newline, key):
    """Reviewers': quoted-printable wraps at 76 columns with a soft break (``=`` at a line's
    end), so a key spread over two lines was masked only where one line held 16 of its
    characters: 26 of them were left readable; a shorter key, on neither line 16, not at all."""
    units = ["x"] * lead + [f"={b:02X}" for b in key.encode()]
    lines, line = [], ""
    for unit in units:  # RFC 2045: at most 76 characters a line, the soft break's "=" included
        if len(line) + len(unit) > 75:
            lines.append(line + "=")
            line = ""
        line += unit
    text = newline.join([*lines, line])
    out = scrub(text, key)
    left = "".join(chr(int(h, 16)) for h in re.findall(r"=([0-9A-F]{2})", out))
    assert len(left) < MIN_MASKED, (out, left)  # the two lines' pieces, each short, told most of the key

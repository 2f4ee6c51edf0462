"""The API key: read from the environment, never written anywhere, in any encoding.

The key lives only in the ``Authorization`` header of outgoing requests. Everything
that leaves the engine (attempt messages, log lines, error reports, stored bodies) goes
through :func:`scrub` / :func:`scrub_bytes`, because exception texts from HTTP libraries
can quote headers and a hostile or buggy server can echo the key back.

What is masked (replaced by ``***``): every run that spells :data:`MIN_MASKED` or more
consecutive characters of the key (the whole key, or what a server kept of it when it
starred the rest; counted in UTF-8 bytes, which for the ASCII keys providers issue are
characters), in any of these spellings, in any mix, since text is searched as a decoder
reads it (:class:`_Reading`). An encoded run counts the key characters it encodes, not
its own (32 hex digits, about 22 base64 characters: :meth:`_Forms.key_bytes`), as the raw
rule counts them, the ``sk-or-v1-`` every OpenRouter key starts with included:
  * raw: ``sk-or-v1-...``;
  * JSON-escaped: ``\\uXXXX`` (any hex case) and the short ``\\/``, ``\\"``, ``\\\\``, each
    behind any number of backslashes, so a JSON string nested in a JSON string is
    covered too;
  * URL-encoded: ``%XX`` (any hex case);
  * HTML numeric character references: ``&#115;``, ``&#x73;`` (an error page quoting it);
  * hex, either case (a server dumping the request's header bytes), and, in UTF-8 text, a
    hex dump written a byte at a time (:data:`_HEX_DUMP`: ``73 6b 2d``, ``hexdump -C``,
    ``xxd``, ``\\x73\\x6b``, ``0x73, 0x6b``), and its bytes as decimal numbers (``115, 107, 45``:
    a JSON byte array, as Node writes a ``Buffer``, pretty-printed or not; Go's ``[115 107]``;
    :func:`_decimal_spans`);
  * the key with its ASCII letters in upper or in lower case (an error text upper-cased:
    for a hex key, which OpenRouter's are after the prefix, that is the key itself);
  * base64 (standard and URL-safe alphabet) at each of the three byte alignments, so the
    key inside a longer encoded blob (``Basic ...``, ``Bearer ...``) is caught too, with
    line breaks anywhere in it (MIME wraps every 76 characters), raw or JSON-escaped;
  * base32, upper or lower case, at each of its five byte alignments;
  * in bytes, each of these as UTF-16 or UTF-32 text, either byte order (an error page sent
    ``charset=utf-16`` quoting the header): a NUL beside every ASCII character hid the key
    from every other spelling. The mask is written in that charset too.

A shorter run is left as it is: ``sk-or-v1-`` and a few characters more is how keys are
named in prose, and as likely in a model's answer as in an echo. A stream's raw bytes that
hold half the key or more in such pieces (8 characters or more each: comment lines, the ids
of its chunks) are not kept at all (:func:`scattered_key`). Callers mask *before*
clipping text (a clip of a key is still most of one) and scrub the assembled body of a
stream, not its pieces (see the engine).

A key shorter than :data:`MIN_MASKED` characters is a placeholder (vLLM's ``EMPTY``, a
local server's ``dummy``), not a secret, and is not masked: masking ``e`` or ``the``
turned every stored response into ``So *** plan is`` and every body's ``"choices"`` into
``"choic***s"`` (all samples failed, each paid for). Real keys are far longer
(OpenRouter's are 73 characters); :func:`placeholder_notice` says so once a run.
"""
from __future__ import annotations

import base64
import bisect
import bz2
import json
import os
import re
import string
import zlib
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping
from functools import lru_cache

from .errors import GenerateError
from .settings import ConfigError, api_key_problem, env_name_problem

__all__ = ["MIN_MASKED", "ApiKey", "MissingApiKey", "check_api_key", "compressed_key", "holds_key", "keys_read", "mask_scattered",
           "placeholder_notice", "read_api_key", "scattered_key", "scrub", "scrub_bytes", "scrub_message"]

_MASK = "***"
#: The one threshold for every secret and run: anything shorter is a placeholder or prose, and masking it corrupts text.
MIN_MASKED = 16
#: What is searched for first: a masked span (MIN_MASKED or more characters of a target)
#: holds a whole piece this long of its target, one starting at a multiple of it, so text
#: holding none of those pieces is let through after a few fast substring searches.
_PIECE = MIN_MASKED // 2


class MissingApiKey(GenerateError):
    """The environment variable that should hold the key is unset or empty."""


@dataclass(frozen=True)
class ApiKey:
    """A key whose repr/str never shows the value (so tracebacks and logs can't leak it)."""

    env_name: str
    _value: str = field(repr=False)

    @property
    def value(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"ApiKey(env={self.env_name!r}, value={_MASK})"

    __str__ = __repr__


def read_api_key(env_name: str = "OPENROUTER_API_KEY", *, required: bool = True) -> ApiKey | None:
    """The key from ``$env_name``; :class:`MissingApiKey` (naming the variable) if absent.
    A ``env_name`` that is no variable name (a key pasted in its place) is a
    :class:`~.settings.ConfigError` that does not quote it."""
    if why := env_name_problem(env_name):
        raise ConfigError(f"the API key's variable {why}")
    value = os.environ.get(env_name, "").strip()
    if not value:
        if required:
            raise MissingApiKey(f"environment variable {env_name} is not set (it must hold the API key)")
        return None
    _READ.add(value)
    return ApiKey(env_name, value)


def check_api_key(key: ApiKey | None, headers: Mapping[str, str] | None = None,
                  extra_body: Mapping[str, Any] | None = None) -> None:
    """:class:`~.settings.ConfigError` (naming the variable, never the text) for a key that
    cannot go into an ``Authorization`` header, before anything is sent: aiohttp refuses a
    CR or LF only per request, so every sample (or every probe) failed its attempts one by
    one. And for a header or ``request.extra_body`` that holds the key (in any spelling
    :func:`scrub` masks): it went to every provider, a server echoing it put it in errors
    unmasked, and the body is stored with every sample."""
    if key is None:
        return
    if why := api_key_problem(key.value):
        raise ConfigError(f"the API key in ${key.env_name} {why}")
    for name, value in (headers or {}).items():
        if holds_key(value, key):
            raise ConfigError(f"headers: header {name}: value holds the API key from ${key.env_name} (not shown "
                              "here): the key is sent only as Authorization; remove it from the header")
    if extra_body and holds_key(json.dumps(extra_body, ensure_ascii=False, default=str), key):
        raise ConfigError(f"request.extra_body holds the API key from ${key.env_name} (not shown here): the key is "
                          "sent only as Authorization; remove it from extra_body")


def holds_key(text: str, key: ApiKey | None) -> bool:
    """Whether ``text`` holds the key in a spelling :func:`scrub` masks."""
    return key is not None and scrub(text, key) != text


def placeholder_notice(key: ApiKey | None) -> str | None:
    """What to tell the user when ``key`` is too short to be masked, else None."""
    if key is None or len(key.value) >= MIN_MASKED:
        return None
    return (f"the key in ${key.env_name} is {len(key.value)} characters, a placeholder rather than a secret: it is "
            f"not masked in stored responses or messages (masking so short a text would corrupt them)")


#: Every key this process has read, whatever its variable is called (``api_key_env`` is the
#: user's to name): the console script's last-resort traceback is scrubbed of each.
_READ: set[str] = set()


def keys_read() -> tuple[str, ...]:
    """The values of every key :func:`read_api_key` has returned in this process."""
    return tuple(_READ)


def scrub(text: str, key: ApiKey | str | None) -> str:
    """``text`` with every spelling of the key replaced by ``***``."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or not text or len(value) < MIN_MASKED:
        return text
    return scrub_bytes(text.encode("utf-8", "surrogatepass"), value).decode("utf-8", "surrogatepass")


def scrub_bytes(data: bytes, key: ApiKey | str | None) -> bytes:
    """Like :func:`scrub` for raw bytes (a server that echoes the key must not get it stored)."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or not data or len(value) < MIN_MASKED:
        return data
    if b"\0" in data:  # UTF-8 text holds no NUL; text in a wide charset holds one beside every ASCII character
        data = _scrub_wide(data, value)
    return _scrub_narrow(data, value)


#: A piece of the key this long, found anywhere, counts toward :func:`scattered_key`.
SCATTER_PIECE = 8


def scattered_key(data: bytes, key: ApiKey | str | None) -> bool:
    """Whether ``data`` holds half the key or more in pieces shorter than :func:`scrub_bytes`
    masks (:data:`MIN_MASKED`), each :data:`SCATTER_PIECE` characters or more, anywhere: a
    stream can spread the key over comment lines or the ids of its chunks, which no byte
    pattern masks, and whoever reads the bytes joins them. Such bytes are not kept. Pieces
    found by chance only cost the keeping of raw bytes beside what was assembled from them.
    About 15 ms a MB for a hex key, 40 for a base62 one (bench/RESULTS.md)."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or not data or len(value) < MIN_MASKED:
        return False
    return _half_covered(value, _key_pieces(data, value))


def mask_scattered(data: bytes, key: ApiKey | str | None) -> bytes:
    """``data`` with every piece of the key :func:`scattered_key` counts masked, where together
    they hold half the key or more: an error text that quotes the key in pieces shorter than
    :func:`scrub_bytes` masks (``sk-or-v1-3f9a1c..d4a6f8b1c3e5d7a..``) is shown and stored,
    not the pieces. Every kept body goes through it, so it reads ``data`` once."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or not data or len(value) < MIN_MASKED or not value.isascii():  # (a piece never splits a character)
        return data
    found = _key_pieces(data, value)
    if not _half_covered(value, found):
        return data
    spans: list[tuple[int, int]] = []
    for start, _ in found:
        end = start + SCATTER_PIECE
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((start, end))
    return _spliced(data, [(start, end, _MASK_BYTES) for start, end in spans])


def _key_pieces(data: bytes, value: str) -> list[tuple[int, bytes]]:
    """Each place in ``data`` where a :data:`SCATTER_PIECE`-long piece of the key starts, in
    either case (an upper-cased hex key is the key), overlapping ones too (a 12-character piece
    holds five), with the piece lower-cased; in order. A piece lies inside a run of the key's
    own characters, so only such runs are looked into: in prose they are few and short."""
    pieces, runs = _pieces(value)
    found: list[tuple[int, bytes]] = []
    for m in runs.finditer(data.lower()):
        run, at = m.group(), m.start()
        for i in range(len(run) - SCATTER_PIECE + 1):
            if (piece := run[i:i + SCATTER_PIECE]) in pieces:
                found.append((at + i, piece))
    return found


def _half_covered(value: str, found: list[tuple[int, bytes]]) -> bool:
    """Whether the key's pieces :func:`_key_pieces` found cover half its characters or more."""
    if not found:
        return False
    pieces = {piece for _, piece in found}
    raw = value.encode("utf-8", "surrogatepass").lower()
    covered = bytearray(len(raw))
    for i in range(len(raw) - SCATTER_PIECE + 1):
        if raw[i:i + SCATTER_PIECE] in pieces:
            covered[i:i + SCATTER_PIECE] = b"\1" * SCATTER_PIECE
    return 2 * sum(covered) >= len(raw)


def scrub_message(text: str, key: ApiKey | str | None) -> str:
    """An error or notice text with the key masked: :func:`scrub`, then :func:`mask_scattered`."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or not text or len(value) < MIN_MASKED:
        return text
    data = mask_scattered(scrub_bytes(text.encode("utf-8", "surrogatepass"), value), value)
    return data.decode("utf-8", "surrogatepass")


@lru_cache(maxsize=8)
def _pieces(value: str) -> tuple[frozenset[bytes], re.Pattern[bytes]]:
    """The key's :data:`SCATTER_PIECE`-long pieces, lower-cased, and a pattern matching each
    run of that many or more of the characters they are made of (in lower-case text)."""
    raw = value.encode("utf-8", "surrogatepass").lower()
    pieces = frozenset(raw[i:i + SCATTER_PIECE] for i in range(len(raw) - SCATTER_PIECE + 1))
    alphabet = b"".join(re.escape(bytes([c])) for c in sorted(set(raw)))
    return pieces, re.compile(b"[" + alphabet + b"]{%d,}" % SCATTER_PIECE)


_GZIP_MAGIC = b"\x1f\x8b"
#: gzip inside gzip is looked into this deep; deeper is not kept (nothing legitimate nests so).
_MAX_GZIP_DEPTH = 4


def compressed_key(data: bytes, key: ApiKey | str | None, *, limit: int) -> str | None:
    """Why ``data`` (bytes kept as received, key already masked in them) must not be kept
    after all: it is compressed (a server sent a gzip, zlib, raw deflate or bzip2 body
    without ``Content-Encoding``, so nothing inflated it) and what it inflates to holds the
    key, where no spelling of the raw bytes shows it; or gzip that cannot be inflated within
    ``limit`` bytes to tell (any of them past ``limit``). None when it can be kept (it is not
    compressed, or holds no key)."""
    value = key.value if isinstance(key, ApiKey) else key
    if not value or len(value) < MIN_MASKED:
        return None
    for _ in range(_MAX_GZIP_DEPTH):
        kind = _compression(data)
        if kind is None:
            return None
        inflated = _unpacked(data, kind, limit)
        if inflated is None:
            if kind == "gzip":  # its magic says it is: unreadable, it cannot be checked
                return f"is gzip that does not inflate within {limit} bytes, so it cannot be checked for the API key"
            return None  # bytes that only looked compressed (no zlib or bzip2 stream, no deflate data)
        if inflated is _TOO_BIG:
            return f"is {kind} that does not inflate within {limit} bytes, so it cannot be checked for the API key"
        if scrub_bytes(inflated, value) != inflated:
            return f"is {kind} that holds the API key"
        data = inflated
    if _compression(data) is None:
        return None
    return f"is compressed more than {_MAX_GZIP_DEPTH} deep, so it cannot be checked for the API key"


#: The most compressed streams (gzip members) one body is inflated through: pbzip2 writes one
#: a 900 kB block; past it, the body cannot be checked (and is not kept).
_MAX_STREAMS = 64

#: What :func:`_unpacked` returns for a stream that inflates past its limit (or holds too many).
_TOO_BIG = b"\0too big"


def _compression(data: bytes) -> str | None:
    """How ``data`` looks compressed: gzip and bzip2 by their magic, zlib by its header (a
    deflate method and a check that 1 in 31 byte pairs pass), raw deflate (no header at
    all) only where the bytes are no UTF-8 text; else None."""
    if data.startswith(_GZIP_MAGIC):
        return "gzip"
    if data[:3] == b"BZh" and data[3:4].isdigit():
        return "bzip2"
    if len(data) >= 2 and data[0] & 0x0F == 8 and data[0] >> 4 <= 7 and (data[0] << 8 | data[1]) % 31 == 0:
        return "zlib"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "deflate" if data else None
    return None


def _unpacked(data: bytes, kind: str, limit: int) -> bytes | None:
    """Every stream of ``kind`` at the start of ``data`` inflated (gzip's members, streams one
    after another as pbzip2 writes them), bytes after them as they are; None where the first
    is no whole stream of that kind, or for gzip, whose magic says it is one, where any is
    cut or corrupt; :data:`_TOO_BIG` past ``limit`` or :data:`_MAX_STREAMS`."""
    out = bytearray()
    rest, first = data, True
    for _ in range(_MAX_STREAMS + 1):
        if not first and not (rest and (kind == "deflate" or _compression(rest[:4]) == kind)):
            break  # (a deflate stream has no header: the next one is tried, and what is none is kept as it is)
        unpack = bz2.BZ2Decompressor() if kind == "bzip2" else zlib.decompressobj(wbits=_WBITS[kind])
        try:
            inflated = unpack.decompress(rest, limit + 1 - len(out))
        except (OSError, ValueError, zlib.error):  # bz2 raises OSError on bad data
            if first or kind == "gzip":
                return None
            break  # what follows the streams is no stream: kept as it is
        out += inflated
        if len(out) > limit:
            return _TOO_BIG
        if not unpack.eof:
            if first or kind == "gzip":
                return None  # cut, or bytes that only began like a stream
            break
        rest, first = unpack.unused_data, False
    else:  # each stream copies what follows it: thousands of tiny ones were quadratic
        return _TOO_BIG
    return bytes(out + rest) if len(out) + len(rest) <= limit else _TOO_BIG


#: zlib's window bits for each kind it inflates: a gzip member, a zlib stream, raw deflate.
_WBITS = {"gzip": 31, "zlib": 15, "deflate": -15}


#: The wide charsets a server may send text in (``Content-Type: ...; charset=utf-16``), each
#: byte order. :func:`_scrub_wide` reads a text in each; a misaligned read of UTF-16 is the
#: other byte order's, so a key is found at either alignment.
_WIDE = ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")


def _scrub_wide(data: bytes, value: str) -> bytes:
    """``data`` with every spelling of the key masked in text encoded in a wide charset, the
    mask in that charset too (so the text still decodes). Where two readings overlap (UTF-16
    read one byte off is the other byte order), the one that masks more wins."""
    found = sorted((start, end, codec) for codec in _WIDE for start, end in _wide_spans(data, value, codec))
    if not found:
        return data
    taken: list[tuple[int, int, str]] = []
    for start, end, codec in found:  # each reading's spans are apart: only another's overlap
        if taken and start < taken[-1][1]:
            if end - start > taken[-1][1] - taken[-1][0]:
                taken[-1] = (start, end, codec)
            continue
        taken.append((start, end, codec))
    return _spliced(data, [(start, end, _MASK.encode(codec)) for start, end, codec in taken])


def _wide_spans(data: bytes, value: str, codec: str) -> list[tuple[int, int]]:
    """Where ``data``, read as ``codec``, spells the key: the stretches of characters a
    spelling can hold are decoded and searched together as UTF-8 text is, and each span
    found is mapped back to the bytes it was read from."""
    stretches = [m.span() for m in _wide_stretch(value, codec).finditer(data)]
    # decoded in one go, a NUL between stretches (no spelling holds one: no run spans two)
    joined = "\0".encode(codec).join(data[start:end] for start, end in stretches).decode(codec).encode("utf-8")
    spans = _masked_spans(joined, value)
    if not spans:
        return []
    starts = [0]
    for text in joined.split(b"\0"):
        starts.append(starts[-1] + len(text) + 1)
    out = []
    for start, end in spans:
        i = bisect.bisect_right(starts, start) - 1
        text = joined[starts[i] : starts[i + 1] - 1]
        at = stretches[i][0] + len(text[: start - starts[i]].decode("utf-8").encode(codec))
        out.append((at, at + len(text[start - starts[i] : end - starts[i]].decode("utf-8").encode(codec))))
    return out


@lru_cache(maxsize=16)
def _wide_stretch(value: str, codec: str) -> re.Pattern[bytes]:
    """A run of characters, encoded in ``codec``, that a spelling of the key may hold: enough
    of them to hold MIN_MASKED UTF-8 bytes (a character is at most four)."""
    spelling = _forms(value).spelling
    ascii_class = re.escape(bytes(b for b in range(0x80) if spelling[b] == ord("a")))
    unit = "A".encode(codec)
    at = unit.index(b"A")
    units = [re.escape(unit[:at]) + b"[" + ascii_class + b"]" + re.escape(unit[at + 1 :])]
    units += [re.escape(ch.encode(codec)) for ch in sorted(set(value)) if not ch.isascii()]
    least = MIN_MASKED if value.isascii() else -(-MIN_MASKED // 4)
    return re.compile(b"(?:" + b"|".join(units) + b"){%d,}" % least)


def _scrub_narrow(data: bytes, value: str) -> bytes:
    """:func:`scrub_bytes` over text as UTF-8 (or any ASCII-compatible charset) spells it."""
    spans = _masked_spans(data, value)
    if _may_hold_dump(data):  # rare: a dump of bytes, written a byte at a time
        spans = _merged(spans + _dump_spans(data, value))
    masks = [(start, end, _MASK_BYTES) for start, end in spans]
    if data.translate(_DECIMAL_CLASS).count(b"ds") >= MIN_MASKED - 1:  # rarer: the bytes as decimal numbers
        zeros = _decimal_spans(data, value)
        if zeros:  # each number a 0 (an array stays JSON, in a string or not), where no other mask is
            masks = sorted(masks + [(a, b, b"0") for a, b in zeros if not any(a < end and start < b
                                                                              for start, end in spans)])
    return _spliced(data, masks) if masks else data


#: What stands between two numbers of a byte list: a comma or semicolon with any spaces or
#: line breaks around it (JSON, pretty-printed at any depth or not; a log), or spaces alone
#: (Go's ``%v``); a line break also as JSON escapes it (a pretty body quoted in a string).
_SPACE = rb"(?:[ \t\r\n]|\\[nrt])"
_DECIMAL_SEPARATOR = rb"(?:%s{0,64}[,;]%s{0,64}|%s{1,64})" % (_SPACE, _SPACE, _SPACE)
_DECIMAL = re.compile(rb"[0-9]{1,3}")
#: A digit as ``d``, what may stand between numbers as ``s``: a run of :data:`MIN_MASKED`
#: numbers holds that many ``ds`` less one, told in C before any pattern runs.
_DECIMAL_CLASS = bytes(ord("d") if chr(b).isdigit() and b < 0x80 else ord("s") if chr(b) in " \t\r\n,;\\" else ord(".")
                       for b in range(256))


#: A run of decimal numbers (of up to three digits: a byte's), each after a separator. It
#: always matches (one number at least), so the search goes on after it, never back into it:
#: one pass, linear in the body (a pattern that needed sixteen numbers failed inside a run of
#: fifteen and started again at its next digit).
_NUMBER_RUN = re.compile(rb"[0-9]{1,3}(?:%s[0-9]{1,3}(?![0-9]))*+" % _DECIMAL_SEPARATOR)


def _decimal_spans(data: bytes, value: str) -> list[tuple[int, int]]:
    """Each number of a run of decimal numbers (:data:`_NUMBER_RUN`, :data:`MIN_MASKED` or
    more: the key's bytes as a JSON byte array, as Node writes a ``Buffer``, pretty-printed
    at any depth or not; Go's ``[115 107]``; C's ``%03d``) that spells the key: the run read
    as bytes and searched as any text is, each byte's number masked alone."""
    out = []
    for run in _NUMBER_RUN.finditer(data):
        if run.end() - run.start() < 2 * MIN_MASKED - 1:  # (most runs: a number or two)
            continue
        text = run[0]
        values = list(map(int, _DECIMAL.findall(text)))  # in C: a run may be a MB of numbers
        if len(values) < MIN_MASKED:
            continue
        try:
            spelled = bytes(values)
        except ValueError:  # a number past a byte's: it spells nothing of the key
            spelled = bytes(v if v < 256 else 0 for v in values)
        spans = _masked_spans(spelled, value)
        if spans:  # rare: where each number is, only then
            at = [n.span() for n in _DECIMAL.finditer(text)]
            out += [(run.start() + a, run.start() + b) for start, end in spans for a, b in at[start:end]]
    return out


#: A hex dump of :data:`MIN_MASKED` bytes or more written a byte at a time, as an error page
#: or a log dumps a request's header: one or two separators between bytes (``73 6b 2d``,
#: ``73:6B``, ``73, 6b``, ``73.6b``, ``73_6b``, ``73|6b``, ``73;6b``, ``73/6b``, quoted-printable's
#: ``=73=6B``, its lines wrapped by soft breaks ``=\r\n``, a line of ``hexdump -C``), ``xxd``'s
#: two-byte groups (``736b 2d6f``,
#: a line each), or a prefix to each byte (``\x73\x6b`` behind up to four backslashes, as
#: JSON escapes it; ``0x73, 0x6b``). Every repeat is bounded, a separator is never a digit
#: and the runs are possessive (a run that cannot end as the pattern ends is never given
#: back a byte at a time from each start), so it runs in linear time.
_HEX_DUMP = re.compile(rb"[0-9a-fA-F]{2}(?:(?:[ :,\-._|;/=]{1,2}|=\r?\n=)[0-9a-fA-F]{2}){%d,}+|[0-9a-fA-F]{4}(?: [0-9a-fA-F]{4}){%d,}+"
                       rb"|(?:(?:\\{1,4}x|0[xX])[0-9a-fA-F]{2}[ ,]{0,2}){%d,}+"
                       % (MIN_MASKED - 1, MIN_MASKED // 2 - 1, MIN_MASKED))
_DUMPED_BYTE = re.compile(rb"(?:\\{1,4}x|0[xX])?([0-9a-fA-F]{2})")


#: Each byte as its class in a hex dump: a hex digit ``h``, a separator ``s``, ``x`` (either
#: case) and a backslash ``b`` (a prefix's), else ``.``.
_DUMP_CLASS = bytes(ord("h") if chr(b) in string.hexdigits else ord("s") if chr(b) in " :,-._|;/="
                    else ord("x") if chr(b) in "xX" else ord("b") if chr(b) == "\\" else ord(".") for b in range(256))
#: :data:`_HEX_DUMP`'s forms, spelled in those classes: one separator, two (``, ``), a line of
#: ``hexdump -C`` (two after the eighth byte), ``xxd``'s groups, then prefixed ``0x`` (with no
#: separator, one or two), then ``\x`` behind one to four backslashes (JSON), likewise.
_DUMP_FORMS = (b"hhs" * (MIN_MASKED - 1) + b"hh", b"hhss" * (MIN_MASKED - 1) + b"hh",
               b"hhs" * 7 + b"hhss" + b"hhs" * 7 + b"hh", b"hhhhs" * (MIN_MASKED // 2 - 1) + b"hhhh",
               *((b"hxhh" + sep) * (MIN_MASKED - 1) + b"hxhh" for sep in (b"", b"s", b"ss")),
               *((b"b" * n + b"xhh" + sep) * (MIN_MASKED - 1) + b"b" * n + b"xhh"
                 for n in (1, 2, 3, 4) for sep in (b"", b"s", b"ss")))
#: What every form but the prefixed ones holds (those hold :data:`MIN_MASKED` of ``xhh``).
_DUMP_SIGNS = (b"hhshhshhshh", b"hhsshhsshh", b"hhhhshhhhshhhh")


def _may_hold_dump(data: bytes) -> bool:
    """Whether ``data`` may hold a :data:`_HEX_DUMP`, told in C (a translation, a search a
    form): the dump's own pattern costs 80 ms a MB run over any body. Quoted-printable's soft
    line breaks are read as it reads them, gone: a short key across one had no 16 bytes on
    either line, so the pattern that reads across it never ran (a reviewer's)."""
    if b"=\n" in data or b"=\r\n" in data:
        data = data.replace(b"=\r\n", b"").replace(b"=\n", b"")
    classes = data.translate(_DUMP_CLASS)
    if not any(sign in classes for sign in _DUMP_SIGNS) and classes.count(b"xhh") < MIN_MASKED:  # most text
        return False
    return any(form in classes for form in _DUMP_FORMS)


def _dump_spans(data: bytes, value: str) -> list[tuple[int, int]]:
    """Where a hex dump (:data:`_HEX_DUMP`) spells the key: its digits, read without what
    stands between bytes, searched as hex is, each span mapped back to the dump."""
    out = []
    for dump in _HEX_DUMP.finditer(data):
        text = dump[0]  # (each dump[0] is a copy of the whole run: once per byte, the square of its length)
        digits = b"".join(_DUMPED_BYTE.findall(text))  # in C: a dump may be a MB
        spans = _masked_spans(digits, value)
        if not spans:
            continue
        at = [m.start(1) for m in _DUMPED_BYTE.finditer(text)]  # where each byte's two digits are (rare: only then)
        for start, end in spans:
            first, last = start, end - 1  # digits; each maps to its byte's place, plus 0 or 1
            out.append((dump.start() + at[first // 2] + first % 2, dump.start() + at[last // 2] + last % 2 + 1))
    return out


_MASK_BYTES = _MASK.encode()


def _spliced(data: bytes, spans: list[tuple[int, int, bytes]]) -> bytes:
    """``data`` with each of ``spans`` (start, end, mask; in order, apart) replaced by its mask
    (the mask in the charset of the text it replaces)."""
    out: list[bytes] = []
    last = 0
    for start, end, mask in spans:
        out += (data[last:start], mask)
        last = end
    out.append(data[last:])
    return b"".join(out)


def _masked_spans(data: bytes, value: str) -> list[tuple[int, int]]:
    """Where ``data`` spells MIN_MASKED or more characters of the key (see the module
    docstring), in order, overlapping ones merged."""
    forms = _forms(value)
    stretches = [m.span() for m in _STRETCH.finditer(data.translate(forms.spelling))]
    joined = b" ".join(data[start:end] for start, end in stretches)
    spans = []
    for reading in forms.readings:
        runs = _runs(reading.read(joined), forms)
        if runs:  # rare: the common case ends without mapping anything back
            wheres = [_joins(stretches), *reading.wheres(joined)]
            spans += [_original(_back(span, wheres), data) for span in runs]
    return _merged(spans)


#: (view start, view end, data start, data end): that part of a view (text as a decoder
#: reads it) was read from that part of the data; after it, the two advance together.
_Unit = tuple[int, int, int, int]


@dataclass(frozen=True)
class _Reading:
    """One way a decoder reads the data: line breaks skipped (raw ones, then ``breaks``),
    then ``escapes`` decoded; None where this reading has none."""

    breaks: re.Pattern[bytes] | None
    escapes: re.Pattern[bytes] | None

    def read(self, data: bytes) -> bytes:
        """The view, fast: raw line breaks dropped in C, each escape read through a cache.
        Every escaped break and every escape starts with ``\\``, ``%`` or ``&#``: data with
        none (most bodies, and every base64 blob) is read without running the patterns at all."""
        if self.breaks is not None:
            data = data.translate(None, b"\r\n")
        if b"\\" not in data and b"%" not in data and b"&#" not in data:
            return data
        if self.breaks is not None:
            data = self.breaks.sub(b"", data)
        return data if self.escapes is None else self.escapes.sub(lambda m: _read_unit(m[0]), data)

    def wheres(self, data: bytes) -> list[list[_Unit]]:
        """:meth:`read` again, one step at a time, keeping where each step's units were."""
        out = []
        for units in ((_RAW_BREAKS, self.breaks) if self.breaks is not None else ()) + (self.escapes,):
            data, where = _decoded(data, units)
            out.append(where)
        return out


@dataclass(frozen=True)
class _Target:
    """One spelling of the key searched for, and how its characters map to the key's bytes."""

    text: bytes
    kind: str  # "raw" (the UTF-8 bytes), "hex", "base64", "base32"
    #: base64, base32: the key's bytes follow ``shift`` zero bytes in the encoded stream, and the
    #: text starts at bit ``start_bit`` of it (its first character that depends on the key alone)
    shift: int = 0
    start_bit: int = 0


@dataclass(frozen=True)
class _Forms:
    raw: bytes  # the key's UTF-8
    targets: tuple[_Target, ...]  # the key's UTF-8, its hex and base32 (either case), its base64 (each alphabet)
    pieces: dict[bytes, tuple[tuple[int, int], ...]]  # each target's sampled pieces: (target, offset)
    pieces32: dict[bytes, tuple[tuple[int, int], ...]]  # the base32 targets' (looked for only in base32 text)
    readings: tuple[_Reading, ...]
    spelling: bytes  # a translate table: b"a" for each byte a spelling of a target can hold, else b" "

    def key_bytes(self, view: bytes, start: int, end: int, i: int, low: int) -> int:
        """How many whole bytes of the key ``view[start:end]`` spells, where it agrees with
        target ``i`` placed at ``low``: each byte of the raw key, one per two hex digits,
        and for base64 every byte whose bits the run's characters carry, and those of a
        byte it shares with the character beside it when that character's bits of the byte
        agree too (base64 of 16 key characters behind other bytes, ``Bearer KEY``, shares
        its first and last with their neighbours). The one measure of every spelling: a
        hex or base64 run is masked for as many key characters as a raw one, not for as
        many characters of its own (16 hex digits of ``sk-or-v1-`` hold none but the
        public prefix every OpenRouter key starts with)."""
        target = self.targets[i]
        first, last = start - low, end - low  # characters of the target
        if target.kind == "raw":
            return last - first
        if target.kind == "hex":
            return last // 2 - (first + 1) // 2
        bits, values = (5, _B32_VALUE) if target.kind == "base32" else (6, _B64_VALUE)
        a, b = target.start_bit + bits * first, target.start_bit + bits * last  # bits of the encoded stream
        lo, hi = -(-a // 8), b // 8  # whole stream bytes inside
        if a % 8:  # a byte begun in the characters before: its first bits must agree there
            n = a % 8
            chars = -(-n // bits)
            v = _value(view, start - chars, start, bits, values)
            if v >= 0 and v & ((1 << n) - 1) == self._stream_byte(a // 8, target.shift) >> (8 - n):
                lo = a // 8
        if b % 8:  # one ended in the characters after
            n = 8 - b % 8
            chars = -(-n // bits)
            v = _value(view, end, end + chars, bits, values)
            if v >= 0 and v >> (bits * chars - n) == self._stream_byte(b // 8, target.shift) & ((1 << n) - 1):
                hi = b // 8 + 1
        shift = target.shift
        return max(0, min(hi, shift + len(self.raw)) - max(lo, shift))

    def _stream_byte(self, k: int, shift: int) -> int:
        return self.raw[k - shift] if 0 <= k - shift < len(self.raw) else -1


#: A base64 character's value, either alphabet (-1: none); a base32 one's, either case.
_B64_VALUE = [-1] * 256
for _i, _c in enumerate(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"):
    _B64_VALUE[_c] = _i
_B64_VALUE[ord("-")], _B64_VALUE[ord("_")] = 62, 63
_B32_VALUE = [-1] * 256
for _i, _c in enumerate(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"):
    _B32_VALUE[_c] = _B32_VALUE[bytes([_c]).lower()[0]] = _i


def _value(view: bytes, i: int, j: int, bits: int, values: list[int]) -> int:
    """The bits ``view[i:j]`` encodes (``bits`` a character), or -1 where that is outside
    the view or not all characters of the encoding."""
    if i < 0 or j > len(view):
        return -1
    out = 0
    for c in view[i:j]:
        if (v := values[c]) < 0:
            return -1
        out = out << bits | v
    return out


#: Translate tables: b"a" for base32's characters in upper case (and in lower), else b" ".
_BASE32_UPPER = bytes(ord("a") if chr(b) in "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567" else ord(" ") for b in range(256))
_BASE32_LOWER = bytes(ord("a") if chr(b) in "abcdefghijklmnopqrstuvwxyz234567" else ord(" ") for b in range(256))


def _base32_stretches(view: bytes) -> list[tuple[int, int]]:
    """The runs of ``view`` in base32's alphabet, one case throughout, long enough to spell
    MIN_MASKED characters (an encoder writes one case; base64 text, mixing both, rarely has
    such a run: a body's base64 blobs are not searched for base32 whole)."""
    out: list[tuple[int, int]] = []
    for table in (_BASE32_UPPER, _BASE32_LOWER):
        marks = view.translate(table)
        if b"a" * MIN_MASKED in marks:
            out += [m.span() for m in _STRETCH.finditer(marks)]
    return out

#: Bytes any spelling of any key may use: base64's (both alphabets, which hold hex and the
#: letters of ``\\u``, ``\\n``, ``\\r``), escapes' and line breaks.
_SPELLING = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_%\\\r\n&#;"
_STRETCH = re.compile(b"a" * MIN_MASKED + b"a*")  # a literal start: found by a fast prefix search
_RAW_BREAKS = re.compile(rb"[\r\n]")


@lru_cache(maxsize=4)
def _forms(value: str) -> _Forms:
    raw = value.encode("utf-8")
    # hex: a server that dumps headers as bytes
    found = {raw: _Target(raw, "raw"), **{h: _Target(h, "hex") for h in (raw.hex().encode(), raw.hex().upper().encode())}}
    # the key in the other case, a server's error text upper-cased (a hex key is as good in either)
    for cased in (raw.upper(), raw.lower()):
        found.setdefault(cased, _Target(cased, "raw"))
    for shift in range(3):
        enc = base64.b64encode(b"\0" * shift + raw)
        # characters that depend on the key's bytes alone: skip the shift's lead-in and the tail
        first = (shift * 8 + 5) // 6
        piece = enc[first : ((shift + len(raw)) * 8) // 6]
        for text in (piece, piece.replace(b"+", b"-").replace(b"/", b"_")):
            found.setdefault(text, _Target(text, "base64", shift, 6 * first))
    for shift in range(5):  # base32 (RFC 4648), at each of its five byte alignments, in either case
        enc = base64.b32encode(b"\0" * shift + raw)
        first = (shift * 8 + 4) // 5
        piece = enc[first : ((shift + len(raw)) * 8) // 5]
        for text in (piece, piece.lower()):
            found.setdefault(text, _Target(text, "base32", shift, 5 * first))
    kept = tuple(found[t] for t in sorted(found) if len(t) >= MIN_MASKED)
    pieces: dict[bytes, list[tuple[int, int]]] = {}
    pieces32: dict[bytes, list[tuple[int, int]]] = {}
    for i, target in enumerate(kept):
        into = pieces32 if target.kind == "base32" else pieces
        for at in range(0, len(target.text) - _PIECE + 1, _PIECE):
            into.setdefault(target.text[at : at + _PIECE], []).append((i, at))
    used = set(raw + _SPELLING)  # base64 whole: a blob in it is one stretch, not one per unused letter
    spelling = bytes(ord("a") if b in used else ord(" ") for b in range(256))
    return _Forms(raw, kept, {p: tuple(places) for p, places in pieces.items()},
                  {p: tuple(places) for p, places in pieces32.items()}, _readings(value), spelling)


def _readings(value: str) -> tuple[_Reading, ...]:
    """Every escape decoded, nested ones too, and line breaks skipped. A key that holds what
    reads as an escape or an escaped line break (``%41``, ``%0D``, a backslash) is also looked for in JSON alone, in URL
    encoding alone, in HTML character references alone (an error page quoting the key's
    ``%20`` or ``\\'`` as they are, the rest entity by entity), as it is, and, where it holds
    a backslash, through one level of JSON (where ``\\\\n`` is a backslash and an ``n``,
    not a line break)."""
    every = _reading(value, json=True, percent=True)
    assert every.escapes is not None and every.breaks is not None
    raw = value.encode("utf-8")
    if "\\" not in value and not every.escapes.search(raw) and not every.breaks.search(raw):  # (%0D reads as a break)
        return (every,)
    alone = (_reading(value, json=True, percent=False), _reading(value, json=False, percent=True),
             _reading(value, json=False, percent=False, entity=True), _Reading(None, None))
    if "\\" not in value:
        return (every, *alone)
    u = b"|".join([rb"00[2-7][0-9a-fA-F]", *_wide(value)])
    return every, *alone, _Reading(None, re.compile(rb"\\(?:u(?:" + u + rb")|[/\"'\\])"))


#: A whole run of backslashes, tried only where the run starts and never given back: what
#: follows it in an escape (``n``, ``u``, ``/``) is no backslash, so a shorter run cannot
#: match where the whole one fails, and trying every start of the run backtracking through
#: the rest cost O(n**2) on a body of backslashes (80 kB: a minute, in the event loop).
#: Its first backslash is matched before the look-behind (which then looks past it), so
#: the pattern starts with a literal and the regex engine skips ahead to each backslash.
_RUN = rb"\\(?<!\\\\)\\*+"


def _reading(value: str, *, json: bool, percent: bool, entity: bool | None = None) -> _Reading:
    """The line breaks a decoder skips (raw, or escaped in JSON or a URL), and the escapes
    that decode to a character a target can hold (a key's or base64's). Each alternative
    starts with ``\\``, ``%`` or ``&#``: :meth:`_Reading.read` relies on that to skip data
    holding none, and the regex engine skips straight to the next candidate."""
    if entity is None:  # the reading of every escape has them; a reading of one kind alone does not
        entity = json and percent
    high = sorted({f"{b:02x}" for b in value.encode("utf-8") if b >= 0x80})
    short = "/" + "".join(sorted(set(value) & set("\"'")))
    u = b"|".join([rb"00[2-7][0-9a-fA-F]", *_wide(value)])
    p = b"|".join([rb"[2-7][0-9a-fA-F]", *(_hex_ci(h) for h in high)])
    breaks = []
    escapes = []
    if percent:
        breaks.append(rb"%0[aAdD]")
        escapes.append(rb"%(?:" + p + rb")")
    if entity:  # HTML's numeric character references
        escapes.append(_ENTITY)
    if json:
        breaks.append(_RUN + rb"(?:[rn]|u000[aAdD])")
        escapes.append(_RUN + rb"(?:u(?:" + u + rb")|[" + re.escape(short.encode()) + rb"])")
        if "\\" in value:  # "\\" in JSON, "\\\\" nested: one backslash
            escapes.append(rb"\\\\+")
    return _Reading(re.compile(b"|".join(breaks)) if breaks else None, re.compile(b"|".join(escapes)))


#: An HTML numeric character reference to a printable ASCII character (``&#115;``, ``&#x73;``):
#: an error page that quotes the request header entity by entity.
_ENTITY = rb"&#(?:0*(?:3[2-9]|[4-9][0-9]|1[01][0-9]|12[0-6])|[xX]0*[2-7][0-9a-fA-F]);"


def _wide(value: str) -> list[bytes]:
    """The JSON escapes of ``value``'s characters beyond ASCII, without the first ``\\u``."""
    return sorted({rb"\\+u".join(map(_hex_ci, _utf16(ch))) for ch in value if not ch.isascii()})


def _utf16(ch: str) -> list[str]:
    """The hex of ``ch``'s JSON ``\\u`` escape: two (a surrogate pair) beyond the BMP."""
    code = ord(ch)
    if code < 0x10000:
        return [f"{code:04x}"]
    code -= 0x10000
    return [f"{0xD800 + (code >> 10):04x}", f"{0xDC00 + (code & 0x3FF):04x}"]


def _hex_ci(digits: str) -> bytes:
    return b"".join(b"[" + d.lower().encode() + d.upper().encode() + b"]" if d.isalpha() else d.encode()
                    for d in digits)


def _joins(stretches: list[tuple[int, int]]) -> list[_Unit]:
    """Where each stretch starts in the data and in their join. The stretches are the runs of
    data of MIN_MASKED or more bytes that a spelling can hold; text between them (prose,
    numbers, JSON punctuation) can hold no run, so most of a body is never decoded."""
    where: list[_Unit] = []
    pos = 0
    for start, end in stretches:
        where.append((pos, pos, start, start))
        pos += end - start + 1
    return where


def _decoded(data: bytes, units: re.Pattern[bytes] | None) -> tuple[bytes, list[_Unit]]:
    """``data`` with each of ``units`` read as a decoder reads it, and where each unit lies in both."""
    parts: list[bytes] = []
    where: list[_Unit] = [(0, 0, 0, 0)]
    last = shift = 0
    for m in units.finditer(data) if units is not None else ():
        text = _read_unit(m[0])
        parts += (data[last : m.start()], text)
        start = m.start() - shift
        where.append((start, start + len(text), m.start(), m.end()))
        shift += m.end() - m.start() - len(text)
        last = m.end()
    parts.append(data[last:])
    return b"".join(parts), where


@lru_cache(maxsize=1024)
def _read_unit(text: bytes) -> bytes:
    """What a decoder reads for one unit: a line break nothing, an escape its character."""
    if text.startswith(b"%"):
        return b"" if text[1:2] == b"0" else bytes([int(text[1:], 16)])
    if text.startswith(b"&#"):
        digits = text[2:-1]
        return bytes([int(digits[1:], 16) if digits[:1] in (b"x", b"X") else int(digits)])
    body = text.lstrip(b"\\")
    if not body:
        return b"\\"  # a run of backslashes: one, escaped once or more
    if body[:1] == b"u":
        codes = [int(h, 16) for h in re.findall(rb"[0-9a-fA-F]{4}", body)]
        if codes[0] in (0x0A, 0x0D):
            return b""
        return "".join(map(chr, codes)).encode("utf-16-le", "surrogatepass").decode("utf-16-le").encode()
    return b"" if body in (b"\r", b"\n", b"r", b"n") else body


def _runs(view: bytes, forms: _Forms) -> list[tuple[int, int]]:
    """Spans of ``view`` that spell MIN_MASKED or more consecutive characters of the key in
    one of its spellings (:meth:`_Forms.key_bytes`), each as long as view and target agree,
    overlapping ones merged. Hits are taken in order and one inside a span already found is
    passed over: what its run could add past that span is shorter than MIN_MASKED
    characters of its target (so fewer key characters), or holds a later hit of its own."""
    hits = _hits(view, forms.pieces, 0, len(view))
    for start, end in _base32_stretches(view):  # rare: base32 pieces are looked for only there
        hits += _hits(view, forms.pieces32, start, end)
    hits.sort(key=lambda hit: hit[0])
    spans = []
    reach = 0
    for at, places in hits:
        if at + _PIECE <= reach:
            continue
        for i, offset in places:
            start, end = _grown(view, at, forms.targets[i].text, offset)
            if end - start >= MIN_MASKED and forms.key_bytes(view, start, end, i, at - offset) >= MIN_MASKED:
                spans.append((start, end))
                reach = max(reach, end)
    return _merged(spans)


def _hits(view: bytes, pieces: dict[bytes, tuple[tuple[int, int], ...]], start: int,
          end: int) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    """Where in ``view[start:end]`` each of ``pieces`` is, with its places in the targets: a
    search per piece, or in a stretch shorter than there are pieces, a lookup per window."""
    out = []
    if end - start < len(pieces):
        for at in range(start, end - _PIECE + 1):
            if (places := pieces.get(view[at : at + _PIECE])) is not None:
                out.append((at, places))
        return out
    for piece, places in pieces.items():
        at = view.find(piece, start, end)
        while at != -1:
            out.append((at, places))
            at = view.find(piece, at + 1, end)
    return out


def _grown(view: bytes, at: int, target: bytes, offset: int) -> tuple[int, int]:
    """The run around ``view[at:]`` holding ``target[offset:]``'s piece: as far each way as the two agree."""
    low = at - offset
    if low >= 0 and view.startswith(target, low):  # what an echo of the whole key is
        return low, low + len(target)
    start = at
    while start > max(low, 0) and view[start - 1] == target[start - 1 - low]:
        start -= 1
    end, high = at + _PIECE, min(low + len(target), len(view))
    while end < high and view[end] == target[end - low]:
        end += 1
    return start, end


def _back(span: tuple[int, int], wheres: list[list[_Unit]]) -> tuple[int, int]:
    """Where the view's ``span`` was read from, through each step of the reading (the last
    first): every unit it covers whole."""
    start, end = span
    for where in reversed(wheres):
        start, end = _data_at(start, where, end=False), _data_at(end - 1, where, end=True)
    return start, end


def _original(span: tuple[int, int], data: bytes) -> tuple[int, int]:
    """``span`` of ``data`` widened to whole UTF-8 characters (a masked text stays decodable)."""
    start, end = span
    while start > 0 and 0x80 <= data[start] < 0xC0:
        start -= 1
    while end < len(data) and 0x80 <= data[end] < 0xC0:
        end += 1
    return start, end


def _data_at(pos: int, where: list[_Unit], *, end: bool) -> int:
    """The data offset of view byte ``pos``: where its unit starts (or, ``end``, where it ends)."""
    v_start, v_end, d_start, d_end = where[bisect.bisect_right(where, pos, key=lambda u: u[0]) - 1]
    if pos < v_end:  # inside the unit's text
        return d_end if end else d_start
    return d_end + pos - v_end + end


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` in order, overlapping ones as one (each becomes one ``***``)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return out

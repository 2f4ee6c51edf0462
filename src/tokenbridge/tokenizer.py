"""Load the target model's tokenizer exactly as its serving stack builds it.

Two folder layouts are supported:

* tiktoken folders (the Kimi family): ``tiktoken.model`` + ``tokenizer_config.json``.
  Every id above the BPE ranks is a special token. Encoding follows the serving path
  (transformers' ``tokenize``): special-token text is split out first and becomes its
  special id, then each ordinary piece goes through the model's own ``encode``
  (400,000-character windows, runs of >25,000 same-class characters cut). Text that
  holds no marker (most completion text) goes straight to tiktoken's ordinary encode,
  which gives the same ids without the special-token scan; prompts are encoded piece by
  piece between markers, with a bounded cache for the pieces prompts share. Where the
  pattern is one proven in :mod:`.pattern` (Kimi's, o200k's), tiktoken is given it with
  its plain alternatives in one group: the same pieces, found with a quarter less work.
* ``tokenizer.json`` folders, through Hugging Face ``tokenizers``; or, where the folder
  also holds the BPE ranks as a ``.tiktoken`` file (gpt-oss: ``o200k_base.tiktoken``)
  and the tokenizer.json is a plain byte-level BPE over exactly those ranks (one split
  regex, no normaliser, ``ignore_merges``), through tiktoken with that regex and the
  tokenizer.json's added tokens: the same ids, several times faster, and lossless.

A Hub repo id is resolved to a local folder with ``huggingface_hub`` (tokenizer files
only); offline and not cached is a clear :class:`TokenizerError`.
"""

from __future__ import annotations

import ast
import binascii
import os
import re
import stat
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from .pattern import CUT_PROVEN, KIMI_PAT_STR, grouped_pattern, last_stable_cut

if TYPE_CHECKING:
    import tiktoken

__all__ = ["FOLDER_FILES", "KIMI_PAT_STR", "MAX_VOCAB_SIZE", "PROMPT_CACHE_BYTES", "EncodeError", "Tokenizer", "TokenizerError", "folder_files", "load_tokenizer",
           "marker_pattern", "marker_splitter"]

#: Kimi reserves this many ids above the BPE ranks for special tokens.
_KIMI_NUM_RESERVED = 256
#: The Kimi tokenizer encodes at most this many characters per tiktoken call...
_WINDOW_CHARS = 400_000
#: ...and cuts any run of more than this many whitespace / non-whitespace characters.
_MAX_RUN_CHARS = 25_000
# A run longer than _MAX_RUN_CHARS, anchored at the start of its run so the scan is
# linear (an unanchored `\S{25001}` would rescan every suffix of a long run).
_RUN_PAST_MAX = "{" + str(_MAX_RUN_CHARS + 1) + "}"
_LONG_RUN = re.compile(r"(?<!\S)\S" + _RUN_PAST_MAX + r"|(?<!\s)\s" + _RUN_PAST_MAX)

#: Bound on one Tokenizer's prompt-piece cache (per process), in bytes as CPython counts
#: them: key string + 40 bytes per id (its tuple slot and int object, counted even where
#: the int is shared) + 150 per entry. 32 MiB holds about 800k prompt tokens.
PROMPT_CACHE_BYTES = 32 << 20

#: The largest vocabulary size tokenbridge takes (a flag, a config, a model's ``config.json``):
#: 2**24 (16,777,216). The largest real vocabularies are about 260k ids; vocab allocates a
#: count and a t2d entry per id, so an unbounded size was a numpy MemoryError (10**13) or
#: the OOM killer (10**9), not a message.
MAX_VOCAB_SIZE = 1 << 24
#: A piece costing more than this share of the bound is encoded but never cached, so one
#: huge prompt cannot flush the shared system prompts.
_CACHE_MAX_ENTRY_SHARE = 8
#: Above this many first characters of markers, one pattern of every marker splits and
#: searches (each group is one search of the text).
_MAX_GROUPS = 4

#: Every file of a tokenizer folder the loader may read (globs): what makes it that tokenizer.
FOLDER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tiktoken.model",
    "*.tiktoken",
    "tokenization_*.py",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
)
_HUB_FILES = [*FOLDER_FILES, "special_tokens_map.json", "generation_config.json"]


def folder_files(folder: Path) -> list[Path]:
    """The files of ``folder`` the loader may read (:data:`FOLDER_FILES`), sorted by name:
    a change to any of them is another tokenizer, and no other file matters."""
    found = {p for pattern in FOLDER_FILES for p in folder.glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: p.name)


class TokenizerError(Exception):
    """The tokenizer could not be found or read; the message names the file."""


class EncodeError(ValueError):
    """This text cannot be encoded by this tokenizer (``tokenizers`` refuses lone
    surrogates, which tiktoken replaces): a fault of the record, not of the tokenizer."""


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A loaded tokenizer: encode/decode plus the facts the gate needs.

    ``marker_ids`` maps every added-token id (special or not, e.g. ``</think>`` or the
    tool-call markers) to its text: these are the ids that text must never smuggle in.
    """

    name: str
    source: str
    kind: str
    vocab_size: int
    marker_ids: Mapping[int, str]
    chat_template: str | None
    config: Mapping[str, object]
    #: Byte-level BPE with no normaliser: decode(encode(s)) == s for all valid UTF-8.
    lossless: bool
    _encode: Callable[[str], list[int]] = field(repr=False)
    _decode_bytes: Callable[[Sequence[int]], bytes] = field(repr=False)
    _piece: Callable[[int], bytes] = field(repr=False)
    markers: Mapping[str, int] = field(init=False, repr=False)
    #: Text -> alternating pieces: ordinary text (str, possibly empty) and marker ids
    #: (int), such that encoding each piece alone and concatenating equals ``encode``.
    #: None where that does not hold (``tokenizers`` folders): encode_prompt is encode.
    _split_markers: Callable[[str], list[str | int]] | None = field(default=None, repr=False)
    #: Encode text known to hold no marker (exactly ``encode`` on such text).
    _encode_plain: Callable[[str], list[int]] | None = field(default=None, repr=False)
    #: Whether text may hold marker text (False: its ids hold no marker id, exactly).
    #: None where only the ids can tell (``tokenizers`` folders).
    _may_hold_marker: Callable[[str], bool] | None = field(default=None, repr=False)
    #: ``(ids, marker_free)`` of completion text, encoded whole: None where ``encode``
    #: makes no cuts (see :meth:`encode_checked`).
    _encode_completion: Callable[[str], tuple[list[int], bool]] | None = field(default=None, repr=False)
    #: Where marker-free text splits whatever is appended to it (:func:`.pattern.last_stable_cut`;
    #: 0: nowhere); None where the pre-tokenizer's pattern is not one proven to.
    _stable_cut: Callable[[str], int] | None = field(default=None, repr=False)
    #: Whether text holds no marker's text, where :meth:`marker_free` cannot say (``tokenizers``
    #: folders): what :meth:`encode_appended` needs to cut such text; None: ``marker_free``.
    _no_marker_text: Callable[[str], bool] | None = field(default=None, repr=False)
    _prompt_cache: _PieceCache = field(init=False, repr=False)
    #: id -> whether it names a token (:meth:`has_id`), as the ids were asked about
    _id_known: dict[int, bool] = field(init=False, repr=False, default_factory=dict)
    #: How many ids the model's output layer has (``lm_head`` rows): the folder's
    #: ``config.json`` ``vocab_size`` where it has one (often more than the tokenizer's
    #: ids: padded), Kimi's reserved range where that pads to it; None where nothing says.
    #: A draft vocabulary's ``t2d`` must be this long for the trainers to load it.
    model_vocab_size: int | None = field(default=None, kw_only=True)
    #: where ``model_vocab_size`` came from: ``config.json``, or ``reserved range`` (Kimi's)
    model_vocab_from: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "markers", {t: i for i, t in self.marker_ids.items()})
        object.__setattr__(self, "_prompt_cache", _PieceCache(PROMPT_CACHE_BYTES))

    @property
    def output_vocab_size(self) -> int:
        """The target vocabulary a draft is mapped into: the model's when known, else the tokenizer's."""
        return self.model_vocab_size if self.model_vocab_size is not None else self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Encode like the model's tokenizer: marker text becomes its marker id."""
        return self._encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        """``encode(text)``, with the text between markers served from a bounded cache.

        Rendered prompts repeat the same pieces (system prompts, tool declarations,
        earlier turns of a conversation); each is encoded once per process while it stays
        in the cache (least recently used first out, :data:`PROMPT_CACHE_BYTES` in all).
        """
        split, plain = self._split_markers, self._encode_plain
        if split is None or plain is None:
            return self._encode(text)
        out: list[int] = []
        self._prompt_cache.extend(out, split(text), plain)
        return out

    def encode_checked(self, text: str) -> tuple[list[int], bool]:
        """``(ids, marker_free(text))`` of a completion's text, the marker test run once for
        both. The ids are ``encode(text)``'s, except that a folder whose tokenizer cuts long
        runs before encoding (Kimi's, :func:`split_long_runs`) encodes a completion whole:
        those cuts are the serving side's, made when it tokenizes a prompt, and a model
        sampling its completion token by token never made them (a cut inside a 25,000-
        character run of minified JSON moved a token boundary at the same count)."""
        if self._encode_completion is not None:
            return self._encode_completion(text)
        may, plain = self._may_hold_marker, self._encode_plain
        if may is None or plain is None or may(text):
            return self._encode(text), False
        return plain(text), True

    def encode_appended(self, text: str, ids: Sequence[int], suffixes: Sequence[str], *,
                        same_count: bool = False) -> list[tuple[list[int], bool] | None]:
        """:meth:`encode_checked` of ``text + s`` for each of ``suffixes``, where ``ids`` are
        ``text``'s own: readings that differ only in what follows a long text (a tail a
        streaming parser held back) re-encode it from its last stable cut on, not whole.
        ``same_count``: None, without building the ids, for a suffix that changes the count."""
        free_text = self.marker_free(text)
        plain = self._no_marker_text or self.marker_free
        cut = self._appended_cut(text, free_text or plain(text))
        tail = text[cut:]
        tail_ids, _ = self.encode_checked(tail) if cut > 0 else (list(ids), True)
        head = len(ids) - len(tail_ids)
        if cut > 0 and (head < 0 or list(ids[head:]) != tail_ids):  # not text's ids: encode whole
            cut, tail, tail_ids, head = 0, text, list(ids), 0
        edge = text[len(text) - self._marker_reach:] if self._marker_reach else ""
        out: list[tuple[list[int], bool] | None] = []
        for s in suffixes:
            # a marker in text + s that text lacks overlaps s: it starts in text's last characters
            crossing = not plain(edge + s)
            more, _ = self.encode_checked((text if crossing else tail) + s)
            if same_count and len(more) != len(ids if crossing else tail_ids):
                out.append(None)
                continue
            out.append((more if crossing or not head else [*ids[:head], *more], free_text and not crossing))
        return out

    def _appended_cut(self, text: str, plain: bool) -> int:
        """Where text that grows at its end may be re-encoded from (0: whole): its last stable
        cut (:func:`.pattern.last_stable_cut`), after its last marker where it holds marker
        text (markers split first), never within a marker's reach of the end of a text with
        markers, so a marker that a suffix could complete is seen whole."""
        if self._stable_cut is None:
            return 0
        if plain:
            return self._stable_cut(text)
        if self._split_markers is None:
            return 0
        start = _after_last_marker(text, self._split_markers)
        if start == 0 or len(text) - start < self._marker_reach:
            return 0
        return start + self._stable_cut(text[start:])

    @cached_property
    def _marker_reach(self) -> int:
        """How far back from the end of a text a marker may start and still reach past it."""
        return max(map(len, self.markers), default=1) - 1

    def marker_free(self, text: str) -> bool:
        """True when ``encode(text)`` certainly holds no marker id: the text holds no
        marker's text, by the same memchr-fast test ``encode`` itself runs (tiktoken
        layout). False means "look at the ids": it may hold one, or only they can say."""
        may = self._may_hold_marker
        return may is not None and not may(text)

    @property
    def prompt_cache_stats(self) -> dict[str, int]:
        """Hits, misses, entries and bytes held of the prompt-piece cache (this process)."""
        return self._prompt_cache.stats()

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self._decode_bytes(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (marker ids give their text); KeyError for an id
        that has none (a hole in the id space)."""
        return self._piece(token_id)

    def has_id(self, token_id: int) -> bool:
        """Whether ``token_id`` names a token of this tokenizer (in range, not a hole)."""
        if not 0 <= token_id < self.vocab_size:
            return False
        known = self._id_known.get(token_id)
        if known is None:  # asked of the decoder once per id: logprobs name an id per token
            try:
                self._piece(token_id)
                known = True
            except KeyError:
                known = False
            self._id_known[token_id] = known
        return known

    def unknown_id(self, ids: Sequence[int]) -> tuple[int, int] | None:
        """(position, id) of the first id that names no token of this tokenizer, or None.

        Ids from an API (ground truth, logprobs) may be out of range or a hole; ``decode``
        would raise on one. The whole list is decoded first, so a known list costs one decode."""
        if not ids:
            return None
        if min(ids) >= 0 and max(ids) < self.vocab_size:
            try:
                self._decode_bytes(ids)
            except KeyError:
                pass
            else:
                return None
        return next(((k, i) for k, i in enumerate(ids) if not self.has_id(i)), None)

    def token_id(self, marker: str) -> int:
        """The id of a marker token such as ``"</think>"``; KeyError if absent."""
        return self.markers[marker]

    @property
    def max_ordinary_id(self) -> int:
        """Ids above this are markers (tiktoken layout); used as a fast pre-check."""
        return min(self.marker_ids, default=self.vocab_size) - 1


class _PieceCache:
    """Least-recently-used map of text piece -> its ids, bounded in bytes.

    Ids are kept as tuples: a hit is copied into the caller's list in C without making
    new int objects (an ``array`` would be 8x smaller but a hit 6x slower to unpack).
    A lock keeps it consistent if one Tokenizer is shared by threads.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[tuple[int, ...], int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def ids(self, piece: str, encode: Callable[[str], list[int]]) -> list[int]:
        """One piece's ids (:meth:`extend` with one piece)."""
        out: list[int] = []
        self.extend(out, (piece,), encode)
        return out

    def extend(self, out: list[int], pieces: Iterable[str | int], encode: Callable[[str], list[int]]) -> None:
        """Append the ids of ``pieces`` to ``out``: an int is a marker's id, a text piece is
        served from the cache or encoded (the lock released meanwhile) and kept. One lock
        acquisition for a whole prompt's pieces, not one per piece."""
        lock, entries = self._lock, self._entries
        with lock:
            for piece in pieces:
                if isinstance(piece, int):
                    out.append(piece)
                    continue
                if not piece:
                    continue
                entry = entries.get(piece)
                if entry is not None:
                    entries.move_to_end(piece)
                    self._hits += 1
                    out += entry[0]
                    continue
                self._misses += 1
                lock.release()
                try:
                    ids = encode(piece)
                finally:
                    lock.acquire()
                out += ids
                self._keep(piece, ids)

    def _keep(self, piece: str, ids: list[int]) -> None:
        """Store a piece's ids (the lock held), oldest first out past the bound."""
        # key + tuple (8 bytes an id) + an int object per id + the dict node
        cost = sys.getsizeof(piece) + 40 * len(ids) + 150
        if cost * _CACHE_MAX_ENTRY_SHARE > self.max_bytes or piece in self._entries:
            return
        self._entries[piece] = (tuple(ids), cost)
        self._bytes += cost
        while self._bytes > self.max_bytes:
            _, (_, old) = self._entries.popitem(last=False)
            self._bytes -= old

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self._hits, "misses": self._misses, "entries": len(self._entries), "bytes": self._bytes}


def load_tokenizer(source: str | Path, *, revision: str | None = None) -> Tokenizer:
    """Load from a local folder, or a Hub repo id (tokenizer files only)."""
    return _load_cached(str(source), revision)


@lru_cache(maxsize=8)
def _load_cached(source: str, revision: str | None) -> Tokenizer:
    try:
        return _load_source(source, revision)
    except PermissionError as exc:  # a folder without search or read permission (exists() itself raises)
        raise TokenizerError(f"{exc.filename or source}: cannot read ({exc.strerror or exc})") from None


def _load_source(source: str, revision: str | None) -> Tokenizer:
    folder = Path(source).expanduser()
    if not folder.is_dir():
        if folder.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
            raise TokenizerError(f"{source}: not a tokenizer folder or a Hub repo id (owner/name)")
        folder = _hub_folder(source, revision)
    if _present(folder / "tiktoken.model"):
        tok = _load_tiktoken(folder, source)
    elif _present(folder / "tokenizer.json"):
        tok = _load_tiktoken_beside_json(folder, source) or _load_tokenizers(folder, source)
    else:
        raise TokenizerError(f"{folder}: has neither tiktoken.model nor tokenizer.json")
    size = _model_vocab_size(folder)
    if size is not None:
        object.__setattr__(tok, "model_vocab_size", size)
        object.__setattr__(tok, "model_vocab_from", "config.json")
    return tok


def _model_vocab_size(folder: Path) -> int | None:
    """``vocab_size`` of the model's ``config.json`` in ``folder`` (a multimodal model's
    ``text_config`` too), checked: a positive int no larger than ids may be."""
    path = folder / "config.json"
    try:
        config = _read_json(path)
    except TokenizerError:  # the tokenizer needs none of it: vocab warns that the model's size is unknown
        return None
    if not isinstance(config, dict):
        return None
    size = config.get("vocab_size")
    text = config.get("text_config")
    if size is None and isinstance(text, dict):
        size = text.get("vocab_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_VOCAB_SIZE:
        raise TokenizerError(f"{path}: vocab_size must be an integer in 1..{MAX_VOCAB_SIZE}, got {size!r}")
    return size


def _hub_folder(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise TokenizerError("huggingface_hub is needed to load a Hub repo id") from exc
    # The Hub's errors are OSError (HTTP, network, offline, missing repo or file) or
    # ValueError (a malformed repo id); anything else is a bug and keeps its traceback.
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_FILES))
    except (OSError, ValueError) as exc:
        try:
            return Path(
                snapshot_download(
                    repo_id, revision=revision, allow_patterns=_HUB_FILES, local_files_only=True
                )
            )
        except (OSError, ValueError):
            pass
        raise TokenizerError(
            f"{repo_id}: could not download the tokenizer from the Hub and it is not cached "
            f"({_hub_reason(exc)}). Pass a local folder, or run once with network access."
        ) from None


#: A Hugging Face access token as it can appear in an error text (header, URL).
_HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{20,}")
_REASON_CHARS = 400


def _hub_reason(exc: BaseException) -> str:
    """The Hub's error on one line, with the user's token masked (an HTTP error can quote
    the request's URL or headers) before it is clipped (a clipped token is still a token)."""
    from huggingface_hub import get_token

    from .generate.secrets import scrub

    text = scrub(" ".join(str(exc).split()), get_token())
    text = _HF_TOKEN.sub("***", text)
    if len(text) > _REASON_CHARS:
        text = text[:_REASON_CHARS] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _present(path: Path) -> bool:
    """Whether a tokenizer folder has the file ``path``: False where it has no such entry,
    True for a regular file (through links). Anything else there is the folder's error, said
    as such, not taken for an absent file: a link to nothing (a half-cleaned Hub cache; the
    built-in template stood in for a chat template linked so), a FIFO (its read hung the
    command), a folder."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise TokenizerError(f"{path}: a symlink to a missing file (a damaged download?)") from None
        return False
    except OSError as exc:  # a link loop, no permission
        raise TokenizerError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        from .fsio import kind_of

        raise TokenizerError(f"{path}: is {kind_of(info.st_mode)}, not a regular file")
    return True


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a tokenizer folder ({} where the file is absent): anything else,
    a list, a number, nesting too deep to read, is the folder's error, said as such."""
    from .jsonl import loads_document

    if not _present(path):
        return {}
    try:
        data = loads_document(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise TokenizerError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: must hold a JSON object, not {_json_type(data)}")
    return data


def _json_type(value: object) -> str:
    """What a JSON value is, in JSON's words."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _read_text(path: Path) -> str:
    """A text file of a tokenizer folder, as UTF-8; its errors name it."""
    _present(path)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise TokenizerError(f"{path}: cannot read ({exc})") from None


def _chat_template(folder: Path, config: Mapping[str, object]) -> str | None:
    """The folder's chat template, as transformers finds it: ``chat_template.jinja``, else
    ``chat_template.json``'s, else ``tokenizer_config.json``'s (a string, or a list of
    named templates: "default"). One of another shape is refused: dropped silently, the
    built-in renderer would stand in for the template the user gave."""
    jinja = folder / "chat_template.jinja"
    if _present(jinja):
        return _read_text(jinja)
    js = folder / "chat_template.json"
    if _present(js):
        data = _read_json(js)
        if "chat_template" in data:
            return _template_value(data["chat_template"], f"{js}: chat_template")
    if "chat_template" in config:
        return _template_value(config["chat_template"], f"{folder / 'tokenizer_config.json'}: chat_template")
    return None


def _template_value(value: object, where: str) -> str | None:
    """A ``chat_template`` value: a string, null, or a list of ``{"name", "template"}``
    entries whose "default" one is taken (None when it has none)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in value):
        raise TokenizerError(f"{where} must be a string or a list of {{\"name\", \"template\"}} objects, "
                             f"not {_json_type(value)}")
    for entry in value:
        if entry["name"] == "default":
            template = entry.get("template")
            if not isinstance(template, str):
                raise TokenizerError(f"{where}: the \"default\" entry's template must be a string, "
                                     f"not {_json_type(template)}")
            return template
    return None


def read_pat_str(folder: Path) -> str:
    """The pre-tokenizer pattern, read statically from ``tokenization_*.py``.

    The file is parsed, never executed: a ``pat_str = "..."`` (or ``"|".join([...])`` of
    literals) assignment is evaluated as a literal. Without such a file the known Kimi
    pattern is used.
    """
    for path in sorted(folder.glob("tokenization_*.py")):
        try:
            tree = ast.parse(_read_text(path), filename=str(path))
        except (SyntaxError, ValueError) as exc:  # ValueError: NUL bytes in the source
            raise TokenizerError(f"{path}: cannot parse ({exc})") from None
        except (RecursionError, MemoryError):
            raise TokenizerError(f"{path}: cannot parse (nested too deep)") from None
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            if any(isinstance(t, ast.Name) and t.id == "pat_str" for t in targets):
                try:
                    pattern = _literal_str(value)
                except RecursionError:
                    pattern = None
                if pattern is None:
                    raise TokenizerError(
                        f"{path}:{node.lineno}: pat_str is not a string literal; cannot read it statically"
                    )
                if not pattern:
                    raise TokenizerError(f"{path}:{node.lineno}: pat_str is empty")
                return pattern
    return KIMI_PAT_STR


def _literal_str(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (  # "sep".join([...literals...])
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], (ast.List, ast.Tuple))
    ):
        sep = _literal_str(node.func.value)
        parts = [_literal_str(e) for e in node.args[0].elts]
        texts = [p for p in parts if p is not None]
        if sep is not None and len(texts) == len(parts):
            return sep.join(texts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_str(node.left), _literal_str(node.right)
        if left is not None and right is not None:
            return left + right
    return None


def _load_ranks(path: Path) -> dict[bytes, int]:
    """A ``*.tiktoken`` / ``tiktoken.model`` file: ``base64token rank`` lines, checked as
    tiktoken needs them. A damaged file loaded silently before: a token twice shifted every
    marker id, a rank out of range came out as an id past the vocabulary in ``ok`` rows, a
    byte without a rank panicked in the middle of a run."""
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}  # rank -> its line
    decode = binascii.a2b_base64
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                token, rank_text = line.split()
                piece = decode(token, strict_mode=True)  # strict: no stray characters, no bad padding
                rank = int(rank_text)
            except ValueError:  # binascii.Error is one too
                raise TokenizerError(f"{path}:{lineno}: expected 'base64token rank'") from None
            if not piece:
                raise TokenizerError(f"{path}:{lineno}: the token is empty")
            if piece in ranks:
                raise TokenizerError(f"{path}:{lineno}: token {piece[:24]!r} is listed twice (rank {ranks[piece]} too)")
            if not 0 <= rank < MAX_VOCAB_SIZE:
                raise TokenizerError(f"{path}:{lineno}: rank {rank} is out of range 0..{MAX_VOCAB_SIZE - 1}")
            if rank in seen:
                raise TokenizerError(f"{path}:{lineno}: rank {rank} is also the rank of line {seen[rank]}")
            ranks[piece] = rank
            seen[rank] = lineno
    if len(seen) and max(seen) != len(seen) - 1:
        missing = next(r for r in range(len(seen)) if r not in seen)
        raise TokenizerError(f"{path}: ranks must run 0..{len(seen) - 1} with none missing; {missing} is missing")
    lost = [b for b in range(256) if bytes([b]) not in ranks]
    if lost:
        raise TokenizerError(f"{path}: {len(lost)} single byte(s) have no rank (first {bytes([lost[0]])!r}): "
                             "text holding them could not be encoded")
    return ranks


def _after_last_marker(text: str, split: Callable[[str], list[str | int]]) -> int:
    """Where the ordinary text after ``text``'s last marker starts (0: no marker)."""
    pieces = split(text)
    last = pieces[-1] if len(pieces) > 1 else None
    return len(text) - len(last) if isinstance(last, str) else 0


def split_long_runs(text: str) -> list[str]:
    """Cut ``text`` the way the Kimi tokenizer does before encoding.

    400,000-character windows, then inside each window a cut before the character that
    would make a run of consecutive whitespace (or non-whitespace) longer than 25,000.
    """
    pieces: list[str] = []
    for start in range(0, len(text), _WINDOW_CHARS):
        window = text[start : start + _WINDOW_CHARS]
        if len(window) <= _MAX_RUN_CHARS or _LONG_RUN.search(window) is None:
            pieces.append(window)
        else:
            pieces.extend(_split_runs_slow(window))
    return pieces or [text]


def _split_runs_slow(s: str) -> list[str]:
    out: list[str] = []
    run_len = 0
    in_space = s[0].isspace() if s else False
    cut = 0
    for i, ch in enumerate(s):
        space = ch.isspace()
        if space != in_space:
            in_space, run_len = space, 1
        else:
            run_len += 1
            if run_len > _MAX_RUN_CHARS:
                out.append(s[cut:i])
                cut, run_len = i, 1
    out.append(s[cut:])
    return out


def marker_pattern(markers: Iterable[str]) -> re.Pattern[str]:
    """A regex for every marker, matching at each position the longest marker there (what
    the longest-first alternation ``<|im_end|>|...|<think>`` matches), as one capture group.

    It is written as a prefix tree, ``<(?:\\|(?:im_(?:end|...)...)|think>|...)|\\[...``: at a
    ``<`` the engine follows one branch instead of trying each of 256 markers in turn,
    2-3x faster on prompts full of markers and on code full of ``<``.
    """
    trie: _Trie = {}
    for marker in markers:
        node = trie
        for ch in marker:
            node = node.setdefault(ch, {})
        node[""] = {}  # a marker ends here
    return re.compile(f"({_trie_regex(trie)})")


#: A prefix tree of markers: character -> subtree; the key "" marks where a marker ends.
_Trie = dict[str, "_Trie"]


def _trie_regex(node: _Trie) -> str:
    branches = [re.escape(ch) + _trie_regex(child) for ch, child in sorted(node.items()) if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    if "" in node:  # a marker ends here and longer ones go on: longer first (greedy), else stop
        return f"(?:{body})?" if len(branches) == 1 else f"{body}?"
    return body


@lru_cache(maxsize=16)
def _marker_groups(markers: tuple[str, ...]) -> tuple[tuple[str, re.Pattern[str]], ...]:
    """The markers' patterns by first character, the largest group first; empty where a
    group per first character would not pay (one group, or more than :data:`_MAX_GROUPS`).

    A pattern whose markers all start with one character has that character as a literal
    prefix, which ``re`` finds at memchr speed; the pattern of every marker (Kimi's start
    with ``<`` or ``[``) is tried at each character, 4-5x slower."""
    groups: dict[str, list[str]] = {}
    for marker in markers:
        groups.setdefault(marker[:1], []).append(marker)
    if len(groups) < 2 or len(groups) > _MAX_GROUPS:
        return ()
    ordered = sorted(groups.items(), key=lambda item: len(item[1]), reverse=True)
    return tuple((first, marker_pattern(group)) for first, group in ordered)


def marker_splitter(markers: Iterable[str]) -> Callable[[str], list[str]]:
    """``marker_pattern(markers).split`` (text, marker, text, ..., text), faster: the
    largest first-character group (:func:`_marker_groups`) splits, and only when another
    group's pattern finds a marker in the text does the whole pattern split instead.
    Where no other group's marker occurs, the two splits are the same, match for match."""
    markers = tuple(markers)
    whole = marker_pattern(markers)
    groups = _marker_groups(markers)
    if not groups:
        return whole.split
    main_split = groups[0][1].split
    searches = [pattern.search for _, pattern in groups[1:]]

    def split(text: str) -> list[str]:
        for search in searches:
            if search(text) is not None:
                return whole.split(text)
        return main_split(text)

    return split


def _marker_finder(markers: Iterable[str]) -> Callable[[str], re.Match[str] | None]:
    """``marker_pattern(markers).search``, faster: each first-character group is looked
    for only where its first character occurs (a one-character ``in``, memchr speed), by
    its own pattern (a literal prefix, :func:`_marker_groups`); the leftmost of the
    groups' matches is the whole pattern's (the longest marker at the leftmost place a
    marker starts: only its own group's markers start with that character). Reasoning
    prose without ``<`` or ``[`` never reaches a regex."""
    markers = tuple(markers)
    groups = _marker_groups(markers)
    if not groups:
        return marker_pattern(markers).search
    searches = [(first, pattern.search) for first, pattern in groups]

    def find(text: str) -> re.Match[str] | None:
        best = None
        for first, search in searches:
            if first in text and (found := search(text)) is not None and (best is None or found.start() < best.start()):
                best = found
        return best

    return find


def _load_tiktoken(folder: Path, source: str) -> Tokenizer:
    config = _read_json(folder / "tokenizer_config.json")
    ranks = _load_ranks(folder / "tiktoken.model")
    n_ranks = len(ranks)
    names = _added_names(folder / "tokenizer_config.json", config, range(n_ranks, n_ranks + _KIMI_NUM_RESERVED))
    pat_str = read_pat_str(folder)
    special = {t: i for i, t in names.items()}
    enc = _encoding(folder / "tiktoken.model", pat_str, ranks, special)
    tok = _tiktoken_tokenizer(folder, source, enc, names, config, pat_str=pat_str, vocab_size=n_ranks + _KIMI_NUM_RESERVED,
                              cut_long_runs=True)
    object.__setattr__(tok, "model_vocab_size", tok.vocab_size)  # the reserved range pads to the model's 163,840
    object.__setattr__(tok, "model_vocab_from", "reserved range")
    return tok


def _added_names(path: Path, config: Mapping[str, Any], ids: range) -> dict[int, str]:
    """The marker text of each id in ``ids`` from ``added_tokens_decoder`` (a reserved name
    where it has none). Each must be a distinct, non-empty string: an empty one made every
    encode loop without end, ignoring Ctrl-C, and a repeated one leaves an id no text."""
    decoder = config.get("added_tokens_decoder")
    if decoder is None:
        decoder = {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{path}: added_tokens_decoder must be an object, not {_json_type(decoder)}")
    # read by id as the model's own loader reads each key, with int(): "+163587" and "0163587"
    # name 163587 there; a key that is no number stops it
    by_id: dict[int, Any] = {}
    for key, entry in decoder.items():
        try:
            i = int(key)
        except ValueError:
            raise TokenizerError(f"{path}: added_tokens_decoder: key {key[:40]!r} is not a token id") from None
        if i in by_id:
            raise TokenizerError(f"{path}: added_tokens_decoder: keys for id {i} are given twice ({key[:40]!r})")
        by_id[i] = entry
    names: dict[int, str] = {}
    owner: dict[str, int] = {}
    for i in ids:
        if i not in by_id:
            text = f"<|reserved_token_{i}|>"
        elif (entry := by_id[i]) is None:  # not absent: a null took the marker's place, silently
            raise TokenizerError(f"{path}: added_tokens_decoder[\"{i}\"] must be an object, not null")
        elif isinstance(entry, dict) and isinstance(entry.get("content"), str) and entry["content"]:
            text = entry["content"]
        else:
            raise TokenizerError(f"{path}: added_tokens_decoder[\"{i}\"].content must be a non-empty string")
        if text in owner:
            raise TokenizerError(f"{path}: added_tokens_decoder[\"{i}\"].content {text!r} is also id {owner[text]}'s")
        names[i] = text
        owner[text] = i
    return names


#: Text of every kind a pre-tokenizer pattern splits (letters, digits, spaces, newlines,
#: punctuation, CJK, an emoji), encoded once when a folder loads: a pattern that matches
#: empty text makes tiktoken panic (a Rust panic, no Python error) on the first encode.
_PROBE = "Hello, world! 123 4567\n\n  x\t= [a] {b}; 中文字符 😀 é's don't\r\n"


def _encoding(path: Path, pat_str: str, ranks: dict[bytes, int], special: dict[str, int]) -> tiktoken.Encoding:
    """tiktoken over ``ranks``, splitting text with ``pat_str``, regrouped where it is a
    proven pattern (:mod:`.pattern`: the same pieces, most of them found natively); with
    ``pat_str`` as it is should the regrouped one not compile, so the rewrite can never be
    why a folder fails to load."""
    import tiktoken

    grouped = grouped_pattern(pat_str)
    error: BaseException | None = None
    for pattern in dict.fromkeys((grouped, pat_str)):
        try:
            enc = tiktoken.Encoding(name=f"tokenbridge:{path.parent.name}", pat_str=pattern, mergeable_ranks=ranks,
                                    special_tokens=special)
            enc.encode_ordinary(_PROBE)
            return enc
        except (ValueError, OverflowError) as exc:  # a pattern that does not compile, a rank out of range
            error = exc
        except BaseException as exc:  # pyo3's PanicException derives from BaseException
            if type(exc).__name__ != "PanicException":
                raise
            error = exc
    raise TokenizerError(f"{path}: tiktoken rejected the data ({error})") from None


def _tiktoken_tokenizer(folder: Path, source: str, enc: tiktoken.Encoding, names: dict[int, str], config: dict[str, Any], *,
                        pat_str: str, vocab_size: int, cut_long_runs: bool) -> Tokenizer:
    """A :class:`Tokenizer` over a built ``tiktoken.Encoding`` whose special tokens are
    ``names``. ``cut_long_runs``: encode as transformers' ``tokenize()`` does for a folder
    whose own tokenizer cuts long runs (Kimi's); without it one tiktoken call is exact."""
    special = {t: i for i, t in names.items()}
    allowed = enc.special_tokens_set
    marker_split = marker_splitter(names.values())
    first_marker = _marker_finder(names.values())
    ordinary = enc.encode_ordinary

    def encode_plain(text: str) -> list[int]:
        # No marker in the text: tiktoken's ordinary encode gives the ids the special-
        # aware encode would, without its per-call special-token set and scan.
        if not cut_long_runs or len(text) <= _MAX_RUN_CHARS:  # too short for a window or run cut
            return ordinary(text)
        out: list[int] = []
        for piece in split_long_runs(text):
            out.extend(ordinary(piece))
        return out

    def encode(text: str) -> list[int]:
        if first_marker(text) is None:
            return encode_plain(text)
        # Short text cannot hit a window or run cut: one tiktoken call is exact.
        if not cut_long_runs or len(text) <= _MAX_RUN_CHARS:
            return enc.encode(text, allowed_special=allowed)
        # As transformers' tokenize(): split on marker text first, then cut and encode
        # each ordinary piece, so a cut can never fall inside a marker.
        out: list[int] = []
        for piece in split_markers(text):
            if isinstance(piece, int):
                out.append(piece)
            elif piece:
                out.extend(encode_plain(piece))
        return out

    def encode_completion(text: str) -> tuple[list[int], bool]:
        if first_marker(text) is None:
            return ordinary(text), True
        return enc.encode(text, allowed_special=allowed), False

    def split_markers(text: str) -> list[str | int]:
        # text, marker, text, ..., text (the pattern's one group keeps the markers)
        # the markers' places, odd ones, are given their ids in place (no copy of the list)
        pieces = cast("list[str | int]", marker_split(text))
        if len(pieces) > 1:
            pieces[1::2] = [special[m] for m in pieces[1::2]]  # type: ignore[index]
        return pieces

    def piece(token_id: int) -> bytes:
        return enc.decode_single_token_bytes(token_id)

    return Tokenizer(
        name=folder.name,
        source=source,
        kind="tiktoken",
        lossless=True,
        vocab_size=vocab_size,
        marker_ids=names,
        chat_template=_chat_template(folder, config),
        config=config,
        _encode=encode,
        _decode_bytes=enc.decode_bytes,
        _piece=piece,
        _split_markers=split_markers,
        _encode_plain=encode_plain,
        _may_hold_marker=lambda text: first_marker(text) is not None,
        _encode_completion=encode_completion if cut_long_runs else None,
        _stable_cut=last_stable_cut if pat_str in CUT_PROVEN else None,
    )


def _tiktoken_layout(folder: Path) -> tuple[Path, str, dict[int, str]] | None:
    """(ranks file, split regex, added tokens) when ``tokenizer.json`` is a byte-level BPE
    that tiktoken reproduces: one ``*.tiktoken`` file beside it, a ``Split`` regex
    (isolated) then ``ByteLevel`` without its own regex, no normaliser, a BPE model that
    takes whole words first (``ignore_merges``, as tiktoken does); else None."""
    files = sorted(folder.glob("*.tiktoken"))
    if len(files) != 1:
        return None
    data = _read_json(folder / "tokenizer.json")
    model = data.get("model")
    regex = _split_regex(data)
    if (regex is None or data.get("normalizer") is not None or not isinstance(model, dict)
            or model.get("type") != "BPE" or model.get("ignore_merges") is not True):
        return None
    tokens, vocab = data.get("added_tokens"), model.get("vocab")
    if not isinstance(tokens, list) or not isinstance(vocab, dict):
        return None  # not this layout: tokenizers reads the file, and says what is wrong with it
    added = {t["id"]: t["content"] for t in tokens
             if isinstance(t, dict) and type(t.get("id")) is int and isinstance(t.get("content"), str) and t["content"]}
    if len(vocab) + len(added) != max(added, default=-1) + 1 or not added or len(set(added.values())) != len(added):
        return None
    return files[0], regex, added


def _load_tiktoken_beside_json(folder: Path, source: str) -> Tokenizer | None:
    layout = _tiktoken_layout(folder)
    if layout is None:
        return None
    path, regex, names = layout
    ranks = _load_ranks(path)
    if len(ranks) != min(names):  # the ranks must be exactly the BPE vocabulary below the added tokens
        return None
    special = {t: i for i, t in names.items()}
    enc = _encoding(path, regex, ranks, special)
    config = _read_json(folder / "tokenizer_config.json")
    return _tiktoken_tokenizer(folder, source, enc, names, config, pat_str=regex, vocab_size=max(names) + 1,
                               cut_long_runs=False)


def _load_tokenizers(folder: Path, source: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    path = folder / "tokenizer.json"
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for any bad file
        raise TokenizerError(f"{path}: tokenizers could not load it ({exc})") from None
    config = _read_json(folder / "tokenizer_config.json")
    markers = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}

    def encode(text: str) -> list[int]:
        try:
            return tok.encode(text, add_special_tokens=False).ids
        except TypeError:
            if not isinstance(text, str):
                raise
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise EncodeError(
                    f"text holds a lone surrogate (U+{ord(exc.object[exc.start]):04X} at char {exc.start}), "
                    f"which {folder.name}'s tokenizer cannot encode"
                ) from None
            raise

    def decode_text(ids: Sequence[int]) -> bytes:
        return tok.decode(list(ids), skip_special_tokens=False).encode("utf-8", errors="surrogatepass")

    # Byte-level BPE: each token is bytes spelled in GPT-2's byte alphabet, so a token
    # holding part of a UTF-8 character has exact bytes, which decoding through text
    # would turn into U+FFFD.
    inverse = {ch: b for b, ch in _byte_alphabet().items()} if _byte_level(path) else None

    def piece(token_id: int) -> bytes:
        if inverse is None:
            return decode_text([token_id])
        if token_id in markers:
            return markers[token_id].encode("utf-8")
        token = tok.id_to_token(token_id)
        if token is None:
            raise KeyError(token_id)
        return bytes(inverse[ch] for ch in token)

    def decode_bytes(ids: Sequence[int]) -> bytes:
        return decode_text(ids) if inverse is None else b"".join(piece(i) for i in ids)

    first_marker = _marker_finder(markers.values()) if markers else None
    return Tokenizer(
        name=folder.name,
        source=source,
        kind="tokenizers",
        lossless=False,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        marker_ids=markers,
        chat_template=_chat_template(folder, config),
        config=config,
        _encode=encode,
        _decode_bytes=decode_bytes,
        _piece=piece,
        _stable_cut=last_stable_cut if _cut_proven(path) else None,
        _no_marker_text=(lambda text: first_marker(text) is None) if first_marker is not None else (lambda text: True),
    )


def _cut_proven(path: Path) -> bool:
    """Whether a ``tokenizer.json`` splits text the way :func:`.pattern.last_stable_cut` is
    proven for: one ``Split`` by a proven pattern (Qwen2's, GLM-4's), then ``ByteLevel``
    without its own regex, and no normaliser or NFC (which never composes across a space)."""
    data = _read_json(path)
    norm = data.get("normalizer")
    if not (norm is None or norm == {"type": "NFC"} or norm == {"type": "Sequence", "normalizers": []}):
        return False
    return _split_regex(data) in CUT_PROVEN


def _split_regex(data: Mapping[str, Any]) -> str | None:
    """The regex of a ``tokenizer.json`` whose pre-tokenizer is exactly one ``Split`` by a
    regex (isolated, not inverted) then ``ByteLevel`` without a regex of its own; else None."""
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2 or not all(isinstance(step, dict) for step in steps):
        return None
    split, level = steps
    pattern = split.get("pattern") or {}
    regex = pattern.get("Regex") if split.get("type") == "Split" and isinstance(pattern, dict) else None
    if (not isinstance(regex, str) or split.get("behavior") != "Isolated" or split.get("invert")
            or level.get("type") != "ByteLevel" or level.get("use_regex") is not False):
        return None
    return regex


def _byte_level(path: Path) -> bool:
    """Whether a tokenizer.json decodes with the ByteLevel decoder (alone or in a sequence)."""
    try:
        decoder = _read_json(path).get("decoder") or {}
    except TokenizerError:
        return False
    parts = decoder.get("decoders", [decoder]) if isinstance(decoder, dict) else []
    return any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the
    other bytes for the characters from U+0100 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table

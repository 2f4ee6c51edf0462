"""Checking a config against its schema: one line per problem, all problems at once.

The schemas are the config classes themselves (frozen dataclasses whose fields carry
pydantic types and constraints: :mod:`.generate.settings`, :mod:`.emulator.config`,
:mod:`.runconfig`). This module validates a parsed TOML/YAML mapping or a set of CLI
flags against one and turns pydantic's errors into lines a user can act on::

    run.toml:31: export.formats[0]: unknown value 'specforg'; did you mean 'specforge'?
    --max-tokens: must be >= 1, got 0

Nothing is coerced: ``"false"`` is not a boolean, ``"3"`` is not a number.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
import types
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, Union
from collections.abc import Callable, Mapping, Sequence

from typing_extensions import is_typeddict
from pydantic import AfterValidator, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError

from .chat import DIALECTS
from .jsonl import path_step
from .tokenizer import MAX_VOCAB_SIZE

__all__ = [
    "FORBID",
    "Bool",
    "DialectName",
    "Float",
    "Int",
    "NonNegFloat",
    "NonNegInt",
    "PosFloat",
    "PosInt",
    "Rate",
    "Str",
    "VocabSize",
    "Where",
    "did_you_mean",
    "read_config_text",
    "read_mapping",
    "validate",
]

#: Every schema class carries this: unknown keys are errors, never ignored.
FORBID = ConfigDict(extra="forbid")

def _no_nul(value: str) -> str:
    """No config string holds NUL (TOML's ``"\u0000"``): a path with one is an OS error at use."""
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    return value


Bool = StrictBool
Int = StrictInt
Str = Annotated[StrictStr, AfterValidator(_no_nul)]
# an int is a number too; a string or a bool is not; inf and nan are no setting (latency_ms = inf hung every
# request, prompt_price = inf made every response's cost the invalid JSON Infinity)
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
PosInt = Annotated[StrictInt, Field(ge=1)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
#: A vocabulary size: at most 2**24 (:data:`~tokenbridge.tokenizer.MAX_VOCAB_SIZE`), far above any real one.
VocabSize = Annotated[StrictInt, Field(ge=1, le=MAX_VOCAB_SIZE)]
PosFloat = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
#: A chat format name from :data:`tokenbridge.chat.DIALECTS` (a typo gets "did you mean").
#: The names are the registry's keys, computed at import; a static checker sees a ``str``.
if TYPE_CHECKING:
    DialectName = str
else:
    DialectName = Literal[tuple(DIALECTS)]


def _rate(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"must be a rate between 0 and 1, got {value!r}")
    return value


#: A per-request probability in [0, 1].
Rate = Annotated[float, Strict(), AfterValidator(_rate)]

T = TypeVar("T")
Loc = tuple[str | int, ...]

#: Keys whose values never appear in a message (they may hold a credential).
_SECRET_KEYS = {"api_key", "api_key_env", "headers"}


@dataclass(frozen=True)
class Where:
    """Where a mapping came from: a file (its text lets problems name the line) or flags.

    ``prefix`` is the mapping's place inside the file (``("generate",)`` for a run
    config's ``[generate]`` table); ``flags`` maps a field's dotted name to the CLI flag
    that set it, so a bad flag is reported as ``--max-tokens: ...``.
    """

    source: str
    text: str | None = None
    prefix: Loc = ()
    flags: Mapping[str, str] | None = None
    #: ``(schema place, file place)`` pairs: keys the loader moved before validation.
    renames: tuple[tuple[Loc, Loc], ...] = ()
    #: More keys accepted at a place than the schema has there (for "did you mean").
    also_known: Mapping[Loc, Sequence[str]] = dataclasses.field(default_factory=dict)

    def at(self, *loc: str | int) -> Where:
        return dataclasses.replace(self, prefix=self.prefix + loc)

    def renamed(self, renames: tuple[tuple[Loc, Loc], ...]) -> Where:
        return dataclasses.replace(self, renames=self.renames + renames)

    def knowing(self, also_known: Mapping[Loc, Sequence[str]]) -> Where:
        return dataclasses.replace(self, also_known={**self.also_known, **also_known})

    def line(self, loc: Sequence[str | int]) -> int | None:
        """The line of ``loc`` (a place in the schema) in the file, when it can be found."""
        return _line_of(self.text, self.prefix + self._in_file(tuple(loc))) if self.text else None

    def place(self, loc: Sequence[str | int]) -> str:
        """``loc`` (a place in the schema) as the file spells it: ``generate.reasoning.enabled``
        for a run config's top-level ``reasoning`` table."""
        return _dotted(self.prefix + self._in_file(tuple(loc)))

    def problem(self, loc: Sequence[str | int], message: str) -> str:
        """One line: ``file:LINE: section.key: message`` (or ``--flag: message``)."""
        place = self._in_file(tuple(loc))
        if self.flags is not None:
            return self._flag_problem(place, message)
        full = self.prefix + place
        line = _line_of(self.text, full) if self.text else None
        at = f"{self.source}:{line}" if line else self.source
        return f"{at}: {_dotted(full)}: {message}" if full else f"{at}: {message}"

    def _in_file(self, loc: Loc) -> Loc:
        for old, new in self.renames:
            if loc[: len(old)] == old:
                return new + loc[len(old):]
        return loc

    def _flag_problem(self, loc: Loc, message: str) -> str:
        """Named after the flag that set ``loc`` (or the nearest one above it)."""
        for n in range(len(loc), 0, -1):
            flag = (self.flags or {}).get(_dotted(loc[:n]))
            if flag is not None:
                rest = loc[n:]
                inner = "" if all(isinstance(p, int) for p in rest) else f"{_dotted(rest)}: "
                return f"{flag}: {inner}{message}"
        return f"{self.source}: {_dotted(loc)}: {message}" if loc else f"{self.source}: {message}"


def read_config_text(path: Path) -> str:
    """A config file's text, UTF-8, without a leading byte order mark (``utf-8-sig``)."""
    return path.read_text(encoding="utf-8-sig")


def read_mapping(path: Path, error: Callable[[str], Exception]) -> tuple[dict[str, Any], str]:
    """A TOML (``.toml``) or YAML (``.yaml``/``.yml``) file as a mapping, plus its text. A
    leading UTF-8 byte order mark (what Windows editors write) is not part of the text:
    TOML's parser read it as an "Invalid statement (at line 1, column 1)"."""
    try:
        text = read_config_text(path)
    except FileNotFoundError:
        raise error(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read config ({getattr(exc, 'strerror', None) or exc})") from None
    suffix = path.suffix.lower()
    data: Any
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.load(text, Loader=_config_loader()) or {}  # a SafeLoader: plain data only
        except _YamlRefused as exc:
            raise error(f"{path}{exc.at}: {exc.why}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f":{mark.line + 1}" if mark is not None else ""
            raise error(f"{path}{at}: invalid YAML: {getattr(exc, 'problem', None) or exc}") from None
        except RecursionError:  # both parsers recurse per level: a 100,000-deep array was exit 8
            raise error(f"{path}: invalid YAML: nested too deeply to read") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise error(f"{path}: invalid TOML: {exc}") from None
        except RecursionError:
            raise error(f"{path}: invalid TOML: nested too deeply to read") from None
    if not isinstance(data, dict):
        raise error(f"{path}: the top level must be a table/mapping")
    return data, text


class _YamlRefused(Exception):
    """A YAML config that reads, but not as one meaning: ``at`` is ``":line: field"`` where
    known (else ``""``), ``why`` what is wrong."""

    def __init__(self, at: str, why: str) -> None:
        super().__init__(why)
        self.at, self.why = at, why


#: The most a YAML config may hold once its aliases are expanded: values (a real config holds
#: hundreds; nine anchors of nine aliases each were 9**9 to check from a few lines) and
#: characters of text (a long string repeated by aliases is sent in every request).
MAX_YAML_VALUES = 1_000_000
MAX_YAML_TEXT = 64 << 20


@cache
def _config_loader() -> type:
    """PyYAML's SafeLoader refusing what it would read silently one way of several:

    * a mapping that gives a key twice. PyYAML keeps the last value without a word, so
      ``concurrency: 8`` ... ``concurrency: 256`` in one section ran with 256. Keys are
      compared as the data they are (``yes`` and ``true``, ``1`` and ``0x1`` are one key),
      before any ``<<`` merge is applied: a key a merge brings in and the mapping then sets
      is YAML's override, not a repeat. An alias as a key (``*k : 4096``) is refused: it
      repeats a key by construction;
    * aliases that expand it past :data:`MAX_YAML_VALUES` values or :data:`MAX_YAML_TEXT`
      characters (a "billion laughs" file: PyYAML shares the repeats, but checking the
      config walks every one of them), or that make a value contain itself.

    And it reads plain scalars as YAML 1.2 and TOML do, not as YAML 1.1: only ``true`` /
    ``false`` are booleans and only decimal digits are integers. PyYAML's 1.1 rules sent
    ``max_tokens: 010`` as 8 (octal), ``1:20`` as 80 (base 60), ``1_0_0`` as 100 and
    ``stream: on`` as true, without a word (a cold tester's); such a scalar is now text,
    which the schema refuses where a number or a boolean belongs."""
    import yaml

    merge = "tag:yaml.org,2002:merge"
    scalar_rules = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}

    class ConfigLoader(yaml.SafeLoader):
        yaml_implicit_resolvers = {
            first: [(tag, rx) for tag, rx in rules if tag not in scalar_rules]
            for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._steps: list[Any] = []  # the key node or index of each node being composed

        def compose_node(self, parent: Any, index: Any) -> Any:
            if parent is not None and index is None and self.check_event(yaml.AliasEvent):
                line = self.peek_event().start_mark.line + 1  # type: ignore[no-untyped-call]  # typeshed: untyped
                raise _YamlRefused(f":{line}: {self._where()}", "an alias (*name) as a key: write the key itself")
            self._steps.append(index)
            try:
                return super().compose_node(parent, index)
            finally:
                self._steps.pop()

        def compose_mapping_node(self, anchor: Any) -> Any:
            node = super().compose_mapping_node(anchor)
            seen: dict[Any, Any] = {}
            for key, _ in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == merge:
                    continue
                first = seen.setdefault(self._as_data(key), key)
                if first is not key:
                    spelled = "" if first.value == key.value else f" as {first.value!r}"
                    raise _YamlRefused(f":{key.start_mark.line + 1}: {self._where(key.value)}", (
                        f"given twice in one mapping (first on line {first.start_mark.line + 1}{spelled}): which "
                        "value is meant is unclear (YAML readers keep the last, silently)"))
            return node

        def _as_data(self, key: Any) -> Any:
            """The key as the mapping will hold it: ``yes`` and ``true`` are one key, ``1``,
            ``0x1`` and ``1.0`` another, as in the dict PyYAML builds (a key it cannot
            build is compared as written)."""
            try:
                value = self.construct_object(key)
                hash(value)
            except (yaml.YAMLError, TypeError, ValueError):
                return (key.tag, key.value)
            return value

        def compose_document(self) -> Any:
            node = super().compose_document()
            _expanded_size(node, yaml.ScalarNode)
            return node

        def _where(self, *last: str) -> str:
            """The path of the node being composed (and ``last`` below it), keys named as
            :mod:`.jsonl` names them (:func:`~.jsonl.path_step`; ``[?]`` for a key that is
            not a scalar); ``<top>`` for none."""
            steps = (_yaml_step(s) for s in (*(s for s in self._steps if s is not None), *last))
            return "".join("[?]" if s is None else path_step(s) for s in steps).removeprefix(".") or "<top>"

    # in this order: the first rule that matches a scalar gives its type ("1" is an int, not a float);
    # a leading zero ("010", "01.5") matches none: text, as TOML refuses it
    ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                       list("tTfF"))
    ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                                       list("-+0123456789"))
    ConfigLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^(?:[-+]?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                   r"|\.(?:nan|NaN|NAN))$"),
        list("-+.0123456789"))
    return ConfigLoader


def _expanded_size(root: Any, scalar: Any) -> tuple[int, int]:
    """(values, characters of text) the YAML node ``root`` holds with every alias
    expanded (a shared node counted once per place it appears, computed once), or
    :class:`_YamlRefused` past :data:`MAX_YAML_VALUES` / :data:`MAX_YAML_TEXT`, or where
    a node contains itself."""
    sizes: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            children = [sizes[id(c)] for c in _yaml_children(node)]
            sizes[key] = size = (1 + sum(n for n, _ in children), sum(c for _, c in children))
            open_.discard(key)
            if size[0] > MAX_YAML_VALUES or size[1] > MAX_YAML_TEXT:
                raise _YamlRefused("", f"holds more than {MAX_YAML_VALUES:,} values or {MAX_YAML_TEXT >> 20} MiB of "
                                       "text once its aliases are expanded (a config holds hundreds of values): "
                                       "refused before reading it")
            continue
        if key in sizes:
            continue
        if key in open_:
            raise _YamlRefused(f":{node.start_mark.line + 1}", "a value that contains itself through an alias")
        if isinstance(node, scalar):
            sizes[key] = (1, len(node.value))
            continue
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _yaml_children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _yaml_children(node: Any) -> list[Any]:
    """A collection node's children: a sequence's items, a mapping's keys and values."""
    items = node.value
    if items and isinstance(items[0], tuple):  # a mapping's (key, value) pairs
        return [n for pair in items for n in pair]
    return list(items)


def _yaml_step(step: Any) -> str | int | None:
    """A path step of a node being composed: its index in a sequence, or its key (a node,
    or its text) as text; None for a key that is not a scalar."""
    if isinstance(step, int):
        return step
    text = step if isinstance(step, str) else getattr(step, "value", None)
    return text if isinstance(text, str) else None


def validate(schema: Any, data: Any, where: Where) -> tuple[Any, list[str]]:
    """``(instance, [])`` when ``data`` fits ``schema``, else ``(None, problems)``."""
    try:
        return _adapter(schema).validate_python(data), []
    except ValidationError as exc:
        found: dict[str, int] = {}
        for err in exc.errors(include_url=False):
            loc = tuple(err["loc"])
            if "[key]" in loc:  # a bad mapping key: name the mapping, the message names the key
                loc = loc[: loc.index("[key]") - 1]
            found.setdefault(where.problem(loc, _message(schema, err, where)), where.line(loc) or 1 << 30)
        return None, sorted(found, key=found.__getitem__)  # in file order


def did_you_mean(word: Any, options: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest option, else the options themselves."""
    close = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (known: {', '.join(options)})" if options else ""


@cache
def _adapter(schema: Any) -> TypeAdapter[Any]:
    return TypeAdapter(schema)


# --- messages ----------------------------------------------------------------------------


def _message(schema: Any, err: Any, where: Where) -> str:  # noqa: PLR0911 - one message per pydantic error type
    kind: str = err["type"]
    loc = tuple(err["loc"])
    if "[key]" in loc:
        loc = loc[: loc.index("[key]") - 1]
    value = err.get("input")
    got = "" if _SECRET_KEYS & {str(p) for p in loc} else f", got {_show(value)}"
    ctx = err.get("ctx") or {}
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        known = [*_keys_at(schema, loc[:-1]), *where.also_known.get(loc[:-1], ())]
        return "unknown key" + did_you_mean(loc[-1] if loc else "", sorted(set(known), key=known.index))
    if kind == "missing":
        return "missing (required)"
    if kind == "literal_error":
        options = re.findall(r"'((?:[^'\\]|\\.)*)'", str(ctx.get("expected", "")))
        hint = did_you_mean(value, options)
        return f"unknown value {_show(value)}" + (hint if hint.startswith(";") else f" (choose from: {', '.join(options)})")
    if kind == "bool_type":
        tip = " (a quoted string is not a boolean: write true or false without quotes)" if isinstance(value, str) else ""
        return f"must be true or false{got}{tip}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer{got}"
    if kind in ("float_type", "float_parsing"):
        return f"must be a number{got}"
    if kind == "finite_number":
        return f"must be a finite number{got}"
    if kind == "string_type":
        return f"must be a string{got}"
    if kind in ("tuple_type", "list_type"):
        tip = f" (write {json.dumps([value])})" if isinstance(value, str) else ""
        return f"must be a list{got}{tip}"
    if kind in ("dict_type", "dataclass_type", "model_type", "typed_dict_type", "mapping_type"):
        return f"must be a table/mapping{got}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return f"must be {bounds[kind]} {limit}{got}"
    if kind in ("string_too_short", "too_short"):  # too_short: a length bound after a validator (``out = ""``)
        return "must not be empty"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error") or err["msg"])
    if kind == "path_type":
        return f"must be a path (a string){got}"
    return str(err["msg"])


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


# --- what keys a schema knows at a place (for "did you mean") ------------------------------


def _keys_at(schema: Any, loc: Loc) -> list[str]:
    tp = _strip(schema)
    for part in loc:
        tp = _strip(_child(tp, part))
        if tp is None:
            return []
    if dataclasses.is_dataclass(tp):
        return [f.name for f in dataclasses.fields(tp)]
    if is_typeddict(tp):
        return list(typing.get_type_hints(tp))
    return []


def _child(tp: Any, part: str | int) -> Any:
    if dataclasses.is_dataclass(tp) or is_typeddict(tp):
        return typing.get_type_hints(tp, include_extras=True).get(str(part))
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (tuple, list) and args:
        return args[0]
    if origin in (dict, Mapping) or (origin is not None and getattr(origin, "__name__", "") == "Mapping"):
        return args[1] if len(args) == 2 else None
    return None


def _strip(tp: Any) -> Any:
    """``Annotated[X, ...]`` and ``X | None`` down to ``X``."""
    while True:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = next((m for m in members if dataclasses.is_dataclass(_strip(m))), members[0] if members else None)
        else:
            return tp


# --- which line a key sits on (cheap, best effort) -------------------------------------------

_HEADER = r"^\s*\[\[?\s*(?:[\w\"'.-]+\.)?[\"']?%s[\"']?(?:\.[\w\"'.-]+)?\s*\]"
_KEY = r"^\s*(?:-\s*)?[\"']?%s[\"']?\s*[=:]"
_INLINE = r"[{,]\s*[\"']?%s[\"']?\s*="


def _line_of(text: str | None, loc: Loc) -> int | None:
    """The 1-based line of the last key of ``loc``, searching key by key down the file,
    each search kept inside the table or list entry the previous one found."""
    if not text:
        return None
    lines = text.splitlines()
    start, end, found, prev = 0, len(lines), None, ""
    for part in loc:
        if isinstance(part, int):
            span = _entry(lines, start, end, prev, part, found)
            if span is None:
                break
            start, end = span
            found = start
            continue
        hit = _key(lines, start, end, str(part))
        if hit is None:
            break
        start = found = hit
        prev = str(part)
    return found + 1 if found is not None else None


_TABLE = re.compile(r"^\s*\[")


def _key(lines: list[str], start: int, end: int, key: str) -> int | None:
    """A ``[table]`` header naming ``key``, or ``key =`` / ``key:`` before the next header."""
    k = re.escape(key)
    header = re.compile(_HEADER % k)
    plain = (re.compile(_KEY % k), re.compile(_INLINE % k))
    below_next_table = False
    for i in range(start, end):
        if header.search(lines[i]):
            return i
        below_next_table = below_next_table or (i > start and bool(_TABLE.match(lines[i])))
        if not below_next_table and any(p.search(lines[i]) for p in plain):
            return i
    return None


def _entry(lines: list[str], start: int, end: int, key: str, index: int, at: int | None) -> tuple[int, int] | None:
    """The lines of entry ``index`` of the list ``key``: a TOML ``[[key]]`` table, a YAML
    ``- `` item, or one inline table per line of a TOML array."""
    heads = [i for i in range(start, end) if re.match(r"^\s*\[\[\s*(?:[\w.-]+\.)?" + re.escape(key) + r"\s*\]\]", lines[i])]
    if heads:
        return (heads[index], heads[index + 1] if index + 1 < len(heads) else end) if index < len(heads) else None
    if at is None:
        return None
    items: list[int] = []
    indent: int | None = None
    stop = end
    for i in range(at + 1, end):
        m = re.match(r"^(\s*)-\s", lines[i])
        depth = len(lines[i]) - len(lines[i].lstrip())
        if m and (indent is None or depth == indent):
            indent = depth
            items.append(i)
        elif indent is not None and lines[i].strip() and depth <= indent and not m:
            stop = i  # dedented: the list ended
            break
    if items:
        return (items[index], items[index + 1] if index + 1 < len(items) else stop) if index < len(items) else None
    if lines[at].count("[") == lines[at].count("]"):
        return None  # a one-line inline array: its own line is as close as it gets
    nxt = next((i for i in range(at + 1, end) if _TABLE.match(lines[i])), end)
    tables = [i for i in range(at + 1, nxt) if "{" in lines[i]]
    return (tables[index], tables[index] + 1) if index < len(tables) else None

"""What the emulator pretends to be: its providers, their quirks and their failures.

Every quirk and fault is a rate in [0, 1], drawn deterministically per request (see
:mod:`.hashing`), so a rate of 1.0 always happens and 0.0 never does. Prices are USD per
million tokens, as OpenRouter lists them.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Mapping

__all__ = [
    "ConfigError",
    "EmulatorConfig",
    "ProviderConfig",
    "ProviderFaults",
    "ProviderQuirks",
    "TRANSPORT_FAULTS",
    "load_emulator_config",
]

#: The serving stacks a provider can reproduce (``ProviderConfig.engine``).
ENGINES = ("none", "sglang", "vllm")

#: The faults ``fault_rate`` mixes in (each equally likely once a fault is drawn).
TRANSPORT_FAULTS = ("rate_limit", "server_error", "malformed_json", "error_body", "midstream_error", "slow")


class ConfigError(ValueError):
    """A bad emulator config; the message names the file, line and field."""


@dataclass(frozen=True)
class ProviderQuirks:
    """How a provider's text view differs from what the model wrote (ids stay exact)."""

    #: ``<|im_end|>`` text appended to ``content`` when the model stopped.
    end_marker_leak: float = 0.0
    #: ``</think>`` text prepended to ``content`` (reasoning still split off).
    think_close_in_content: float = 0.0
    #: ``<think>`` text prepended to ``reasoning``.
    think_open_in_reasoning: float = 0.0
    #: Reasoning not split off: ``content = reasoning + "</think>" + content``, reasoning null.
    reasoning_in_content: float = 0.0
    #: ``content`` and ``reasoning`` are ``.strip()``-ed (usage counts the original).
    strip_whitespace: float = 0.0
    #: Raw tool-call markers parsed into ``tool_calls`` even without a ``tools`` parameter.
    parse_tool_calls: float = 0.0
    #: No ``reasoning`` key at all (usage still counts the reasoning tokens).
    drop_reasoning: float = 0.0
    #: Native ids use a non-canonical split: one token becomes two with the same bytes.
    noncanonical: float = 0.0
    #: Reasoning also sent as OpenRouter ``reasoning_details`` (``reasoning.text`` entries).
    reasoning_details: float = 0.0
    #: Reasoning sent only as ``reasoning_details``: no ``reasoning`` key.
    reasoning_details_only: float = 0.0
    #: Text Unicode-normalized to NFC (usage counts the original).
    unicode_nfc: float = 0.0
    #: Text Unicode-normalized to NFKC (usage counts the original).
    unicode_nfkc: float = 0.0
    #: ``\r\n`` in the text turned into ``\n`` (usage counts the original).
    crlf_to_lf: float = 0.0


@dataclass(frozen=True)
class ProviderFaults:
    """How often a provider fails, per request (checked in this order, first hit wins)."""

    no_endpoints: float = 0.0  # HTTP 404 "No endpoints found"
    rate_limit: float = 0.0  # HTTP 429 with Retry-After
    server_error: float = 0.0  # HTTP 502/503
    error_body: float = 0.0  # HTTP 200 whose body is {"error": {...}}
    choice_error: float = 0.0  # a choice with finish_reason "error" and partial text
    midstream_error: float = 0.0  # SSE: an error chunk then the stream ends (non-stream: choice_error)
    malformed_json: float = 0.0  # HTTP 200 with a truncated JSON body / SSE line
    slow: float = 0.0  # the response waits ``slow_s`` first


@dataclass(frozen=True)
class ProviderConfig:
    """One upstream provider as OpenRouter would route to it."""

    name: str
    quantization: str = "fp8"
    prompt_price: float = 0.60  # USD per million prompt tokens
    completion_price: float = 2.50  # USD per million completion tokens
    latency_ms: float | None = None  # time to first byte; None: the emulator's latency_ms
    tokens_per_s: float = 0.0  # streaming pace; 0: as fast as possible
    context_length: int = 262_144
    quirks: ProviderQuirks = field(default_factory=ProviderQuirks)
    faults: ProviderFaults = field(default_factory=ProviderFaults)
    #: Serving stack whose observable behaviour the provider reproduces (see
    #: :mod:`.engines`): "none" is the emulator's own ideal text view.
    engine: Literal["none", "sglang", "vllm"] = "none"

    @property
    def slug(self) -> str:
        """The part before ``/`` (``"leaky/int4"`` -> ``"leaky"``), matched like OpenRouter slugs."""
        return self.name.split("/", 1)[0]


def _default_providers() -> tuple[ProviderConfig, ...]:
    return (ProviderConfig(name="clean/fp8"),)


@dataclass(frozen=True)
class EmulatorConfig:
    """The whole emulator. Runtime-switchable parts (credits, fault rate) start from here."""

    providers: tuple[ProviderConfig, ...] = field(default_factory=_default_providers)
    models: tuple[str, ...] = ("moonshotai/kimi-k2.5",)
    #: Accept any ``model`` in a request (otherwise unknown ids get HTTP 400).
    accept_any_model: bool = False
    seed: int = 0
    latency_ms: float = 0.0
    #: Share of requests that get one of :data:`TRANSPORT_FAULTS` (on top of provider faults).
    fault_rate: float = 0.0
    slow_s: float = 5.0
    retry_after_s: int = 1
    #: Budget in USD; once spent every request gets HTTP 402. None: unlimited.
    credits_usd: float | None = None
    #: Chance that the model calls a tool when tools are offered and the user spoke last.
    tool_call_rate: float = 0.8
    #: Chance that a tool call opens without ``</think>`` first (Kimi K2 does this).
    tool_call_without_think_close: float = 0.0
    #: Synthetic completion length range in tokens (log-uniform, approximate).
    min_tokens: int = 30
    max_tokens: int = 3000
    #: Characters per SSE chunk.
    stream_chunk_chars: int = 48
    #: Dialect name for prompt rendering (None: recognised from the tokenizer).
    dialect: str | None = None
    #: Require ``Authorization: Bearer <api_key>`` (never logged). None: accept any.
    api_key: str | None = field(default=None, repr=False)
    #: Tokenizer folder used by the CLI when ``--tokenizer`` is not given.
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        names = [p.name for p in self.providers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"provider names must be unique: {', '.join(dupes)}")
        if not self.providers:
            raise ConfigError("at least one provider is needed")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ConfigError("need 1 <= min_tokens <= max_tokens")
        for name in ("fault_rate", "tool_call_rate", "tool_call_without_think_close"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1]")


# --- loading ---------------------------------------------------------------------------


def load_emulator_config(path: str | Path) -> EmulatorConfig:
    """Read an emulator config from TOML (``.toml``) or YAML (``.yaml``/``.yml``).

    Keys mirror :class:`EmulatorConfig`; ``[[providers]]`` entries mirror
    :class:`ProviderConfig` with ``quirks`` / ``faults`` sub-tables. Unknown keys and
    wrong types are errors naming the file, line and field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    data = _parse(path, text)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a table/mapping")
    return _build(EmulatorConfig, data, _Where(path, text, ""))


def _parse(path: Path, text: str) -> Any:
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    raise ConfigError(f"{path}: unknown config format (use .toml, .yaml or .yml)")


@dataclass(frozen=True)
class _Where:
    """Where a value sits, for error messages: file, field path, and a line guess."""

    path: Path
    text: str
    field: str
    provider_index: int | None = None

    def child(self, name: str, provider_index: int | None = None) -> "_Where":
        dotted = f"{self.field}.{name}" if self.field and not name.startswith("[") else f"{self.field}{name}"
        index = self.provider_index if provider_index is None else provider_index
        return _Where(self.path, self.text, dotted, index)

    def error(self, message: str) -> ConfigError:
        line = self._line()
        at = f":{line}" if line else ""
        return ConfigError(f"{self.path}{at}: {self.field or '<top>'}: {message}")

    def _line(self) -> int | None:
        """The first line naming the last key of the field, after the provider's start."""
        key = re.sub(r"\[\d+\]$", "", self.field.rsplit(".", 1)[-1])
        if not key:
            return None
        lines = self.text.splitlines()
        start = 0
        if self.provider_index is not None:
            starts = [i for i, ln in enumerate(lines) if re.match(r"\s*(\[\[providers\]\]|-\s)", ln)]
            if self.provider_index < len(starts):
                start = starts[self.provider_index]
        pattern = re.compile(r"^\s*(-\s*)?[\"']?%s[\"']?\s*[=:]" % re.escape(key))
        for i in range(start, len(lines)):
            if pattern.match(lines[i]):
                return i + 1
        return None


_FLOAT_RATE_CLASSES = (ProviderQuirks, ProviderFaults)


def _build(cls: type, data: Mapping[str, Any], where: _Where) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise where.child(unknown[0]).error(f"unknown key (known: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        at = where.child(name)
        kwargs[name] = _convert(cls, name, value, at)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise where.error(str(exc)) from None
    except ConfigError as exc:
        raise where.error(str(exc)) from None


def _convert(cls: type, name: str, value: Any, at: _Where) -> Any:
    if cls is EmulatorConfig and name == "providers":
        if not isinstance(value, list) or not value:
            raise at.error("must be a non-empty list of provider tables")
        out = []
        for i, entry in enumerate(value):
            item = at.child(f"[{i}]", provider_index=i)
            if not isinstance(entry, Mapping):
                raise item.error("must be a table/mapping")
            if "name" not in entry:
                raise item.error("missing required key 'name'")
            out.append(_build(ProviderConfig, entry, item))
        return tuple(out)
    if cls is EmulatorConfig and name == "models":
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise at.error("must be a list of model ids")
        return tuple(value)
    if cls is ProviderConfig and name in ("quirks", "faults"):
        if not isinstance(value, Mapping):
            raise at.error("must be a table/mapping of rates")
        return _build(ProviderQuirks if name == "quirks" else ProviderFaults, value, at)
    if cls in _FLOAT_RATE_CLASSES:
        return _rate(value, at)
    if cls is ProviderConfig and name == "engine":
        if value not in ENGINES:
            raise at.error(f"must be one of {', '.join(ENGINES)}, got {value!r}")
        return value
    default = next(f for f in fields(cls) if f.name == name)
    return _scalar(default.type, value, at)


def _rate(value: Any, at: _Where) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise at.error(f"must be a rate between 0 and 1, got {value!r}")
    return float(value)


def _scalar(type_text: Any, value: Any, at: _Where) -> Any:
    spec = str(type_text)
    optional = "None" in spec
    if value is None:
        if optional:
            return None
        raise at.error("must not be empty")
    if spec.startswith("bool"):
        if not isinstance(value, bool):
            raise at.error(f"must be true or false, got {value!r}")
        return value
    if spec.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise at.error(f"must be an integer, got {value!r}")
        return value
    if spec.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise at.error(f"must be a non-negative number, got {value!r}")
        return float(value)
    if spec.startswith("str"):
        if not isinstance(value, str) or not value:
            raise at.error(f"must be a non-empty string, got {value!r}")
        return value
    raise at.error(f"unsupported value {value!r}")  # pragma: no cover - all fields covered above

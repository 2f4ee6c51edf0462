"""What the emulator pretends to be: its providers, their quirks and their failures.

Every quirk and fault is a rate in [0, 1], drawn deterministically per request (see
:mod:`.hashing`), so a rate of 1.0 always happens and 0.0 never does. Prices are USD per
million tokens, as OpenRouter lists them.

The dataclasses below are also the config file's schema: each field's type carries its
pydantic check (:mod:`tokenbridge.schema`), so a new setting is one annotated line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from collections.abc import Mapping

from pydantic import Field, with_config

from ..display import several
from ..exit_codes import ExitCode
from ..schema import (
    FORBID,
    Bool,
    DialectName,
    Int,
    NonNegFloat,
    NonNegInt,
    PosInt,
    Rate,
    Str,
    Where,
    read_mapping,
    validate,
)

__all__ = [
    "ConfigError",
    "EmulatorConfig",
    "ProviderConfig",
    "ProviderFaults",
    "ProviderQuirks",
    "TRANSPORT_FAULTS",
    "emulator_config_problems",
    "load_emulator_config",
]

#: The faults ``fault_rate`` mixes in (each equally likely once a fault is drawn).
TRANSPORT_FAULTS = ("rate_limit", "server_error", "malformed_json", "error_body", "midstream_error", "slow")


class ConfigError(ValueError):
    """A bad emulator config; one line per problem, each naming the file, line and field."""

    exit_code = ExitCode.CONFIG


@with_config(FORBID)
@dataclass(frozen=True)
class ProviderQuirks:
    """How a provider's text view differs from what the model wrote (ids stay exact)."""

    #: The end token's text (``<|im_end|>``; GLM's ``<|observation|>`` after a call) appended
    #: to ``content`` when the model stopped.
    end_marker_leak: Rate = 0.0
    #: ``</think>`` text prepended to ``content`` (reasoning still split off).
    think_close_in_content: Rate = 0.0
    #: ``<think>`` text prepended to ``reasoning``.
    think_open_in_reasoning: Rate = 0.0
    #: Reasoning not split off: ``content = reasoning + "</think>" + content``, reasoning null.
    reasoning_in_content: Rate = 0.0
    #: ``content`` and ``reasoning`` are ``.strip()``-ed (usage counts the original).
    strip_whitespace: Rate = 0.0
    #: Raw tool-call markers parsed into ``tool_calls`` even without a ``tools`` parameter.
    parse_tool_calls: Rate = 0.0
    #: No ``reasoning`` key at all (usage still counts the reasoning tokens).
    drop_reasoning: Rate = 0.0
    #: Native ids use a non-canonical split: one token becomes two with the same bytes.
    noncanonical: Rate = 0.0
    #: Reasoning also sent as OpenRouter ``reasoning_details`` (``reasoning.text`` entries).
    reasoning_details: Rate = 0.0
    #: Reasoning sent only as ``reasoning_details``: no ``reasoning`` key.
    reasoning_details_only: Rate = 0.0
    #: Text Unicode-normalized to NFC (usage counts the original).
    unicode_nfc: Rate = 0.0
    #: Text Unicode-normalized to NFKC (usage counts the original).
    unicode_nfkc: Rate = 0.0
    #: ``\r\n`` in the text turned into ``\n`` (usage counts the original).
    crlf_to_lf: Rate = 0.0
    #: SGLang's ``no_stop_trim``: the stop token's text kept for the reasoning parser
    #: (gpt-oss: a tool call then stays in ``content`` raw, ``<|call|>`` included).
    no_stop_trim: Rate = 0.0


@with_config(FORBID)
@dataclass(frozen=True)
class ProviderFaults:
    """How often a provider fails, per request (checked in this order, first hit wins)."""

    no_endpoints: Rate = 0.0  # HTTP 404 "No endpoints found"
    rate_limit: Rate = 0.0  # HTTP 429 with Retry-After
    server_error: Rate = 0.0  # HTTP 502/503
    error_body: Rate = 0.0  # HTTP 200 whose body is {"error": {...}}
    choice_error: Rate = 0.0  # a choice with finish_reason "error" and partial text
    midstream_error: Rate = 0.0  # SSE: an error chunk then the stream ends (non-stream: choice_error)
    malformed_json: Rate = 0.0  # HTTP 200 with a truncated JSON body / SSE line
    slow: Rate = 0.0  # the response waits ``slow_s`` first


@with_config(FORBID)
@dataclass(frozen=True)
class ProviderConfig:
    """One upstream provider as OpenRouter would route to it."""

    name: Annotated[Str, Field(min_length=1)]
    quantization: Annotated[Str, Field(min_length=1)] = "fp8"
    prompt_price: NonNegFloat = 0.60  # USD per million prompt tokens
    completion_price: NonNegFloat = 2.50  # USD per million completion tokens
    latency_ms: NonNegFloat | None = None  # time to first byte; None: the emulator's latency_ms
    tokens_per_s: NonNegFloat = 0.0  # streaming pace; 0: as fast as possible
    context_length: PosInt = 262_144
    #: Requests served at once; one more is answered HTTP 429 (with Retry-After) at once,
    #: as a provider at its capacity does. None: no cap (random 429s are ``faults.rate_limit``).
    max_concurrency: PosInt | None = None
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


@with_config(FORBID)
@dataclass(frozen=True)
class EmulatorConfig:
    """The whole emulator. Runtime-switchable parts (credits, fault rate) start from here."""

    providers: tuple[ProviderConfig, ...] = field(default_factory=_default_providers)
    models: tuple[Annotated[Str, Field(min_length=1)], ...] = ("moonshotai/kimi-k2.5",)
    #: Accept any ``model`` in a request (otherwise unknown ids get HTTP 400).
    accept_any_model: Bool = False
    seed: Int = 0
    latency_ms: NonNegFloat = 0.0
    #: Share of requests that get one of :data:`TRANSPORT_FAULTS` (on top of provider faults).
    fault_rate: Rate = 0.0
    slow_s: NonNegFloat = 5.0
    retry_after_s: NonNegInt = 1
    #: Budget in USD; once spent every request gets HTTP 402. None: unlimited.
    credits_usd: NonNegFloat | None = None
    #: Chance that the model calls a tool when tools are offered and the user spoke last.
    tool_call_rate: Rate = 0.8
    #: Chance that a tool call opens without ``</think>`` first (Kimi K2 does this; the
    #: other families' models never do, and ignore it).
    tool_call_without_think_close: Rate = 0.0
    #: Synthetic completion length range in tokens (log-uniform, approximate).
    min_tokens: PosInt = 30
    max_tokens: PosInt = 3000
    #: Characters per SSE chunk.
    stream_chunk_chars: PosInt = 48
    #: Dialect name for prompt rendering (None: recognised from the tokenizer).
    dialect: DialectName | None = None
    #: Require ``Authorization: Bearer <api_key>`` (never logged). None: accept any.
    api_key: Str | None = field(default=None, repr=False)
    #: Tokenizer folder used by the CLI when ``--tokenizer`` is not given.
    tokenizer: Str | None = None

    def __post_init__(self) -> None:
        names = [p.name for p in self.providers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"provider names must be unique: {', '.join(dupes)}")
        if not self.providers:
            raise ConfigError("at least one provider is needed")
        if not self.models:
            raise ConfigError("at least one model id is needed")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens} and {self.max_tokens}")
        for name in ("fault_rate", "tool_call_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1]")


# --- loading ---------------------------------------------------------------------------


def load_emulator_config(path: str | Path) -> EmulatorConfig:
    """Read an emulator config from TOML (``.toml``) or YAML (``.yaml``/``.yml``).

    Keys mirror :class:`EmulatorConfig`; ``[[providers]]`` entries mirror
    :class:`ProviderConfig` with ``quirks`` / ``faults`` sub-tables. Every problem
    (unknown key, wrong type, out of range) is reported at once, one line each, naming
    the file, line and field.
    """
    path = Path(path)
    if path.suffix.lower() not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"{path}: unknown config format (use .toml, .yaml or .yml)")
    data, text = read_mapping(path, ConfigError)
    cfg, problems = emulator_config_problems(data, Where(str(path), text))
    if cfg is None:
        raise several(ConfigError, problems)
    return cfg


def emulator_config_problems(
    data: Mapping[str, Any], where: Where, base: EmulatorConfig | None = None
) -> tuple[EmulatorConfig | None, list[str]]:
    """``data`` (a whole config, or overrides of ``base``) checked against the schema:
    ``(config, [])``, or ``(None, one line per problem)``."""
    merged: dict[str, Any] = {}
    if base is not None:
        merged = {name: getattr(base, name) for name in base.__dataclass_fields__}
    cfg, problems = validate(EmulatorConfig, {**merged, **data}, where)
    return cfg, problems

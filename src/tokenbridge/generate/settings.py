"""Run settings: what to send, where, how hard, and within which budget.

One :class:`GenerateSettings` is built from a TOML/YAML config file, CLI flags, or
Python; flags override the file. The config may hold these keys at its top level or
under a ``[generate]`` table (so the pipeline config can share one file)::

    base_url = "https://openrouter.ai/api/v1"
    model = "moonshotai/kimi-k2.5"
    concurrency = 256
    [request]            # max_tokens, temperature, top_p, seed, n, reasoning, provider, extra_body
    [prices]             # USD per million tokens: prompt, completion
    [[datasets]]         # name, path (or builtin:prompts/chat.jsonl), limit, split

The dataclasses below are the schema (:mod:`tokenbridge.schema`): a config file and the
CLI flags are both checked against them, every value for type and range, no string
taken for a number or a boolean, unknown keys refused with "did you mean". Besides,
whenever settings are built (file, flags, ``with_overrides`` or Python): ``base_url``
must be ``http(s)://host[:port]/path`` without user info, query or fragment
(``/chat/completions`` is appended to it; a run refuses to send the key over plain
``http://`` to a host that is not this machine unless ``allow_plain_http``), and
``headers`` may not carry a credential
(any name containing auth, key, token, secret, cookie, passw, session or credential, a
value that looks like a key or an authorization scheme's token, or, once the key is read,
holds it: the key comes only from ``api_key_env``), a name that is no HTTP field name or a
value with a control character. ``extra_body`` may not set a key tokenbridge sets itself, nor
a ``reasoning`` / ``provider`` key a setting or flag sets too (it is merged last and
replaced that value in every body), and must be JSON; a request field both at the top
level and under ``[request]`` is refused.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field, with_config
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from ..display import several
from ..fsio import real_path
from ..schema import (
    FORBID,
    Bool,
    DialectName,
    Int,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    Str,
    Where,
    did_you_mean,
    read_mapping,
    validate,
)
from ..jsonl import MAX_DEPTH, is_int, not_text
from .errors import GenerateError

__all__ = [
    "ConfigError",
    "DatasetSpec",
    "GenerateSettings",
    "MAX_RESPONSE_BYTES",
    "Prices",
    "RequestSettings",
    "api_key_problem",
    "check_base_url",
    "check_headers",
    "endpoint_identity",
    "env_name_problem",
    "is_loopback_url",
    "load_config",
    "override_settings",
    "parse_dataset_arg",
    "plain_http_problem",
    "settings_from_mapping",
    "settings_problems",
]

DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
#: ``max_response_bytes``' default, for generate and probe alike: a 32k reasoning answer is
#: ~150 KB, ``top_logprobs`` can reach tens of MB
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_CREDENTIAL_HEADER = re.compile(r"auth|key|token|secret|cookie|passw|session|credential", re.IGNORECASE)
#: A header value's tokens that may be a credential, whatever the header's name: one that
#: starts as providers' keys start (``sk-or-v1-``, ``sk-ant-``, ``sk-proj-``, ``sk_live_``,
#: ``gsk_``, ``xai-``, ``AIza``, ``hf_``, ``ghp_``...) or follows an authorization scheme
#: (``Bearer``, ``Basic``), at a token's start (not inside a URL's path).
_CREDENTIAL_TOKEN = re.compile(
    r"(?<![A-Za-z0-9_./:-])((?:sk|rk|pk)[-_][A-Za-z0-9_-]{20,}|(?:gsk_|xai-|AIza|hf_|ghp_|gho_|ghs_|github_pat_|"
    r"glpat-|pplx-|r8_)[A-Za-z0-9_-]{20,})|(?i:\b(?:bearer|basic)\s+)([A-Za-z0-9+/=_.~-]{20,})")
#: Runs of digits a token of random characters has (about one in six characters is a
#: digit); a word or a date after a key's prefix has one or two
#: (``sk-proj-reconstruction-2024-run1``, ``Basic configuration-v2-20240501``).
_RANDOM_DIGIT_RUNS = 3
_DIGIT_RUN = re.compile(r"[0-9]+")


def _credential_in(value: str) -> bool:
    """Whether ``value`` holds a token that is a key: a provider's prefix or a scheme, and
    the body of random characters (three or more separate runs of digits)."""
    for m in _CREDENTIAL_TOKEN.finditer(value):
        if len(_DIGIT_RUN.findall(m.group(1) or m.group(2))) >= _RANDOM_DIGIT_RUNS:
            return True
    return False


_LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: Dataset paths starting with this name prompt files shipped in the package (the demo's).
_BUILTIN = "builtin:"
#: A ``tokenbridge run`` config's sections: ``generate --config`` reads its [generate] only.
_RUN_SECTIONS = ("run", "emulator", "generate", "reconstruct", "export", "vocab", "report")


class ConfigError(GenerateError, ValueError):
    """Settings are missing or malformed: one line per problem, each naming file and key."""


def _base_url_problem(url: Any) -> str | None:
    if not isinstance(url, str) or not url:
        return "must be a URL like https://openrouter.ai/api/v1"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        return f"{url!r} is malformed ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} needs http:// or https:// and a host (e.g. https://openrouter.ai/api/v1)"
    if parts.username is not None or parts.password is not None:
        return "must not carry user info (user:password@); the key comes from api_key_env"
    if parts.query or parts.fragment:
        return "must not have a query or fragment (/chat/completions is appended to it)"
    return None


def _headers_problem(headers: Any) -> str | None:
    if not isinstance(headers, Mapping):
        return "must be a mapping of name -> value"
    bad = sorted(str(k) for k in headers if _CREDENTIAL_HEADER.search(str(k)))
    if bad:
        return f"header(s) {bad} look like credentials and are refused (the key comes only from api_key_env)"
    for name, value in headers.items():
        if not isinstance(name, str) or not _HTTP_TOKEN.match(name):
            return (f"header name {name!r} is not an HTTP field name (letters, digits and !#$%&'*+-.^_`|~; "
                    "no space, colon or control character)")
        if isinstance(value, str) and (why := _header_text_problem(value)):
            return f"header {name}: value {why}"
        if isinstance(value, str) and _credential_in(value):
            return (f"header {name}: value looks like a credential (not shown here): the key comes only from "
                    "api_key_env, and header values are sent to every provider and echoed in their errors")
    return None


#: An HTTP field name (RFC 9110 ``token``).
_HTTP_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
#: What an HTTP field value may not hold (RFC 9110): C0 controls but tab, and DEL. A CR or
#: LF would end the header and start another; aiohttp refuses it only when sending.
_HEADER_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\ud800-\udfff]")


def _header_text_problem(value: str) -> str | None:
    """Why ``value`` cannot be sent in an HTTP header, naming the place, never the text
    (the API key is one such value)."""
    m = _HEADER_CONTROL.search(value)
    if m is None:
        return None
    char = m.group()
    what = "a lone surrogate (bytes that are not UTF-8)" if "\ud800" <= char <= "\udfff" else "a control character"
    return f"holds {what} (U+{ord(char):04X} at character {m.start()}): it cannot be sent in an HTTP header"


#: An environment variable's name as a shell writes it (``export NAME=...``).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: What a key looks like and a variable's name does not: a provider's key prefix, or 20 or
#: more letters, digits and dashes in a row with a digit among them (``OPENROUTER_API_KEY``'s
#: longest such run is 10).
_KEY_LIKE = re.compile(r"^(?:sk|pk|rk)[-_]|(?=[A-Za-z0-9-]*[0-9])[A-Za-z0-9-]{20,}", re.IGNORECASE)


def env_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be ``api_key_env``, the NAME of the variable holding the key,
    else None. Never quotes it: a key pasted there was printed in "environment variable
    sk-or-v1-... is not set" and stored in the run log."""
    expected = ("give the NAME of the environment variable that holds the key (letters, digits and '_', not "
                "starting with a digit, e.g. OPENROUTER_API_KEY), never the key itself")
    if not isinstance(name, str) or not name:
        return f"must be a variable name: {expected}"
    if _KEY_LIKE.search(name):
        return f"looks like an API key (not shown here): {expected}, and put the key in that variable"
    if not _ENV_NAME.fullmatch(name):
        return f"is not an environment variable name (not shown here, as it may be a key): {expected}"
    return None


def _valid_env_name(name: str) -> str:
    if why := env_name_problem(name):
        raise ValueError(why)
    return name


def api_key_problem(value: str) -> str | None:
    """Why a key read from the environment cannot be sent (``Authorization: Bearer KEY``),
    checked before anything is sent: aiohttp refused a CR or LF in it only per request, so
    every sample failed its attempts one by one. The message never shows the key."""
    return _header_text_problem(value)


def is_loopback_url(url: str) -> bool:
    """The API is this machine (the emulator, a local vLLM): it may run without a key, and
    plain ``http://`` to it never crosses a network."""
    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:
        return False
    if host in _LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback  # 127.0.0.0/8
    except ValueError:
        return False


def plain_http_problem(url: str, allowed: bool = False) -> str | None:
    """Why the key must not be sent to ``url``: plain ``http://`` to another machine sends
    it unencrypted (``http://openrouter.ai`` for ``https://`` did), unless ``allowed``
    (``allow_plain_http``: a server on a network the user trusts). Names the host only:
    a gateway may take the key in the path."""
    if allowed or urlsplit(url).scheme != "http" or is_loopback_url(url):
        return None
    return (f"is plain http:// to {urlsplit(url).hostname}, which is not this machine: the API key would "
            "cross the network unencrypted; use https://, or set allow_plain_http = true (--allow-plain-http) for a "
            "server on a network you trust")


def check_base_url(url: Any, where: str = "settings") -> str:
    """``url`` if it is a usable API base, else :class:`ConfigError` (before anything is sent)."""
    problem = _base_url_problem(url)
    if problem:
        raise ConfigError(f"{where}: base_url {problem}")
    return str(url)  # already a str: _base_url_problem refuses anything else


def check_headers(headers: Any, where: str = "settings") -> dict[str, str]:
    """Extra HTTP headers as str -> str; a name that looks like a credential is refused."""
    problem = _headers_problem(headers)
    if problem:
        raise ConfigError(f"{where}: headers: {problem}")
    return {str(k): str(v) for k, v in headers.items()}


def _valid_url(url: str) -> str:
    problem = _base_url_problem(url)
    if problem:
        raise ValueError(problem)
    return url


def _valid_headers(headers: Mapping[str, str]) -> Mapping[str, str]:
    problem = _headers_problem(headers)
    if problem:
        raise ValueError(problem)
    return headers


#: Body keys tokenbridge sets itself, which ``extra_body`` would replace for every
#: sample, and where each is set instead. ``reasoning`` and ``provider`` tables merge.
_BODY_OWN_KEYS = {
    "messages": "from each prompt row",
    "tools": "from each prompt row, with send_tools = true",
    "model": "from model",
    **{key: f"from request.{key}, which is checked" for key in ("max_tokens", "temperature", "top_p", "seed", "n")},
    "stream": "with stream = true (--stream), when sending",
    "usage": "as {include: true}, which costs and the budget need",
}


def _valid_extra_body(extra: Mapping[str, Any]) -> Mapping[str, Any]:
    """``extra_body`` is merged into every request body: its keys may not replace what
    tokenbridge sets (``messages = "hijack"`` replaced every prompt, silently), and what it
    holds must be JSON (a ``nan`` was sent as ``NaN`` and written into exchanges.jsonl)."""
    own = [key for key in extra if key in _BODY_OWN_KEYS]
    if own:
        raise ValueError("; ".join(f"{key}: tokenbridge sets this itself ({_BODY_OWN_KEYS[key]})" for key in own))
    # a run setting put in the body: max_cost there went to the provider and capped nothing (a cold tester's)
    settings = [key for key in extra if key in {f.name for f in fields(GenerateSettings)}]
    if settings:
        raise ValueError("; ".join(f"{key}: a tokenbridge setting, not a request field: set it outside extra_body; "
                                   "there it would go to the provider as it is and do nothing here" for key in settings))
    for key in ("reasoning", "provider"):
        if key in extra and not isinstance(extra[key], Mapping):
            raise ValueError(f"{key}: must be a table (it is merged into the request's {key})")
    cap = extra.get("max_completion_tokens")
    if cap is not None and not (type(cap) is int and 1 <= cap <= INT64_MAX):
        raise ValueError(f"max_completion_tokens: must be a whole number of tokens, 1 or more (the budget reserves "
                         f"it as the completion's cap), got {cap!r}")
    if why := _json_problem(extra):
        raise ValueError(why)
    if where := _credential_path(extra):
        raise ValueError(f"{where}: looks like a credential (not shown here): extra_body goes into every request and "
                         "is stored with every exchange (the store, exchanges.jsonl, the exports); the key comes only "
                         "from api_key_env")
    return extra


def _credential_path(value: Any) -> str | None:  # Any: JSON (checked by _json_problem first)
    """Where in ``value`` a string (or a key) is a credential: a token that starts as a
    provider's key does (``sk-ant-``, ``sk-or-v1-``, ``AIza``...), or a generic one (``sk-``,
    ``Bearer``) or any string under a key named as a credential (``api_key``, ``auth``,
    ``secret``, ``private_key``... but not ``prompt_cache_key``) with a key's random body
    (:func:`_random_run`). Free text is no header value: ``rk-2024-11-05-ablation-v2`` and
    ``Use basic 2024-05-01T12-00-00Z`` are not keys (a cold reviewer's)."""
    stack: list[tuple[Any, str, bool]] = [(value, "", False)]
    while stack:
        v, at, named = stack.pop()
        if isinstance(v, str):
            if (named and _random_run(v)) or _key_token_in(v):
                return at.lstrip(".") or "value"
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{at}[{i}]", named) for i, x in enumerate(v))
        elif isinstance(v, Mapping):
            for k, x in v.items():
                if _key_token_in(str(k)):
                    return f"{at}.<a key>".lstrip(".")
                name = str(k)
                stack.append((x, f"{at}.{k}", named or bool(_CREDENTIAL_FIELD.search(name) and "cache" not in
                                                              name.lower())))
    return None


#: A body field named as a credential (as :data:`_CREDENTIAL_HEADER`, but a session's or a
#: cookie's id is sent to the provider as such: ``session_id`` is routing, not a secret).
_CREDENTIAL_FIELD = re.compile(r"auth|key|token|secret|passw|credential|bearer|private", re.IGNORECASE)
#: Prefixes only providers' keys start with: a token after one is a key whatever its body.
_KEY_PREFIX = re.compile(r"^(?:sk-(?:or|ant|proj|svcacct|admin)-|gsk_|xai-|AIza|hf_|ghp_|gho_|ghs_|github_pat_|glpat-|"
                         r"pplx-|r8_)")
_ALNUM_RUN = re.compile(r"[A-Za-z0-9]{20,}")


def _key_token_in(text: str) -> bool:
    """Whether ``text`` holds a token :data:`_CREDENTIAL_TOKEN` finds that is a key: after a
    provider's own prefix, or (generic ``sk-``/``rk-``/``pk-``, a scheme) with a random body."""
    for m in _CREDENTIAL_TOKEN.finditer(text):
        token = m.group(1) or m.group(2)
        if (m.group(1) and _KEY_PREFIX.match(token)) or _random_run(token):
            return True
    return False


def _random_run(text: str) -> bool:
    """Whether ``text`` holds 20 letters and digits in a row, three or more of each: the body
    of a key (hex, base62, base64), which a word, a date or an id made of words never is."""
    for m in _ALNUM_RUN.finditer(text):
        run = m.group()
        digits = sum(c.isdigit() for c in run)
        if digits >= 3 and len(run) - digits >= 3:
            return True
    return False


def _json_problem(value: Any) -> str | None:
    """Where ``value`` stops being plain JSON (a non-finite float, a date, a non-string
    key, nesting past :data:`~tokenbridge.jsonl.MAX_DEPTH`), as ``path: why``; None when it is JSON."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, at, depth = stack.pop()
        where = at.lstrip(".") or "value"
        if depth > MAX_DEPTH:
            return f"{where}: nested more than {MAX_DEPTH} levels deep"
        if v is None or isinstance(v, (str, bool, int)):
            if isinstance(v, str) and (why := not_text(v)):
                return f"{where}: {why}"
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                return f"{where}: must be a finite number, got {v!r} (a request holding it is not JSON)"
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{at}[{i}]", depth + 1) for i, x in enumerate(v))
        elif isinstance(v, Mapping):
            for k, x in v.items():
                if not isinstance(k, str):
                    return f"{where}: key {k!r} is not a string"
                stack.append((x, f"{at}.{k}", depth + 1))
        else:
            return f"{where}: a {type(v).__name__} is not a JSON value"
    return None


def _valid_name(name: str) -> str:
    if not _NAME_OK.match(name):
        raise ValueError(f"dataset name {name!r} must be letters, digits, '_', '.', '-'")
    return name


def endpoint_identity(url: str) -> str:
    """What makes two base URLs the same API for resume checks: scheme, host, port, path.

    Loopback URLs compare without their port: the built-in emulator (and ``tokenbridge
    run``'s) picks a free port on every start.
    """
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    path = parts.path.rstrip("/")
    if host in _LOOPBACK:
        return f"{parts.scheme}://loopback{path}"
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme, 0)
    return f"{parts.scheme}://{host}:{port}{path}"


# --- the schema --------------------------------------------------------------------------

#: The integers a request may carry: 64-bit signed, what OpenAI-compatible servers take
#: (vLLM checks ``seed`` against it) and what a stored request reads back as an integer
#: (orjson read ``seed = 99999999999999999999999`` back as the float ``1e+23``).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64(value: int) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"must be a 64-bit integer, {INT64_MIN} to {INT64_MAX} (what the API takes and a stored "
                         f"request reads back as an integer), got {value}")
    return value


#: An integer request field (``seed``): any sign, within 64 bits.
ApiInt = Annotated[Int, AfterValidator(_int64)]
#: A positive integer request field (``max_tokens``, ``n``), within 64 bits.
ApiPosInt = Annotated[Int, Field(ge=1), AfterValidator(_int64)]


@with_config(FORBID)
class Reasoning(TypedDict, total=False):
    """OpenRouter's ``reasoning`` request field."""

    enabled: Bool
    #: OpenRouter's efforts: any other word went out as sent ("no" turned thinking on)
    effort: Literal["max", "xhigh", "high", "medium", "low", "minimal", "none"]
    max_tokens: ApiPosInt
    exclude: Bool


def _named(value: str) -> str:
    if not value.strip():
        raise ValueError("must be a name, not empty or blank")
    return value


#: A provider or quantization name: an empty one is a slip (``--provider-only a,,b``), never a name.
_Name = Annotated[Str, AfterValidator(_named)]


@with_config(FORBID)
class ProviderRouting(TypedDict, total=False):
    """OpenRouter provider routing; a typo must not silently route elsewhere."""

    order: list[_Name]
    #: none allowed is no routing: every sample failed with no endpoint
    only: Annotated[list[_Name], Field(min_length=1)]
    ignore: list[_Name]
    quantizations: Annotated[list[_Name], Field(min_length=1)]
    allow_fallbacks: Bool
    require_parameters: Bool
    data_collection: Literal["allow", "deny"]
    sort: Str


PROVIDER_KEYS = tuple(ProviderRouting.__annotations__)
REASONING_KEYS = tuple(Reasoning.__annotations__)


def _reasoning_shorthand(value: Any) -> Any:
    """A bare effort string or on/off (the ``--reasoning`` flag's forms) as a mapping."""
    if isinstance(value, bool):
        return {"enabled": value}
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("on", "true", "enabled", "yes"):
            return {"enabled": True}
        if word in ("off", "false", "disabled", "none", "no"):
            return {"enabled": False}
        return {"effort": word}  # an effort in any case; one that is none is named by the schema
    return value


@with_config(FORBID)
@dataclass(frozen=True)
class DatasetSpec:
    """One named prompt source: a JSONL/Parquet file or a folder (HF ``save_to_disk`` or files)."""

    name: Annotated[Str, AfterValidator(_valid_name)]
    path: Path
    limit: NonNegInt | None = None
    split: Annotated[Str, Field(min_length=1)] | None = None


@with_config(FORBID)
@dataclass(frozen=True)
class Prices:
    """USD per million tokens, used when the response carries no ``usage.cost``."""

    prompt: NonNegFloat = 0.0
    completion: NonNegFloat = 0.0

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.prompt + completion_tokens * self.completion) / 1e6


@with_config(FORBID)
@dataclass(frozen=True)
class RequestSettings:
    """The body fields every sample's request shares (besides its messages)."""

    model: Str = ""
    max_tokens: ApiPosInt | None = None
    temperature: NonNegFloat | None = None
    top_p: Annotated[NonNegFloat, Field(le=1)] | None = None
    seed: ApiInt | None = None
    n: ApiPosInt | None = None
    reasoning: Annotated[Reasoning | None, BeforeValidator(_reasoning_shorthand)] = None
    provider: ProviderRouting | None = None
    extra_body: Annotated[Mapping[Str, Any], AfterValidator(_valid_extra_body)] = field(default_factory=dict)
    # Kimi emits tool calls as raw marker text when no `tools` parameter is sent, which
    # is what exact-token reconstruction wants; sending `tools` makes providers parse them.
    send_tools: Bool = False


#: Requests in flight at most: far past what any API serves one key (OpenRouter's limits are
#: in the hundreds), and what the limiter's per-slot history stays small at.
MAX_CONCURRENCY = 10_000


@with_config(FORBID)
@dataclass(frozen=True)
class GenerateSettings:
    """Everything one ``generate`` run needs (the API key is *not* here: only its env name)."""

    datasets: tuple[DatasetSpec, ...] = ()
    request: RequestSettings = field(default_factory=RequestSettings)
    base_url: Annotated[Str, AfterValidator(_valid_url)] = DEFAULT_BASE_URL
    api_key_env: Annotated[Str, AfterValidator(_valid_env_name)] = "OPENROUTER_API_KEY"
    # the limiter keeps a few entries a slot: 10**8 slots were 24 GB and an OOM kill
    concurrency: Annotated[PosInt, Field(le=MAX_CONCURRENCY)] = 64
    min_concurrency: Annotated[PosInt, Field(le=MAX_CONCURRENCY)] = 1
    max_attempts: PosInt = 6
    stream: Bool = False
    max_cost: NonNegFloat | None = None
    prices: Prices | None = None
    limit: NonNegInt | None = None  # default per-dataset limit (a dataset's own limit wins)
    tokenizer: Annotated[Str, Field(min_length=1)] | None = None
    dialect: DialectName | None = None
    timeout_s: PosFloat = 1800.0  # whole non-streamed request (the model's full generation time)
    read_timeout_s: PosFloat = 300.0  # streamed: longest silence between bytes (attempt_timeout_s bounds the total)
    connect_timeout_s: PosFloat = 30.0
    backoff_base_s: NonNegFloat = 1.0
    backoff_max_s: NonNegFloat = 120.0
    commit_interval_s: NonNegFloat = 0.0  # extra wait before each group commit (0: commit as soon as idle)
    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    log_interval_s: NonNegFloat = 15.0
    headers: Annotated[Mapping[Str, Str], AfterValidator(_valid_headers)] = field(default_factory=dict)  # e.g. X-Title
    proxy_from_env: Bool = False  # honour HTTPS_PROXY / netrc (aiohttp trust_env)
    # send the key over plain http:// to a host that is not this machine (a LAN server)
    allow_plain_http: Bool = False
    # every attempt, streamed or not, ends after this long in all (keep-alive comments
    # reset nothing): Kimi K2.5 reasoning runs to ~32k tokens, ~10 min at a slow 50 tok/s
    attempt_timeout_s: PosFloat = 900.0
    # a body (or SSE stream) larger than this is refused while it is read, never buffered
    max_response_bytes: Annotated[Int, Field(ge=1024)] = MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        if not (isinstance(self.attempt_timeout_s, (int, float)) and not isinstance(self.attempt_timeout_s, bool)
                and 0 < self.attempt_timeout_s < float("inf")):
            raise ConfigError(f"attempt_timeout_s must be a positive number of seconds, got {self.attempt_timeout_s!r}")
        if not (is_int(self.max_response_bytes) and self.max_response_bytes >= 1024):
            raise ConfigError(f"max_response_bytes must be an integer >= 1024, got {self.max_response_bytes!r}")
        check_base_url(self.base_url)
        check_headers(self.headers)
        if why := env_name_problem(self.api_key_env):
            raise ConfigError(f"api_key_env {why}")

    def with_overrides(self, **overrides: Any) -> GenerateSettings:
        """A copy with the given non-None fields replaced (CLI flags over the config file),
        checked against the schema like a config file."""
        return override_settings(self, overrides)

    def describe(self) -> dict[str, Any]:
        """JSON-able view for the store's run log (the key is not a setting, only its env name;
        a ``base_url`` that holds it is masked by the run before this is stored)."""
        d = asdict(self)
        d["datasets"] = [{**asdict(s), "path": str(s.path)} for s in self.datasets]
        # a header's value may be a token of the user's under a harmless name (X-Title): its
        # digest says whether it changed, never what it is
        d["headers"] = {name: "sha256:" + hashlib.sha256(str(value).encode("utf-8", "surrogatepass")).hexdigest()[:16]
                        for name, value in self.headers.items()}
        out: dict[str, Any] = json.loads(json.dumps(d, default=str))
        return out


_TOP_KEYS = tuple(f.name for f in fields(GenerateSettings))
_REQ_KEYS = tuple(f.name for f in fields(RequestSettings))
#: Request fields may sit at the top level of a config: they are known keys there too.
_ALSO_KNOWN: dict[tuple[str | int, ...], tuple[str, ...]] = {(): _REQ_KEYS}


def override_settings(
    settings: GenerateSettings, overrides: Mapping[str, Any], where: Where | None = None
) -> GenerateSettings:
    """``settings`` with the non-None ``overrides`` (``request`` a mapping of its own),
    validated by the same schema as a config file; ``where.flags`` names the CLI flag of
    each field so a bad one is reported as ``--max-tokens: ...``."""
    where = where or Where("overrides", flags={})
    clean = {k: v for k, v in overrides.items() if v is not None}
    req = {k: v for k, v in (clean.pop("request", None) or {}).items() if v is not None}
    data: dict[str, Any] = {name: getattr(settings, name) for name in _TOP_KEYS}
    data.update(clean)
    if req:
        data["request"] = {**{name: getattr(settings.request, name) for name in _REQ_KEYS}, **req}
    out, problems = validate(GenerateSettings, data, where)
    if problems:
        raise several(ConfigError, problems)
    checked: GenerateSettings = out
    if dup := repeated_names(checked.datasets):  # a config's are refused at load: the same here
        given = "; ".join(f"{n}: {', '.join(str(d.path) for d in checked.datasets if d.name == n)}" for n in dup)
        raise ConfigError(f"datasets: names must be unique, repeated: {given} (a path alone is named after its file: "
                          "give each a name, NAME=PATH)")
    from .request import extra_body_overlaps  # noqa: PLC0415 - request.py builds on this module

    overlaps = extra_body_overlaps(checked.request)
    if overlaps:  # the file alone was refused at load: a flag (or an override) set what extra_body sets
        problems = [where.problem(("request", *p), (
            f"also set by extra_body.{'.'.join(p)} in the config; set it in one place (extra_body is merged last "
            "and would silently replace this value)")) for p in overlaps]
        raise several(ConfigError, problems)
    return checked


# --- loading -----------------------------------------------------------------------------


def repeated_names(datasets: Sequence[DatasetSpec]) -> list[str]:
    """The dataset names given more than once, sorted: each must name one dataset."""
    names = [d.name for d in datasets]
    return sorted({n for n in names if names.count(n) > 1})


def parse_dataset_arg(arg: str, *, limit: int | None = None) -> DatasetSpec:
    """``name=path`` or ``path`` (named after the file/folder stem) as a :class:`DatasetSpec`."""
    name, sep, path = arg.partition("=")
    if not sep or "/" in name or not name:
        path, name = arg, _stem(arg)
    if not path.strip():  # Path("") is the working folder: every prompt file there was read
        raise ConfigError(f"prompt argument {arg!r}: no path (give name=FILE or a folder)")
    _check_name(name, f"prompt argument {arg!r}")
    return DatasetSpec(name=name, path=Path(path), limit=limit)


def _stem(path: str) -> str:
    p = Path(path.rstrip("/"))
    name = p.name
    for suffix in (".jsonl", ".json", ".parquet", ".arrow"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _check_name(name: str, where: str) -> None:
    if not _NAME_OK.match(name):
        raise ConfigError(f"{where}: dataset name {name!r} must be letters, digits, '_', '.', '-'")


def load_config(path: str | Path, *, base_url_given: bool = False) -> GenerateSettings:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) config file; every problem
    in it is reported at once (one line each: ``file:line: key: what is wrong``).

    A ``tokenbridge run`` config is read for its [generate]. One that also has [emulator]
    is refused unless the caller gives the base URL (``base_url_given``): ``run`` starts
    that emulator and sends to it, ``generate`` starts none, so its requests (paid ones,
    with a key) would go to the [generate] base URL, OpenRouter by default, unannounced."""
    path = Path(path)
    data, text = read_mapping(path, ConfigError)
    where = Where(str(path), text)
    if isinstance(data.get("generate"), dict):
        stray = [where.problem((key,), "outside [generate], where it would be ignored; move it under [generate]")
                 for key in data if key not in _RUN_SECTIONS]
        if data.get("emulator") is not None and not base_url_given:
            stray.append(where.problem(("emulator",), (
                f"generate starts no emulator, so this config's requests would go to "
                f"{data['generate'].get('base_url') or GenerateSettings().base_url}: run it with "
                f"`tokenbridge run {path}`, or give --base-url (a `tokenbridge emulator` you started, or the API "
                "you mean to pay)")))
        if stray:
            raise several(ConfigError, stray)
        data, where = data["generate"], where.at("generate")
    return settings_from_mapping(data, source=str(path), base_dir=path.parent, where=where)


def settings_from_mapping(
    data: Mapping[str, Any], *, source: str = "config", base_dir: Path | None = None, where: Where | None = None
) -> GenerateSettings:
    """Build settings from a parsed config mapping; raises :class:`ConfigError` listing
    every problem (unknown keys get "did you mean")."""
    settings, problems = settings_problems(data, where or Where(source), base_dir)
    if problems:
        raise several(ConfigError, problems)
    return settings


#: Keys a user writes the API key itself under (``api_key = "sk-or-..."``): "did you mean
#: 'api_key_env'?" led users to paste the key there, where it was printed and stored.
_KEY_IN_CONFIG = re.compile(r"(?:openrouter[_-]?)?(?:api[_-]?)?(?:key|token|secret)", re.IGNORECASE)
_NO_KEY_IN_CONFIG = ("unknown key: a config never holds the API key (its value is not shown). Put the key in an "
                     "environment variable (export OPENROUTER_API_KEY=...); to read another variable, set api_key_env "
                     "to that variable's NAME (api_key_env = \"MY_KEY_VAR\"), never the key itself")


def settings_problems(
    data: Mapping[str, Any], where: Where, base_dir: Path | None = None
) -> tuple[GenerateSettings, list[str]]:
    """:func:`settings_from_mapping` that returns its problems (for ``run``, which reports
    the problems of every section together)."""
    data = dict(data)
    pasted = [key for key in data if key not in _TOP_KEYS and _KEY_IN_CONFIG.fullmatch(str(key))]
    for key in pasted:
        data.pop(key)
    moved: list[tuple[tuple[str | int, ...], tuple[str | int, ...]]] = []
    twice: list[str] = []
    req = data.get("request")
    if req is None or isinstance(req, Mapping):
        req = dict(req or {})
        for key in list(data):  # request fields may also sit at the top level
            if key in _REQ_KEYS and key not in _TOP_KEYS:
                if key in req:  # one would silently lose: say so instead
                    twice.append(key)
                    data.pop(key)
                    continue
                req[key] = data.pop(key)
                moved.append((("request", key), (key,)))
        if req:
            data["request"] = req
    problems = [where.problem((key,), f"also set as request.{key}; set it in one place") for key in twice]
    problems += [where.problem((key,), _NO_KEY_IN_CONFIG) for key in pasted]
    where = where.renamed(tuple(moved)).knowing(_ALSO_KNOWN)
    datasets = data.get("datasets")
    if isinstance(datasets, list):  # named after the file unless they say otherwise; builtin: resolved
        data["datasets"] = [_dataset_entry(d, i, where, problems) for i, d in enumerate(datasets)]
    settings, more = validate(GenerateSettings, data, where)
    problems += more
    if settings is None:
        return GenerateSettings(), sorted(problems, key=lambda p: _line_number(p, where.source))
    from .request import extra_body_overlaps, request_problem  # noqa: PLC0415 - request.py builds on this module

    overlaps = extra_body_overlaps(settings.request)
    problems += [where.problem(("request", "extra_body", *p), (
        f"also set by {where.place(('request', *p))}; set it in one place (extra_body is merged last and would "
        "silently replace it)")) for p in overlaps]
    if not overlaps and (bad := request_problem(settings.request)):
        problems.append(where.problem(*bad))
    dup = repeated_names(settings.datasets)
    if dup:
        problems.append(where.problem(("datasets",), f"dataset names must be unique, repeated: {dup}"))
    if base_dir is not None:
        specs = tuple(d if d.path.is_absolute() else replace(d, path=base_dir / d.path) for d in settings.datasets)
        tok = settings.tokenizer
        if tok is not None and not Path(tok).is_absolute() and (base_dir / tok).exists():
            tok = str(real_path(base_dir / tok))  # relative to the config file, like dataset paths
        settings = replace(settings, datasets=specs, tokenizer=tok)
    return settings, problems


def _dataset_entry(d: Any, i: int, where: Where, problems: list[str]) -> Any:
    if not isinstance(d, Mapping) or not isinstance(d.get("path"), str):
        return d
    if "\x00" in d["path"]:  # a path with one is an OS error (a traceback) at its first use
        problems.append(where.problem(("datasets", i, "path"), "must not contain a NUL character"))
        return {**d, "path": d["path"].replace("\x00", "")}
    if not d["path"].strip():  # joined to the config's folder, it read every prompt file there
        problems.append(where.problem(("datasets", i, "path"), "must name a file or folder (it is empty)"))
        return d
    d = {"name": _stem(d["path"]), **d}
    if d["path"].startswith(_BUILTIN):
        path = _builtin_path(d["path"])
        if path is None:
            names = _builtin_names()
            hint = did_you_mean(d["path"], names)
            problems.append(where.problem(("datasets", i, "path"), f"no such built-in data {d['path']!r}"
                                          + (hint if hint.startswith(";") else f" (have: {', '.join(names)})")))
        else:
            d["path"] = str(path)
    return d


def _builtin_path(value: str) -> Path | None:
    """``builtin:prompts/chat.jsonl``: the file shipped inside the package, if it is one of
    :func:`_builtin_names` (``builtin:../../../../../etc/passwd`` was joined and passed)."""
    name = value[len(_BUILTIN):].strip("/")
    if f"{_BUILTIN}{name}" not in _builtin_names():
        return None
    return Path(str(resources.files("tokenbridge") / "data" / name))


def _builtin_names() -> list[str]:
    root = Path(str(resources.files("tokenbridge") / "data"))
    return sorted(f"{_BUILTIN}{p.relative_to(root)}" for p in root.rglob("*.jsonl"))


def _line_number(problem: str, source: str) -> int:
    head = problem[len(source) + 1:].split(":", 1)[0] if problem.startswith(source + ":") else ""
    return int(head) if head.isdigit() else 1 << 30


def normalize_reasoning(value: Any, source: str = "reasoning") -> dict[str, Any]:
    """``reasoning`` as OpenRouter takes it; a bare effort string or bool is accepted too."""
    out, problems = validate(RequestSettings, {"reasoning": value}, Where(source, flags={"reasoning": source}))
    if problems:
        raise several(ConfigError, problems)
    return dict(out.reasoning)


def normalize_provider(value: Any, source: str = "provider") -> dict[str, Any]:
    """OpenRouter provider routing; unknown keys are rejected so a typo can't silently route wrong."""
    clean = {k: v for k, v in value.items() if v is not None} if isinstance(value, Mapping) else value
    out, problems = validate(RequestSettings, {"provider": clean}, Where(source, flags={"provider": source}))
    if problems:
        raise several(ConfigError, problems)
    return dict(out.provider)

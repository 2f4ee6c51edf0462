"""Run settings: what to send, where, how hard, and within which budget.

One :class:`GenerateSettings` is built from a TOML/YAML config file, CLI flags, or
Python; flags override the file. The config may hold these keys at its top level or
under a ``[generate]`` table (so the pipeline config can share one file)::

    base_url = "https://openrouter.ai/api/v1"
    model = "moonshotai/kimi-k2.5"
    concurrency = 256
    [request]            # max_tokens, temperature, top_p, seed, n, reasoning, provider, extra_body
    [prices]             # USD per million tokens: prompt, completion
    [[datasets]]         # name, path, limit, split

Validated whenever settings are built (file, flags, ``with_overrides`` or Python):
``base_url`` must be ``http(s)://host[:port]/path`` without user info, query or fragment
(``/chat/completions`` is appended to it), and ``headers`` may not carry a credential
(any name containing auth, key, token, secret, cookie, passw, session or credential:
the key comes only from ``api_key_env``).
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import yaml

from .errors import GenerateError

__all__ = [
    "ConfigError",
    "DatasetSpec",
    "GenerateSettings",
    "Prices",
    "RequestSettings",
    "check_base_url",
    "check_headers",
    "endpoint_identity",
    "load_config",
    "parse_dataset_arg",
    "settings_from_mapping",
]

DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
PROVIDER_KEYS = (
    "order",
    "only",
    "ignore",
    "quantizations",
    "allow_fallbacks",
    "require_parameters",
    "data_collection",
    "sort",
)
REASONING_KEYS = ("enabled", "effort", "max_tokens", "exclude")
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_CREDENTIAL_HEADER = re.compile(r"auth|key|token|secret|cookie|passw|session|credential", re.IGNORECASE)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ConfigError(GenerateError, ValueError):
    """A setting is missing or malformed; the message names the file and key."""


def check_base_url(url: Any, where: str = "settings") -> str:
    """``url`` if it is a usable API base, else :class:`ConfigError` (before anything is sent)."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{where}: base_url must be a URL like https://openrouter.ai/api/v1")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise ConfigError(f"{where}: base_url {url!r} is malformed ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: base_url {url!r} needs http:// or https:// and a host "
                          "(e.g. https://openrouter.ai/api/v1)")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{where}: base_url must not carry user info (user:password@); "
                          "the key comes from api_key_env")
    if parts.query or parts.fragment:
        raise ConfigError(f"{where}: base_url must not have a query or fragment (/chat/completions is appended to it)")
    return url


def check_headers(headers: Any, where: str = "settings") -> dict[str, str]:
    """Extra HTTP headers as str -> str; a name that looks like a credential is refused."""
    if not isinstance(headers, Mapping):
        raise ConfigError(f"{where}: headers must be a mapping of name -> value")
    out = {str(k): str(v) for k, v in headers.items()}
    bad = sorted(k for k in out if _CREDENTIAL_HEADER.search(k))
    if bad:
        raise ConfigError(f"{where}: header(s) {bad} look like credentials and are refused "
                          "(the key comes only from api_key_env)")
    return out


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


@dataclass(frozen=True)
class DatasetSpec:
    """One named prompt source: a JSONL/Parquet file or a folder (HF ``save_to_disk`` or files)."""

    name: str
    path: Path
    limit: int | None = None
    split: str | None = None


@dataclass(frozen=True)
class Prices:
    """USD per million tokens, used when the response carries no ``usage.cost``."""

    prompt: float
    completion: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.prompt + completion_tokens * self.completion) / 1e6


@dataclass(frozen=True)
class RequestSettings:
    """The body fields every sample's request shares (besides its messages)."""

    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = None
    reasoning: Mapping[str, Any] | None = None
    provider: Mapping[str, Any] | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    # Kimi emits tool calls as raw marker text when no `tools` parameter is sent, which
    # is what exact-token reconstruction wants; sending `tools` makes providers parse them.
    send_tools: bool = False


@dataclass(frozen=True)
class GenerateSettings:
    """Everything one ``generate`` run needs (the API key is *not* here: only its env name)."""

    datasets: tuple[DatasetSpec, ...] = ()
    request: RequestSettings = field(default_factory=RequestSettings)
    base_url: str = DEFAULT_BASE_URL
    api_key_env: str = "OPENROUTER_API_KEY"
    concurrency: int = 64
    min_concurrency: int = 1
    max_attempts: int = 6
    stream: bool = False
    max_cost: float | None = None
    prices: Prices | None = None
    limit: int | None = None  # default per-dataset limit (a dataset's own limit wins)
    tokenizer: str | None = None
    dialect: str | None = None
    timeout_s: float = 1800.0  # whole non-streamed request (the model's full generation time)
    read_timeout_s: float = 300.0  # streamed: longest silence between bytes (no total limit)
    connect_timeout_s: float = 30.0
    # every attempt, streamed or not, ends after this long in all (keep-alive comments
    # reset nothing): Kimi K2.5 reasoning runs to ~32k tokens, ~10 min at a slow 50 tok/s
    attempt_timeout_s: float = 900.0
    # a body (or SSE stream) larger than this is refused while it is read, never buffered
    max_response_bytes: int = 64 * 1024 * 1024
    backoff_base_s: float = 1.0
    backoff_max_s: float = 120.0
    commit_interval_s: float = 0.0  # extra wait before each group commit (0: commit as soon as idle)
    progress: str = "auto"  # auto | rich | plain | none
    log_interval_s: float = 15.0
    headers: Mapping[str, str] = field(default_factory=dict)  # e.g. HTTP-Referer / X-Title
    proxy_from_env: bool = False  # honour HTTPS_PROXY / netrc (aiohttp trust_env)

    def __post_init__(self) -> None:
        if not (isinstance(self.attempt_timeout_s, (int, float)) and not isinstance(self.attempt_timeout_s, bool)
                and 0 < self.attempt_timeout_s < float("inf")):
            raise ConfigError(f"attempt_timeout_s must be a positive number of seconds, got {self.attempt_timeout_s!r}")
        if not (isinstance(self.max_response_bytes, int) and not isinstance(self.max_response_bytes, bool)
                and self.max_response_bytes >= 1024):
            raise ConfigError(f"max_response_bytes must be an integer >= 1024, got {self.max_response_bytes!r}")
        check_base_url(self.base_url)
        check_headers(self.headers)

    def with_overrides(self, **overrides: Any) -> "GenerateSettings":
        """A copy with the given non-None fields replaced (CLI flags over the config file)."""
        clean = {k: v for k, v in overrides.items() if v is not None}
        req = clean.pop("request", None)
        out = replace(self, **clean)
        if req:
            out = replace(out, request=replace(out.request, **{k: v for k, v in req.items() if v is not None}))
        return out

    def describe(self) -> dict[str, Any]:
        """JSON-able view for the store's run log (contains no secret: only the env name)."""
        d = asdict(self)
        d["datasets"] = [{**asdict(s), "path": str(s.path)} for s in self.datasets]
        return json.loads(json.dumps(d, default=str))


def parse_dataset_arg(arg: str, *, limit: int | None = None) -> DatasetSpec:
    """``name=path`` or ``path`` (named after the file/folder stem) as a :class:`DatasetSpec`."""
    name, sep, path = arg.partition("=")
    if not sep or "/" in name or not name:
        path, name = arg, _stem(arg)
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


def load_config(path: str | Path) -> GenerateSettings:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) config file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text) or {}
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a table/mapping at the top level")
    if isinstance(data.get("generate"), dict):
        data = data["generate"]
    return settings_from_mapping(data, source=str(path), base_dir=path.parent)


_TOP_KEYS = {f.name for f in fields(GenerateSettings)} - {"request", "datasets", "prices"}
_REQ_KEYS = {f.name for f in fields(RequestSettings)}


def settings_from_mapping(
    data: Mapping[str, Any], *, source: str = "config", base_dir: Path | None = None
) -> GenerateSettings:
    """Build settings from a parsed config mapping; unknown keys are errors (typos must not pass)."""
    data = dict(data)
    req_data = dict(data.pop("request", None) or {})
    for key in list(data):  # request fields may also sit at the top level
        if key in _REQ_KEYS and key not in _TOP_KEYS:
            req_data.setdefault(key, data.pop(key))
    unknown = set(data) - _TOP_KEYS - {"datasets", "prices"}
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)}")
    bad_req = set(req_data) - _REQ_KEYS
    if bad_req:
        raise ConfigError(f"{source}: unknown request key(s) {sorted(bad_req)}")

    request = _request_from(req_data, source)
    datasets = tuple(_dataset_from(d, i, source, base_dir) for i, d in enumerate(data.pop("datasets", None) or []))
    names = [d.name for d in datasets]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"{source}: dataset names must be unique, repeated: {sorted(dup)}")
    prices = _prices_from(data.pop("prices", None), source)
    top: dict[str, Any] = {}
    for key, value in data.items():
        top[key] = _coerce_top(key, value, source)
    tok = top.get("tokenizer")
    if base_dir is not None and isinstance(tok, str) and not Path(tok).is_absolute() and (base_dir / tok).exists():
        top["tokenizer"] = str((base_dir / tok).resolve())  # relative to the config file, like dataset paths
    return GenerateSettings(datasets=datasets, request=request, prices=prices, **top)


def _coerce_top(key: str, value: Any, source: str) -> Any:
    default = getattr(GenerateSettings(), key)
    if key == "headers":
        return check_headers(value, source)
    if key == "base_url":
        return check_base_url(value, source)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key} must be true or false")
        return value
    if isinstance(default, int) and not isinstance(default, bool):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{source}: {key} must be a positive integer")
        return value
    if isinstance(default, float) or key == "max_cost":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{source}: {key} must be a non-negative number")
        return float(value)
    if key == "limit":
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: limit must be a positive integer")
        return value
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{source}: {key} must be a string")
    return value


def _request_from(d: dict[str, Any], source: str) -> RequestSettings:
    for key in ("max_tokens", "seed", "n"):
        v = d.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ConfigError(f"{source}: request.{key} must be an integer")
    for key in ("temperature", "top_p"):
        v = d.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise ConfigError(f"{source}: request.{key} must be a number")
    if d.get("model") is not None and not isinstance(d["model"], str):
        raise ConfigError(f"{source}: model must be a string")
    reasoning = d.get("reasoning")
    if reasoning is not None:
        reasoning = normalize_reasoning(reasoning, source)
    provider = d.get("provider")
    if provider is not None:
        provider = normalize_provider(provider, source)
    extra = d.get("extra_body") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{source}: request.extra_body must be a mapping")
    send_tools = d.get("send_tools", False)
    if not isinstance(send_tools, bool):
        raise ConfigError(f"{source}: request.send_tools must be true or false")
    return RequestSettings(
        model=d.get("model") or "",
        max_tokens=d.get("max_tokens"),
        temperature=d.get("temperature"),
        top_p=d.get("top_p"),
        seed=d.get("seed"),
        n=d.get("n"),
        reasoning=reasoning,
        provider=provider,
        extra_body=extra,
        send_tools=send_tools,
    )


def normalize_reasoning(value: Any, source: str = "reasoning") -> dict[str, Any]:
    """``reasoning`` as OpenRouter takes it; a bare effort string or bool is accepted too."""
    if isinstance(value, bool):
        return {"enabled": value}
    if isinstance(value, str):
        if value.lower() in ("on", "true", "enabled"):
            return {"enabled": True}
        if value.lower() in ("off", "false", "disabled", "none"):
            return {"enabled": False}
        return {"effort": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: reasoning must be a mapping like {{effort = \"high\"}}")
    bad = set(value) - set(REASONING_KEYS)
    if bad:
        raise ConfigError(f"{source}: unknown reasoning key(s) {sorted(bad)} (allowed: {', '.join(REASONING_KEYS)})")
    return dict(value)


def normalize_provider(value: Any, source: str = "provider") -> dict[str, Any]:
    """OpenRouter provider routing; unknown keys are rejected so a typo can't silently route wrong."""
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: provider must be a mapping")
    bad = set(value) - set(PROVIDER_KEYS)
    if bad:
        raise ConfigError(f"{source}: unknown provider key(s) {sorted(bad)} (allowed: {', '.join(PROVIDER_KEYS)})")
    for key in ("order", "only", "ignore", "quantizations"):
        v = value.get(key)
        if v is not None and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
            raise ConfigError(f"{source}: provider.{key} must be a list of strings")
    for key in ("allow_fallbacks", "require_parameters"):
        v = value.get(key)
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"{source}: provider.{key} must be true or false")
    return {k: v for k, v in value.items() if v is not None}


def _dataset_from(d: Any, i: int, source: str, base_dir: Path | None) -> DatasetSpec:
    where = f"{source}: datasets[{i}]"
    if not isinstance(d, dict) or "path" not in d:
        raise ConfigError(f"{where}: each dataset needs at least a path")
    bad = set(d) - {"name", "path", "limit", "split"}
    if bad:
        raise ConfigError(f"{where}: unknown key(s) {sorted(bad)}")
    path = Path(str(d["path"]))
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    name = str(d.get("name") or _stem(str(d["path"])))
    _check_name(name, where)
    limit = d.get("limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ConfigError(f"{where}: limit must be a non-negative integer")
    split = d.get("split")
    return DatasetSpec(name=name, path=path, limit=limit, split=str(split) if split else None)


def _prices_from(value: Any, source: str) -> Prices | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"prompt", "completion"}:
        raise ConfigError(f"{source}: prices must be {{prompt = USD/Mtok, completion = USD/Mtok}}")
    try:
        return Prices(prompt=float(value.get("prompt", 0.0)), completion=float(value.get("completion", 0.0)))
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: prices must be numbers (USD per million tokens)") from None

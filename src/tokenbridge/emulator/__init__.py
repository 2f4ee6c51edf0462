"""A loopback OpenRouter-compatible server for tests and dry runs.

It answers chat completions (plain JSON and SSE streams) from a deterministic synthetic
model whose native ids come from the real tokenizer, through configurable "providers"
that show the quirks and failures real providers do. The model family is the
tokenizer's (Kimi K2.5, Qwen3, DeepSeek V3.1 / V3.2, GLM-4.5; :mod:`.families`), and
``engine = "sglang"`` / ``"vllm"`` serve what those engines make of that family's ids.

Stable API (the generate engine's tests use it)::

    from tokenbridge.emulator import EmulatorConfig, ProviderConfig, ProviderQuirks, running_emulator

    cfg = EmulatorConfig(providers=(ProviderConfig("leaky/int4", quantization="int4",
                                                   quirks=ProviderQuirks(end_marker_leak=1.0)),))
    with running_emulator(cfg, tokenizer=tok) as base_url:   # "http://127.0.0.1:PORT/api/v1"
        ...  # POST f"{base_url}/chat/completions"

* ``running_emulator(config=None, tokenizer=None, *, host="127.0.0.1", port=0)``: a context
  manager; the server runs on a background thread with its own event loop and stops on
  exit. ``tokenizer`` is a loaded :class:`~tokenbridge.tokenizer.Tokenizer` or a folder.
* ``serve(config, tokenizer, *, host, port)``: the same in the foreground (the CLI).
* ``build_app(config, tokenizer)``: the bare ``aiohttp.web.Application``.
* ``load_emulator_config(path)``: TOML or YAML, see ``examples/emulator.toml``.
* ``sample_key(messages)``: the key ``GET /stats`` counts requests under.

Besides the chat endpoints the server has (relative to the host root; also under
``/api/v1``): ``GET /health``, ``GET /stats`` (``total``, ``by_provider``, ``by_status``,
``by_fault``, ``by_key`` (every request per sample key), ``ok_by_key`` (successful ones),
``by_request``, ``spent_usd``), ``GET|POST /admin/credits`` with ``{"credits_usd": X|null}``
(a fresh budget: once spent, every request gets HTTP 402), ``POST /admin/settings``
with ``{"fault_rate": F, "latency_ms": L}`` (L applies to providers without their own
``latency_ms``), and ``POST /admin/reset``.

Provider quirks (rates in ``ProviderQuirks``): ``end_marker_leak``, ``think_close_in_content``,
``think_open_in_reasoning``, ``reasoning_in_content``, ``strip_whitespace``,
``parse_tool_calls``, ``drop_reasoning``, ``noncanonical``. Faults (``ProviderFaults``):
``no_endpoints`` (404), ``rate_limit`` (429 + Retry-After), ``server_error`` (502/503),
``error_body`` (200 + error), ``choice_error``, ``midstream_error``, ``malformed_json``,
``slow``. ``EmulatorConfig.fault_rate`` mixes the transport ones in; draws are keyed by
(seed, sample key, attempt), so retries get a fresh but reproducible coin.

Behaviour worth knowing: outputs are deterministic per (messages, tools, thinking mode,
``seed``, choice index); ``temperature: 0`` makes all ``n`` choices equal; requests for a
model id not in ``EmulatorConfig.models`` get HTTP 400 unless ``accept_any_model``;
``return_token_ids: true`` adds ``prompt_token_ids`` and ``choices[i].token_ids``.
"""

from __future__ import annotations

from .config import (
    TRANSPORT_FAULTS,
    ConfigError,
    EmulatorConfig,
    ProviderConfig,
    ProviderFaults,
    ProviderQuirks,
    load_emulator_config,
)
from .hashing import sample_key
from .runner import running_emulator, serve
from .server import build_app
from .synthetic import Generation, SyntheticModel

__all__ = [
    "TRANSPORT_FAULTS",
    "ConfigError",
    "EmulatorConfig",
    "Generation",
    "ProviderConfig",
    "ProviderFaults",
    "ProviderQuirks",
    "SyntheticModel",
    "build_app",
    "load_emulator_config",
    "running_emulator",
    "sample_key",
    "serve",
]

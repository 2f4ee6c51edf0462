"""Generation at scale: send every prompt once, keep every byte the API returned.

Python API (what ``tokenbridge run`` calls)::

    from tokenbridge.generate import load_config, parse_dataset_arg, generate_run, write_exchanges

    settings = load_config("generate.toml")          # or GenerateSettings(...) built in code
    settings = settings.with_overrides(concurrency=128, stream=True)
    summary = generate_run(settings, "runs/k25")      # blocking; resumes if run before
    summary.exit_code, summary.done, summary.failed, summary.spent_total, summary.stop_reason
    write_exchanges("runs/k25")                       # RUN/exchanges.jsonl again from the store

    report = dry_run(settings, "runs/k25")            # prompt tokens + cost estimate, sends nothing
    reports = probe(model=..., providers=[...], base_url=..., key=read_api_key(), tokenizer=tok)

``generate_run`` (async: ``agenerate_run``) loads the datasets (:mod:`.prompts`), stores
each sample's canonical request in ``RUN/state.sqlite`` (:mod:`.store`), sends the pending
ones through the engine (:mod:`.engine`: aiohttp, AIMD concurrency, retries, budget),
commits every response verbatim before counting it, and finally rewrites
``RUN/exchanges.jsonl`` (input order, atomic) and ``RUN/generate.json`` (the summary).
The API key is read from ``settings.api_key_env`` (default ``OPENROUTER_API_KEY``) and is
never stored, logged or reported.

Exit codes (:class:`ExitCode`): 0 all done; 1 finished with failed samples or bad rows;
2 usage/config error; 3 stopped on HTTP 402; 4 stopped at ``max_cost``; 5 stopped on
repeated 401; 6 store write failed; 130 interrupted. Any stop leaves the unsent samples
pending: rerunning the same command continues.
"""

from __future__ import annotations

from .estimate import DryRunReport, dry_run
from .probe import PROBE_PROMPTS, ProbeCall, ProviderReport, aprobe, probe, render_table
from .prompts import LoadedPrompts, PromptSourceError, RowError, Sample, load_prompts
from .request import build_request
from .run import EXCHANGES_FILE, ExitCode, RunSummary, agenerate_run, generate_run, write_exchanges
from .secrets import ApiKey, MissingApiKey, read_api_key
from .settings import (
    ConfigError,
    DatasetSpec,
    GenerateSettings,
    Prices,
    RequestSettings,
    load_config,
    parse_dataset_arg,
    settings_from_mapping,
)
from .store import Store, StoreError

__all__ = [
    "EXCHANGES_FILE",
    "PROBE_PROMPTS",
    "ApiKey",
    "ConfigError",
    "DatasetSpec",
    "DryRunReport",
    "ExitCode",
    "GenerateSettings",
    "LoadedPrompts",
    "MissingApiKey",
    "Prices",
    "ProbeCall",
    "PromptSourceError",
    "ProviderReport",
    "RequestSettings",
    "RowError",
    "RunSummary",
    "Sample",
    "Store",
    "StoreError",
    "agenerate_run",
    "aprobe",
    "build_request",
    "dry_run",
    "generate_run",
    "load_config",
    "load_prompts",
    "parse_dataset_arg",
    "probe",
    "read_api_key",
    "render_table",
    "settings_from_mapping",
    "write_exchanges",
]

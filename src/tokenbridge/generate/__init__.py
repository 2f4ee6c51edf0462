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

``generate_run`` (async: ``agenerate_run``) takes an exclusive lock on ``RUN/.lock`` for
the whole run, loads the datasets (:mod:`.prompts`), stores each sample's canonical
request in ``RUN/state.sqlite`` (:mod:`.store`), sends the pending ones through the
engine (:mod:`.engine`: aiohttp, AIMD concurrency, retries, budget), commits every
response verbatim (with the ``base_url`` it came from) before counting it, and finally
rewrites ``RUN/exchanges.jsonl`` with this invocation's done samples (input order, atomic)
and ``RUN/generate.json`` (the summary). The API key is read from ``settings.api_key_env``
(default ``OPENROUTER_API_KEY``) and is never stored, logged or reported.

Rerunning on a folder: done samples are kept and not sent again; failed ones are sent
again; samples not done yet take this invocation's request. If *done* samples were made
with another request (model, max_tokens, messages...) or from another API (base_url;
loopback URLs match whatever their port), the run refuses (``SettingsChanged``, exit 2)
unless ``force_settings=True`` / ``--force-settings``, which keeps those answers. New
samples whose requests the folder already holds answers to under other sample ids (a
dataset renamed: ids are ``<dataset>-<row id>``) are refused too (``AlreadyAnswered``,
exit 2), before anything is sent.

Errors raised before anything is sent are all :class:`GenerateError` (``str(exc)`` is one
line without secrets, ``exc.exit_code`` the code to exit with): ``ConfigError``,
``MissingApiKey``, ``PromptSourceError``, ``StoreError`` (2; 6 when the state cannot be
written), ``SettingsChanged`` (2), ``AlreadyAnswered`` (2), ``RunFolderBusy`` (7). Loading a tokenizer for
``dry_run`` may also raise ``tokenbridge.tokenizer.TokenizerError`` or
``tokenbridge.chat.DialectError``. Bad rows do not raise: they are ``RunSummary.bad_rows``.

Exit codes (:class:`ExitCode`, ``RunSummary.exit_code``): 0 all done; 1 finished with
failed samples or bad rows; 2 usage/config error; 3 stopped on HTTP 402; 4 stopped at
``max_cost``; 5 stopped on repeated 401; 6 store write failed (``exchanges.jsonl`` then
holds what was committed); 7 run folder in use by another process; 130 interrupted. Any
stop leaves the unsent samples pending: rerunning the same command continues.

Budget (``max_cost``, details in :mod:`.budget`): with ``[prices]`` the cap is never
passed; without, prompt and completion prices are learned apart from ``usage.cost`` and
the cap can be passed by at most one request. Timeouts and cut streams count as possibly
billed (``RunSummary.spent_possible``).

A 404 "No endpoints found" fails the later samples whose body matches on everything but
the messages (tools by presence; :func:`~.request.routing_key`) without sending them
(``no_endpoints_skipped``, sent once on the next run); one about context or length fails
only its sample. ``base_url`` must be ``http(s)://host/path`` without user info, query or
fragment; headers that look like credentials are refused (:mod:`.settings`).
"""

from __future__ import annotations

from .errors import AlreadyAnswered, GenerateError, RunFolderBusy, SettingsChanged
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
    "AlreadyAnswered",
    "EXCHANGES_FILE",
    "PROBE_PROMPTS",
    "ApiKey",
    "ConfigError",
    "DatasetSpec",
    "DryRunReport",
    "ExitCode",
    "GenerateError",
    "GenerateSettings",
    "LoadedPrompts",
    "MissingApiKey",
    "Prices",
    "ProbeCall",
    "PromptSourceError",
    "ProviderReport",
    "RequestSettings",
    "RowError",
    "RunFolderBusy",
    "RunSummary",
    "Sample",
    "SettingsChanged",
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

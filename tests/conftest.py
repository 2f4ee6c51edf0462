"""Shared fixtures and helpers: the real Kimi K2.5 tokenizer data from ../shared, the
pipeline test's run config, and the small readers and writers many test files need."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIMI_DIR = ROOT.parent / "shared" / "tokenizers" / "kimi-k2.5"
#: The README's seven exchange records and one broken line.
EXAMPLE_EXCHANGES = ROOT / "examples" / "exchanges.jsonl"
#: The six providers with real quirks that `make demo` and the README use.
EXAMPLE_EMULATOR = ROOT / "examples" / "emulator.toml"
MODEL = "moonshotai/kimi-k2.5"
#: An emulator config whose one provider leaks the end marker into every completed answer.
LEAKY_EMULATOR = (f'models = ["{MODEL}"]\n[[providers]]\nname = "leaky/int4"\nquantization = "int4"\n'
                  "[providers.quirks]\nend_marker_leak = 1.0\n")


@pytest.fixture(scope="session")
def kimi_dir() -> Path:
    if not (KIMI_DIR / "tiktoken.model").is_file():
        pytest.fail(f"Kimi tokenizer data missing at {KIMI_DIR} (CI lays ../shared beside the clone)")
    return KIMI_DIR


@pytest.fixture(scope="session")
def kimi(kimi_dir):
    from tokenbridge.tokenizer import load_tokenizer

    return load_tokenizer(kimi_dir)


@pytest.fixture(scope="module")
def tok(request: pytest.FixtureRequest):
    """The tokenizer of the module's ``FAMILY`` (a folder under ../shared/tokenizers)."""
    from test_families_support import family_tokenizer

    family = getattr(request.module, "FAMILY", None)
    if family is None:
        pytest.fail(f"{request.module.__name__} uses the tok fixture but sets no FAMILY")
    return family_tokenizer(family)


@pytest.fixture(scope="module")
def dialect(tok):
    """The dialect resolved from :func:`tok`."""
    from tokenbridge.chat import resolve_dialect

    return resolve_dialect(tok)


@pytest.fixture(autouse=True)
def _no_tokenizer_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TOKENBRIDGE_TOKENIZER set in the developer's shell must not change what a test
    sees: the tests that want it set it themselves."""
    monkeypatch.delenv("TOKENBRIDGE_TOKENIZER", raising=False)


def write_run_config(root: Path, kimi_dir: Path, extra: str = "", *, emulator: Path = EXAMPLE_EMULATOR) -> Path:
    """``root/run.toml``: the whole pipeline on the built-in emulator (``emulator``'s providers,
    no latency), 16 built-in prompts (12 chat, 4 plain), native ids asked for, run folder
    ``root/out``; ``extra`` is appended (more sections)."""
    cfg = root / "run.toml"
    cfg.write_text(
        f"""
[run]
out = "out"
tokenizer = "{kimi_dir}"

[emulator]
config = "{emulator}"
latency_ms = 0

[generate]
model = "{MODEL}"
concurrency = 8
max_tokens = 1024
progress = "none"
extra_body = {{ return_token_ids = true }}
datasets = [
  {{ name = "chat", path = "builtin:prompts/chat.jsonl", limit = 12 }},
  {{ name = "plain", path = "builtin:prompts/plain.jsonl", limit = 4 }},
]

[vocab]
draft_vocab_size = 512
{extra}
""",
        encoding="utf-8",
    )
    return cfg


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSON-lines file, parsed."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def write_prompts(folder: Path, n: int) -> Path:
    """``folder/p.jsonl``: ``n`` prompts ``q0`` ... with ids 0 ... (what the hostile servers key on)."""
    path = folder / "p.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"q{i}"}) + "\n" for i in range(n)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def stage_inputs(kimi, tmp_path_factory) -> Path:
    """A folder with ``exchanges.jsonl`` (10 seeded synthetic exchanges), their
    ``reconstructed.jsonl`` and its first half (``first-half.jsonl``, an older output to
    replace): the inputs of the stage kill and signal tests, which only read them."""
    from test_export_support import make_run, write_jsonl

    root = tmp_path_factory.mktemp("stage-inputs")
    exchanges, rows = make_run(kimi, 10)
    write_jsonl(root / "exchanges.jsonl", exchanges)
    write_jsonl(root / "reconstructed.jsonl", rows)
    write_jsonl(root / "first-half.jsonl", rows[: len(rows) // 2])
    return root

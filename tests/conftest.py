"""Shared fixtures: the real Kimi K2.5 tokenizer data from ../shared."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIMI_DIR = ROOT.parent / "shared" / "tokenizers" / "kimi-k2.5"


@pytest.fixture(scope="session")
def kimi_dir() -> Path:
    if not (KIMI_DIR / "tiktoken.model").is_file():
        pytest.fail(f"Kimi tokenizer data missing at {KIMI_DIR} (CI lays ../shared beside the clone)")
    return KIMI_DIR


@pytest.fixture(scope="session")
def kimi(kimi_dir):
    from tokenbridge.tokenizer import load_tokenizer

    return load_tokenizer(kimi_dir)


@pytest.fixture(autouse=True)
def _no_tokenizer_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TOKENBRIDGE_TOKENIZER set in the developer's shell must not change what a test
    sees: the tests that want it set it themselves."""
    monkeypatch.delenv("TOKENBRIDGE_TOKENIZER", raising=False)

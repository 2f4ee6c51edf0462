"""Shared pieces of the per-family tests (no tests here): the real tokenizers from
../shared, an adapter that lets ``renderers`` encode with our tokenizer, SGLang's own
reasoning parsers as the engine, and conversation strategies.

SGLang is imported as test_sglang_oracle.py does: registered as a bare namespace package
so its ``__init__`` (the whole runtime) never runs; the parser modules import normally.
"""

from __future__ import annotations

import codecs
import dataclasses
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "tokenizers"


def family_tokenizer(name: str):
    from tokenbridge.tokenizer import load_tokenizer

    folder = SHARED / name
    if not (folder / "tokenizer.json").is_file():
        pytest.fail(f"{name} tokenizer data missing at {folder} (CI lays ../shared beside the clone)")
    return load_tokenizer(folder)


def special_ids(name: str) -> set[int]:
    """Ids a ``skip_special_tokens=True`` decode drops (``special: true`` added tokens)."""
    data = json.loads((SHARED / name / "tokenizer.json").read_text(encoding="utf-8"))
    return {t["id"] for t in data["added_tokens"] if t.get("special")}


@dataclasses.dataclass
class ExampleRun:
    """An ``examples/<family>.toml`` run end to end in a temporary folder (emulator, no keys)."""

    out: Path
    #: exchange id -> (native prompt ids, native completion ids, provider), as the emulator served them
    native: dict[str, tuple[list[int], list[int], str]]
    rows: list[dict[str, Any]]

    def ok_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "ok"]

    def train_input_ids(self) -> list[list[int]]:
        """The SpecForge export's ``input_ids``, one list per exported sample."""
        path = self.out / "export" / "specforge" / "train.jsonl"
        return [json.loads(line)["input_ids"] for line in path.read_text(encoding="utf-8").splitlines()]


def run_example(tmp_path: Path, name: str) -> ExampleRun:
    """Run the shipped example config of family ``name`` with its paths pointed here
    (output in ``tmp_path/out``, the tokenizer from ../shared, bundled prompts from the
    source tree); fails the test if any stage failed."""
    from tokenbridge.pipeline import load_run_config, run_pipeline

    text = (ROOT / "examples" / f"{name}.toml").read_text(encoding="utf-8")
    assert f'tokenizer = "../../shared/tokenizers/{name}"' in text
    text = text.replace(f'out = "../runs/{name}"', 'out = "out"').replace(
        f'tokenizer = "../../shared/tokenizers/{name}"', f'tokenizer = "{SHARED / name}"').replace(
        'progress = "auto"', 'progress = "none"').replace('builtin:', str(ROOT / "src/tokenbridge/data") + "/")
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(text, encoding="utf-8")
    results = {r.name: r.status for r in run_pipeline(load_run_config(cfg), echo=lambda _: None)}
    assert "failed" not in results.values(), results
    out = tmp_path / "out"
    native = {}
    for line in (out / "exchanges.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        native[rec["id"]] = (rec["response"]["prompt_token_ids"], rec["response"]["choices"][0]["token_ids"],
                             rec["response"]["provider"])
    rows = [json.loads(line) for line in (out / "reconstructed.jsonl").read_text(encoding="utf-8").splitlines()]
    return ExampleRun(out, native, rows)


class OracleTokenizer:
    """The slice of the transformers tokenizer API the ``renderers`` classes call, backed
    by our tokenizer, so both sides encode with the same BPE (the comparison is then
    about the prompt text and where each side cuts it into encode calls)."""

    unk_token_id = -1

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def convert_tokens_to_ids(self, token: str) -> int:
        return self._tok.markers.get(token, self.unk_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids)


def register_sglang_namespace(missing: Any) -> None:
    """Register sglang as a bare namespace package, so its ``__init__`` (the whole
    runtime) never runs; ``missing(reason)`` (pytest.skip or pytest.fail) when absent."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            missing("sglang is not installed: `make` installs requirements-oracles.txt (--no-deps)")
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["sglang"] = pkg


def import_sglang_reasoning():
    register_sglang_namespace(pytest.skip)
    try:
        from sglang.srt.parser.reasoning_parser import ReasoningParser
    except ImportError as e:  # pragma: no cover - CI installs it
        pytest.skip(f"sglang's reasoning parser does not import ({e})")
    return ReasoningParser


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: vocab string character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class RawBytes:
    """The raw bytes of each id of a byte-level BPE tokenizer.json (a lone id may hold
    part of a UTF-8 character, which a decode call would turn into U+FFFD)."""

    def __init__(self, folder: str) -> None:
        data = json.loads((SHARED / folder / "tokenizer.json").read_text(encoding="utf-8"))
        dec = _byte_decoder()
        self.table = {i: bytes(dec[c] for c in t) if all(c in dec for c in t) else t.encode()
                      for t, i in data["model"]["vocab"].items()}
        for t in data["added_tokens"]:
            self.table[t["id"]] = t["content"].encode()

    def __call__(self, token_id: int) -> bytes:
        return self.table[token_id]


class SGLangEngine:
    """What SGLang 0.5.23's OpenAI server returns for native completion ids when the
    request sends no ``tools`` (raw tool-call text stays in content): the matched stop
    id trimmed, the rest detokenized with ``skip_special_tokens=True``, reasoning split
    by the real ``ReasoningParser(model_type)`` -- whole (``parse_non_stream``) or one
    text delta per token (``parse_stream_chunk`` / ``parse_stream_end``). Usage counts
    every completion id, the stop id included. ``skip_special=False`` is SGLang with
    ``skip_special_tokens: false`` (what it sets itself when the request sends tools)."""

    def __init__(self, tok: Any, folder: str, model_type: str, stop_ids: set[int], *, skip_special: bool = True) -> None:
        self.tok = tok
        self.skipped = special_ids(folder) if skip_special else set()
        self.model_type = model_type
        self.stop_ids = stop_ids
        self.parser_cls = import_sglang_reasoning()
        self.raw = RawBytes(folder)

    def serve(self, ids: list[int], prompt_tokens: int, *, thinking: bool, stream: bool) -> dict[str, Any]:
        body, finish = (ids[:-1], "stop") if ids and ids[-1] in self.stop_ids else (ids, "length")
        parser = self.parser_cls(self.model_type, stream_reasoning=stream, force_reasoning=thinking)
        if stream:
            reasoning, content = self._stream(parser, body)
        else:
            text = self.tok.decode_bytes([i for i in body if i not in self.skipped]).decode("utf-8", errors="replace")
            reasoning, content = parser.parse_non_stream(text)
        message = {"role": "assistant", "content": content or "", "reasoning_content": reasoning or None}
        n = len(ids)
        return {"id": "sgl", "object": "chat.completion", "model": self.model_type,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}}

    def _stream(self, parser: Any, body: list[int]) -> tuple[str | None, str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        reasoning: list[str] = []
        content: list[str] = []

        def take(r: str | None, normal: str | None) -> None:
            if r:
                reasoning.append(r)
            if normal:
                content.append(normal)

        for i in body:
            delta = decoder.decode(b"" if i in self.skipped else self.raw(i))
            if delta:
                take(*parser.parse_stream_chunk(delta))
        tail = decoder.decode(b"", final=True)
        if tail:
            take(*parser.parse_stream_chunk(tail))
        take(*parser.parse_stream_end())
        return ("".join(reasoning) or None), "".join(content)


# --- strategies ------------------------------------------------------------------------

# A fixed alphabet that reaches every BPE pre-token class; its letters cannot spell
# "think" or "tool", so no generated text forms a marker.
_ALPHABET = st.sampled_from(list("abcdeXYZ<> 0123456789.,;:!?'\"-_()[]{}/\\#*+=&%$@~`|^ éüßñ中文字的你好😀🚀…–“”\u3000"))
words = st.text(_ALPHABET, max_size=24)
cjk = st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF), min_size=1, max_size=12)
texts = st.one_of(
    words, cjk, st.just(""),
    st.lists(st.one_of(words, cjk, st.sampled_from(["\n", "\n\n", " ", "  \n", "\t", "\r\n"])), max_size=5).map("".join),
)
nonempty = texts.filter(bool)
arg_values = st.one_of(words, st.integers(-99, 99), st.booleans(), st.lists(st.integers(0, 9), max_size=3))
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search 网页",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"},
                                                                                      "n": {"type": "integer"}}}}},
]
tool_lists = st.one_of(st.none(), st.just(TOOLS[:1]), st.just(TOOLS))


@st.composite
def tool_round(draw, idx: int, *, content: Any = None, reasoning: Any = None, string_args: bool = False) -> list[dict]:
    """An assistant turn with one or two tool calls, then one result per call."""
    calls = []
    for k in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(["get_weather", "search"]))
        args = draw(st.dictionaries(st.sampled_from(["city", "q", "n"]), arg_values, max_size=2))
        calls.append({"id": f"call_{idx}_{k}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if string_args else args}})
    assistant: dict[str, Any] = {"role": "assistant", "content": draw(content if content is not None else texts),
                                 "tool_calls": calls}
    if reasoning is not None:
        r = draw(reasoning)
        if r is not None:
            assistant["reasoning_content"] = r
    out = [assistant]
    for call in calls:
        out.append({"role": "tool", "tool_call_id": call["id"], "content": draw(texts)})
    return out

"""Tokenizer loading: the real Kimi K2.5 data, a tokenizer.json folder, and the errors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbridge.tokenizer import (
    KIMI_PAT_STR,
    TokenizerError,
    _marker_finder,
    _PieceCache,
    _split_runs_slow,
    load_tokenizer,
    marker_pattern,
    read_pat_str,
    split_long_runs,
)

TOOL_MARKERS = {
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
}


def _linked_folder(tmp_path: Path, kimi_dir: Path, *names: str) -> Path:
    folder = tmp_path / "kimi"
    folder.mkdir()
    for name in names:
        (folder / name).symlink_to(kimi_dir / name)
    return folder


def test_kimi_vocab_and_marker_names(kimi):
    assert kimi.kind == "tiktoken"
    assert kimi.vocab_size == 163840
    assert len(kimi.marker_ids) == 256
    assert kimi.marker_ids[163586] == "<|im_end|>"
    assert kimi.marker_ids[163607] == "</think>"
    assert kimi.marker_ids[163606] == "<think>"
    # ids without an added_tokens_decoder entry get reserved names
    assert kimi.marker_ids[163589] == "<|reserved_token_163589|>"
    assert kimi.marker_ids[163837] == "<|reserved_token_163837|>"
    assert kimi.max_ordinary_id == 163583


def test_marker_text_encodes_to_marker_ids(kimi):
    for text, tid in TOOL_MARKERS.items():
        assert kimi.encode(text) == [tid]
    ids = kimi.encode("a</think>b<|im_end|>")
    assert ids[1] == 163607 and ids[-1] == 163586
    assert kimi.decode(ids) == "a</think>b<|im_end|>"
    assert kimi.encode("<|reserved_token_163600|>") == [163600]


def test_known_ordinary_ids(kimi):
    assert kimi.encode("Hello") == [19180]
    assert kimi.encode(" 世界") == [220, 2243]
    assert kimi.token_bytes(19180) == b"Hello"


def test_builtin_pattern_is_the_shared_one(kimi_dir):
    assert (kimi_dir / "pat_str.txt").read_text(encoding="utf-8") == KIMI_PAT_STR


def test_pat_str_read_statically_from_tokenization_file(tmp_path, kimi_dir):
    folder = _linked_folder(tmp_path, kimi_dir, "tiktoken.model", "tokenizer_config.json")
    # Executing this file would fail loudly; reading it statically must not.
    (folder / "tokenization_kimi.py").write_text(
        "raise SystemExit('executed!')\n"
        "class T:\n"
        "    pat_str = '|'.join([r'''\\p{N}{1,3}''', r'''\\s+''', r'''[^\\s\\p{N}]+'''])\n",
        encoding="utf-8",
    )
    assert read_pat_str(folder) == r"\p{N}{1,3}|\s+|[^\s\p{N}]+"
    tok = load_tokenizer(folder)
    # With this cruder pattern digits split in threes exactly as the pattern says.
    assert [tok.token_bytes(i) for i in tok.encode("1234567")] == [b"123", b"456", b"7"]


def test_pat_str_not_a_literal_is_a_clear_error(tmp_path, kimi_dir):
    folder = _linked_folder(tmp_path, kimi_dir, "tiktoken.model", "tokenizer_config.json")
    (folder / "tokenization_kimi.py").write_text("import os\n\npat_str = os.environ['X']\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenization_kimi.py:3: pat_str is not a string literal"):
        read_pat_str(folder)


def test_long_runs_are_cut_like_the_model_tokenizer(kimi):
    run = "x" * 60_000
    pieces = split_long_runs(run)
    assert [len(p) for p in pieces] == [25_000, 25_000, 10_000]
    expected = [i for p in pieces for i in kimi.encode(p)]
    assert kimi.encode(run) == expected
    # whitespace runs too, and a short text is one piece
    assert [len(p) for p in split_long_runs("a" + " " * 30_000 + "b")] == [25_001, 5_001]
    assert split_long_runs("short text") == ["short text"]


def test_window_of_400k_characters(kimi):
    text = ("word " * 100_000)[:450_000]
    pieces = split_long_runs(text)
    assert [len(p) for p in pieces] == [400_000, 50_000]
    assert kimi.encode(text) == kimi.encode(pieces[0]) + kimi.encode(pieces[1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([" ", "\n", "\u3000", "\x1c", "a", "字", "\u00a0"]), st.integers(1, 30_000)), max_size=5))
def test_fast_split_equals_reference(runs):
    text = "".join(ch * n for ch, n in runs)
    fast = split_long_runs(text) if text else []
    slow = [p for w in range(0, len(text), 400_000) for p in _split_runs_slow(text[w : w + 400_000])]
    assert "".join(fast) == text
    assert fast == slow


def _tiny_tokenizer_json(folder: Path, specials: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the answer is 42.", "think step by step"] * 50, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))


def test_tokenizer_json_folder(tmp_path):
    folder = tmp_path / "tiny"
    _tiny_tokenizer_json(folder, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    tok = load_tokenizer(folder)
    assert tok.kind == "tokenizers"
    end = tok.token_id("<|im_end|>")
    ids = tok.encode("hello world<|im_end|>")
    assert ids[-1] == end
    assert tok.decode(ids) == "hello world<|im_end|>"
    assert set(tok.marker_ids.values()) == {"<|im_start|>", "<|im_end|>", "<think>", "</think>"}


def test_missing_folder_and_bad_files(tmp_path):
    with pytest.raises(TokenizerError, match="not a tokenizer folder or a Hub repo id"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="neither tiktoken.model nor tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tiktoken.model").write_text("aGVsbG8= 0\nnot-a-line\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model:2: expected 'base64token rank'"):
        load_tokenizer(bad)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.json"])
@pytest.mark.parametrize("body,why", [
    # the stdlib recurses per level: a RecursionError, and the command's exit 8
    ("[" * 100_000, "cannot read JSON (nested too deeply to read)"),
    ('{"a":\n x}', "cannot read JSON (not valid JSON (Expecting value at line 2 column 2))"),
    ('["chat_template"]', "must hold a JSON object, not an array"),
])
def test_a_tokenizer_folders_unreadable_json_names_the_file(tmp_path, kimi_dir, name, body, why):
    folder = _linked_folder(tmp_path, kimi_dir, "tiktoken.model",
                            *(["tokenizer_config.json"] if name != "tokenizer_config.json" else []))
    (folder / name).write_text(body)
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(folder)
    assert str(err.value) == f"{folder / name}: {why}"


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                                  "tiktoken.model"])
@pytest.mark.parametrize("kind", ["dangling", pytest.param("fifo", marks=pytest.mark.skipif(
    not hasattr(os, "mkfifo"), reason="no FIFOs here")), "folder"])
def test_a_folder_file_that_is_no_regular_file_is_the_folders_error_not_an_absent_file(tmp_path, kimi_dir, name,
                                                                                         kind):
    """A link to nothing (a half-cleaned Hub cache) was taken for an absent file: a Kimi
    folder could not tell its chat format, a GLM one had "no chat template", another's was
    replaced by the built-in one; a FIFO hung the command (a cold tester's)."""
    present = [n for n in ("tiktoken.model", "tokenizer_config.json") if n != name]
    folder = _linked_folder(tmp_path, kimi_dir, *present)
    where = folder / name
    if kind == "dangling":
        where.symlink_to(tmp_path / "gone")
        why = "a symlink to a missing file (a damaged download?)"
    elif kind == "fifo":
        os.mkfifo(where)
        why = "is a named pipe (FIFO), not a regular file"
    else:
        where.mkdir()
        why = "is a folder, not a regular file"
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(folder)
    assert str(err.value) == f"{where}: {why}"


def test_a_models_config_too_deep_to_read_is_as_if_it_were_not_there(tmp_path, kimi_dir):
    """The tokenizer needs none of config.json: one it cannot read is skipped, deep or not."""
    folder = _linked_folder(tmp_path, kimi_dir, "tiktoken.model", "tokenizer_config.json")
    deep = tmp_path / "deep"
    shutil.copytree(folder, deep, symlinks=True)
    (deep / "config.json").write_text("[" * 100_000)
    assert load_tokenizer(deep).model_vocab_size == load_tokenizer(folder).model_vocab_size


def test_hub_id_offline_and_not_cached_is_clear(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = (
        "from tokenbridge.tokenizer import load_tokenizer, TokenizerError\n"
        "try:\n    load_tokenizer('moonshotai/Kimi-K2.5')\n"
        "except TokenizerError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("ERR moonshotai/Kimi-K2.5: could not download the tokenizer from the Hub and it is not cached")


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=300),
       st.sampled_from(["", "<|im_end|>", "</think>", "<|tool_call_begin|>", "x" * 25_010]))
def test_kimi_is_lossless_for_valid_text(text, extra):
    """Justifies `lossless`: the gate's round-trip check relies on it for tiktoken folders."""
    from tokenbridge.tokenizer import load_tokenizer

    from conftest import KIMI_DIR

    kimi = load_tokenizer(KIMI_DIR)
    assert kimi.lossless
    s = text + extra + text
    assert kimi.decode_bytes(kimi.encode(s)) == s.encode("utf-8")


# --- fast paths: the ordinary encode for marker-free text, the prompt-piece cache ------

#: Text near the markers: whole markers, their fragments, and characters that start one.
_NEAR_MARKERS = [
    "<|im_end|>", "<|im_end|", "<|im_end", "|>", "<|", "<", "[", "]", "[BOS]", "[BOS", "[EOS]", "[E",
    "</think>", "</think", "<think>", "<think", "think>", "</", "<t", "<|im_user|>", "<|im_middle|>",
    "<|reserved_token_163600|>", "<|reserved_token_16360", "<|tool_call_begin|>", "<|tool_calls_section_end|",
    "a", " ", "  ", "\n", "\r\n", "\t", "字", "é", "\u2028", "0123", "def f(x):\n    return x[0] < 1\n",
]
_near_marker_text = st.lists(
    st.one_of(st.sampled_from(_NEAR_MARKERS), st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)),
    max_size=40,
).map("".join)


@lru_cache(maxsize=1)
def _raw_tiktoken():
    """tiktoken built directly from the same files: the serving reference for text up to
    25,000 characters (markers split out by tiktoken itself, every marker allowed)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from conftest import KIMI_DIR

    kimi = load_tokenizer(KIMI_DIR)
    return kimi, tiktoken.Encoding(
        "reference", pat_str=KIMI_PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(KIMI_DIR / "tiktoken.model")),
        special_tokens={t: i for i, t in kimi.marker_ids.items()},
    )


def _reference_long(raw, kimi, text: str) -> list[int]:
    """transformers' tokenize for any length: markers split out, then 400k windows and the
    run cut (the slow reference splitter), each piece through the ordinary encode."""
    marker = re.compile("|".join(re.escape(t) for t in sorted(kimi.markers, key=len, reverse=True)))
    out: list[int] = []
    pos = 0
    for m in [*marker.finditer(text), None]:
        end = m.start() if m else len(text)
        for w in range(pos, end, 400_000):
            for piece in _split_runs_slow(text[w : min(w + 400_000, end)]):
                out.extend(raw.encode_ordinary(piece))
        if m:
            out.append(kimi.markers[m.group()])
            pos = m.end()
    return out


@settings(max_examples=400, deadline=None)
@given(_near_marker_text)
def test_fast_paths_equal_tiktoken_on_arbitrary_text(text):
    kimi, raw = _raw_tiktoken()
    expected = raw.encode(text, allowed_special="all")
    assert kimi.encode(text) == expected
    assert kimi.encode_prompt(text) == expected
    assert kimi.encode_prompt(text) == expected  # again: now from the cache


@settings(max_examples=25, deadline=None)
@given(st.lists(st.one_of(_near_marker_text, st.sampled_from(["x" * 25_003, " " * 25_010, "字" * 26_000])), min_size=1, max_size=4).map("".join))
def test_fast_paths_equal_reference_on_long_text(text):
    kimi, raw = _raw_tiktoken()
    expected = _reference_long(raw, kimi, text)
    assert kimi.encode(text) == expected
    assert kimi.encode_prompt(text) == expected


@settings(max_examples=300, deadline=None)
@given(_near_marker_text)
def test_marker_precheck_is_exact(text):
    kimi, _ = _raw_tiktoken()
    marker = re.compile("|".join(re.escape(t) for t in sorted(kimi.markers, key=len, reverse=True)))
    find = _marker_finder(kimi.markers)
    ours, theirs = find(text), marker.search(text)
    assert (ours is None) == (theirs is None)
    if ours is not None and theirs is not None:  # the same first marker, longest there
        assert ours.span() == theirs.span()


_NESTED = ("<a", "<ab", "<abc", "[E", "[EOS]", "b", "<|x|>")


@settings(max_examples=300, deadline=None)
@given(st.text("<ab[EOS]|xc ", max_size=24))
def test_marker_finder_gives_the_whole_patterns_first_match_across_groups(text):
    """Groups by first character ("<", "[", "b"): the leftmost of their first matches is
    the whole pattern's first match, the longest marker there (a "b" inside "<ab" is not one)."""
    theirs = marker_pattern(_NESTED).search(text)
    ours = _marker_finder(_NESTED)(text)
    assert (ours is None) == (theirs is None)
    if ours is not None and theirs is not None:
        assert ours.span() == theirs.span()


def test_marker_text_in_a_long_completion_still_becomes_marker_ids(kimi):
    text = "reasoning " * 3000 + "</think>" + "content" + "<|im_end|>"
    ids = kimi.encode(text)
    assert ids.count(163607) == 1 and ids[-1] == 163586
    assert kimi.encode("reasoning " * 3000) == ids[: ids.index(163607)]


def test_piece_cache_is_bounded_and_least_recently_used():
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return [ord(c) for c in text]

    cache = _PieceCache(max_bytes=200_000)
    pieces = [f"piece {i:04d} " + "y" * 200 for i in range(200)]
    for p in pieces:
        assert list(cache.ids(p, encode)) == [ord(c) for c in p]
    stats = cache.stats()
    assert stats["misses"] == 200 and stats["hits"] == 0
    assert 0 < stats["bytes"] <= 200_000 and 0 < stats["entries"] < 200
    # the newest stay, the oldest went; a hit does not call the encoder
    calls.clear()
    assert list(cache.ids(pieces[-1], encode)) == [ord(c) for c in pieces[-1]] and calls == []
    cache.ids(pieces[0], encode)
    assert calls == [pieces[0]]
    # a piece over an eighth of the bound is encoded but never kept
    big = "z" * 5_000
    assert list(cache.ids(big, encode)) == [ord("z")] * 5_000
    assert list(cache.ids(big, encode)) == [ord("z")] * 5_000
    assert calls.count(big) == 2


def test_encode_prompt_reuses_shared_prompt_pieces(kimi):
    system = "You are a careful assistant. " * 40
    before = kimi.prompt_cache_stats
    for q in ("first question", "second question"):
        prompt = f"<|im_system|>system<|im_middle|>{system}<|im_end|><|im_user|>user<|im_middle|>{q}<|im_end|>"
        assert kimi.encode_prompt(prompt) == kimi.encode(prompt)
    after = kimi.prompt_cache_stats
    # the second prompt found "system", the system text and "user" in the cache
    assert after["hits"] - before["hits"] >= 3


_NEAR_MARKER_TEXT = st.lists(st.one_of(
    st.sampled_from(["<|im_end|>", "</think>", "<think>", "[EOS]", "<|tool_call_begin|>", "<|im_", "</th", "[E", "<", "[",
                     "|>", "think>", "<|", "a < b", "x[0]", "字", "\n"]),
    st.text(max_size=6)), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(_NEAR_MARKER_TEXT)
def test_marker_free_text_encodes_to_no_marker_id(kimi, text):
    """The gate skips its marker-id scan for text ``marker_free`` clears: that is only
    right if such text never encodes to a marker id (and text holding one is never cleared)."""
    ids = kimi.encode(text)
    holds_marker = any(i in kimi.marker_ids for i in ids)
    if kimi.marker_free(text):
        assert not holds_marker
    if holds_marker:
        assert not kimi.marker_free(text)
    assert kimi.marker_free(text) == (re.search("|".join(map(re.escape, kimi.markers)), text) is None)
    assert kimi.encode_checked(text) == (ids, kimi.marker_free(text))  # one test, the same answers


def test_tokenizer_json_folders_leave_marker_ids_to_the_scan(tmp_path):
    folder = tmp_path / "tiny"
    _tiny_tokenizer_json(folder, ["<|im_start|>", "<|im_end|>"])
    tok = load_tokenizer(folder)
    assert not tok.marker_free("plain words") and not tok.marker_free("<|im_end|>")
    assert tok.encode_checked("plain words") == (tok.encode("plain words"), False)


def test_tokenizer_json_encode_prompt_is_encode(tmp_path):
    folder = tmp_path / "tiny"
    _tiny_tokenizer_json(folder, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    tok = load_tokenizer(folder)
    text = "<|im_start|>hello world<|im_end|><think>think step</think>"
    assert tok.encode_prompt(text) == tok.encode(text)
    assert tok.prompt_cache_stats["misses"] == 0  # no splitting, no cache for these folders


@pytest.mark.parametrize("name", ["qwen3", "glm-4.5", "deepseek-v3.1"])
def test_byte_level_tokens_keep_their_exact_bytes(name):
    """A token that holds part of a UTF-8 character has those bytes, not U+FFFD: logprobs
    and cut completions are matched on bytes."""
    from tokenbridge.tokenizer import load_tokenizer

    folder = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / name
    tok = load_tokenizer(folder)
    text = "天气很好。Ünïcödé 😀 🦜🦜 <think>x</think>"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.decode_bytes(ids) == text.encode()
    parrot = tok.encode("🦜")
    if len(parrot) > 1:  # a cut inside the character keeps the partial bytes
        assert tok.decode_bytes(parrot[:1]) == "🦜".encode()[: len(tok.token_bytes(parrot[0]))]
        assert b"\xef\xbf\xbd" not in tok.decode_bytes(parrot[:1])


_FAKE_HF_TOKEN = "hf_" + "Zq7" * 12


def _hub_failing_with(monkeypatch, exc: BaseException) -> None:
    import huggingface_hub

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    monkeypatch.setenv("HF_TOKEN", _FAKE_HF_TOKEN)


def test_hub_error_keeps_its_message_without_the_token(monkeypatch):
    """The reason the Hub gave is kept (not just its type name), the access token masked in every form."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    url = f"https://huggingface.co/api/models/o/n?token={_FAKE_HF_TOKEN}"
    response = httpx.Response(401, request=httpx.Request("GET", url))
    _hub_failing_with(monkeypatch, HfHubHTTPError(f"401 Client Error: Unauthorized for url: {url}\nBearer {_FAKE_HF_TOKEN}",
                                                  response=response))
    with pytest.raises(TokenizerError) as info:
        load_tokenizer("o/n")
    msg = str(info.value)
    assert msg == ("o/n: could not download the tokenizer from the Hub and it is not cached (HfHubHTTPError: "
                   "401 Client Error: Unauthorized for url: https://huggingface.co/api/models/o/n?token=*** Bearer ***). "
                   "Pass a local folder, or run once with network access.")
    assert "Zq7" not in msg


def test_hub_error_masks_any_token_shaped_text(monkeypatch):
    """A token other than the configured one (or none configured) is still masked."""
    other = "hf_" + "Ab9" * 10
    _hub_failing_with(monkeypatch, OSError(f"cannot reach the Hub with {other}"))
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(TokenizerError, match=r"\(OSError: cannot reach the Hub with \*\*\*\)") as info:
        load_tokenizer("o/n")
    assert "Ab9" not in str(info.value)


def test_a_bug_inside_the_hub_loader_is_not_called_a_download_failure(monkeypatch):
    _hub_failing_with(monkeypatch, KeyError("a bug"))
    with pytest.raises(KeyError):
        load_tokenizer("o/n")

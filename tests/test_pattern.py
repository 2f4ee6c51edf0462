"""The pre-tokenizer patterns regrouped for tiktoken's regex engine: that only the proven
ones are regrouped (a cold attack found patterns the regex crate would run differently once
grouped), and that the real Kimi and gpt-oss ranks give the same ids
under each grouped form as under the pattern itself, held against tiktoken on the model files."""

from __future__ import annotations

import json
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import KIMI_DIR, ROOT
from tokenbridge.pattern import CUT_PROVEN, KIMI_PAT_STR, O200K_PAT_STR, PROVEN, grouped_pattern, last_stable_cut

GPTOSS_DIR = ROOT.parent / "shared" / "tokenizers" / "gpt-oss"
_TAIL = r"|\s+(?!\S)|\s+"


def _gptoss_pattern() -> str:
    data = json.loads((GPTOSS_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    return data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]


def test_kimi_pattern_groups_its_six_plain_alternatives():
    assert KIMI_PAT_STR.endswith(_TAIL)
    assert grouped_pattern(KIMI_PAT_STR) == "(?:" + KIMI_PAT_STR.removesuffix(_TAIL) + ")" + _TAIL


def test_gptoss_pattern_groups_its_five_plain_alternatives():
    pattern = _gptoss_pattern()
    assert pattern.endswith(_TAIL)
    assert grouped_pattern(pattern) == "(?:" + pattern.removesuffix(_TAIL) + ")" + _TAIL


def test_the_gptoss_folders_pattern_is_o200ks():
    assert _gptoss_pattern() == O200K_PAT_STR
    assert {KIMI_PAT_STR, O200K_PAT_STR} == PROVEN


@pytest.mark.parametrize("pattern", [
    # the regex crate lifts a shared first element out of a grouped run (P X|P Y -> P(?:X|Y)),
    # which changes the winner when P is quantified: ".*q|.*b" matches "xq", grouped "xqb"
    r".*q|.*b|(?=x)",
    r"[^\s]*[.!?]|[^\s]*[\p{L}]+|\s+(?!\S)|\s+",
    r"[\p{L}]*[\p{Lu}]|[\p{L}]*[\p{Ll}]+|\s+(?!\S)|\s+",
    # syntax the splitter does not know: comments, free-form group names, flags split by a comment
    "q|(?#[)((]x|y)|z(?=w)(?#())k",
    "q|(?x:#)\na|z(?=w)(?#())k",
    "q|(?<a)>a|z(?=w)(?<b(>k))k",
    "(?i(?#c))q|a|z(?=w)",
    # near misses of the proven patterns: one character off is another pattern
    KIMI_PAT_STR.replace("{1,3}", "{1,4}"),
    O200K_PAT_STR + "|x",
    r"a|b|c(?=x)",
    # unbalanced: no pattern at all
    "a|(b", "a)|b", "[a|b", "a|b\\", "((a)|b",
])
def test_only_proven_patterns_are_regrouped(pattern):
    assert pattern not in PROVEN
    assert grouped_pattern(pattern) == pattern


@cache
def _encodings(family: str):
    """(the model's own pattern, grouped) as two tiktoken encodings over the real ranks."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    if family == "kimi":
        ranks, pattern = load_tiktoken_bpe(str(KIMI_DIR / "tiktoken.model")), KIMI_PAT_STR
    else:
        ranks, pattern = load_tiktoken_bpe(str(GPTOSS_DIR / "o200k_base.tiktoken")), O200K_PAT_STR
    grouped = grouped_pattern(pattern)
    assert grouped != pattern
    return (tiktoken.Encoding(f"{family}-own", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}),
            tiktoken.Encoding(f"{family}-grouped", pat_str=grouped, mergeable_ranks=ranks, special_tokens={}))


# Every class the alternatives tell apart: whitespace runs with and without line ends
# (what the look-around decides), each letter category, marks, Han, digits, the
# contractions, punctuation with and without a space before it, and the end of text.
_ATOMS = [" ", "  ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\x0b", "\x85", "a", "Z", "é", "e\u0301", "ǅ", "ʰ",
          "ª", "字", "中文", "1", "12345", "٣", "'s", "'T", "'ll", "'", "!", "/", "...", "()", "_", "😀", "x" * 5]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(_ATOMS), max_size=40).map("".join), st.sampled_from(["kimi", "gptoss"]))
def test_grouped_pattern_gives_the_same_ids(text, family):
    own, grouped = _encodings(family)
    assert grouped.encode_ordinary(text) == own.encode_ordinary(text)


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=200), st.sampled_from(["kimi", "gptoss"]))
def test_grouped_pattern_gives_the_same_ids_on_any_text(text, family):
    own, grouped = _encodings(family)
    assert grouped.encode_ordinary(text) == own.encode_ordinary(text)


def _holds_at_cut(text: str, suffix: str, family: str) -> None:
    """encode(text + suffix) is encode(text[:cut]) + encode(text[cut:] + suffix), under the
    model's own pattern and its grouped form (both in CUT_PROVEN)."""
    cut = last_stable_cut(text)
    assert 0 <= cut < len(text) or cut == 0
    if cut:
        assert text[cut] == " " and not text[cut - 1].isspace()
    for enc in _encodings(family):
        assert enc._pat_str in CUT_PROVEN
        whole = enc.encode_ordinary(text + suffix)
        assert whole == enc.encode_ordinary(text[:cut]) + enc.encode_ordinary(text[cut:] + suffix)


@settings(max_examples=800, deadline=None)
@given(st.lists(st.sampled_from(_ATOMS), max_size=40).map("".join),
       st.lists(st.sampled_from([*_ATOMS, "<|", "<|tool", "<", "|"]), max_size=6).map("".join),
       st.sampled_from(["kimi", "gptoss"]))
def test_text_splits_at_its_last_stable_cut_whatever_follows(text, suffix, family):
    _holds_at_cut(text, suffix, family)


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=120),
       st.text(st.characters(blacklist_categories=("Cs",)), max_size=12), st.sampled_from(["kimi", "gptoss"]))
def test_any_text_splits_at_its_last_stable_cut(text, suffix, family):
    _holds_at_cut(text, suffix, family)


@pytest.mark.parametrize(("text", "cut"), [
    ("It starts like this: ", 20), ("a b", 1), ("a  b", 1), ("  ab", 0), ("ab", 0), ("", 0), ("x\n y", 0),
    ("x\t y z", 4), ("字 字", 1), (". ", 1),
])
def test_last_stable_cut_is_a_space_after_non_whitespace(text, cut):
    assert last_stable_cut(text) == cut


@pytest.mark.parametrize("family", ["kimi", "gptoss"])
def test_grouped_pattern_gives_the_same_ids_on_code_and_prose(family):
    """Whole files: the standard library's indentation, blank lines and trailing spaces."""
    import inspect
    import textwrap

    import json as module_a
    import pathlib as module_b

    own, grouped = _encodings(family)
    for text in (inspect.getsource(module_a), inspect.getsource(module_b), textwrap.__doc__ or "",
                 "  trailing  \n\n\t\tindent\n   \n" * 50 + "   "):
        assert grouped.encode_ordinary(text) == own.encode_ordinary(text)


def test_tiktoken_folders_are_built_with_the_grouped_pattern(monkeypatch, kimi_dir):
    import tiktoken

    from tokenbridge import tokenizer

    built: list[str] = []
    real = tiktoken.Encoding.__init__

    def record(self, name, *, pat_str, **kwargs):
        built.append(pat_str)
        real(self, name, pat_str=pat_str, **kwargs)

    monkeypatch.setattr(tiktoken.Encoding, "__init__", record)
    kimi = tokenizer._load_tiktoken(kimi_dir, str(kimi_dir))
    gptoss = tokenizer._load_tiktoken_beside_json(GPTOSS_DIR, str(GPTOSS_DIR))
    assert gptoss is not None
    assert built == [grouped_pattern(KIMI_PAT_STR), grouped_pattern(_gptoss_pattern())]
    assert kimi.encode("def f():\n        return  1  \n") == _encodings("kimi")[0].encode_ordinary("def f():\n        return  1  \n")


def test_a_regrouped_pattern_that_does_not_compile_falls_back_to_the_models_own(monkeypatch, kimi_dir):
    """The rewrite is an optimisation: it can never be why a folder fails to load."""
    from tokenbridge import tokenizer

    monkeypatch.setattr(tokenizer, "grouped_pattern", lambda pattern: "(" + pattern)
    kimi = tokenizer._load_tiktoken(kimi_dir, str(kimi_dir))
    text = "def f():\n        return  1  \n"
    assert kimi.encode(text) == _encodings("kimi")[0].encode_ordinary(text)


def test_a_pattern_tiktoken_rejects_is_still_a_clear_error(tmp_path, kimi_dir):
    from tokenbridge.tokenizer import TokenizerError, _load_tiktoken

    folder = tmp_path / "kimi"
    folder.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (folder / name).symlink_to(kimi_dir / name)
    (folder / "tokenization_kimi.py").write_text('pat_str = "(unclosed|a|b"\n', encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tiktoken\.model: tiktoken rejected the data"):
        _load_tiktoken(folder, str(folder))


@cache
def _hf(family: str):
    from test_families_support import family_tokenizer

    return family_tokenizer(family)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([*_ATOMS, "\u0301", "e\u0301 ", "'S", "1 2"]), max_size=40).map("".join),
       st.lists(st.sampled_from([*_ATOMS, "<", "</", "</tool", "\u0301"]), max_size=6).map("".join),
       st.sampled_from(["qwen3", "glm-4.5"]))
def test_qwen2_and_glm4_folders_split_at_the_last_stable_cut_too(text, suffix, family):
    """The tokenizers folders whose Split pattern is Qwen2's or GLM-4's (NFC before it, for
    Qwen3: a space composes with nothing) hold the same property, through their own encode."""
    tok = _hf(family)
    assert tok._stable_cut is last_stable_cut
    cut = last_stable_cut(text)
    assert tok.encode(text + suffix) == tok.encode(text[:cut]) + tok.encode(text[cut:] + suffix)

"""Run-level provider traits: count calibration, whitespace stripping, vLLM's joined text,
and probe profiles, through ``reconstruct_file`` on the real Kimi K2.5 tokenizer."""

from __future__ import annotations

import json
import os

import pytest

from tokenbridge.chat import DIALECTS
from tokenbridge.export import export_file
from tokenbridge.reconstruct import reconstruct_file
from tokenbridge.traits import ProfileError, load_provider_profile

PROMPT = [{"role": "user", "content": "Say something."}]
REQUEST = {"model": "moonshotai/kimi-k2.5", "messages": PROMPT}


def _record(kimi, i: int, provider: str, reasoning: str, content: str | None, *, finish: str = "stop",
            completion_delta: int = 0, prompt_delta: int = 0, cached: int | None = None) -> dict:
    close, end = kimi.token_id("</think>"), kimi.token_id("<|im_end|>")
    truth = kimi.encode(reasoning)
    if finish != "length" or content:
        truth += [close] + kimi.encode(content or "")
    if finish != "length":
        truth += [end]
    prompt = len(kimi.encode(DIALECTS["kimi-k2.5"].render_request(REQUEST)))
    usage = {"prompt_tokens": prompt + prompt_delta, "completion_tokens": len(truth) + completion_delta}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    msg = {"role": "assistant", "reasoning": reasoning, "content": content}
    return {"id": f"{provider}-{i}", "request": REQUEST,
            "response": {"provider": provider, "usage": usage,
                         "choices": [{"index": 0, "message": msg, "finish_reason": finish}]},
            "native_ids": truth}


def _write(path, records, drop_native=True):
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            rec = dict(rec)
            if drop_native:
                rec.pop("native_ids")
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")


def _rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _texts(i: int) -> tuple[str, str]:
    return f"Thinking about item {i}.\n", f"Answer number {i}.\n"


def test_a_provider_that_never_counts_the_end_token_is_calibrated(tmp_path, kimi):
    recs = [_record(kimi, i, "Lazy", *_texts(i), completion_delta=-1) for i in range(24)]
    recs += [_record(kimi, 100 + i, "Lazy", f"Cut reasoning {i}", None, finish="length") for i in range(4)]
    recs.append(_record(kimi, 999, "Lazy", *_texts(999), completion_delta=-4))  # really wrong
    recs += [_record(kimi, i, "Good", *_texts(i)) for i in range(5)]
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    _write(src, recs)
    summary = reconstruct_file(src, dst, kimi)
    rows = {r["id"]: r for r in _rows(dst)}
    lazy = summary.traits["Lazy"]
    assert lazy.end_uncounted and not lazy.cached_excluded
    assert "Good" not in summary.traits
    assert sum(r["status"] == "ok" for r in rows.values()) == 24 + 5  # the ended ones and Good
    assert all(rows[f"Lazy-{100 + i}"]["status"] == "flagged" for i in range(4))  # truncated, exact
    wrong = rows["Lazy-999"]
    assert wrong["status"] == "rejected" and [f["code"] for f in wrong["findings"]] == ["usage_completion_mismatch"]
    assert "leaves out the end token" in wrong["findings"][0]["message"]
    assert summary.to_dict()["provider_traits"]["Lazy"]["end_uncounted"] is True


@pytest.mark.parametrize("delta", [+1, +2, -1])
def test_an_offset_without_a_known_cause_is_never_calibrated(tmp_path, kimi, delta):
    """Usage one more than ours on every sample is what a model that always splits one
    word another way looks like: calibrating it away would pass every wrong sample. And
    an offset that holds on cut samples too is not the end token."""
    recs = [_record(kimi, i, "Off", *_texts(i), completion_delta=delta) for i in range(22)]
    recs += [_record(kimi, 50 + i, "Off", f"Cut {i}", None, finish="length", completion_delta=delta) for i in range(3)]
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    _write(src, recs)
    summary = reconstruct_file(src, dst, kimi)
    assert summary.traits == {}
    # +1 on a reasoning-only cut is also what a cut right after </think> counts, and what a
    # cut inside a character vLLM held back counts: the count alone reads neither
    assert summary.status == {"rejected": 25}
    cuts = [json.loads(line) for line in dst.read_text(encoding="utf-8").splitlines()[22:]]
    assert [r["reconstruction"] for r in cuts] == [None] * 3


def test_prompt_offsets_are_never_calibrated(tmp_path, kimi):
    recs = [_record(kimi, i, "Bos", *_texts(i), prompt_delta=-1) for i in range(25)]
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    _write(src, recs)
    summary = reconstruct_file(src, dst, kimi)
    assert summary.traits == {} and summary.status["rejected"] == 25


def test_too_few_samples_or_mixed_offsets_are_not_calibrated(tmp_path, kimi):
    recs = [_record(kimi, i, "Few", *_texts(i), completion_delta=-1) for i in range(10)]
    recs += [_record(kimi, i, "Mixed", *_texts(i), completion_delta=-1 if i % 3 else 1) for i in range(30)]
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    _write(src, recs)
    summary = reconstruct_file(src, dst, kimi)
    assert summary.traits == {}
    assert summary.status["rejected"] == 40


def test_prompt_tokens_without_cached_tokens_is_calibrated(tmp_path, kimi):
    recs = [_record(kimi, i, "Cache", *_texts(i), prompt_delta=-5, cached=5) for i in range(12)]
    recs += [_record(kimi, 50 + i, "Cache", *_texts(i), cached=0) for i in range(10)]
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    _write(src, recs)
    summary = reconstruct_file(src, dst, kimi)
    assert summary.traits["Cache"].cached_excluded
    assert summary.status["ok"] == 22


def test_a_stripping_provider_gets_a_finding_unless_ids_prove_it(tmp_path, kimi):
    recs = [_record(kimi, i, "Keeps", *_texts(i)) for i in range(25)]
    strip = [_record(kimi, i, "Strips", *(t.strip() for t in _texts(i))) for i in range(25)]
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    _write(src, recs + strip[:20], drop_native=True)
    with open(src, "a", encoding="utf-8") as fh:  # five of them carry ground-truth ids
        for rec in strip[20:]:
            fh.write(json.dumps(rec) + "\n")
    summary = reconstruct_file(src, dst, kimi)
    rows = _rows(dst)
    flagged = [r for r in rows if r["provider"] == "Strips" and r["status"] == "flagged"]
    assert len(flagged) == 20
    assert all([f["code"] for f in r["findings"]] == ["provider_strips_whitespace"] for r in flagged)
    assert sum(r["status"] == "ok" for r in rows) == 25 + 5
    assert summary.traits["Strips"].edits == ("strip",)


def test_a_provider_serving_joined_text_is_found_across_the_run(tmp_path, kimi):
    from test_evidence import _vllm_text  # the same independent model of vLLM's detokenizer

    close, end = kimi.token_id("</think>"), kimi.token_id("<|im_end|>")
    recs = []
    for i in range(24):
        reasoning, content = f"Thinking about item {i}.", f"Answer number {i}."
        truth = kimi.encode(reasoning) + [close] + kimi.encode(content) + [end]
        r, c = _vllm_text(kimi, truth).split("</think>", 1)
        rec = _record(kimi, i, "Joins", reasoning, content)
        rec["response"]["choices"][0]["message"].update(reasoning=r, content=c)
        recs.append(rec)
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    _write(src, recs, drop_native=False)  # keep the truth to compare, and as evidence too
    summary = reconstruct_file(src, dst, kimi)
    assert summary.traits["Joins"].joins_markers
    rows = _rows(dst)
    assert all(r["status"] == "ok" and r["reconstruction"] == "marker_spaces" for r in rows)
    assert [r["completion_ids"] for r in rows] == [rec["native_ids"] for rec in recs]
    # the row's text is what the model wrote (the joins taken out), as its ids spell it; the
    # conversations export, which a trainer re-tokenizes, carries that text too
    for i, r in enumerate(rows):
        assert (r["reasoning"], r["content"]) == (f"Thinking about item {i}.", f"Answer number {i}.")
        served = recs[i]["response"]["choices"][0]["message"]
        assert served["reasoning"] != r["reasoning"] and served["content"] != r["content"]
    export_file(dst, tmp_path / "conv", "conversations")
    finals = [c["conversations"][-1] for c in _rows(tmp_path / "conv" / "conversations.jsonl")]
    assert finals == [{"role": "assistant", "content": r["content"], "reasoning_content": r["reasoning"]} for r in rows]


def test_a_probe_profile_flags_invisible_edits(tmp_path, kimi):
    profile = tmp_path / "probe.json"
    profile.write_text(json.dumps({"providers": [
        {"provider": "Folds", "profile": {"provider": "Folds", "text_edits": ["nfkc"]}},
        {"provider": "Clean", "profile": {"provider": "Clean", "text_edits": []}}]}))
    recs = [_record(kimi, i, "Folds", *_texts(i)) for i in range(3)] + [_record(kimi, i, "Clean", *_texts(i)) for i in range(3)]
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    _write(src, recs)
    summary = reconstruct_file(src, dst, kimi, provider_profile=load_provider_profile(profile))
    rows = _rows(dst)
    assert [r["status"] for r in rows] == ["flagged"] * 3 + ["ok"] * 3
    assert all(f["code"] == "provider_edits_text" and "nfkc" in f["message"] for r in rows[:3] for f in r["findings"])
    assert summary.traits["Folds"].edit_sources == ("probe",)


@pytest.mark.parametrize("body,where", [
    ("not json", "cannot read"),
    ('{"providers": 3}', "providers: must be a list"),
    ('{"providers": [{"profile": {}}]}', "providers[0].provider"),
    ('{"providers": [{"provider": "x", "profile": {"text_edits": "nfkc"}}]}', "text_edits: must be a list"),
    # the stdlib recurses per level: this was a RecursionError, and the command's exit 8
    ("[" * 100_000, "cannot read the provider profile (nested too deeply to read)"),
    ('{"providers": ' + "1" * 5000 + "}", "cannot read the provider profile (not valid JSON (a number of more than"),
    # a hand edit read strictly: a misspelt edit or a provider given twice let its samples pass unflagged
    ('{"providers": [{"provider": "x", "profile": {"text_edits": ["nfc", "NFKC"]}}]}',
     "providers[0].profile.text_edits[1]: 'NFKC' is no edit a probe names (one of crlf_to_lf, nfc, nfkc, strip, "
     "marker_spaces)"),
    ('[{"provider": "x", "text_edits": ["nfkc"]}, {"provider": "y", "text_edits": null}, {"provider": "x", '
     '"text_edits": []}]',
     "providers[2].provider: 'x' is also providers[0], with other text_edits: which one holds is unclear"),
    # misspelt or misplaced, text_edits was read as "no edit": the provider's samples went unflagged
    ('{"providers": [{"provider": "x", "profile": {"text_edit": ["nfkc"]}}]}',
     "providers[0].profile.text_edits: missing (a probe writes it: the edits it found, [] for none, or null where "
     "it could not tell); the profile has 'text_edit'"),
    ('{"providers": [{"provider": "x", "text_edits": ["nfkc"], "profile": {}}]}',
     "providers[0].profile.text_edits: missing (a probe writes it: the edits it found, [] for none, or null where it "
     "could not tell)"),
    ('[{"provider": "x"}]', "providers[0].text_edits: missing"),
])
def test_a_bad_profile_names_the_field(tmp_path, body, where):
    path = tmp_path / "p.json"
    path.write_text(body)
    with pytest.raises(ProfileError) as err:
        load_provider_profile(path)
    assert where in str(err.value) and str(path) in str(err.value)


def test_a_profile_that_gives_a_key_twice_is_refused_naming_the_object(tmp_path):
    # a hand-edited profile: which of the two lists was meant no reader can tell (the stdlib kept the last)
    path = tmp_path / "p.json"
    path.write_text('{"providers": [{"provider": "a", "profile": {"text_edits": ["nfkc"], "text_edits": []}}]}')
    with pytest.raises(ProfileError) as err:
        load_provider_profile(path)
    assert str(err.value) == (f"{path}: providers[0].profile: cannot read the provider profile (the key 'text_edits' "
                              "appears twice in one object: which value is meant is unclear (readers keep the first or "
                              "the last))")
    path.write_text('{"providers": [], "providers": [{"provider": "a", "text_edits": ["nfkc"]}]}')
    with pytest.raises(ProfileError, match=r"p\.json: cannot read the provider profile \(the key 'providers' appears"):
        load_provider_profile(path)
    path.write_text('[{"provider": "a", "text_edits": [], "text_edits": ["nfkc"]}]')  # a bare list: named as the other shape
    with pytest.raises(ProfileError, match=r"p\.json: providers\[0\]: cannot read the provider profile \(the key 'text_"):
        load_provider_profile(path)
    path.write_text('{"a": 1, "a": 2} xx')  # what else is wrong is said first, as without the repeat
    with pytest.raises(ProfileError, match=r"p\.json: cannot read the provider profile \(not valid JSON \(Extra data at line 1"):
        load_provider_profile(path)
    path.write_text('[{"provider": "a", "text_edits": ["nfkc"], "note": NaN}]')  # Python's writers' NaN still reads
    assert load_provider_profile(path) == {"a": ("nfkc",)}


def test_reconstruct_cli_reads_a_probe_profile(tmp_path, kimi, kimi_dir):
    import subprocess
    import sys

    profile = tmp_path / "probe.json"
    profile.write_text(json.dumps([{"provider": "Folds", "text_edits": ["nfkc", "marker_spaces"]}]))
    src, dst = tmp_path / "ex.jsonl", tmp_path / "out.jsonl"
    _write(src, [_record(kimi, 0, "Folds", *_texts(0))])
    cli = [sys.executable, "-m", "tokenbridge.cli", "reconstruct", str(src), "-o", str(dst), "-t", str(kimi_dir)]
    done = subprocess.run([*cli, "--provider-profile", str(profile)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    row, = _rows(dst)
    assert [f["code"] for f in row["findings"]] == ["provider_edits_text"]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    done = subprocess.run([*cli, "--provider-profile", str(bad)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith(f"error: --provider-profile: {bad}: cannot read")
    assert "Traceback" not in done.stderr


def test_a_run_config_with_a_bad_profile_fails_before_anything_is_sent(tmp_path):
    from tokenbridge.pipeline import PipelineError
    from tokenbridge.runconfig import load_run_config

    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\ntokenizer = "owner/name"\n[reconstruct]\nprovider_profile = "missing.json"\n'
                   '[generate]\nmodel = "m"\ndatasets = ["builtin:chat"]\n')
    with pytest.raises(PipelineError) as err:
        load_run_config(cfg)
    assert err.value.code == 2
    assert f"{cfg}:4: reconstruct.provider_profile:" in str(err.value) and "missing.json" in str(err.value)


def test_a_run_read_from_a_pipe_gets_its_second_pass(tmp_path, kimi):
    """A trait found in the first pass needs a second one, which a pipe (``<(...)``) cannot
    give: the output came out empty, exit 0. The pipe is read once into a temp copy; the
    rows are those of the same file read from disk, and bad lines name the pipe."""
    import threading

    recs = [_record(kimi, i, "Lazy", *_texts(i), completion_delta=-1) for i in range(24)]
    src = tmp_path / "ex.jsonl"
    _write(src, recs)
    data = src.read_bytes() + b"{not json\n"
    src.write_bytes(data)
    summary = reconstruct_file(src, tmp_path / "from-file.jsonl", kimi)
    assert summary.traits["Lazy"].end_uncounted
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(data))
    writer.start()
    piped = reconstruct_file(fifo, tmp_path / "from-pipe.jsonl", kimi)
    writer.join(timeout=30)
    assert (tmp_path / "from-pipe.jsonl").read_bytes() == (tmp_path / "from-file.jsonl").read_bytes()
    assert piped.status == summary.status == {"ok": 24} and piped.traits == summary.traits
    assert [str(b) for b in piped.bad_lines] == [str(b).replace(str(src), str(fifo)) for b in summary.bad_lines]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ex.jsonl", "from-file.jsonl", "from-pipe.jsonl", "pipe"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_profile_that_is_no_regular_file_is_refused_without_waiting(tmp_path):
    """A FIFO no one writes to hung ``reconstruct --provider-profile`` (the run config already refused it)."""
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    with pytest.raises(ProfileError) as err:
        load_provider_profile(fifo)
    assert str(err.value) == (f"{fifo}: cannot read the provider profile ([Errno 22] is a named pipe (FIFO), not a "
                              f"regular file: '{fifo}')")


def test_a_provider_listed_twice_with_the_same_edits_loads(tmp_path):
    """``probe --providers a,a`` wrote the same profile twice (a cold reviewer's): it says
    nothing twice, so it loads; the probe now probes each provider once."""
    path = tmp_path / "p.json"
    path.write_text('[{"provider": "a", "text_edits": ["nfkc", "strip"]}, {"provider": "a", "text_edits": ["strip", '
                    '"nfkc"]}]')
    assert load_provider_profile(path) == {"a": ("nfkc", "strip")}

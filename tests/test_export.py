"""Exports: every format carries reconstruct's exact ids and masks, and only what it should."""

from __future__ import annotations

import json
import math
import os

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from test_export_support import make_exchange, make_run, read_jsonl, reconstruct, write_jsonl
from tokenbridge.cli import app
from tokenbridge.export import FORMATS, ExportError, export_file

N_EXCHANGES = 30


@pytest.fixture(scope="module")
def run(kimi, tmp_path_factory):
    """(exchanges path, reconstructed path, rows) from the real reconstruct on the real tokenizer."""
    root = tmp_path_factory.mktemp("run")
    exchanges, rows = make_run(kimi, N_EXCHANGES)
    return write_jsonl(root / "exchanges.jsonl", exchanges), write_jsonl(root / "reconstructed.jsonl", rows), rows


def _expected(rows, include_flagged=False):
    wanted = {"ok", "flagged"} if include_flagged else {"ok"}
    return [r for r in rows if r["status"] in wanted]


def _meta(r):
    return {k: r[k] for k in ("id", "choice", "dataset", "provider", "model", "status", "findings")}


def test_fixture_has_every_status(run):
    statuses = {r["status"] for r in run[2]}
    assert statuses == {"ok", "flagged", "rejected"}
    assert any(seg["kind"] == "tool_calls" for r in run[2] for seg in r["segments"])


@pytest.mark.parametrize("include_flagged", [False, True])
def test_specforge_rows_equal_reconstruct(run, tmp_path, include_flagged):
    _, src, rows = run
    summary = export_file(src, tmp_path / "sf", "specforge", include_flagged=include_flagged)
    got = read_jsonl(tmp_path / "sf" / "train.jsonl")
    want = _expected(rows, include_flagged)
    assert [(g["input_ids"], g["loss_mask"]) for g in got] == [(w["input_ids"], w["loss_mask"]) for w in want]
    assert [{k: g[k] for k in _meta(g)} for g in got] == [_meta(w) for w in want]
    assert summary.rows_exported == len(want)
    assert summary.skipped == {
        "flagged": 0 if include_flagged else sum(r["status"] == "flagged" for r in rows),
        "rejected": sum(r["status"] == "rejected" for r in rows),
    }
    assert summary.completion_tokens == sum(len(w["completion_ids"]) for w in want)
    assert sorted(p.name for p in (tmp_path / "sf").iterdir()) == [".tokenbridge-output", "README.md", "train.jsonl"]


def test_parquet_rows_equal_reconstruct_and_load_with_datasets(run, tmp_path):
    from datasets import load_dataset

    _, src, rows = run
    out = tmp_path / "pq"
    export_file(src, out, "parquet", shard_rows=7, row_group_rows=3)
    want = _expected(rows)
    shards = sorted((out / "data").glob("*.parquet"))
    n_shards = math.ceil(len(want) / 7)
    assert [p.name for p in shards] == [f"train-{k:05d}-of-{n_shards:05d}.parquet" for k in range(n_shards)]
    assert [pq.ParquetFile(p).metadata.num_rows for p in shards] == [7] * (n_shards - 1) + [len(want) - 7 * (n_shards - 1)]
    assert pq.ParquetFile(shards[0]).metadata.num_row_groups == 3  # 3 + 3 + 1 rows
    by_files = load_dataset("parquet", data_files=[str(p) for p in shards], split="train")
    by_card = load_dataset(str(out), split="train")  # the README's `configs` point at data/train-*.parquet
    for ds in (by_files, by_card):
        assert ds["input_ids"] == [w["input_ids"] for w in want]
        assert ds["loss_mask"] == [w["loss_mask"] for w in want]
        assert ds["id"] == [w["id"] for w in want]
        assert ds["findings"] == [w["findings"] for w in want]
        assert ds["segments"] == [w["segments"] for w in want]
    assert by_files["num_prompt_tokens"] == [len(w["prompt_ids"]) for w in want]
    assert [json.loads(m) for m in by_files["messages"]] == [w["messages"] for w in want]
    card = (out / "README.md").read_text()
    assert f"rows_exported: {len(want)}" in card and "path: data/train-*.parquet" in card


def test_speculators_folder_equals_reconstruct(run, tmp_path):
    from datasets import load_from_disk

    _, src, rows = run
    out = tmp_path / "spec"
    export_file(src, out, "speculators", include_flagged=True)
    want = _expected(rows, True)
    ds = load_from_disk(str(out))
    assert ds.format["type"] == "torch"
    row = ds[0]
    assert str(row["input_ids"].dtype) == "torch.int64" and str(row["loss_mask"].dtype) == "torch.int64"
    plain = ds.with_format(None)
    assert plain["input_ids"] == [w["input_ids"] for w in want]
    assert plain["loss_mask"] == [w["loss_mask"] for w in want]
    assert plain["seq_len"] == [len(w["input_ids"]) for w in want]
    assert [{k: r[k] for k in _meta(r)} for r in plain] == [_meta(w) for w in want]
    assert not list(tmp_path.glob(".*"))  # staging and partial folders are gone


def test_conversations_rebuild_the_same_ids(run, tmp_path, kimi):
    """Rendering an exported conversation with the model's template gives back our exact ids."""
    from tokenbridge.reconstruct import reconstruct_record

    _, src, rows = run
    export_file(src, tmp_path / "conv", "conversations")
    got = read_jsonl(tmp_path / "conv" / "conversations.jsonl")
    want = _expected(rows)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert _meta(g) == _meta(w)
        *history, final = g["conversations"]
        assert [t["role"] for t in history] == [m["role"] for m in w["messages"]]
        assert [t["content"] for t in history] == [m["content"] for m in w["messages"]]
        assert final == {"role": "assistant", "content": w["content"], "reasoning_content": w["reasoning"]}
        exchange = {"id": g["id"], "request": {"messages": history}, "response": {"choices": [
            {"index": 0, "finish_reason": w["finish_reason"],
             "message": {"role": "assistant", "reasoning_content": final["reasoning_content"], "content": final["content"]}}]}}
        again = reconstruct_record(exchange, kimi)[0]
        assert again["input_ids"] == w["input_ids"] and again["loss_mask"] == w["loss_mask"]


def test_conversations_leave_out_turns_no_chat_template_writes(tmp_path, kimi):
    """A cut turn re-rendered by the chat template gains the ``</think>`` and ``<|im_end|>``
    the model never wrote, and a turn ended by ``[EOS]`` gets ``<|im_end|>``: trained from
    text, both teach tokens it never emitted. The id formats keep them; conversations
    leaves them out and counts them."""
    from tokenbridge.reconstruct import reconstruct_record

    def record(k, finish, content, **extra):
        return {"id": f"r{k}", "request": {"messages": [{"role": "user", "content": f"q{k}"}]}, **extra,
                "response": {"choices": [{"index": 0, "finish_reason": finish, "message": {
                    "role": "assistant", "reasoning": f"thinking {k}", "content": content}}]}}

    eos = kimi.token_id("[EOS]")
    native = kimi.encode("thinking 2") + [kimi.token_id("</think>")] + kimi.encode("done") + [eos]
    # a turn ended in its block after a <think> the parser deleted (a reviewer's): the template
    # would write </think> in its place
    hidden = kimi.encode("thinking 3") + [kimi.token_id("<think>"), kimi.token_id("<|im_end|>")]
    rows = [*reconstruct_record(record(0, "stop", "done"), kimi),
            *reconstruct_record(record(1, "length", "half an ans"), kimi),
            *reconstruct_record(record(2, "stop", "done", native_ids=native), kimi),
            *reconstruct_record(record(3, "stop", "", native_ids=hidden), kimi)]
    assert [r["reconstruction"] for r in rows] == [None, None, "end=[EOS]", "token_hidden"]
    assert rows[2]["completion_ids"] == native and (rows[3]["status"], rows[3]["completion_ids"]) == ("flagged", hidden)
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    summary = export_file(src, tmp_path / "conv", "conversations", include_flagged=True)
    assert summary.rows_exported == 1 and summary.skipped == {"flagged": 0, "rejected": 0, "not_a_chat_turn": 3}
    assert [c["id"] for c in read_jsonl(tmp_path / "conv" / "conversations.jsonl")] == ["r0"]
    assert "3 not a chat turn" in (tmp_path / "conv" / "README.md").read_text()
    assert export_file(src, tmp_path / "sf", "specforge", include_flagged=True).rows_exported == 4


@pytest.mark.parametrize("label", ["drop", None, "bogus_reading"])
def test_a_turn_whose_ids_never_close_its_reasoning_is_no_chat_turn_without_its_label(tmp_path, kimi, label):
    """A cold tester's: the conversations export told such a turn by its ``reconstruction``
    label alone, so a row without it (or with another word) was written as a conversation a
    template re-renders with a ``</think>`` the model never emitted. The segments tell."""
    from tokenbridge.chat import resolve_dialect
    from tokenbridge.reconstruct import reconstruct_record
    from tokenbridge.traits import ProviderTrait

    # a tool call opened without </think>, as SGLang serves it: usage proves the reading (where
    # the run showed the end token counted)
    section = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
               '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    truth = kimi.encode("I will call the tool.") + kimi.encode(section) + [kimi.token_id("<|im_end|>")]
    request = {"messages": [{"role": "user", "content": "Weather in Paris?"}]}
    prompt_ids = kimi.encode(resolve_dialect(kimi).render_request(request))
    record = {"id": "r", "request": request, "response": {"provider": "P", "choices": [{"index": 0,
              "finish_reason": "tool_calls", "message": {"reasoning_content": "I will call the tool.", "content": section}}],
              "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(truth)}}}
    row = reconstruct_record(record, kimi, traits={"P": ProviderTrait("P", end_counted=True)})[0]
    assert (row["status"], row["reconstruction"], row["completion_ids"]) == ("ok", "no_think_close", truth)
    assert "think_end" not in {s["kind"] for s in row["segments"]}
    if label == "drop":
        del row["reconstruction"]
    else:
        row["reconstruction"] = label
    src = write_jsonl(tmp_path / "rows.jsonl", [row])
    with pytest.raises(ExportError, match="no row to export"):
        export_file(src, tmp_path / "conv", "conversations")
    assert export_file(src, tmp_path / "sf", "specforge").rows_exported == 1  # the ids are the ids


def test_a_label_that_is_not_a_string_is_refused(run, tmp_path):
    rows = [dict(r) for r in run[2][:3]]
    rows[1]["reconstruction"] = 5
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ExportError) as err:
        export_file(src, tmp_path / "conv", "conversations")
    assert str(err.value) == f"{src}:2: reconstruction: must be a string or null, got int"


@pytest.mark.parametrize(("field", "edit"), [
    ("content", lambda r: r.update(content=r["content"] + "\udc80")),
    ("reasoning", lambda r: r.update(reasoning=r["reasoning"] + "\ud800")),
    ("messages[0].content", lambda r: r["messages"][0].update(content="hi \udc80")),
])
@pytest.mark.parametrize("fmt", ["conversations", "parquet", "specforge"])
def test_an_exported_row_whose_text_holds_a_lone_surrogate_is_refused(run, tmp_path, field, edit, fmt):
    """A cold tester's: exported with exit 0, the file then failed to load in datasets and
    pyarrow (and Parquet held the text's JSON, not the text). The gate rejects such a
    sample, so an ok row holding one is a hand edit: named, nothing written."""
    rows = [json.loads(json.dumps(r)) for r in _expected(run[2])[:2]]
    edit(rows[1])
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="ascii")  # the escapes, as dumps_line writes
    with pytest.raises(ExportError) as err:
        export_file(src, tmp_path / "out", fmt)
    assert str(err.value) == (f"{src}:2: {field}: holds a lone surrogate (not UTF-8): no training file can carry it "
                              "(datasets and pyarrow refuse to read it)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_parquet_source_gives_the_same_export(run, tmp_path, kimi_dir, fmt):
    from tokenbridge.reconstruct import reconstruct_file

    exchanges, src, _ = run
    pq_src = tmp_path / "reconstructed.parquet"
    reconstruct_file(exchanges, pq_src, kimi_dir, workers=1)
    a, b = export_file(src, tmp_path / "a", fmt), export_file(pq_src, tmp_path / "b", fmt)
    assert a.rows_exported == b.rows_exported > 0
    for rel in a.files:
        if rel in ("README.md", "state.json"):  # the card names its source; state.json holds a random fingerprint
            continue
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


# --- validation -------------------------------------------------------------------------


def _corrupt(rows, k, **changes):
    rows = [dict(r) for r in rows]
    rows[k].update(changes)
    return rows


def _first_ok(rows):
    return next(k for k, r in enumerate(rows) if r["status"] == "ok")


#: A history tool call every renderer reads.
_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}

CORRUPTIONS = {
    "all_zero": (lambda r: {"loss_mask": [0] * len(r["input_ids"])}, "loss_mask", "all zeros"),
    "all_one": (lambda r: {"loss_mask": [1] * len(r["input_ids"])}, "loss_mask", "all ones"),
    "shift_left": (  # mask starts one token early: the last prompt token would be trained on
        lambda r: {"loss_mask": r["loss_mask"][1:] + [1]}, "loss_mask",
        "is 1 at position {p1}, inside the prompt"),
    "shift_right": (  # mask starts one token late: the first completion token is lost
        lambda r: {"loss_mask": [0] + r["loss_mask"][:-1]}, "loss_mask",
        "is 0 at position {p}, inside the completion"),
    "short_mask": (lambda r: {"loss_mask": r["loss_mask"][:-1]}, "loss_mask", "entries but input_ids has"),
    "bad_value": (lambda r: {"loss_mask": r["loss_mask"][:-1] + [2]}, "loss_mask", "must be 0 or 1, found 2"),
    "ids_differ": (lambda r: {"input_ids": r["input_ids"][:-1] + [5]}, "input_ids",
                   "differs from prompt_ids + completion_ids at position {last}"),
    "float_id": (lambda r: {"input_ids": [1.5] + r["input_ids"][1:]}, "input_ids", "found float at position 0"),
    # orjson reads it as a float: said as what was written (a cold tester's)
    "huge_id": (lambda r: {"input_ids": [2**70] + r["input_ids"][1:]}, "input_ids",
                "found a number past 64 bits at position 0"),
    "segment_gap": (lambda r: {"segments": r["segments"][:1] + [dict(r["segments"][1], start=r["segments"][1]["start"] + 1)]
                                          + r["segments"][2:]}, "segments[1]", "but the previous segment ended at"),
    "bad_status": (lambda r: {"status": "great"}, "status", "got 'great'"),
    # the conversations export writes these to a trainer as they are: a wrong type is named, not written
    "tool_not_object": (lambda r: {"tools": [1, 2]}, "tools[0]", "must be a tool object, got int"),
    "tool_calls_text": (lambda r: {"messages": [dict(r["messages"][0], tool_calls="x"), *r["messages"][1:]]},
                        "messages[0].tool_calls", "must be a list or null, got str"),
    "tool_call_not_object": (lambda r: {"messages": [dict(r["messages"][0], tool_calls=[_CALL, 3]),
                                                     *r["messages"][1:]]},
                             "messages[0].tool_calls[1]", "must be a tool call object, got int"),
    # the exchange check's rule: a call the renderers cannot read is named here too (it was let through)
    "tool_call_no_function": (lambda r: {"messages": [dict(r["messages"][0], tool_calls=[{"id": "c"}]),
                                                      *r["messages"][1:]]},
                              "messages[0].tool_calls[0].function", "missing or not an object"),
    "tool_call_no_arguments": (lambda r: {"messages": [dict(r["messages"][0], tool_calls=[
                                   {"id": "c", "type": "function", "function": {"name": "f"}}]), *r["messages"][1:]]},
                               "messages[0].tool_calls[0].function.arguments", "missing"),
    "reasoning_content_number": (lambda r: {"messages": [dict(r["messages"][0], reasoning_content=7),
                                                         *r["messages"][1:]]},
                                 "messages[0].reasoning_content", "must be a string or null, got int"),
    "reasoning_list": (lambda r: {"messages": [dict(r["messages"][0], reasoning=["x"]), *r["messages"][1:]]},
                       "messages[0].reasoning", "must be a string or null, got list"),
    "end_dropped": (  # ids, mask and segments all consistent, but the end token is gone
        lambda r: {"input_ids": r["input_ids"][:-1], "completion_ids": r["completion_ids"][:-1],
                   "loss_mask": r["loss_mask"][:-1], "segments": r["segments"][:-1]},
        "segments[{nseg}].kind", "must end with the end token"),
    # a hand edit the trainers take as it is (a cold tester's): the turn ends, then more follows
    "end_inside": (lambda r: {"segments": [*r["segments"][:-2], {"kind": "end", "start": r["segments"][-2]["start"],
                                                                   "end": r["segments"][-2]["start"] + 1},
                                           {"kind": r["segments"][-2]["kind"], "start": r["segments"][-2]["start"] + 1,
                                            "end": r["segments"][-1]["end"]}]},
                   "segments[{nseg}].kind", "is 'end' but more of the completion follows"),
    # the answer before the thinking, the reasoning after its close: exported as it was (a cold tester's)
    "answer_before_thinking": (lambda r: {"segments": [dict(seg, kind={"reasoning": "content", "content": "reasoning"}.get(
        seg["kind"], seg["kind"])) for seg in r["segments"]]}, "segments[1].kind",
        "is 'content' before the think block's close (segments[2]): a completion thinks first, then answers"),
    # the same with the close relabelled too: no think_end left to order the rest by (a cold reviewer's)
    "answer_before_thinking_no_close": (lambda r: {"segments": [dict(seg, kind={
        "reasoning": "content", "content": "reasoning", "think_end": "content"}.get(seg["kind"], seg["kind"]))
        for seg in r["segments"]]}, "segments[3].kind",
        "is 'reasoning' after the answer began (segments[1]): a completion thinks first, then answers"),
}


def test_a_cut_row_that_ends_in_a_leaked_end_marker_exports_under_a_policy_that_lets_it(tmp_path, kimi):
    """Cut by the length limit, its content ending in ``<|im_end|>``'s text: reconstruct writes
    the end segment (the id the text spells), and with ``eos_in_text`` and ``truncated`` off
    the row is ok. A check that refused an end segment under a cut failed the whole export
    (a cold reviewer's): the end segment stands last, as the model's own would."""
    from tokenbridge.checks import Policy
    from tokenbridge.reconstruct import reconstruct_file

    ex = make_exchange(1, "length")
    ex["response"]["choices"][0]["message"]["content"] += "<|im_end|>"
    row, = reconstruct(ex, kimi)
    src = write_jsonl(tmp_path / "ex.jsonl", [ex])
    policy = Policy({"eos_in_text": "off", "truncated": "off"})
    reconstruct_file(src, tmp_path / "rows.jsonl", kimi, policy=policy)
    rec, = read_jsonl(tmp_path / "rows.jsonl")
    assert (rec["status"], rec["finish_reason"], rec["segments"][-1]["kind"]) == ("ok", "length", "end")
    assert rec["completion_ids"][-1] == kimi.token_id("<|im_end|>") and row["completion_ids"] == rec["completion_ids"]
    summary = export_file(tmp_path / "rows.jsonl", tmp_path / "out", "specforge")
    assert summary.rows_exported == 1


@pytest.mark.parametrize("family", ["qwen3", "glm-4.5"])
def test_a_token_hidden_reading_with_a_second_think_start_exports(tmp_path, family):
    """``<think>R<think><|im_end|>``: a ``<think>`` the engine's parser hid in place of the
    close, read as such (``token_hidden``) and ok with ground-truth ids; a rule that a
    completion opens one think block failed the whole export (a cold reviewer's)."""
    from test_families_support import family_tokenizer
    from tokenbridge.chat import resolve_dialect
    from tokenbridge.reconstruct import reconstruct_record

    tok = family_tokenizer(family)
    d = resolve_dialect(tok)
    request = {"model": "m", "messages": [{"role": "user", "content": "Say something."}]}
    prompt = tok.encode(d.render_request(request))
    reasoning = "Nothing more to say."
    native = [*tok.encode(d.think_open_prefix + d.think_open), *tok.encode(reasoning), tok.token_id(d.think_open),
              tok.token_id(d.end_token)]
    rec = {"id": "u", "request": request, "native_ids": native, "response": {"choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "reasoning_content": reasoning,
                                                         "content": ""}}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(native)}}}
    row, = reconstruct_record(rec, tok)
    assert (row["status"], row["completion_ids"]) == ("ok", native)
    assert [s["kind"] for s in row["segments"]].count("think_start") == 2
    summary = export_file(write_jsonl(tmp_path / "rows.jsonl", [row]), tmp_path / "out", "specforge")
    assert summary.rows_exported == 1


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_bad_row_names_line_and_field(run, tmp_path, name):
    rows = run[2]
    k = _first_ok(rows[3:]) + 3
    change, field, message = CORRUPTIONS[name]
    p = len(rows[k]["prompt_ids"])
    fmt = {"p": p, "p1": p - 1, "last": len(rows[k]["input_ids"]) - 1, "nseg": len(rows[k]["segments"]) - 2}
    message, field = message.format(**fmt), field.format(**fmt)
    src = write_jsonl(tmp_path / "bad.jsonl", _corrupt(rows, k, **change(rows[k])))
    with pytest.raises(ExportError) as err:
        export_file(src, tmp_path / "out", "specforge")
    assert (err.value.line, err.value.field) == (k + 1, field)
    assert message in err.value.detail
    assert str(err.value).startswith(f"{src}:{k + 1}: {field}: ")


@pytest.mark.parametrize("name", ["tool_not_object", "tool_calls_text", "reasoning_content_number", "tool_call_no_arguments"])
def test_conversations_export_names_a_wrongly_typed_tool_or_history_field(run, tmp_path, name):
    """``tools: [1, 2]``, a history message's ``tool_calls: "x"`` or ``reasoning_content: 7``
    were written to conversations.jsonl as they were (exit 0) for a trainer to choke on."""
    rows = run[2]
    k = _first_ok(rows[3:]) + 3
    change, field, message = CORRUPTIONS[name]
    src = write_jsonl(tmp_path / "bad.jsonl", _corrupt(rows, k, **change(rows[k])))
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "out"), "--format", "conversations"])
    assert res.exit_code == 1
    assert res.output.splitlines() == [f"error: {src}:{k + 1}: {field}: {message}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_failed_export_keeps_the_previous_one(run, tmp_path):
    rows = run[2]
    out = tmp_path / "out"
    export_file(run[1], out, "parquet")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    k = _first_ok(rows)
    bad = write_jsonl(tmp_path / "bad.jsonl", _corrupt(rows, k, loss_mask=[0] * len(rows[k]["input_ids"])))
    with pytest.raises(ExportError):
        export_file(bad, out, "parquet")
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out"]


def test_invalid_json_line(run, tmp_path):
    rejected = next(r for r in run[2] if r["status"] == "rejected")
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(rejected) + '\n\n{"status": \n')
    with pytest.raises(ExportError) as err:
        export_file(src, tmp_path / "out", "specforge")
    assert (err.value.line, err.value.field) == (3, "<line>")


def test_rejected_rows_are_not_validated_and_never_exported(run, tmp_path):
    rows = [dict(r) for r in run[2]]
    for r in rows:
        if r["status"] == "rejected":
            r["loss_mask"] = []  # broken, but never looked at
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    s = export_file(src, tmp_path / "out", "specforge", include_flagged=True)
    ids = {(g["id"], g["choice"]) for g in read_jsonl(tmp_path / "out" / "train.jsonl")}
    assert not ids & {(r["id"], r["choice"]) for r in rows if r["status"] == "rejected"}
    assert s.skipped["rejected"] == sum(r["status"] == "rejected" for r in rows) > 0


def test_nothing_to_export_is_an_error(run, tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", [r for r in run[2] if r["status"] == "flagged"])
    with pytest.raises(ExportError, match="no row to export.*--include-flagged"):
        export_file(src, tmp_path / "out", "specforge")
    assert not (tmp_path / "out").exists()


SPLIT_NOTE = (
    "Rows are in the order of the source file (reconstruct's, often one dataset after another), not shuffled. "
    "speculators' trainer splits by row index: the last (1 - `--train-data-ratio`) of the rows (default 0.9: the "
    "last 10%) are validation and never trained on, so whole datasets may land there. Set `--train-data-ratio` "
    "(`data.train_data_ratio` in its YAML), or shuffle into a new folder before generating hidden states: "
    "`datasets.load_from_disk(\"{dir}\").shuffle(seed=0).save_to_disk(\"NEW\")`.")
TURNS_NOTE = (
    "Only the final assistant turn is the target model's; earlier assistant turns in a history are the prompt "
    "dataset's. SpecForge trains every assistant turn unless `data.train_only_last_turn: true`; speculators' "
    "`prepare-data` makes a supervised row of every assistant turn (no option), so histories with earlier "
    "assistant turns train text the target never produced. The id formats (specforge, speculators, parquet) "
    "train only the proven completion.")


def test_cards_say_what_the_trainers_do_with_the_rows(run, tmp_path):
    """The speculators folder keeps file order (its trainer holds out the last rows by index)
    and the conversations card says which assistant turns a re-tokenizing trainer trains."""
    spec, conv = tmp_path / "spec", tmp_path / "conv"
    export_file(run[1], spec, "speculators")
    export_file(run[1], conv, "conversations")
    spec_card = (spec / "README.md").read_text(encoding="utf-8").split("\n")
    assert SPLIT_NOTE.format(dir=spec) in spec_card
    assert (f"speculators: `--data-path {spec}` (a `datasets.load_from_disk` folder; hidden states go to "
            f"`{spec}/hidden_states`, and speculators caches its draft vocabulary there as `d2t-N.npy` / `t2d-N.npy` "
            "and reads a `token_freq.pt` there: a re-export of the same rows keeps them, as everything else it "
            "did not write; one that changes the rows is refused while they are there, since they belong to the "
            "old rows: move them away, or export into a new folder).") in spec_card
    assert TURNS_NOTE in (conv / "README.md").read_text(encoding="utf-8").split("\n")
    for fmt in ("specforge", "parquet"):
        export_file(run[1], tmp_path / fmt, fmt)
        card = (tmp_path / fmt / "README.md").read_text(encoding="utf-8")
        assert "train_data_ratio" not in card and "train_only_last_turn" not in card


# --- memory -----------------------------------------------------------------------------


def _synthetic(path, n, prompt=40, completion=100):
    with open(path, "w") as fh:
        for k in range(n):
            p = [(k * 7 + i) % 150_000 for i in range(prompt)]
            c = [(k * 13 + i) % 150_000 for i in range(completion)] + [163586]
            fh.write(json.dumps({"id": f"s{k}", "choice": 0, "dataset": "syn", "status": "ok", "prompt_ids": p,
                                 "completion_ids": c, "input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c),
                                 "segments": [{"kind": "prompt", "start": 0, "end": len(p)},
                                              {"kind": "content", "start": len(p), "end": len(p) + completion},
                                              {"kind": "end", "start": len(p) + completion, "end": len(p + c)}],
                                 "findings": [], "provider": "x", "model": "m", "finish_reason": "stop",
                                 "thinking": False, "usage": None, "messages": [{"role": "user", "content": "q"}],
                                 "tools": None, "reasoning": "", "content": "a"}) + "\n")
    return path


@pytest.mark.parametrize("fmt", ["specforge", "parquet", "speculators", "conversations"])
def test_memory_stays_flat(tmp_path, fmt):
    import tracemalloc

    options = {"row_group_rows": 200} if fmt in ("parquet", "speculators") else {}
    export_file(_synthetic(tmp_path / "warm.jsonl", 10), tmp_path / "warm", fmt)  # imports happen untraced
    peaks = []
    for n in (400, 3200):
        src = _synthetic(tmp_path / f"s{n}.jsonl", n)
        tracemalloc.start()
        export_file(src, tmp_path / f"out{n}", fmt, **options)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    size = os.path.getsize(tmp_path / "s3200.jsonl")
    assert peaks[1] < 1.5 * peaks[0] + (1 << 20), peaks  # 8x the rows, about the same peak
    # far below what holding the rows would take; the one thing kept per row is the
    # (id, choice) entry that refuses a repeated sample (under 200 bytes, whatever the row's size)
    assert peaks[1] < size / 4 + 200 * 3200, (peaks, size)


# --- CLI --------------------------------------------------------------------------------


def test_cli_export_and_bad_row(run, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(run[1]), "-o", str(tmp_path / "o"), "--format", "specforge"])
    assert res.exit_code == 0, res.output
    n = len(_expected(run[2]))
    assert res.output.startswith(f"{n} rows ")
    assert len(read_jsonl(tmp_path / "o" / "train.jsonl")) == n
    k = _first_ok(run[2])
    bad = write_jsonl(tmp_path / "bad.jsonl", _corrupt(run[2], k, loss_mask=run[2][k]["loss_mask"][1:] + [1]))
    res = runner.invoke(app, ["export", str(bad), "-o", str(tmp_path / "o2"), "--format", "parquet"])
    assert res.exit_code == 1  # bad data, not a bad flag (docs/contracts.md, stage exit codes)
    assert f"{bad}:{k + 1}: loss_mask: is 1 at position" in res.output


def test_speculators_shards_load_in_order(run, tmp_path):
    from datasets import load_from_disk

    _, src, rows = run
    out = tmp_path / "spec"
    summary = export_file(src, out, "speculators", shard_bytes=1)  # a new shard after every batch
    want = _expected(rows)
    shards = sorted(p.name for p in out.glob("*.arrow"))
    assert shards == [f"data-{k:05d}-of-{len(want):05d}.arrow" for k in range(len(want))]  # one row each
    assert summary.files == shards + ["dataset_info.json", "state.json", "README.md"]
    plain = load_from_disk(str(out)).with_format(None)
    assert plain["input_ids"] == [w["input_ids"] for w in want]


# --- a file name need not be UTF-8 ----------------------------------------------------------

#: A folder name that is not UTF-8 (a byte Linux allows in any name), as Python spells it.
NOT_UTF8 = os.fsdecode(b"d\xfe")


def test_parquet_is_written_and_read_under_a_name_that_is_not_utf8(run, tmp_path, kimi, kimi_dir):
    """pyarrow takes a path as UTF-8: a Parquet export or reconstruct output under such a name
    was a UnicodeEncodeError traceback (exit 8), and reading a good Parquet file there was
    "not a readable Parquet file" in export, vocab, inspect and report, where every other
    format works. The files are opened by tokenbridge and handed over: the same bytes."""
    from conftest import EXAMPLE_EXCHANGES
    from outputs_support import snapshot

    _, src, rows = run
    export_file(src, tmp_path / "plain", "parquet")
    odd = tmp_path / NOT_UTF8
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(odd / "pq"), "-f", "parquet"])
    assert res.exit_code == 0, res.output
    made, plain = snapshot(odd / "pq"), snapshot(tmp_path / "plain")
    assert sorted(made) == sorted(plain) and all(made[k] == plain[k] for k in made if k != "README.md")  # it names the folder
    res = CliRunner().invoke(app, ["reconstruct", str(EXAMPLE_EXCHANGES), "-o", str(odd / "r.parquet"),
                                   "-t", str(kimi_dir)])
    assert res.exit_code == 1 and "Traceback" not in res.output  # its one broken line
    res = CliRunner().invoke(app, ["reconstruct", str(EXAMPLE_EXCHANGES), "-o", str(tmp_path / "r.parquet"),
                                   "-t", str(kimi_dir)])
    assert (odd / "r.parquet").read_bytes() == (tmp_path / "r.parquet").read_bytes()
    # and read back there: export, vocab, inspect, report
    shard = odd / "pq" / "data" / "train-00000-of-00001.parquet"
    assert pq.read_table(shard.open("rb")).num_rows == len(_expected(rows))
    run_dir = odd / "run"
    run_dir.mkdir()
    (run_dir / "reconstructed.parquet").write_bytes((tmp_path / "r.parquet").read_bytes())
    recon = run_dir / "reconstructed.parquet"
    for args in (["export", str(recon), "-o", str(tmp_path / "sf"), "-f", "specforge"],
                 ["vocab", str(recon), "-n", "64", "-o", str(tmp_path / "vocab"), "--target-vocab-size", "163840"],
                 ["inspect", str(recon), "-t", str(kimi_dir), "--id", "ex-clean"],
                 ["report", str(run_dir)]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, (args[0], res.output)
    assert len(read_jsonl(tmp_path / "sf" / "train.jsonl")) == 4
    assert json.loads((run_dir / "report" / "report.json").read_text())["rows"]["total"] == 7  # one row a record


@pytest.mark.parametrize(("args", "message"), [
    (["--row-group-rows", "0"], "Invalid value for '--row-group-rows': Input should be greater than or equal to 1"),
    (["--row-group-rows", "-3"], "Invalid value for '--row-group-rows': Input should be greater than or equal to 1"),
    (["--row-group-rows", str(10**20)],
     "Invalid value for '--row-group-rows': Input should be less than or equal to 2147483647"),
    (["--shard-rows", "0"], "Invalid value for '--shard-rows': Input should be greater than or equal to 1"),
    (["--shard-rows", "-5"], "Invalid value for '--shard-rows': Input should be greater than or equal to 1"),
])
def test_export_row_counts_are_range_checked_naming_the_flag(run, tmp_path, args, message):
    """``--row-group-rows 0`` (or past int64) was pyarrow's ValueError / OverflowError, exit 8;
    ``--shard-rows 0`` or below silently wrote a shard per row."""
    res = CliRunner().invoke(app, ["export", str(run[1]), "-o", str(tmp_path / "o"), "-f", "parquet", *args])
    assert res.exit_code == 2
    assert message in " ".join(res.output.replace("│", " ").split()), res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "Invalid value for '--workers' / '-j': Input should be greater than or equal to 0"),
    (str(10**20), "Invalid value for '--workers' / '-j': Input should be less than or equal to 1024"),
])
def test_reconstruct_workers_are_range_checked(run, tmp_path, value, message):
    """``--workers 10**20`` was an OverflowError in the lanes (exit 8)."""
    res = CliRunner().invoke(app, ["reconstruct", str(run[0]), "-o", str(tmp_path / "r.jsonl"), "--workers", value])
    assert res.exit_code == 2
    assert message in " ".join(res.output.replace("│", " ").split()), res.output
    assert not (tmp_path / "r.jsonl").exists()

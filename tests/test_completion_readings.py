"""Completion readings the served text alone cannot pick (hypotheses.py): GLM's newline
before ``<think>`` under SGLang's and vLLM's parsers, and the B3 cases where the count
proves an empty or just-closed think block.

SGLang forms come from the real ``ReasoningParser`` (sglang 0.5.23, ``SGLangEngine``).
vLLM is not installed: ``vllm_glm45`` below is a RE-IMPLEMENTATION of vLLM's GLM-4.5
reasoning parser (``vllm/reasoning/glm4_moe_reasoning_parser.py``, GLM-4.5 template:
the generation prompt ends ``<|assistant|>``), as restated from its source.
"""

from __future__ import annotations

import json
from typing import Any

from test_families_support import SGLangEngine, family_tokenizer
from tokenbridge.chat import resolve_dialect
from tokenbridge.reconstruct import reconstruct_file, reconstruct_record
from tokenbridge.traits import ProviderTrait

GLM = family_tokenizer("glm-4.5")
GLM_D = resolve_dialect(GLM)
THINK, THINK_END, USER = 151350, 151351, 151336
PROMPT = [{"role": "user", "content": "What is 2+2?"}]


def vllm_glm45(ids: list[int], *, stream: bool) -> tuple[str | None, str | None]:
    """RE-IMPLEMENTATION of vLLM's glm45 parser (not the oracle itself). Whole: no split
    unless both markers are in the text; everything before ``<think>`` is dropped.
    Streamed, one token per delta: a lone marker delta is skipped, a delta before
    ``<think>`` is content, between the markers reasoning, after ``</think>`` content."""
    if not stream:
        text = GLM.decode(ids)
        if "<think>" not in text or "</think>" not in text:
            return None, text
        reasoning, _, content = text.partition("<think>")[2].partition("</think>")
        return reasoning, content or None
    reasoning, content, seen = [], [], set()
    for i in ids:
        if i in (THINK, THINK_END):
            seen.add(i)
            continue
        (reasoning if THINK in seen and THINK_END not in seen else content).append(GLM.decode([i]))
    return "".join(reasoning) or None, "".join(content) or None


def _glm(native: str, served: tuple[str | None, str | None], *, stream: bool | None = None,
         provider: str = "p", traits: dict[str, ProviderTrait] | None = None) -> tuple[dict[str, Any], list[int]]:
    ids = GLM.encode(native)
    reasoning, content = served
    request: dict[str, Any] = {"messages": PROMPT}
    if stream is not None:
        request["stream"] = stream
    prompt = GLM.encode(GLM_D.render_request(request))
    response = {"provider": provider, "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": reasoning, "content": content}}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}
    row, = reconstruct_record({"id": "g", "request": request, "response": response}, GLM, traits=traits)
    return row, ids


def codes(row: dict[str, Any]) -> list[str]:
    return [f["code"] for f in row["findings"]]


NATIVE_A1 = "\n<think>Simple sum.</think>\nThe answer is 4.<|user|>"


def test_vllm_streamed_newline_in_content_is_not_read_as_the_models():
    """A1: vLLM streams the newline before <think> as content ("\\n" + "\\nC"). Alone, the
    record also fits vLLM's whole form of "</think>\\n\\nC" (271 for 198, 198, same count)."""
    ids = GLM.encode(NATIVE_A1)
    served = vllm_glm45(ids[:-1], stream=True)
    assert served == ("Simple sum.", "\n\nThe answer is 4.")
    row, native = _glm(NATIVE_A1, served)
    assert row["status"] == "rejected" and codes(row) == ["reconstruction_ambiguous"]
    row, native = _glm(NATIVE_A1, served, stream=True)  # the request says it streamed
    assert row["status"] == "ok" and row["completion_ids"] == native and codes(row) == []
    assert row["reconstruction"] == "think_prefix_in_content"
    assert native[native.index(THINK_END) + 1] == 198


def test_vllm_whole_drops_the_newline_before_think():
    """A2: "\\n<think>\\n\\nR" whole under vLLM before 0.34 is reasoning "\\n\\nR", SGLang's
    streamed form of "\\n<think>\\nR" too: same count, other ids. vLLM 0.34 serves that
    form whole as well (tests/test_vllm_oracle.py), so a whole response no longer picks."""
    native = "\n<think>\n\nSimple sum.</think>\nThe answer is 4.<|user|>"
    served = vllm_glm45(GLM.encode(native)[:-1], stream=False)
    assert served == ("\n\nSimple sum.", "\nThe answer is 4.")
    for stream in (None, False):
        row, ids = _glm(native, served, stream=stream)
        assert row["status"] == "rejected" and codes(row) == ["reconstruction_ambiguous"]
        assert "think_prefix_kept" in row["findings"][0]["message"] and ids[:3] == [198, THINK, 271]


def test_sglang_forms_stay_exact():
    """SGLang's whole form names the newline itself; its streamed form is resolved by the
    request's stream flag alone when the content cannot carry the prefix, else by the run."""
    engine = SGLangEngine(GLM, "glm-4.5", "glm45", {USER})
    ids = GLM.encode(NATIVE_A1)
    whole = engine.serve(ids, 10, thinking=True, stream=False)["choices"][0]["message"]
    assert whole["reasoning_content"] == "\n<think>Simple sum."
    row, _ = _glm(NATIVE_A1, (whole["reasoning_content"], whole["content"]))
    assert row["status"] == "ok" and row["completion_ids"] == ids and row["reconstruction"] is None
    streamed = engine.serve(ids, 10, thinking=True, stream=True)["choices"][0]["message"]
    assert streamed["reasoning_content"] == "\nSimple sum." and streamed["content"] == "\nThe answer is 4."
    served = (streamed["reasoning_content"], streamed["content"])
    row, _ = _glm(NATIVE_A1, served, stream=True)  # vLLM's "\n<think>\nR</think>C" fits too
    assert codes(row) == ["reconstruction_ambiguous"]
    sglang = {"p": ProviderTrait("p", prefix_in_reasoning=True)}
    row, _ = _glm(NATIVE_A1, served, stream=True, traits=sglang)
    assert row["status"] == "ok" and row["completion_ids"] == ids


def test_run_trait_names_the_engine_form(tmp_path):
    """20 SGLang-streamed GLM rows show the newline in every reasoning: the run decides."""
    engine = SGLangEngine(GLM, "glm-4.5", "glm45", {USER})
    prompt = GLM.encode(GLM_D.render_request({"messages": PROMPT}))
    src = tmp_path / "x.jsonl"
    natives = []
    with src.open("w") as f:
        for n in range(20):
            ids = GLM.encode(f"\n<think>Sum {n}.</think>\nIt is {n}.<|user|>")
            natives.append(ids)
            response = {**engine.serve(ids, len(prompt), thinking=True, stream=True), "provider": "sgl"}
            f.write(json.dumps({"id": f"r{n}", "request": {"messages": PROMPT}, "response": response}) + "\n")
    out = tmp_path / "o.jsonl"
    summary = reconstruct_file(src, out, GLM, workers=1)
    rows = [json.loads(line) for line in out.open()]
    assert [r["status"] for r in rows] == ["ok"] * 20
    assert [r["completion_ids"] for r in rows] == natives
    assert summary.traits["sgl"].prefix_in_reasoning is True


# --- B3: empty and just-closed think blocks, proven by the count ---------------------------

QWEN = family_tokenizer("qwen3")
DS31 = family_tokenizer("deepseek-v3.1")
SAY_HI = [{"role": "user", "content": "Say hi."}]


def _sglang(tok: Any, folder: str, parser: str, stop: int, request: dict[str, Any], native: str, *,
            usage: bool = True, logprobs: bool = False) -> tuple[dict[str, Any], list[int]]:
    ids = tok.encode(native)
    prompt = tok.encode(resolve_dialect(tok).render_request(request))
    response = SGLangEngine(tok, folder, parser, {stop}).serve(ids, len(prompt), thinking=True, stream=False)
    if not usage:
        del response["usage"]
    if logprobs:  # vLLM / SGLang with return_tokens_as_token_ids
        response["choices"][0]["logprobs"] = {"content": [{"token": f"token_id:{i}", "logprob": -0.1, "bytes": None,
                                                           "top_logprobs": []} for i in ids]}
    row, = reconstruct_record({"id": "b3", "request": request, "response": response}, tok)
    return row, ids


def test_empty_think_block_proven_by_usage_is_not_reasoning_missing():
    row, ids = _sglang(QWEN, "qwen3", "qwen3", 151645, {"messages": SAY_HI}, "<think></think>Hi!<|im_end|>")
    assert row["status"] == "ok" and codes(row) == [] and row["completion_ids"] == ids == [151667, 151668, 13048, 0, 151645]
    request = {"messages": SAY_HI, "chat_template_kwargs": {"thinking": True}}
    row, ids = _sglang(DS31, "deepseek-v3.1", "deepseek-v3", 1, request, "</think>Hi!<｜end▁of▁sentence｜>")
    assert row["status"] == "ok" and codes(row) == [] and row["completion_ids"] == ids
    # nothing proves it without usage: the reasoning may have been withheld
    row, _ = _sglang(QWEN, "qwen3", "qwen3", 151645, {"messages": SAY_HI}, "<think></think>Hi!<|im_end|>", usage=False)
    assert row["status"] == "rejected" and codes(row) == ["reasoning_missing", "usage_missing"]


def test_cut_right_after_think_close_is_a_reading_the_ids_prove():
    request = {"messages": SAY_HI, "max_tokens": 6}
    row, ids = _sglang(QWEN, "qwen3", "qwen3", 151645, request, "<think>\nHmm.\n</think>", logprobs=True)
    assert row["status"] == "flagged" and codes(row) == ["truncated"]
    assert row["completion_ids"] == ids and ids[-1] == 151668
    assert row["reconstruction"] == "cut_after_think_close"


def test_a_cut_right_after_think_close_is_not_read_from_the_count_alone():
    """One token more than the formula is also a cut inside a character that vLLM held back
    (a partial UTF-8 token is never served): the count cannot say which, so neither is read."""
    request = {"messages": SAY_HI, "max_tokens": 6}
    row, ids = _sglang(QWEN, "qwen3", "qwen3", 151645, request, "<think>\nHmm.\n</think>")
    assert row["status"] == "rejected" and codes(row) == ["truncated", "usage_completion_mismatch"]
    assert row["reconstruction"] is None and row["completion_ids"] == ids[:-1]
    # vLLM's form of a cut inside 🦩 (its tokens: " \xf0\x9f", "\xa6", "\xa9"): the text holds back
    # the partial character
    cut = QWEN.encode("<think>\nSmile 🦩")[:-1]
    assert QWEN.decode_bytes(cut).endswith(b" \xf0\x9f\xa6")  # the cut falls inside the character
    shown = QWEN.decode_bytes(cut).decode("utf-8", "ignore")
    prompt = QWEN.encode(resolve_dialect(QWEN).render_request(request))
    response = {"choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "reasoning_content": shown.removeprefix("<think>\n"), "content": None}}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(cut)}}
    row, = reconstruct_record({"id": "v", "request": request, "response": response}, QWEN)
    assert row["status"] == "rejected" and "usage_completion_mismatch" in codes(row)
    assert 151668 not in row["completion_ids"]  # no </think> the model never wrote


# --- A5: gpt-oss cut inside a recipient-first header ----------------------------------------

OSS = family_tokenizer("gpt-oss")


def test_gptoss_cut_after_recipient_to_ties_with_the_channel_header():
    """SGLang holds back an unfinished header: a cut right after `` to`` (316) of
    ``<|start|>assistant to=functions.X`` serves what a cut after ``<|channel|>`` (200005)
    serves, with the same count."""
    dialect = resolve_dialect(OSS)
    request, noon = {"messages": [{"role": "user", "content": "Weather in Paris?"}]}, 1750075200
    prompt = OSS.encode_prompt(dialect.prompt_readings(request, {"created": noon}, {})[0].text)
    ids = OSS.encode("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to")
    assert ids[-1] == 316
    engine = SGLangEngine(OSS, "gpt-oss", "gpt-oss", {199999, 200002, 200012}, skip_special=False)
    response = {**engine.serve(ids, len(prompt), thinking=True, stream=False), "created": noon}
    assert response["choices"][0]["message"]["content"] in ("", None)
    row, = reconstruct_record({"id": "o", "request": request, "response": response}, OSS)
    assert row["status"] == "rejected" and codes(row) == ["truncated", "reconstruction_ambiguous"]
    assert "cut_header=4, cut_header=recipient:to" in row["findings"][1]["message"]


# --- a GLM turn written without the newline before <think> -------------------------------

NATIVE_BARE = "<think>Let me think.</think>\nHello there.<|user|>"


def _bare(served: dict[str, Any], *, stream: bool | None, traits: dict[str, ProviderTrait] | None = None,
          native: list[int] | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"messages": PROMPT}
    if stream is not None:
        request["stream"] = stream
    record: dict[str, Any] = {"id": "b", "request": request, "response": {**served, "provider": "p"}}
    if native is not None:
        record["native_ids"] = native
    row, = reconstruct_record(record, GLM, traits=traits)
    return row


def test_a_turn_without_the_newline_before_think_is_never_read_as_one_with_it():
    """SGLang serves ``<think>R</think>\\nC`` as reasoning ``R``, content ``"\\nC"``: vLLM's
    stream of ``"\\n<think>R</think>C"`` looks the same and has as many tokens. Only
    evidence that tells them apart may pick one; without it the gate says both fit
    (before, the vLLM reading was taken alone and the wrong ids passed as ok)."""
    engine = SGLangEngine(GLM, "glm-4.5", "glm45", {USER})
    ids = GLM.encode(NATIVE_BARE)
    prompt = len(GLM.encode(GLM_D.render_request({"messages": PROMPT})))
    other = GLM.encode("\n<think>Let me think.</think>Hello there.<|user|>")
    assert len(other) == len(ids) and other != ids
    for stream in (True, False):
        served = engine.serve(ids, prompt, thinking=True, stream=stream)
        message = served["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Let me think.", "\nHello there.")
        # (a record that does not say whether it streamed is read as the trained format here:
        # vLLM's whole form, one token longer, fits too, and a reading one token short of it
        # is what an uncounted end token looks like, so it needs evidence: see below)
        row = _bare(served, stream=stream)
        if stream is False:  # vLLM's whole form with the newline, one token longer, is all that is offered
            assert row["status"] == "rejected" and codes(row) == ["usage_completion_mismatch"]
        else:
            assert row["status"] == "rejected" and codes(row) == ["reconstruction_ambiguous"], stream
        # the run shows SGLang's form (its reasoning keeps the newline): no newline here means none was written
        row = _bare(served, stream=stream, traits={"p": ProviderTrait("p", prefix_in_reasoning=True)})
        assert row["status"] == "ok" and row["completion_ids"] == ids and row["reconstruction"] == "think_prefix_absent"
        row = _bare(served, stream=stream, native=ids)  # ground-truth ids pick it
        assert row["status"] == "ok" and row["completion_ids"] == ids and row["reconstruction"] == "think_prefix_absent"


def test_vllm_stream_with_no_newline_in_content_reads_the_turn_as_written_without_it():
    """Under a run that shows vLLM's form, a streamed content that does not start with the
    newline cannot hold vLLM's stream of it: the model wrote none (before, the formula put
    one back and the sample was rejected, one token over usage)."""
    native = "<think>Brief.</think>Hello.<|user|>"
    ids = GLM.encode(native)
    served = vllm_glm45(ids[:-1], stream=True)
    assert served == ("Brief.", "Hello.")
    row, _ = _glm(native, served, stream=True, traits={"p": ProviderTrait("p", prefix_in_reasoning=False)})
    assert row["status"] == "ok" and row["completion_ids"] == ids and row["reconstruction"] == "think_prefix_absent"


def test_a_turn_without_the_newline_needs_evidence_where_vllms_whole_form_fits_too():
    """vLLM whole serves ``"\n<think>R</think>C"`` as reasoning R, content C, as a model that
    wrote no newline is served: the two are one token apart, exactly what an end token that
    usage leaves out looks like. Offered without evidence, that reading kept a vLLM run's
    count traits from learning the uncounted end token, and every sample was rejected (a
    cold reviewer). Ground-truth ids, or a run that proved its end token counted, offer it."""
    native = "\n<think>Sure.</think>\nYes.<|user|>"
    ids = GLM.encode(native)
    served = vllm_glm45(ids[:-1], stream=False)
    assert served == ("Sure.", "\nYes.")
    row, _ = _glm(native, served, stream=False)
    assert row["status"] == "ok" and row["completion_ids"] == ids and row["reconstruction"] is None
    bare = GLM.encode("<think>Sure.</think>\nYes.<|user|>")
    prompt = len(GLM.encode(GLM_D.render_request({"messages": PROMPT})))
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "Sure.", "content": "\nYes."}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": len(bare)}}
    row = _bare(response, stream=False)  # the count alone: one short of vLLM's form, as an uncounted end is
    assert row["status"] == "rejected" and codes(row) == ["usage_completion_mismatch"]
    row = _bare(response, stream=False, native=bare)
    assert row["status"] == "ok" and row["completion_ids"] == bare and row["reconstruction"] == "think_prefix_absent"
    row = _bare(response, stream=False, traits={"p": ProviderTrait("p", end_counted=True)})
    assert row["status"] == "ok" and row["completion_ids"] == bare and row["reconstruction"] == "think_prefix_absent"


def test_a_vllm_run_whose_usage_leaves_out_the_end_token_is_still_calibrated(tmp_path):
    """30 GLM answers served in vLLM's whole form by a provider that counts no end token:
    the run learns that, and every row is ok with its exact ids (with the no-newline reading
    offered, no sample taught the count and all 30 were rejected)."""
    src, natives = tmp_path / "ex.jsonl", []
    with src.open("w") as fh:
        for k in range(30):
            request = {"messages": [{"role": "user", "content": f"Question {k}: what is {k}+{k}?"}]}
            reasoning, content = f"Adding {k} and {k} gives {2 * k}.", f"It is {2 * k}."
            ids = GLM.encode(f"\n<think>{reasoning}</think>\n{content}<|user|>")
            natives.append(ids)
            fh.write(json.dumps({"id": f"s{k}", "request": request, "meta": {"stream": False}, "response": {
                "provider": "P", "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "reasoning_content": reasoning, "content": "\n" + content}}],
                "usage": {"prompt_tokens": len(GLM.encode(GLM_D.render_request(request))),
                          "completion_tokens": len(ids) - 1}}}) + "\n")
    summary = reconstruct_file(src, tmp_path / "rows.jsonl", GLM, workers=1)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").open()]
    assert summary.traits["P"].end_uncounted
    assert [r["status"] for r in rows] == ["ok"] * 30 and [r["completion_ids"] for r in rows] == natives


def test_a_second_think_open_streamed_is_not_read_as_sglangs_whole_form():
    """GLM wrote ``<think>`` twice, then a tool call without ``</think>``: SGLang's streaming
    parser strips only the first, so the reasoning it streams starts ``"\\n<think>"``, which
    was read as its whole-response form, and the ``</think>`` the formula adds made up the
    count for the ``<think>`` lost: ``ok`` with wrong ids (a cold tester's). A record that
    says it streamed is read as streamed."""
    engine = SGLangEngine(GLM, "glm-4.5", "glm45", {USER, GLM.token_id("<|observation|>")})
    native = ("\n<think><think>\n\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "</tool_call><|observation|>")
    ids = GLM.encode(native)
    message = engine.serve(ids, 10, thinking=True, stream=True)["choices"][0]["message"]
    assert message["reasoning_content"].startswith("\n<think>")  # the premise: the second <think> is served
    row, truth = _glm(native, (message["reasoning_content"], message["content"]), stream=True)
    assert truth == ids and (row["status"] != "ok" or row["completion_ids"] == ids), row["completion_ids"]


def test_a_second_think_open_streamed_without_its_close_is_proven_by_logprob_ids():
    """The streamed second ``<think>`` and a tool call with no ``</think>``, logprobs giving
    every id: the unclosed reading's veto (an uncounted end token could stand in for the
    ``</think>`` it lacks) was kept because the reading also names ``think_open_twice``, so
    the formula's reading was chosen against the ids (usage and logprobs mismatches). Ids
    lift it; a policy that lets a ``<think>`` in reasoning pass then proves the row."""
    from tokenbridge.checks import Policy

    engine = SGLangEngine(GLM, "glm-4.5", "glm45", {USER, GLM.token_id("<|observation|>")})
    native = ("\n<think><think>\n\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "</tool_call><|observation|>")
    ids = GLM.encode(native)
    message = engine.serve(ids, 10, thinking=True, stream=True)["choices"][0]["message"]
    request = {"messages": PROMPT, "stream": True}
    lenient = Policy(severities={"think_marker_in_reasoning": "warning"})
    for logged in (ids, ids[:-1]):  # every id, or all but the end token
        response = {"provider": "p", "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "reasoning_content": message["reasoning_content"], "content": message["content"]},
            "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": -0.1, "bytes": None, "top_logprobs": []}
                                     for i in logged]}}],
            "usage": {"prompt_tokens": len(GLM.encode(GLM_D.render_request(request))), "completion_tokens": len(ids)}}
        row, = reconstruct_record({"id": "g", "request": request, "response": response}, GLM, policy=lenient)
        assert row["status"] == "flagged" and codes(row) == ["think_marker_in_reasoning"], codes(row)
        assert row["completion_ids"] == ids and row["reconstruction"] == "think_open_twice+no_think_close"


def test_a_second_think_open_where_the_record_does_not_say_it_streamed_ties():
    """The same served message in a record without ``stream`` (an external file): it was
    still read as SGLang's whole form only, ``ok`` with wrong ids. Both forms are read;
    the second ``<think>`` is one token from the whole form, an uncounted end token's gap,
    so without ids it only makes the row ambiguous."""
    engine = SGLangEngine(GLM, "glm-4.5", "glm45", {USER, GLM.token_id("<|observation|>")})
    native = ("\n<think><think>\n\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "</tool_call><|observation|>")
    ids = GLM.encode(native)
    message = engine.serve(ids, 10, thinking=True, stream=True)["choices"][0]["message"]
    row, _ = _glm(native, (message["reasoning_content"], message["content"]))
    assert row["status"] == "rejected" and "reconstruction_ambiguous" in codes(row), codes(row)
    assert "think_open_twice" in next(f["message"] for f in row["findings"] if f["code"] == "reconstruction_ambiguous")
    # served whole, the same text is SGLang's whole form: its count is one token short of a
    # second <think>, no tie, the row proven
    whole = "\n<think>Plan.</think>Done.<|user|>"
    message = engine.serve(GLM.encode(whole), 10, thinking=True, stream=False)["choices"][0]["message"]
    assert message["reasoning_content"].startswith("\n<think>")
    row, ids = _glm(whole, (message["reasoning_content"], message["content"]))
    assert row["status"] == "ok" and row["completion_ids"] == ids and row["reconstruction"] is None

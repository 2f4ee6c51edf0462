"""The last gate before training data leaves tokenbridge: is this row's mask right?

Trainers accept almost anything shaped like ``{input_ids, loss_mask}``; the failures
users hit are silent (all-zero or all-one masks, masks shifted by one token, a prompt
token trained on). So every exported row must satisfy, exactly:

* ``input_ids`` and ``loss_mask`` are lists of the same length, ids non-negative ints
  that fit int32, mask values 0/1;
* ``input_ids == prompt_ids + completion_ids`` when those fields are present;
* the mask is 0 over the prompt and 1 over the whole completion (reasoning,
  ``</think>``, content, tool markers, end token), i.e. ``[0]*P + [1]*C`` with P the
  prompt length (from ``prompt_ids``, else the ``prompt`` segment);
* ``segments`` (when present) tile ``input_ids`` from 0 to the end, prompt first, and
  unless the model was cut off (``finish_reason == "length"``) the last one is the
  end token (so a dropped end token cannot pass as a shorter completion); an end token
  is never anywhere else (a cut completion may end with one: the text ended in the end
  marker's text, and a policy that lets that through exports it);
* at least one prompt token and one completion token (no all-zero / all-one masks).

:class:`RowContract` then holds each exported row to the rest of the row contract
(docs/contracts.md): typed ``id`` / ``choice`` / ``findings``, a status that its findings
give (an ``ok`` row carries none, a ``flagged`` one no error), each ``(id, choice)``
once, and every id inside the target vocabulary when its size is known.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import orjson

from ..jsonl import unencodable
from ..rows import MARKER_SEGMENTS, SEGMENT_KINDS
from .source import ExportError

__all__ = ["MAX_ID", "RowContract", "check_training_row", "stored_row_ids"]

_SEVERITIES = ("error", "warning")

#: The largest token id a row can hold (ids are int32 in the row schema, tokenbridge.rows).
MAX_ID = (1 << 31) - 1
#: Builds the error for a field of the row being checked (file and line are bound).
_Fail = Callable[[str, str], ExportError]
#: Every digit as ``9``: ten in a row is an id that may not fit int32 (the slow path decides).
_DIGITS_AS_NINE = bytes.maketrans(b"0123456789", b"9999999999")


def check_training_row(rec: Mapping[str, Any], path: str | Path, line: int) -> tuple[list[int], list[int]]:
    """Return ``(input_ids, loss_mask)`` of a row, or raise :class:`ExportError`."""

    def fail(field: str, message: str) -> ExportError:
        return ExportError(path, line, field, message)

    fast = _exact_row(rec)
    if fast is not None:
        ids, mask, n_prompt = fast
        if isinstance(rec.get("segments"), list):
            _check_segments(rec["segments"], len(ids), n_prompt, rec.get("finish_reason"), fail)
        return ids, mask
    ids = _int_list(rec.get("input_ids"), "input_ids", fail)
    mask = _int_list(rec.get("loss_mask"), "loss_mask", fail)
    if len(ids) != len(mask):
        raise fail("loss_mask", f"has {len(mask)} entries but input_ids has {len(ids)}")
    if not ids:
        raise fail("input_ids", "is empty")
    if min(ids) < 0:
        raise fail("input_ids", f"has a negative id at position {_first(ids, lambda i: i < 0)}")
    if max(ids) > MAX_ID:
        raise fail("input_ids", f"has id {max(ids)} at position {_first(ids, lambda i: i > MAX_ID)}, beyond the "
                   f"row schema's int32 (max {MAX_ID})")

    n_prompt = _prompt_length(rec, ids, fail)
    if n_prompt == 0:
        raise fail("loss_mask", "is all ones: no prompt tokens, so the prompt would be trained on")
    if n_prompt >= len(ids):
        raise fail("loss_mask", "is all zeros: the row has no completion tokens to train on")
    n_completion = len(ids) - n_prompt
    if mask != [0] * n_prompt + [1] * n_completion:
        bad = [x for x in mask if x not in (0, 1)]
        if bad:
            raise fail("loss_mask", f"values must be 0 or 1, found {bad[0]!r}")
        if not any(mask):
            raise fail("loss_mask", "is all zeros: nothing would be trained on")
        if all(mask):
            raise fail("loss_mask", "is all ones: the prompt would be trained on")
        pos = _first(mask[:n_prompt], bool)
        if pos is not None:
            raise fail("loss_mask", f"is 1 at position {pos}, inside the prompt (positions 0..{n_prompt - 1})")
        pos = n_prompt + _at(mask[n_prompt:], lambda x: not x)
        raise fail("loss_mask", f"is 0 at position {pos}, inside the completion (positions {n_prompt}..{len(ids) - 1})")
    if isinstance(rec.get("segments"), list):
        _check_segments(rec["segments"], len(ids), n_prompt, rec.get("finish_reason"), fail)
    return ids, mask


def _exact_row(rec: Mapping[str, Any]) -> tuple[list[int], list[int], int] | None:
    """``(ids, mask, prompt length)`` when the row is right, proven on the rows' JSON text
    (a few C-speed passes instead of a Python scan per token); None when anything is off or
    unusual, and the slow path below then names the field and position.

    orjson writes an int as digits (a ``-`` when negative), a float with ``.`` or ``e``, a
    bool as ``true``/``false``: so ``input_ids`` whose text holds only digits and commas are
    non-negative ints, prompt + completion whose texts join into it are the same ints, and
    a mask whose text is ``[0,...,0,1,...,1]`` is exactly ``[0] * P + [1] * C`` in ints.
    """
    ids, mask = rec.get("input_ids"), rec.get("loss_mask")
    prompt, completion = rec.get("prompt_ids"), rec.get("completion_ids")
    if not (type(ids) is list and type(mask) is list and type(prompt) is list and type(completion) is list):
        return None
    if not prompt or not completion:
        return None
    try:
        text_ids, text_prompt, text_completion = orjson.dumps(ids), orjson.dumps(prompt), orjson.dumps(completion)
        text_mask = orjson.dumps(mask)
    except TypeError:  # an int beyond 64 bits, or a value orjson does not write
        return None
    digits = text_ids.translate(_DIGITS_AS_NINE)
    if digits.translate(None, b"9,") != b"[]" or b"9999999999" in digits:  # not all ints, or one of 10+ digits
        return None
    if text_ids != b"".join((text_prompt[:-1], b",", text_completion[1:])):
        return None
    if text_mask != b"".join((b"[", b"0," * len(prompt), b"1," * (len(completion) - 1), b"1]")):
        return None
    return ids, mask, len(prompt)


def stored_row_ids(rec: Mapping[str, Any], path: str | Path, line: int) -> list[Any]:
    """The ids of a row read back from disk (report, inspect): an ``ok`` row's held to
    :func:`check_training_row`, as export would take it; another's as they are, since a
    rejected or truncated row may have no completion to train on. Hand them to
    :meth:`RowContract.check`."""
    return check_training_row(rec, path, line)[0] if rec["status"] == "ok" else rec["input_ids"]


class RowContract:
    """The checks that span fields and rows: one instance per exported file."""

    def __init__(self, path: str | Path, vocab_size: int | None = None, markers: frozenset[int] | None = None) -> None:
        self.path, self.vocab_size = path, vocab_size
        #: the tokenizer's marker ids, where known (``run``): a marker segment must hold one
        self.markers = markers
        #: hash of (id, choice) -> line: one small entry per row, never the row itself
        self._seen: dict[int, int] = {}

    def check(self, rec: Mapping[str, Any], line: int, ids: list[int] | None, *, texts: bool = True) -> None:
        """Raise :class:`ExportError` (file:line:field) for the first breach. ``ids``: the
        row's ``input_ids`` as :func:`check_training_row` passed them; None for a row no
        consumer takes (its fields and status are still held to the contract). ``texts``:
        hold its texts to what a training file can carry (a row shown, not trained: not)."""

        def fail(field: str, message: str) -> ExportError:
            return ExportError(self.path, line, field, message)

        sid, choice = rec.get("id"), rec.get("choice", 0)
        if not isinstance(sid, str) or not sid:
            raise fail("id", f"must be a non-empty string, got {type(sid).__name__}")
        if type(choice) is not int or not 0 <= choice <= MAX_ID:  # Parquet holds it as int32
            raise fail("choice", f"must be a non-negative integer up to {MAX_ID}, got {choice!r}"[:200])
        findings = rec.get("findings")
        if findings is not None and hasattr(findings, "tolist"):  # a Parquet source
            findings = findings.tolist()
        if not isinstance(findings, list):
            raise fail("findings", f"must be a list, got {type(findings).__name__}")
        for k, f in enumerate(findings):
            if not isinstance(f, Mapping) or not isinstance(f.get("code"), str) or f.get("severity") not in _SEVERITIES:
                raise fail(f"findings[{k}]", "must be an object with a string code and severity error or warning")
        errors = [f["code"] for f in findings if f["severity"] == "error"]
        implied = "rejected" if errors else "flagged" if findings else "ok"
        if rec.get("status") != implied:
            why = (f"error finding {errors[0]}" if errors
                   else f"{len(findings)} finding(s)" if findings else "no finding")
            raise fail("status", f"is {rec.get('status')!r} but the row carries {why}, so it is {implied!r}")
        earlier = self._seen.setdefault(hash((sid, choice)), line)
        if earlier != line:
            raise fail("id", f"({sid!r}, choice {choice}) is also on line {earlier}: each sample choice once")
        if ids is None:
            return
        if texts:
            _check_texts(rec, fail)
        vocab_size = self.vocab_size
        if vocab_size is not None and ids and max(ids) >= vocab_size:
            pos = _at(ids, lambda i: i >= vocab_size)
            raise fail("input_ids", f"id {ids[pos]} at position {pos} is outside the vocabulary "
                       f"(size {self.vocab_size})")
        segments = rec.get("segments")
        if self.markers is not None and isinstance(segments, list):  # shapes checked by check_training_row
            for k, seg in enumerate(segments):
                if seg["kind"] in MARKER_SEGMENTS and ids[seg["start"]] not in self.markers:
                    raise fail(f"segments[{k}]", f"the {seg['kind']} segment holds id {ids[seg['start']]}, which is "
                               "no marker of the tokenizer (reconstruct writes the marker's id there)")


def _check_texts(rec: Mapping[str, Any], fail: _Fail) -> None:
    """A trained row's texts hold nothing UTF-8 cannot (a lone surrogate: the gate rejects
    such a sample, so this is a hand edit): an export wrote it with exit 0, and datasets and
    pyarrow then refused the file. Its numbers were held to JSON's when it was read."""
    texts = {col: rec.get(col) for col in ("content", "reasoning", "messages", "tools")}
    if (why := unencodable(texts, numbers=False)) is not None:
        field, _, what = why.partition(": ")
        raise fail(field, f"{what}: no training file can carry it (datasets and pyarrow refuse to read it)")


def _int_list(value: Any, field: str, fail: _Fail) -> list[int]:
    if hasattr(value, "tolist"):  # numpy / pyarrow arrays from a Parquet source
        value = value.tolist()
    if not isinstance(value, list):
        raise fail(field, f"must be a list of integers, got {type(value).__name__}")
    if not set(map(type, value)) <= {int}:
        pos = _at(value, lambda x: type(x) is not int)
        found = value[pos]
        # orjson reads an integer past 64 bits as a float: "float" named a row whose ids all were integers
        what = ("a number past 64 bits" if type(found) is float and found.is_integer() and abs(found) >= 2**63
                else type(found).__name__)
        raise fail(field, f"must hold integers only, found {what} at position {pos}")
    return value


def _prompt_length(rec: Mapping[str, Any], ids: list[int], fail: _Fail) -> int:
    prompt, completion = rec.get("prompt_ids"), rec.get("completion_ids")
    if prompt is not None or completion is not None:
        prompt = _int_list(prompt, "prompt_ids", fail)
        completion = _int_list(completion, "completion_ids", fail)
        if len(prompt) + len(completion) != len(ids) or ids[: len(prompt)] != prompt or ids[len(prompt):] != completion:
            joined = prompt + completion
            pos = _first(range(min(len(ids), len(joined))), lambda k: ids[k] != joined[k])
            where = f"position {pos}" if pos is not None else f"length ({len(ids)} vs {len(joined)})"
            raise fail("input_ids", f"differs from prompt_ids + completion_ids at {where}")
        return len(prompt)
    segments = rec.get("segments")
    if isinstance(segments, list) and segments and isinstance(segments[0], Mapping):
        end = segments[0].get("end")
        if segments[0].get("kind") == "prompt" and isinstance(end, int):
            return end
    raise fail("prompt_ids", "missing, and no prompt segment says where the prompt ends")


def _check_segments(segments: Sequence[Any], n: int, n_prompt: int, finish_reason: Any, fail: _Fail) -> None:
    pos = 0
    for k, seg in enumerate(segments):
        field = f"segments[{k}]"
        if not isinstance(seg, Mapping) or not all(type(seg.get(key)) is int for key in ("start", "end")):
            raise fail(field, "must be an object with integer start and end")
        if seg["start"] != pos or seg["end"] < seg["start"]:
            raise fail(field, f"spans {seg['start']}..{seg['end']} but the previous segment ended at {pos}")
        if seg.get("kind") not in SEGMENT_KINDS:
            raise fail(f"{field}.kind", f"is {seg.get('kind')!r}, not one of {', '.join(SEGMENT_KINDS)}"[:300])
        is_prompt = seg.get("kind") == "prompt"
        if (k == 0) != is_prompt:
            raise fail(f"{field}.kind", "the first segment, and only it, must be the prompt")
        size = seg["end"] - seg["start"]
        if seg.get("kind") in MARKER_SEGMENTS and size != 1:  # an emptied end segment is a dropped end token
            raise fail(field, f"the {seg['kind']} segment is one token (a marker), this one spans {size}")
        if not is_prompt and size == 0:
            raise fail(field, f"an empty {seg['kind']} segment: reconstruct writes none")
        if seg.get("kind") == "end" and k != len(segments) - 1:  # (last under a cut too: a leaked end marker's id)
            raise fail(f"{field}.kind", "is 'end' but more of the completion follows: the turn ended at its end token")
        pos = seg["end"]
    _check_think_block([seg.get("kind") for seg in segments], fail)
    if segments and segments[0]["end"] != n_prompt:
        raise fail("segments[0].end", f"is {segments[0]['end']} but the prompt has {n_prompt} tokens")
    if pos != n:
        raise fail("segments", f"cover {pos} positions but input_ids has {n}")
    if finish_reason != "length" and segments[-1].get("kind") != "end":
        raise fail(f"segments[{len(segments) - 1}].kind", f"is {segments[-1].get('kind')!r}: a completion that "
                   f"finished with {finish_reason!r} must end with the end token")


#: What may stand in a completion before its think block closes (``think_end``), and what never after it.
_BEFORE_CLOSE = frozenset({"format", "think_start", "reasoning"})
_THINKING = frozenset({"think_start", "reasoning", "think_end"})


def _check_think_block(kinds: Sequence[Any], fail: _Fail) -> None:
    """Every dialect writes one think block, first in the completion: an optional
    ``think_start``, the reasoning, then ``think_end`` where it closes; content and tool
    calls come after it (a hand edit that swapped them was exported as it was). A row with
    ``format`` segments (gpt-oss's channels, whose messages may come in other orders) is
    held to the close alone. (A second ``think_start`` may stand before the answer: a
    ``<think>`` the engine's parser hid in place of the close, reconstruct's
    ``token_hidden`` reading.)"""
    if "think_end" in kinds:
        close = kinds.index("think_end")
        for k, kind in enumerate(kinds[1:], start=1):
            if (kind not in _BEFORE_CLOSE) if k < close else (k > close and kind in _THINKING):
                where = "before" if k < close else "after"
                raise fail(f"segments[{k}].kind", f"is {kind!r} {where} the think block's close (segments[{close}]): "
                           "a completion thinks first, then answers")
    elif "format" not in kinds:  # no close (a cut, thinking off): the answer still comes after the thinking
        answer = next((k for k, kind in enumerate(kinds) if kind in ("content", "tool_calls")), len(kinds))
        if (late := next((k for k in range(answer + 1, len(kinds)) if kinds[k] in _THINKING), None)) is not None:
            raise fail(f"segments[{late}].kind", f"is {kinds[late]!r} after the answer began (segments[{answer}]): a "
                       "completion thinks first, then answers")


def _first(seq: Sequence[Any], pred: Callable[[Any], object]) -> int | None:
    for k, item in enumerate(seq):
        if pred(item):
            return k
    return None


def _at(seq: Sequence[Any], pred: Callable[[Any], object]) -> int:
    """:func:`_first` where the caller has shown such an item exists."""
    pos = _first(seq, pred)
    if pos is None:
        raise AssertionError("no item matches, though the caller checked one does")
    return pos

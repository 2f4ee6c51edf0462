"""One incremental writer per export format (the :class:`Writer` protocol).

* ``specforge``: ``train.jsonl``, one ``{input_ids, loss_mask, ...metadata}`` object a
  line: SpecForge's ``data.prompts_path`` pre-tokenized fast path (it reads only those
  two keys and ignores the rest).
* ``conversations``: ``conversations.jsonl``, ``{id, conversations: [{role, content,
  reasoning_content?, tool_calls?, ...}], tools?, ...metadata}``: for trainers that
  re-tokenize with their own chat template (SpecForge raw data, speculators
  ``prepare-data``). Re-tokenizing is *not* guaranteed to reproduce our ids. The final
  assistant turn's tool calls are raw marker text inside ``content``, as the model wrote
  them (the provider sends no ``tool_calls`` a sample with exact ids could keep).
* ``speculators``: a ``datasets`` ``save_to_disk`` folder (written with pyarrow alone,
  no ``datasets`` or torch needed) with ``input_ids`` / ``loss_mask`` (int64, as
  speculators' own ``prepare-data`` writes them), ``seq_len`` (which its ``ArrowDataset``
  needs for length bucketing), torch format on those three.
* ``parquet``: ``data/train-XXXXX-of-YYYYY.parquet`` shards (bounded rows and bytes,
  bounded row groups) with every column of the row except ``prompt_ids`` /
  ``completion_ids`` (``num_prompt_tokens`` splits ``input_ids`` into them), plus a
  dataset card.

Every row carries ``id, choice, dataset, provider, model, status, findings``. Column
types come from the one row schema (:func:`tokenbridge.rows.arrow_fields`). Every writer
gets rows :func:`~tokenbridge.export.check_training_row` has passed, so ``loss_mask`` is
exactly ``[0] * P + [1] * C`` and the Arrow writers build it from ``P`` and ``C``.
"""

from __future__ import annotations

import array
import hashlib
import json
import math
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable
from collections.abc import Mapping

import numpy as np

from ..content import content_text, is_text_parts
from ..jsonl import dumps_line
from ..rows import ReconstructedRow, arrow_fields, to_arrow_record

__all__ = ["WRITERS", "Writer", "ids_array", "metadata_of"]

_ROW_GROUP_ROWS = 1000
#: Buffered ids (input_ids entries) before an Arrow batch is written: bounds memory whatever the row length.
_BATCH_TOKENS = 1 << 20
#: The provenance columns every export carries, in this order.
META_COLUMNS = ("id", "choice", "dataset", "provider", "model", "status", "findings")


@runtime_checkable
class Writer(Protocol):
    """An export format: ``open`` a staging folder, ``write`` validated rows, then
    ``close`` (returns the files written) or ``abort`` (releases open files; the staging
    folder itself is removed by :func:`tokenbridge.fsio.publish_dir`)."""

    def open(self, out_dir: Path) -> None: ...

    def write(self, row: ReconstructedRow) -> None: ...

    def close(self) -> list[Path]: ...

    def abort(self) -> None: ...


def metadata_of(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance every exported row carries."""
    return {
        "id": rec["id"],
        "choice": rec["choice"],
        "dataset": rec["dataset"],
        "provider": rec["provider"],
        "model": rec["model"],
        "status": rec["status"],
        "findings": list(rec["findings"]),
    }


class _JsonlWriter:
    name = ""

    def __init__(self, **_: Any):
        self.path: Path | None = None
        self._fh: BinaryIO | None = None

    def open(self, out_dir: Path) -> None:
        self.path = out_dir / self.name
        self._fh = open(self.path, "wb", buffering=1 << 20)  # noqa: SIM115 - the writer owns it until close()

    def row(self, rec: ReconstructedRow) -> dict[str, Any]:
        raise NotImplementedError

    def write(self, row: ReconstructedRow) -> None:
        assert self._fh is not None
        self._fh.write(dumps_line(self.row(row)))
        self._fh.write(b"\n")

    def close(self) -> list[Path]:
        assert self._fh is not None and self.path is not None
        self._fh.close()
        return [self.path]

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()


class SpecForgeWriter(_JsonlWriter):
    name = "train.jsonl"

    def row(self, rec: ReconstructedRow) -> dict[str, Any]:
        return {"input_ids": rec["input_ids"], "loss_mask": rec["loss_mask"], **metadata_of(rec)}


#: Readings whose completion a chat template cannot write: it closes the think block, puts
#: its newline before ``<think>`` and, where it ends a turn with a token (Kimi, Qwen3,
#: DeepSeek; GLM's writes none after the last one), writes its own end token.
_NOT_A_TURN = ("no_think_close", "end_in_think", "token_hidden", "think_open_twice", "think_prefix_absent", "end=",
               "bytes=ids")


class ConversationsWriter(_JsonlWriter):
    name = "conversations.jsonl"
    #: what :meth:`skip` counts a row it leaves out under (the summary's ``skipped``)
    skip_key = "not_a_chat_turn"

    def skip(self, rec: ReconstructedRow) -> bool:
        """Whether the row cannot be a conversation whose final turn, re-rendered by the
        model's chat template, spells its ids: a cut turn (the template closes it: an end
        token where it writes one, and ``</think>`` when the cut fell in the reasoning), a
        turn with reasoning its ids never close (told by the segments, not only the
        ``reconstruction`` label: a row without it was exported with a ``</think>`` the model
        never wrote), or a reading the template cannot write (:data:`_NOT_A_TURN`). Trained from text, either
        teaches tokens the model never emitted; the id formats keep these rows. What a
        template does to the rest (GLM's final turn with no end token, whitespace a template
        strips, a prompt served in another reading) is the trainer's re-tokenizing, which
        the format never promised to be exact."""
        kinds = {seg["kind"] for seg in rec["segments"]}
        if "end" not in kinds:
            return True
        if rec["reasoning"] and "think_end" not in kinds:  # a template closes the reasoning it writes
            return True
        names = _reading_names(rec)
        if any(name.startswith(_NOT_A_TURN) for name in names):
            return True
        # arguments SGLang parsed to NaN or Infinity (Python's json reads them, and its dump
        # writes them back into the prompt): JSON Lines cannot hold them, a null is another prompt
        return "tool_args=parsed" in names and _holds_non_finite(_served_messages(rec))

    def row(self, rec: ReconstructedRow) -> dict[str, Any]:
        turns = [_turn(m) for m in _served_messages(rec)]
        final: dict[str, Any] = {"role": "assistant", "content": rec["content"]}
        if rec["reasoning"]:
            final["reasoning_content"] = rec["reasoning"]
        turns.append(final)
        out = {**metadata_of(rec), "conversations": turns}
        if rec["tools"]:
            tools = rec["tools"]
            if "tools=vllm" in _reading_names(rec):  # as vLLM's tool model handed them to the template
                from ..chat.serving import vllm_tools

                tools = vllm_tools({"tools": tools})[0] or tools
            # SpecForge parses a JSON string; the stdlib's spacing keeps earlier exports' bytes
            out["tools"] = json.dumps(tools, ensure_ascii=False)
        return out


def _served_messages(rec: ReconstructedRow) -> list[Any]:
    """The request's messages as the prompt reading the row was proved by has them: a
    trainer re-renders these, so a history SGLang handed its template otherwise (arguments
    parsed, a user's name dropped, a tool result's parts joined, a last assistant message made
    a user's; vLLM's parts joined with newlines; a folder's template's parts, :func:`_parts_served`)
    is written as it was served, not as sent.
    (SGLang's tool dump, ``tools=sglang``, is not redone here: the row does not keep
    ``tool_choice``, which it depends on.)"""
    messages = rec["messages"]
    names = _reading_names(rec)
    if not isinstance(messages, list) or not names & _SERVED_HISTORY:
        return messages if isinstance(messages, list) else []
    from ..chat.serving import sglang_history, sglang_last_assistant, vllm_history, vllm_postprocessed, vllm_reasoning

    messages = _parts_served(messages, names)  # first: SGLang flattens before it makes a last assistant a user
    if "tool_calls=vllm" in names:  # vLLM's tool-call post-processing ({} arguments, no empty list)
        messages = list((vllm_postprocessed({"messages": messages}) or {"messages": messages})["messages"])
    if "history=vllm" in names:  # Kimi's vLLM reading: its reasoning=vllm change included
        messages = next((list(v["messages"]) for v, _ in vllm_history({"messages": messages})), messages)
    elif "reasoning=vllm" in names:
        messages = next((list(v["messages"]) for v, _ in vllm_reasoning({"messages": messages})), messages)
    elif names & {"tool_args=parsed", "user_name=dropped", "tool_parts=space"}:
        # its last-assistant change only where the reading names it (the row keeps no continue_final_message)
        served = {"messages": messages, "continue_final_message": "last_assistant=user" not in names}
        messages = next((list(v["messages"]) for v, _ in sglang_history(served)), messages)
    if "last_assistant=user" in names:
        messages = sglang_last_assistant(messages) or messages
    return messages


def _parts_served(messages: list[Any], names: frozenset[str]) -> list[Any]:
    """Lists of parts as the engine that the row's reading names handed them to a folder's
    template (:mod:`tokenbridge.chat.parts`): joined with a space (SGLang) or a newline
    (vLLM); where vLLM kept them as parts, a tool result's joined with a newline (the rest
    are written as their text, :func:`_turn`, as the template joins them), and a system
    message's attribution line dropped as vLLM drops it. Kimi's vLLM reading
    (``history=vllm``) joins its own way."""
    from ..chat.parts import sglang_parts, vllm_parts, without_billing_header

    if "history=vllm" in names:
        return messages
    if "parts=space" in names:
        return sglang_parts(messages, "string")
    if names & {"tool_parts=newline", "parts=vllm"}:
        return vllm_parts(messages, "openai")
    if "parts=newline" in names:
        return vllm_parts(messages, "string")
    if "billing_header=dropped" in names:  # the attribution line alone: any lists are a template's that iterates them
        return [without_billing_header(m) or m for m in messages]
    return messages


def _holds_non_finite(value: Any) -> bool:
    """Whether a float that is NaN or infinite is anywhere in ``value`` (plain JSON values)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return True
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _reading_names(rec: ReconstructedRow) -> frozenset[str]:
    """The readings (prompt and completion) a row was proved by, from its ``reconstruction``."""
    return frozenset((rec["reconstruction"] or "").split("+"))


#: Prompt readings whose messages differ from the request's (:mod:`tokenbridge.chat.serving`).
_SERVED_HISTORY = frozenset({"tool_args=parsed", "user_name=dropped", "tool_parts=space", "history=vllm",
                             "reasoning=vllm", "last_assistant=user", "parts=space", "parts=newline",
                             "tool_parts=newline", "parts=vllm", "billing_header=dropped", "tool_calls=vllm"})


def _turn(message: Mapping[str, Any]) -> dict[str, Any]:
    """A request message in the ``{role, content, reasoning_content?, tool_calls?}`` shape."""
    turn: dict[str, Any] = {"role": message.get("role")}
    content = message.get("content")
    if is_text_parts(content):
        content = content_text(content)
    turn["content"] = "" if content is None else content
    # only the key the templates read: a ``reasoning`` (OpenRouter's name) reached no template
    # unless vLLM's reading proved it did (``reasoning=vllm``, which copied it above)
    reasoning = message.get("reasoning_content")
    if reasoning:
        turn["reasoning_content"] = reasoning
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key) is not None:
            turn[key] = message[key]
    return turn


_last_ids: tuple[list[int], np.ndarray] | None = None


def ids_array(row: ReconstructedRow) -> np.ndarray:
    """``row["input_ids"]`` as int64, converted once per row however many consumers of the
    pass (speculators, Parquet, the vocabulary) ask: the last row's array is kept, keyed by
    the list itself (held, so its identity cannot be reused)."""
    global _last_ids
    ids = row["input_ids"]
    if _last_ids is None or _last_ids[0] is not ids:
        _last_ids = (ids, np.frombuffer(array.array("q", ids), dtype=np.int64))
    return _last_ids[1]


class _ArrowBatches:
    """Rows buffered as Arrow-ready columns: the batch's ids as one flat int64 buffer, the
    mask as prompt lengths, the rest as records of the row schema."""

    def __init__(self, schema: Any, columns: tuple[str, ...]):
        import pyarrow as pa

        self._pa = pa
        self.schema = schema
        self.columns = columns  # the row columns taken through to_arrow_record
        self._ids_type = schema.field("input_ids").type.value_type
        self._mask_type = schema.field("loss_mask").type.value_type
        self._mask_dtype = _numpy_types()[self._mask_type]
        self._rest = pa.schema([f for f in schema if f.name not in ("input_ids", "loss_mask")])
        self._clear()

    def _clear(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.values: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.prompt: list[int] = []
        self.tokens = 0

    def add(self, rec: ReconstructedRow, **extra: Any) -> None:
        ids = ids_array(rec)
        self.values.append(ids)
        self.lengths.append(len(ids))
        self.prompt.append(len(rec["prompt_ids"]))
        self.tokens += len(ids)
        self.records.append({**to_arrow_record(rec, self.columns), **extra})

    def __len__(self) -> int:
        return len(self.records)

    def table(self) -> Any:
        """The buffered rows as one table (then the buffer is empty)."""
        pa = self._pa
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int32)
        np.cumsum(self.lengths, out=offsets[1:])
        mask = np.ones(self.tokens, dtype=self._mask_dtype)
        for start, n_prompt in zip(offsets.tolist(), self.prompt):  # [0] * P + [1] * C per row
            mask[start:start + n_prompt] = 0
        arrow_offsets = _from_numpy(pa, offsets, pa.int32())
        flat = np.concatenate(self.values) if self.values else np.zeros(0, dtype=np.int64)
        values = _from_numpy(pa, flat, pa.int64()).cast(self._ids_type)
        arrays = {
            "input_ids": pa.ListArray.from_arrays(arrow_offsets, values),
            "loss_mask": pa.ListArray.from_arrays(arrow_offsets, _from_numpy(pa, mask, self._mask_type)),
        }
        rest = pa.Table.from_pylist(self.records, schema=self._rest)
        columns = [arrays[f.name] if f.name in arrays else rest.column(f.name) for f in self.schema]
        self._clear()
        return pa.Table.from_arrays(columns, schema=self.schema)


def _from_numpy(pa: Any, arr: np.ndarray, type_: Any) -> Any:
    """A numpy array as an Arrow array over the same memory (no conversion, no copy)."""
    arr = np.ascontiguousarray(arr)
    return pa.Array.from_buffers(type_, len(arr), [None, pa.py_buffer(arr)])


def _numpy_types() -> dict[Any, Any]:
    import pyarrow as pa

    return {pa.int8(): np.int8, pa.int32(): np.int32, pa.int64(): np.int64}


class _HashingFile:
    """A write-only file that hashes what passes through (the shards' fingerprint,
    without reading them back)."""

    def __init__(self, path: Path, digest: Any):
        self._fh = open(path, "wb")  # noqa: SIM115 - the file object owns it until close()
        self._digest = digest
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._digest.update(view)
        return self._fh.write(view)

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
        self.closed = True

    @property
    def mode(self) -> str:
        return "wb"


class SpeculatorsWriter:
    """A ``datasets`` ``save_to_disk`` folder, written with pyarrow alone, in its final layout.

    Why not ``datasets`` itself: its ``set_format("torch")`` needs torch, and a plain
    install has neither. The folder is what ``save_to_disk`` lays out and
    ``datasets.load_from_disk`` (speculators' ``ArrowDataset``) reads: Arrow IPC stream
    shards ``data-XXXXX-of-YYYYY.arrow``, ``dataset_info.json`` (features left to be read
    from the Arrow schema, which every ``datasets`` version can do) and ``state.json``
    naming the shards and the torch format ``ArrowDataset`` relies on (``input_ids`` /
    ``loss_mask`` / ``seq_len`` as tensors). Each shard is written once, where it stays
    (its name gets the shard count by a rename at the end, no copy), and hashed as it is
    written; memory holds one record batch (``row_group_rows`` rows, at most
    ~``_BATCH_TOKENS`` ids). A shard closes past ~``shard_bytes`` of ids.
    """

    _COLUMNS = ("input_ids", "loss_mask", "seq_len", *META_COLUMNS)

    def __init__(self, shard_bytes: int = 500 << 20, row_group_rows: int = _ROW_GROUP_ROWS, **_: Any):
        import pyarrow as pa

        self._pa = pa
        self.shard_bytes, self.row_group_rows = shard_bytes, row_group_rows
        self.schema = pa.schema(
            arrow_fields(("input_ids", "loss_mask"), input_ids=pa.list_(pa.int64()), loss_mask=pa.list_(pa.int64()))
            + [pa.field("seq_len", pa.int64())]
            + arrow_fields(META_COLUMNS)
        )
        self.out_dir: Path | None = None
        self._batch = _ArrowBatches(self.schema, META_COLUMNS)
        self._shards: list[Path] = []
        self._digest = hashlib.blake2b(digest_size=8)
        self._file: _HashingFile | None = None
        self._writer: Any = None
        self._bytes = 0
        self.rows = 0

    def open(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def write(self, row: ReconstructedRow) -> None:
        self._batch.add(row, seq_len=len(row["input_ids"]))
        self._bytes += 16 * len(row["input_ids"])
        if len(self._batch) >= self.row_group_rows or self._batch.tokens >= _BATCH_TOKENS:
            self._flush()
        if self._bytes >= self.shard_bytes:
            self._end_shard()

    def _flush(self) -> None:
        if not len(self._batch):
            return
        assert self.out_dir is not None
        if self._writer is None:
            path = self.out_dir / f"shard-{len(self._shards):05d}.arrow"
            self._shards.append(path)
            self._file = _HashingFile(path, self._digest)
            self._writer = self._pa.ipc.new_stream(self._file, self.schema)
        self.rows += len(self._batch)
        self._writer.write_table(self._batch.table())

    def _end_shard(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            assert self._file is not None
            self._file.close()
            self._writer = self._file = None
        self._bytes = 0

    def close(self) -> list[Path]:
        self._end_shard()
        assert self.out_dir is not None
        n = len(self._shards)
        names = [f"data-{k:05d}-of-{n:05d}.arrow" for k in range(n)]
        for path, name in zip(self._shards, names):
            path.rename(self.out_dir / name)
        state = {
            "_data_files": [{"filename": name} for name in names],
            "_fingerprint": self._digest.hexdigest(),  # 16 hex digits over the shards' bytes, as datasets' own
            "_format_columns": ["input_ids", "loss_mask", "seq_len"],
            "_format_kwargs": {},
            "_format_type": "torch",
            "_output_all_columns": True,
            "_split": None,
        }
        info = {"citation": "", "description": "", "homepage": "", "license": ""}
        (self.out_dir / "state.json").write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        (self.out_dir / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        return [self.out_dir / name for name in names] + [self.out_dir / "dataset_info.json", self.out_dir / "state.json"]

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()


class ParquetWriter:
    """Sharded Parquet: a new shard past ``shard_rows`` rows or ~``shard_bytes`` of ids."""

    _ROW_COLUMNS = (*META_COLUMNS, "finish_reason", "thinking", "segments", "usage", "messages", "tools",
                    "reasoning", "content", "reconstruction")

    #: Columns with few distinct values; dictionary pages on ids and text only cost time and space.
    _DICTIONARY = ["dataset", "provider", "model", "status", "finish_reason", "reconstruction"]

    def __init__(self, shard_rows: int = 200_000, shard_bytes: int = 256 << 20,
                 row_group_rows: int = _ROW_GROUP_ROWS, **_: Any):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa, self._pq = pa, pq
        self.schema = pa.schema(
            arrow_fields(("input_ids", "loss_mask"))
            + [pa.field("num_prompt_tokens", pa.int32()), pa.field("num_completion_tokens", pa.int32())]
            + arrow_fields(self._ROW_COLUMNS)
        )
        self.shard_rows, self.shard_bytes, self.row_group_rows = shard_rows, shard_bytes, row_group_rows
        self.data_dir: Path | None = None
        self._batch = _ArrowBatches(self.schema, self._ROW_COLUMNS)
        self._shards: list[Path] = []
        self._writer: Any = None
        self._file: Any = None
        self._shard_rows = self._shard_bytes = 0

    def open(self, out_dir: Path) -> None:
        self.data_dir = out_dir / "data"
        self.data_dir.mkdir()

    def write(self, row: ReconstructedRow) -> None:
        n_prompt = len(row["prompt_ids"])
        self._batch.add(row, num_prompt_tokens=n_prompt, num_completion_tokens=len(row["input_ids"]) - n_prompt)
        self._shard_rows += 1
        self._shard_bytes += 5 * len(row["input_ids"]) + len(row["reasoning"]) + len(row["content"])
        if len(self._batch) >= self.row_group_rows or self._batch.tokens >= _BATCH_TOKENS:
            self._flush()
        if self._shard_rows >= self.shard_rows or self._shard_bytes >= self.shard_bytes:
            self._end_shard()

    def _flush(self) -> None:
        if not len(self._batch):
            return
        assert self.data_dir is not None
        if self._writer is None:
            path = self.data_dir / f"shard-{len(self._shards):05d}.parquet"
            self._shards.append(path)
            # a file object, not the path: pyarrow takes a path as UTF-8, and a folder's name need not be
            self._file = open(path, "xb")  # noqa: SIM115 - closed with the shard (_end_shard, abort)
            self._writer = self._pq.ParquetWriter(self._file, self.schema, compression="zstd",
                                                  use_dictionary=self._DICTIONARY)
        self._writer.write_table(self._batch.table(), row_group_size=self.row_group_rows)

    def _end_shard(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None
        self._shard_rows = self._shard_bytes = 0

    def close(self) -> list[Path]:
        self._end_shard()
        assert self.data_dir is not None
        final = []
        for k, path in enumerate(self._shards):
            target = self.data_dir / f"train-{k:05d}-of-{len(self._shards):05d}.parquet"
            path.rename(target)
            final.append(target)
        return final

    def abort(self) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            if self._file is not None:
                self._file.close()


WRITERS: dict[str, type[Writer]] = {
    "specforge": SpecForgeWriter,
    "speculators": SpeculatorsWriter,
    "parquet": ParquetWriter,
    "conversations": ConversationsWriter,
}

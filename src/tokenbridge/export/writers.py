"""One incremental writer per export format; each holds at most one batch of rows.

* ``specforge``: ``train.jsonl``, one ``{input_ids, loss_mask, ...metadata}`` object a
  line: SpecForge's ``data.prompts_path`` pre-tokenized fast path (it reads only those
  two keys and ignores the rest).
* ``conversations``: ``conversations.jsonl``, ``{id, conversations: [{role, content,
  reasoning_content?, tool_calls?, ...}], tools?, ...metadata}``: for trainers that
  re-tokenize with their own chat template (SpecForge raw data, speculators
  ``prepare-data``). Re-tokenizing is *not* guaranteed to reproduce our ids.
* ``speculators``: a ``datasets`` ``save_to_disk`` folder (written with pyarrow alone,
  no ``datasets`` or torch needed) with ``input_ids`` / ``loss_mask`` (int64, as
  speculators' own ``prepare-data`` writes them), ``seq_len`` (which its ``ArrowDataset``
  needs for length bucketing), torch format on those three.
* ``parquet``: ``data/train-XXXXX-of-YYYYY.parquet`` shards (bounded rows and bytes,
  bounded row groups) with every field, plus a dataset card.

Every row carries ``id, choice, dataset, provider, model, status, findings``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..fsio import dumps_line

__all__ = ["WRITERS", "metadata_of"]

_ROW_GROUP_ROWS = 1000
_FINDING_KEYS = ("code", "severity", "message")


def metadata_of(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance every exported row carries."""
    return {
        "id": rec.get("id"),
        "choice": rec.get("choice", 0),
        "dataset": rec.get("dataset"),
        "provider": rec.get("provider"),
        "model": rec.get("model"),
        "status": rec.get("status"),
        "findings": list(rec.get("findings") or []),
    }


class _JsonlWriter:
    name = ""

    def __init__(self, out_dir: Path, **_: Any):
        self.path = out_dir / self.name
        self._fh = open(self.path, "wb")

    def row(self, rec: Mapping[str, Any], ids: list[int], mask: list[int]) -> dict[str, Any]:
        raise NotImplementedError

    def add(self, rec: Mapping[str, Any], ids: list[int], mask: list[int]) -> None:
        self._fh.write(dumps_line(self.row(rec, ids, mask)))
        self._fh.write(b"\n")

    def close(self) -> list[Path]:
        self._fh.close()
        return [self.path]


class SpecForgeWriter(_JsonlWriter):
    name = "train.jsonl"

    def row(self, rec, ids, mask):
        return {"input_ids": ids, "loss_mask": mask, **metadata_of(rec)}


class ConversationsWriter(_JsonlWriter):
    name = "conversations.jsonl"

    def row(self, rec, ids, mask):
        turns = [_turn(m) for m in rec.get("messages") or []]
        final: dict[str, Any] = {"role": "assistant", "content": rec.get("content") or ""}
        if rec.get("reasoning"):
            final["reasoning_content"] = rec["reasoning"]
        if rec.get("tool_calls"):
            final["tool_calls"] = rec["tool_calls"]
        turns.append(final)
        out = {**metadata_of(rec), "conversations": turns}
        if rec.get("tools"):
            out["tools"] = json.dumps(rec["tools"], ensure_ascii=False)  # SpecForge parses a JSON string
        return out


def _turn(message: Mapping[str, Any]) -> dict[str, Any]:
    """A request message in the ``{role, content, reasoning_content?, tool_calls?}`` shape."""
    turn: dict[str, Any] = {"role": message.get("role")}
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    turn["content"] = "" if content is None else content
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if reasoning:
        turn["reasoning_content"] = reasoning
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key) is not None:
            turn[key] = message[key]
    return turn


def _arrow_findings(findings: list[Any]) -> list[dict[str, str | None]]:
    return [{k: (None if f.get(k) is None else str(f.get(k))) for k in _FINDING_KEYS} for f in findings if isinstance(f, Mapping)]


def _meta_schema_fields(pa) -> list:
    finding = pa.struct([(k, pa.string()) for k in _FINDING_KEYS])
    return [
        ("id", pa.string()), ("choice", pa.int64()), ("dataset", pa.string()), ("provider", pa.string()),
        ("model", pa.string()), ("status", pa.string()), ("findings", pa.list_(finding)),
    ]


def _arrow_meta(rec: Mapping[str, Any]) -> dict[str, Any]:
    meta = metadata_of(rec)
    meta["findings"] = _arrow_findings(meta["findings"])
    for key in ("id", "dataset", "provider", "model"):
        if meta[key] is not None:
            meta[key] = str(meta[key])
    return meta


class SpeculatorsWriter:
    """A ``datasets`` ``save_to_disk`` folder, written with pyarrow alone.

    Why not ``datasets`` itself: its ``set_format("torch")`` needs torch, and a plain
    install has neither. The folder is what ``save_to_disk`` lays out: Arrow IPC stream
    shards ``data-XXXXX-of-YYYYY.arrow``, ``dataset_info.json`` (features left to be read
    from the Arrow schema, which every ``datasets`` version can do) and ``state.json``
    naming the shards and the torch format speculators' ``ArrowDataset`` relies on
    (``input_ids`` / ``loss_mask`` / ``seq_len`` as tensors). Rows are streamed, so memory
    stays flat; a shard closes past ~``shard_bytes`` of ids.
    """

    def __init__(self, out_dir: Path, shard_bytes: int = 500 << 20, **_: Any):
        import pyarrow as pa

        self._pa = pa
        self.out_dir = out_dir
        self.shard_bytes = shard_bytes
        self.schema = pa.schema(
            [("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())]
            + _meta_schema_fields(pa)
        )
        self._shards: list[Path] = []
        self._sink: Any = None
        self._writer: Any = None
        self._bytes = 0
        self._buf: list[dict] = []
        self.rows = 0

    def add(self, rec, ids, mask) -> None:
        self._buf.append({"input_ids": ids, "loss_mask": mask, "seq_len": len(ids), **_arrow_meta(rec)})
        self._bytes += 16 * len(ids)
        if len(self._buf) >= _ROW_GROUP_ROWS:
            self._flush()
        if self._bytes >= self.shard_bytes:
            self._end_shard()

    def _flush(self) -> None:
        if not self._buf:
            return
        if self._writer is None:
            path = self.out_dir / f"shard-{len(self._shards):05d}.arrow"
            self._shards.append(path)
            self._sink = self._pa.OSFile(str(path), "wb")
            self._writer = self._pa.ipc.new_stream(self._sink, self.schema)
        self._writer.write_table(self._pa.Table.from_pylist(self._buf, schema=self.schema))
        self.rows += len(self._buf)
        self._buf = []

    def _end_shard(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None
        self._bytes = 0

    def close(self) -> list[Path]:
        self._end_shard()
        n = len(self._shards)
        names = [f"data-{k:05d}-of-{n:05d}.arrow" for k in range(n)]
        for path, name in zip(self._shards, names):
            path.rename(self.out_dir / name)
        state = {
            "_data_files": [{"filename": name} for name in names],
            "_fingerprint": _fingerprint(self.out_dir / name for name in names),
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
            self._sink.close()


def _fingerprint(paths: Iterable[Path]) -> str:
    """16 hex digits over the shards' bytes, the form ``datasets`` uses for its fingerprints."""
    h = hashlib.blake2b(digest_size=8)
    for path in paths:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


class ParquetWriter:
    """Sharded Parquet: a new shard past ``shard_rows`` rows or ~``shard_bytes`` of ids."""

    def __init__(self, out_dir: Path, shard_rows: int = 200_000, shard_bytes: int = 256 << 20,
                 row_group_rows: int = _ROW_GROUP_ROWS, **_: Any):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa, self._pq = pa, pq
        self.data_dir = out_dir / "data"
        self.data_dir.mkdir()
        ids = pa.list_(pa.int32())
        seg = pa.struct([("kind", pa.string()), ("start", pa.int32()), ("end", pa.int32())])
        self.schema = pa.schema(
            [("input_ids", ids), ("loss_mask", pa.list_(pa.int8())), ("num_prompt_tokens", pa.int32()),
             ("num_completion_tokens", pa.int32())]
            + _meta_schema_fields(pa)
            + [("finish_reason", pa.string()), ("thinking", pa.bool_()), ("segments", pa.list_(seg)),
               ("usage", pa.string()), ("messages", pa.string()), ("reasoning", pa.string()), ("content", pa.string())]
        )
        self.shard_rows, self.shard_bytes, self.row_group_rows = shard_rows, shard_bytes, row_group_rows
        self._shards: list[Path] = []
        self._writer = None
        self._shard_rows = self._shard_bytes = 0
        self._buf: list[dict] = []

    def add(self, rec, ids, mask) -> None:
        n_prompt = mask.index(1)
        usage, messages = rec.get("usage"), rec.get("messages")
        self._buf.append({
            "input_ids": ids, "loss_mask": mask, "num_prompt_tokens": n_prompt,
            "num_completion_tokens": len(ids) - n_prompt, **_arrow_meta(rec),
            "finish_reason": rec.get("finish_reason"), "thinking": rec.get("thinking"),
            "segments": rec.get("segments"),
            "usage": None if usage is None else json.dumps(usage, ensure_ascii=False),
            "messages": None if messages is None else json.dumps(messages, ensure_ascii=False),
            "reasoning": rec.get("reasoning"), "content": rec.get("content"),
        })
        self._shard_rows += 1
        self._shard_bytes += 5 * len(ids) + len(rec.get("reasoning") or "") + len(rec.get("content") or "")
        if len(self._buf) >= self.row_group_rows:
            self._flush()
        if self._shard_rows >= self.shard_rows or self._shard_bytes >= self.shard_bytes:
            self._end_shard()

    def _flush(self) -> None:
        if not self._buf:
            return
        if self._writer is None:
            path = self.data_dir / f"shard-{len(self._shards):05d}.parquet"
            self._shards.append(path)
            self._writer = self._pq.ParquetWriter(path, self.schema, compression="zstd")
        table = self._pa.Table.from_pylist(self._buf, schema=self.schema)
        self._writer.write_table(table, row_group_size=self.row_group_rows)
        self._buf = []

    def _end_shard(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._shard_rows = self._shard_bytes = 0

    def close(self) -> list[Path]:
        self._end_shard()
        final = []
        for k, path in enumerate(self._shards):
            target = self.data_dir / f"train-{k:05d}-of-{len(self._shards):05d}.parquet"
            path.rename(target)
            final.append(target)
        return final


WRITERS = {
    "specforge": SpecForgeWriter,
    "speculators": SpeculatorsWriter,
    "parquet": ParquetWriter,
    "conversations": ConversationsWriter,
}

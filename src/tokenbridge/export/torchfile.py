"""Write ``torch.save`` files without torch: numpy arrays, ints and strings in dicts.

Why: SpecForge reads the draft vocabulary only as ``vocab_mapping.pt`` (``torch.load``),
and a plain ``pip install tokenbridge`` must not pull torch (about 1 GB) to write two
small tensors. The format is torch's zip archive (version 3): ``data.pkl`` is a protocol-2
pickle whose tensors are ``torch._utils._rebuild_tensor_v2`` calls on persistent
``('storage', torch.<Type>Storage, key, 'cpu', numel)`` ids, and ``data/<key>`` holds each
storage's little-endian bytes, stored uncompressed and 64-byte aligned as torch writes
them. Only globals that ``torch.load(weights_only=True)`` allows are emitted.
tests/test_trainers.py loads these files with torch and with SpecForge's own loader.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from pathlib import Path
from typing import TypeAlias
from collections.abc import Mapping

import numpy as np

__all__ = ["TorchValue", "save"]

TorchValue: TypeAlias = int | str | bool | np.ndarray | Mapping[int | str, "TorchValue"]

#: numpy dtype -> torch's legacy typed-storage class name (what torch.save pickles).
_STORAGES: dict[np.dtype, str] = {
    np.dtype(np.int64): "LongStorage",
    np.dtype(np.int32): "IntStorage",
    np.dtype(np.int16): "ShortStorage",
    np.dtype(np.int8): "CharStorage",
    np.dtype(np.uint8): "ByteStorage",
    np.dtype(np.bool_): "BoolStorage",
    np.dtype(np.float64): "DoubleStorage",
    np.dtype(np.float32): "FloatStorage",
}
_ALIGN = 64
_PREFIX = "archive"
_BATCH = 1000  # SETITEMS batch, as pickle itself emits


class _Pickler:
    """Just the protocol-2 opcodes torch.save's output uses (no memo: nothing repeats)."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.storages: list[np.ndarray] = []

    def dump(self, obj: TorchValue) -> bytes:
        self.out.write(b"\x80\x02")  # PROTO 2
        self._value(obj)
        self.out.write(b".")  # STOP
        return self.out.getvalue()

    def _value(self, obj: TorchValue) -> None:
        w = self.out.write
        if isinstance(obj, bool):
            w(b"\x88" if obj else b"\x89")  # NEWTRUE / NEWFALSE
        elif isinstance(obj, (int, np.integer)):
            self._int(int(obj))
        elif isinstance(obj, str):
            data = obj.encode("utf-8")
            w(b"X" + struct.pack("<I", len(data)) + data)  # BINUNICODE
        elif isinstance(obj, np.ndarray):
            self._tensor(obj)
        elif isinstance(obj, Mapping):
            w(b"}")  # EMPTY_DICT
            items = list(obj.items())
            for start in range(0, len(items), _BATCH):
                w(b"(")  # MARK
                for key, value in items[start:start + _BATCH]:
                    self._value(key)
                    self._value(value)
                w(b"u")  # SETITEMS
        else:
            raise TypeError(f"torchfile cannot write a {type(obj).__name__}")

    def _int(self, n: int) -> None:
        if 0 <= n < 1 << 8:
            self.out.write(b"K" + struct.pack("<B", n))  # BININT1
        elif 0 <= n < 1 << 16:
            self.out.write(b"M" + struct.pack("<H", n))  # BININT2
        elif -(1 << 31) <= n < 1 << 31:
            self.out.write(b"J" + struct.pack("<i", n))  # BININT
        else:
            data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
            self.out.write(b"\x8a" + struct.pack("<B", len(data)) + data)  # LONG1

    def _tuple(self, values: tuple[TorchValue, ...]) -> None:
        self.out.write(b"(")
        for v in values:
            self._value(v)
        self.out.write(b"t")  # TUPLE

    def _tensor(self, arr: np.ndarray) -> None:
        storage = _STORAGES.get(arr.dtype)
        if storage is None:
            raise TypeError(f"torchfile cannot write a {arr.dtype} array")
        arr = np.ascontiguousarray(arr)
        key = str(len(self.storages))
        self.storages.append(arr)
        strides = tuple(s // arr.itemsize for s in arr.strides)
        w = self.out.write
        w(b"ctorch._utils\n_rebuild_tensor_v2\n")
        w(b"(")  # the call's argument tuple
        w(b"(")  # the persistent id
        self._value("storage")
        w(f"ctorch\n{storage}\n".encode())
        self._value(key)
        self._value("cpu")
        self._int(arr.size)
        w(b"tQ")  # TUPLE, BINPERSID
        self._int(0)  # storage offset
        self._tuple(tuple(int(n) for n in arr.shape))
        self._tuple(strides)
        w(b"\x89")  # requires_grad = False
        w(b"ccollections\nOrderedDict\n)R")  # backward hooks: OrderedDict()
        w(b"tR")  # TUPLE, REDUCE


def save(obj: TorchValue, path: str | Path) -> None:
    """Write ``obj`` as ``torch.save(obj_with_tensors, path)`` would (arrays become CPU tensors)."""
    pickler = _Pickler()
    pkl = pickler.dump(obj)
    records: list[tuple[str, bytes]] = [
        ("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", str(_ALIGN).encode()),
        ("byteorder", b"little"),
    ]
    records += [(f"data/{k}", arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
                for k, arr in enumerate(pickler.storages)]
    records += [("version", b"3\n")]
    with open(path, "wb") as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED) as zf:
        for name, data in records:
            info = zipfile.ZipInfo(f"{_PREFIX}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            if name.startswith("data/"):
                info.extra = _padding(fh.tell(), len(info.filename))
            zf.writestr(info, data)
        fh.flush()
        os.fsync(fh.fileno())


def _padding(offset: int, name_len: int) -> bytes:
    """A zip extra field that puts the record's data on a 64-byte boundary (torch mmaps it)."""
    start = offset + 30 + name_len + 4  # local header, name, then the extra field's own header
    pad = -start % _ALIGN
    return struct.pack("<HH", 0x4246, pad) + b"Z" * pad

"""torch.save's file format written forward only, record by record, so that a storage can
be filled as its bytes arrive and no whole tensor is ever held (issue 29: SpecForge files).

The format is torch's zip archive (torch/serialization.py `_save`): `<archive>/data.pkl`
(the object, its storages pickled as persistent ids), `.format_version`,
`.storage_alignment`, `byteorder`, one `data/<key>` record per storage, then `version` and
`.data/serialization_id`. Records are stored uncompressed with their data 64-byte aligned
(torch pads the local header's extra field; `torch.load(mmap=True)` maps them in place).

Python's `zipfile` writes it: given a file object that cannot seek, it puts each record's
CRC and sizes in a data descriptor after the data, and uses zip64 where a size or offset
needs it, so the archive goes out front to back in one pass.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64  # torch.serialization._get_storage_alignment()
_PAD_FIELD = 0x4246  # b"FB": the extra field torch's writer pads local headers with
_LOCAL_HEADER = 30  # zipfile.sizeFileHeader
_ZIP64_EXTRA = 20  # zipfile's zip64 field in a local header: <HHQQ
_DATE = (1980, 1, 1, 0, 0, 0)  # no time in the file: the same sample gives the same bytes
_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL


@dataclass(frozen=True)
class StorageRef:
    """A storage of the archive (record `data/<key>`) of `numel` elements of `dtype`."""

    key: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class TensorRef:
    """A tensor over a StorageRef; pickles as torch's own tensors do (`_rebuild_tensor_v2`),
    which `torch.load(weights_only=True)` accepts."""

    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # fresh tuples, as a tensor's are: the pickle memoizes shared ones (torch's bytes differ)
        size, stride = tuple(int(n) for n in self.size), tuple(int(n) for n in self.stride)
        return (torch._utils._rebuild_tensor_v2, (self.storage, self.offset, size, stride, False, collections.OrderedDict()))


def _storage_type(dtype: torch.dtype) -> type:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):  # the tuple torch's _save returns for a typed storage
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None


def pickle_object(obj: Any) -> bytes:
    """`data.pkl` of `obj`, whose tensors are TensorRefs."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=_PROTOCOL).dump(obj)
    return buf.getvalue()


class _ForwardOnly:
    """The file object zipfile writes to: `write` and `tell`, no `seek` (so zipfile writes
    data descriptors instead of going back to patch headers)."""

    def __init__(self, write: Callable[[Any], Any]) -> None:
        self._write: Callable[[Any], Any] | None = write
        self.pos = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self._write is None:  # abandoned: zipfile's finalizers write nothing more
            return n
        self._write(data)
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


class RecordWriter:
    """One record being written: exactly `size` bytes, in any number of `write`s."""

    def __init__(self, handle: Any, name: str, size: int) -> None:
        self._handle, self.name, self.size, self.written = handle, name, size, 0

    def write(self, data: Any) -> None:
        n = memoryview(data).nbytes
        if self.written + n > self.size:
            raise ValueError(f"record {self.name}: {self.written + n} bytes written, {self.size} declared")
        self._handle.write(data)
        self.written += n

    def close(self) -> None:
        if self.written != self.size:
            raise ValueError(f"record {self.name}: {self.written} bytes written, {self.size} declared")
        self._handle.close()


class TorchZipWriter:
    """A torch.save archive through `write(buffer)`, front to back. Usage: `record` the
    pickle and the small records, `open_record` a storage and write it in pieces, then
    `close` (the end records and the zip's central directory). `force_zip64`: every record
    with zip64 fields (tests reach that path without 4 GiB of data)."""

    def __init__(self, write: Callable[[Any], Any], archive: str = "archive", force_zip64: bool = False) -> None:
        self._out = _ForwardOnly(write)
        self._zip = zipfile.ZipFile(self._out, "w", zipfile.ZIP_STORED, allowZip64=True)
        self.archive = archive
        self._force_zip64 = force_zip64

    def begin(self, pickled: bytes) -> None:
        """The records before the storages, as torch writes them."""
        self.record("data.pkl", pickled)
        self.record(".format_version", b"1")
        self.record(".storage_alignment", str(ALIGN).encode())
        self.record("byteorder", b"little")  # the states come little-endian over the wire

    def open_record(self, name: str, size: int) -> RecordWriter:
        zinfo = zipfile.ZipInfo(f"{self.archive}/{name}", date_time=_DATE)
        zinfo.compress_type = zipfile.ZIP_STORED
        zinfo.file_size = size  # zipfile decides zip64 from it, as below
        zip64 = self._force_zip64 or size * 1.05 > zipfile.ZIP64_LIMIT
        fixed = _LOCAL_HEADER + len(zinfo.filename.encode()) + (_ZIP64_EXTRA if zip64 else 0) + 4
        pad = -(self._out.pos + fixed) % ALIGN
        zinfo.extra = struct.pack("<HH", _PAD_FIELD, pad) + b"Z" * pad
        handle = self._zip.open(zinfo, "w", force_zip64=self._force_zip64)
        if self._out.pos % ALIGN:  # zipfile's header is not the size counted above
            raise AssertionError(f"record {name} starts at {self._out.pos}, not {ALIGN}-byte aligned")
        return RecordWriter(handle, name, size)

    def record(self, name: str, data: Any) -> None:
        w = self.open_record(name, memoryview(data).nbytes)
        w.write(data)
        w.close()

    def close(self) -> None:
        self.record("version", b"3\n")
        # torch's id: a hash of the record names, then of their CRCs, 20 digits each
        names = zlib.crc32("".join(i.filename for i in self._zip.infolist()).encode())
        crcs = zlib.crc32(b"".join(struct.pack("<I", i.CRC) for i in self._zip.infolist()))
        self.record(".data/serialization_id", f"{names:020d}{crcs:020d}".encode())
        self._zip.close()

    def abandon(self) -> None:
        """Give up the archive (its file is being removed): nothing more is written, not
        even by zipfile's own finalizers of an open record."""
        self._out._write = None
        self._zip.fp = None  # ZipFile.close (and __del__) then returns at once

"""The wire body (hsx/wire.py's safetensors file: hidden_states first, token-major, then
token_ids and loss_mask) parsed as its bytes arrive, so that an HTTP sample stream hands
the states on in chunks of whole tokens without ever holding the sample."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from hsx import dtypes
from hsx_client.sample_stream import (
    DEFAULT_CHUNK_BYTES, SampleHead, StatesChunk, StatesLayout, StreamError, torch_dtype,
)


class BodyParser:
    """The wire body (hsx/wire.py's safetensors file) parsed as its bytes arrive, in pieces
    cut anywhere: `feed(data)` yields the states in chunks of whole tokens (at most
    `chunk_bytes`, at least one token), copied once into one reused buffer; `finish()`
    checks that the body ended where its header says and returns the head.

    Memory: the header, one chunk buffer and the tail (token ids and mask, 9 bytes a token)."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.layout: StatesLayout | None = None
        self._prefix = bytearray()  # the header while it arrives
        self._header: dict[str, Any] | None = None
        self._states_total = 0
        self._states_seen = 0
        self._rows_done = 0
        self._buf: bytearray | None = None
        self._fill = 0
        self._tail = bytearray()  # token_ids and loss_mask
        self._tail_total = 0

    @property
    def body_bytes(self) -> int:
        return len(self._prefix) + self._states_seen + len(self._tail)

    @property
    def states_done(self) -> bool:
        return self._header is not None and self._states_seen == self._states_total

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[StatesChunk]:
        view = memoryview(data).cast("B")
        if self._header is None:
            view = self.feed_header(view)
            if self._header is None:
                return
        while view.nbytes and self._states_seen < self._states_total:
            assert self._buf is not None
            take = min(view.nbytes, len(self._buf) - self._fill, self._states_total - self._states_seen)
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            self._states_seen += take
            view = view[take:]
            if self._fill == len(self._buf) or self._states_seen == self._states_total:
                yield self._flush()
        if view.nbytes:
            if len(self._tail) + view.nbytes > self._tail_total:
                raise StreamError(f"body runs past the {self._states_total + self._tail_total} data bytes "
                                  "its header describes")
            self._tail += view

    def _flush(self) -> StatesChunk:
        assert self.layout is not None and self._buf is not None
        row = self.layout.row_bytes
        rows = self._fill // row
        chunk = StatesChunk(self._rows_done, self._rows_done + rows, memoryview(self._buf)[: self._fill])
        self._rows_done += rows
        self._fill = 0
        return chunk

    def feed_header(self, view: memoryview) -> memoryview:
        """Takes the header's bytes from `view`; returns what follows them."""
        if self._header is not None:
            return view
        need = 8 if len(self._prefix) < 8 else 8 + struct.unpack("<Q", self._prefix[:8])[0]
        while True:
            take = min(view.nbytes, need - len(self._prefix))
            self._prefix += view[:take]
            view = view[take:]
            if len(self._prefix) < need:
                return view
            if need == 8:
                (n,) = struct.unpack("<Q", self._prefix[:8])
                if n > 100 << 20:
                    raise StreamError(f"safetensors header of {n} bytes: not an hsx body")
                need = 8 + n
                continue
            self._start(bytes(self._prefix[8:]))
            return view

    def _start(self, raw_header: bytes) -> None:
        try:
            header = json.loads(raw_header)
        except ValueError as exc:
            raise StreamError(f"safetensors header is not JSON: {exc}") from exc
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        hs = entries.get("hidden_states")
        if hs is None or "token_ids" not in entries:
            raise StreamError("response lacks the hidden_states or token_ids tensor")
        if hs["data_offsets"][0] != 0 or any(v["data_offsets"][0] < hs["data_offsets"][1]
                                             for k, v in entries.items() if k != "hidden_states"):
            raise StreamError("hidden_states is not first in the body: it cannot be streamed")
        shape = tuple(int(d) for d in hs["shape"])
        if len(shape) != 3:
            raise StreamError(f"hidden_states has shape {shape}, not [T, L, H]")
        layout = StatesLayout(torch_dtype(hs["dtype"]), shape, header.get("__metadata__", {}))
        total = hs["data_offsets"][1]
        if total != layout.nbytes:
            raise StreamError(f"hidden_states: {total} bytes for shape {shape}")
        end = max(v["data_offsets"][1] for v in entries.values())
        self._header, self.layout = header, layout
        self._states_total, self._tail_total = total, end - total
        rows = max(1, self.chunk_bytes // max(1, layout.row_bytes))
        self._buf = bytearray(min(total, rows * layout.row_bytes)) if total else bytearray()

    def finish(self) -> SampleHead:
        """The head, once the whole body went through `feed`; StreamError when it is short."""
        if self._header is None or not self.states_done or len(self._tail) != self._tail_total:
            got = len(self._prefix) + self._states_seen + len(self._tail)
            raise StreamError(f"body ended after {got} bytes, before its header's end (truncated?)")
        assert self.layout is not None
        tensors = {}
        for name in ("token_ids", "loss_mask", "media_mask"):
            e = self._header.get(name)
            if e is None:
                continue
            lo, hi = (o - self._states_total for o in e["data_offsets"])
            dt = dtypes.BY_ST.get(e["dtype"])
            if dt is None:
                raise StreamError(f"tensor {name!r} has unsupported dtype {e['dtype']!r}")
            arr = np.frombuffer(self._tail, dtype=np.dtype(dt.name if dt.name != "bfloat16" else "u2"),
                                count=(hi - lo) // dt.itemsize, offset=lo)
            tensors[name] = arr.reshape([int(d) for d in e["shape"]])
        ids, mask = tensors["token_ids"], tensors.get("loss_mask")
        t = self.layout.shape[0]
        if ids.shape != (t,) or (mask is not None and mask.shape != (t,)):
            raise StreamError(f"token_ids {ids.shape} / loss_mask do not match {t} tokens of states")
        media = tensors.get("media_mask")
        if media is not None and media.shape != (t,):
            raise StreamError(f"media_mask {media.shape} does not match {t} tokens of states")
        return SampleHead(ids, mask, self.layout.metadata, self.layout.dtype, self.layout.shape, media)

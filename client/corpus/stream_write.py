"""One sample stored as its states arrive (issue 29): a `SampleStream` consumed straight
into the sample's file, never held whole.

The file is a `store.StreamedFile` (a temporary name, hashed in file order, fsync'ed,
renamed), by the format's `stream_open` sample writer: its first bytes (from the stream's
layout), each states chunk as it comes (through the format's `stream_chunk`: SpecForge
applies the final norm there), then its last bytes (from the head: over HTTP the token ids
arrive after the states). A crash or any error on the way leaves
no file under the final name; the temporary one is removed here, or by the next run's
`store.clean_temp_files` after a SIGKILL. The manifest entry is the caller's (run.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx_client.corpus import store
from hsx_client.corpus.formats.common import CorpusFormatError, drop_reason
from hsx_client.sample_stream import SampleHead, states_layout


class StreamDropped(Exception):
    """The sample has nothing to train on (its mask, known once the states are through)."""


@dataclass
class StreamStored:
    files: dict[str, dict[str, Any]]  # rel -> {"size", HASH_ALGO}, as write_files_atomic returns
    record: dict[str, Any]
    head: SampleHead


async def store_stream(out: Path, fmt: Any, index: int, stream: Any, ctx: Any,
                       blocking: Callable[..., Awaitable[Any]]) -> StreamStored:
    """Write `stream`'s sample to `out` in `fmt`; `blocking(fn, *args)` runs file work off
    the event loop (a pool thread). Raises CorpusFormatError (the format refuses it),
    StreamDropped, the stream's own errors (transport, malformed body), OSError."""
    layout = await states_layout(stream)
    sample = fmt.stream_open(index, layout, ctx)
    f = await blocking(store.StreamedFile, out, sample.rel)
    try:
        await blocking(sample.begin, f.write)
        expected = 0
        async for c in stream.chunks():
            if c.start != expected or c.stop <= c.start or c.data.nbytes != (c.stop - c.start) * layout.row_bytes:
                raise CorpusFormatError(f"states chunk [{c.start}, {c.stop}) of {c.data.nbytes} bytes "
                                        f"out of order after token {expected}")
            await blocking(sample.chunk, c.data)
            expected = c.stop
        if expected != layout.shape[0]:
            raise CorpusFormatError(f"the stream ended after {expected} of {layout.shape[0]} tokens")
        head = await stream.head()
        reason = drop_reason(fmt, head.loss_mask)
        if reason:
            raise StreamDropped(reason)
        record = await blocking(sample.end, head)
        info = await blocking(f.commit)
    except BaseException:
        sample.abort()
        await blocking(f.abort)
        raise
    return StreamStored({sample.rel: info}, record, head)

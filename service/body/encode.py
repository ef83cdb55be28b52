"""One response body, coded as negotiated: the headers and the stream a route sends.

Both places that send states build them here: the engine process when it serves HTTP
itself (serving.py), and the HTTP workers (http_worker.py), which send from their own
read-only mapping of the arena.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from hsx import bf16split
from hsx.wire import MEDIA_TYPE, TensorSpec, encode_header
from hsx_service.body.compress import CompressPool, stream_bf16split
from hsx_service.body.response import Body, Stats, stream_identity, stream_zstd


def encode_body(specs: list[TensorSpec], parts: list, metadata: dict[str, str], coding: str, stats: Stats,
                pool: CompressPool) -> tuple[dict[str, str], AsyncIterator]:
    """Headers (Content-Type, and Content-Encoding or Content-Length) and the body stream of
    tensors `specs` with bytes `parts` (`hidden_states` first). `coding` is what
    negotiate.choose_coding chose: bf16split applies to BF16 states only (zstd otherwise)."""
    if coding == "bf16split" and specs and specs[0].name == "hidden_states" and specs[0].dtype == "BF16":
        return {"Content-Type": bf16split.MEDIA_TYPE}, stream_bf16split(specs, metadata, parts, stats, pool)
    body = Body([encode_header(specs, metadata), *parts])
    if coding in ("zstd", "bf16split"):
        return ({"Content-Type": MEDIA_TYPE, "Content-Encoding": "zstd"},
                stream_zstd(body, stats, pool.level, pool.executor, pool.frame_threads))
    return {"Content-Type": MEDIA_TYPE, "Content-Length": str(body.nbytes)}, stream_identity(body, stats)

"""The incremental body parser and the HTTP sample stream (hsx_client.sample_stream):
a body cut anywhere (1 byte, mid-header, mid-row) gives the same states and head as
`wire.decode` of the whole body; short or overlong bodies are errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch
import zstandard

from hsx import wire
from hsx_client.api import HsxClient
from hsx_client.errors import HsxError
from hsx_client.body_parser import BodyParser
from hsx_client.sample_stream import StreamError, states_layout
from _wire_bodies import make_body


def parse(body: bytes, cut: int, chunk_bytes: int):
    p = BodyParser(chunk_bytes)
    states, spans = bytearray(), []
    for i in range(0, len(body), cut):
        for c in p.feed(body[i:i + cut]):
            assert c.start == (spans[-1][1] if spans else 0)
            spans.append((c.start, c.stop))
            states += c.data
    return p.finish(), bytes(states), spans


@pytest.mark.parametrize("cut", [1, 3, 8, 13, 40, 41, 1000, 1 << 20])
@pytest.mark.parametrize("chunk_bytes", [1, 40, 100, 1 << 20])
def test_parser_any_cut_gives_the_whole_decode(cut, chunk_bytes):
    body = make_body()
    want = wire.decode(body)
    head, states, spans = parse(body, cut, chunk_bytes)
    row = 4 * 5 * 2
    assert states == want.hidden_states.view(torch.uint8).numpy().tobytes()
    assert spans[-1][1] == 7 and all(b > a for a, b in spans)
    assert all((b - a) * row <= max(chunk_bytes, row) for a, b in spans)  # chunks bounded, whole tokens
    assert np.array_equal(head.token_ids, want.token_ids) and np.array_equal(head.loss_mask, want.loss_mask)
    assert head.shape == (7, 4, 5) and head.dtype == torch.bfloat16 and head.layer_ids == [1, 2, 3, 4]


def test_parser_without_mask_and_fp32():
    body = make_body(t=3, dtype=torch.float32, mask=False)
    head, states, _ = parse(body, 5, 64)
    assert head.loss_mask is None and head.dtype == torch.float32
    assert states == wire.decode(body).hidden_states.numpy().tobytes()


@pytest.mark.parametrize("cut_at", [0, 4, 8, 30, -10, -1])
def test_parser_truncated_body_is_an_error(cut_at):
    body = make_body()[:cut_at]
    p = BodyParser(64)
    for _ in p.feed(body):
        pass
    with pytest.raises(StreamError):
        p.finish()


def test_parser_overlong_body_is_an_error():
    p = BodyParser(64)
    with pytest.raises(StreamError):
        for _ in p.feed(make_body() + b"x"):
            pass


def test_parser_refuses_states_not_first():
    specs = [wire.TensorSpec("token_ids", "I64", (2,)), wire.TensorSpec("hidden_states", "F32", (2, 1, 1))]
    body = wire.encode_header(specs, {}) + bytes(16 + 8)
    with pytest.raises(StreamError, match="first"):
        list(BodyParser().feed(body))


def _client_for(body: bytes, encoding: str) -> HsxClient:
    def handler(request: httpx.Request) -> httpx.Response:
        data = zstandard.ZstdCompressor().compress(body) if encoding == "zstd" else body
        chunks = [data[i:i + 17] for i in range(0, len(data), 17)]

        async def gen():
            for c in chunks:
                yield c

        headers = {"content-type": wire.MEDIA_TYPE}
        if encoding == "zstd":
            headers["content-encoding"] = "zstd"
        return httpx.Response(200, headers=headers, content=gen())

    return HsxClient("http://h:1", transport=httpx.MockTransport(handler), compression="zstd")


@pytest.mark.parametrize("encoding", ["identity", "zstd"])
def test_http_stream_equals_the_whole_body(encoding):
    body = make_body(t=9)
    want = wire.decode(body)

    async def go():
        async with _client_for(body, encoding) as client:
            s = await client.hidden_states_stream({"prompt": "x"}, chunk_bytes=100)
            try:
                layout = await states_layout(s)
                got = bytearray()
                async for c in s.chunks():
                    got += c.data
                head = await s.head()
            finally:
                await s.aclose()
            return layout, bytes(got), head, client.stats()["http://h:1"]

    layout, got, head, stats = asyncio.run(go())
    assert stats["body_bytes"] == len(body) and stats["wire_bytes"] > 0
    assert layout.shape == (9, 4, 5) and layout.row_bytes == 40
    assert got == want.hidden_states.view(torch.uint8).numpy().tobytes()
    assert np.array_equal(head.token_ids, want.token_ids)


def test_http_stream_truncated_zstd_raises():
    body = make_body(t=9)

    def handler(request):
        data = zstandard.ZstdCompressor().compress(body)[:-5]
        return httpx.Response(200, headers={"content-encoding": "zstd"}, content=data)

    async def go():
        async with HsxClient("http://h:1", transport=httpx.MockTransport(handler), compression="zstd") as client:
            s = await client.hidden_states_stream({"prompt": "x"})
            try:
                async for _ in s.chunks():
                    pass
            finally:
                await s.aclose()

    with pytest.raises((StreamError, HsxError)):
        asyncio.run(go())

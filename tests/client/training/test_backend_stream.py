"""The online backend receives a sample as a stream: its states go chunk by chunk into the
one tensor it hands the trainer (hsx_client.training.speculators_backend._receive)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

pytest.importorskip("hs_connectors", reason="speculators' hs_connectors is not installed")

from hsx import wire  # noqa: E402
from hsx_client.api import HsxClient  # noqa: E402
from hsx_client.training.speculators_backend import _receive  # noqa: E402

from _wire_bodies import make_body  # noqa: E402


def test_receive_fills_one_tensor_from_the_chunks():
    body = make_body(t=33, hidden=16)
    want = wire.decode(body)

    def handler(request):
        async def gen():
            for i in range(0, len(body), 101):
                yield body[i:i + 101]
        return httpx.Response(200, content=gen())

    async def go():
        async with HsxClient("http://h:1", transport=httpx.MockTransport(handler), compression="none") as client:
            s = await client.hidden_states_stream({"input_ids": [1]}, chunk_bytes=300)
            try:
                return await _receive(s)
            finally:
                await s.aclose()

    hs, head = asyncio.run(go())
    assert torch.equal(hs, want.hidden_states) and hs.dtype == torch.bfloat16
    assert head.token_ids.tolist() == want.token_ids.tolist()
    hs.add_(1)  # the trainer's own tensor: writable, shares nothing with a body

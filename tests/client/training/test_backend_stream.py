"""The online backend receives a sample as a stream: its states go chunk by chunk into the
one tensor it hands the trainer (hsx_client.training.speculators_backend._receive)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
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


def test_a_row_whose_lease_expired_is_asked_again_over_http():
    """Issue 36 item 2, the online trainer's side: a lease found expired at its release was
    asked again under a lease, three times, then the row failed; now it is asked again over
    an HTTP body, which cannot expire."""
    from types import SimpleNamespace

    from hsx_client.errors import LeaseExpiredError
    from hsx_client.responses import Lease, RawResponse
    from hsx_client.sample_stream import WholeSampleStream
    from hsx_client.training.speculators_backend import HsxTransfer

    body = make_body(t=5, hidden=16)
    asked = []

    class Client:
        async def hidden_states_stream(self, body_, lease_ok=False):
            asked.append(lease_ok)
            stream = WholeSampleStream(RawResponse(body=body, request_id="r", server="s", wire_bytes=0), self)
            if lease_ok:
                stream.lease = Lease("l", "s", memoryview(b""))
            return stream

        async def release_lease(self, lease):
            raise LeaseExpiredError("the lease expired before its release", status=410, type="lease_gone")

    rt = SimpleNamespace(client=Client(), layers=None, num_layers=None)
    out = asyncio.run(HsxTransfer._fetch(None, rt, 0, np.asarray(wire.decode(body).token_ids)))
    assert asked == [True, False] and torch.equal(out["hidden_states"], wire.decode(body).hidden_states)

"""client/lease_stream.py: the chunked lease form read as a SampleStream (fast tier, fakes
for the response, the arena and the release; the real server: tests/service/test_chunked_states.py)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from hsx.wire import TensorSpec, encode_header
from hsx_client.errors import LeaseExpiredError, ServerError
from hsx_client.lease_stream import LeaseStream

T, L, H = 5, 2, 4
ROW = L * H * 4


class _Arena:
    arena_id = "a1"

    def __init__(self, data: bytes) -> None:
        self.data = data

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.data)[offset : offset + nbytes]


class _Client:
    def __init__(self, expired: tuple[str, ...] = ()) -> None:
        self.released: list[str] = []
        self.expired = expired  # lease ids whose release answers 410
        self.noted: list[str] = []

    async def release_lease(self, lease) -> None:
        self.released.append(lease.id)
        if lease.id in self.expired:
            self.note_lease_expired(lease.server)
            raise LeaseExpiredError("the lease expired before its release", status=410, type="lease_gone")

    def note_lease_expired(self, server: str) -> None:
        self.noted.append(server)


class _Response:
    def __init__(self, body: bytes, piece: int = 7) -> None:
        self.pieces = [body[i : i + piece] for i in range(0, len(body), piece)]
        self.closed = False

    async def aiter_raw(self):
        for p in self.pieces:
            yield p

    async def aclose(self) -> None:
        self.closed = True


def _body(records: list[dict]) -> bytes:
    lease = {"chunked": True, "arena_id": "a1", "dtype": "F32", "shape": [T, L, H], "expires_in": 60}
    ids = np.arange(T, dtype=np.int64)
    head = encode_header([TensorSpec("token_ids", "I64", (T,))], {"lease": json.dumps(lease), "m": "1"}) + ids.tobytes()
    return head + b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _stream(records, states: np.ndarray, client=None):
    data = bytearray(4096)
    for r in records:
        if "tokens" in r:
            a, b = r["tokens"]
            data[r["offset"] : r["offset"] + r["nbytes"]] = states[a:b].tobytes()
    response, client = _Response(_body(records)), client or _Client()
    return LeaseStream(client, "http://s", response, response.aclose, _Arena(data), "rid"), client, response


RECORDS = [{"id": "c0", "offset": 0, "nbytes": 3 * ROW, "tokens": [0, 3]},
           {"id": "c1", "offset": 1024, "nbytes": 2 * ROW, "tokens": [3, 5]}, {"end": True}]


def test_chunks_arrive_in_order_each_taken_out_and_released_before_it_is_handed_out():
    """Issue 36: a chunk's lease was held while the caller wrote it (a slow disk on a loaded
    box outlasted it). Now each chunk is copied out and its lease released first (the first
    one with the head, before the caller opens its file); what is handed out is the copy."""
    states = np.random.default_rng(0).standard_normal((T, L, H)).astype(np.float32)
    stream, client, response = _stream(RECORDS, states)

    async def main():
        head = await stream.head()
        assert head.shape == (T, L, H) and head.token_ids.tolist() == list(range(T)) and head.metadata == {"m": "1"}
        assert client.released == ["c0"]  # taken out with the head
        got = []
        async for c in stream.chunks():
            assert client.released == ["c0", "c1"][: 1 + (c.start > 0)]
            if c.start == 0:  # released: the server reuses its range at once
                stream._arena.data[: 3 * ROW] = bytes(3 * ROW)
            got.append((c.start, c.stop, np.frombuffer(c.data, dtype=np.float32).copy()))
        await stream.aclose()
        return got

    got = asyncio.run(main())
    assert [g[:2] for g in got] == [(0, 3), (3, 5)]
    assert np.array_equal(np.concatenate([g[2] for g in got]).reshape(T, L, H), states)
    assert client.released == ["c0", "c1"] and response.closed


def test_collect_gives_the_whole_body():
    from hsx.wire import decode

    states = np.random.default_rng(1).standard_normal((T, L, H)).astype(np.float32)
    stream, client, _ = _stream(RECORDS, states)
    raw = asyncio.run(stream.collect())
    d = decode(raw.body)
    assert np.array_equal(d.hidden_states.numpy(), states) and d.token_ids.tolist() == list(range(T))
    assert client.released == ["c0", "c1"]


@pytest.mark.parametrize("records, error", [
    ([RECORDS[0], {"error": "engine died", "status": 502}], ServerError),
    ([RECORDS[1], RECORDS[2]], ValueError),  # out of order
    ([RECORDS[0], {"end": True}], ValueError),  # ended short
    ([RECORDS[0]], ValueError),  # no end record
])
def test_broken_streams_raise_and_release_what_is_held(records, error):
    stream, client, response = _stream(records, np.zeros((T, L, H), dtype=np.float32))

    async def main():
        try:
            async for _ in stream.chunks():
                pass
        finally:
            await stream.aclose()

    with pytest.raises(error):
        asyncio.run(main())
    assert response.closed and client.released in ([], ["c0"], ["c1"])


@pytest.mark.parametrize("records, expired", [
    (RECORDS, ("c1",)),  # the release of a chunk answers 410
    ([RECORDS[0], {"error": "a chunk lease expired", "status": 410}], ()),  # the server ended the sample
])
def test_an_expired_chunk_lease_raises_lease_expired_and_is_counted(records, expired):
    """The caller asks again over HTTP (hsx extract's run loop) and the summary counts it."""
    stream, client, response = _stream(records, np.zeros((T, L, H), dtype=np.float32), _Client(expired))

    async def main():
        try:
            async for _ in stream.chunks():
                pass
        finally:
            await stream.aclose()

    with pytest.raises(LeaseExpiredError) as err:
        asyncio.run(main())
    assert err.value.status == 410 and client.noted == ["http://s"] and response.closed


_ATTACH_SCRIPT = r'''
import asyncio, sys, threading
from hsx_client import api, shm
from hsx_client.api import HsxClient

loaded_in = {}
real_import = api.importlib.import_module
def spy(name):
    loaded_in[name] = threading.current_thread() is threading.main_thread()
    return real_import(name)
api.importlib.import_module = spy
class Arena:  # the arena handshake, faked
    def close(self):
        pass
shm.attach = lambda offer, key: Arena()

async def main():
    async with HsxClient("http://127.0.0.1:9", transfer="auto") as client:
        async def info(server, path, rid):
            return {"shm_lease": {"socket": "@x"}}
        client._get_json = info
        before = "torch" in sys.modules
        await client._arena_for(client._pool.servers[0], "rid")
        print(before, "torch" in sys.modules, loaded_in)

asyncio.run(main())
'''


@pytest.mark.slow  # a fresh interpreter imports torch: seconds
def test_attaching_to_an_arena_loads_the_lease_reader_and_torch_off_the_loop():
    """A first `import torch` inside the lease stream's head() ran on the event loop after the
    server had granted chunk leases; on a loaded box it took minutes and they expired. Now the
    client loads the reader (torch with it) in a thread when it attaches, before any lease."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ATTACH_SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # torch was not loaded before; it is after the attach; the reader was imported off the main thread
    assert out.stdout.strip() == "False True {'hsx_client.lease_stream': False}", out.stdout

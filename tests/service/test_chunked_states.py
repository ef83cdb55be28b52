"""Issue 29: a sample whose states exceed the server's stream window (and its whole arena) is
copied and sent in token chunks, exactly, on a real engine: an 8 MiB arena (a 1 MiB window)
and a 4096-token prompt on a model with hidden 2048 (4 layers) in fp32: 128 MiB of states.

Over HTTP (identity, zstd) and the chunked lease form (client/lease_stream.py), a client
leaving mid-sample (HTTP or lease) frees the window and the request's blocks, and many large
and small samples at once. The server is the session's `chunk_server` (tests/conftest.py; the
client's streaming tests share it); the transformers reference is computed once.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch
import zstandard

from _reference import reference_states, rel_err
from _server import wait_until
from conftest import WIDE_ARENA, WIDE_TOKENS, WIDE_VOCAB
from hsx.wire import decode, parse_header

pytestmark = pytest.mark.engine

TOKENS = WIDE_TOKENS
ARENA = WIDE_ARENA
VOCAB = WIDE_VOCAB
LAYERS, HIDDEN = 4, 2048  # wide_model: the default ids 1..4


def _ids(seed: int, n: int = TOKENS) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()


@pytest.fixture(scope="module")
def reference(wide_model):
    ids = _ids(0)
    return ids, reference_states(str(wide_model), ids, [1, 2, 3, 4])


def _arena_used(server) -> float:
    return server.metrics().get("hsx_arena_used_bytes")


def test_info_says_what_bounds_a_sample(chunk_server):
    info = httpx.get(chunk_server.url + "/info").json()
    bounds = info["bounds"]
    assert bounds["max_model_len"] == TOKENS + 64
    assert bounds["arena_bytes"] == ARENA
    assert bounds["stream_window_bytes"] == ARENA // 8
    assert bounds["sample_bound"] == "max_model_len"


@pytest.mark.parametrize("coding", ["identity", "zstd"])
def test_sample_larger_than_the_arena_is_exact(chunk_server, reference, coding):
    ids, ref = reference
    r = httpx.post(chunk_server.url + "/hidden_states", json={"input_ids": ids},
                   headers={"Accept-Encoding": coding}, timeout=300)
    assert r.status_code == 200, r.text[:300]
    assert r.headers.get("content-encoding", "identity") == coding
    body = r.content  # httpx decodes the zstd frame
    header, _ = parse_header(body)
    assert header["hidden_states"]["shape"] == [TOKENS, LAYERS, HIDDEN]
    got = decode(body)
    assert got.hidden_states.numel() * 4 > ARENA * 10
    assert got.token_ids.tolist() == ids
    assert rel_err(got.hidden_states, ref) < 1e-4
    # Chunk boundaries: every token's states are its own (a slot mix-up shows per token).
    per_token = (got.hidden_states - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))
    assert float(per_token.max()) < 1e-3
    wait_until(lambda: _arena_used(chunk_server) == 0, 30, "the window freed")


def test_identity_and_zstd_bodies_are_byte_equal(chunk_server):
    ids = _ids(1, 3000)
    plain = httpx.post(chunk_server.url + "/hidden_states", json={"input_ids": ids},
                       headers={"Accept-Encoding": "identity"}, timeout=300)
    with httpx.stream("POST", chunk_server.url + "/hidden_states", json={"input_ids": ids},
                      headers={"Accept-Encoding": "zstd"}, timeout=300) as r:
        raw = b"".join(r.iter_raw())
    assert plain.status_code == 200
    assert int(plain.headers["content-length"]) == len(plain.content)
    unzipped = zstandard.ZstdDecompressor().decompress(raw)
    (_, a), (_, b) = parse_header(unzipped), parse_header(plain.content)
    assert unzipped[a:] == plain.content[b:]  # the data bytes (the metadata names each request)


def test_client_leaving_mid_sample_frees_window_and_blocks(chunk_server):
    ids = _ids(2)
    with httpx.stream("POST", chunk_server.url + "/hidden_states", json={"input_ids": ids},
                      headers={"Accept-Encoding": "identity"}, timeout=300) as r:
        assert r.status_code == 200
        got = 0
        for piece in r.iter_raw():
            got += len(piece)
            if got > 3 * ARENA:
                break
    assert got < TOKENS * LAYERS * HIDDEN * 4
    wait_until(lambda: _arena_used(chunk_server) == 0, 60, "the window freed after the client left")
    # The engine holds no blocks of it: the KV cache is empty again, and the next sample passes.
    wait_until(lambda: chunk_server.metrics().get("hsx_kv_cache_usage", 0.0) == 0.0, 60, "the KV blocks freed")
    r = httpx.post(chunk_server.url + "/hidden_states", json={"input_ids": ids[:2000]}, timeout=300)
    assert r.status_code == 200
    assert decode(r.content).hidden_states.shape == (2000, LAYERS, HIDDEN)


def test_many_large_and_small_samples_at_once(chunk_server):
    async def one(client, ids):
        r = await client.post(chunk_server.url + "/hidden_states", json={"input_ids": ids},
                              headers={"Accept-Encoding": "zstd"})
        for _ in range(60):  # a full arena is a 503 to retry
            if r.status_code != 503:
                break
            await asyncio.sleep(0.5)
            r = await client.post(chunk_server.url + "/hidden_states", json={"input_ids": ids},
                                  headers={"Accept-Encoding": "zstd"})
        assert r.status_code == 200, r.text[:300]
        return ids, decode(r.content)

    async def main():
        async with httpx.AsyncClient(timeout=600) as client:
            inputs = [_ids(10 + i, 3500 if i % 3 == 0 else 40 + i) for i in range(9)]
            return await asyncio.gather(*(one(client, ids) for ids in inputs))

    results = asyncio.run(main())
    for ids, got in results:
        assert got.token_ids.tolist() == ids
        assert got.hidden_states.shape == (len(ids), LAYERS, HIDDEN)
        assert torch.isfinite(got.hidden_states).all()
    # The same input alone gives the same states (chunks of concurrent samples never mix; batched
    # with others, the last bits of fp32 sums may differ).
    ids, first = results[0]
    again = decode(httpx.post(chunk_server.url + "/hidden_states", json={"input_ids": ids}, timeout=300).content)
    assert rel_err(first.hidden_states, again.hidden_states) < 1e-5
    wait_until(lambda: _arena_used(chunk_server) == 0, 30, "every window freed")


# ------------------------------------------------------------------ the chunked lease form
def _lease_stream(server, ids, steps):
    """Open a lease-stream answer for `ids` through the client's own path and run `steps(stream)`."""
    from hsx_client.api import HsxClient
    from hsx_client.lease_stream import LeaseStream

    async def main():
        async with HsxClient(server.url, transfer="auto") as client:
            state = client._pool.servers[0]
            arena = await client._arena_for(state, "rid")
            assert arena is not None, "no lease offer from the test server"
            stream = await client._open_states(state, json.dumps({"input_ids": ids}).encode(), "rid", True,
                                               whole=False, chunk_bytes=1 << 20)
            assert isinstance(stream, LeaseStream)
            try:
                return await steps(stream)
            finally:
                await stream.aclose()

    return asyncio.run(main())


def test_lease_stream_hands_over_exact_chunks(chunk_server, reference):
    ids, ref = reference

    async def read_all(stream):
        head = await stream.head()
        assert head.shape == (TOKENS, LAYERS, HIDDEN) and head.token_ids.tolist() == ids
        out = torch.empty(head.shape, dtype=head.dtype)
        chunks = 0
        async for c in stream.chunks():
            out[c.start : c.stop] = torch.frombuffer(bytearray(c.data), dtype=head.dtype).view(c.stop - c.start, LAYERS, HIDDEN)
            chunks += 1
        return out, chunks

    got, chunks = _lease_stream(chunk_server, ids, read_all)
    assert chunks > 10
    assert rel_err(got, ref) < 1e-4
    http = decode(httpx.post(chunk_server.url + "/hidden_states", json={"input_ids": ids}, timeout=300).content)
    assert torch.equal(got, http.hidden_states)  # the same bytes as the HTTP body
    wait_until(lambda: _arena_used(chunk_server) == 0 and chunk_server.metrics().get("hsx_leases_live") == 0,
               30, "every chunk lease released and the window freed")


def test_lease_stream_closed_mid_sample_frees_everything(chunk_server):
    async def two_chunks(stream):
        n = 0
        async for _ in stream.chunks():
            n += 1
            if n == 2:
                break
        return n

    assert _lease_stream(chunk_server, _ids(3), two_chunks) == 2
    wait_until(lambda: _arena_used(chunk_server) == 0 and chunk_server.metrics().get("hsx_leases_live") == 0,
               60, "the window and the leases freed after the client left")
    r = httpx.post(chunk_server.url + "/hidden_states", json={"input_ids": _ids(4, 100)}, timeout=300)
    assert r.status_code == 200


def test_whole_response_callers_get_a_chunked_lease_whole(chunk_server, reference):
    from hsx_client.api import HsxClient

    ids, ref = reference

    async def main():
        async with HsxClient(chunk_server.url, transfer="auto") as client:
            return await client.hidden_states_response({"input_ids": ids}, lease_ok=True)

    raw = asyncio.run(main())
    got = raw.decode()
    assert raw.lease is None and got.token_ids.tolist() == ids and rel_err(got.hidden_states, ref) < 1e-4


# The tests below wait a lease out, so they need chunk_server's short --lease-timeout
# (tests/conftest.py: `--lease-timeout 10` on its command line); with a longer one they skip.
SILENT_TEST_MAX_TIMEOUT = 15.0


def test_a_whole_response_caller_whose_chunk_lease_expires_gets_the_sample_over_http(chunk_server, reference):
    """A chunk lease released after --lease-timeout (a loaded client box: CI saw it once at --lease-timeout 5)
    ended the sample with a 410 that reached the caller of a whole response. Now the client
    asks again as an HTTP body: the caller gets the exact states, the expiry is counted."""
    from hsx_client.api import HsxClient

    ids, ref = reference
    timeout = httpx.get(chunk_server.url + "/info").json()["shm_lease"]["lease_timeout"]
    if timeout > SILENT_TEST_MAX_TIMEOUT:
        pytest.skip(f"chunk_server's --lease-timeout is {timeout:g}s: this test waits it out")
    expired_before = chunk_server.metrics().get("hsx_leases_total", 0, outcome="expired")

    async def main():
        async with HsxClient(chunk_server.url, transfer="auto") as client:
            release = client.release_lease
            late = []

            async def release_late_once(lease):
                if not late:  # the first chunk's release waits out its lease
                    late.append(lease.id)
                    await asyncio.sleep(timeout + 1)
                await release(lease)

            client.release_lease = release_late_once
            raw = await client.hidden_states_response({"input_ids": ids}, lease_ok=True)
            return raw, late, client.stats()[chunk_server.url]["leases_expired"]

    raw, late, expired = asyncio.run(main())
    got = raw.decode()
    assert late and expired == 1
    assert raw.lease is None and got.token_ids.tolist() == ids and rel_err(got.hidden_states, ref) < 1e-4
    assert chunk_server.metrics().get("hsx_leases_total", 0, outcome="expired") > expired_before
    wait_until(lambda: _arena_used(chunk_server) == 0 and chunk_server.metrics().get("hsx_leases_live") == 0,
               60, "the expired sample's window and leases freed")


def test_a_silent_lease_stream_client_is_ended_within_the_lease_timeout(chunk_server):
    """Issue 36 item 4: a client that takes a chunked lease answer and then says nothing kept
    its request, its KV blocks and its window: each expired chunk lease gave the next chunk to
    the same client (33 such streams held 33 slots and half the arena past 75 s against
    --lease-timeout 60). Now the first expiry ends the request: the engine request is
    aborted, window, KV blocks and the in-flight slot freed within about the timeout, and the
    stream's last record says why (410)."""
    import time

    from hsx import wire
    from hsx_client import shm

    offer = httpx.get(chunk_server.url + "/info").json()["shm_lease"]
    arena = shm.attach(offer, None)  # the lease session: open for the whole test
    expired_before = chunk_server.metrics().get("hsx_leases_total", 0, outcome="expired")
    try:
        headers = {"Accept": f"{wire.LEASE_MEDIA_TYPE}, {wire.MEDIA_TYPE};q=0.5", shm.SESSION_HEADER: arena.session}
        with httpx.stream("POST", chunk_server.url + "/hidden_states", json={"input_ids": _ids(5)}, headers=headers,
                          timeout=300) as r:
            assert r.status_code == 200 and r.headers["content-type"] == wire.LEASE_STREAM_MEDIA_TYPE
            reader, pieces = wire.LeaseStreamReader(), r.iter_raw()
            records = []
            while reader.head is None:
                records += reader.feed(next(pieces))
            timeout = float(reader.lease["expires_in"])
            if timeout > SILENT_TEST_MAX_TIMEOUT:
                pytest.skip(f"chunk_server's --lease-timeout is {timeout:g}s: this test needs at most "
                            f"{SILENT_TEST_MAX_TIMEOUT:g}s (see SILENT_TEST_MAX_TIMEOUT)")
            t0 = time.monotonic()
            # silent from here: no chunk read, no lease released, the connection open

            def freed():
                m = chunk_server.metrics()
                return (m.get("hsx_arena_used_bytes") == 0 and m.get("hsx_leases_live") == 0
                        and m.get("hsx_inflight_requests") == 0 and m.get("hsx_kv_cache_usage", 0.0) == 0.0)

            wait_until(freed, timeout + 30, "the silent client's request ended and its window, KV and slot freed")
            took = time.monotonic() - t0
            for piece in pieces:  # what was sent meanwhile: a lease or two, then why it ended
                records += reader.feed(piece)
        assert took < timeout + 15, f"freed {took:.1f}s after the head against --lease-timeout {timeout:g}"
        assert records and records[-1].get("status") == 410 and "lease expired" in records[-1]["error"]
        assert sum("id" in rec for rec in records) <= 8  # no more than the window's slots were offered
        assert chunk_server.metrics().get("hsx_leases_total", 0, outcome="expired") > expired_before
    finally:
        arena.close()
    r = httpx.post(chunk_server.url + "/hidden_states", json={"input_ids": _ids(6, 100)}, timeout=300)
    assert r.status_code == 200

"""Chunked states (issue 29), fast tier: the worker's chunked copies and credits
(connector.py + chunks.py) on a fake page cache and a real arena file, the API side's
window (window.py), the streamed body (body/response.py) and the lease-stream framing
(hsx/wire.py). The real engine path: tests/service/test_chunked_states.py."""

from __future__ import annotations

import asyncio
import json
import queue

import numpy as np
import pytest
import torch
import zstandard

from hsx.wire import (LEASE_STREAM_MEDIA_TYPE, LeaseStreamReader, TensorSpec, WireFormatError, encode_header,
                      head_size)
from hsx_service.body.compress import CompressPool, stream_bf16split
from hsx_service.body.response import Body, Stats, stream_identity, stream_zstd
from hsx_service.engine.arena import Allocator, SharedArena
from hsx_service.engine.chunks import ChunkedSave, ChunkPlan, CreditBook, plan_slots
from hsx_service.engine.window import ChunkCut, ChunkFailed, ChunkLease, StreamWindow, WindowStates

L, H, BLOCK = 2, 8, 4
TOKEN_BYTES = L * H * 4


# ------------------------------------------------------------------------ pure logic
def test_plan_slots_whole_tokens_and_at_least_two():
    assert plan_slots(1 << 20, TOKEN_BYTES) == (2, (1 << 19) // TOKEN_BYTES)
    slots, tokens = plan_slots(256 << 20, 57344)
    assert slots >= 2 and slots * tokens * 57344 <= 256 << 20
    assert plan_slots(1000, 57344) == (2, 1)  # a token larger than the window: one per slot


def test_chunked_save_issues_only_into_free_slots():
    save = ChunkedSave("k", 10, ChunkPlan(3, (0, 100), TOKEN_BYTES))
    assert list(save.ready()) == [(0, 0, 0, 3), (1, 1, 3, 6)]
    assert list(save.ready()) == []  # no credit yet: nothing waits, nothing is issued
    save.credit(0)
    save.credit(0)  # twice: once
    assert list(save.ready()) == [(2, 0, 6, 9)]
    save.credit(1)
    assert list(save.ready()) == [(3, 1, 9, 10)] and save.issued_all


def test_cancel_before_the_save_is_known_applies_when_it_starts():
    book = CreditBook()
    book.apply({"key": "k", "cancel": True})
    book.apply({"key": "other", "slot": 0})  # unknown: ignored
    save = ChunkedSave("k", 10, ChunkPlan(3, (0, 100), TOKEN_BYTES))
    book.add(save)
    assert save.cancelled and save.issued_all and list(save.ready()) == []


# ------------------------------------------------------------------- worker: connector
class _Inbox:
    def __init__(self):
        self.msgs = []

    def drain(self):
        out, self.msgs = self.msgs, []
        return out


@pytest.fixture
def worker(tmp_path):
    pytest.importorskip("vllm")
    from hsx_service.engine import connector as conn

    c = object.__new__(conn.HsxConnector)
    blocks = 16
    c._kv_cache = torch.randn(blocks, BLOCK, L + 1, H)  # axis 1: [blocks, block_size, layers, hidden]
    c._block_axis, c._block_size, c._is_writer = 1, BLOCK, True
    c._arena = SharedArena.create(str(tmp_path), 1 << 16)
    c._copy_stream, c._copies, c._copy_events = None, queue.Queue(), {}
    c._chunked, c._book, c._credits = {}, CreditBook(), _Inbox()
    c._finished, c._step_events = set(), {}
    c._stats = {"copies": 0, "bytes": 0, "submit_s": 0.0, "wait_s": 0.0}
    c._connector_metadata = None
    yield c
    c._arena.close()


def _save(conn_mod, tokens: int, slots=(0, 4096)):
    plan = ChunkPlan(3, slots, TOKEN_BYTES)
    return conn_mod.PendingSave(req_id="r", key="k", block_ids=[5, 2, 9], num_tokens=tokens, offset=0,
                                nbytes=tokens * TOKEN_BYTES, layer_positions=[0, 2], chunks=plan.to_params())


def _items(c):
    out = []
    while not c._copies.empty():
        out.append(c._copies.get_nowait())
    return out


def test_worker_copies_chunk_by_chunk_as_credits_come_and_holds_the_blocks(worker):
    from hsx_service.engine import connector as conn
    from hsx_service.engine import hidden_cache

    c = worker
    c._start_copy(_save(conn, 10))
    c._pump_chunks()
    items = _items(c)
    assert [(i[1], i[3]) for i in items] == [("chunk", {"chunk": 0, "slot": 0}), ("chunk", {"chunk": 1, "slot": 1})]
    slots = hidden_cache.slot_ids([5, 2, 9], BLOCK, 10)
    want = hidden_cache.gather(c._kv_cache, slots, 1, [0, 2])  # [T, 2, H]

    def slot_states(offset, a, b):
        return torch.frombuffer(c._arena.view[offset : offset + (b - a) * TOKEN_BYTES], dtype=torch.float32).view(
            b - a, L, H)

    assert torch.equal(slot_states(0, 0, 3), want[0:3]) and torch.equal(slot_states(4096, 3, 6), want[3:6])
    assert c.get_finished({"r"}) == (None, None)  # chunks left: the blocks stay held
    c._credits.msgs.append({"key": "k", "slot": 0})
    c.get_finished(set())
    (item,) = _items(c)
    assert item[3] == {"chunk": 2, "slot": 0} and torch.equal(slot_states(0, 6, 9), want[6:9])
    c._credits.msgs.append({"key": "k", "slot": 1})
    done, _ = c.get_finished(set())
    items = _items(c)
    assert [i[1] for i in items] == ["chunk", "end"] and items[1][3] is None  # the end after the last chunk
    assert torch.equal(slot_states(4096, 9, 10), want[9:10])
    assert done == {"r"} and not c._chunked and not c._book.saves


def test_worker_cancel_ends_the_save_and_frees_the_blocks(worker):
    from hsx_service.engine import connector as conn

    c = worker
    c._start_copy(_save(conn, 10))
    c._pump_chunks()
    _items(c)
    c._credits.msgs.append({"key": "k", "cancel": True})
    done, _ = c.get_finished({"r"})
    (end,) = _items(c)
    assert end[1] == "end" and end[3] == "cancelled" and done == {"r"}


def test_worker_notify_thread_sends_chunk_and_end_notices(worker):
    sent = []

    class _N:
        def send(self, key, ok, error=None, **extra):
            sent.append({"key": key, "ok": ok, "error": error, **extra})

    c = worker
    c._notifier = _N()
    for item in [("k", "chunk", None, {"chunk": 0, "slot": 1}), ("k", "end", None, None),
                 ("j", "end", None, "cancelled"), None]:
        c._copies.put(item)
    c._notify_loop()
    assert sent == [{"key": "k", "ok": True, "error": None, "chunk": 0, "slot": 1},
                    {"key": "k", "ok": True, "error": None, "end": True},
                    {"key": "j", "ok": False, "error": "cancelled", "end": True}]


# --------------------------------------------------------------------- API: window
class _Credits:
    def __init__(self):
        self.sent = []

    def credit(self, key, slot):
        self.sent.append(("credit", slot))

    def cancel(self, key):
        self.sent.append(("cancel",))


def _window(tokens=10, arena_size=1 << 16, token_bytes=TOKEN_BYTES):
    alloc = Allocator(arena_size)
    res = alloc.reserve(2 * 3 * token_bytes)
    base = res.extent.offset
    plan = ChunkPlan(3, (base, base + 3 * token_bytes), token_bytes)
    credits = _Credits()
    w = StreamWindow(res, plan, tokens, credits, end_timeout=5.0)
    w.key = "k"
    return alloc, w, credits


def test_window_hands_out_chunks_in_order_and_frees_after_end_close_and_give_back():
    async def main():
        alloc, w, credits = _window()
        w.on_notice({"key": "k", "ok": True, "chunk": 1, "slot": 1})
        w.on_notice({"key": "k", "ok": True, "chunk": 0, "slot": 0})
        await w.first()
        a = await w.next_chunk()
        b = await w.next_chunk()
        assert (a.index, a.start, a.stop, b.index, b.slot) == (0, 0, 3, 1, 1)
        w.give_back(0)
        w.give_back(0)
        assert credits.sent == [("credit", 0)]
        waiting = asyncio.ensure_future(w.next_chunk())
        await asyncio.sleep(0)
        assert not waiting.done()  # not landed yet
        w.on_notice({"key": "k", "ok": True, "chunk": 2, "slot": 0})
        assert (await waiting).index == 2
        w.on_notice({"key": "k", "ok": True, "chunk": 3, "slot": 1})
        w.on_notice({"key": "k", "ok": True, "end": True})
        last = await w.next_chunk()
        assert last.stop == 10 and await w.next_chunk() is None
        w.close()
        assert alloc.used > 0  # chunks 1, 2, 3 are still out
        for i in (1, 2, 3):
            w.give_back(i)
        assert alloc.used == 0

    asyncio.run(main())


def test_window_closed_early_cancels_and_waits_for_the_end():
    async def main():
        alloc, w, credits = _window()
        w.on_notice({"key": "k", "ok": True, "chunk": 0, "slot": 0})
        w.close()
        assert credits.sent == [("cancel",)] and alloc.used > 0  # the worker may still write
        w.on_notice({"key": "k", "ok": False, "error": "cancelled", "end": True})
        assert alloc.used == 0

    asyncio.run(main())


def test_window_failure_reaches_the_reader():
    async def main():
        alloc, w, _ = _window()
        w.on_notice({"key": None, "ok": False, "error": "engine died", "end": True})
        with pytest.raises(ChunkFailed, match="engine died"):
            await w.first()
        w.close()
        assert alloc.used == 0

    asyncio.run(main())


def test_a_cut_window_stops_its_waiting_reader_and_still_frees_only_after_the_end():
    """Issue 36.6: a chunked response whose client stopped releasing waited for its next
    chunk through the drain's cut-off (the drain took 15 s at --shutdown-timeout 10). The
    cut wakes the reader at once; the range is still freed only once the worker ended."""
    async def main():
        alloc, w, credits = _window()
        w.on_notice({"key": "k", "ok": True, "chunk": 0, "slot": 0})
        w.on_notice({"key": "k", "ok": True, "chunk": 1, "slot": 1})
        await w.next_chunk()
        await w.next_chunk()  # both slots out: chunk 2 cannot land until one comes back
        waiting = asyncio.ensure_future(w.next_chunk())
        holder = asyncio.ensure_future(w.all_back())
        await asyncio.sleep(0)
        w.cut("shut down")
        with pytest.raises(ChunkCut, match="shut down"):
            await asyncio.wait_for(waiting, 1)
        await asyncio.wait_for(holder, 1)
        w.close()
        assert credits.sent == [("cancel",)] and alloc.used > 0  # the worker may still write
        w.on_notice({"key": "k", "ok": False, "error": "cancelled", "end": True})
        w.give_back(0)
        w.give_back(1)
        assert alloc.used == 0

    asyncio.run(main())


def test_chunk_lease_gives_the_chunk_back_once():
    async def main():
        alloc, w, credits = _window()
        w.on_notice({"key": "k", "ok": True, "chunk": 0, "slot": 0})
        lease = ChunkLease(w, await w.next_chunk())
        assert lease.extent.nbytes == 3 * TOKEN_BYTES
        lease.release()
        lease.release()
        assert credits.sent == [("credit", 0)]

    asyncio.run(main())


def test_all_back_waits_for_every_chunk_handed_out():
    """What an HTTP worker's chunked lease answer waits on before it ends (serving.py)."""
    async def main():
        _, w, _ = _window()
        w.on_notice({"key": "k", "ok": True, "chunk": 0, "slot": 0})
        w.on_notice({"key": "k", "ok": True, "chunk": 1, "slot": 1})
        await w.next_chunk()
        await w.next_chunk()
        waiting = asyncio.ensure_future(w.all_back())
        w.give_back(0)
        await asyncio.sleep(0)
        assert not waiting.done()  # chunk 1 is still out
        w.give_back(1)
        await asyncio.wait_for(waiting, 1)

    asyncio.run(main())


# ----------------------------------------------------------------- the streamed body
def _streamed_body(coding: str):
    """A window fed by a fake worker as the body reads it: the body equals the whole one."""
    bf16 = coding == "bf16split"
    itemsize = 2 if bf16 else 4

    async def main():
        arena = bytearray(1 << 16)
        alloc, w, credits = _window(tokens=10, token_bytes=L * H * itemsize)
        rng = np.random.default_rng(0)
        states = (rng.integers(0, 1 << 16, (10, L, H), dtype=np.uint16) if bf16
                  else rng.standard_normal((10, L, H)).astype(np.float32))
        ids = np.arange(10, dtype=np.int64)
        specs = [TensorSpec("hidden_states", "BF16" if bf16 else "F32", (10, L, H)),
                 TensorSpec("token_ids", "I64", (10,))]
        whole = encode_header(specs, {"a": "b"}) + states.tobytes() + ids.tobytes()

        async def fake_worker():
            free, sent_chunk = [0, 1], 0
            while sent_chunk < 4:
                while credits.sent and credits.sent[0][0] == "credit":
                    free.append(credits.sent.pop(0)[1])
                if free:
                    slot = free.pop(0)
                    a, b = sent_chunk * 3, min(10, sent_chunk * 3 + 3)
                    off = w.plan.slots[slot]
                    arena[off : off + (b - a) * w.plan.token_bytes] = states[a:b].tobytes()
                    w.on_notice({"key": "k", "ok": True, "chunk": sent_chunk, "slot": slot})
                    sent_chunk += 1
                await asyncio.sleep(0)
            w.on_notice({"key": "k", "ok": True, "end": True})

        feeder = asyncio.ensure_future(fake_worker())
        body = Body([encoded := encode_header(specs, {"a": "b"}), WindowStates(w, memoryview(arena)),
                     ids.tobytes()])
        assert body.nbytes == len(whole) and len(encoded) < len(whole)
        stats = Stats()
        if bf16:  # pieces across chunk boundaries: the same frames as the whole body's
            pool = CompressPool(1, 4)
            whole = b"".join([bytes(x) async for x in stream_bf16split(
                specs, {"a": "b"}, [states.tobytes(), ids.tobytes()], Stats(), pool)])
            stream = stream_bf16split(specs, {"a": "b"}, [WindowStates(w, memoryview(arena)), ids.tobytes()],
                                      stats, pool)
        elif coding == "identity":
            stream = stream_identity(body, stats)
        else:
            stream = stream_zstd(body, stats, 1, None)
        out = b"".join([bytes(x) async for x in stream])
        await feeder
        w.close()
        assert alloc.used == 0 and stats.complete
        return out, whole

    out, whole = asyncio.run(main())
    if coding == "zstd":
        out = zstandard.ZstdDecompressor().decompress(out)
    assert out == whole


@pytest.fixture
def small_pieces(monkeypatch):
    from hsx_service.body import compress

    monkeypatch.setattr(compress, "PIECE", 40)  # 3-token chunks of 32-byte rows: pieces straddle chunks


def test_streamed_bf16split_body_equals_the_whole_one(small_pieces):
    _streamed_body("bf16split")


@pytest.mark.parametrize("coding", ["identity", "zstd"])
def test_streamed_body_equals_the_whole_body(coding):
    _streamed_body(coding)


# --------------------------------------------------------------- lease-stream framing
def _lease_head() -> bytes:
    lease = {"chunked": True, "arena_id": "a1", "dtype": "F32", "shape": [10, L, H], "expires_in": 60}
    specs = [TensorSpec("token_ids", "I64", (10,))]
    return encode_header(specs, {"lease": json.dumps(lease)}) + np.arange(10, dtype=np.int64).tobytes()


def test_lease_stream_reader_byte_by_byte():
    head = _lease_head()
    recs = [{"id": "x", "offset": 0, "nbytes": 3 * TOKEN_BYTES, "tokens": [0, 3]}, {"end": True}]
    data = head + b"".join(json.dumps(r).encode() + b"\n" for r in recs)
    reader = LeaseStreamReader()
    got = []
    for i in range(len(data)):
        got += reader.feed(data[i : i + 1])
    reader.finish()
    assert reader.head == head and reader.lease["shape"] == [10, L, H] and got == recs
    assert head_size(head[:5]) is None and head_size(head) == len(head)
    assert LEASE_STREAM_MEDIA_TYPE == "application/vnd.hsx.lease-stream"


@pytest.mark.parametrize("tail, error", [
    (b'{"id": "x"}\n', "malformed"),
    (b"not json\n", "not JSON"),
    (b'{"end": true}\n{"end": true}\n', "after its end"),
    (b'{"id": "x", "offset": 0, "nbytes": 4, "tokens": [0, 1]}\n', "ended early"),
])
def test_lease_stream_reader_refuses_malformed_streams(tail, error):
    reader = LeaseStreamReader()
    with pytest.raises(WireFormatError, match=error):
        reader.feed(_lease_head() + tail)
        reader.finish()


def test_worker_bad_plan_fails_the_request_not_the_engine(worker):
    from hsx_service.engine import connector as conn

    c = worker
    c._start_copy(_save(conn, 30))  # 3 blocks of 4 cannot hold 30 tokens
    (end,) = _items(c)
    assert end[1] == "end" and "cannot hold" in end[3]
    assert c.get_finished({"r"})[0] == {"r"}  # its blocks are freed


def test_window_without_an_end_notice_is_freed_after_its_timeout():
    async def main():
        alloc, w, _ = _window()
        forgotten = []
        w._end_timeout, w._on_give_up = 0.05, forgotten.append
        w.on_notice({"key": "k", "ok": True, "chunk": 0, "slot": 0})
        await w.next_chunk()  # out, never given back: the worker died silently
        w.close()
        await asyncio.sleep(0.2)
        assert alloc.used == 0 and forgotten == ["k"]

    asyncio.run(main())


# ------------------------------------------------------- the chunked lease form's expiry
def _lease_stream_reply(window, leases, session="s"):
    """replies.Replies.lease_stream on `window`, with what it reads of the engine stubbed (the
    arena's id) and its metrics recorded nowhere: the real stream and close."""
    from types import SimpleNamespace
    from unittest import mock

    from hsx_service.replies import LeaseTerms, Outgoing, Replies

    replies = Replies(SimpleNamespace(arena=SimpleNamespace(arena_id="a")), None, mock.MagicMock(), leases.timeout)
    replies.record = lambda *a, **k: None
    n = window.num_tokens
    sample = Outgoing(TensorSpec("hidden_states", "F32", (n, L, H)), [TensorSpec("token_ids", "I64", (n,))],
                      [np.zeros(n, np.int64).tobytes()], {}, {}, n, 0.0, 0.0)
    return replies.lease_stream(sample, window, LeaseTerms(leases, session, False))


def test_an_expired_chunk_lease_ends_the_request():
    """Issue 36 item 4: when a silent client's chunk lease expired, the next chunk was offered
    to it, so its request, KV blocks and window stayed held for one --lease-timeout per chunk.
    Now the expiry ends the request: a 410 error record ends the stream, the worker is told to
    cancel (it frees the blocks), and the window is freed once the worker has ended."""
    from hsx_service.engine.lease import Leases

    async def main():
        alloc, w, credits = _window(tokens=12)
        leases = Leases(timeout=0.1, arena_bytes=alloc.size)
        reply = _lease_stream_reply(w, leases)
        stream = reply.stream.__aiter__()
        await stream.__anext__()  # the head
        w.on_notice({"key": "k", "ok": True, "chunk": 0, "slot": 0})
        w.on_notice({"key": "k", "ok": True, "chunk": 1, "slot": 1})
        records = [json.loads(await stream.__anext__()) for _ in range(2)]
        assert [r["tokens"] for r in records] == [[0, 3], [3, 6]]
        await asyncio.sleep(0.3)  # the client released neither: both expire, their slots are credited
        assert ("cancel",) in credits.sent  # the worker stops copying and frees the request's blocks
        w.on_notice({"key": "k", "ok": True, "chunk": 2, "slot": 0})  # landed before the worker saw the cancel
        after = await asyncio.wait_for(stream.__anext__(), 2)  # must not be a lease of chunk 2
        assert json.loads(after)["status"] == 410 and "lease expired" in json.loads(after)["error"]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        reply.close()
        assert alloc.used > 0  # the worker may still write
        w.on_notice({"key": "k", "ok": False, "error": "cancelled", "end": True})
        assert alloc.used == 0 and len(leases) == 0 and leases.client_bytes == 0

    asyncio.run(main())


def test_released_chunk_leases_stream_to_the_end():
    """The same stream read by a client that releases each chunk: every chunk, then the end."""
    from hsx_service.engine.lease import Leases

    async def main():
        alloc, w, credits = _window(tokens=6)
        leases = Leases(timeout=5, arena_bytes=alloc.size)
        reply = _lease_stream_reply(w, leases)
        stream = reply.stream.__aiter__()
        await stream.__anext__()
        for i in range(2):
            w.on_notice({"key": "k", "ok": True, "chunk": i, "slot": i})
            rec = json.loads(await stream.__anext__())
            assert leases.release(rec["id"]) is True
        w.on_notice({"key": "k", "ok": True, "end": True})
        assert json.loads(await stream.__anext__()) == {"end": True}
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        reply.close()
        assert alloc.used == 0 and ("cancel",) not in credits.sent

    asyncio.run(main())

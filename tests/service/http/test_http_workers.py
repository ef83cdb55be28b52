"""HTTP workers (`hsx serve --http-workers N`: service/http/http_workers.py starts them, service/http/http_worker.py
is one): processes that serve the public port, take the states of a POST /hidden_states
under a worker lease from the engine process (which listens on a private Unix socket),
send the body from their own read-only mapping of the arena and release the lease with
a report (lease.SendReport) that the engine process records in its metrics.

Units first (no engine): the default worker count, the release report's header, the
public socket, the body a worker rebuilds from a lease answer, and a worker app (HttpWorkerApp)
in front of a fake engine process: the body it sends and the report it releases with, and
a client leaving as the lease answer arrives (the worker releases that lease). Then one real
`hsx serve --http-workers 2` for the module: bodies byte-identical to the single-process
server's in every coding, errors and other routes relayed, the metrics of a concurrent
batch, clients that hang up mid-request, and a SIGKILLed worker replaced.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import tempfile
from contextlib import asynccontextmanager

import httpx
import numpy as np
import psutil
import pytest
import zstandard

from _server import ServerProcess, engine_core, eventually, frozen, metrics_async
from conftest import need_vllm
from hsx import bf16split, wire
from hsx.wire import TensorSpec, encode_header
from hsx_service.http import http_workers
from hsx_service.core.errors import StartupError
from hsx_service.http.http_worker import HttpWorkerApp
from hsx_service.http.worker_lease_body import rebuild_body
from hsx.protocol.lease import SendReport
from hsx_service.settings import ServiceSettings

WORKERS = 2
LAYERS, HIDDEN = 4, 128  # tiny_model: default layers [1, 2, 3, 6], hidden size 128
IDENTITY = {"Accept-Encoding": "identity"}  # httpx would add zstd by default (zstandard is installed)
ZSTD = {"Accept-Encoding": "zstd"}
BF16SPLIT = {"Accept": bf16split.MEDIA_TYPE, "Accept-Encoding": "zstd"}
CODINGS = {"identity": IDENTITY, "zstd": ZSTD, "bf16split": BF16SPLIT}


# ------------------------------------------------------------------------------ units

@pytest.mark.parametrize("setting, cpu, cores", [(3, True, None), (0, False, 64), (5, False, 4), (1, False, 1)])
def test_an_explicit_worker_count_wins(setting, cpu, cores):
    assert http_workers.resolve_count(setting, cpu, cores) == setting


@pytest.mark.parametrize("cores", [1, 2, 16, 64, None])
def test_no_workers_by_default_on_the_cpu_backend(cores):
    assert http_workers.resolve_count(None, True, cores) == 0  # the engine computes on the same cores


@pytest.mark.parametrize("cores, count", [(1, 2), (4, 2), (8, 2), (12, 3), (16, 4), (20, 5), (32, 8), (64, 8),
                                          (256, 8)])
def test_gpu_default_is_a_quarter_of_the_cores_two_to_eight(cores, count):
    assert http_workers.resolve_count(None, False, cores) == count


def test_gpu_default_counts_this_process_s_cores():
    assert 2 <= http_workers.resolve_count(None, False) <= http_workers.MAX_AUTO


def test_send_report_header_round_trip():
    for report in (SendReport(123456, 7890, True, 0.25, 0.125, "zstd"),
                   SendReport(0, 0, False, 0.0, 0.0, "identity"),
                   SendReport(1 << 40, 3, True, 1e-6, 12.5, "bf16split")):
        header = report.header()
        assert header.isascii() and "\n" not in header and " " not in header  # a valid header value
        assert SendReport.parse(header) == report


@pytest.mark.parametrize("value", [
    None, "", "garbage", "{", "null", "[]", "1", '"raw"', "{}",
    '{"raw":1,"wire":2,"complete":true,"send_s":0.1,"work_s":0.1}',  # no coding
    '{"raw":"many","wire":2,"complete":true,"send_s":0.1,"work_s":0.1,"coding":"zstd"}',
    '{"raw":1,"wire":2,"complete":true,"send_s":"soon","work_s":0.1,"coding":"zstd"}',
    '{"raw":null,"wire":2,"complete":true,"send_s":0.1,"work_s":0.1,"coding":"zstd"}',
])
def test_send_report_parse_of_garbage_is_none(value):
    assert SendReport.parse(value) is None


def test_bind_public_refuses_a_port_in_use_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=rf"127\.0\.0\.1:{port}\b"):
            http_workers.bind_public("127.0.0.1", port)


def test_bind_public_listens_and_is_inheritable():
    sock = http_workers.bind_public("127.0.0.1", 0)
    try:
        assert sock.get_inheritable() and sock.getsockname()[1] > 0
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass  # it listens: the connection waits in its backlog
    finally:
        sock.close()


class FakeArena:
    """What rebuild_body needs of hsx_client.shm.ArenaMap: read-only views by offset."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.asked: list[tuple[int, int]] = []

    def view(self, offset: int, nbytes: int) -> memoryview:
        self.asked.append((offset, nbytes))
        return memoryview(self.data)[offset : offset + nbytes]


def _engine_reply(mask: bool, offset: int = 4096, n: int = 7):
    """What the engine process makes of one request (serving.HiddenStatesService._reply):
    the body it sends itself, and the lease answer it gives an HTTP worker instead (the
    same tensors and metadata without the states, the lease's description last), with
    an arena holding the states at `offset`."""
    rng = np.random.default_rng(n + offset)
    states = rng.integers(0, 1 << 16, size=(n, LAYERS, 8), dtype=np.uint16).tobytes()  # bf16 bit patterns
    arena = bytearray(rng.integers(0, 256, size=offset + len(states) + 512, dtype=np.uint8).tobytes())
    arena[offset : offset + len(states)] = states
    ids = rng.integers(0, 1000, size=n, dtype=np.int64)
    specs = [TensorSpec("hidden_states", "BF16", (n, LAYERS, 8)), TensorSpec("token_ids", "I64", (n,))]
    parts: list[bytes] = [states, ids.tobytes()]
    if mask:
        specs.append(TensorSpec("loss_mask", "U8", (n,)))
        parts.append(rng.integers(0, 2, size=n, dtype=np.uint8).tobytes())
    metadata = {"format": wire.FORMAT, "model": "tiny", "model_path": "/m", "model_revision": "",
                "layer_ids": json.dumps([1, 2, 3, 6]), "num_hidden_layers": 6, "hidden_size": 8, "dtype": "bfloat16",
                "last_layer_pre_norm": "true", "loss_mask_source": "request" if mask else "none",
                "request_id": "rid-7", "caller_id": "", "chat_template_sha256": "", "num_input_tokens": n + 3}
    engine_body = encode_header(specs, metadata) + b"".join(parts)
    lease = {"id": "ab" * 16, "arena_id": "cd" * 16, "offset": offset, "nbytes": len(states), "dtype": "BF16",
             "shape": [n, LAYERS, 8], "expires_in": None}
    answer = encode_header(specs[1:], {**metadata, "lease": json.dumps(lease)}) + b"".join(parts[1:])
    return engine_body, answer, FakeArena(bytes(arena)), specs, metadata


@pytest.mark.parametrize("mask", [True, False])
def test_rebuild_gives_the_engine_process_s_body(mask):
    engine_body, answer, arena, specs, metadata = _engine_reply(mask)
    lease = wire.lease_of(answer)
    got_specs, parts, got_meta = rebuild_body(answer, lease, arena)
    assert got_specs == specs and got_specs[0].name == "hidden_states"
    assert arena.asked == [(lease["offset"], lease["nbytes"])]
    assert list(got_meta) == list(metadata) and "lease" not in got_meta
    assert got_meta == {k: str(v) for k, v in metadata.items()}
    assert [len(p) for p in parts] == [s.nbytes for s in specs]
    assert encode_header(got_specs, got_meta) + b"".join(bytes(p) for p in parts) == engine_body


def test_rebuild_refuses_a_lease_that_disagrees_with_its_shape_or_a_truncated_answer():
    _, answer, arena, _, _ = _engine_reply(True)
    lease = wire.lease_of(answer)
    with pytest.raises(wire.WireFormatError, match="lease of"):
        rebuild_body(answer, {**lease, "nbytes": lease["nbytes"] - 2}, arena)
    with pytest.raises(wire.WireFormatError, match="truncated"):
        rebuild_body(answer[:-1], lease, arena)


class FakeEngine:
    """The engine process's side of a worker's POST /hidden_states, on a Unix socket, in
    just enough HTTP/1.1: the request is answered with `answer` (a worker lease) in one
    write, after which the engine process counts the lease as delivered (serving.py
    `close_lease`: its stream completed); DELETE /leases/{id} records the release and
    its X-Hsx-Sent report."""

    def __init__(self, path: str, answer: bytes, content_type: str = wire.LEASE_MEDIA_TYPE) -> None:
        self.path = path
        self.answer = answer
        self.content_type = content_type
        self.delivered = asyncio.Event()
        self.released: dict[str, str | None] = {}
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> "FakeEngine":
        self.server = await asyncio.start_unix_server(self._serve, path=self.path)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, target, _ = head[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "POST":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + self.content_type.encode()
                                 + b"\r\nx-request-id: rid-7\r\nx-hsx-num-tokens: 7\r\ncontent-length: "
                                 + str(len(self.answer)).encode() + b"\r\n\r\n" + self.answer)
                    await writer.drain()
                    self.delivered.set()
                else:
                    self.released[target.rsplit("/", 1)[1]] = headers.get("x-hsx-sent")
                    writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class MappedArena(FakeArena):
    """FakeArena as HttpWorkerApp holds it: with the arena's id and the worker's session."""

    arena_id = "cd" * 16
    session = "ef" * 16

    def close(self) -> None:
        pass


@asynccontextmanager
async def _worker(answer: bytes, arena: FakeArena, content_type: str = wire.LEASE_MEDIA_TYPE):
    """A FakeEngine answering `answer` and a HttpWorkerApp (front.py) in front of it, through
    its lifespan, its arena already mapped: (engine, app)."""
    with tempfile.TemporaryDirectory(prefix="hsx-http-worker-") as tmp:  # short: a Unix socket path
        async with FakeEngine(os.path.join(tmp, "engine.sock"), answer, content_type) as engine:
            app = HttpWorkerApp(ServiceSettings(), engine.path, "worker-token", threads=1)
            inbox: asyncio.Queue = asyncio.Queue()
            outbox: asyncio.Queue = asyncio.Queue()
            lifespan = asyncio.ensure_future(app({"type": "lifespan"}, inbox.get, outbox.put))
            await inbox.put({"type": "lifespan.startup"})
            assert (await outbox.get())["type"] == "lifespan.startup.complete"
            app.arena = MappedArena(arena.data)
            try:
                yield engine, app
            finally:
                await inbox.put({"type": "lifespan.shutdown"})
                await asyncio.wait_for(lifespan, 10)


async def _call(app: HttpWorkerApp, client_leaves: asyncio.Event) -> list[dict]:
    """POST /hidden_states (identity) to the worker app; the client disconnects when
    `client_leaves` is set. Returns the ASGI messages the worker sent."""
    scope = {"type": "http", "method": "POST", "path": "/hidden_states", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")],
             "state": {"request_id": "rid-7"}}
    messages = [{"type": "http.request", "body": b'{"input_ids": [1, 2, 3]}', "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await client_leaves.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def test_worker_app_sends_the_engine_process_s_body_and_reports_it():
    engine_body, answer, arena, _, _ = _engine_reply(True)
    lease_id = wire.lease_of(answer)["id"]
    async with _worker(answer, arena) as (engine, app):
        sent = await _call(app, asyncio.Event())  # the client stays

        async def released() -> bool:
            return lease_id in engine.released

        await eventually(released, 10, "the worker released its lease")
    start, *chunks = sent
    headers = dict(start["headers"])
    assert start["status"] == 200 and headers[b"content-type"] == wire.MEDIA_TYPE.encode()
    assert headers[b"x-request-id"] == b"rid-7" and headers[b"x-hsx-num-tokens"] == b"7"
    assert int(headers[b"content-length"]) == len(engine_body)
    assert b"".join(bytes(c["body"]) for c in chunks) == engine_body and not chunks[-1]["more_body"]
    report = SendReport.parse(engine.released[lease_id])
    assert report is not None and report.complete and report.coding == "identity"
    assert report.raw == report.wire == len(engine_body)


def _lease_stream_reply(split_at: int = 3):
    """The chunked lease form of _engine_reply's answer (issue 29): the head, then the states
    as two chunk leases at two arena offsets, then the end."""
    engine_body, answer, arena, specs, metadata = _engine_reply(True)
    lease = wire.lease_of(answer)
    n, row = specs[0].shape[0], specs[0].nbytes // specs[0].shape[0]
    states = arena.data[lease["offset"] : lease["offset"] + lease["nbytes"]]
    first, second = states[: split_at * row], states[split_at * row :]
    data = bytearray(8192 + len(second))
    data[0 : len(first)] = first
    data[8192:] = second
    head_lease = {"chunked": True, "arena_id": lease["arena_id"], "dtype": "BF16", "shape": lease["shape"],
                  "expires_in": None}
    ids_and_mask = answer[len(answer) - n * 9:]  # int64 ids, uint8 mask: the lease answer's data
    head = encode_header(specs[1:], {**metadata, "lease": json.dumps(head_lease)}) + ids_and_mask
    records = [{"id": "c0", "offset": 0, "nbytes": len(first), "tokens": [0, split_at]},
               {"id": "c1", "offset": 8192, "nbytes": len(second), "tokens": [split_at, n]}, {"end": True}]
    body = head + b"".join(json.dumps(r).encode() + b"\n" for r in records)
    return engine_body, body, FakeArena(bytes(data))


async def test_worker_app_sends_a_chunked_lease_as_the_same_body_and_releases_each_chunk():
    engine_body, answer, arena = _lease_stream_reply()
    async with _worker(answer, arena, wire.LEASE_STREAM_MEDIA_TYPE) as (engine, app):
        sent = await _call(app, asyncio.Event())

        async def released() -> bool:
            return {"c0", "c1"} <= set(engine.released)

        await eventually(released, 10, "the worker released each chunk's lease")
    start, *chunks = sent
    headers = dict(start["headers"])
    assert start["status"] == 200 and int(headers[b"content-length"]) == len(engine_body)
    assert b"".join(bytes(c["body"]) for c in chunks) == engine_body and not chunks[-1]["more_body"]


async def test_a_client_leaving_as_the_lease_arrives_leaves_no_lease_held():
    """The engine process has written its lease answer (for it, delivered: serving.py
    `close_lease`) when the client hangs up: the worker must release that lease, having
    sent nothing (its report says incomplete, so the request counts as aborted)."""
    _, answer, arena, _, _ = _engine_reply(True)
    lease_id = wire.lease_of(answer)["id"]
    async with _worker(answer, arena) as (engine, app):
        await _call(app, engine.delivered)  # the client leaves once the answer is on its way

        async def released() -> bool:
            return lease_id in engine.released

        await eventually(released, 2, "the lease the client never got released")
    report = SendReport.parse(engine.released[lease_id])
    assert report is not None and not report.complete


# ------------------------------------------------------------- one server with workers

@pytest.fixture(scope="module")
def fronted(tiny_model, log_dir, request):
    """tiny_server's configuration with two HTTP workers. When the session's tiny_server
    is wanted too and not up yet, both engines start at once."""
    need_vllm()
    server = ServerProcess(str(tiny_model), "--dtype", "bfloat16", "--max-model-len", "1024",
                           "--http-workers", str(WORKERS), log_dir=log_dir, name="http-workers")
    try:
        if any("tiny_server" in getattr(item, "fixturenames", ()) for item in request.session.items):
            request.getfixturevalue("tiny_server")
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(6, 1000) for _ in range(n - 1)]


async def _post_raw(client: httpx.AsyncClient, url: str, ids: list[int], headers: dict[str, str]):
    """The response and its body as it came over the wire (not decoded)."""
    async with client.stream("POST", url + "/hidden_states", json={"input_ids": ids}, headers=headers) as r:
        raw = b"".join([chunk async for chunk in r.aiter_raw()])
    return r, raw


def _plain(r: httpx.Response, raw: bytes) -> bytes:
    """The safetensors body of a response, whatever its coding."""
    if r.headers["content-type"] == bf16split.MEDIA_TYPE:
        return bytes(bf16split.decode_body(raw))
    if r.headers.get("content-encoding") == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    return raw


def _headers(r: httpx.Response) -> list[tuple[str, str]]:
    """A response's headers but those of the connection (date, server)."""
    return sorted((k.lower(), v) for k, v in r.headers.items() if k.lower() not in ("date", "server"))


def _workers(server: ServerProcess) -> list[psutil.Process]:
    """The server's live HTTP worker processes."""
    out = []
    for child in psutil.Process(server.proc.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "hsx_service.http.http_worker" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.Error:
            pass
    return out


Expected = tuple[str, dict[str, str], float]  # a sample of /metrics: name, labels, value


async def _settled(client: httpx.AsyncClient, server: ServerProcess, what: str, *expected: Expected,
                   timeout: float = 30) -> None:
    """Eventually: no lease live, the arena empty, nothing in flight, and the `expected` samples."""
    want = [("hsx_leases_live", {}, 0), ("hsx_arena_used_bytes", {}, 0), ("hsx_inflight_requests", {}, 0), *expected]
    seen: dict[str, float] = {}

    async def check() -> bool:
        m = await metrics_async(client, server.url)
        for name, labels, _ in want:
            seen[name + (json.dumps(labels) if labels else "")] = m.get(name, 0, **labels)
        return all(m.get(name, 0, **labels) == value for name, labels, value in want)

    try:
        await eventually(check, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen {seen}, wanted {want}") from None


@pytest.mark.engine
async def test_bodies_are_byte_identical_to_the_single_process_server_s(fronted, tiny_server):
    ids = _prompt(1, 77)
    rid = "same-body-1"  # in the metadata: the same for every coding, so the plain bodies agree too
    plain = {}
    async with httpx.AsyncClient(timeout=120) as client:
        for coding, headers in CODINGS.items():
            (r1, raw1), (r2, raw2) = [await _post_raw(client, s.url, ids, {**headers, "X-Request-Id": rid})
                                      for s in (fronted, tiny_server)]
            for r in (r1, r2):
                assert r.status_code == 200, (coding, r.status_code)
                assert r.headers["x-request-id"] == rid and r.headers["x-hsx-num-tokens"] == str(len(ids))
            expected_type = bf16split.MEDIA_TYPE if coding == "bf16split" else wire.MEDIA_TYPE
            assert r1.headers["content-type"] == r2.headers["content-type"] == expected_type, coding
            expected_encoding = "zstd" if coding == "zstd" else None
            assert r1.headers.get("content-encoding") == r2.headers.get("content-encoding") == expected_encoding
            if coding == "identity":
                assert int(r1.headers["content-length"]) == len(raw1)
            assert raw1 == raw2, f"{coding}: {len(raw1)} bytes from the workers, {len(raw2)} from one process"
            assert _headers(r1) == _headers(r2), coding
            plain[coding] = _plain(r1, raw1)
    assert plain["zstd"] == plain["identity"] and plain["bf16split"] == plain["identity"]
    d = wire.decode(plain["identity"])
    assert d.token_ids.tolist() == ids and tuple(d.hidden_states.shape) == (len(ids), LAYERS, HIDDEN)
    assert d.metadata["request_id"] == rid and "lease" not in d.metadata


@pytest.mark.engine
async def test_errors_and_other_routes_are_relayed(fronted):
    url = fronted.url
    async with httpx.AsyncClient(timeout=60, headers=IDENTITY) as client:
        r = await client.post(url + "/hidden_states", json={"input_ids": [1, 5, 10**7]},
                              headers={"X-Request-Id": "oov-1"})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["type"] == "invalid_request" and "outside the vocabulary" in err["message"]
        assert r.headers["x-request-id"] == "oov-1"
        r = await client.post(url + "/hidden_states", content=b'{"input_ids": [1, 2',
                              headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request"
        r = await client.post(url + "/hidden_states", content=b"input_ids=1", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415  # the worker's own guard
        r = await client.get(url + "/no-such-route")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"

        assert (await client.get(url + "/health")).json() == {"status": "ok"}
        assert (await client.get(url + "/ready")).json() == {"status": "ready"}
        info = (await client.get(url + "/info")).json()
        assert (info["hidden_size"], info["max_model_len"], info["dtype"]) == (HIDDEN, 1024, "bfloat16")
        assert len(info["layer_ids"]) == LAYERS
        r = await client.post(url + "/tokenize", json={"input_ids": [1, 7, 8]})
        assert r.status_code == 200 and r.json()["token_ids"] == [1, 7, 8]
        r = await client.get(url + "/metrics")
        assert r.status_code == 200 and f"hsx_http_workers {WORKERS:.1f}" in r.text
        assert (await metrics_async(client, url)).get("hsx_http_workers") == WORKERS


@pytest.mark.engine
async def test_a_same_host_client_s_own_lease_is_relayed(fronted):
    import torch

    from hsx_client.api import HsxClient

    ids = _prompt(2, 30)
    async with HsxClient(fronted.url) as client:
        leased = await client.hidden_states_response({"input_ids": ids}, lease_ok=True)
        assert leased.lease is not None  # the engine process's own lease, asked for through a worker
        body = await client.hidden_states_response({"input_ids": ids})
        assert body.lease is None
        a, b = body.decode(), leased.decode()
        assert b.token_ids.tolist() == ids == a.token_ids.tolist()
        assert bytes(leased.lease.states) == a.hidden_states.reshape(-1).view(torch.uint8).numpy().tobytes()
        await client.release_lease(leased.lease)
    async with httpx.AsyncClient(timeout=30) as probe:
        await _settled(probe, fronted, "the client's lease released")


@pytest.mark.engine
async def test_a_concurrent_batch_is_counted_and_leaves_nothing_held(fronted):
    rng = random.Random(3)
    prompts = [_prompt(100 + i, rng.randrange(20, 300)) for i in range(16)]
    codings = list(CODINGS.values())
    async with httpx.AsyncClient(timeout=120) as client:
        m0 = await metrics_async(client, fronted.url)
        rs = await asyncio.gather(*[
            _post_raw(client, fronted.url, ids, {**codings[i % 3], "X-Request-Id": f"batch-{i}"})
            for i, ids in enumerate(prompts)])
        for i, ((r, raw), ids) in enumerate(zip(rs, prompts)):
            assert r.status_code == 200, (i, r.status_code, raw[:300])
            assert r.headers["x-request-id"] == f"batch-{i}" and r.headers["x-hsx-num-tokens"] == str(len(ids))
            d = wire.decode(_plain(r, raw))
            assert d.token_ids.tolist() == ids and tuple(d.hidden_states.shape) == (len(ids), LAYERS, HIDDEN)
            assert d.metadata["request_id"] == f"batch-{i}"

        def grown(name: str, by: float, **labels: str) -> Expected:
            return name, labels, m0.get(name, 0, **labels) + by

        # recorded when each worker releases its lease with its report, just after the body's end
        await _settled(client, fronted, "16 concurrent requests recorded, their leases released",
                       grown("hsx_requests_total", 16, status="ok"),
                       grown("hsx_tokens_total", sum(map(len, prompts))),
                       grown("hsx_leases_total", 16, outcome="granted"),  # every body under a worker lease
                       grown("hsx_leases_total", 16, outcome="released"),
                       grown("hsx_response_bytes_total", sum(len(raw) for _, raw in rs)),  # the workers' reports
                       *(grown("hsx_requests_total", 0, status=s) for s in ("aborted", "error", "disconnected")))


@pytest.mark.engine
async def test_clients_that_hang_up_in_the_engine_leave_nothing_held(fronted):
    """1000-token prompts hung up on once they are in the engine behind a dozen others, so
    the hang-up reaches the engine process before their answer could: no lease and no arena
    byte stays, and the requests that were not hung up on are served and counted. The engine
    core is frozen (SIGSTOP) until the hang-ups, which makes "before" certain (polling for a
    busy engine raced the prefills on a loaded CI box). (A client that leaves just as its
    lease answer arrives is the FakeEngine case above.)"""
    url = fronted.url
    blockers, victims, rounds = 12, 3, 3
    core = engine_core(fronted)
    async with httpx.AsyncClient(timeout=30) as probe:
        m0 = await metrics_async(probe, url)
        for round_ in range(rounds):
            seed = 3000 + 100 * round_
            async with httpx.AsyncClient(timeout=120, headers=IDENTITY) as client:
                def post(ids: list[int]) -> asyncio.Future:
                    return asyncio.ensure_future(client.post(url + "/hidden_states", json={"input_ids": ids}))

                async def in_engine(n: int) -> bool:
                    return (await metrics_async(probe, url)).get("hsx_engine_requests") == n

                served = [_prompt(seed + i, 1000) for i in range(blockers)]
                with frozen(core):
                    calls = [post(ids) for ids in served]
                    await eventually(lambda: in_engine(blockers), 30, "the first prompts in the engine")
                    hung = [post(_prompt(seed + 50 + i, 1000)) for i in range(victims)]
                    await eventually(lambda: in_engine(blockers + victims), 30, "the hung-up prompts in the engine")
                    for call in hung:
                        call.cancel()  # closes that connection mid-request
                    cut = await asyncio.gather(*hung, return_exceptions=True)
                done = await asyncio.gather(*calls)
            assert all(isinstance(r, asyncio.CancelledError) for r in cut), f"round {round_}: {cut}"
            assert [r.status_code for r in done] == [200] * blockers
            assert [wire.decode(r.content).token_ids.tolist() for r in done] == served
            await _settled(probe, fronted, f"round {round_}: nothing held after {victims} hang-ups")
        m = await metrics_async(probe, url)

    def grown(status: str) -> float:
        return m.get("hsx_requests_total", 0, status=status) - m0.get("hsx_requests_total", 0, status=status)

    # Every body that was asked for sent and counted; the hang-ups cut before any answer
    # (the engine process counts those that reached it as disconnected, and only so).
    assert grown("ok") == rounds * blockers and grown("aborted") == 0 and grown("error") == 0
    assert 1 <= grown("disconnected") <= rounds * victims
    r = await asyncio.to_thread(httpx.post, url + "/hidden_states", json={"input_ids": [1, 2, 3]}, headers=IDENTITY)
    assert r.status_code == 200 and wire.decode(r.content).token_ids.tolist() == [1, 2, 3]


def _serving(workers: list[psutil.Process], client_port: int) -> psutil.Process | None:
    """The worker holding the TCP connection from the client's `client_port`."""
    for w in workers:
        try:
            conns = w.net_connections(kind="tcp") if hasattr(w, "net_connections") else w.connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.raddr and c.raddr.port == client_port for c in conns):
            return w
    return None


async def _kill_and_wait_replaced(server: ServerProcess, victim: psutil.Process) -> None:
    victim.kill()

    async def replaced() -> bool:
        live = {p.pid for p in _workers(server)}
        if victim.pid in live or len(live) != WORKERS:
            return False
        try:  # a fresh connection: the killed worker's keep-alive ones are gone
            async with httpx.AsyncClient(timeout=10) as probe:
                return (await metrics_async(probe, server.url)).get("hsx_http_workers") == WORKERS
        except httpx.HTTPError:
            return False

    await eventually(replaced, 30, f"HTTP worker {victim.pid} replaced")


@pytest.mark.engine
async def test_a_killed_worker_is_replaced_and_its_lease_ends(fronted):
    """SIGKILL the worker that holds a lease (its client reads nothing of its bodies):
    the lease ends with the worker's arena session and the arena is empty again. Then the
    other original worker: each is replaced (hsx_http_workers back to 2), and the
    replacements serve bodies under worker leases of their own."""
    url = fronted.url
    original = _workers(fronted)
    assert len(original) == WORKERS, original
    async with httpx.AsyncClient(timeout=30) as probe:
        m0 = await metrics_async(probe, url)

        last_granted: list[float] = []

        async def blocked_holding_a_lease() -> bool:  # one lease live, and no new one since the last poll
            m = await metrics_async(probe, url)
            last_granted.append(m.get("hsx_leases_total", 0, outcome="granted"))
            return m.get("hsx_leases_live") == 1 and last_granted[-2:-1] == last_granted[-1:]

        # Pipelined 1 MB bodies to a client that reads nothing: the kernel takes the first few
        # MB (the socket's send buffer grows to 4 MB), then the worker waits, holding a lease.
        body = json.dumps({"input_ids": _prompt(4000, 1000)}).encode()
        request = (b"POST /hidden_states HTTP/1.1\r\nHost: hsx\r\nContent-Type: application/json\r\n"
                   b"Accept-Encoding: identity\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        try:
            stalled.connect(("127.0.0.1", fronted.port))
            stalled.sendall(request * 8)
            await eventually(blocked_holding_a_lease, 30, "a worker blocked on its client, holding a lease")
            holder = _serving(original, stalled.getsockname()[1])
            assert holder is not None, "no original worker holds the stalled client's connection"
            await _kill_and_wait_replaced(fronted, holder)
            async with httpx.AsyncClient(timeout=30) as fresh:  # the probe's connection may have been the holder's
                await _settled(fresh, fronted, "the killed worker's lease ended with its arena session",
                               ("hsx_leases_total", {"outcome": "client_gone"},
                                m0.get("hsx_leases_total", 0, outcome="client_gone") + 1),
                               ("hsx_requests_total", {"status": "aborted"},
                                m0.get("hsx_requests_total", 0, status="aborted") + 1))
        finally:
            stalled.close()
    await _kill_and_wait_replaced(fronted, next(w for w in original if w.pid != holder.pid))
    assert not {p.pid for p in original} & {p.pid for p in _workers(fronted)}
    assert fronted.log_path.read_text(errors="replace").count("exited with status -9; starting another") >= WORKERS
    prompts = [_prompt(2000 + i, 50 + 20 * i) for i in range(8)]
    codings = list(CODINGS.values())
    async with httpx.AsyncClient(timeout=120) as client:
        m1 = await metrics_async(client, url)
        rs = await asyncio.gather(*[_post_raw(client, url, ids, codings[i % 3]) for i, ids in enumerate(prompts)])
        for (r, raw), ids in zip(rs, prompts):
            assert r.status_code == 200, (r.status_code, raw[:300])
            assert wire.decode(_plain(r, raw)).token_ids.tolist() == ids
        await _settled(client, fronted, "the replacements' leases released",
                       ("hsx_leases_total", {"outcome": "granted"},
                        m1.get("hsx_leases_total", 0, outcome="granted") + len(prompts)),
                       ("hsx_requests_total", {"status": "ok"},
                        m1.get("hsx_requests_total", 0, status="ok") + len(prompts)),
                       ("hsx_http_workers", {}, WORKERS))

"""An HTTP worker: one of the `--http-workers` processes that serve the public port.

Why: one Python process moves about 1 GB/s of response bodies (one event loop, one GIL),
and the engine's own process also runs vLLM's output handling on that loop; an H200 makes
1.4-4 GB/s of states (bench/README.md). So with HTTP workers the engine process
(lifecycle.py) listens only on a private Unix socket and does what needs the engine:
validation, tokenizing, admission, the prefill, the arena and the metrics. The workers
share the public listening socket (the kernel spreads connections over them) and move
the bytes, each on its own core(s):

- `POST /hidden_states` asking for a body: after the guard (headers, key, body limits:
  guard.py, as in the engine process), forwarded to the engine process over its socket
  as a request for a *worker lease* (this worker's token as the key, its arena session:
  service/engine/lease.py). The answer names the states' range in the shared arena; the worker
  builds the very body the engine process would have sent (body.py: identity, zstd or
  bf16split, compressed on this worker's own thread pool) from its read-only mapping of
  the arena, then releases the lease with a report of what it sent (lease.SendReport),
  which the engine process records in its metrics. A worker lease has no timeout (the
  range is held while the body is sent, as in the engine process); it ends when the
  worker releases it or the worker's process ends (its arena session closes).
- Everything else (probes, /info, /metrics, /tokenize, /final_norm, lease releases,
  the docs, a same-host client's own lease request): relayed to the engine process
  unchanged, so there is one owner of every answer and of every metric.
- The engine process unreachable (starting up, stopping): 503 with Retry-After.

A worker ignores SIGTERM / SIGINT: the engine process drains and then stops its workers
by closing their standard input (http_workers.py), which they also see if it dies.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from hsx import lifeline
from hsx.dtypes import BY_ST
from hsx.protocol.lease import EXCHANGE_HEADER, SENT_HEADER, SESSION_HEADER, ArenaMap, SendReport, ShmUnavailable, attach
from hsx.wire import LEASE_MEDIA_TYPE, LeaseStreamReader, TensorSpec, WireFormatError, lease_of
from hsx_service.core.admission import AdmissionGate
from hsx_service.body.encode import encode_body
from hsx_service.body.compress import CompressPool
from hsx_service.http.connections import protocol_for
from hsx_service.http.disconnect import race_client
from hsx_service.core.errors import EngineFailure, NotReady, ServiceError
from hsx_service.http.errors import render
from hsx_service.http.guard import GuardMiddleware
from hsx_service.core.metrics import Metrics
from hsx_service.body.negotiate import accepts_media, choose_coding
from hsx_service.body.response import Stats
from hsx_service.http.worker_lease_body import is_lease, is_lease_stream, rebuild_body
from hsx_service.settings import ServiceSettings

log = logging.getLogger("hsx.http_worker")

CONFIG_ENV = "HSX_HTTP_WORKER"  # JSON: fd, upstream, token, index, threads, settings (http_workers.py writes it)
UPSTREAM_BASE = "http://hsx-engine"
UNREACHABLE_RETRY = 2.0  # seconds a client waits before retrying when the engine process is unreachable
ARENA_RETRY = 30.0  # seconds before a worker that could not map the arena tries again
# Not relayed: they describe one connection, not the message (RFC 9110 section 7.6.1).
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host", b"te", b"trailer",
              b"upgrade", b"proxy-authorization", b"proxy-authenticate"}


def _forwarded_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in HOP_BY_HOP]


async def _read_body(receive) -> bytes | None:
    """The request's body (for /hidden_states the guard has read it: one message); None
    when the client left."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class HttpWorkerApp:
    """The worker's ASGI app (behind GuardMiddleware): see the module docstring."""

    def __init__(self, settings: ServiceSettings, upstream: str, token: str, threads: int) -> None:
        self.settings = settings
        self.upstream_path = upstream
        self.token = token
        self.auth = {"authorization": f"Bearer {self.token}"}  # to the engine process, as its internal key
        self.threads = threads
        self.client: httpx.AsyncClient | None = None
        self.pool: CompressPool | None = None
        self.arena: ArenaMap | None = None  # once mapped
        self._arena_lock = asyncio.Lock()
        self._arena_retry_at = 0.0

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        rid = scope.get("state", {}).get("request_id")
        try:
            if scope["path"] == "/hidden_states" and scope["method"] == "POST":
                await self._hidden_states(scope, receive, send, rid)
            else:
                await self._relay(scope, receive, send)
        except ServiceError as exc:
            await render(exc, rid, None)(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.client = httpx.AsyncClient(
                    transport=httpx.AsyncHTTPTransport(uds=self.upstream_path),
                    base_url=UPSTREAM_BASE,
                    # The engine process bounds each request (--request-timeout: 504); only a
                    # connection that cannot be made is this worker's to time out.
                    timeout=httpx.Timeout(None, connect=5.0),
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                )
                self.pool = CompressPool(self.threads, self.settings.compress_inflight, self.settings.zstd_level,
                                         frame_threads=self.settings.zstd_frame_threads)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.aclose()
                if self.pool is not None:
                    self.pool.shutdown()
                if self.arena is not None:
                    self.arena.close()  # ends this worker's arena session
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ relaying
    async def _relay(self, scope, receive, send, body: bytes | None = None) -> None:
        """The request to the engine process, its answer back, both as they are."""
        if body is None:
            body = await _read_body(receive)
            if body is None:
                return
        path = scope["path"] + (("?" + scope["query_string"].decode("latin-1")) if scope.get("query_string") else "")
        request = self.client.build_request(scope["method"], path, headers=_forwarded_headers(scope["headers"]),
                                            content=body)
        work = asyncio.ensure_future(self._relay_answer(request, send))
        (await race_client(work, receive)).cancel()
        if not work.done():  # the client left: closing the upstream connection aborts its request there
            work.cancel()
        if work.done() and not work.cancelled():
            work.result()

    async def _relay_answer(self, request: httpx.Request, send) -> None:
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc
        try:
            headers = _forwarded_headers(response.headers.raw)
            if "content-length" in response.headers:  # known length: keep it (not chunked)
                headers.append((b"content-length", response.headers["content-length"].encode()))
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            async for chunk in response.aiter_raw():  # as sent: a Content-Encoding stays valid
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    # ------------------------------------------------------------------ /hidden_states
    async def _hidden_states(self, scope, receive, send, rid: str | None) -> None:
        body = await _read_body(receive)
        if body is None:
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        # A same-host client asking a lease of its own (where the server offers them) or no
        # mapping here: the engine process answers it itself.
        client_lease = self.settings.shm_lease and accepts_media(headers.get("accept"), LEASE_MEDIA_TYPE)
        arena = None if client_lease else await self._arena()
        if arena is None:
            return await self._relay(scope, receive, send, body)
        # identity: were the answer a body after all (the engine process did not know this
        # worker's session), it is relayed as read, with no Content-Encoding to mislabel.
        forward = {"content-type": "application/json", "accept": LEASE_MEDIA_TYPE, "accept-encoding": "identity",
                   **self.auth, SESSION_HEADER: arena.session}
        if rid:
            forward["x-request-id"] = rid
        exchange = forward[EXCHANGE_HEADER] = secrets.token_hex(16)
        work = asyncio.ensure_future(self._post_states(body, forward))
        gone = await race_client(work, receive)
        if not work.done():
            # The client left. The exchange is never cut short: once the engine process has
            # written a lease answer it counts it delivered, and only this worker can end that
            # lease. The engine process is asked to abort the request instead; its answer
            # (499, or a lease if it was done first) is still read, and a lease released.
            await self._abort(exchange, work)
            return
        try:
            answer = work.result()
        except httpx.TransportError as exc:
            gone.cancel()
            raise _unreachable(exc) from exc
        if is_lease_stream(answer):
            return await self._send_lease_stream(answer, headers, arena, send, gone)
        if not is_lease(answer):
            gone.cancel()  # an error (or a body the engine process sent itself): as it is
            out = _forwarded_headers(answer.headers.raw)
            out.append((b"content-length", str(len(answer.content)).encode()))
            await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
            await send({"type": "http.response.body", "body": answer.content, "more_body": False})
            return
        await self._send_leased(answer, headers, arena, send, gone)

    async def _abort(self, exchange: str, work: asyncio.Future) -> None:
        try:
            await self.client.delete(f"/exchanges/{exchange}", headers=self.auth)
        except httpx.HTTPError as exc:
            log.warning("abort of a request whose client left failed: %s", exc)
        try:
            answer = await work
        except httpx.HTTPError:
            return  # no answer: nothing was granted, or the engine process saw the connection fail
        if is_lease_stream(answer):  # closing it ends its chunk leases (the engine process's serving.py)
            await answer.aclose()
            return
        if not is_lease(answer):
            return
        try:
            lease_id = lease_of(answer.content)["id"]
        except WireFormatError:
            return
        await self._release(lease_id, SendReport(0, 0, False, 0.0, 0.0, "identity"))

    async def _send_leased(self, answer: httpx.Response, headers: dict[str, str], arena, send,
                           gone: asyncio.Future) -> None:
        """The body from this worker's mapping of the arena; the lease is released (with
        the report) however the sending ends."""
        t_send = time.perf_counter()
        content = answer.content
        stats = Stats()
        coding = "identity"
        lease = None
        try:
            lease = lease_of(content)
            if lease["arena_id"] != arena.arena_id:
                raise WireFormatError(f"lease of arena {lease['arena_id']}, this worker maps {arena.arena_id}")
            specs, parts, metadata = rebuild_body(content, lease, arena)
            coding = choose_coding(headers.get("accept"), headers.get("accept-encoding"), BY_ST[lease["dtype"]].name)
            body_headers, stream = encode_body(specs, parts, metadata, coding, stats, self.pool)
            try:
                await _send_body(send, answer, body_headers, stream, gone)
            finally:
                await stream.aclose()  # nothing reads the range after this
        except (WireFormatError, KeyError, ValueError) as exc:
            log.error("unusable lease answer from the engine process: %s", exc)
            raise EngineFailure("the engine process answered with an unusable lease") from exc
        finally:
            gone.cancel()
            if lease is not None:
                report = SendReport(stats.raw, stats.wire, stats.complete, time.perf_counter() - t_send, stats.work_s,
                                    coding)
                await asyncio.shield(self._release(lease["id"], report))

    async def _post_states(self, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """The engine process's answer: read whole, except the chunked lease form, left open
        (its records come as the chunks land)."""
        answer = await self.client.send(self.client.build_request("POST", "/hidden_states", content=body,
                                                                  headers=headers), stream=True)
        if not is_lease_stream(answer):
            try:
                await answer.aread()
            finally:
                await answer.aclose()
        return answer

    async def _send_lease_stream(self, answer: httpx.Response, headers: dict[str, str], arena, send,
                                 gone: asyncio.Future) -> None:
        """The body of a chunked lease answer, from this worker's mapping of the arena: each
        chunk is coded as its record comes and its lease released once read; closing the answer
        (however the sending ends) ends whatever lease is left."""
        t_send = time.perf_counter()
        stats = Stats()
        reader = LeaseStreamReader()
        raw = answer.aiter_raw()
        records: list[dict] = []
        releases: list[asyncio.Task] = []

        async def more() -> None:
            try:
                data = await raw.__anext__()
            except StopAsyncIteration:
                reader.finish()
                raise WireFormatError("lease stream ended early") from None
            records.extend(reader.feed(data))

        def released(lease_id: str) -> None:
            releases.append(asyncio.ensure_future(self._release(
                lease_id, SendReport(0, 0, True, 0.0, 0.0, "identity"))))

        class _Chunks:  # body/response.StreamedPart
            def __init__(self, nbytes: int) -> None:
                self.nbytes = nbytes

            async def pieces(self):
                while True:
                    while not records:
                        await more()
                    rec = records.pop(0)
                    if "end" in rec:
                        return
                    if "error" in rec:
                        raise EngineFailure(rec["error"])
                    yield arena.view(int(rec["offset"]), int(rec["nbytes"])), functools.partial(released, rec["id"])

        try:
            try:
                while reader.head is None:
                    await more()
                lease = reader.lease
                if lease["arena_id"] != arena.arena_id:
                    raise WireFormatError(f"lease of arena {lease['arena_id']}, this worker maps {arena.arena_id}")
                whole = {**lease, "offset": 0, "nbytes": TensorSpec("hidden_states", lease["dtype"],
                                                                    tuple(lease["shape"])).nbytes}
                specs, parts, metadata = rebuild_body(reader.head, whole, None)
                parts[0] = _Chunks(specs[0].nbytes)
                coding = choose_coding(headers.get("accept"), headers.get("accept-encoding"),
                                       BY_ST[lease["dtype"]].name)
                body_headers, stream = encode_body(specs, parts, metadata, coding, stats, self.pool)
            except (WireFormatError, KeyError, ValueError) as exc:
                log.error("unusable lease stream from the engine process: %s", exc)
                raise EngineFailure("the engine process answered with an unusable lease") from exc
            try:
                await _send_body(send, answer, body_headers, stream, gone)
            finally:
                await stream.aclose()  # nothing reads the arena after this
        finally:
            gone.cancel()
            await asyncio.sleep(0)  # the done callbacks of the last pieces run: their releases are queued
            if releases:
                await asyncio.shield(asyncio.gather(*releases, return_exceptions=True))
            await answer.aclose()
            log.debug("lease stream sent in %.3fs (%d bytes)", time.perf_counter() - t_send, stats.wire)

    async def _release(self, lease_id: str, report: SendReport) -> None:
        try:
            r = await self.client.delete(f"/leases/{lease_id}", headers={
                **self.auth, SENT_HEADER: report.header()})
            if r.status_code != 204:
                log.warning("release of worker lease %s answered %d", lease_id[:8], r.status_code)
        except httpx.HTTPError as exc:  # the lease ends with this worker's arena session anyway
            log.warning("release of worker lease %s failed: %s", lease_id[:8], exc)

    async def _arena(self):
        """This worker's read-only mapping of the arena (made on first use, once the
        engine process serves); None while it cannot be had (then bodies come from the
        engine process)."""
        if self.arena is not None or time.monotonic() < self._arena_retry_at:
            return self.arena
        async with self._arena_lock:
            if self.arena is not None:
                return self.arena

            try:
                r = await self.client.get("/info", headers=self.auth)
                if r.status_code != 200:
                    return None  # loading: the engine process answers the request itself (503)
                self.arena = await asyncio.to_thread(attach, r.json().get("shm_lease"), self.token)
                log.info("mapped the arena %s (session %s)", self.arena.arena_id, (self.arena.session or "")[:8])
            except (httpx.HTTPError, ShmUnavailable, ValueError) as exc:
                log.warning("cannot map the arena (%s); the engine process sends bodies for %.0fs", exc, ARENA_RETRY)
                self._arena_retry_at = time.monotonic() + ARENA_RETRY
            return self.arena


async def _send_body(send, answer: httpx.Response, body_headers: dict[str, str], stream, gone: asyncio.Future) -> None:
    """The response (status, the engine process's request id and token count, the coding's
    headers) and its body as `stream` yields it; stops once the client is `gone`."""
    out = {"x-request-id": answer.headers.get("x-request-id", ""),
           "x-hsx-num-tokens": answer.headers.get("x-hsx-num-tokens", ""), **body_headers}
    await send({"type": "http.response.start", "status": 200,
                "headers": [(k.lower().encode(), str(v).encode("latin-1")) for k, v in out.items()]})
    async for chunk in stream:
        if gone.done():  # uvicorn drops writes to a closed connection: stop coding
            return
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _unreachable(exc: Exception) -> ServiceError:
    return NotReady(f"the engine process is not answering ({type(exc).__name__}); retry shortly",
                    retry_after=UNREACHABLE_RETRY, reason="engine_unreachable")


class _WorkerServer(uvicorn.Server):
    """uvicorn that ignores SIGTERM / SIGINT (the engine process drains first, then ends
    its workers) and stops when its standard input closes (http_workers.py closes it, or the
    engine process died)."""

    @contextmanager
    def capture_signals(self):
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Thread(target=self._stop_on_eof, name="hsx-http-worker-stdin", daemon=True).start()
        yield

    def _stop_on_eof(self) -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        self.should_exit = True


def main() -> int:
    lifeline.hold()  # dies with the engine process, however that one ends (its stdin closing is the polite way)
    cfg = json.loads(os.environ.pop(CONFIG_ENV))
    settings = ServiceSettings(**cfg["settings"])
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {cfg['index']}]: %(message)s")
    metrics = Metrics()  # the guard's own counters; the engine process keeps the served ones
    gate = AdmissionGate(settings.max_inflight, settings.max_queued_tokens, metrics)
    app = GuardMiddleware(HttpWorkerApp(settings, cfg["upstream"], cfg["token"], cfg["threads"]),
                          settings=settings, gate=gate, metrics=metrics)
    config = uvicorn.Config(app, log_level=settings.log_level.lower(), timeout_keep_alive=30,
                            timeout_graceful_shutdown=5, lifespan="on", http=protocol_for(settings, metrics))
    sock = socket.socket(fileno=cfg["fd"])
    _WorkerServer(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Async client for one or many hsx servers.

    async with HsxClient(["http://a:8000", "http://b:8000"], api_key=KEY) as client:
        info = await client.info()
        d = await client.hidden_states(messages=[...], max_length=4096, truncation="right")
        d.hidden_states  # torch [T, L, H], d.token_ids, d.loss_mask

Scheduling: each request goes to the least-loaded healthy server (fewest requests in
flight; ties go to the one picked least recently), and at most `concurrency_per_server`
requests are in flight per server; callers beyond that wait their turn.

Retries (a plain loop, see `_with_retries`): 429/503 (with `Retry-After`), timeouts,
connection errors, other 5xx and malformed bodies are retried up to `max_attempts`
attempts in all, 5xx at most `max_server_errors` times (an input that crashes the engine
should not be replayed on every server). The delay is full-jitter exponential backoff,
`uniform(0, min(backoff_max, backoff_base * 2**(n-1)))`, raised to `Retry-After` when the
server asks for longer. If another healthy, not-busy server is free, the retry goes there
at once (failover) instead of sleeping. 400/401/413/422 raise at once.

Health: a server that fails with a connection error, timeout or 5xx is set aside for
`unhealthy_cooldown` seconds, then probed with `GET /health` (in a task owned by this
client) and reused once it answers 200. A 429/503 only makes it "busy" for its
`Retry-After` (other servers are preferred meanwhile). When every server is unhealthy, a
request waits for the next probe; a failed probe costs it one attempt.

No global state and no threads of its own: decompression and body checks run through
`asyncio.to_thread` (the loop's executor); everything is released by `aclose()`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import httpx

from hsx_client import shm
from hsx_client.fast_http import FastTransport

from hsx import wire

from .errors import (
    ConnectionFailedError,
    HsxError,
    LeaseExpiredError,
    RequestTimeoutError,
    RetriesExhaustedError,
    ServerBusyError,
    ServerError,
    error_from_response,
)

T = TypeVar("T")

_RETRY_AFTER_CAP = 300.0


@dataclass
class ServerState:
    url: str
    capacity: int
    in_flight: int = 0
    ok: int = 0
    retries: int = 0
    errors: int = 0
    healthy: bool = True
    unhealthy_until: float = 0.0
    busy_until: float = 0.0
    probing: bool = False
    last_pick: int = 0
    wire_bytes: int = 0
    body_bytes: int = 0
    last_error: str | None = None
    arena: shm.ArenaMap | None = None  # same-host lease mapping, once attached
    arena_note: str | None = None  # why leases are not used with this server
    arena_lock: asyncio.Lock | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "ok": self.ok,
            "retries": self.retries,
            "errors": self.errors,
            "healthy": self.healthy,
            "wire_bytes": self.wire_bytes,
            "body_bytes": self.body_bytes,
            "last_error": self.last_error,
            "transfer": "shm-lease" if self.arena is not None else "http",
        }


@dataclass
class Lease:
    """States left in a same-host server's arena: valid until released (see release_lease)."""

    id: str
    server: str
    states: memoryview  # read-only view of the arena range


@dataclass
class RawResponse:
    """A successful `POST /hidden_states`: the decompressed safetensors body and how it came.
    With a lease, `body` lacks the hidden_states bytes: decode with `wire.decode(body,
    lease.states)` and call `HsxClient.release_lease` once they are stored."""

    body: bytes
    request_id: str | None
    server: str
    wire_bytes: int  # bytes on the wire (compressed when the server compressed)
    attempts: int = 1
    lease: Lease | None = None

    def decode(self) -> wire.Decoded:
        return wire.decode(self.body, self.lease.states if self.lease else None)


@dataclass
class _FallbackFinalNorm:  # used only when hsx_client.postnorm is not installed
    weight: Any
    eps: float
    style: str


def _zstd_decompress(data: bytes | bytearray) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(data)


def _check_body(body: bytes) -> None:
    """Cheap structural check (header parses, sizes add up) without decoding tensors."""
    header, start = wire.parse_header(body)
    expected = max(
        (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
    )
    if len(body) - start != expected:
        raise wire.WireFormatError(
            f"body holds {len(body) - start} data bytes, the header describes {expected} (truncated?)"
        )


def _finish_body(raw: bytes, encoding: str) -> bytes:
    body = _zstd_decompress(raw) if encoding == "zstd" else raw
    _check_body(body)
    return body


def _is_local(url: str) -> bool:
    host = (httpx.URL(url).host or "").lower()
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def _zstd_available() -> bool:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


class HsxClient:
    """Async client over a set of hsx servers (see the module docstring)."""

    def __init__(
        self,
        servers: list[str] | str,
        *,
        api_key: str | None = None,
        concurrency_per_server: int = 8,
        timeout: float = 600.0,
        max_attempts: int = 10,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        unhealthy_cooldown: float = 10.0,
        max_server_errors: int = 3,
        probe_timeout: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        compression: str = "auto",
        transfer: str = "auto",
    ) -> None:
        if compression not in ("auto", "zstd", "none"):
            raise ValueError(f"compression must be auto, zstd or none, not {compression!r}")
        if transfer not in ("auto", "http"):
            raise ValueError(f"transfer must be auto or http, not {transfer!r}")
        if isinstance(servers, str):
            servers = [servers]
        urls = [s.rstrip("/") for s in servers if s and s.strip()]
        if not urls:
            raise ValueError("HsxClient needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs in {urls}")
        if concurrency_per_server < 1 or max_attempts < 1:
            raise ValueError("concurrency_per_server and max_attempts must be >= 1")
        self._servers = [ServerState(u, concurrency_per_server) for u in urls]
        self._by_url = {s.url: s for s in self._servers}
        self.api_key = api_key
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.unhealthy_cooldown = unhealthy_cooldown
        self.max_server_errors = max_server_errors
        self.probe_timeout = min(probe_timeout, timeout)
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._changed: asyncio.Event | None = None
        self._probe_tasks: set[asyncio.Task[None]] = set()
        self._probe_failures = 0
        self._picks = 0
        self._closed = False
        self.compression = compression
        self.transfer = transfer
        self._accept_encoding = "zstd" if _zstd_available() else "identity"

    def _encoding_for(self, url: str) -> str:
        """zstd saves ~22% of the bytes but costs ~0.5-1 GB/s per core at each end
        (measured on the H200 host), more than a loopback or same-host link is worth:
        `auto` asks for it only from servers on other hosts."""
        if self.compression == "none" or self._accept_encoding == "identity":
            return "identity"
        if self.compression == "auto" and _is_local(url):
            return "identity"
        return "zstd"

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "HsxClient":
        self._ensure_open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def _ensure_open(self) -> httpx.AsyncClient:
        if self._closed:
            raise RuntimeError("HsxClient is closed")
        if self._http is None:
            n = sum(s.capacity for s in self._servers) + len(self._servers)
            headers = {"User-Agent": _user_agent()}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, connect=min(10.0, self.timeout)),
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                headers=headers,
                # httpx's default stack spends ~2 s of CPU per GB of body; this one ~0.75
                # (client/fast_http.py): the client is what limits a corpus run.
                transport=self._transport or FastTransport(max_idle_per_host=n),
            )
            self._changed = asyncio.Event()
        return self._http

    async def aclose(self) -> None:
        self._closed = True
        for t in list(self._probe_tasks):
            t.cancel()
        if self._probe_tasks:
            await asyncio.gather(*self._probe_tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        for s in self._servers:
            if s.arena is not None:
                s.arena.close()
                s.arena = None
        self._notify()

    # ------------------------------------------------------------------ public API
    @property
    def servers(self) -> list[str]:
        return [s.url for s in self._servers]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-server counters: in_flight, ok, retries, errors, healthy, wire/body bytes."""
        return {s.url: s.as_dict() for s in self._servers}

    async def info(self) -> dict[str, Any]:
        """`GET /info` of the least-loaded healthy server."""
        return await self._with_retries(lambda s, rid: self._get_json(s, "/info", rid), None)

    async def server_infos(self) -> dict[str, dict[str, Any]]:
        """`GET /info` of every server (to check that they serve the same model)."""
        out = {}
        for s in self._servers:
            out[s.url] = await self._with_retries(
                lambda srv, rid: self._get_json(srv, "/info", rid),
                None,
                pinned=s,
            )
        return out

    async def final_norm(self) -> Any:
        """`GET /final_norm` -> `hsx_client.postnorm.FinalNorm(weight, eps, style)`."""
        body = await self._with_retries(lambda s, rid: self._get_bytes(s, "/final_norm", rid), None)
        import safetensors.numpy

        header, _ = wire.parse_header(body)
        meta = header.get("__metadata__", {}) or {}
        weight = safetensors.numpy.load(body)["weight"].astype("float32", copy=False)
        try:
            from .postnorm import FinalNorm  # written by the formats side
        except ImportError:  # pragma: no cover - only before postnorm exists
            FinalNorm = _FallbackFinalNorm  # type: ignore[misc,assignment]
        return FinalNorm(weight=weight, eps=float(meta.get("eps", "1e-6")), style=meta.get("style", "rms"))

    async def hidden_states_response(
        self, body: dict[str, Any], *, request_id: str | None = None, lease_ok: bool = False
    ) -> RawResponse:
        """`POST /hidden_states` with retries; the decompressed body plus where it came from.

        `lease_ok`: from a same-host server (and `transfer="auto"`), the states may stay in
        its shared memory: the result then has a `lease`, to read before `release_lease`.
        That skips the HTTP body (about 4x the throughput of one client process on an
        H200, bench/README.md), at the price of the release call."""
        payload = json.dumps({k: v for k, v in body.items() if v is not None}).encode()
        rid0 = request_id or uuid.uuid4().hex

        async def attempt(server: ServerState, rid: str) -> RawResponse:
            arena = await self._arena_for(server, rid) if lease_ok and self.transfer == "auto" else None
            return await self._post_hidden_states(server, payload, rid, arena)

        return await self._with_retries(attempt, rid0)

    async def tokenize(self, body: dict[str, Any], *, request_id: str | None = None) -> dict[str, Any]:
        """`POST /tokenize` with retries: the `token_ids` (and `loss_mask`) the server would
        prefill for this `/hidden_states` body, computed without the engine."""
        payload = json.dumps({k: v for k, v in body.items() if v is not None}).encode()

        async def attempt(server: ServerState, rid: str) -> dict[str, Any]:
            http = self._ensure_open()
            headers = {"Content-Type": "application/json", "X-Request-Id": rid}
            try:
                resp = await http.post(server.url + "/tokenize", content=payload, headers=headers)
            except httpx.HTTPError as exc:
                raise self._wrap_transport_error(exc, server, rid) from exc
            if resp.status_code != 200:
                raise error_from_response(resp.status_code, resp.content, resp.headers, server=server.url,
                                          request_id=resp.headers.get("x-request-id") or rid)
            try:
                out = resp.json()
                out["token_ids"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ServerError("/tokenize did not return token_ids", type="bad_response",
                                  server=server.url, request_id=rid) from exc
            return out

        return await self._with_retries(attempt, request_id)

    async def release_lease(self, lease: Lease) -> None:
        """Give a lease's range back. Raises LeaseExpiredError when it had expired (or the
        answer is unknown): the states read under it may be stale, so redo the request."""
        http = self._ensure_open()
        try:
            resp = await http.delete(f"{lease.server}/leases/{lease.id}")
        except httpx.HTTPError as exc:
            raise LeaseExpiredError(
                f"lease release failed ({type(exc).__name__}: {exc}); the states cannot be trusted",
                type="lease_unknown", server=lease.server,
            ) from exc
        if resp.status_code == 204:
            return
        if resp.status_code == 410:
            raise LeaseExpiredError(
                "the lease expired before its release (server --lease-timeout); redo the request",
                status=410, type="lease_gone", server=lease.server,
            )
        raise error_from_response(resp.status_code, resp.content, resp.headers, server=lease.server,
                                  request_id=resp.headers.get("x-request-id"))

    async def hidden_states_raw(self, body: dict[str, Any], *, request_id: str | None = None) -> bytes:
        """The decompressed safetensors bytes, for callers that store them as they are."""
        return (await self.hidden_states_response(body, request_id=request_id)).body

    async def hidden_states(self, *, request_id: str | None = None, **fields: Any) -> wire.Decoded:
        """`POST /hidden_states` with the given request fields -> `hsx.wire.Decoded`."""
        raw = await self.hidden_states_response(fields, request_id=request_id)
        return await asyncio.to_thread(raw.decode)

    # ------------------------------------------------------------------ scheduling
    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float | None) -> None:
        ev = self._changed
        assert ev is not None
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _start_due_probes(self, now: float) -> None:
        for s in self._servers:
            if not s.healthy and not s.probing and s.unhealthy_until <= now:
                s.probing = True
                task = asyncio.get_running_loop().create_task(self._probe(s))
                self._probe_tasks.add(task)
                task.add_done_callback(self._probe_tasks.discard)

    async def _probe(self, s: ServerState) -> None:
        ok = False
        try:
            r = await self._ensure_open().get(s.url + "/health", timeout=self.probe_timeout)
            ok = r.status_code == 200
            if not ok:
                s.last_error = f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            s.last_error = f"/health: {type(exc).__name__}: {exc}"
        except RuntimeError:  # closed meanwhile
            pass
        finally:
            s.probing = False
            if ok:
                s.healthy = True
            else:
                s.unhealthy_until = time.monotonic() + self.unhealthy_cooldown
                self._probe_failures += 1
            self._notify()

    async def _acquire(self, pinned: ServerState | None = None) -> ServerState:
        self._ensure_open()
        failures_at_start = self._probe_failures
        while True:
            if self._closed:
                raise RuntimeError("HsxClient is closed")
            now = time.monotonic()
            self._start_due_probes(now)
            pool = [pinned] if pinned is not None else self._servers
            healthy = [s for s in pool if s.healthy]
            free = [s for s in healthy if s.in_flight < s.capacity]
            if free:
                best = min(free, key=lambda s: (s.busy_until > now, s.in_flight, s.last_pick))
                best.in_flight += 1
                self._picks += 1
                best.last_pick = self._picks
                return best
            if healthy:
                due = [s.unhealthy_until - now for s in self._servers if not s.healthy and not s.probing]
                await self._wait_change(max(0.01, min(due)) if due else None)
                continue
            # Nothing healthy: wait for a probe; a failed one costs this request an attempt.
            if self._probe_failures > failures_at_start:
                last = "; ".join(f"{s.url}: {s.last_error}" for s in pool)
                raise ConnectionFailedError(
                    f"no healthy server ({last})", type="no_healthy_server", server=pool[0].url if pinned else None
                )
            due = [s.unhealthy_until - now for s in pool if not s.probing]
            await self._wait_change(max(0.01, min(due)) if due else None)

    def _release(self, s: ServerState, error: HsxError | None) -> None:
        s.in_flight -= 1
        if error is None:
            s.ok += 1
        else:
            s.errors += 1
            s.last_error = str(error)
            if isinstance(error, ServerBusyError):
                s.busy_until = time.monotonic() + (error.retry_after or self.backoff_base)
            elif isinstance(error, (ConnectionFailedError, ServerError)):
                s.healthy = False
                s.unhealthy_until = time.monotonic() + self.unhealthy_cooldown
        self._notify()

    def _backoff(self, attempt: int, error: HsxError, failed: ServerState | None) -> float:
        now = time.monotonic()
        others = [
            s
            for s in self._servers
            if s is not failed and s.healthy and s.busy_until <= now and s.in_flight < s.capacity
        ]
        if others and failed is not None:
            return 0.0  # fail over at once
        delay = random.uniform(0.0, min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1)))
        ra = getattr(error, "retry_after", None)
        if ra:
            delay = max(delay, min(ra, _RETRY_AFTER_CAP))
        return delay

    async def _with_retries(
        self,
        fn: Callable[[ServerState, str], Awaitable[T]],
        request_id: str | None,
        *,
        pinned: ServerState | None = None,
    ) -> T:
        rid = request_id or uuid.uuid4().hex
        last: HsxError | None = None
        server_errors = 0
        attempt = 0
        while attempt < self.max_attempts:
            attempt += 1
            failed: ServerState | None = None
            try:
                server = await self._acquire(pinned)
            except ConnectionFailedError as exc:
                exc.request_id = exc.request_id or rid
                last = exc
            else:
                try:
                    result = await fn(server, rid)
                except HsxError as exc:
                    self._release(server, exc)
                    if not exc.retryable:
                        raise
                    last = exc
                    failed = server
                except BaseException:  # cancelled, or a bug: give the slot back
                    server.in_flight -= 1
                    self._notify()
                    raise
                else:
                    self._release(server, None)
                    if isinstance(result, RawResponse):
                        result.attempts = attempt
                    return result
            assert last is not None
            if isinstance(last, ServerError):
                server_errors += 1
                if server_errors >= self.max_server_errors:
                    break
            if attempt >= self.max_attempts:
                break
            if failed is not None:
                failed.retries += 1
            await asyncio.sleep(self._backoff(attempt, last, failed))
        assert last is not None
        raise RetriesExhaustedError(
            f"gave up after {attempt} attempt(s): {last}", last_error=last, attempts=attempt
        )

    # ------------------------------------------------------------------ HTTP
    def _wrap_transport_error(self, exc: Exception, server: ServerState, rid: str) -> HsxError:
        if isinstance(exc, httpx.TimeoutException):
            return RequestTimeoutError(
                f"no answer within the timeout ({type(exc).__name__})", type="timeout", request_id=rid, server=server.url
            )
        return ConnectionFailedError(
            f"{type(exc).__name__}: {exc}", type="connection", request_id=rid, server=server.url
        )

    async def _arena_for(self, server: ServerState, rid: str) -> shm.ArenaMap | None:
        """The server's arena mapped here, attached on first use; None when it cannot be."""
        if server.arena is not None or server.arena_note is not None:
            return server.arena
        if server.arena_lock is None:
            server.arena_lock = asyncio.Lock()
        async with server.arena_lock:
            if server.arena is None and server.arena_note is None:
                try:
                    offer = (await self._get_json(server, "/info", rid)).get("shm_lease")
                    server.arena = await asyncio.to_thread(shm.attach, offer, self.api_key)
                except shm.ShmUnavailable as exc:  # for good: this server's states come as bodies
                    server.arena_note = str(exc)
                except HsxError:  # /info failed this time (loading?): bodies now, try again later
                    pass
        return server.arena

    async def _post_hidden_states(
        self, server: ServerState, payload: bytes, rid: str, arena: shm.ArenaMap | None = None
    ) -> RawResponse:
        http = self._ensure_open()
        headers = {
            "Content-Type": "application/json",
            "Accept": f"{wire.LEASE_MEDIA_TYPE}, {wire.MEDIA_TYPE};q=0.5" if arena else wire.MEDIA_TYPE,
            "Accept-Encoding": self._encoding_for(server.url),
            "X-Request-Id": rid,
        }
        try:
            async with http.stream("POST", server.url + "/hidden_states", content=payload, headers=headers) as resp:
                resp_rid = resp.headers.get("x-request-id") or rid
                if resp.status_code != 200:
                    content = await resp.aread()
                    raise error_from_response(
                        resp.status_code, content, resp.headers, server=server.url, request_id=resp_rid
                    )
                encoding = resp.headers.get("content-encoding", "identity").strip().lower()
                ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
                if resp.is_stream_consumed:  # a transport that hands back read responses (MockTransport)
                    raw = resp.content
                    wire_bytes = resp.num_bytes_downloaded or len(raw)
                    encoding = "identity"
                elif encoding in ("zstd", "identity", ""):
                    chunks = [c async for c in resp.aiter_raw()]
                    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    wire_bytes = len(raw)
                else:  # gzip etc.: let httpx decode
                    raw = await resp.aread()
                    wire_bytes = resp.num_bytes_downloaded
                    encoding = "identity"
        except httpx.HTTPError as exc:
            raise self._wrap_transport_error(exc, server, rid) from exc
        lease = None
        try:
            if ctype == wire.LEASE_MEDIA_TYPE:
                if arena is None:
                    raise wire.WireFormatError("a lease came back though none was asked for")
                _check_body(raw)
                body, desc = raw, wire.lease_of(raw)
                lease = Lease(desc["id"], server.url, memoryview(b""))
                if desc["arena_id"] != arena.arena_id:  # restarted since we attached
                    server.arena, server.arena_note = None, None
                    raise wire.WireFormatError("the lease names another arena (server restarted?)")
                lease.states = arena.view(int(desc["offset"]), int(desc["nbytes"]))
            else:
                body = await asyncio.to_thread(_finish_body, raw, encoding)
        except Exception as exc:  # zstd error or malformed safetensors
            if lease is not None:  # give the range back now rather than at its expiry
                try:
                    await self.release_lease(lease)
                except HsxError:
                    pass
            raise ServerError(
                f"malformed response body: {exc}", type="bad_response", request_id=resp_rid, server=server.url
            ) from exc
        server.wire_bytes += wire_bytes
        server.body_bytes += len(body) + (len(lease.states) if lease else 0)
        return RawResponse(body=body, request_id=resp_rid, server=server.url, wire_bytes=wire_bytes, lease=lease)

    async def _get(self, server: ServerState, path: str, rid: str) -> httpx.Response:
        http = self._ensure_open()
        try:
            resp = await http.get(server.url + path, headers={"X-Request-Id": rid})
        except httpx.HTTPError as exc:
            raise self._wrap_transport_error(exc, server, rid) from exc
        if resp.status_code != 200:
            raise error_from_response(
                resp.status_code, resp.content, resp.headers, server=server.url,
                request_id=resp.headers.get("x-request-id") or rid,
            )
        return resp

    async def _get_json(self, server: ServerState, path: str, rid: str) -> Any:
        resp = await self._get(server, path, rid)
        try:
            return resp.json()
        except ValueError as exc:
            raise ServerError(f"{path} did not return JSON", type="bad_response", server=server.url, request_id=rid) from exc

    async def _get_bytes(self, server: ServerState, path: str, rid: str) -> bytes:
        return (await self._get(server, path, rid)).content


def _user_agent() -> str:
    try:
        from hsx import __version__
    except ImportError:  # pragma: no cover
        __version__ = "?"
    return f"hsx-client/{__version__} httpx/{httpx.__version__}"

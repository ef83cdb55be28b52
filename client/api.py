"""Async client for one or many hsx servers.

    async with HsxClient(["http://a:8000", "http://b:8000"], api_key=KEY) as client:
        info = await client.info()
        d = await client.hidden_states(messages=[...], max_length=4096, truncation="right")
        d.hidden_states  # torch [T, L, H], d.token_ids, d.loss_mask

Scheduling: each request goes to the least-loaded healthy server (fewest requests in
flight; ties go to the one picked least recently), and at most `concurrency_per_server`
requests are in flight per server; callers beyond that wait their turn.

Retries (a plain loop, see `hsx_client.servers.ServerSet.with_retries`): 429/503 (with `Retry-After`), timeouts,
connection errors, other 5xx and malformed bodies (`ResponseValidationError`) are retried up to `max_attempts`
attempts in all, 5xx at most `max_server_errors` times (an input that crashes the engine
should not be replayed on every server). The delay is full-jitter exponential backoff,
`uniform(0, min(backoff_max, backoff_base * 2**(n-1)))`, raised to `Retry-After` when the
server asks for longer. If another healthy, not-busy server is free, the retry goes there
at once (failover) instead of sleeping. 400/401/413/422 raise at once.

First contact: a server whose first connection fails (refused, or not accepted within
CONNECT_TIMEOUT) is set aside for good; when every server is, requests raise
ServersUnreachableError at once instead of retrying a typo for minutes. Only servers that
answered once are retried.

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
import dataclasses
import importlib
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from hsx import __version__ as hsx_version
from hsx import wire
from hsx_client import shm
from hsx_client.responses import Lease, RawResponse, copy_out, is_local
from hsx_client.sample_stream import DEFAULT_CHUNK_BYTES, SampleStream
from hsx_client.servers import ServerSet, ServerState
from hsx_client.settings import COMPRESSIONS, DEFAULTS, TRANSFERS, ClientSettings
from hsx_client.states_request import open_states

from .errors import (
    ConnectionFailedError,
    HsxError,
    LeaseExpiredError,
    RequestTimeoutError,
    ResponseValidationError,
    error_from_response,
)


# Seconds to open a connection: a live server accepts in milliseconds even when busy (admission
# answers 503 at once), so a few seconds tell a wrong host from a slow one without minutes of waiting.
CONNECT_TIMEOUT = 5.0


class HsxClient:
    """Async client over a set of hsx servers (see the module docstring)."""

    def __init__(
        self,
        servers: list[str] | str,
        *,
        api_key: str | None = DEFAULTS.api_key,
        concurrency_per_server: int = DEFAULTS.concurrency_per_server,
        timeout: float = DEFAULTS.timeout,
        max_attempts: int = DEFAULTS.max_attempts,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        unhealthy_cooldown: float = DEFAULTS.unhealthy_cooldown,
        max_server_errors: int = 3,
        probe_timeout: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        compression: str = DEFAULTS.compression,
        transfer: str = DEFAULTS.transfer,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, not {compression!r}")
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {', '.join(TRANSFERS)}, not {transfer!r}")
        if isinstance(servers, str):
            servers = [servers]
        urls = [s.rstrip("/") for s in servers if s and s.strip()]
        if not urls:
            raise ValueError("HsxClient needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs in {urls}")
        if concurrency_per_server < 1 or max_attempts < 1:
            raise ValueError("concurrency_per_server and max_attempts must be >= 1")
        self.api_key = api_key
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.unhealthy_cooldown = unhealthy_cooldown
        self._pool = ServerSet(
            urls, concurrency_per_server, max_attempts=max_attempts, backoff_base=backoff_base,
            backoff_max=backoff_max, unhealthy_cooldown=unhealthy_cooldown, max_server_errors=max_server_errors,
            probe_timeout=min(probe_timeout, timeout), http=self._ensure_open,
        )
        self._servers = self._pool.servers
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._closed = False
        self.compression = compression
        self.transfer = transfer

    @classmethod
    def from_settings(cls, settings: ClientSettings, **kw: Any) -> HsxClient:
        """A client for the connection `settings` describe (its servers too); `kw`: the other arguments."""
        return cls(settings.server, api_key=settings.api_key, concurrency_per_server=settings.concurrency_per_server,
                   timeout=settings.timeout, max_attempts=settings.max_attempts,
                   unhealthy_cooldown=settings.unhealthy_cooldown, compression=settings.compression,
                   transfer=settings.transfer, **kw)

    def _compression_for(self, url: str) -> str:
        """identity, zstd or bf16split. Compression costs ~0.5-1 GB/s per core at each end
        (bench/README.md), more than a loopback or same-host link is worth: `auto` asks
        identity from local servers and zstd from the others. Not bf16split, although it
        is smaller (1.5x vs 1.27x): on the H200 (vLLM 0.33, 2026-12-01) one client process
        decoded it at half zstd's rate (0.102x vs 0.133x of plain prefill over loopback)."""
        if self.compression == "auto":
            return "identity" if is_local(url) else "zstd"
        return "identity" if self.compression == "none" else self.compression

    def _encoding_for(self, url: str) -> str:
        """The Accept-Encoding asked of `url` (bf16split is a media type, zstd inside it)."""
        return "identity" if self._compression_for(url) == "identity" else "zstd"

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
            from hsx_client.transport import HsxTransport  # aiohttp: imported when first needed

            n = sum(s.capacity for s in self._servers) + len(self._servers)
            headers = {"User-Agent": _user_agent()}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, connect=min(CONNECT_TIMEOUT, self.timeout)),
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                headers=headers,
                # aiohttp underneath (client/transport.py): httpx's default stack spends
                # ~1.5-3x the CPU per GB of body, and the client limits a corpus run.
                transport=self._transport or HsxTransport(n),
            )
            self._pool.open()
        return self._http

    async def aclose(self) -> None:
        self._closed = True
        await self._pool.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # ------------------------------------------------------------------ public API
    @property
    def servers(self) -> list[str]:
        return [s.url for s in self._servers]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-server counters: in_flight, ok, retries, errors, healthy, wire/body bytes."""
        return {s.url: s.as_dict() for s in self._servers}

    async def info(self) -> dict[str, Any]:
        """`GET /info` of the least-loaded healthy server."""
        return await self._pool.with_retries(lambda s, rid: self._get_json(s, "/info", rid), None)

    async def models(self) -> dict[str, Any]:
        """`GET /v1/models` (hsx serve and vllm serve list their model and max_model_len)."""
        return await self._pool.with_retries(lambda s, rid: self._get_json(s, "/v1/models", rid), None)

    async def server_infos(self, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        """`GET /info` of every server at once, one attempt each (to check that they serve
        the same model). A server that does not answer within `timeout` seconds (down,
        loading) is left out: the request loop's retries and health probes deal with it."""
        self._ensure_open()

        async def one(s: ServerState) -> Any:
            return await asyncio.wait_for(self._get_json(s, "/info", uuid.uuid4().hex), timeout)

        answers = await asyncio.gather(*(one(s) for s in self._servers), return_exceptions=True)
        for s, a in zip(self._servers, answers):
            if isinstance(a, BaseException) and not isinstance(a, (HsxError, asyncio.TimeoutError)):
                raise a
            if isinstance(a, HsxError):
                self._pool.first_contact_failed(s, a)
        return {s.url: a for s, a in zip(self._servers, answers) if not isinstance(a, BaseException)}

    async def final_norm(self) -> Any:
        """`GET /final_norm` -> `hsx_client.postnorm.FinalNorm(weight, eps, style)`."""
        body = await self._pool.with_retries(lambda s, rid: self._get_bytes(s, "/final_norm", rid), None)
        from hsx.protocol import final_norm
        from hsx_client.postnorm import FinalNorm  # torch: imported when first needed

        norm = final_norm.decode(body)
        return FinalNorm(weight=norm.weight, eps=norm.eps, style=norm.style)

    async def hidden_states_response(
        self, body: dict[str, Any], *, request_id: str | None = None, lease_ok: bool = False
    ) -> RawResponse:
        """`POST /hidden_states` with retries; the decompressed body plus where it came from.

        `lease_ok`: from a same-host server (and `transfer="auto"`), the states may stay in
        its shared memory: the result then has a `lease`, to read before `release_lease`.
        That skips the HTTP body (about 4x the throughput of one client process on an
        H200, bench/README.md), at the price of the release call. A sample too big for one
        lease comes in chunk leases, collected here; when one of them expires before its
        release, the sample is asked for again as an HTTP body (a second prefill)."""
        payload = _json_body(body)
        rid = request_id or uuid.uuid4().hex

        def attempt_with(leased: bool) -> Callable[[ServerState, str], Awaitable[RawResponse]]:
            async def attempt(server: ServerState, rid: str) -> RawResponse:
                stream = await self._open_states(server, payload, rid, leased, whole=True,
                                                 chunk_bytes=DEFAULT_CHUNK_BYTES)
                return await stream.collect()  # within the attempt: a body that breaks off is retried
            return attempt

        try:
            return await self._pool.with_retries(attempt_with(lease_ok), rid)
        except LeaseExpiredError:
            if not lease_ok:
                raise
            # A chunk lease expired while the sample was collected (a loaded client or
            # server): asked again as an HTTP body, which cannot expire. Counted in stats().
            return await self._pool.with_retries(attempt_with(False), rid)

    async def tokenize(self, body: dict[str, Any], *, request_id: str | None = None) -> dict[str, Any]:
        """`POST /tokenize` with retries: the `token_ids` (and `loss_mask`) the server would
        prefill for this `/hidden_states` body, computed without the engine."""
        return await self._post_json("/tokenize", body, request_id, lambda out: out["token_ids"],
                                     "did not return token_ids")

    async def chat_completion(self, body: dict[str, Any], *, request_id: str | None = None) -> dict[str, Any]:
        """`POST /v1/chat/completions` with retries (hsx serve's, or any OpenAI-compatible server's)."""
        return await self._post_json("/v1/chat/completions", body, request_id, lambda out: out["choices"][0],
                                     "did not return a choice")

    async def _post_json(self, path: str, body: dict[str, Any], request_id: str | None,
                         check: Any, missing: str) -> dict[str, Any]:
        """A JSON request and answer, with retries; `check(answer)` raises if it lacks a part."""
        payload = _json_body(body)

        async def attempt(server: ServerState, rid: str) -> dict[str, Any]:
            http = self._ensure_open()
            headers = {"Content-Type": "application/json", "X-Request-Id": rid}
            try:
                resp = await http.post(server.url + path, content=payload, headers=headers)
            except httpx.HTTPError as exc:
                raise self._wrap_transport_error(exc, server, rid) from exc
            server.answered = True
            if resp.status_code != 200:
                raise error_from_response(resp.status_code, resp.content, resp.headers, server=server.url,
                                          request_id=resp.headers.get("x-request-id") or rid)
            try:
                out = resp.json()
                check(out)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise ResponseValidationError(f"{path} {missing}", server=server.url, request_id=rid) from exc
            return out

        return await self._pool.with_retries(attempt, request_id)

    async def release_lease(self, lease: Lease) -> None:
        """Give a lease's range back. Raises LeaseExpiredError when it had expired (or the
        answer is unknown): the states read under it may be stale, so redo the request."""
        http = self._ensure_open()
        try:
            resp = await http.delete(f"{lease.server}/leases/{lease.id}")
        except httpx.HTTPError as exc:
            self.note_lease_expired(lease.server)
            raise LeaseExpiredError(
                f"lease release failed ({type(exc).__name__}: {exc}); the states cannot be trusted",
                type="lease_unknown", server=lease.server,
            ) from exc
        if resp.status_code == 204:
            return
        if resp.status_code == 410:
            self.note_lease_expired(lease.server)
            raise LeaseExpiredError(
                "the lease expired before its release (server --lease-timeout); redo the request",
                status=410, type="lease_gone", server=lease.server,
            )
        raise error_from_response(resp.status_code, resp.content, resp.headers, server=lease.server,
                                  request_id=resp.headers.get("x-request-id"))

    def note_lease_expired(self, server: str) -> None:
        """A lease of `server` expired before its release (counted in `stats()`, and in hsx
        extract's summary)."""
        for s in self._servers:
            if s.url == server:
                s.leases_expired += 1

    async def take_out(self, raw: RawResponse) -> RawResponse:
        """`raw` with its states copied out of their lease and the lease released: a 204 proves
        the copy is the server's states. Do it as soon as the answer is here, before anything
        slow (decoding, writing, fsync, hashing): a lease held through a store on a loaded box
        expired. Raises LeaseExpiredError when it had expired anyway (ask again without a
        lease: `lease_ok=False`). A response without a lease comes back as it is."""
        lease = raw.lease
        if lease is None:
            return raw
        try:
            states = await copy_out(lease.states)
        except BaseException:
            try:
                await self.release_lease(lease)
            except HsxError:
                pass
            raise
        await self.release_lease(lease)
        return dataclasses.replace(raw, lease=None, states=states)

    async def hidden_states_raw(self, body: dict[str, Any], *, request_id: str | None = None) -> bytes:
        """The decompressed safetensors bytes, for callers that store them as they are."""
        return (await self.hidden_states_response(body, request_id=request_id)).body

    async def hidden_states(self, *, request_id: str | None = None, **fields: Any) -> wire.Decoded:
        """`POST /hidden_states` with the given request fields -> `hsx.wire.Decoded`."""
        raw = await self.hidden_states_response(fields, request_id=request_id)
        return await asyncio.to_thread(raw.decode)

    async def hidden_states_stream(self, body: dict[str, Any], *, request_id: str | None = None,
                                   lease_ok: bool = False, chunk_bytes: int | None = None) -> SampleStream:
        """`POST /hidden_states` as a `hsx_client.sample_stream.SampleStream`: the states in
        token chunks as they arrive, never the whole sample in memory (issue 29). Retries
        cover the request up to its answer's headers; an error later in the body raises
        from the stream (the caller asks again). From a same-host server (`lease_ok`) the
        states come as a lease: one zero-copy chunk (or the server's chunked lease form).
        Close the stream (`aclose`) however it ends."""
        payload = _json_body(body)
        chunk = chunk_bytes or DEFAULT_CHUNK_BYTES

        async def attempt(server: ServerState, rid: str) -> SampleStream:
            return await self._open_states(server, payload, rid, lease_ok, whole=False, chunk_bytes=chunk)

        return await self._pool.with_retries(attempt, request_id or uuid.uuid4().hex)

    async def _open_states(self, server: ServerState, payload: bytes, rid: str, lease_ok: bool, *,
                           whole: bool, chunk_bytes: int) -> SampleStream:
        arena = await self._arena_for(server, rid) if lease_ok and self.transfer == "auto" else None
        return await open_states(self, server, payload, rid, arena=arena, whole=whole, chunk_bytes=chunk_bytes)

    # ------------------------------------------------------------------ HTTP
    def _wrap_transport_error(self, exc: Exception, server: ServerState, rid: str) -> HsxError:
        if isinstance(exc, httpx.ConnectTimeout):  # nothing accepted the connection in time
            return ConnectionFailedError(
                f"no connection within {CONNECT_TIMEOUT:.0f} s ({type(exc).__name__})", type="connect_timeout",
                request_id=rid, server=server.url,
            )
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
                    # the chunked lease reader (and torch), loaded off the loop before any
                    # lease's clock runs (hsx_client.lease_stream's docstring says why)
                    await asyncio.to_thread(importlib.import_module, "hsx_client.lease_stream")
                except shm.ShmUnavailable as exc:  # for good: this server's states come as bodies
                    server.arena_note = str(exc)
                except HsxError:  # /info failed this time (loading?): bodies now, try again later
                    pass
        return server.arena

    async def _get(self, server: ServerState, path: str, rid: str) -> httpx.Response:
        http = self._ensure_open()
        try:
            resp = await http.get(server.url + path, headers={"X-Request-Id": rid})
        except httpx.HTTPError as exc:
            raise self._wrap_transport_error(exc, server, rid) from exc
        server.answered = True
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
            raise ResponseValidationError(f"{path} did not return JSON", server=server.url, request_id=rid) from exc

    async def _get_bytes(self, server: ServerState, path: str, rid: str) -> bytes:
        return (await self._get(server, path, rid)).content


def _user_agent() -> str:
    return f"hsx-client/{hsx_version} httpx/{httpx.__version__}"


def _json_body(body: dict[str, Any]) -> bytes:
    """A request body as JSON, fields left at None omitted (the server's defaults apply)."""
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()

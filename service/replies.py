"""The three reply shapes of POST /hidden_states, each built by its own method of `Replies`:
the states' bytes in an HTTP body (`body`), a lease on the whole range (`lease`), and the
chunked lease form (`lease_stream`). Which one a request gets is decided once, before
(serving.HiddenStatesService._lease_terms); each reply's `close` records the response in
the metrics and frees or ends what it holds.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from hsx.protocol.lease import SendReport
from hsx.wire import LEASE_MEDIA_TYPE, LEASE_STREAM_MEDIA_TYPE, TensorSpec, encode_header
from hsx_service.body.compress import CompressPool
from hsx_service.body.encode import encode_body
from hsx_service.body.response import Body, Stats, stream_identity
from hsx_service.core.metrics import Metrics
from hsx_service.engine.arena import Reservation
from hsx_service.engine.lease import Leases
from hsx_service.engine.prefill import PrefillEngine
from hsx_service.engine.window import ChunkCut, ChunkFailed, ChunkLease, StreamWindow, WindowStates


@dataclass(frozen=True)
class LeaseTerms:
    """A reply that is a lease (decided once, serving's `_lease_terms`): the lease table, whose
    session holds it, and whether an HTTP worker does (its lease never expires; it sends the
    body and reports)."""

    leases: Leases  # the table that grants it
    session: str | None
    http_worker: bool


@dataclass
class Outgoing:
    """One sample's reply, whatever its shape: the states' spec (their bytes stay in the
    arena), the tensors after them (token ids, loss mask), metadata and headers."""

    states: TensorSpec
    specs: list[TensorSpec]
    parts: list
    metadata: dict[str, str]
    headers: dict[str, str]
    n: int  # tokens
    started: float  # perf_counter when the prefill began
    t_send: float  # perf_counter when the reply's build began


@dataclass
class Reply:
    """What the route sends: headers, the body stream, and `close`, which must run once
    however the response ends (it frees the arena range or ends an unsent lease)."""

    headers: dict[str, str]
    stream: AsyncIterator
    close: Callable[[], None]


class Replies:
    """Builds each reply shape from one `Outgoing`; what they share: the arena (read from the
    engine, which maps it at start), the compression pool and the metrics; a lease's table
    comes with its terms."""

    def __init__(self, prefill: PrefillEngine, compress: CompressPool, metrics: Metrics, lease_timeout: float) -> None:
        self.prefill = prefill
        self.compress = compress
        self.metrics = metrics
        self.lease_timeout = lease_timeout

    def body(self, sample: Outgoing, reservation: Reservation | StreamWindow, coding: str) -> Reply:
        """The states' bytes in the body, coded as negotiated; a chunked save's as its chunks land."""
        states_part = (WindowStates(reservation, self.prefill.arena.view) if isinstance(reservation, StreamWindow)
                       else self.prefill.arena.slice(reservation.extent))
        stats = Stats()
        body_headers, stream = encode_body([sample.states, *sample.specs], [states_part, *sample.parts],
                                           sample.metadata, coding, stats, self.compress)
        headers = {**sample.headers, **body_headers}

        def close_body() -> None:
            reservation.release()
            self.record(sample.n, stats.raw, stats.wire, stats.complete, sample.started,
                        time.perf_counter() - sample.t_send, stats.work_s, coding)

        return Reply(headers, stream, _once(close_body))

    def lease(self, sample: Outgoing, reservation: Reservation, terms: LeaseTerms) -> Reply:
        """A lease on the whole range (hsx/wire.py LEASE_MEDIA_TYPE): a few KB, never worth
        compressing. An HTTP worker's lease (http_worker.py) lasts until it has sent the body,
        however slow its client; it reports what it sent when it releases the lease (its metrics
        are recorded then). A same-host client's lease expires after --lease-timeout."""
        extent, states, n, http_worker = reservation.extent, sample.states, sample.n, terms.http_worker
        on_end = functools.partial(self.http_worker_lease_ended, n, sample.started) if http_worker else None
        leases = terms.leases
        lease_id = leases.grant(reservation.hand_over(), terms.session, expires=not http_worker, on_end=on_end)
        self.metrics.leases.labels("granted").inc()
        metadata = {**sample.metadata, "lease": json.dumps({
            "id": lease_id, "arena_id": self.prefill.arena.arena_id, "offset": extent.offset,
            "nbytes": extent.nbytes, "dtype": states.dtype, "shape": list(states.shape),
            "expires_in": None if http_worker else self.lease_timeout,
        })}
        body = Body([encode_header(sample.specs, metadata), *sample.parts])
        headers = {**sample.headers, "Content-Type": LEASE_MEDIA_TYPE, "Content-Length": str(body.nbytes)}
        stats = Stats()

        def close_lease() -> None:
            if not stats.complete:  # the client never got the lease: take the range back
                leases.release(lease_id, "unsent")
            if not http_worker:
                self.record(n, extent.nbytes, stats.wire, stats.complete, sample.started,
                            time.perf_counter() - sample.t_send)

        return Reply(headers, stream_identity(body, stats), _once(close_lease))

    def lease_stream(self, sample: Outgoing, window: StreamWindow, terms: LeaseTerms) -> Reply:
        """The chunked lease form (hsx/wire.py LEASE_STREAM_MEDIA_TYPE): the lease head, then a
        lease per chunk as it lands; each release gives the chunk's slot back to the worker.
        A client that closes the response mid-sample has left it: the chunk leases it still holds
        end then (a later release of one is a 410). An HTTP worker's do not expire; the worker
        closes this response only once it reads no chunk any more, so they end with it too. For
        that, this response stays open after its last record until the worker has released every
        chunk: ending it at the last record ended the chunks the worker was still coding, and
        freed their range for another request while the worker read it.

        A client's chunk lease that expires ends the request (`StreamWindow.stop`): the stream
        sends an error record (410) and ends, the worker cancels and frees the KV blocks, and
        the window is freed. Offering the next chunk instead kept a silent client's request,
        its blocks and its window for one --lease-timeout per chunk."""
        states, session, http_worker = sample.states, terms.session, terms.http_worker
        metadata = {**sample.metadata, "lease": json.dumps({
            "chunked": True, "arena_id": self.prefill.arena.arena_id, "dtype": states.dtype,
            "shape": list(states.shape), "expires_in": self.lease_timeout,
        })}
        head = encode_header(sample.specs, metadata) + b"".join(bytes(p) for p in sample.parts)
        headers = {**sample.headers, "Content-Type": LEASE_STREAM_MEDIA_TYPE}
        stats = Stats()
        leases = terms.leases
        granted: list[str] = []
        expired = f"a chunk lease expired after --lease-timeout {leases.timeout:g}s: the client stopped reading"

        def chunk_lease_ended(outcome: str, _report: SendReport | None) -> None:
            if outcome == "expired":
                window.stop(expired)

        async def stream() -> AsyncIterator[bytes]:
            yield head
            stats.wire += len(head)
            try:
                while (chunk := await window.next_chunk()) is not None:
                    if not leases.session_alive(session):  # the client is gone: nobody would release it
                        window.give_back(chunk.index)
                        return
                    lease_id = leases.grant(ChunkLease(window, chunk), session, expires=not http_worker,
                                            on_end=chunk_lease_ended, counted=False)
                    self.metrics.leases.labels("granted").inc()
                    granted.append(lease_id)
                    line = json.dumps({"id": lease_id, "offset": chunk.offset, "nbytes": chunk.nbytes,
                                       "tokens": [chunk.start, chunk.stop]}).encode() + b"\n"
                    try:
                        yield line
                    except BaseException:  # closed: this record may never have left
                        leases.release(lease_id, "unsent")
                        raise
                    stats.raw += chunk.nbytes
                    stats.wire += len(line)
                yield b'{"end": true}\n'
                stats.complete = True
            except ChunkCut as exc:
                yield json.dumps({"error": str(exc), "status": 503}).encode() + b"\n"  # send it elsewhere
            except ChunkFailed as exc:
                error = ({"error": expired, "status": 410} if window.stopped == expired else
                         {"error": f"the engine did not deliver the hidden states ({exc})", "status": 502})
                yield json.dumps(error).encode() + b"\n"
            if http_worker:  # its chunks end with its releases, or with this response once it closes it
                await window.all_back()

        def close() -> None:
            if http_worker or not stats.complete:  # released already, or never to be read
                for lease_id in granted:
                    leases.release(lease_id, "unsent")
            window.close()
            self.record(sample.n, stats.raw, stats.wire, stats.complete, sample.started,
                        time.perf_counter() - sample.t_send)

        return Reply(headers, stream(), _once(close))

    def record(self, n: int, raw: int, wire: int, complete: bool, started: float, send_s: float,
                work_s: float | None = None, coding: str = "identity") -> None:
        """One finished response in the metrics (`work_s`: pool seconds of its copies or
        compression, within send; none for a lease)."""
        self.metrics.sent(raw, wire)
        self.metrics.tokens.inc(n)
        self.metrics.requests.labels("ok" if complete else "aborted").inc()
        self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.phase.labels("send").observe(send_s)
        if work_s is not None:
            self.metrics.phase.labels("encode_identity" if coding == "identity" else "compress").observe(work_s)

    def http_worker_lease_ended(self, n: int, started: float, outcome: str, report: SendReport | None) -> None:
        """An HTTP worker's lease ended: released with its report of the body it sent, or
        ended unsent / with the worker (`client_gone`): an aborted request."""
        if report is None:
            self.record(n, 0, 0, False, started, 0.0)
        else:
            self.record(n, report.raw, report.wire, report.complete and outcome == "released", started,
                        report.send_s, report.work_s, report.coding)


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, run at most once however often it is called (a Reply's close)."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return run

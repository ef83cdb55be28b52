"""The fan-out loop of `hsx extract`: each planned sample is fetched, stored, recorded.

    fetch   `POST /hidden_states` through HsxClient (least-loaded server, retries); a
            permanent failure is logged to failed.jsonl and the sample skipped;
    store   in a pool thread: decode, `fmt.encode_sample`, files written atomically
            (store.write_files_atomic); a format that `streams` (speculators, SpecForge) instead gets
            the response as a stream and writes its file as the states arrive
            (hsx_client.corpus.stream_write), each stream admitted against the memory
            budget (hsx_client.byte_budget, `--max-buffer-bytes`);
    record  its manifest line appended (fsync'ed): only then does the sample count.

States read from a same-host server's shared memory (a lease) are taken out of it as soon
as the answer is here, before anything slow (decode, write, fsync, hash): copied into this
process and the lease released, a 204 proving the copy is the server's states (a chunked
lease: chunk by chunk, hsx_client.lease_stream). A lease held through a store expired on a
loaded box, again and again. A lease that expired anyway (a 410) has the sample asked again
over an HTTP body, which cannot expire, so no sample fails for an expired lease; the summary
counts them ("N leases expired, asked again over HTTP").

Failures of one sample: 400/422/413 (and other 4xx) and a format that cannot encode the
response are permanent (`bad_request`, `too_large`, `encode`). A sample with no supervised
token after truncation is *dropped*, not failed (kind `dropped`): every request carries
`require_supervised`, so the server refuses it (422 no_supervised_tokens) before the
prefill; a response whose mask is all zero anyway is dropped here too. A sample on which every
attempt got a 5xx is `server_error` and retried by the next run. If the servers are
unreachable beyond the retries, authentication fails, many samples in a row fail with 5xx,
or storing fails (disk full), the loop stops with a resumable state (`RunState.fatal`).

Stopping (Ctrl-C, `request_stop`): no new sample starts, requests in flight are
cancelled (those samples are simply not done), stores already running finish.

`RunHooks` are the loop's small callbacks (the benchmark times the fan-out with them).
The state the workers share is one `RunState` (both in hsx_client.corpus.run_state). With
`--workers N` (hsx_client.corpus.workers) each worker process runs this loop open-ended
(samples arrive through `add`), its manifest and failed log stand-ins sending the lines to
the parent, the one writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hsx_client.corpus import images, store
from hsx_client.api import RawResponse
from hsx_client.errors import (
    AuthenticationError, HsxError, LeaseExpiredError, ResponseValidationError, RetriesExhaustedError, ServerError,
    ServersUnreachableError,
)
from hsx_client.sample_stream import SampleStream
from hsx_client.corpus.plan import DROPPED
from hsx_client.corpus.run_state import RunHooks, RunState, StopSignals, default_write_workers

log = logging.getLogger("hsx.extract")

STREAM_REDOS = 3  # a sample whose body broke off this often fails (server_error)


class SampleEncodeError(Exception):
    """The format refused a response (recorded as a permanent failure)."""


class SampleDropped(Exception):
    """The response has nothing to train on (recorded as dropped, not failed)."""


NO_SUPERVISED = "no_supervised_tokens"  # the server's error type for require_supervised


class RunLoop:
    def __init__(self, state: RunState, *, concurrency: int, write_workers: int | None = None,
                 handle_signals: bool = False, hooks: RunHooks | None = None, open_ended: bool = False) -> None:
        self.state = state
        self.concurrency = concurrency  # requests in flight over all servers
        self.write_workers = write_workers or default_write_workers()
        self.handle_signals = handle_signals
        self.hooks = hooks or RunHooks()
        self.breaker = max(10, 2 * concurrency)  # this many 5xx samples in a row stop the run
        self._phase: dict[asyncio.Task[Any], str] = {}
        self._signals = StopSignals(self.request_stop)
        self._pool: ThreadPoolExecutor | None = None
        # open_ended (a worker process, hsx_client.corpus.workers): samples keep arriving through
        # `add` until `close_feed`; an empty queue then waits instead of ending the loop.
        self._open = open_ended
        self._more: asyncio.Event | None = None
        # Issue 29: a format that can write a sample as it arrives gets streams, each with a
        # chunk buffer of its own, admitted against the memory budget.
        from hsx_client.byte_budget import ByteBudget, STREAM_OVERHEAD, default_max_buffer_bytes, stream_chunk_bytes
        from hsx_client.sample_stream import DEFAULT_CHUNK_BYTES

        self.streams = bool(getattr(state.fmt, "streams", False))
        limit = getattr(state, "max_buffer_bytes", None) or default_max_buffer_bytes()
        self.budget = ByteBudget(limit)
        self.chunk_bytes = stream_chunk_bytes(limit, concurrency, DEFAULT_CHUNK_BYTES)
        self.reserve = self.chunk_bytes + STREAM_OVERHEAD  # what one stream may hold

    # -------------------------------------------------------------- the feed (open-ended runs)
    def add(self, indices: list[int]) -> None:
        self.state.queue.extend(indices)
        self._wake()

    def close_feed(self) -> None:
        self._open = False
        self._wake()

    def _wake(self) -> None:
        if self._more is not None:
            self._more.set()

    async def _wait_for_more(self) -> bool:
        """True when the queue has a sample to take; False when the loop should end."""
        st = self.state
        while self._open and not st.queue and not st.stopping:
            assert self._more is not None
            self._more.clear()
            await self._more.wait()
        return bool(st.queue) and not st.stopping

    # -------------------------------------------------------------- control
    def request_stop(self, reason: str) -> None:
        st = self.state
        if not st.stopping:
            st.stopping = True
            st.stop_reason = reason
        for task, phase in list(self._phase.items()):
            if phase == "request":
                task.cancel()
        self._wake()

    def _stop_on(self, exc: BaseException, reason: str) -> None:
        self.state.fatal = exc
        self.request_stop(reason)

    # -------------------------------------------------------------- the loop
    async def run(self, todo: list[int]) -> None:
        st = self.state
        if not todo and not self._open:
            return
        loop = asyncio.get_running_loop()
        st.queue.extend(todo)
        self._more = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=self.write_workers, thread_name_prefix="hsx-store")
        if self.handle_signals:
            self._signals.install(loop)

        async def ticker() -> None:
            while True:
                await asyncio.sleep(1.0)
                st.progress.refresh()

        tick = loop.create_task(ticker())
        try:
            if self.hooks.on_start is not None:
                self.hooks.on_start(st)
            # Enough workers to keep every request slot busy while others are storing.
            slots = self.concurrency + self.write_workers
            workers = [loop.create_task(self._worker()) for _ in range(slots if self._open else min(len(todo), slots))]
            for w in workers:
                self._phase[w] = "idle"
            for r in await asyncio.gather(*workers, return_exceptions=True):
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError) and st.fatal is None:
                    st.fatal = r
        finally:
            tick.cancel()
            self._signals.remove()
            self._pool.shutdown(wait=True)
            if self.hooks.on_end is not None:
                self.hooks.on_end(st)

    async def _worker(self) -> None:
        st = self.state
        task = asyncio.current_task()
        assert task is not None
        try:
            while not st.stopping and (st.queue or await self._wait_for_more()):
                index = st.queue.popleft()
                t_taken = time.perf_counter()
                if self.streams:
                    await self._stream_one(index, task, t_taken)
                    continue
                self._phase[task] = "request"
                try:
                    raw = await self._fetch(index)
                finally:
                    self._phase[task] = "idle"
                if raw is None:
                    continue
                self._phase[task] = "store"
                try:
                    await self._store_and_record(index, raw)
                finally:
                    self._phase[task] = "idle"
                    st.life_s += time.perf_counter() - t_taken
        finally:
            self._phase.pop(task, None)

    async def _stream_one(self, index: int, task: asyncio.Task[Any], t_taken: float) -> None:
        """Fetch and store one sample as a stream (hsx_client.corpus.stream_write), within the budget."""
        st = self.state
        self._phase[task] = "request"  # admission waits, and a stop cancels the wait
        try:
            await self.budget.acquire(self.reserve)
        except asyncio.CancelledError:
            if st.stopping:
                return
            raise
        held = self.reserve
        try:
            stream = await self._fetch(index, stream=True)
            self._phase[task] = "idle"
            if stream is None:
                return
            # a whole lease's states, taken out: in memory beyond the stream's chunk buffer
            extra = max(0, stream.taken_bytes - self.chunk_bytes)
            self.budget.take(extra)
            held += extra
            self._phase[task] = "store"
            try:
                await self._store_stream(index, stream)
            finally:
                st.life_s += time.perf_counter() - t_taken
        finally:
            self._phase[task] = "idle"
            await self.budget.release(held)

    async def _store_stream(self, index: int, stream: SampleStream) -> None:
        from hsx_client.corpus.stream_write import store_stream

        st = self.state
        loop = asyncio.get_running_loop()

        def blocking(fn: Callable[..., Any], *args: Any) -> Any:
            return loop.run_in_executor(self._pool, fn, *args)

        t = time.perf_counter()
        try:
            stored = await store_stream(st.out, st.fmt, index, stream, st.ctx, blocking)
            entry = self._entry(index, stored.files, stored.record, int(stored.head.shape[0]),
                                stream.request_id, stored.head.metadata)
            await blocking(st.manifest.append, entry)
            # a streamed body is received while it is stored: its receiving is counted once,
            # in the server's receive_s, so the profile's phases still sum within a life
            st.store_s += max(0.0, time.perf_counter() - t - stream.receive_s)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failed(index, exc)
            return
        finally:
            await stream.aclose()
        st.done[index] = entry
        written = sum(f["size"] for f in stored.files.values())
        st.progress.sample_done(tokens=entry["tokens"], wire_bytes=stream.wire_bytes, written_bytes=written)
        if self.hooks.on_stored is not None:
            self.hooks.on_stored(st, index, entry)

    def _entry(self, index: int, files: dict[str, Any], record: dict[str, Any], tokens: int,
               request_id: str | None, metadata: dict[str, str]) -> dict[str, Any]:
        st = self.state
        entry = {"key": st.keys[index], "index": index, "files": files, "record": record, "tokens": tokens,
                 "request_id": request_id}
        before = int(metadata.get("num_input_tokens") or 0)
        if before > tokens:  # the server cut it (--max-length / --truncation)
            entry["truncated_from"] = before
        return entry

    async def _fetch(self, index: int, stream: bool = False) -> Any:
        """The response (a SampleStream when `stream`), or None: the sample failed (logged)
        or the run stops."""
        st = self.state
        lease_ok = index not in st.http_only
        try:
            body = st.request_body(index)
            if images.needs_inlining(body):  # its image files, read now (the plan holds their paths)
                body = await asyncio.to_thread(images.inline, body)
            if stream:
                raw = await st.client.hidden_states_stream(body, lease_ok=lease_ok, chunk_bytes=self.chunk_bytes)
            else:  # a format may ask for less than states (POST /tokenize)
                raw = await st.fmt.fetch(st.client, body, lease_ok=lease_ok)
            raw = await self._take_out(raw, stream)
        except asyncio.CancelledError:
            if st.stopping:
                return None  # abandoned: not done, redone on resume
            raise
        except (HsxError, images.ImageFileError) as exc:
            self._failed(index, exc)
            return None
        st.consecutive_5xx = 0
        return raw

    async def _take_out(self, answer: Any, stream: bool) -> Any:
        """A lease's states copied here and the lease released, before anything slow (the
        module docstring); LeaseExpiredError when it had expired. A stream's own `take_out`
        (a chunked lease stream's: its first chunk; the others as they are read), a
        RawResponse's through the client (a format's other answers hold no lease)."""
        if stream:
            try:
                await answer.take_out()
            except BaseException:
                await answer.aclose()
                raise
            return answer
        return await self.state.client.take_out(answer) if getattr(answer, "lease", None) is not None else answer

    async def _store_and_record(self, index: int, raw: RawResponse) -> None:
        st = self.state
        loop = asyncio.get_running_loop()
        try:
            # Shielded: a stop must not leave a file half-written by a cancelled await.
            t = time.perf_counter()
            entry, written = await asyncio.shield(loop.run_in_executor(self._pool, self._store, index, raw))
            st.store_s += time.perf_counter() - t
        except asyncio.CancelledError:
            raise  # the worker ends (a stop cancels requests, never stores: this came from outside)
        except BaseException as exc:
            self._failed(index, exc)
            return
        st.done[index] = entry
        st.progress.sample_done(tokens=entry["tokens"], wire_bytes=raw.wire_bytes, written_bytes=written)
        if self.hooks.on_stored is not None:
            self.hooks.on_stored(st, index, entry)

    def _failed(self, index: int, exc: BaseException) -> None:
        """The one failure ladder of a sample, whether fetching or storing it failed: fail it
        (a kind of failed.jsonl), ask for it again, or stop the run (resumable)."""
        from hsx_client.corpus.formats.common import CorpusFormatError
        from hsx_client.corpus.stream_write import StreamDropped

        st = self.state
        if isinstance(exc, ServersUnreachableError):
            self._stop_on(exc, "servers unreachable")
        elif isinstance(exc, RetriesExhaustedError):
            self._retries_exhausted(index, exc)
        elif isinstance(exc, AuthenticationError):
            self._stop_on(exc, "authentication failed")
        elif isinstance(exc, LeaseExpiredError):
            self._lease_expired(index, exc)
        elif isinstance(exc, (SampleEncodeError, CorpusFormatError)):
            self._fail(index, "encode", exc)
        elif isinstance(exc, images.ImageFileError):  # its image file is gone or unreadable
            self._fail(index, "bad_request", exc)
        elif isinstance(exc, (SampleDropped, StreamDropped)):
            self._fail(index, DROPPED, exc)
        elif isinstance(exc, HsxError) and exc.retryable:  # a stream that broke off or came malformed
            redos = st.stream_redos[index] = st.stream_redos.get(index, 0) + 1
            if redos >= STREAM_REDOS:
                self._fail(index, "server_error", exc)
            else:
                log.warning("sample %d: %s; requesting it again", index, exc)
                st.queue.append(index)
        elif isinstance(exc, HsxError):  # 400/422/413/other 4xx: the sample is bad
            kind = DROPPED if exc.type == NO_SUPERVISED else {413: "too_large"}.get(exc.status or 0, "bad_request")
            self._fail(index, kind, exc)
        else:  # disk full, a bug: stop, resumable
            self._stop_on(exc, f"storing failed: {exc}")

    def _retries_exhausted(self, index: int, exc: RetriesExhaustedError) -> None:
        """Every attempt failed: a 5xx each time is this sample's (the breaker counts a run of
        them), a malformed body each time too (not the engine's: no breaker); anything else
        (unreachable, timing out, busy) is the servers' and stops the run."""
        st = self.state
        last = exc.last_error
        if isinstance(last, ServerError):
            st.consecutive_5xx += 1
            self._fail(index, "server_error", last)
            if st.consecutive_5xx >= self.breaker:
                self._stop_on(exc, f"{st.consecutive_5xx} samples in a row failed with 5xx")
        elif isinstance(last, ResponseValidationError):
            self._fail(index, "server_error", last)
        else:
            self._stop_on(exc, "servers unreachable")

    def _lease_expired(self, index: int, exc: LeaseExpiredError) -> None:
        """Asked again over an HTTP body, which cannot expire: no sample fails for a lease."""
        st = self.state
        st.http_only.add(index)
        log.warning("sample %d: %s; asking again over HTTP", index, exc)
        st.queue.append(index)

    def _store(self, index: int, raw: RawResponse) -> tuple[dict[str, Any], int]:
        """In a pool thread: decode, encode, write the files, append the manifest line."""
        st = self.state
        try:
            decoded = raw.decode()
        except Exception as exc:
            raise SampleEncodeError(f"{type(exc).__name__}: {exc}") from exc
        from hsx_client.corpus.formats.common import drop_reason  # the formats import torch: not at this module's import

        dropped = drop_reason(st.fmt, decoded.loss_mask)  # nothing to train on: all masked, or the format's rule
        if dropped:
            raise SampleDropped(dropped)
        try:
            out = st.fmt.encode_sample(index, decoded, st.ctx)
        except Exception as exc:
            raise SampleEncodeError(f"{type(exc).__name__}: {exc}") from exc
        files = store.write_files_atomic(st.out, out.files)
        entry = self._entry(index, files, out.record, int(len(decoded.token_ids)), raw.request_id, decoded.metadata)
        st.manifest.append(entry)
        return entry, sum(f["size"] for f in files.values())

    def _fail(self, index: int, kind: str, exc: BaseException) -> None:
        st = self.state
        entry: dict[str, Any] = {"index": index, "key": st.keys[index], "kind": kind, "time": time.time()}
        if isinstance(exc, HsxError):
            message = exc.message
            if kind == "too_large":  # the server names its API fields; say the flags
                message += " [hsx extract: --max-length N with --truncation right or left cuts such samples]"
            entry.update(
                status=exc.status, type=exc.type, message=message, request_id=exc.request_id, server=exc.server
            )
        else:
            entry.update(message=f"{type(exc).__name__}: {exc}")
        st.failed_log.append(entry)
        st.failed[index] = entry
        st.progress.sample_failed(dropped=kind == DROPPED)
        if self.hooks.on_failed is not None:
            self.hooks.on_failed(st, index, entry)

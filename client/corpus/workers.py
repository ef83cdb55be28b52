"""`hsx extract --workers N`: the fan-out loop spread over N worker processes.

Why processes: one client process receives, decodes, hashes and writes ~1 GB/s at most
(issue 17); N processes, each with its own connections (its own HsxClient), multiply that.

Who does what:
    parent   plans, hands sample indices to the workers (a small window each, so a dead
             worker costs little), and is the ONE writer of manifest.jsonl and failed.jsonl;
    worker   runs hsx_client.corpus.run's RunLoop (the owner of every per-sample rule: retries,
             5xx breaker, leases, dropped, encode errors) on the indices it gets: fetch,
             store the files (fsync'ed, checksummed), release the lease, and only then
             send the manifest entry to the parent, which appends it (fsync'ed).

Samples go out once every first worker has said `ready` (its imports, torch included, and its
client are done: seconds), which is also when the run's `on_start` hook fires.

So the crash rules stay those of the in-process loop: a sample counts once its line is on
disk, written by one process. A worker that dies (SIGKILL, OOM) is noticed by its process
sentinel; what it had sent is read to the end of its pipe, and every index it held
without a line is handed to a new worker (files it left half-written are temporary files
named with its pid, which the parent removes at once; whole files without a line are
overwritten atomically).
After RESTARTS deaths the run stops, resumable (exit 1, as RunState.fatal). Ctrl-C/SIGTERM
reach the parent (workers ignore SIGINT: a terminal sends it to the whole group); it tells
the workers to stop, they finish their stores and report, and the run exits 130. A parent
that dies closes the pipes: workers stop the same way.

Processes start with 'spawn' (vLLM/torch and fork do not mix). `--workers 1` never comes
here: it is the in-process RunLoop, unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
import signal
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from hsx_client.corpus import store
from hsx_client.corpus.plan import DROPPED
from hsx_client.corpus.progress import add_stats
from hsx_client.corpus.run import RunLoop
from hsx_client.corpus.run_state import RunHooks, RunState, StopSignals, default_write_workers
from hsx_client.corpus.worker_messages import End, Exited, Failed, Note, Progressed, Ready, Samples, Stop, Stored
from hsx_client.malloc_tuning import keep_large_blocks
from hsx_client.settings import ClientSettings

log = logging.getLogger("hsx.extract")

RESTARTS = 3  # worker deaths a run survives; more stop it, resumable
CORPUS_FIELDS = ("fmt", "ctx", "out", "settings", "served_layers", "keys")


class WorkerError(Exception):
    """A worker stopped on an error (its message), or workers kept dying."""


@dataclass
class WorkerSpec:
    """What a worker process needs (pickled once, at its start)."""

    client: ClientSettings  # this worker's connection: its share of the requests in flight per server
    corpus: dict[str, Any]  # RunState's corpus side (CORPUS_FIELDS), as the parent has it
    concurrency: int  # requests in flight in this worker, over all servers
    write_workers: int
    max_buffer_bytes: int | None = None  # this worker's share of the run's memory budget


# ----------------------------------------------------------------------------- the worker side


class _Outbox:
    """The worker's one pipe to the parent; sends come from the loop and store threads."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._mu = threading.Lock()

    def send(self, msg: object) -> None:
        with self._mu:
            self._conn.send(msg)


class _LogToParent:
    """Stands in for a JsonlLog: the line goes to the parent, which writes it."""

    def __init__(self, outbox: _Outbox, message: type[Stored] | type[Failed]) -> None:
        self._outbox, self._message = outbox, message

    def append(self, entry: dict[str, Any]) -> None:
        self._outbox.send(self._message(entry))


class _ProgressToParent:
    """Stands in for Progress: the parent's bar counts (from the entries and these bytes)."""

    def __init__(self, outbox: _Outbox) -> None:
        self._outbox = outbox

    def sample_done(self, *, tokens: int, wire_bytes: int, written_bytes: int) -> None:
        self._outbox.send(Progressed(tokens, wire_bytes, written_bytes))

    def sample_failed(self, dropped: bool = False) -> None:
        pass

    def refresh(self, force: bool = False) -> None:
        pass

    def write(self, msg: str) -> None:
        self._outbox.send(Note(msg))


def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """A worker process's entry (module level: 'spawn' imports it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it tells us to stop
    keep_large_blocks()  # each body in reused memory, not a fresh mmap (hsx_client.malloc_tuning)
    outbox = _Outbox(conn)
    books: dict[str, Any] = {}  # its client's counters and store time, for the parent's totals
    try:
        fatal = asyncio.run(_work(conn, outbox, spec, books))
    except BaseException as exc:  # noqa: BLE001: anything, reported as this worker's error
        fatal = f"{type(exc).__name__}: {exc}"
    try:
        outbox.send(Exited(fatal, books))
    except OSError:
        pass  # the parent is gone


async def _work(conn: Connection, outbox: _Outbox, spec: WorkerSpec, books: dict[str, Any]) -> str | None:
    from hsx_client.api import HsxClient

    async with HsxClient.from_settings(spec.client) as client:
        state = RunState(
            client=client, **spec.corpus, by_key={},
            manifest=_LogToParent(outbox, Stored), failed_log=_LogToParent(outbox, Failed),
            done={}, failed={}, progress=_ProgressToParent(outbox),  # type: ignore[arg-type]
            max_buffer_bytes=spec.max_buffer_bytes,
        )
        loop = RunLoop(state, concurrency=spec.concurrency, write_workers=spec.write_workers, open_ended=True)
        aloop = asyncio.get_running_loop()

        def take(samples: list[tuple[int, Any]]) -> None:
            for index, sample in samples:
                state.by_key[sample.key] = sample
            loop.add([index for index, _ in samples])

        def read() -> None:  # a thread: the parent's messages, onto the event loop
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the parent died: stop as on Ctrl-C
                    aloop.call_soon_threadsafe(loop.request_stop, "the parent process is gone")
                    return
                match msg:
                    case Samples(items):
                        aloop.call_soon_threadsafe(take, items)
                    case End():
                        aloop.call_soon_threadsafe(loop.close_feed)
                        return
                    case Stop(reason):
                        aloop.call_soon_threadsafe(loop.request_stop, reason)
                        return

        threading.Thread(target=read, name="hsx-worker-feed", daemon=True).start()
        outbox.send(Ready())  # imports done, client up: the parent may start its clock and feed us
        try:
            await loop.run([])
        finally:
            books.update(stats=client.stats(), store_s=state.store_s, life_s=state.life_s)
        return None if state.fatal is None else str(state.fatal)


# ----------------------------------------------------------------------------- the parent side


class _Worker:
    def __init__(self, proc: Any, conn: Connection) -> None:
        self.proc, self.conn = proc, conn
        self.held: set[int] = set()  # indices sent, with no manifest/failed line yet
        self.reported_exit = False
        self.ended = False  # told "end" or "stop"
        self.ready = False  # said "ready": its imports (torch: seconds) and client are done


class WorkerPool:
    """RunLoop's interface (`run(todo)`, `request_stop`) over worker processes."""

    def __init__(self, state: RunState, spec: WorkerSpec, *, workers: int, handle_signals: bool = False,
                 hooks: RunHooks | None = None, target: Callable[..., None] = worker_main) -> None:
        self.state = state
        self.spec = spec
        self.workers = workers
        self.hooks = hooks or RunHooks()
        self.handle_signals = handle_signals
        self.target = target  # tests swap in a worker that misbehaves
        self.window = 2 * spec.concurrency + 2  # indices a worker holds at most
        self.deaths = 0
        self._started = False  # every first worker was ready; samples flow
        self._signals = StopSignals(self.request_stop)
        self._mp = mp.get_context("spawn")

    def request_stop(self, reason: str) -> None:
        st = self.state
        if not st.stopping:
            st.stopping = True
            st.stop_reason = reason

    def _stop_on(self, exc: BaseException, reason: str) -> None:
        if self.state.fatal is None:
            self.state.fatal = exc
        self.request_stop(reason)

    def _start(self) -> _Worker:
        parent_end, child_end = self._mp.Pipe(duplex=True)
        proc = self._mp.Process(target=self.target, args=(child_end, self.spec), name="hsx-extract-worker",
                                daemon=True)
        proc.start()
        child_end.close()
        return _Worker(proc, parent_end)

    async def run(self, todo: list[int]) -> None:
        st = self.state
        if not todo:
            return
        pending = deque(todo)
        live: list[_Worker] = []
        if self.handle_signals:
            self._signals.install(asyncio.get_running_loop())
        try:
            live = [self._start() for _ in range(min(self.workers, len(todo)))]
            while live:
                if not self._started and all(w.ready for w in live):
                    # Samples go out once every first worker is ready, and on_start marks
                    # that: a run's clock (hsx bench) starts at its first request, as the
                    # in-process loop's does, not seconds earlier while N processes import.
                    self._started = True
                    self._on_start()
                for w in live:
                    self._feed(w, pending)
                objs = [w.conn for w in live] + [w.proc.sentinel for w in live]
                ready = set(await asyncio.to_thread(wait, objs, 0.5))
                for w in list(live):
                    if w.conn in ready:
                        self._drain(w)
                    if w.proc.sentinel in ready:
                        self._drain(w)
                        w.proc.join()
                        live.remove(w)
                        self._ended(w, pending, live)
                st.progress.refresh()
        finally:
            self._signals.remove()
            for w in live:  # an exception in the parent: the workers must not outlive it
                w.proc.kill()
                w.proc.join()
            if not self._started:
                self._on_start()  # the hooks stay paired however the run ended
            if self.hooks.on_end is not None:
                self.hooks.on_end(st)

    def _on_start(self) -> None:
        if self.hooks.on_start is not None:
            self.hooks.on_start(self.state)

    def _feed(self, w: _Worker, pending: deque[int]) -> None:
        if w.ended or not (w.ready and self._started or self.state.stopping):
            return
        try:
            if self.state.stopping:
                w.ended = True
                w.conn.send(Stop(self.state.stop_reason))
                return
            batch = []
            while pending and len(w.held) + len(batch) < self.window:
                batch.append(pending.popleft())
            if batch:
                w.held.update(batch)
                st = self.state
                w.conn.send(Samples([(i, st.by_key[st.keys[i]]) for i in batch]))
            elif not pending and not w.held:
                w.ended = True
                w.conn.send(End())
        except OSError:
            pass  # it died: its sentinel tells, and _ended hands its indices on

    def _drain(self, w: _Worker) -> None:
        """Every message the worker sent, to the end of its pipe when it is gone."""
        while True:
            try:
                if not w.conn.poll():
                    return
                msg = w.conn.recv()
            except (EOFError, OSError):
                return  # gone (a message cut by its death is not a line: its index is redone)
            self._handle(w, msg)

    def _handle(self, w: _Worker, msg: object) -> None:
        st = self.state
        match msg:
            case Ready():
                w.ready = True
            case Stored(entry):
                index = entry["index"]
                st.manifest.append(entry)  # the one writer; fsync'ed before the sample counts
                st.done[index] = entry
                w.held.discard(index)
                if self.hooks.on_stored is not None:
                    self.hooks.on_stored(st, index, entry)
            case Progressed(tokens, wire_bytes, written_bytes):  # the worker's numbers of a stored sample
                st.progress.sample_done(tokens=tokens, wire_bytes=wire_bytes, written_bytes=written_bytes)
            case Failed(entry):
                index = entry["index"]
                st.failed_log.append(entry)
                st.failed[index] = entry
                w.held.discard(index)
                st.progress.sample_failed(dropped=entry.get("kind") == DROPPED)
                if self.hooks.on_failed is not None:
                    self.hooks.on_failed(st, index, entry)
            case Note(text):
                st.progress.write(text)
            case Exited(error, books):
                w.reported_exit = True
                st.store_s += books.get("store_s", 0.0)
                st.life_s += books.get("life_s", 0.0)
                add_stats(st.worker_stats, books.get("stats", {}))
                st.progress.add_server_stats(books.get("stats", {}))  # the summary's per-server counts
                if error is not None:
                    self._stop_on(WorkerError(error), error)
            case _:
                raise TypeError(f"unknown worker message {msg!r}")

    def _ended(self, w: _Worker, pending: deque[int], live: list[_Worker]) -> None:
        """A worker process is gone: hand on what it held; replace it when it died."""
        w.conn.close()
        if w.held:  # not done: back to the front, in plan order
            pending.extendleft(sorted(w.held, reverse=True))
        if w.reported_exit:
            if pending and not self.state.stopping and not live:
                live.append(self._start())
            return
        self.deaths += 1
        log.warning("worker process %d died (exit code %s) holding %d sample(s); handing them on",
                    w.proc.pid, w.proc.exitcode, len(w.held))
        # Its half-written files: removed now (before a new worker could reuse the pid), so a
        # run that completes leaves none; the next writer's sweep would only catch them later.
        store.clean_temp_files(self.state.out, pid=w.proc.pid)
        if self.deaths > RESTARTS:
            self._stop_on(WorkerError(f"worker processes died {self.deaths} times (last exit code "
                                      f"{w.proc.exitcode}); rerun the same command to resume"), "workers died")
        elif not self.state.stopping and pending:
            live.append(self._start())


def worker_count(requested: int, concurrency_per_server: int) -> int:
    """Worker processes a run starts: no more than --concurrency-per-server, since each one
    holds at least one request per server (more would raise the requests in flight past
    what the user set, and a worker with nothing in flight is a process for nothing)."""
    return max(1, min(requested, concurrency_per_server))


def worker_spec(cfg: Any, state: RunState, *, workers: int, servers: list[str]) -> WorkerSpec:
    """The spec of one of `workers` workers: the run's requests in flight and store threads
    shared among them (--concurrency-per-server stays the total per server)."""
    per_server = max(1, math.ceil(cfg.client.concurrency_per_server / workers))
    return WorkerSpec(
        client=cfg.client.model_copy(update={"server": servers, "concurrency_per_server": per_server}),
        corpus={f: getattr(state, f) for f in CORPUS_FIELDS}, concurrency=per_server * len(servers),
        write_workers=cfg.write_workers or max(2, math.ceil(default_write_workers() / workers)),
        max_buffer_bytes=_share(getattr(cfg, "max_buffer_bytes", None), workers),
    )


def _share(budget: int | None, workers: int) -> int:
    """A worker's share of the run's memory budget (the default's, measured once here)."""
    from hsx_client.byte_budget import default_max_buffer_bytes

    return max(1, (budget or default_max_buffer_bytes()) // workers)

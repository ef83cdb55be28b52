"""What the run loop's workers share (`RunState`: the corpus side, the books, the queue,
the stop flags), the loop's callbacks (`RunHooks`), and its stop on SIGINT/SIGTERM
(`StopSignals`); the loop itself is hsx_client.corpus.run."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.exit_codes import ExitCode
from hsx.host import usable_cores
from hsx_client.api import HsxClient
from hsx_client.corpus import journal
from hsx_client.corpus.progress import Progress
from hsx_client.corpus.settings import CorpusSettings


@dataclass
class RunHooks:
    """Callbacks on the loop's events, run on the event loop (keep them quick)."""

    on_start: Callable[["RunState"], None] | None = None  # the workers are about to send (processes: all ready)
    on_stored: Callable[["RunState", int, dict], None] | None = None  # a manifest line is on disk
    on_failed: Callable[["RunState", int, dict], None] | None = None  # a failed.jsonl line is on disk
    on_end: Callable[["RunState"], None] | None = None  # every worker has returned


@dataclass
class RunState:
    """What the workers share: the corpus side, the books, the queue and the stop flags."""

    client: HsxClient
    fmt: Any
    ctx: Any
    out: Path
    settings: CorpusSettings
    served_layers: list[int]
    keys: list[str]
    by_key: dict[str, Any]
    manifest: journal.JsonlLog
    failed_log: journal.JsonlLog
    done: dict[int, dict[str, Any]]
    failed: dict[int, dict[str, Any]]
    progress: Progress
    queue: deque[int] = field(default_factory=deque)
    stopping: bool = False
    stop_reason: str | None = None
    fatal: BaseException | None = None
    consecutive_5xx: int = 0
    http_only: set[int] = field(default_factory=set)  # samples whose lease expired: asked again over HTTP
    store_s: float = 0.0  # summed over samples: decode, encode, write, fsync (bench's profile)
    life_s: float = 0.0  # summed over answered samples: taken off the queue -> stored (bench's profile)
    worker_stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # --workers: their clients' stats, summed
    max_buffer_bytes: int | None = None  # this loop's memory budget (None: byte_budget's default)
    stream_redos: dict[int, int] = field(default_factory=dict)  # streams cut mid-body, per sample

    def request_body(self, index: int) -> dict[str, Any]:
        sample = self.by_key[self.keys[index]]
        body = dict(sample.request)
        s = self.settings
        if s.layers != self.served_layers:
            body.setdefault("layers", s.layers)
        if s.max_length:
            body.setdefault("max_length", s.max_length)
            body.setdefault("truncation", s.truncation)
        body.setdefault("id", sample.key)
        body.setdefault("require_supervised", True)  # refused before the prefill (dropped)
        return body


def default_write_workers() -> int:
    """Store threads of one loop: decode, hash and fsync release the GIL."""
    return max(4, min(16, usable_cores() * 2))


class StopSignals:
    """SIGINT/SIGTERM on the event loop: the first calls `request_stop("interrupted")`
    (stores in progress finish), the second exits at once (the state stays resumable)."""

    def __init__(self, request_stop: Callable[[str], None]) -> None:
        self._request_stop = request_stop
        self._count = 0
        self._installed: list[signal.Signals] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig.name)
                self._installed.append(sig)
            except (NotImplementedError, RuntimeError):
                pass

    def remove(self) -> None:
        for sig in self._installed:
            assert self._loop is not None
            self._loop.remove_signal_handler(sig)
        self._installed = []

    def _on_signal(self, signame: str) -> None:
        self._count += 1
        if self._count > 1:
            print(f"\nhsx extract: second {signame}, exiting now (state stays resumable)", file=sys.stderr)
            os._exit(ExitCode.INTERRUPTED)
        print(
            f"\nhsx extract: {signame}: finishing stores in progress, then exiting (again to exit at once)",
            file=sys.stderr,
        )
        self._request_stop("interrupted")

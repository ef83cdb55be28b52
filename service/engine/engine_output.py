"""The engine's own exception line, for hsx's last line when the engine fails to start.

vLLM's engine core and its workers are child processes. When one dies at start (or at
the start-up self-test's first prefill), its exception is logged in its own output (vLLM
logs to stdout, Python prints to stderr) and the front end learns only "Engine core
initialization failed. See root cause above." `ChildOutput` gives the children pipes as
their stdout and stderr while vLLM spawns them (they keep them for their life; hsx's own
are restored at once), copies everything through unchanged, and remembers the exception
lines that end the tracebacks in it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("hsx.engine")

# vLLM prefixes its children's lines with "(EngineCore pid=123) ", "(Worker pid=...) " etc.,
# and a traceback it logs with "ERROR 12-03 08:32:22 [core.py:1510] " too.
_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)*\([^()]*pid=\d+\)(?:\x1b\[[0-9;]*m)*\s?")
_LOGGED = re.compile(r"^(?:\x1b\[[0-9;]*m)*[A-Z]+(?:\x1b\[[0-9;]*m)* \d\d-\d\d [\d:.]+ \[[^\]]*\] ")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_][\w.]*?)?(?:Error|Exception|Exit|Failure)(?::\s.*)?)\s*$")
# Wrappers that point back at the cause instead of naming it.
_POINTERS = ("see root cause above", "see stack trace for root cause")
MAX_KEPT = 16  # exception lines remembered


class ExceptionLines:
    """Fed line by line: keeps the lines that end a traceback (`ValueError: ...`), prefixes
    off, in order. Tracked per process tag, as the children's lines interleave."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self._open: set[str] = set()  # tags of processes inside a traceback

    def feed(self, raw: str) -> str | None:
        """Returns the line when it ends a traceback."""
        m = _PREFIX.match(raw)
        tag = m.group(0) if m else ""
        line = raw[m.end():].rstrip() if m else raw.rstrip()
        line = _LOGGED.sub("", line, count=1)
        if line.startswith("Traceback (most recent call last):"):
            self._open.add(tag)
        elif tag in self._open and line and not line[0].isspace():  # frames are indented
            exc = _EXCEPTION.match(line)
            if exc:
                self.found.append(exc.group(1))
                self._open.discard(tag)
                return exc.group(1)
        return None


def exception_lines(text: str) -> list[str]:
    scan = ExceptionLines()
    for line in text.splitlines():
        scan.feed(line)
    return scan.found


def root_cause(lines: list[str]) -> str | None:
    """The first exception line that names a cause (a traceback prints its root cause first)."""
    for line in lines:
        if not any(p in line.lower() for p in _POINTERS):
            return line
    return None


class ChildOutput:
    """Tees stdout and stderr of the processes spawned inside `inherited()`."""

    def __init__(self) -> None:
        self._found: list[tuple[float, str]] = []  # (when, exception line), from both streams
        self._last_read = 0.0
        self._threads: list[threading.Thread] = []

    @contextmanager
    def inherited(self) -> Iterator[None]:
        """Processes spawned in this block write their stdout and stderr through the tee."""
        swapped: list[tuple[int, int, int]] = []  # (fd, saved copy, pipe's write end)
        try:
            for fd in (1, 2):
                read_fd, write_fd = os.pipe()
                saved = os.dup(fd)
                thread = threading.Thread(target=self._copy, args=(read_fd, saved), daemon=True,
                                          name=f"hsx-engine-output-{fd}")
                thread.start()
                self._threads.append(thread)
                os.dup2(write_fd, fd)
                swapped.append((fd, saved, write_fd))
        except OSError as exc:  # no capture: the start-up errors lose only their cause
            log.debug("cannot tee the engine's output: %s", exc)
        try:
            yield
        finally:
            for fd, saved, write_fd in swapped:  # the children keep the pipes; hsx writes directly again
                os.dup2(saved, fd)
                os.close(write_fd)

    def _copy(self, read_fd: int, out_fd: int) -> None:
        lines = ExceptionLines()
        pending = ""
        while True:
            try:
                chunk = os.read(read_fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self._last_read = time.monotonic()
            view = memoryview(chunk)
            try:
                while view:  # a blocking write can still be cut short by a signal
                    view = view[os.write(out_fd, view):]
            except OSError:
                pass
            if len(self._found) >= MAX_KEPT:
                continue
            *complete, pending = (pending + chunk.decode(errors="replace")).split("\n")
            for line in complete:
                found = lines.feed(line)
                if found:
                    self._found.append((time.monotonic(), found))
            pending = pending[-10_000:]
        os.close(read_fd)
        os.close(out_fd)

    def cause(self, settle: float = 0.3, timeout: float = 3.0) -> str | None:
        """The children's root exception line, once their last output has been read
        (a child that died has written its traceback before its parent noticed)."""
        deadline = time.monotonic() + timeout
        while self._threads and time.monotonic() < deadline:
            if time.monotonic() - self._last_read >= settle:
                break
            time.sleep(0.05)
        return root_cause([line for _, line in sorted(self._found)])

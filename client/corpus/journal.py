"""The corpus directory's records of a run: the one writer's lock (DirLock on DIR/.lock) and
the JSONL logs (manifest.jsonl, failed.jsonl: append, fsync, a torn last line cut off on
reopening; the last line of an index wins). The files they name are hsx_client.corpus.store's."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterable

from hsx_client.corpus.store import LOCK_NAME, LockedError, StoreError, fsync_dir


class DirLock:
    """Exclusive, non-blocking `flock` on DIR/.lock, held until `release()`.

    The kernel drops it when the process dies, so a kill -9 never leaves a stale lock.
    """

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, what: str = "hsx extract") -> "DirLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # read-only mount, permissions, a file in the way
            raise StoreError(f"cannot write to {self.path.parent}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            raise LockedError(
                f"{self.path.parent} is in use by another writer ({holder or 'unknown process'}); "
                "wait for it to finish or stop it, one writer per output dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{what} pid={os.getpid()} host={os.uname().nodename}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "DirLock":
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc: Any) -> None:
        self.release()


# ---------------------------------------------------------------- JSONL logs
def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int, int]:
    """(entries, byte length of the complete prefix, number of bad lines skipped).

    The prefix stops before a torn last line (no trailing newline, or not JSON): that
    line is what a crash in the middle of an append leaves; it does not count."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return [], 0, 0
    entries: list[dict[str, Any]] = []
    good = 0
    bad = 0
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:  # torn tail
            bad += 1
            break
        line = data[pos:nl]
        pos = nl + 1
        if not line.strip():
            good = pos
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            bad += 1
            if pos >= len(data):  # last line garbage: cut it
                break
            good = pos  # a bad line in the middle: skip it, keep going
            continue
        if isinstance(obj, dict):
            entries.append(obj)
        good = pos
    return entries, good, bad


class JsonlLog:
    """Append-only, fsync'ed JSONL file with group commit (thread-safe).

    Opening cuts a torn last line so new lines never glue onto a fragment."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.entries, good, self.bad_lines = read_jsonl(self.path)
        if self.path.exists() and self.path.stat().st_size != good:
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        self._f = open(self.path, "ab", buffering=0)
        fsync_dir(self.path.parent)
        self._io = threading.Lock()
        self._mu = threading.Lock()
        self._pending: list[bytes] = []
        self._assigned = 0
        self._committed = 0

    def append(self, entry: dict[str, Any]) -> None:
        """Append one line; returns once it (and any batched with it) is on disk."""
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        with self._mu:
            self._pending.append(line)
            self._assigned += 1
            mine = self._assigned
        with self._io:
            with self._mu:
                if self._committed >= mine:
                    return
                batch, self._pending = self._pending, []
                last = self._assigned
            data = b"".join(batch)
            view = memoryview(data)
            while view:
                n = self._f.write(view)
                view = view[n:]
            os.fsync(self._f.fileno())
            with self._mu:
                self._committed = last

    def extend(self, entries: Iterable[dict[str, Any]]) -> None:
        """Append several lines with one write and one fsync; a crash keeps a prefix of them."""
        data = memoryview(b"".join((json.dumps(e, separators=(",", ":")) + "\n").encode() for e in entries))
        with self._io:
            while data:
                data = data[self._f.write(data):]
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "JsonlLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def latest_by_index(entries: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The last manifest line of each index wins (a redo or an invalidation overrides)."""
    out: dict[int, dict[str, Any]] = {}
    for e in entries:
        if "index" in e:
            out[int(e["index"])] = e
    return {i: e for i, e in out.items() if not e.get("invalid")}
